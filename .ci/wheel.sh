#!/usr/bin/env bash
# CI lane: the release wheel on the oldest supported JAX. tools/build_release.sh builds the sdist and
# the manylinux wheel (from the sdist); the wheel goes into a fresh venv with jax and jaxlib pinned to the
# oldest release pyproject.toml admits, and the tests run from a copy outside the source tree, so what
# they import is the installed wheel. Arguments are passed to pytest.
set -euo pipefail
cd "$(dirname "$0")/.."
repo=$PWD

bash tools/build_release.sh
oldest=$(python3 -c "import re, tomllib; deps = tomllib.load(open('pyproject.toml', 'rb'))['project']['dependencies']; print(next(re.fullmatch(r'jax>=([0-9.]+)', d).group(1) for d in deps if d.startswith('jax>=')))")

venv=$repo/.ci-wheel-venv
rm -rf "$venv"
python3 -m venv "$venv"
# shellcheck disable=SC1091
source "$venv/bin/activate"
python -m pip install --quiet --upgrade pip
wheel=$(ls dist/jaxbind_ffi-*-manylinux*.whl)
pip install "$wheel[test]" "jax==$oldest" "jaxlib==$oldest"

# The tests and what they read besides the package (pyproject.toml's pytest settings, the guides a test
# compares with), copied where no jaxbind/ source folder is.
copy=$(mktemp -d)
trap 'rm -rf "$copy"' EXIT
cp -r tests pyproject.toml "$copy/"
mkdir "$copy/docs" && cp -r docs/guides "$copy/docs/"
cd "$copy"
python - "$venv" "$oldest" <<'EOF'
import sys, jax, jaxlib, jaxbind
venv, oldest = sys.argv[1:]
assert jaxbind.__file__.startswith(venv), f"jaxbind imported from {jaxbind.__file__}, not the wheel in {venv}"
assert jax.__version__ == jaxlib.__version__ == oldest, (jax.__version__, jaxlib.__version__)
print("wheel lane:", jaxbind.__file__, "jax", jax.__version__)
EOF
pytest -q "$@"
