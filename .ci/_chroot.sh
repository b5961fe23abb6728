# Sourced by the chroot lanes (.ci/py313.sh, .ci/freethreaded.sh, .ci/py314.sh): a Debian chroot made by debootstrap,
# a wheelhouse the host's pip fills, the mounts, and the chroot's shell. Python inside the chroot rejects
# this network's TLS chain, so the host downloads every wheel an install needs and pip inside installs
# offline from the wheelhouse (PIP_NO_INDEX, PIP_FIND_LINKS). Needs root (debootstrap, chroot, mount) and
# Debian's debootstrap package (installed when missing).
#
# The caller sets `lane` (the name its log lines carry) and calls chroot_make first. It may set, before
# sourcing this file, `chroot_suite` (the Debian suite; trixie, Debian 13, when unset), `chroot_packages`
# (debootstrap's --include list; the trixie lanes' list below when unset) and `chroot_root` (where the
# chroot lives; JAXBIND_CI_CHROOT or /var/tmp/jaxbind-ci-chroot when unset): a lane on another suite
# keeps a root of its own, so that two lanes' chroots never collide.
set -euo pipefail
repo=$(cd "$(dirname "${BASH_SOURCE[0]}")/.." && pwd)
suite=${chroot_suite:-trixie}
# Debian 13 with its Python, the build tools (CMake, g++, gfortran for the Fortran tests, git) and the
# headers of the libraries CPython's own build links (for the free-threaded lane, which builds its
# Python: one package list, so that either trixie lane can reuse a chroot the other made).
packages=${chroot_packages:-python3,python3-venv,python3-dev,g++,make,cmake,ninja-build,gfortran,git,ca-certificates,xz-utils,pkg-config,libffi-dev,zlib1g-dev,libssl-dev,libbz2-dev,liblzma-dev}
root=${chroot_root:-${JAXBIND_CI_CHROOT:-/var/tmp/jaxbind-ci-chroot}}  # outside the repository: no tool walks into it
wheels=$root/wheelhouse

step() { echo "== $lane lane, ${SECONDS} s: $*"; }

chroot_unmount() {
  for m in dev proc sys; do
    if mountpoint -q "$root/$m"; then umount -R "$root/$m" || umount -lR "$root/$m"; fi
  done
}

# The suite with the packages above, by debootstrap alone (its --include resolves their dependencies:
# no apt inside, whose sid mirror's Release can be past its Valid-Until date).
# JAXBIND_CI_KEEP_CHROOT=1 reuses a chroot made before (by hand, between tries, or by the lane before in
# the same CI run) of the same suite and packages (a chroot made before the record of them was kept
# counts as the trixie lanes'); otherwise it is made anew. Then a fresh clone of what is committed in /src, and a
# name for this host (gloo, the multi-process tests' collectives, resolves it).
chroot_make() {
  command -v debootstrap >/dev/null || { apt-get update && apt-get install -y debootstrap; }
  if [ "$(id -u)" != 0 ]; then
    echo "$lane lane: needs root (debootstrap, chroot and mount); run it as root, as CI does" >&2
    exit 1
  fi
  trap chroot_unmount EXIT
  trap 'chroot_unmount; exit 143' TERM INT
  chroot_unmount
  local made="$suite $packages" record=$root/var/lib/jaxbind-ci-debootstrap
  if [ "${JAXBIND_CI_KEEP_CHROOT:-0}" = 1 ] && { [ "$(cat "$record" 2>/dev/null)" = "$made" ] ||
    { [ ! -e "$record" ] && [ -z "${chroot_packages:-}" ] && [ -x "$root/usr/bin/python3" ]; }; }; then
    rm -rf "$root/src" "$wheels"
  else
    rm -rf --one-file-system "$root"
    step "debootstrap $suite"
    debootstrap --variant=minbase --include="$packages" "$suite" "$root" http://deb.debian.org/debian
    echo "$made" >"$record"
  fi
  git clone --quiet "$repo" "$root/src"
  cp /etc/resolv.conf "$root/etc/resolv.conf" 2>/dev/null || true
  printf '127.0.0.1 localhost %s\n::1 localhost\n' "$(hostname)" >"$root/etc/hosts"
  hostname >"$root/etc/hostname"
}

# wheelhouse_download PIP VERSION ABI... -- REQUIREMENT...: the wheels for Python VERSION (3.13) with
# these ABI tags (cp313, abi3, none; cp313t for the free-threaded build), for the manylinux glibc
# versions the chroot runs (2.17 to its own: 2.41 in Debian 13, asked of the chroot), downloaded by the
# host's PIP (a command).
wheelhouse_download() {
  local pip=$1 version=$2
  shift 2
  local abis=()
  while [ "$1" != -- ]; do abis+=(--abi "$1"); shift; done
  shift
  local platforms=() glibc newest
  newest=$(chroot "$root" getconf GNU_LIBC_VERSION | sed -n 's/^glibc 2\.\([0-9]*\)$/\1/p')
  [ -n "$newest" ] || { echo "$lane lane: the chroot's glibc version could not be read" >&2; return 1; }
  for glibc in $(seq 17 "$newest"); do platforms+=(--platform "manylinux_2_${glibc}_x86_64"); done
  platforms+=(--platform manylinux2014_x86_64 --platform manylinux2010_x86_64 --platform manylinux1_x86_64)
  # Three tries: PyPI's index answers with nothing now and then ("from versions: none").
  local try
  for try in 1 2 3; do
    # shellcheck disable=SC2086  # (PIP is a command and its arguments)
    if $pip download --quiet --dest "$wheels" --only-binary=:all: --python-version "$version" \
      --implementation cp "${abis[@]}" "${platforms[@]}" "$@"; then
      return 0
    fi
    [ "$try" = 3 ] || { echo "the download failed: again in 30 s" >&2; sleep 30; }
  done
  return 1
}

# pyproject.toml's test extra (one requirement a line), and its build requirements for Python VERSION
# (the oldest jaxlib's headers).
test_requirements() {
  python3 -c "import tomllib; print('\n'.join(tomllib.load(open('$repo/pyproject.toml', 'rb'))['project']['optional-dependencies']['test']))"
}
build_requirements() {
  python3 - "$repo/pyproject.toml" "$1" <<'EOF'
import sys, tomllib
version = tuple(int(v) for v in sys.argv[2].split("."))
for requirement in tomllib.load(open(sys.argv[1], "rb"))["build-system"]["requires"]:
    name, _, marker = requirement.partition(";")
    bound = marker.split("python_version")[-1].strip() if marker else ""
    if bound.startswith(">="):  # (the only markers there: python_version>= and < a version)
        keep = version >= tuple(int(v) for v in bound[2:].strip(" '\"").split("."))
    elif bound.startswith("<"):
        keep = version < tuple(int(v) for v in bound[1:].strip(" '\"").split("."))
    else:
        keep = True
    if keep:
        print(name.strip())
EOF
}

# chroot_run SCRIPT: runs SCRIPT (bash, -euo pipefail) in the chroot, in /src, with a clean environment,
# /proc, /sys and /dev mounted, and pip pointed at the wheelhouse only.
chroot_run() {
  mountpoint -q "$root/proc" || mount -t proc proc "$root/proc"
  mountpoint -q "$root/sys" || mount --rbind /sys "$root/sys"
  mountpoint -q "$root/dev" || mount --rbind /dev "$root/dev"
  chroot "$root" /usr/bin/env -i HOME=/root PATH=/usr/local/bin:/usr/bin:/bin LANG=C.UTF-8 \
    PIP_NO_INDEX=1 PIP_FIND_LINKS=/wheelhouse PIP_DISABLE_PIP_VERSION_CHECK=1 \
    /bin/bash -euo pipefail -c "cd /src; $1"
}
