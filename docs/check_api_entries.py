"""Every public name has an entry in the built API reference.

Run after the HTML build:  python docs/check_api_entries.py docs/_build/html
(CI does.) Exits non-zero naming each public name of ``jaxbind``, ``jaxbind.testing`` and
``jaxbind.contrib.jaxducc0`` whose anchor is missing from the API pages.
"""

import importlib
import os
import sys

MODULES = {"jaxbind": "jaxbind.html", "jaxbind.testing": "testing.html", "jaxbind.contrib.jaxducc0": "jaxducc0.html"}


def missing_entries(html_dir):
    missing = []
    for module_name, page in MODULES.items():
        module = importlib.import_module(module_name)
        with open(os.path.join(html_dir, "api", page), encoding="utf-8") as f:
            html = f.read()
        for name in module.__all__:
            if name == "testing" and module_name == "jaxbind":
                continue  # a module of its own, with its own page
            if f'id="{module_name}.{name}"' not in html:
                missing.append(f"{module_name}.{name}")
    return missing


if __name__ == "__main__":
    html_dir = sys.argv[1] if len(sys.argv) > 1 else os.path.join(os.path.dirname(__file__), "_build", "html")
    missing = missing_entries(html_dir)
    if missing:
        sys.exit("public names without an API entry: " + ", ".join(missing))
    print(f"every public name has an API entry ({', '.join(MODULES)})")
