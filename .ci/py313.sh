#!/usr/bin/env bash
# CI lane: the suite on the newest Python and JAX, as a user on Debian 13 gets them. Debian 13's
# Python 3.13 in a debootstrap chroot (.ci-chroot/), a fresh clone of this repository inside it, the
# package built and installed there with the README's install command, then the README's test command.
#
# Python 3.13 inside rejects this network's TLS chain, so the host's pip downloads every cp313 wheel
# the install needs (the newest jax and jaxlib; the oldest supported jaxlib's headers for the build) into
# a wheelhouse, and pip inside installs from it offline (PIP_NO_INDEX, PIP_FIND_LINKS).
# Needs root (debootstrap, chroot, mount) and Debian's debootstrap package (installed when missing).
set -euo pipefail
cd "$(dirname "$0")/.."
repo=$PWD
root=${JAXBIND_CI_CHROOT:-/var/tmp/jaxbind-ci-py313}  # outside the repository: no tool walks into it
wheels=$root/wheelhouse

command -v debootstrap >/dev/null || { apt-get update && apt-get install -y debootstrap; }
if [ "$(id -u)" != 0 ]; then
  echo "py313.sh: needs root (debootstrap, chroot and mount); run it as root, as CI does" >&2
  exit 1
fi

unmount() {
  for m in dev proc sys; do
    if mountpoint -q "$root/$m"; then umount -R "$root/$m" || umount -lR "$root/$m"; fi
  done
}
trap unmount EXIT
trap 'unmount; exit 143' TERM INT
unmount
step() { echo "== py313 lane, ${SECONDS} s: $*"; }

# Debian 13 with its Python and the build tools (CMake, g++, gfortran for the Fortran tests, git).
# JAXBIND_CI_KEEP_CHROOT=1 reuses a chroot made before (by hand, between tries); CI always makes it anew.
if [ "${JAXBIND_CI_KEEP_CHROOT:-0}" = 1 ] && [ -x "$root/usr/bin/python3" ]; then
  rm -rf "$root/src" "$wheels"
else
  rm -rf --one-file-system "$root"
  step "debootstrap Debian 13"
  debootstrap --variant=minbase \
    --include=python3,python3-venv,python3-dev,g++,make,cmake,ninja-build,gfortran,git,ca-certificates \
    trixie "$root" http://deb.debian.org/debian
fi
chroot "$root" python3 --version
step "the wheelhouse"

# The wheelhouse: cp313 wheels for the manylinux glibc versions Debian 13 runs (2.17 to its 2.41).
platforms=()
for minor in $(seq 17 41); do platforms+=(--platform "manylinux_2_${minor}_x86_64"); done
platforms+=(--platform manylinux2014_x86_64 --platform manylinux2010_x86_64 --platform manylinux1_x86_64)
download() {
  python3 -m pip download --quiet --dest "$wheels" --only-binary=:all: --python-version 3.13 \
    --implementation cp --abi cp313 --abi abi3 --abi none "${platforms[@]}" "$@"
}
# What `pip install '.[test]'` installs (the test extra's list is pyproject.toml's) ...
extra=$(python3 -c "import tomllib; print('\n'.join(tomllib.load(open('pyproject.toml', 'rb'))['project']['optional-dependencies']['test']))")
mapfile -t test_requirements <<<"$extra"
download jax jaxlib numpy "${test_requirements[@]}"
# ... and what its build needs (pyproject.toml's build-system table: the oldest jaxlib's headers).
build=$(python3 -c "import tomllib; print('\n'.join(r.split(';')[0] for r in tomllib.load(open('pyproject.toml', 'rb'))['build-system']['requires'] if 'python_version>=' not in r))")
mapfile -t build_requirements <<<"$build"
download pip "${build_requirements[@]}"
ls "$wheels" | grep -E '^(jax|jaxlib)-'

# A fresh clone of what is committed, and a name for this host (gloo, the multi-process tests'
# collectives, resolves it).
step "clone, install and test"
git clone --quiet "$repo" "$root/src"
cp /etc/resolv.conf "$root/etc/resolv.conf" 2>/dev/null || true
printf '127.0.0.1 localhost %s\n::1 localhost\n' "$(hostname)" > "$root/etc/hosts"
hostname > "$root/etc/hostname"

mount -t proc proc "$root/proc"
mount --rbind /sys "$root/sys"
mount --rbind /dev "$root/dev"

chroot "$root" /usr/bin/env -i HOME=/root PATH=/usr/local/bin:/usr/bin:/bin LANG=C.UTF-8 \
  PIP_NO_INDEX=1 PIP_FIND_LINKS=/wheelhouse PIP_DISABLE_PIP_VERSION_CHECK=1 \
  /bin/bash -euo pipefail -c '
    cd /src
    python3 -m venv .venv
    . .venv/bin/activate
    python -m pip install --quiet --upgrade pip
    # The README'"'"'s install and test commands:
    pip install ".[test]"
    (cd / && python -c "import sys, jax, jaxlib, jaxbind; print(sys.version.split()[0], \"jax\", jax.__version__, \"jaxlib\", jaxlib.__version__)")
    pytest -q
  '
step "done"
