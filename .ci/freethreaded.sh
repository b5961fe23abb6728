#!/usr/bin/env bash
# CI lane: the suite on free-threaded CPython (the GIL off), with the newest jax. Debian publishes no
# free-threaded Python package, so the lane builds one: the newest CPython source Debian's archive
# serves (its source package's upstream tarball, checked against the archive's SHA-256), 3.14 when its
# tarball is there, else 3.13, configured with --disable-gil and installed in /opt/python-ft of the
# Debian 13 chroot .ci/_chroot.sh makes (a chroot made before in this CI run is reused). The host's pip
# (a new one: pip >= 24.1 picks the free-threaded `t` wheels) downloads the free-threaded wheels of jax,
# jaxlib, NumPy, SciPy and the test extra; numba and ducc0 publish none, so they are left out and the
# tests that need them skip, saying so. Then the package is built and installed inside, the GIL is
# checked off after `import jaxbind`, and the whole suite runs.
set -euo pipefail
lane=free-threaded
# shellcheck source=.ci/_chroot.sh
source "$(dirname "$0")/_chroot.sh"
without_free_threaded_wheels='^(numba|ducc0)\b'

chroot_make

step "CPython's source from Debian"
mkdir -p "$root/build"
version=$(python3 - "$root/build/cpython.tar.xz" <<'PYEOF'
import hashlib, lzma, sys, urllib.request
archive = "http://deb.debian.org/debian"
index = lzma.decompress(urllib.request.urlopen(f"{archive}/dists/sid/main/source/Sources.xz").read()).decode()
tarballs = []  # (version, directory, file, sha256) of each python3.X source package's upstream tarball
for stanza in index.split("\n\n"):
    fields = dict(line.split(": ", 1) for line in stanza.splitlines() if ": " in line and not line.startswith(" "))
    if fields.get("Package") not in ("python3.13", "python3.14"):
        continue
    sums = stanza.split("Checksums-Sha256:")[1].splitlines()
    for line in sums[1:]:
        if not line.startswith(" "):
            break
        digest, _, name = line.split()
        if name.endswith(".orig.tar.xz"):
            version = tuple(int(v) for v in name.split("_")[1].split(".orig")[0].split("."))
            tarballs.append((version, fields["Directory"], name, digest))
for version, directory, name, digest in sorted(tarballs, reverse=True):
    try:  # (the archive lists some tarballs it no longer serves)
        data = urllib.request.urlopen(f"{archive}/{directory}/{name}").read()
    except OSError:
        continue
    if hashlib.sha256(data).hexdigest() == digest:
        open(sys.argv[1], "wb").write(data)
        print(".".join(map(str, version)))
        break
else:
    raise SystemExit("no python3.13 or python3.14 upstream tarball could be fetched from Debian")
PYEOF
)
minor=${version%.*}                   # 3.13
abi=cp${minor/./}t                    # cp313t
rm -rf "$root/build/cpython" && mkdir "$root/build/cpython"
tar -xJf "$root/build/cpython.tar.xz" -C "$root/build/cpython" --strip-components=1 && rm "$root/build/cpython.tar.xz"
echo "CPython $version ($abi)"

step "build CPython $version with --disable-gil"
# -O1: the build takes about half the time of the default -O3 (2.5 minutes here, 6 on 2 busy cores).
# JAXBIND_CI_KEEP_CHROOT=1 (by hand, between tries) also keeps a Python built before.
if [ "${JAXBIND_CI_KEEP_CHROOT:-0}" = 1 ] && [ -x "$root/opt/python-ft/bin/python$minor" ]; then
  echo "kept: $(chroot "$root" "/opt/python-ft/bin/python$minor" --version)"
else
  rm -rf "$root/opt/python-ft"
  chroot_run '
  cd /build/cpython
  ./configure --quiet --disable-gil --prefix=/opt/python-ft --without-ensurepip OPT="-DNDEBUG -O1" >/dev/null
  make -s -j"$(nproc)" >/build/make.log 2>&1 || { tail -50 /build/make.log; exit 1; }
  make -s install >/build/install.log 2>&1 || { tail -50 /build/install.log; exit 1; }
'
fi

step "the wheelhouse"
hostpip=$root/build/host-pip
python3 -m venv "$hostpip"
"$hostpip/bin/python" -m pip install --quiet --upgrade 'pip>=24.1'
mapfile -t test_reqs < <(test_requirements | grep -Ev "$without_free_threaded_wheels")
wheelhouse_download "$hostpip/bin/python -m pip" "$minor" "$abi" none -- jax jaxlib numpy "${test_reqs[@]}"
mapfile -t build_reqs < <(build_requirements "$minor")
# (no pip: the venv's, from CPython's ensurepip, is new enough)
wheelhouse_download "$hostpip/bin/python -m pip" "$minor" "$abi" none -- "${build_reqs[@]}"
ls "$wheels" | grep -E '^(jax|jaxlib|numpy|scipy)-'

step "install"
printf '%s\n' "${test_reqs[@]}" >"$root/src/.ci-test-requirements.txt"
chroot_run "
  /opt/python-ft/bin/python$minor -m venv .venv
  . .venv/bin/activate
  # The README's install command without the test extra (it names numba and ducc0), then the extra's
  # other requirements.
  pip install --quiet .
  pip install --quiet -r .ci-test-requirements.txt
  cd /
  python -c 'import sys, sysconfig, jax, jaxlib, numpy, jaxbind
print(sys.version.split()[0], \"jax\", jax.__version__, \"jaxlib\", jaxlib.__version__, \"numpy\", numpy.__version__)
assert sysconfig.get_config_var(\"Py_GIL_DISABLED\"), \"not a free-threaded build\"
assert not sys._is_gil_enabled(), \"importing jaxbind (or JAX) turned the GIL on\"
print(\"the GIL is off after import jaxbind\")'
"

step "test"
# The one lane on CPython >= 3.13.8, where a thread back in Python after finalization began is parked
# (gh-87135): without the exit hook keeping JAX's clients, test_lifetime.py's "exit does not wait" cases
# hang here at exit; tests/runtime/test_exit_keeps_clients.py pins the keeping itself on every build.
chroot_run '. .venv/bin/activate && pytest -q'
step "done"
