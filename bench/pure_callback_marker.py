"""What the host-callback marker of jaxbind.pure_callback's programs costs (issue 40), A/B in one process.

Run:  python bench/pure_callback_marker.py [--rounds N]

Method: the same callback body under two names; the lowering of one skips the
marker (``_jax_compat.hold_as_host_callback``, which makes JAX run the program
before the call returns), the other keeps it, so both programs live in one
process and their calls interleave (no between-process noise). Timed: a jitted
call from Python, dispatch included (``_timing.interleaved_plain_per_call``,
``jax.pure_callback`` beside them for scale), and per call inside a jitted
``fori_loop`` (``_timing.interleaved_per_call``, on the calling thread and on a
worker thread); the median over rounds, and each round's ratio.
"""

from __future__ import annotations

import argparse
import os
import statistics
import warnings

import jax

jax.config.update("jax_enable_x64", True)

import jax.numpy as jnp
import numpy as np
from _timing import cpu_model, interleaved_per_call, interleaved_plain_per_call, load_average
from jax.interpreters import mlir

import jaxbind
from jaxbind import _lowering, _primitive

warnings.filterwarnings("ignore", "overflow encountered", RuntimeWarning)


def without_marker(a):
    return np.multiply(a, 2)


def with_marker(a):
    return np.multiply(a, 2)


def install_switch():
    """Lower ``without_marker``'s op without the marker (the lowering rule re-registered around jaxbind's)."""
    marker, original, lowering_now = _lowering.hold_as_host_callback, _lowering.jaxbind_lowering, [None]

    def maybe_marker(ctx):
        if lowering_now[0] != "pure_callback(without_marker)":
            marker(ctx)

    def lowering(ctx, *args, role, **params):
        lowering_now[0] = role.op.name
        return original(ctx, *args, role=role, **params)

    _lowering.hold_as_host_callback = maybe_marker
    for primitive in _primitive.PRIMITIVES:
        mlir.register_lowering(primitive, lowering, platform="cpu")


def via(api, f):
    return lambda x: api(f, jax.ShapeDtypeStruct(x.shape, x.dtype), x)


def main():
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--rounds", type=int, default=5)
    rounds = parser.parse_args().rounds
    install_switch()
    for n in (1, 1000):
        x = jnp.asarray(np.random.default_rng(0).standard_normal(n))
        jitted = [
            jax.jit(via(jaxbind.pure_callback, without_marker)),
            jax.jit(via(jaxbind.pure_callback, with_marker)),
            jax.jit(via(jax.pure_callback, without_marker)),
        ]
        for f in jitted:
            np.testing.assert_allclose(f(x), 2 * np.asarray(x))
        samples = [interleaved_plain_per_call([(f, (x,)) for f in jitted], 3, 0.05) for _ in range(rounds)]
        b, a, stock = (statistics.median(s[i] for s in samples) * 1e6 for i in range(3))
        each = ", ".join(f"{s[1] / s[0]:.2f}" for s in samples)
        print(
            f"n={n:>4}, jitted call from Python: without {b:6.2f} us, with {a:6.2f} us "
            f"(rounds: {each}); jax.pure_callback {stock:6.2f} us"
        )
        for worker in (False, True):
            fns = [via(jaxbind.pure_callback, without_marker), via(jaxbind.pure_callback, with_marker)]
            samples = [interleaved_per_call(fns, x, worker, 3, 0.05) for _ in range(rounds)]
            b, a = (statistics.median(s[i] for s in samples) * 1e6 for i in range(2))
            print(
                f"n={n:>4}, per call in a fori_loop, {'worker' if worker else 'caller'} thread: "
                f"without {b:6.2f} us, with {a:6.2f} us, ratio {a / b:.2f}"
            )
    print(f"{cpu_model()}, {os.cpu_count()} cores, jax {jax.__version__}, load at the end {load_average():.2f}")


if __name__ == "__main__":
    main()
