"""Reference counts read by the running interpreter, never assumed: the baseline the kept-view checks
compare with is measured (CPython 3.14 counts a local passed to a call one lower than 3.11 and 3.13,
and not inside a ``finally`` an exception passes through), and a kept input or derived view is found
on the path where the callback returned and on the one where it raised, against jax.pure_callback."""

import gc

import jax
import jax.numpy as jnp
import numpy as np
import pytest

import jaxbind
from jaxbind import _kept_views, _pure_callback

pc = jaxbind.pure_callback


def like(x):
    return jax.ShapeDtypeStruct(jnp.shape(x), jnp.result_type(x))


def test_the_baseline_is_what_the_interpreter_counts_of_an_object_only_a_tuple_holds():
    lone = ([3],)  # (a list: the collector tracks the tuple that holds it, on every version)
    assert gc.get_referrers(lone[0]) == [lone]  # the independent reference: one holder
    assert _kept_views.held(lone, _kept_views.UNKEPT) == ()
    assert _kept_views.held(lone, _kept_views.UNKEPT - 1) == lone  # one lower would see it as kept
    also = [lone[0]]  # a second holder
    assert _kept_views.held(lone, _kept_views.UNKEPT) == lone
    assert also  # (alive until here)


@pytest.mark.parametrize("n_args", [1, 2])  # (one input takes a path of its own)
@pytest.mark.parametrize("fails", [False, True], ids=["returns", "raises"])
@pytest.mark.parametrize("what", ["input", "derived view"])
def test_a_kept_input_or_view_keeps_its_values_whether_the_callback_returns_or_raises(fails, what, n_args):
    def run(api):
        kept = []

        def cb(v, *more):
            kept.append(v if what == "input" else v[1:].reshape(1, -1))
            if fails:
                raise ValueError("no")
            return v

        f = jax.jit(lambda v: api(cb, like(v), v, *[v + 1.0] * (n_args - 1)))
        for k in range(3):
            try:
                f(jnp.full(4, float(k))).block_until_ready()
            except Exception:
                assert fails
        for k in range(3):  # later programs reuse XLA's buffers
            jax.jit(lambda v: v * -7.0)(jnp.arange(4.0) + k).block_until_ready()
        return [np.asarray(a).tolist() for a in kept]

    assert run(pc) == run(jax.pure_callback)
    assert len(run(pc)) == 3


@pytest.mark.parametrize("n_args", [1, 2])
@pytest.mark.parametrize("fails", [False, True], ids=["returns", "raises"])
def test_a_callback_that_keeps_nothing_is_never_searched_for_kept_views(monkeypatch, fails, n_args):
    searched = []
    monkeypatch.setattr(_pure_callback, "_keep_values", lambda views: searched.append(len(views)))

    def cb(v, *more):
        if fails:
            raise ValueError("no")
        return v * 2.0

    f = jax.jit(lambda v: pc(cb, like(v), v, *[v] * (n_args - 1)))
    x = jnp.arange(5.0)
    for _ in range(3):
        try:
            np.testing.assert_allclose(f(x), x * 2.0)
        except Exception:
            assert fails
    assert searched == []  # (a baseline one too low takes every call for a kept one)
