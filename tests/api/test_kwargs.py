"""Keyword arguments: static values keyed by value, snapshotted when the op is called, kept once."""

import gc
import weakref

import jax
import jax.numpy as jnp
import numpy as np

import jaxbind
from jaxbind._kwargs import Kwargs


def fill_with_weights(out, args, kwargs_dump):
    """out = the kwarg `weights` as an array (and args[0] only sets the dtype)."""
    out[0][...] = np.asarray(jaxbind.load_kwargs(kwargs_dump)["weights"], dtype=out[0].dtype)


def weights_abstract(x, *, weights):
    return (((len(weights),), x.dtype),)


op = jaxbind.get_linear_call(fill_with_weights, fill_with_weights, weights_abstract, weights_abstract)


def test_a_kwarg_mutated_after_the_call_changes_nothing_traced_with_it():
    # Before: the cached eager call kept the caller's list; a retrace (here for a
    # new dtype) took its shapes from the mutated list: [2., 2., 2.] for [2., 2.].
    weights = [2.0, 2.0]
    np.testing.assert_array_equal(op(jnp.ones(1), weights=weights)[0], [2.0, 2.0])
    weights.append(2.0)
    np.testing.assert_array_equal(op(jnp.ones(1, jnp.float32), weights=[2.0, 2.0])[0], [2.0, 2.0])
    np.testing.assert_array_equal(op(jnp.ones(1), weights=weights)[0], [2.0, 2.0, 2.0])


def test_kwargs_values_are_a_fresh_snapshot():
    values = {"weights": [1.0, 2.0]}
    kwargs = Kwargs(values, "op")
    values["weights"].append(3.0)
    assert kwargs.values == {"weights": [1.0, 2.0]}
    kwargs.values["weights"].append(4.0)
    assert kwargs.values == {"weights": [1.0, 2.0]}


def test_kwargs_that_cannot_change_are_read_once_and_still_a_fresh_dict(monkeypatch):
    # Each trace, lowering and re-resolution reads the kwargs: values that cannot change
    # (numbers, strings, tuples of them) are unpickled once; a list or array each time.
    import pickle

    loads = []
    real = pickle.loads
    monkeypatch.setattr(pickle, "loads", lambda data: loads.append(1) or real(data))
    fixed = Kwargs({"n": 3, "label": "x", "shape": (2, (1, 2.5)), "s": np.float32(1)}, "op")
    for _ in range(4):
        values = fixed.values
        assert values == {"label": "x", "n": 3, "s": np.float32(1), "shape": (2, (1, 2.5))}
        values["n"] = 99  # the caller's own dict
    assert len(loads) == 1
    changing = Kwargs({"weights": [1.0], "t": (np.zeros(1),)}, "op")
    for _ in range(3):
        changing.values["weights"].append(2.0)
        changing.values["t"][0][0] = 5.0
    assert changing.values["weights"] == [1.0] and changing.values["t"][0][0] == 0.0
    assert len(loads) == 1 + 8


def test_an_array_kwarg_is_not_kept_besides_its_serialized_bytes():
    # Before: every distinct value was kept twice (the object in the call-site
    # key and its pickle in the compiled call site).
    weights = np.linspace(0.0, 1.0, 1000)
    alive = weakref.ref(weights)
    y = jax.jit(lambda x: op(x, weights=weights)[0])(jnp.ones(1))  # noqa: F821  (a closure over a name deleted later, to drop its last reference)
    np.testing.assert_array_equal(y, np.linspace(0.0, 1.0, 1000))
    np.testing.assert_array_equal(op(jnp.ones(1), weights=weights)[0], np.linspace(0.0, 1.0, 1000))
    del weights
    gc.collect()
    assert alive() is None


_DUMP_IN_A_FRESH_PROCESS = """
import sys
from jaxbind._kwargs import Kwargs
kwargs = {"names": {"alpha", "beta", "gamma", "delta", "epsilon"},
          "frozen": frozenset({("x", 1), ("y", 2), ("z", frozenset({"p", "q", "r"}))}),
          "nested": [{"u", "v", "w"}, {"k": {"s", "t"}}]}
sys.stdout.write(Kwargs(kwargs, "probe").dump.hex())
"""


def test_kwargs_holding_sets_pickle_to_the_same_bytes_in_every_process(tmp_path):
    # A set's iteration order follows its strings' hashes, which differ between processes
    # (PYTHONHASHSEED): the bytes must not, or equal kwargs miss the persistent cache.
    import os
    import subprocess
    import sys

    dumps = set()
    for seed in ("1", "2", "3", "4"):
        env = dict(os.environ, PYTHONHASHSEED=seed)
        # (from elsewhere: in the repository the source folder jaxbind/ would shadow the installed package)
        result = subprocess.run(
            [sys.executable, "-c", _DUMP_IN_A_FRESH_PROCESS],
            env=env,
            cwd=tmp_path,
            capture_output=True,
            text=True,
            timeout=120,
            check=True,
        )
        dumps.add(result.stdout)
    assert len(dumps) == 1
    values = Kwargs.from_dump(bytes.fromhex(dumps.pop()))
    assert values.values == {
        "frozen": frozenset({("x", 1), ("y", 2), ("z", frozenset({"p", "q", "r"}))}),
        "names": {"alpha", "beta", "gamma", "delta", "epsilon"},
        "nested": [{"u", "v", "w"}, {"k": {"s", "t"}}],
    }


def test_equal_sets_built_in_different_orders_are_one_kwargs_value():
    a = {f"n{k}" for k in range(40)}
    b = set(a) | {f"junk{k}" for k in range(1000)}  # a larger table: another iteration order
    b -= {f"junk{k}" for k in range(1000)}
    assert a == b
    assert Kwargs({"s": a, "f": frozenset(a)}, "probe") == Kwargs({"s": b, "f": frozenset(b)}, "probe")
