"""The floor rows of the per-call benchmarks: hand-written XLA typed-FFI handlers (``floor/handler.cc``).

``ops()`` compiles ``floor/handler.cc`` against the installed jaxlib's FFI headers
(``jax.ffi.include_dir()``) with ``$CXX`` (default ``c++``), once per source, headers and
compiler (cached in the temporary directory), registers its handlers with ``jax.ffi`` and
returns y = 2 x as functions of a float64 array: the least a custom call costs, against which
jaxbind's native calls are measured.
"""

import ctypes
import functools
import hashlib
import os
import shlex
import subprocess
import tempfile

import jax
import numpy as np

SOURCE = os.path.join(os.path.dirname(os.path.abspath(__file__)), "floor", "handler.cc")
HANDLERS = ("floor_double", "floor_double_attributes", "floor_empty")


def _command(output):
    compiler = shlex.split(os.environ.get("CXX") or "c++")
    return compiler + ["-O2", "-std=c++17", "-shared", "-fPIC", "-I", jax.ffi.include_dir(), SOURCE, "-o", output]


def _build():
    digest = hashlib.sha256(open(SOURCE, "rb").read())
    digest.update(" ".join(_command("")).encode())
    digest.update(jax.__version__.encode())
    path = os.path.join(tempfile.gettempdir(), f"jaxbind-bench-floor-{digest.hexdigest()[:16]}.so")
    if not os.path.exists(path):
        partial = f"{path}.{os.getpid()}"
        try:
            done = subprocess.run(_command(partial), capture_output=True, text=True)
        except FileNotFoundError:
            raise RuntimeError(
                f"compiling the floor handlers needs a C++17 compiler: {_command('')[0]} "
                "was not found (set $CXX, or install g++)"
            ) from None
        if done.returncode != 0:
            raise RuntimeError(
                f"compiling the floor handlers failed ({' '.join(_command(partial))}): "
                f"a C++17 compiler is needed ($CXX)\n{done.stdout}{done.stderr}"
            )
        os.replace(partial, path)
    return path


@functools.lru_cache(None)
def ops():
    """{name: fn(x) -> 2 x} for the hand-written handlers (``floor_empty`` returns garbage)."""
    library = ctypes.CDLL(_build())
    calls = {}
    for name in HANDLERS:
        target = f"jaxbind_bench_{name}"
        jax.ffi.register_ffi_target(target, jax.ffi.pycapsule(getattr(library, name)), platform="cpu")
        attributes = {"jaxbind": "floor", "site": np.int64(1)} if name.endswith("attributes") else {}

        def call(x, target=target, attributes=attributes):
            return jax.ffi.ffi_call(target, jax.ShapeDtypeStruct(x.shape, x.dtype))(x, **attributes)

        calls[name] = call
    return calls
