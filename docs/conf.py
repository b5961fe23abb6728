"""Sphinx configuration of jaxbind's documentation site.

Build:  pip install '.[docs]' && sphinx-build -W -b html docs docs/_build/html
Run every example in it:  sphinx-build -W -b doctest docs docs/_build/doctest
"""

import os
import sys

project = "jaxbind"
author = "the jaxbind developers"
copyright = "2026, the jaxbind developers"

extensions = [
    "myst_parser",
    "sphinx.ext.autodoc",
    "sphinx.ext.napoleon",
    "sphinx.ext.doctest",
]

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

# Every page's examples share this set-up (each page is one namespace, run top to bottom).
doctest_global_setup = f"""
DOCS = {os.path.dirname(os.path.abspath(__file__))!r}  # this folder (the examples' files)
import jax
jax.config.update("jax_enable_x64", True)
import jax.numpy as jnp
import numpy as np
import jaxbind
"""
doctest_test_doctest_blocks = ""  # only the explicit testcode/doctest directives run

html_theme = "furo"
html_title = "jaxbind"
html_static_path = ["_static"]
html_css_files = ["wide.css"]
