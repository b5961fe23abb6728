#!/usr/bin/env bash
# Downloads Debian binary packages of another architecture into a folder, with apt-get and a private apt
# state (no root needed, the machine's own apt configuration is untouched; apt checks the archive's
# signature with /usr/share/keyrings/debian-archive-keyring.gpg). Used by tools/build_release.sh (the
# aarch64 wheel's Python headers and libgcc_s) and .ci/aarch64.sh (the arm64 root).
#
#   bash tools/debian_debs.sh ARCH SUITE DEST [--with-deps] PACKAGE...
#
# With --with-deps the packages' dependencies come too, resolved as for an empty system (what an
# unpacked root needs); without, only the packages named. DEST keeps apt's state between runs (apt-get
# update fetches only what changed) and the .deb files in DEST/debs.
set -euo pipefail
arch=$1 suite=$2 dest=$3
shift 3
deps=0
if [ "${1:-}" = --with-deps ]; then deps=1; shift; fi
command -v apt-get >/dev/null || { echo "debian_debs.sh: apt-get is needed (a Debian or Ubuntu machine)" >&2; exit 1; }
mirror=${JAXBIND_DEBIAN_MIRROR:-http://deb.debian.org/debian}
dest=$(mkdir -p "$dest" && cd "$dest" && pwd)
mkdir -p "$dest/etc/apt/sources.list.d" "$dest/etc/apt/preferences.d" "$dest/etc/apt/apt.conf.d" \
  "$dest/var/lib/apt/lists/partial" "$dest/var/cache/apt/archives/partial" "$dest/var/lib/dpkg" "$dest/debs"
touch "$dest/var/lib/dpkg/status"
echo "deb [arch=$arch signed-by=/usr/share/keyrings/debian-archive-keyring.gpg] $mirror $suite main" \
  >"$dest/etc/apt/sources.list"
opts=(-o "Dir=$dest" -o "Dir::State::status=$dest/var/lib/dpkg/status" -o "APT::Architecture=$arch"
  -o "APT::Architectures::=$arch" -o "Dir::Etc::trusted=/dev/null"
  -o "Dir::Etc::TrustedParts=/usr/share/keyrings/nonexistent" -o "Debug::NoLocking=1"
  -o "APT::Install-Recommends=0" -o "APT::Sandbox::User=$(id -un)" -o "Acquire::Languages=none")
apt-get "${opts[@]}" -q update >/dev/null
if [ "$deps" = 1 ]; then
  apt-get "${opts[@]}" -q -y install --download-only "$@" >/dev/null
  cp "$dest"/var/cache/apt/archives/*.deb "$dest/debs/"
else
  (cd "$dest/debs" && apt-get "${opts[@]}" -q download "$@" >/dev/null)
fi
