#!/usr/bin/env bash
# CI lane: the aarch64 release wheel, run under emulation (qemu-user) in an arm64 Debian 13 root.
#
#   bash .ci/aarch64.sh [WHEEL]
#
# The wheel: the argument, else $JAXBIND_AARCH64_WHEEL, else the one the wheel lane's
# tools/build_release.sh left in dist/ (jaxbind_ffi-*_aarch64.whl), else tools/build_release.sh is run.
# Needs root (binfmt_misc, chroot, mount); installs Debian's qemu-user-static and binfmt-support when
# missing. The root is made without debootstrap (its second stage takes about an hour under emulation):
# Debian 13's arm64 packages Python 3.13, GCC and gfortran need, with their dependencies, are downloaded
# (tools/debian_debs.sh) and unpacked with dpkg-deb -x; no maintainer script runs. The host's pip
# unpacks the wheel, the newest jax and jaxlib with cp313 aarch64 wheels and the test extra into the
# root's site folder (no pip, no ensurepip under emulation), and the host's CPython 3.13, when there is
# one, compiles the standard library's and the site's bytecode, which the emulated Python would
# otherwise compile at every first import.
#
# Then, under emulation: the README's example with its numbers checked, and the tests .ci/aarch64-subset.txt
# names (a subset: emulation is ~100x slower, the whole suite would take a day; the file says what it
# covers). JAXBIND_AARCH64_TESTS="tests/api/test_kwargs.py tests/native" runs another selection (node
# ids or paths, as pytest takes them), JAXBIND_AARCH64_LIST=FILE the node ids a file lists (one test of
# every file: .ci/aarch64-every-file.txt). JAXBIND_CI_KEEP_CHROOT=1 reuses a root made before (for tries by
# hand); JAXBIND_AARCH64_ROOT picks its folder.
set -euo pipefail
cd "$(dirname "$0")/.."
repo=$PWD
started=$SECONDS
step() { echo "== aarch64 lane, $((SECONDS - started)) s: $*"; }
root=${JAXBIND_AARCH64_ROOT:-/var/tmp/jaxbind-ci-arm64}
site=$root/usr/local/lib/python3.13/dist-packages
if [ "$(id -u)" != 0 ]; then
  echo "aarch64 lane: needs root (binfmt_misc, chroot and mount); run it as root, as CI does" >&2
  exit 1
fi

wheel=${1:-${JAXBIND_AARCH64_WHEEL:-}}
if [ -z "$wheel" ]; then
  wheel=$(ls dist/jaxbind_ffi-*_aarch64.whl 2>/dev/null | tail -1 || true)
  if [ -z "$wheel" ]; then
    step "build the wheels (tools/build_release.sh)"
    bash tools/build_release.sh
    wheel=$(ls dist/jaxbind_ffi-*_aarch64.whl)
  fi
fi
wheel=$(cd "$(dirname "$wheel")" && pwd)/$(basename "$wheel")
echo "aarch64 lane: $wheel"

step "qemu-user and binfmt_misc"
if ! command -v update-binfmts >/dev/null || [ ! -e /usr/share/binfmts/qemu-aarch64 ]; then
  apt-get update && apt-get install -y qemu-user-static binfmt-support
fi
mountpoint -q /proc/sys/fs/binfmt_misc || mount -t binfmt_misc binfmt_misc /proc/sys/fs/binfmt_misc
[ -e /proc/sys/fs/binfmt_misc/qemu-aarch64 ] || update-binfmts --import qemu-aarch64 || true
update-binfmts --enable qemu-aarch64 || true
grep -q '^enabled' /proc/sys/fs/binfmt_misc/qemu-aarch64

unmount() {
  for m in dev sys proc; do
    if mountpoint -q "$root/$m"; then umount -R "$root/$m" || umount -lR "$root/$m"; fi
  done
}
trap unmount EXIT
trap 'unmount; exit 143' TERM INT
unmount

# The host's CPython 3.13 (pyenv's, or PATH's) writes bytecode the emulated 3.13 reads.
python313=$(ls -d "$(pyenv root 2>/dev/null || echo /root/.pyenv)"/versions/3.13.*/bin/python3.13 2>/dev/null | sort -V | tail -1 || true)
python313=${python313:-$(command -v python3.13 || true)}

if [ "${JAXBIND_CI_KEEP_CHROOT:-0}" = 1 ] && [ -e "$root/.made" ]; then
  step "the arm64 root made before ($root)"
else
  step "the arm64 Debian 13 root, unpacked ($root)"
  rm -rf "$root"
  mkdir -p "$root"/usr/{bin,sbin,lib} "$root"/{proc,sys,dev,root,etc} "$root/tmp"
  for d in bin sbin lib; do ln -s "usr/$d" "$root/$d"; done
  chmod 1777 "$root/tmp"
  # Python 3.13 (the interpreter and its standard library's native modules), GCC for the tests' C
  # kernels (tests/_kernels.py runs `cc`) and gfortran for the Fortran ones, a shell for subprocesses.
  debs=${root}-debs
  bash tools/debian_debs.sh arm64 trixie "$debs" --with-deps \
    python3.13 libpython3.13 gcc gfortran libc6-dev libstdc++6 dash bash coreutils
  for deb in "$debs"/debs/*.deb; do dpkg-deb -x "$deb" "$root"; done
  # What the packages' maintainer scripts and alternatives would have made.
  ln -sf gcc "$root/usr/bin/cc"
  ln -sf python3.13 "$root/usr/bin/python3"
  ln -sf dash "$root/usr/bin/sh"
  echo "root:x:0:0:root:/root:/bin/sh" >"$root/etc/passwd"
  echo "root:x:0:" >"$root/etc/group"
  if [ -n "$python313" ]; then
    "$python313" -m compileall -q -j0 -s "$root" -p / "$root/usr/lib/python3.13" >/dev/null || true
  fi
  touch "$root/.made"
fi
# gloo (the two-process test) resolves this host's name.
printf '127.0.0.1 localhost %s\n::1 localhost\n' "$(hostname)" >"$root/etc/hosts"

step "the wheel, the newest jax and jaxlib and the test extra, unpacked by the host's pip"
platforms=()
for glibc in 17 26 27 28 31 34 35 36 38 39 41; do platforms+=(--platform "manylinux_2_${glibc}_aarch64"); done
platforms+=(--platform manylinux2014_aarch64 --platform linux_aarch64)
rm -rf "$site"
pip_python=${python313:-python3}
"$pip_python" -m pip install --quiet --disable-pip-version-check --root-user-action=ignore --target "$site" "${platforms[@]}" \
  --only-binary=:all: --python-version 3.13 --implementation cp --abi cp313 "$wheel[test]"

# The tests and what they read besides the package, as the wheel lane copies them, and the release
# check (tests/api/test_release_check.py reads the installed extension with it).
rm -rf "$root/opt/jaxbind-tests" && mkdir -p "$root/opt/jaxbind-tests/docs" "$root/opt/jaxbind-tests/tools"
cp -r tests pyproject.toml "$root/opt/jaxbind-tests/"
cp tools/check_release.py "$root/opt/jaxbind-tests/tools/"
cp -r docs/guides docs/examples "$root/opt/jaxbind-tests/docs/"
# The README's example, as it stands, with its numbers checked.
python3 - "$root/opt/jaxbind-tests/readme_example.py" <<'EOF'
import re, sys
block = re.search(r"## Example\n\n```python\n(.*?)```", open("README.md").read(), re.S)[1]
checks = '''
import sys, jaxbind, jaxlib, platform
assert platform.machine() == "aarch64", platform.machine()
assert jaxbind.__file__.startswith("/usr/local/lib/python3.13/dist-packages/"), jaxbind.__file__
np.testing.assert_allclose(y, [0.0, 2.0, 4.0])
np.testing.assert_allclose(g, 8.0 * np.arange(3.0))
np.testing.assert_allclose(b, np.full((4, 3), 3.0))
np.testing.assert_allclose(s, np.sin(np.full((4, 3), 3.0)), rtol=1e-6)
print("README example on", platform.machine(), "Python", sys.version.split()[0], "jax", jax.__version__,
      "jaxlib", jaxlib.__version__, ": y", y, "g", g, "s[0]", s[0])
'''
open(sys.argv[1], "w").write(block + checks)
EOF

mount -t proc proc "$root/proc"
mount --rbind /sys "$root/sys"
mount --rbind /dev "$root/dev"
in_root() {
  chroot "$root" /usr/bin/env -i PATH=/usr/local/bin:/usr/bin:/bin HOME=/root LANG=C.UTF-8 \
    TMPDIR=/tmp JAXBIND_PROPERTY_EXAMPLES="${JAXBIND_PROPERTY_EXAMPLES:-3}" \
    /bin/sh -c 'cd /opt/jaxbind-tests && exec "$@"' sh "$@"
}

step "the README's example, emulated"
in_root python3 readme_example.py

if [ -n "${JAXBIND_AARCH64_TESTS:-}" ]; then
  read -r -a selection <<<"$JAXBIND_AARCH64_TESTS"
else
  mapfile -t selection < <(grep -v '^\s*\(#\|$\)' "${JAXBIND_AARCH64_LIST:-$repo/.ci/aarch64-subset.txt}")
fi
step "pytest, emulated: ${#selection[@]} selections"
in_root python3 -m pytest -q -p no:cacheprovider "${selection[@]}"
step "done"
