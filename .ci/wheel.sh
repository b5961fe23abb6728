#!/usr/bin/env bash
# CI lane: the release wheel on the oldest supported Python and JAX. tools/build_release.sh builds the
# sdist and the manylinux wheel (from the sdist) for the oldest Python requires-python admits (this
# machine image's pyenv has it); the lane checks the wheel's manylinux tag (glibc 2.27, jaxlib's own
# floor, or older), the license file in the sdist and the wheel and the metadata, then installs the
# wheel into a fresh venv with jax and jaxlib pinned to the oldest release pyproject.toml admits, and the
# tests run from a copy outside the source tree, so what they import is the installed wheel. Arguments
# are passed to pytest.
set -euo pipefail
cd "$(dirname "$0")/.."
repo=$PWD

read -r oldest oldest_python < <(python3 -c "
import re, tomllib
project = tomllib.load(open('pyproject.toml', 'rb'))['project']
jax = next(re.fullmatch(r'jax>=([0-9.]+)', d).group(1) for d in project['dependencies'] if d.startswith('jax>='))
print(jax, re.fullmatch(r'>=([0-9]+\.[0-9]+)', project['requires-python']).group(1))")
python=$(ls -d "$(pyenv root 2>/dev/null || echo /root/.pyenv)"/versions/"$oldest_python".*/bin/python"$oldest_python" 2>/dev/null | sort -V | tail -1 || true)
if [ -z "$python" ]; then
  echo "wheel lane: no Python $oldest_python (requires-python's oldest) in pyenv's versions" >&2
  exit 1
fi

PYTHON=$python bash tools/build_release.sh
python3 tools/check_release.py dist
touch "$repo/.ci-release-built"  # (lane 8, in another stream, waits for the aarch64 wheel)

venv=$repo/.ci-wheel-venv
rm -rf "$venv"
"$python" -m venv "$venv"
# shellcheck disable=SC1091
source "$venv/bin/activate"
python -m pip install --quiet --upgrade pip
wheel=$(ls dist/jaxbind_ffi-*-manylinux*_"$(uname -m)".whl)  # (dist/ also holds the aarch64 wheel: .ci/aarch64.sh)
pip install "$wheel[test]" "jax==$oldest" "jaxlib==$oldest"

# The tests and what they read besides the package (pyproject.toml's pytest settings, the guides a test
# compares with, the example kernels a test compiles), copied where no jaxbind/ source folder is.
copy=$(mktemp -d)
trap 'rm -rf "$copy"' EXIT
cp -r tests pyproject.toml "$copy/"
mkdir "$copy/docs" && cp -r docs/guides docs/examples "$copy/docs/"
cd "$copy"
python - "$venv" "$oldest" "$oldest_python" <<'EOF'
import sys, jax, jaxlib, jaxbind
venv, oldest, oldest_python = sys.argv[1:]
assert "%d.%d" % sys.version_info[:2] == oldest_python, (sys.version, oldest_python)
assert jaxbind.__file__.startswith(venv), f"jaxbind imported from {jaxbind.__file__}, not the wheel in {venv}"
assert jax.__version__ == jaxlib.__version__ == oldest, (jax.__version__, jaxlib.__version__)
print("wheel lane:", jaxbind.__file__, "Python", sys.version.split()[0], "jax", jax.__version__)
EOF
pytest -q "$@"
