#!/usr/bin/env bash
# CI lane: the suite on the newest Python and JAX, as a user on Debian 13 gets them. Debian 13's
# Python 3.13 in a debootstrap chroot, a fresh clone of this repository inside it, the package built and
# installed there with the README's install command, then the README's test command. The chroot, the
# wheelhouse (the host's pip downloads every cp313 wheel the install needs: the newest jax and jaxlib;
# the oldest supported jaxlib's headers for the build) and the offline install: .ci/_chroot.sh.
# Not in .ci/run since issue 36 (the free-threaded lane, .ci/freethreaded.sh, took its place in the
# time budget); run it by hand as root.
set -euo pipefail
lane=py313
# shellcheck source=.ci/_chroot.sh
source "$(dirname "$0")/_chroot.sh"

chroot_make
chroot "$root" python3 --version
step "the wheelhouse"
mapfile -t test_reqs < <(test_requirements)
wheelhouse_download "python3 -m pip" 3.13 cp313 abi3 none -- jax jaxlib numpy "${test_reqs[@]}"
mapfile -t build_reqs < <(build_requirements 3.13)
wheelhouse_download "python3 -m pip" 3.13 cp313 abi3 none -- pip "${build_reqs[@]}"
ls "$wheels" | grep -E '^(jax|jaxlib)-'

step "install and test"
chroot_run '
  python3 -m venv .venv
  . .venv/bin/activate
  python -m pip install --quiet --upgrade pip
  # The README'"'"'s install and test commands:
  pip install ".[test]"
  (cd / && python -c "import sys, jax, jaxlib, jaxbind; print(sys.version.split()[0], \"jax\", jax.__version__, \"jaxlib\", jaxlib.__version__)")
  pytest -q
'
step "done"
