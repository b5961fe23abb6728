#!/usr/bin/env bash
# CI lane: the whole suite on Python 3.14 with the newest jax and jaxlib that publish cp314 wheels (0.12
# when written), as a user of a new distribution gets them: Debian sid's python3.14 in a chroot of its
# own (debootstrap --variant=minbase sid, everything the build needs from debootstrap's --include: no
# apt inside), a fresh clone of this repository inside it, the package built and installed there with
# the README's install command (for 3.14, pyproject.toml's build requirements take the newest jaxlib's
# headers: no older jaxlib has cp314 wheels), then the README's test command. The host's pip downloads
# every cp314 wheel (numba, ducc0 and SciPy publish them, so the test extra is whole and nothing skips
# for a missing package); pip inside installs offline (.ci/_chroot.sh). The chroot's root is its own
# (/var/tmp/jaxbind-ci-sid, or JAXBIND_CI_SID_CHROOT), apart from the trixie lanes' chroot, so that it
# can run beside lane 3. Needs root. Arguments are passed to pytest (by hand: a file or -k).
set -euo pipefail
lane=py314
chroot_suite=sid
chroot_packages=python3.14,python3.14-venv,python3.14-dev,g++,make,cmake,ninja-build,gfortran,git,ca-certificates
chroot_root=${JAXBIND_CI_SID_CHROOT:-/var/tmp/jaxbind-ci-sid}
# shellcheck source=.ci/_chroot.sh
source "$(dirname "$0")/_chroot.sh"

chroot_make
chroot "$root" python3.14 --version
step "the wheelhouse"
mapfile -t test_reqs < <(test_requirements)
wheelhouse_download "python3 -m pip" 3.14 cp314 abi3 none -- jax jaxlib numpy "${test_reqs[@]}"
mapfile -t build_reqs < <(build_requirements 3.14)
wheelhouse_download "python3 -m pip" 3.14 cp314 abi3 none -- pip "${build_reqs[@]}"
ls "$wheels" | grep -E '^(jax|jaxlib|numpy|scipy|numba|ducc0)-'

step "install"
chroot_run '
  python3.14 -m venv .venv
  . .venv/bin/activate
  python -m pip install --quiet --upgrade pip
  # The README'"'"'s install command:
  pip install ".[test]"
  (cd / && python -c "import sys, jax, jaxlib, numpy, jaxbind
print(sys.version.split()[0], \"jax\", jax.__version__, \"jaxlib\", jaxlib.__version__, \"numpy\", numpy.__version__)")
'
step "test"
# The README's test command, by the venv's pytest, in /src.
chroot_run ". .venv/bin/activate && pytest -q $(printf '%q ' "$@")"
step "done"
