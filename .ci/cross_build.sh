#!/usr/bin/env bash
# CI check: the extension compiles and links for macOS and Windows, with the release toolchain (zig's
# clang from the `ziglang` package, the version tools/build_release.sh pins). Nothing runs there: the
# check is that CMake configures and builds `_trampoline` from CMakeLists.txt as it is, that the
# product is a Mach-O arm64 dylib (zig makes no bundle; CPython loads either) / a PE32+ x86-64 DLL named
# as CPython looks for it on that platform, and that it needs nothing but Python's C API and the
# system's libraries (.ci/cross_check.py). docs/architecture.md, issue 41, has the details.
#
# Targets (JAXBIND_CROSS_TARGETS, space-separated): aarch64-macos and x86_64-windows-gnu by default;
# x86_64-macos too when named (it costs a second run of CPython's configure and zig's macOS libraries).
# The target Python is the version of the python3 running this (CMake's FindPython wants the
# interpreter it runs and the headers it compiles with to be one version). The target's headers:
# - CPython's Include/ from Debian's source package of that Python (its upstream tarball, checked
#   against the archive's SHA-256). pyconfig.h: Windows, PC/pyconfig.h(.in) of that tarball, as
#   CPython's Windows build copies it; macOS, made by that tarball's configure run for the target
#   with zig's clang (configure refuses to cross-build for Darwin: a few lines of it are changed).
#   Windows' import library python3XY.lib is made by zig's dlltool from the functions and data the
#   headers declare as exported (PyAPI_FUNC, PyAPI_DATA).
# - NumPy's headers from NumPy's wheel for the target (PyPI), XLA's FFI headers from jaxlib's wheel
#   (the jaxlib pyproject.toml's build requirements pick for that Python).
# JAXBIND_CI_KEEP_CROSS=1 (by hand, between tries) reuses the downloads, venv and headers made before.
# Run as: bash .ci/cross_build.sh (needs python3 with venv, Debian's archive and PyPI; root not needed).
set -euo pipefail
repo=$(cd "$(dirname "$0")/.." && pwd)
work=${JAXBIND_CROSS_DIR:-/var/tmp/jaxbind-cross}   # outside the repository: no tool walks into it
targets=${JAXBIND_CROSS_TARGETS:-aarch64-macos x86_64-windows-gnu}
started=$SECONDS
step() { echo "== cross build, $((SECONDS - started)) s: $*"; }

if [ "${JAXBIND_CI_KEEP_CROSS:-0}" != 1 ]; then rm -rf "$work"; fi
mkdir -p "$work"
minor=$(python3 -c 'import sys; print("%d.%d" % sys.version_info[:2])')   # 3.11
nodot=${minor/./}

step "the tools (zig as tools/build_release.sh pins it, CMake, Ninja, nanobind, LIEF to read the products)"
zig_pin=$(grep -o 'ziglang==[0-9.]*' "$repo/tools/build_release.sh" | head -1)
if [ ! -x "$work/venv/bin/cmake" ]; then
  python3 -m venv "$work/venv"
  "$work/venv/bin/python" -m pip install --quiet --upgrade pip
  "$work/venv/bin/python" -m pip install --quiet "$zig_pin" 'nanobind>=2.2' cmake ninja lief==1.0.0 packaging
fi
py=$work/venv/bin/python
# zig's cache of what it builds for a target the first time (the C runtime, libc++, compiler-rt: most of
# this check's time) is kept with the rest, not in the home folder: each run builds all it uses.
export ZIG_GLOBAL_CACHE_DIR=$work/zig-cache ZIG_LOCAL_CACHE_DIR=$work/zig-cache
# CMake takes a compiler as one executable: small scripts that call zig with the target.
mkdir -p "$work/bin"
# zig's Mach-O linker makes no MH_BUNDLE (it ignores -bundle, CMake's flag for a module: a dylib, which
# CPython's dlopen loads as well) and reads no ld64 response file (nanobind's `-Wl,@darwin-ld-cpython.sym`,
# a -U for each name of Python's C API, which it knows neither): the macOS scripts link with -shared and
# -undefined dynamic_lookup (what nanobind linked with before), and .ci/cross_check.py checks that every
# name so left undefined is Python's.
for target in $targets; do
  for tool in cc c++; do
    {
      printf '#!/bin/sh\n'
      case $target in
        *-macos) printf '%s\n' 'for a in "$@"; do shift; case $a in' \
          '  -bundle) set -- "$@" -shared ;;' \
          '  -Wl,@*/darwin-ld-*.sym) set -- "$@" -Wl,-undefined,dynamic_lookup ;;' \
          '  *) set -- "$@" "$a" ;;' 'esac; done' ;;
      esac
      printf 'exec "%s" -m ziglang %s -target %s "$@"\n' "$py" "$tool" "$target"
    } >"$work/bin/$target-$tool"
  done
done
for tool in ar ranlib dlltool; do
  printf '#!/bin/sh\nexec "%s" -m ziglang %s "$@"\n' "$py" "$tool" >"$work/bin/zig-$tool"
done
chmod +x "$work/bin"/*

step "CPython $minor's source from Debian"
if [ ! -d "$work/cpython/Include" ]; then
  "$py" - "$minor" "$work/cpython" <<'PYEOF'
import hashlib, io, lzma, sys, tarfile, urllib.request
minor, dest = sys.argv[1], sys.argv[2]
archive = "http://deb.debian.org/debian"
tarballs = []  # (version, directory, file, sha256) of python3.X's upstream tarballs in Debian's suites
for suite in ("sid", "trixie", "bookworm"):
    index = lzma.decompress(urllib.request.urlopen(f"{archive}/dists/{suite}/main/source/Sources.xz").read()).decode()
    for stanza in index.split("\n\n"):
        fields = dict(line.split(": ", 1) for line in stanza.splitlines() if ": " in line and not line.startswith(" "))
        if fields.get("Package") != f"python{minor}":
            continue
        for line in stanza.split("Checksums-Sha256:")[1].splitlines()[1:]:
            if not line.startswith(" "):
                break
            digest, _, name = line.split()
            if ".orig.tar." in name and not name.endswith(".asc"):
                version = tuple(int(v) for v in name.split("_")[1].split(".orig")[0].split("."))
                tarballs.append((version, fields["Directory"], name, digest))
for version, directory, name, digest in sorted(set(tarballs), reverse=True):
    try:  # (the archive lists some tarballs it no longer serves)
        data = urllib.request.urlopen(f"{archive}/{directory}/{name}").read()
    except OSError:
        continue
    if hashlib.sha256(data).hexdigest() != digest:
        raise SystemExit(f"{name}: the SHA-256 is not the one Debian's index lists")
    with tarfile.open(fileobj=io.BytesIO(data)) as tar:
        for member in tar.getmembers():  # the top folder's name dropped
            member.name = member.name.partition("/")[2]
            if member.name:
                tar.extract(member, dest, filter="data")
    print(f"CPython {'.'.join(map(str, version))} ({name})")
    break
else:
    raise SystemExit(f"no python{minor} upstream tarball could be fetched from Debian")
PYEOF
fi

# wheel_include SPEC PLATFORM FOLDER DEST: FOLDER of the wheel pip picks for SPEC on PLATFORM into DEST.
wheel_include() {
  local spec=$1 platform=$2 folder=$3 dest=$4
  [ -d "$dest/$folder" ] && return 0
  rm -rf "$work/wheel" && mkdir -p "$work/wheel"
  "$py" -m pip download --quiet --no-deps --only-binary=:all: --python-version "$minor" --implementation cp \
    --abi "cp$nodot" --platform "$platform" --dest "$work/wheel" "$spec"
  "$py" - "$work/wheel" "$folder" "$dest" <<'PYEOF'
import pathlib, sys, zipfile
(wheel,) = pathlib.Path(sys.argv[1]).glob("*.whl")
with zipfile.ZipFile(wheel) as z:
    z.extractall(sys.argv[3], [n for n in z.namelist() if n.startswith(sys.argv[2] + "/")])
print(wheel.name)
PYEOF
}

step "XLA's FFI headers (jaxlib as pyproject.toml's build requirements pick it for Python $minor)"
jaxlib_spec=$("$py" - "$repo/pyproject.toml" "$minor" <<'PYEOF'
import sys, tomllib
from packaging.markers import Marker
from packaging.requirements import Requirement
for text in tomllib.load(open(sys.argv[1], "rb"))["build-system"]["requires"]:
    req = Requirement(text)
    if req.name == "jaxlib" and (req.marker is None or req.marker.evaluate({"python_version": sys.argv[2]})):
        print(f"jaxlib{req.specifier}")
PYEOF
)
# (the headers are one for every platform: those of macOS's wheel, the smallest)
wheel_include "$jaxlib_spec" macosx_11_0_arm64 jaxlib/include "$work/jaxlib"

status=0
for target in $targets; do
  case $target in
    aarch64-macos) platform=macosx_11_0_arm64 system=Darwin processor=arm64 host=aarch64-apple-darwin macos_version=11.0 ;;
    x86_64-macos) platform=macosx_10_13_x86_64 system=Darwin processor=x86_64 host=x86_64-apple-darwin macos_version=10.13 ;;
    x86_64-windows-gnu) platform=win_amd64 system=Windows processor=AMD64 host= ;;
    *) echo "cross_build.sh: no such target: $target" >&2; exit 2 ;;
  esac
  t=$work/$target
  mkdir -p "$t"

  step "$target: NumPy's headers (NumPy's $platform wheel)"
  wheel_include 'numpy>=2.0' "$platform" numpy/_core/include "$t/numpy"

  step "$target: Python $minor's headers"
  python_args=()
  if [ "$system" = Windows ]; then
    if [ ! -e "$t/include/pyconfig.h" ]; then
      rm -rf "$t/include" && cp -r "$work/cpython/Include" "$t/include"
      # (3.13 and newer: pyconfig.h.in, copied as it is for the build with the GIL)
      cp "$(ls "$work/cpython/PC/pyconfig.h" "$work/cpython/PC/pyconfig.h.in" 2>/dev/null | head -1)" "$t/include/pyconfig.h"
      "$py" "$repo/.ci/cross_check.py" def "$t/include" "python$nodot" >"$t/python$nodot.def"
      "$work/bin/zig-dlltool" -m i386:x86-64 -d "$t/python$nodot.def" -l "$t/python$nodot.lib"
    fi
    # FindPython takes an import library with no DLL beside it for a static libpython, and adds the
    # host Python's link flags (-ldl -lm): it is told where python3XY.dll would be (nothing reads it).
    # nanobind's suffix is CPython's on Windows (its own guess asks the host's interpreter).
    python_args=(-DPython_LIBRARY="$t/python$nodot.lib" -D_Python_RUNTIME_LIBRARY_RELEASE="$t/python$nodot.dll"
      -DNB_SUFFIX=".cp$nodot-win_amd64.pyd" -DNB_SUFFIX_S=.pyd)
  else
    python_args=(-DNB_SUFFIX=".cpython-$nodot-darwin.so" -DNB_SUFFIX_S=.abi3.so)  # (CPython's on macOS)
  fi
  if [ "$system" = Darwin ] && [ ! -e "$t/include/pyconfig.h" ]; then
    # CPython's configure, run for the target (nothing is built): its answers to what it can only
    # learn by running a program there are the ones the macOS build of CPython finds.
    rm -rf "$t/configure" && cp -r "$work/cpython" "$t/configure"
    "$py" - "$t/configure/configure" "$([ "$processor" = arm64 ] && echo arm64 || echo i386)" <<'PYEOF'
import re, sys
path, arch = sys.argv[1:]
text = open(path).read()
# What `/usr/bin/arch` prints on the target (i386 on Intel Macs), and the answer the run test of
# `sizeof(long) == 4` gets there (no) where configure assumes yes when it cannot run it (3.11).
text = text.replace("`/usr/bin/arch`", arch)
text = text.replace('if test "$cross_compiling" = yes; then :\n  ac_osx_32bit=yes', 'if test "$cross_compiling" = yes; then :\n  ac_osx_32bit=no')
# Both of configure's case statements that refuse a cross build for a host they do not list.
text, n1 = re.subn(r"(\n\t\*-\*-cygwin\*\)\n\t\tac_sys_system=Cygwin)", r"\n\t*-apple-darwin*)\n\t\tac_sys_system=Darwin\n\t\t;;\1", text)
text, n2 = re.subn(r"(\n\t\*-\*-cygwin\*\)\n\t\t(_host_cpu|_host_ident)=)", r"\n\t*-apple-darwin*)\n\t\t\2=$host_cpu\n\t\t;;\1", text)
if (n1, n2) != (1, 1):
    raise SystemExit(f"configure's cross-build cases are not where they were ({n1}, {n2}): update the patch")
open(path, "w").write(text)
PYEOF
    # ac_cv_*: what configure asks a cross build's caller (the files exist on macOS; its getaddrinfo works).
    # READELF: 3.11's configure wants one for a cross build's Makefile; nothing is built here.
    if ! (cd "$t/configure" && CONFIG_SITE=/dev/null MACOSX_DEPLOYMENT_TARGET=$macos_version ./configure --host="$host" --build="$(uname -m)-pc-linux-gnu" \
      --with-build-python=python3 CC="$work/bin/$target-cc" CXX="$work/bin/$target-c++" AR="$work/bin/zig-ar" \
      READELF=/bin/true ac_cv_file__dev_ptmx=yes ac_cv_file__dev_ptc=no ac_cv_buggy_getaddrinfo=no >"$t/configure.log" 2>&1); then
      tail -30 "$t/configure.log"
      echo "cross_build.sh: CPython's configure failed for $target (its log: $t/configure.log)" >&2
      exit 1
    fi
    rm -rf "$t/include" && cp -r "$work/cpython/Include" "$t/include"
    cp "$t/configure/pyconfig.h" "$t/include/pyconfig.h"
  fi

  step "$target: configure and build the extension"
  cat >"$t/toolchain.cmake" <<EOF
set(CMAKE_SYSTEM_NAME $system)
set(CMAKE_SYSTEM_PROCESSOR $processor)
set(CMAKE_C_COMPILER "$work/bin/$target-cc")
set(CMAKE_CXX_COMPILER "$work/bin/$target-c++")
set(CMAKE_AR "$work/bin/zig-ar")
set(CMAKE_RANLIB "$work/bin/zig-ranlib")
EOF
  rm -rf "$t/build"
  # The host's interpreter runs CMakeLists.txt's queries (nanobind's folder); every header is the target's.
  PATH=$work/venv/bin:$PATH cmake -S "$repo" -B "$t/build" -G Ninja -DCMAKE_BUILD_TYPE=Release \
    -DCMAKE_TOOLCHAIN_FILE="$t/toolchain.cmake" -DPython_EXECUTABLE="$py" -DPython_INCLUDE_DIR="$t/include" \
    "${python_args[@]}" -DNUMPY_INCLUDE_DIR="$t/numpy/numpy/_core/include" \
    -DXLA_FFI_INCLUDE_DIR="$work/jaxlib/jaxlib/include" >"$t/cmake.log" 2>&1 || { cat "$t/cmake.log"; exit 1; }
  PATH=$work/venv/bin:$PATH cmake --build "$t/build"

  step "$target: the product"
  "$py" "$repo/.ci/cross_check.py" check "$target" "$minor" "$t/build" || status=1
done
step "done"
exit "$status"
