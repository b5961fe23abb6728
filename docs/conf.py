"""Sphinx configuration of jaxbind's documentation site.

Build:  pip install '.[docs]' && sphinx-build -W -b html docs docs/_build/html
Run every example in it:  sphinx-build -W -b doctest docs docs/_build/doctest
Run each page's examples as one script in an empty folder:  python docs/check_pages.py
"""

import os
import shutil
import sys
import tempfile

project = "jaxbind"
author = "the jaxbind developers"
copyright = "2026, the jaxbind developers"

extensions = ["myst_parser", "sphinx.ext.autodoc", "sphinx.ext.napoleon", "sphinx.ext.doctest"]

# Markdown pages (MyST); code examples are ```{testcode}``` blocks, run by the doctest builder.
source_suffix = {".md": "markdown", ".rst": "restructuredtext"}
myst_enable_extensions = ["colon_fence", "deflist"]
myst_heading_anchors = 3
exclude_patterns = ["_build", "Thumbs.db", ".DS_Store"]

# The API reference: NumPy-style docstrings of the installed package (never the source folder:
# the compiled core lives only in the installed one).
_ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
sys.path = [p for p in sys.path if os.path.abspath(p or ".") != _ROOT]
autodoc_member_order = "bysource"
autodoc_typehints = "description"
autodoc_default_options = {"members": True, "show-inheritance": False}
napoleon_google_docstring = False
napoleon_numpy_docstring = True
napoleon_use_rtype = False
napoleon_use_ivar = True  # attributes of an instance's class stay under it (jaxbind.config)

# Nothing is predefined: each page's first example block shows its imports. Each page runs as a
# reader runs it, in a fresh empty folder holding the files the page links with {download}, under
# their own names (docs/check_pages.py runs each page as one script the same way).
doctest_test_doctest_blocks = ""  # only the explicit testcode/doctest directives run

html_theme = "furo"
html_title = "jaxbind"
html_static_path = ["_static"]
html_css_files = ["wide.css"]


def setup(app):
    from sphinx.ext.doctest import DocTestBuilder

    class PageFolderDocTestBuilder(DocTestBuilder):
        """The doctest builder, running each page in an empty folder with its downloads beside it."""

        def test_doc(self, docname, doctree):
            folder, here = tempfile.mkdtemp(prefix="jaxbind-doctest-"), os.getcwd()
            try:
                for path, (docnames, _) in self.env.dlfiles.items():
                    if docname in docnames:
                        shutil.copy(os.path.join(self.env.srcdir, path), folder)
                os.chdir(folder)
                return super().test_doc(docname, doctree)
            finally:
                os.chdir(here)
                shutil.rmtree(folder, ignore_errors=True)

    app.add_builder(PageFolderDocTestBuilder, override=True)
