"""``setup=``'s cache of states, pinned (issue 40): least recently used first out, exactly ``setup_cache``
states kept, a setup that calls its own op from any thread, waiters when a setup raises, the cache after
``check_op``, the residuals of an op with ``n_residuals``; read-only states; the refusals when an op is
made."""

import functools
import os
import sys
import textwrap
import threading

import _subprocesses
import jax
import jax.numpy as jnp
import numpy as np
import pytest

import jaxbind
from jaxbind import _state
from jaxbind._state import state_cache


def like(x, *rest, **kwargs):
    return ((x.shape, x.dtype),)


def sine(out, args, kwargs_dump, state):  # y = sin(x), the state the copy of x setup made
    np.testing.assert_array_equal(state, args[0])
    out[0][...] = np.sin(args[0])


def sine_vjp(out, args, kwargs_dump, state):
    np.testing.assert_array_equal(state, args[0])
    out[0][...] = np.cos(args[0]) * args[1]


def copy_setup(made):
    def setup(args, kwargs):
        made.append(float(args[0][0]))
        return args[0]

    return setup


def sine_op(made, name, **options):
    return jaxbind.get_nonlinear_call(
        sine, (sine_vjp, sine_vjp), like, like, setup=copy_setup(made), name=name, **options
    )


def lru_misses(sequence, size):
    """The independent reference: how often functools.lru_cache of ``size`` computes over ``sequence``."""
    computed = []

    @functools.lru_cache(maxsize=size)
    def make(value):
        computed.append(value)

    for value in sequence:
        make(value)
    return computed


@pytest.mark.parametrize("size", [1, 2, 3, 5])
def test_the_cache_keeps_setup_cache_states_least_recently_used_first_out(size):
    made = []
    op = sine_op(made, f"sine_lru_{size}", setup_cache=size)
    call = jax.jit(lambda v: op(v)[0])
    rng = np.random.default_rng(size)
    # a walk that comes back to recent inputs: (0, 1, 0, 2, 0, 3 ...) makes oldest-first and LRU differ
    sequence = [0, 1, 0, 2, 0, 3, 1, 0, 4, 4, 2] + [int(k) for k in rng.integers(0, 7, 60)]
    for k in sequence:
        np.testing.assert_allclose(call(jnp.full(3, float(k))), np.sin(np.full(3, float(k))), rtol=1e-15)
    assert made == lru_misses(sequence, size)
    assert len(state_cache(op.definition)) == min(size, len(set(sequence)))


def test_one_kept_state_serves_a_repeated_call_and_its_gradient():
    made = []
    op = sine_op(made, "sine_one_kept", setup_cache=1)
    x = jnp.linspace(0.1, 1.0, 4)
    for _ in range(3):
        value, grad = jax.jit(jax.value_and_grad(lambda v: jnp.sum(op(v)[0])))(x)
        np.testing.assert_allclose(grad, np.cos(x), rtol=1e-15)
    assert made == [0.1]  # one state: made once, found by the forward and vjp of every call


def test_the_cache_keeps_states_after_check_op_clears_it():
    made = []
    op = sine_op(made, "sine_after_check")
    jaxbind.testing.check_op(op, jnp.linspace(0.1, 1.0, 4))
    cache, before = state_cache(op.definition), len(made)
    call = jax.jit(jax.value_and_grad(lambda v: jnp.sum(op(v)[0])))
    for k in range(3):
        for _ in range(2):
            _, grad = call(jnp.full(4, 2.0 + k))
            np.testing.assert_allclose(grad, np.cos(np.full(4, 2.0 + k)), rtol=1e-15)
    assert made[before:] == lru_misses([2.0, 2.0, 3.0, 3.0, 4.0, 4.0], 8) == [2.0, 3.0, 4.0]
    cache.clear()
    assert len(cache) == 0
    call(jnp.full(4, 2.0))
    call(jnp.full(4, 2.0))
    assert made[before:] == [2.0, 3.0, 4.0, 2.0] and len(cache) == 1


def newton(out, args, kwargs_dump, state):  # x with x**3 + a x = c, and the slope as a residual
    a, c = args
    assert state == (a.tobytes(), c.tobytes())  # the state of these primals
    x = np.cbrt(c)
    for _ in range(60):
        x = x - (x**3 + a * x - c) / (3 * x**2 + a)
    out[0][...] = x
    out[1][...] = 3 * x**2 + a


def newton_vjp(out, args, kwargs_dump, state):
    a, c, slope, x_ct = args  # primals, residual, cotangent
    assert state == (a.tobytes(), c.tobytes())
    x = np.cbrt(c)
    for _ in range(60):
        x = x - (x**3 + a * x - c) / (3 * x**2 + a)
    out[0][...] = -x * x_ct / slope
    out[1][...] = x_ct / slope


def test_the_derivatives_of_an_op_with_residuals_find_the_forwards_state():
    made = []

    def setup(args, kwargs):
        made.append(len(args))
        return tuple(a.tobytes() for a in args)

    op = jaxbind.get_nonlinear_call(
        newton,
        (newton_vjp, newton_vjp),
        lambda a, c: ((c.shape, c.dtype), (c.shape, c.dtype)),
        lambda a, c, slope, x_ct: ((a.shape, a.dtype), (c.shape, c.dtype)),
        n_residuals=1,
        setup=setup,
        name="newton_state",
    )
    a, c = jnp.linspace(0.5, 2.0, 6), jnp.linspace(-3.0, 3.0, 6)  # (c = 0: the reference's cbrt has no derivative)

    def reference(a, c):
        x = jnp.cbrt(c)
        for _ in range(60):
            x = x - (x**3 + a * x - c) / (3 * x**2 + a)
        return x

    loss = lambda f: lambda a, c: jnp.sum(jnp.sin(f(a, c)))
    grads = jax.jit(jax.grad(loss(lambda a, c: op(a, c)[0]), argnums=(0, 1)))(a, c)
    for got, want in zip(grads, jax.grad(loss(reference), argnums=(0, 1))(a, c)):
        np.testing.assert_allclose(got, want, rtol=1e-12, atol=1e-14)
    assert made == [2]  # one state, of the two primals: the vjp's residual is not part of its key


def test_threads_waiting_for_a_setup_that_raises_run_it_themselves(monkeypatch):
    # (the slice so long that only the failed setup's end can wake the waiter)
    monkeypatch.setattr(_state, "_WAIT_SLICE", 3600.0)
    started, release, runs = threading.Event(), threading.Event(), []

    def failing(args, kwargs):
        runs.append(threading.current_thread().name)
        if len(runs) == 1:
            started.set()
            release.wait(60)
        raise np.linalg.LinAlgError("Singular matrix")

    op = jaxbind.get_nonlinear_call(sine, None, like, None, setup=failing, name="singular_threads")
    cache, errors = state_cache(op.definition), {}

    def call(name):
        try:
            jax.jit(lambda v: op(v)[0])(jnp.ones(3)).block_until_ready()
        except Exception as err:
            errors[name] = str(err)

    first = threading.Thread(target=call, args=("first",), name="first", daemon=True)
    first.start()
    assert started.wait(120)
    second = threading.Thread(target=call, args=("second",), name="second", daemon=True)
    second.start()
    for _ in range(1200):  # until it waits for the first one's setup
        if cache.waits:
            break
        second.join(0.1)
    release.set()
    first.join(120)
    second.join(120)
    assert not first.is_alive() and not second.is_alive(), "a thread waits for ever for a setup that raised"
    assert cache.waits == 1 and runs == ["first", "second"]
    for name in ("first", "second"):
        assert "jaxbind op 'singular_threads': its setup 'failing' raised LinAlgError: Singular matrix" in errors[name]


NESTED_SCRIPT = textwrap.dedent("""
    import concurrent.futures, sys, threading
    import jax, jax.numpy as jnp, numpy as np
    import jaxbind
    from jaxbind import _state
    jax.config.update("jax_enable_x64", True)
    made, threads = [], []

    def setup(args, kwargs):
        made.append(threading.get_ident())
        if len(made) == 1:  # the first setup calls its own op on the same inputs (its own call does not)
            inner = run(lambda: np.asarray(inner_call(jnp.asarray(args[0]))))
            np.testing.assert_allclose(inner, 2 * np.sin(args[0]), rtol=1e-15)
        return 2.0

    def f(out, args, kwargs_dump, state):
        threads.append(threading.get_ident())
        out[0][...] = state * np.sin(args[0])

    like = lambda x: ((x.shape, x.dtype),)
    op = jaxbind.get_nonlinear_call(f, None, like, None, setup=setup, name="nested_" + sys.argv[1])
    n = 4
    inner_call = jax.jit(lambda v: op(v)[0])
    if sys.argv[1] == "same thread":
        _state._WAIT_SLICE = 3600.0  # (a call on the setup's thread must not wait at all)
        run = lambda g: g()
    elif sys.argv[1] == "pool thread":
        pool = concurrent.futures.ThreadPoolExecutor(2)
        run = lambda g: pool.submit(g).result()
    else:  # a program large enough that XLA runs it on its own threads, the setup's waiting for it
        n = 600
        run = lambda g: g()
        inner_call = jax.jit(lambda v: op(v)[0] + 0 * jnp.sum(jnp.sin(jnp.outer(v, v)) @ jnp.cos(jnp.outer(v, v))))
    x = jnp.linspace(0.0, 1.0, n)
    y = jax.jit(lambda v: op(v)[0])(x)
    np.testing.assert_allclose(y, 2 * np.sin(x), rtol=1e-15)
    cache = _state.state_cache(op.definition)
    print("setups", len(made), "waits", cache.waits, "kept", len(cache),
          "inner thread", "same" if threads[0] == made[0] else "other")
""")


@pytest.mark.parametrize("where", ["same thread", "pool thread", "XLA's threads"])
def test_a_setup_that_calls_its_own_op_on_the_same_inputs_gets_its_value(tmp_path, where):
    script = tmp_path / "nested_setup.py"
    script.write_text(NESTED_SCRIPT)
    parent = os.path.dirname(os.path.dirname(os.path.abspath(jaxbind.__file__)))
    env = {**os.environ, "PYTHONPATH": parent + os.pathsep + os.environ.get("PYTHONPATH", "")}
    code, out, err = _subprocesses.run([sys.executable, str(script), where], 240, f"a nested setup ({where})", env=env)
    assert code == 0, err[-3000:]
    # two setups (the outer, and the inner call's own), one state kept (the second is the same value)
    assert "setups 2" in out and "kept 1" in out, out
    if where == "same thread":
        assert "waits 0 " in out and "inner thread same" in out, out
    if where == "pool thread":
        assert "waits 1 " in out and "inner thread other" in out, out


def test_a_callback_cannot_write_into_the_arrays_of_its_state():
    def setup(args, kwargs):
        return {"count": np.ones(1), "scale": (np.full(3, 2.0), "a label")}

    def counting(out, args, kwargs_dump, state):
        state["count"] += 1  # (a mistake: the next call would see 2, 3 ...)
        out[0][...] = state["count"] * args[0]

    op = jaxbind.get_nonlinear_call(counting, None, like, None, setup=setup, name="counting")
    with pytest.raises(
        Exception, match="(?s)jaxbind op 'counting'.*ValueError.*read-only.*in the state setup made, are read-only"
    ):
        op(jnp.ones(3))

    # the arrays are read-only views: the setup's own arrays stay writeable
    mine = np.zeros(3)
    given = _state.read_only({"a": [mine, (mine, 1)], "b": mine})
    assert all(not v.flags.writeable for v in (given["a"][0], given["a"][1][0], given["b"]))
    assert mine.flags.writeable and np.shares_memory(given["b"], mine)
    assert type(given["a"]) is list and type(given["a"][1]) is tuple and given["a"][1][1] == 1
    plain = (1, "x", {"k": None})
    assert _state.read_only(plain) is plain


def test_check_op_finds_a_callback_that_changes_its_state():
    class Counter:
        def __init__(self):
            self.n = 1

    def counting(out, args, kwargs_dump, state):
        state.n += 1  # each call on the same state gives more
        out[0][...] = state.n * args[0]

    op = jaxbind.get_nonlinear_call(counting, None, like, None, setup=lambda args, kwargs: Counter(), name="counter")
    x = jnp.ones(3)
    np.testing.assert_array_equal(op(x)[0], 2 * np.ones(3))
    np.testing.assert_array_equal(op(x)[0], 3 * np.ones(3))  # what check_op must catch
    with pytest.raises(AssertionError, match="state: kept or made again.*changes its state"):
        jaxbind.testing.check_op(op, x)


def test_setup_cache_without_setup_is_refused_naming_the_op():
    def plain(out, args, kwargs_dump):
        out[0][...] = args[0]

    for f in (sine, plain):  # (callbacks that take a state: the cause is the missing setup all the same)
        for make in (
            lambda: jaxbind.get_nonlinear_call(f, None, like, None, setup_cache=4, name="no_setup"),
            lambda: jaxbind.get_linear_call(f, f, like, like, setup_cache=4, name="no_setup"),
            lambda: jaxbind.get_nonlinear_call(f, None, like, None, setup_cache=4),
        ):
            with pytest.raises(
                TypeError, match=f"jaxbind op '(no_setup|{f.__name__})': setup_cache=4 is given without setup"
            ):
                make()
    # with setup, or neither: accepted
    assert jaxbind.get_nonlinear_call(sine, None, like, None, setup=copy_setup([]), setup_cache=4, name="a")
    assert jaxbind.get_nonlinear_call(lambda out, args, kwargs_dump: None, None, like, None, name="b")


def test_a_setup_that_cannot_take_args_and_kwargs_is_refused_when_the_op_is_made():
    for bad in (lambda args: None, lambda: None, lambda args, kwargs, extra: None):
        with pytest.raises(
            TypeError, match=r"jaxbind op 'arity': setup \('<lambda>'\) cannot be called as setup\(args, kwargs\)"
        ):
            jaxbind.get_nonlinear_call(sine, None, like, None, setup=bad, name="arity")
        with pytest.raises(TypeError, match=r"jaxbind op 'arity': setup \('<lambda>'\) cannot be called"):
            jaxbind.get_linear_call(sine, sine, like, like, setup=bad, name="arity")
    # what can take two positional arguments is accepted, and so is what has no readable signature
    for good in (lambda *args: 0, lambda args, kwargs, extra=None: 0, functools.partial(lambda k, a, kw: 0, 1), max):
        op = jaxbind.get_nonlinear_call(sine, None, like, None, setup=good, name="arity_ok")
        assert state_cache(op.definition).setup is good


def test_a_waiter_stops_waiting_for_an_idle_setup_and_for_none_that_ends(monkeypatch):
    monkeypatch.setattr(_state, "_WAIT_SLICE", 0.01)
    idle = _state._Making(threading.get_ident())  # (this thread's setup: idle while this thread waits)
    assert idle.clock is not None or sys.platform != "linux"
    assert _state._wait_for(idle) is False
    idle.event.set()
    assert _state._wait_for(idle) is True
    # where threads have no CPU clock: a bounded wait
    monkeypatch.setattr(_state, "_own_cpu_clock", lambda: None)
    monkeypatch.setattr(_state, "_BLIND_WAIT", 0.05)
    blind = _state._Making(threading.get_ident())
    assert blind.clock is None and _state._wait_for(blind) is False
