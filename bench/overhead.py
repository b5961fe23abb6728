"""Per-call cost of jaxbind ops against JAX's own callbacks, measured side by side in one run.

Run:  python bench/overhead.py [--quick] [--json bench/results.json]

Method (per-call cases): the op runs K times inside ONE jitted function, as a
``lax.fori_loop`` with a traced trip count, so K=0 and K=K use the same
executable; per call = (T(K) - T(0)) / K, the median over interleaved
repetitions after a warm-up, with K chosen so that a run takes about 0.1 s.
The floor rows are XLA typed-FFI handlers written by hand (``bench/floor/handler.cc``, compiled
at run time against the installed jaxlib's headers): the least a custom call costs.
Each per-call case runs twice: alone (a tiny program, which XLA runs on the
calling Python thread) and beside an independent ``sum(sin(x))`` over 4096
elements (which makes XLA run the program on one of its worker threads, as it
does real programs). Results are checked once, outside the timing, on random data.
"""

from __future__ import annotations

import argparse
import json
import os
import sys
import threading
import time
import warnings

import jax

jax.config.update("jax_enable_x64", True)

import jax.numpy as jnp
import numpy as np
from _bodies import batched_abstract, empty_body, numpy_double, same_shape
from _floor import ops as floor_ops
from _timing import interleaved_per_call, interleaved_plain_per_call, load_average, looped, machine, plain_per_call

import jaxbind
from jaxbind import _trampoline

try:
    from jax.experimental.buffer_callback import buffer_callback
except ImportError:  # older jax
    buffer_callback = None

# y = 2 x applied a million times overflows to inf: harmless here (and NumPy's
# error state is per thread, so silence the warning rather than np.seterr).
warnings.filterwarnings("ignore", "overflow encountered", RuntimeWarning)
sys.path.insert(1, os.path.join(os.path.dirname(os.path.abspath(__file__)), os.pardir, "tests"))
import _kernels

KERNELS = _kernels.load()
TARGET_SECONDS = 0.1
REPEATS = 5


# ---------------------------------------------------------------------------
# The ops under test: y = 2 x
# ---------------------------------------------------------------------------

python_op = jaxbind.get_linear_call(numpy_double, numpy_double, same_shape, same_shape)
empty_op = jaxbind.get_linear_call(empty_body, empty_body, same_shape, same_shape)
native_op = jaxbind.get_linear_call(KERNELS.jb_double, KERNELS.jb_double, same_shape, same_shape)
native_empty_op = jaxbind.get_linear_call(KERNELS.jb_empty, KERNELS.jb_empty, same_shape, same_shape)
try:
    import numba  # noqa: F401  (whether numba is there decides which rows run)
except ImportError:  # (the test extra installs it)
    numba_op = None
else:

    @jaxbind.numba_kernel
    def numba_double(out, args, kwargs):
        x, y = args[0], out[0]
        for i in range(x.size):
            y[i] = 2.0 * x[i]

    numba_op = jaxbind.get_linear_call(numba_double, numba_double, same_shape, same_shape)
FLOOR = floor_ops()
can_batch_op = jaxbind.get_linear_call(
    numpy_double, numpy_double, batched_abstract, batched_abstract, func_can_batch=True
)


def pure_callback_double(x, vmap_method=None):
    kwargs = {} if vmap_method is None else {"vmap_method": vmap_method}
    return jax.pure_callback(lambda a: np.multiply(a, 2), jax.ShapeDtypeStruct(x.shape, x.dtype), x, **kwargs)


def buffer_callback_double(x):
    def body(ctx, out, a):
        np.multiply(np.asarray(a), 2, out=np.asarray(out))

    return buffer_callback(body, jax.ShapeDtypeStruct(x.shape, x.dtype))(x)


CASES = {
    "jnp 2*x (floor)": lambda x: 2 * x,
    "XLA FFI handler (floor of a custom call)": FLOOR["floor_double"],
    "XLA FFI handler with jaxbind's attributes": FLOOR["floor_double_attributes"],
    "jax.pure_callback": pure_callback_double,
    "buffer_callback": buffer_callback_double if buffer_callback else None,
    "jaxbind python": lambda x: python_op(x)[0],
    "jaxbind python, empty body": lambda x: empty_op(x)[0],
    "jaxbind native": lambda x: native_op(x)[0],
    "jaxbind native, empty body": lambda x: native_empty_op(x)[0],
    "jaxbind numba kernel": (lambda x: numba_op(x)[0]) if numba_op else None,
}

# ---------------------------------------------------------------------------
# Timing
# ---------------------------------------------------------------------------


def per_call_plain(fn, *args, repeats=None):
    """Seconds per Python-level call of ``fn(*args)``, median of several timed batches."""
    return plain_per_call(fn, *args, repeats=repeats or REPEATS, target=TARGET_SECONDS)


def body_alone(size):
    """The NumPy body itself, from a Python loop on preallocated arrays."""
    x, y = np.random.default_rng(0).standard_normal(size), np.empty(size)
    return per_call_plain(lambda: np.multiply(x, 2, out=y))


# ---------------------------------------------------------------------------
# Checks (once, outside the timing)
# ---------------------------------------------------------------------------


def check_results():
    rng = np.random.default_rng(1)
    x = jnp.asarray(rng.standard_normal(1000))
    for name, body in CASES.items():
        if body is None or "empty" in name:
            continue
        np.testing.assert_allclose(jax.jit(body)(x), 2 * np.asarray(x), rtol=1e-15, err_msg=name)
    xs = jnp.asarray(rng.standard_normal((64, 1000)))
    for body in (lambda v: python_op(v)[0], lambda v: can_batch_op(v)[0]):
        np.testing.assert_allclose(jax.jit(jax.vmap(body))(xs), 2 * np.asarray(xs), rtol=1e-15)
    grad = jax.jit(jax.grad(lambda v: 0.5 * jnp.sum(python_op(v)[0] ** 2)))
    np.testing.assert_allclose(grad(x), 4 * np.asarray(x), rtol=1e-14)
    # the worker-thread programs really run the op off the Python thread
    threads = set()

    def spy(out, args, kwargs_dump):
        threads.add(threading.get_ident())
        out[0][...] = args[0]

    spy_op = jaxbind.get_linear_call(spy, spy, same_shape, same_shape)
    fn = looped(lambda v: spy_op(v)[0], worker=True)
    jax.block_until_ready(fn(x[:1], 3))
    worker_ok = threading.main_thread().ident not in threads
    threads.clear()
    jax.block_until_ready(looped(lambda v: spy_op(v)[0], worker=False)(x[:1], 3))
    caller_ok = threads == {threading.main_thread().ident}
    return {"worker_program_runs_off_python_thread": worker_ok, "tiny_program_runs_on_python_thread": caller_ok}


# ---------------------------------------------------------------------------
# The suite
# ---------------------------------------------------------------------------


def concurrency():
    """Independent ~1 ms native calls in one program, against one call (milliseconds).

    Two shapes of program: the smallest (two calls), and two independent
    pipelines of five calls each; with plain and with concurrent kernels.
    """
    x = jnp.ones(1000)
    results = {}
    for mode in ("plain", "concurrent"):
        kernel = jaxbind.native(KERNELS.jb_busy, concurrent=(mode == "concurrent"))
        busy = jaxbind.get_linear_call(kernel, kernel, same_shape, same_shape)

        def chain(a, n):
            for _ in range(n):
                a = busy(a, iterations=110000)[0]
            return a

        for n in (1, 5):
            one = jax.jit(lambda a, n=n: chain(a, n))
            two = jax.jit(lambda a, b, n=n: (chain(a, n), chain(b, n)))
            t_one = per_call_plain(one, x, repeats=7) * 1e3
            t_two = per_call_plain(two, x, x + 1, repeats=7) * 1e3
            results[f"{mode}, {n} call(s) per branch"] = {"one_ms": t_one, "two_ms": t_two, "ratio": t_two / t_one}
    return results


def per_call_table(sizes, rng, quick) -> dict:
    """Per call of every case, by size: interleaved, on the calling thread and on a worker."""
    table = {}
    for size in sizes:
        x = jnp.asarray(rng.standard_normal(size))
        row = {}
        names = [
            name
            for name, body in CASES.items()
            if body is not None and not (name == "jax.pure_callback" and size >= 1000000 and quick)
        ]
        for worker in (False, True):
            seconds = interleaved_per_call([CASES[name] for name in names], x, worker, REPEATS, TARGET_SECONDS)
            for name, s in zip(names, seconds):
                row[f"{name} [{'worker' if worker else 'caller'}]"] = s * 1e6
        row = {key: row[key] for name in names for key in (f"{name} [caller]", f"{name} [worker]")}
        row["numpy body alone"] = body_alone(size) * 1e6
        table[str(size)] = row

    return table


def floor_steps() -> dict:
    """The steps the handler cannot avoid, each alone (ns)."""
    n = 200000
    return {
        "gil_worker_thread": _trampoline._diag_gil(n, True),
        "gil_calling_thread": _trampoline._diag_gil(n, False),
        "views_and_tuples": _trampoline._diag_views(n),
        "python_call_empty": _trampoline._diag_call(empty_body, (np.zeros(1),), (np.ones(1),), b"", n),
    }


def other_costs(rng, per_call_us) -> dict:
    """A gradient step, vmaps of 64 rows and eager calls from Python (us)."""
    x = jnp.asarray(rng.standard_normal(1000))
    forward = jax.jit(lambda v: python_op(v)[0])
    grad = jax.jit(jax.grad(lambda v: 0.5 * jnp.sum(python_op(v)[0] ** 2)))
    xs = jnp.asarray(rng.standard_normal((64, 1000)))
    vmaps = {
        "jaxbind walk (no func_can_batch)": jax.jit(jax.vmap(lambda v: python_op(v)[0])),
        "jaxbind func_can_batch": jax.jit(jax.vmap(lambda v: can_batch_op(v)[0])),
        "64 single calls of jaxbind python": None,
    }
    for method in ("sequential", "expand_dims", "broadcast_all"):
        vmaps[f"pure_callback vmap_method={method}"] = jax.jit(
            jax.vmap(lambda v, m=method: pure_callback_double(v, vmap_method=m))
        )
    other = {
        "forward 1000 (jit, called from Python)": per_call_plain(forward, x) * 1e6,
        "grad step 1000 (jit, called from Python)": per_call_plain(grad, x) * 1e6,
    }
    for name, fn in vmaps.items():
        if fn is None:
            other[f"vmap 64x1000: {name}"] = (
                64 * per_call_us["1000"]["jaxbind python [caller]"] if "1000" in per_call_us else float("nan")
            )
        else:
            other[f"vmap 64x1000: {name}"] = per_call_plain(fn, xs) * 1e6
    # Eager calls from Python on one element: the op itself, the same op in a
    # jitted function (the anchor: the same program, called by JAX's own
    # dispatch), and a jitted jnp function of one op.
    x1 = jnp.asarray(rng.standard_normal(1))
    eager = {
        "eager op(x), python op, 1 element": python_op,
        "jitted op function, python op, 1 element": jax.jit(lambda v: python_op(v)),
        "eager op(x), native op, 1 element": native_op,
        "jitted op function, native op, 1 element": jax.jit(lambda v: native_op(v)),
        "jitted jnp one-op function, 1 element": jax.jit(lambda v: 2 * v),
    }
    seconds = interleaved_plain_per_call([(fn, (x1,)) for fn in eager.values()], REPEATS, TARGET_SECONDS)
    other.update({name: s * 1e6 for name, s in zip(eager, seconds)})
    return other


def main():
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--quick", action="store_true", help="fewer sizes and repetitions")
    parser.add_argument("--json", default=os.path.join(os.path.dirname(__file__), "results.json"))
    options = parser.parse_args()
    global REPEATS, TARGET_SECONDS
    sizes = [1, 1000, 1000000]
    if options.quick:
        REPEATS, TARGET_SECONDS, sizes = 3, 0.03, [1, 1000]
    started = time.time()
    results = {"machine": machine(), "method": __doc__.split("Method")[1].strip(), "checks": check_results()}
    rng = np.random.default_rng(0)
    results["per_call_us"] = per_call_table(sizes, rng, options.quick)
    results["floor_ns"] = floor_steps()
    results["other_us"] = other_costs(rng, results["per_call_us"])
    results["concurrency"] = concurrency()
    results["seconds"] = time.time() - started
    results["machine"]["load_at_end"] = load_average()

    with open(options.json, "w") as handle:
        json.dump(results, handle, indent=2)
    print_tables(results)
    print(f"\nwritten: {options.json} ({results['seconds']:.0f} s)")


def print_tables(results):
    m = results["machine"]
    print(
        f"# jaxbind overhead: {m['platform']}, {m.get('cpu', '?')}, {m['cpus']} CPUs, Python {m['python']}, "
        f"jax {m['jax']}, numpy {m['numpy']}, load at the end {m.get('load_at_end', float('nan')):.2f}\n"
    )
    print(
        "Per call, microseconds (float64 arrays; caller = tiny program on the Python thread, "
        "worker = program XLA runs on its own thread):\n"
    )
    sizes = list(results["per_call_us"])
    print("| case | " + " | ".join(f"{s} elements" for s in sizes) + " |")
    print("|---|" + "---:|" * len(sizes))
    names = list(results["per_call_us"][sizes[0]])
    for name in names:
        cells = [results["per_call_us"][s].get(name) for s in sizes]
        print(f"| {name} | " + " | ".join("-" if c is None else f"{c:.3g}" for c in cells) + " |")
    print("\nFloor, nanoseconds per step alone:", ", ".join(f"{k} {v:.0f}" for k, v in results["floor_ns"].items()))
    print("\nOther, microseconds per call:\n")
    print("| case | us |")
    print("|---|---:|")
    for name, value in results["other_us"].items():
        print(f"| {name} | {value:.3g} |")
    print("\nIndependent ~1 ms native calls: one branch against two independent branches in one program:\n")
    print("| kernels, calls per branch | one branch ms | two branches ms | ratio |")
    print("|---|---:|---:|---:|")
    for name, c in results["concurrency"].items():
        print(f"| {name} | {c['one_ms']:.2f} | {c['two_ms']:.2f} | {c['ratio']:.2f} |")
    print("\nChecks:", results["checks"])
    print_ratios(results)


def print_ratios(results):
    """The targets of the speed issue, as ratios from this run."""
    rows = _per_call_rows(results) + _other_rows(results)
    results["ratios"] = {name: value for name, value, _ in rows}
    print("\nRatios (this run) against targets:\n")
    print("| ratio | value | target |")
    print("|---|---:|---|")
    for name, value, target in rows:
        shown = f"1/{1 / value:.0f}" if value < 0.5 else f"{value:.2f}"
        print(f"| {name} | {shown} | {target} |")


def _per_call_rows(results) -> list:
    """(name, ratio, target) of the per-call costs: one element, and 10^6 where measured."""
    pc = results["per_call_us"]
    one = pc["1"]
    rows = []
    for where in ("caller", "worker"):
        pure = one[f"jax.pure_callback [{where}]"]
        rows.append(
            (f"python op / pure_callback, 1 elem [{where}]", one[f"jaxbind python [{where}]"] / pure, "<= 1/100")
        )
        rows.append(
            (
                f"empty python op / pure_callback, 1 elem [{where}]",
                one[f"jaxbind python, empty body [{where}]"] / pure,
                "<= 1/200",
            )
        )
        rows.append(
            (
                f"native op / python op, 1 elem [{where}]",
                one[f"jaxbind native [{where}]"] / one[f"jaxbind python [{where}]"],
                "<= 1/10",
            )
        )
    for where in ("caller", "worker"):
        floor = one[f"XLA FFI handler (floor of a custom call) [{where}]"]
        rows.append(
            (f"native op / XLA FFI handler, 1 elem [{where}]", one[f"jaxbind native [{where}]"] / floor, "<= 1.15")
        )
        if f"jaxbind numba kernel [{where}]" in one:
            rows.append(
                (
                    f"numba kernel op / XLA FFI handler, 1 elem [{where}]",
                    one[f"jaxbind numba kernel [{where}]"] / floor,
                    "<= 1.15",
                )
            )
    rows.append(
        ("python op worker / caller, 1 elem", one["jaxbind python [worker]"] / one["jaxbind python [caller]"], "<= 1.2")
    )
    # The floor of an empty Python callback: XLA's own cost of a custom call in
    # the loop (the native empty op) plus the steps the handler cannot skip,
    # taking the GIL and the Python call. (Views are made on the first call
    # only, then re-pointed: "views_and_tuples" is their cost when made anew.)
    floor = (
        one["jaxbind native, empty body [worker]"]
        + sum(results["floor_ns"][k] for k in ("gil_worker_thread", "python_call_empty")) / 1e3
    )
    rows.append(
        ("empty python op [worker] / floor sum", one["jaxbind python, empty body [worker]"] / floor, "(close to 1)")
    )
    if "1000000" in pc:
        big = pc["1000000"]
        rows.append(
            ("python op / numpy body, 1e6 elem", big["jaxbind python [caller]"] / big["numpy body alone"], "<= 1.1")
        )
        # The loop carries the op's output, so XLA copies it every iteration
        # (a copy in the HLO, paid by every custom call); the native empty op
        # measures that copy and the loop, and nothing of jaxbind's.
        rows.append(
            (
                "(python op - native empty op) / numpy body, 1e6 elem",
                (big["jaxbind python [caller]"] - big["jaxbind native, empty body [caller]"]) / big["numpy body alone"],
                "<= 1.1 (no hidden copies)",
            )
        )
    return rows


def _other_rows(results) -> list:
    """(name, ratio, target) of the walks, the gradient, eager calls and concurrency."""
    other = results["other_us"]
    rows = []
    rows.append(
        (
            "vmap 64 walk / 64 single calls",
            other["vmap 64x1000: jaxbind walk (no func_can_batch)"]
            / other["vmap 64x1000: 64 single calls of jaxbind python"],
            "<= 1.2",
        )
    )
    rows.append(
        (
            "vmap 64 walk / pure_callback sequential",
            other["vmap 64x1000: jaxbind walk (no func_can_batch)"]
            / other["vmap 64x1000: pure_callback vmap_method=sequential"],
            "<= 1/30",
        )
    )
    rows.append(
        (
            "grad step / forward",
            other["grad step 1000 (jit, called from Python)"] / other["forward 1000 (jit, called from Python)"],
            "<= 2.2",
        )
    )
    for kind in ("python", "native"):
        rows.append(
            (
                f"eager op(x) / jitted op function, {kind} op",
                other[f"eager op(x), {kind} op, 1 element"] / other[f"jitted op function, {kind} op, 1 element"],
                "<= 1.1",
            )
        )
    rows.append(
        (
            "eager op(x), native op / jitted jnp one-op",
            other["eager op(x), native op, 1 element"] / other["jitted jnp one-op function, 1 element"],
            "(close to 1)",
        )
    )
    for name, c in results["concurrency"].items():
        rows.append((f"two branches / one, {name}", c["ratio"], "<= 1.3"))
    return rows


if __name__ == "__main__":
    main()
