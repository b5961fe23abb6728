"""Ops with side effects (issue 42, item 2): ``effect="io"`` and ``effect="ordered"`` on
``get_nonlinear_call`` and ``get_linear_call``, with a Python callback and a native C kernel that keep a
running total (``_effects_kernels.py``: the C one in static variables).

Each program is checked against the same sequence of calls in a plain Python loop
(``_effects_kernels.reference``) and against the log of the values each call saw: a call whose result is
unused still runs, two equal calls run twice, ordered calls run in program order (within a program, across
successive programs, under ``scan``/``while_loop``/``cond``) as ``jax.experimental.io_callback(ordered=True)``
runs them, and what an op with an effect refuses is a ``ValueError`` naming the op. Threads and devices:
``test_effects_threads.py``; export, the persistent cache and exit: ``test_effects_persist.py``.
"""

import re

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from _effects_kernels import like, plain, reference, state
from jax.experimental import io_callback

import jaxbind

KINDS = ["python", "native"]
EFFECTS = ["io", "ordered"]
FAMILIES = ["nonlinear", "linear"]


def make(kind, effect, family="nonlinear", **flags):
    """A fresh state and an op of it (the native state reset: it is one per process)."""
    st = state(kind)
    st.reset()
    name = f"running_total_{kind}_{effect}_{family}"
    if family == "linear":
        op = jaxbind.get_linear_call(st.kernel, st.kernel, like, like, effect=effect, name=name, **flags)
    else:
        op = jaxbind.get_nonlinear_call(st.kernel, None, like, None, effect=effect, name=name, **flags)
    return st, op, name


def heavy(y):
    """Work of no value (0.0) that XLA cannot drop: an input made late by it is ready late."""
    return 0.0 * jnp.sum(jnp.sin(y) @ jnp.cos(y).T)


@pytest.mark.parametrize("family", FAMILIES)
@pytest.mark.parametrize("effect", EFFECTS)
@pytest.mark.parametrize("kind", KINDS)
def test_a_call_whose_result_is_unused_still_runs(kind, effect, family):
    st, op, _ = make(kind, effect, family)
    x = np.array([1.0, 2.0, 3.0])
    np.testing.assert_array_equal(jax.jit(lambda v: (op(v), v + 1)[1])(x), x + 1)
    jax.effects_barrier()
    assert st.log() == [1.0, 2.0, 3.0]
    # Inside a scan, too: each step's call runs though nothing reads it.
    jax.block_until_ready(jax.jit(lambda vs: jax.lax.scan(lambda c, v: (c + 1.0, op(v)), 0.0, vs)[0])(np.eye(3)))
    jax.effects_barrier()
    assert st.log() == [1.0, 2.0, 3.0] + list(np.eye(3).ravel())


@pytest.mark.parametrize("family", FAMILIES)
@pytest.mark.parametrize("effect", EFFECTS)
@pytest.mark.parametrize("kind", KINDS)
def test_equal_calls_run_twice(kind, effect, family):
    st, op, _ = make(kind, effect, family)
    x = np.array([1.0, 2.0, 4.0])
    got = jax.jit(lambda v: op(v)[0] + op(v)[0])(x)
    first, second = reference([x, x])
    np.testing.assert_array_equal(got, first + second)
    assert st.log() == [1.0, 2.0, 4.0] * 2
    # Eagerly too, each call at once.
    np.testing.assert_array_equal(op(x)[0], reference([x], 14.0)[0])
    assert st.log() == [1.0, 2.0, 4.0] * 3


def ordered_program(op):
    """Six calls on independent inputs; the first ones wait for the most work (an out-of-order
    scheduler would run the later ones first)."""

    def program(xs, y):
        return [op(xs[i] + heavy(y[: 40 * (6 - i)]))[0] for i in range(6)]

    return jax.jit(program)


@pytest.mark.parametrize("family", FAMILIES)
@pytest.mark.parametrize("kind", KINDS)
def test_ordered_calls_run_in_program_order(kind, family):
    st, op, _ = make(kind, "ordered", family)
    xs = np.arange(12.0).reshape(6, 2) + 1.0
    y = np.linspace(0.0, 1.0, 240 * 240).reshape(240, 240)
    program = ordered_program(op)
    runs = [program(xs, y) for _ in range(3)]  # dispatched without waiting: ordered across programs too
    want = reference(list(xs) * 3)
    for k, run in enumerate(runs):
        for i in range(6):
            np.testing.assert_array_equal(run[i], want[6 * k + i])
    assert st.log() == list(xs.ravel()) * 3
    if kind == "python":  # JAX's ordered io_callback on the same callback logs the same
        st.reset()
        jax_op = lambda v: [io_callback(plain(st), jax.ShapeDtypeStruct(v.shape, v.dtype), v, ordered=True)]
        jax_runs = [ordered_program(jax_op)(xs, y) for _ in range(3)]
        np.testing.assert_array_equal(np.array(jax_runs), np.array(runs))
        assert st.log() == list(xs.ravel()) * 3


@pytest.mark.parametrize("kind", KINDS)
def test_io_calls_all_run_once_each_in_some_order(kind):
    st, op, _ = make(kind, "io")
    xs = np.arange(12.0).reshape(6, 2) + 1.0
    y = np.linspace(0.0, 1.0, 240 * 240).reshape(240, 240)
    outs = np.array(ordered_program(op)(xs, y))
    jax.effects_barrier()
    log = np.array(st.log()).reshape(6, 2)
    assert sorted(map(tuple, log)) == sorted(map(tuple, xs))
    # Whatever order they ran in, each result is the loop's for that order.
    order = [int(row[0] - 1) // 2 for row in log]
    np.testing.assert_array_equal(outs[order], np.array(reference(log)))


@pytest.mark.parametrize("effect", EFFECTS)
@pytest.mark.parametrize("kind", KINDS)
def test_scan_while_loop_and_cond_as_a_python_loop(kind, effect):
    st, op, _ = make(kind, effect)
    xs = np.arange(15.0).reshape(5, 3)

    def step(carry, v):
        y = op(v)[0]
        return carry + y[-1], y

    carry, ys = jax.jit(lambda vs: jax.lax.scan(step, 0.0, vs))(xs)
    want = reference(xs)
    np.testing.assert_array_equal(ys, np.array(want))
    np.testing.assert_array_equal(carry, sum(w[-1] for w in want))

    def body(state_):
        i, acc = state_
        return i + 1, acc + op(jnp.asarray(xs)[i])[0]

    _, acc = jax.jit(lambda: jax.lax.while_loop(lambda s: s[0] < 5, body, (0, jnp.zeros(3))))()
    np.testing.assert_array_equal(acc, np.sum(reference(xs, float(xs.sum())), axis=0))

    branch = jax.jit(lambda p, v: jax.lax.cond(p, lambda u: op(u)[0], lambda u: -u, v))
    np.testing.assert_array_equal(branch(False, xs[0]), -xs[0])  # the branch not taken does not run
    np.testing.assert_array_equal(branch(True, xs[1]), reference([xs[1]], 2 * float(xs.sum()))[0])
    jax.effects_barrier()
    assert st.log() == list(xs.ravel()) * 2 + list(xs[1])


@pytest.mark.parametrize("kind", KINDS)
def test_an_io_op_vmaps_with_its_vmap_method_each_element_once(kind):
    st, op, _ = make(kind, "io")
    xs = np.arange(12.0).reshape(4, 3)
    outs = np.asarray(jax.jit(jax.vmap(lambda v: op(v)[0]))(xs))
    jax.effects_barrier()
    log = np.array(st.log()).reshape(4, 3)
    assert sorted(map(tuple, log)) == sorted(map(tuple, xs))
    order = [int(row[0]) // 3 for row in log]
    np.testing.assert_array_equal(outs[order], np.array(reference(log)))


def raises_naming(name, fn, *words):
    with pytest.raises(ValueError) as err:
        fn()
    text = str(err.value)
    assert f"jaxbind op '{name}'" in text or f"op '{name}'" in text, text
    for word in words:
        assert word in text, text
    return text


@pytest.mark.parametrize("family", FAMILIES)
@pytest.mark.parametrize("effect", EFFECTS)
def test_an_op_with_an_effect_has_no_derivatives_or_transpose(effect, family):
    _, op, name = make("python", effect, family)
    x = np.array([1.0, 2.0])
    f = lambda v: op(v)[0]
    raises_naming(name, lambda: jax.jvp(f, (x,), (x,)))
    raises_naming(name, lambda: jax.grad(lambda v: jnp.sum(f(v)))(x))
    raises_naming(name, lambda: jax.vjp(f, x))
    raises_naming(name, lambda: jax.jit(jax.grad(lambda v: jnp.sum(f(v))))(x))
    if family == "linear":
        raises_naming(name, lambda: jax.linear_transpose(f, x)(x))


@pytest.mark.parametrize("kind", KINDS)
def test_vmap_of_an_ordered_op_is_refused(kind):
    st, op, name = make(kind, "ordered")
    raises_naming(name, lambda: jax.vmap(lambda v: op(v)[0])(np.ones((3, 2))))
    raises_naming(name, lambda: jax.jit(jax.vmap(lambda v: op(v)[0]))(np.ones((3, 2))))
    assert st.log() == []


@pytest.mark.parametrize("bad", ["sometimes", "IO", "", True, 1])
@pytest.mark.parametrize("family", FAMILIES)
def test_a_bad_effect_value_names_the_op_and_the_accepted_values(bad, family):
    st = state("python")
    if family == "linear":
        make_op = lambda: jaxbind.get_linear_call(st.kernel, st.kernel, like, like, effect=bad, name="badfx")
    else:
        make_op = lambda: jaxbind.get_nonlinear_call(st.kernel, None, like, None, effect=bad, name="badfx")
    with pytest.raises(ValueError) as err:
        make_op()
    text = str(err.value)
    assert "badfx" in text and re.search(r"""['"]io['"]""", text) and re.search(r"""['"]ordered['"]""", text), text


@pytest.mark.parametrize("effect", EFFECTS)
def test_derivatives_given_with_an_effect_are_refused_at_construction(effect):
    st = state("python")
    with pytest.raises((TypeError, ValueError)) as err:
        jaxbind.get_nonlinear_call(st.kernel, (st.kernel, st.kernel), like, like, effect=effect, name="fx_with_jvp")
    assert "fx_with_jvp" in str(err.value), str(err.value)


@pytest.mark.parametrize("effect", EFFECTS)
@pytest.mark.parametrize("kind", KINDS)
def test_after_a_call_fails_the_next_one_runs_and_is_right(kind, effect):
    st, op, name = make(kind, effect)
    failing = jax.jit(lambda v: op(v, fail_on=5.0)[0])
    x, five = np.array([1.0, 2.0]), np.array([4.0, 5.0])
    np.testing.assert_array_equal(failing(x), reference([x])[0])
    with pytest.raises(RuntimeError, match="got a 5"):
        jax.block_until_ready(failing(five))
    # The failed call left the state as it was: the next calls, of the same program and another, go on.
    np.testing.assert_array_equal(failing(x), reference([x], 3.0)[0])
    np.testing.assert_array_equal(jax.jit(lambda v: op(v)[0])(five), reference([five], 6.0)[0])
    jax.effects_barrier()  # no error left behind for the barrier
    assert st.log() == [1.0, 2.0, 1.0, 2.0, 4.0, 5.0]


def test_an_op_with_an_effect_may_say_it_is_thread_safe():
    # Accepted: its calls may then overlap (test_effects_threads.py sees them do so).
    st, op, _ = make("python", "io", thread_safe=True)
    np.testing.assert_array_equal(jax.jit(lambda v: op(v)[0])(np.ones(2)), [1.0, 2.0])
    assert st.log() == [1.0, 1.0]
