"""The native kernels of jaxbind's tests and benchmarks, compiled for them only.

``load()`` compiles ``kernels/test_kernels.c`` against the installed package's header
(``jaxbind.get_include()``) once, into ``kernels/build/`` (or, when that is not writable,
a folder in the temporary directory), keyed by a hash of the source, the header, the
compiler and its flags, and returns the loaded ``ctypes.CDLL`` (one per process).

The compiler is ``$CC`` (default ``cc``); ``$CFLAGS`` are added to the flags, e.g. the
sanitizers of ``.ci/run``. Tests use the ``kernels`` fixture of ``conftest.py`` or, for ops
made at import, ``_kernels.load()``; the subprocess helpers and ``bench/`` import this file
by path.
"""

import ctypes
import functools
import hashlib
import os
import shlex
import subprocess
import sys
import tempfile

import jaxbind

HERE = os.path.dirname(os.path.abspath(__file__))
SOURCE = os.path.join(HERE, "kernels", "test_kernels.c")
BASE_FLAGS = ["-O2", "-std=gnu99", "-Wall", "-shared", "-fPIC", "-pthread", "-fvisibility=hidden"]


def _command(output):
    compiler = shlex.split(os.environ.get("CC") or "cc")
    flags = BASE_FLAGS + shlex.split(os.environ.get("CFLAGS", ""))
    return compiler + flags + ["-I", jaxbind.get_include(), SOURCE, "-o", output, "-lm"]


def _key():
    digest = hashlib.sha256()
    for path in (SOURCE, os.path.join(jaxbind.get_include(), "jaxbind.h")):
        with open(path, "rb") as f:
            digest.update(f.read())
    digest.update(" ".join(_command("")).encode())
    return digest.hexdigest()[:16]


def _cache_dirs():
    yield os.path.join(HERE, "kernels", "build")
    yield os.path.join(tempfile.gettempdir(), f"jaxbind-test-kernels-{os.getuid()}")


def build():
    """The path of the compiled kernels, compiling them first if no cached build matches."""
    name = f"test_kernels-{_key()}.so"
    for folder in _cache_dirs():
        path = os.path.join(folder, name)
        if os.path.exists(path):
            return path
        try:
            os.makedirs(folder, exist_ok=True)
            fd, partial = tempfile.mkstemp(suffix=".so", dir=folder)
        except OSError:
            continue
        os.close(fd)
        env = dict(os.environ)
        env.pop("LD_PRELOAD", None)  # (sanitizer runtimes preloaded for the tests, not the compiler)
        try:
            done = subprocess.run(_command(partial), env=env, capture_output=True, text=True)
            if done.returncode != 0:
                raise RuntimeError(
                    f"compiling the test kernels failed: {' '.join(_command(partial))}\n{done.stdout}{done.stderr}"
                )
            os.replace(partial, path)  # atomic: processes compiling side by side agree
        finally:
            if os.path.exists(partial):
                os.unlink(partial)
        return path
    raise RuntimeError("no writable folder for the compiled test kernels")


@functools.lru_cache(None)
def load():
    """The test kernels as a ``ctypes.CDLL`` (compiled on first use, then cached)."""
    return ctypes.CDLL(build())


if __name__ == "__main__":  # python tests/_kernels.py: compile and print the path
    print(build(), file=sys.stdout)
