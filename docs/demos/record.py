"""Record what every demo prints, and the figures it draws, for the demo pages of the documentation.

Run from the repository root, with jaxbind installed (``pip install '.[test]'`` or ``'.[demos]'``; demo 7
also needs gfortran)::

    python docs/demos/record.py            # every demo
    python docs/demos/record.py 05 09      # only the demos whose file names start so

Each demo runs as CI runs it, ``python demos/NN_name.py`` from the repository root, in a fresh process.
Its standard output goes to ``docs/demos/output/NN_name.txt`` (with the repository's path removed from
the paths it prints); the figures it writes
(``demos/out/*.png``) are copied to ``docs/_static/figures/demos/``. A demo that fails (non-zero exit
status) is reported and makes this script exit non-zero; its output is recorded all the same, so
that the failure can be read.
"""

from __future__ import annotations

import glob
import os
import shutil
import subprocess
import sys
import time

HERE = os.path.dirname(os.path.abspath(__file__))
ROOT = os.path.dirname(os.path.dirname(HERE))
OUTPUT = os.path.join(HERE, "output")
FIGURES = os.path.join(ROOT, "docs", "_static", "figures", "demos")


def demos(prefixes):
    found = sorted(glob.glob(os.path.join(ROOT, "demos", "[0-9][0-9]_*.py")))
    if prefixes:
        found = [p for p in found if any(os.path.basename(p).startswith(x) for x in prefixes)]
    return found


def record(path) -> bool:
    name = os.path.splitext(os.path.basename(path))[0]
    started = time.perf_counter()
    # From the repository root, as CI runs the demos: the script's own folder (demos/) is on
    # sys.path, the root is not, so `import jaxbind` finds the installed package.
    result = subprocess.run([sys.executable, os.path.relpath(path, ROOT)], cwd=ROOT, capture_output=True, text=True)
    seconds = time.perf_counter() - started
    # Paths a demo prints are shown relative to the repository root: the recorded text must
    # not depend on where the repository sits on the machine that recorded it.
    stdout = result.stdout.replace(ROOT + os.sep, "")
    with open(os.path.join(OUTPUT, name + ".txt"), "w", encoding="utf-8") as file:
        file.write(stdout)
    status = "ok" if result.returncode == 0 else f"FAILED (exit status {result.returncode})"
    print(f"{name}: {status}, {seconds:.1f} s, {len(result.stdout.splitlines())} lines")
    if result.returncode != 0:
        sys.stderr.write(result.stderr[-4000:])
    return result.returncode == 0


def copy_figures():
    os.makedirs(FIGURES, exist_ok=True)
    for figure in sorted(glob.glob(os.path.join(ROOT, "demos", "out", "*.png"))):
        shutil.copy2(figure, FIGURES)
        print(f"figure: {os.path.relpath(figure, ROOT)} -> {os.path.relpath(FIGURES, ROOT)}/")


def main(argv):
    os.makedirs(OUTPUT, exist_ok=True)
    paths = demos(argv)
    if not paths:
        sys.exit(f"no demo matches {argv}")
    ok = [record(path) for path in paths]
    copy_figures()
    if not all(ok):
        sys.exit(f"{ok.count(False)} demo(s) failed")


if __name__ == "__main__":
    main(sys.argv[1:])
