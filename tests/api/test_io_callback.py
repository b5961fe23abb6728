"""jaxbind.io_callback against jax.experimental.io_callback on the same callbacks (issue 42).

Each test runs the same callbacks through both and compares what they did: the calls each callback
logged (a list it appends to, in the order it ran), the results, or the exception (type and text)
where JAX refuses. The ordering, sharding and thread cases run in a child process
(test_io_callback_threads.py); these run in the test process, on its one CPU device.
"""

import logging
import re

import jax
import jax.experimental
import jax.numpy as jnp
import numpy as np
import pytest

import jaxbind

APIS = {"jax": jax.experimental.io_callback, "jaxbind": jaxbind.io_callback}
ORDERED = pytest.mark.parametrize("ordered", [False, True], ids=["unordered", "ordered"])
SCALAR = jax.ShapeDtypeStruct((), np.float64)


def like(x):
    return jax.ShapeDtypeStruct(jnp.shape(x), jnp.result_type(x))


def plain(tree):
    """A pytree of arrays as something ``==`` compares: its structure and each leaf's dtype, shape, values."""
    leaves, structure = jax.tree_util.tree_flatten(tree)
    return str(structure), [(str(np.asarray(a).dtype), np.shape(a), np.asarray(a).tolist()) for a in leaves]


def outcome(fn):
    """``("ok", plain(fn()))`` after every effect ran, or ``(type, message)`` of what ``fn`` raised."""
    try:
        out = fn()
        jax.block_until_ready(out)
        jax.effects_barrier()
        return "ok", plain(out)
    except Exception as err:  # compared between the two APIs
        # (jaxbind's refusals give JAX's words, then the op they name: "... (jaxbind op 'io_callback(f)')")
        return type(err), re.sub(r" \(jaxbind op '[^']*'\)$", "", str(err))


def compare(run):
    """``run(api)`` for JAX's io_callback and jaxbind's, which must give the same; jaxbind's result."""
    ref = run(APIS["jax"])
    got = run(APIS["jaxbind"])
    assert got == ref
    return got


def logging_callback(log, fn=lambda *a: a[0]):
    """A callback that logs its arguments (as lists) and returns ``fn`` of them as NumPy arrays."""

    def cb(*args, **kwargs):
        log.append([np.asarray(a).tolist() for a in args] + [np.asarray(kwargs[k]).tolist() for k in sorted(kwargs)])
        return jax.tree_util.tree_map(np.asarray, fn(*args, **kwargs))

    return cb


@ORDERED
def test_calls_whose_results_are_unused_still_run(ordered):
    def run(api):
        log = []
        cb = logging_callback(log)
        f = jax.jit(
            lambda v: (api(cb, like(v), v, ordered=ordered), api(cb, like(v), v + 1, ordered=ordered), 2 * v)[2]
        )
        out = f(jnp.arange(3.0))
        jax.effects_barrier()
        return plain(out), sorted(log)

    out, log = compare(run)
    assert log == [[np.arange(3.0).tolist()], [(np.arange(3.0) + 1).tolist()]]
    assert out == plain(2 * np.arange(3.0))


@ORDERED
def test_equal_calls_run_twice(ordered):
    def run(api):
        log = []
        cb = logging_callback(log, lambda a: a + len(log))  # a stateful callback: each call returns another value
        out = jax.jit(lambda v: api(cb, like(v), v, ordered=ordered) + api(cb, like(v), v, ordered=ordered))(4.0)
        jax.effects_barrier()
        return plain(out), log

    out, log = compare(run)
    assert log == [[4.0], [4.0]]
    assert out == plain(np.float64(4.0 + 1 + 4.0 + 2))


@ORDERED
def test_scan_while_loop_and_cond_call_as_jax_does(ordered):
    def in_scan(api, cb, xs):
        def body(c, x):
            api(cb, like(x), -x, ordered=ordered)  # (its result unused)
            return c + 1.0, api(cb, like(x), x * c, ordered=ordered)

        return jax.lax.scan(body, 1.0, xs)

    def in_while(api, cb, v):
        return jax.lax.while_loop(lambda c: c < 5.0, lambda c: api(cb, like(c), c, ordered=ordered) + 1.0, v)

    def in_cond(api, cb, p, v):
        return jax.lax.cond(
            p, lambda w: api(cb, like(w), w, ordered=ordered), lambda w: api(cb, like(w), -w, ordered=ordered) * 3, v
        )

    def run(api):
        logs = {}
        outs = {}
        for name, fn, args in [
            ("scan", in_scan, (jnp.arange(5.0),)),
            ("while", in_while, (0.5,)),
            ("cond", in_cond, (True, 2.0)),
            ("cond-false", in_cond, (False, 2.0)),
        ]:
            log = logs[name] = []
            cb = logging_callback(log)
            outs[name] = plain(jax.jit(fn, static_argnums=(0, 1))(api, cb, *args))
            jax.effects_barrier()
        return outs, logs

    outs, logs = compare(run)
    xs = np.arange(5.0)
    assert sorted(logs["scan"]) == sorted([[x * (1.0 + k)] for k, x in enumerate(xs)] + [[-x] for x in xs])
    if ordered:  # in the loop's order
        assert logs["scan"] == [call for k, x in enumerate(xs) for call in ([-x], [x * (1.0 + k)])]
    assert outs["scan"] == plain((np.float64(6.0), xs * (1.0 + np.arange(5.0))))
    assert logs["while"] == [[0.5 + k] for k in range(5)]
    assert logs["cond"] == [[2.0]] and logs["cond-false"] == [[-2.0]]
    assert outs["cond-false"] == plain(np.float64(-6.0))


def test_vmap_of_an_ordered_callback_is_refused_with_jaxs_text():
    def run(api):
        f = lambda v: api(np.sin, like(v), v, ordered=True)
        return [outcome(lambda: jax.vmap(f)(jnp.arange(3.0))), outcome(lambda: jax.jit(jax.vmap(f))(jnp.arange(3.0)))]

    result = compare(run)
    assert result[0] == (ValueError, "Cannot `vmap` ordered IO callback.")


def vmapped_calls(api, levels, jit):
    """The calls an unordered callback logs under ``levels`` nested vmaps, and the results."""
    log = []
    cb = logging_callback(log, lambda a, b, scale: {"sum": a + b * scale, "b": b})

    def f(a, b):
        return api(cb, {"sum": like(a), "b": like(b)}, a, b, scale=np.float64(2.0))

    x = jnp.arange(6.0).reshape(3, 2)
    if levels == 1:
        f, args = jax.vmap(f, in_axes=(0, None)), (x, 7.0)
    else:
        f, args = jax.vmap(jax.vmap(f, in_axes=(0, 0)), in_axes=(1, None)), (x, jnp.arange(3.0) + 10)
    out = (jax.jit(f) if jit else f)(*args)
    jax.effects_barrier()
    return plain(out), log


@pytest.mark.parametrize("jit", [False, True], ids=["eager", "jit"])
def test_vmap_of_an_unordered_callback_runs_once_per_element_in_order(jit):
    out, log = compare(lambda api: vmapped_calls(api, 1, jit))
    x = np.arange(6.0).reshape(3, 2)
    assert log == [[x[k].tolist(), 7.0, 2.0] for k in range(3)]
    assert out[1][1] == ("float64", (3, 2), (x + 2 * 7.0).tolist())


@pytest.mark.parametrize("jit", [False, True], ids=["eager", "jit"])
def test_nested_vmaps_of_an_unordered_callback_make_jaxs_calls(jit):
    (out, log), (ref_out, ref_log) = vmapped_calls(APIS["jaxbind"], 2, jit), vmapped_calls(APIS["jax"], 2, jit)
    x = np.arange(6.0).reshape(3, 2)
    assert out == ref_out
    # JAX's: the inner vmap's loop (over x's rows) is made first, and the outer vmap's runs inside it
    assert ref_log == [[x[i, j], 10.0 + i, 2.0] for i in range(3) for j in range(2)]
    # jaxbind's walk runs the outer vmap's level outermost: the same calls, in another order (an
    # unordered callback's calls have none; an ordered one refuses vmap)
    assert log == [[x[i, j], 10.0 + i, 2.0] for j in range(2) for i in range(3)]
    assert out[1][1] == ("float64", (2, 3), (x + 2 * (np.arange(3.0) + 10)[:, None]).T.tolist())


@ORDERED
def test_jvp_grad_and_transpose_are_refused_with_jaxs_texts(ordered):
    def run(api):
        f = lambda v: api(lambda a: 2 * a, like(v), v, ordered=ordered)
        return {
            "jvp": outcome(lambda: jax.jvp(f, (1.0,), (1.0,))),
            "grad": outcome(lambda: jax.grad(f)(1.0)),
            "jit-grad": outcome(lambda: jax.jit(jax.grad(f))(1.0)),
            "vjp": outcome(lambda: jax.vjp(f, 1.0)),
            "transpose": outcome(lambda: jax.linear_transpose(f, 1.0)(1.0)),
            "jit-transpose": outcome(lambda: jax.jit(jax.linear_transpose(f, 1.0))(1.0)),
        }

    result = compare(run)
    assert result["grad"] == (ValueError, "IO callbacks do not support JVP.")
    assert result["transpose"] == (ValueError, "IO callbacks do not support transpose.")


@ORDERED
def test_under_custom_jvp_and_custom_vjp_as_jax_does(ordered):
    # Refused or run, and then with the same calls and values: whatever the installed JAX's does.
    def run(api):
        log = []
        cb = logging_callback(log, np.sin)

        @jax.custom_jvp
        def sin(x):
            return api(cb, like(x), x, ordered=ordered)

        @sin.defjvp
        def sin_jvp(primals, tangents):
            (x,), (t,) = primals, tangents
            return sin(x), jnp.cos(x) * t

        @jax.custom_vjp
        def sin2(x):
            return api(cb, like(x), x, ordered=ordered)

        sin2.defvjp(lambda x: (sin2(x), x), lambda x, g: (jnp.cos(x) * g,))

        cos_cb = logging_callback(log, np.cos)

        @jax.custom_jvp
        def sin3(x):  # a callback in the rule too
            return api(cb, like(x), x, ordered=ordered)

        @sin3.defjvp
        def sin3_jvp(primals, tangents):
            (x,), (t,) = primals, tangents
            return sin3(x), api(cos_cb, like(x), x, ordered=ordered) * t

        @jax.custom_vjp
        def sin4(x):
            return api(cb, like(x), x, ordered=ordered)

        sin4.defvjp(lambda x: (sin4(x), x), lambda x, g: (api(cos_cb, like(x), x, ordered=ordered) * g,))
        x = 0.5
        outcomes = {}
        for name, fn in [
            ("jvp call", lambda: sin(x)),
            ("jvp jit", lambda: jax.jit(sin)(x)),
            ("jvp grad", lambda: jax.grad(sin)(x)),
            ("jvp jit grad", lambda: jax.jit(jax.grad(sin))(x)),
            ("vjp call", lambda: sin2(x)),
            ("vjp jit", lambda: jax.jit(sin2)(x)),
            ("vjp grad", lambda: jax.grad(sin2)(x)),
            ("vjp jit grad", lambda: jax.jit(jax.grad(sin2))(x)),
            ("jvp rule grad", lambda: jax.grad(sin3)(x)),
            ("jvp rule jit grad", lambda: jax.jit(jax.grad(sin3))(x)),
            ("vjp rules grad", lambda: jax.grad(sin4)(x)),
            ("vjp rules jit grad", lambda: jax.jit(jax.grad(sin4))(x)),
        ]:
            log.clear()
            outcomes[name] = outcome(fn), list(log)
        return outcomes

    outcomes = compare(run)
    for name, (result, log) in outcomes.items():
        if result[0] == "ok":  # (the value checked against NumPy where JAX's runs)
            assert result[1] == plain(np.cos(0.5) if "grad" in name else np.sin(0.5)), name
            assert sorted(log) == [[0.5]] * (2 if "rule" in name else 1), name


@ORDERED
@pytest.mark.parametrize("jit", [False, True], ids=["eager", "jit"])
def test_pytrees_in_arguments_keywords_and_results(ordered, jit):
    def cb(pair, y, *, scale, extra=None):
        a, b = pair
        return {"sum": np.asarray(a + b * scale), "parts": (np.asarray(y).astype(np.int32), np.float32(2.5))}

    def call(api, x, y):
        spec = {
            "sum": like(x),
            "parts": (jax.ShapeDtypeStruct(y.shape, np.int32), jax.ShapeDtypeStruct((), np.float32)),
        }
        return api(cb, spec, (x, 2 * x), y, scale=x[0], extra={"n": y}, ordered=ordered)

    x, y = jnp.linspace(1.0, 2.0, 5), jnp.arange(3.0)
    fn = jax.jit(call, static_argnums=0) if jit else call
    got = compare(lambda api: outcome(lambda: fn(api, x, y)))
    assert got == ("ok", plain(cb((np.asarray(x), 2 * np.asarray(x)), np.asarray(y), scale=np.asarray(x)[0])))


@ORDERED
def test_eager_calls_run_at_once_with_jax_arrays_on_cpu(ordered):
    def run(api):
        seen = []

        def cb(v, *, w):
            seen.append((isinstance(v, jax.Array), isinstance(w, jax.Array), [d.platform for d in v.devices()]))
            seen.append(np.asarray(v).tolist())
            return np.asarray(v) * w

        x = jnp.arange(3.0)
        out = api(cb, like(x), x, w=jnp.float64(3.0), ordered=ordered)
        log_before_barrier = list(seen)  # it ran at once
        return isinstance(out, jax.Array), plain(out), log_before_barrier

    is_array, out, log = compare(run)
    assert is_array
    assert log == [(True, True, ["cpu"]), [0.0, 1.0, 2.0]]
    assert out == plain(3 * np.arange(3.0))


@ORDERED
@pytest.mark.parametrize("result_shape_dtypes", [None, (), {}], ids=["None", "tuple", "dict"])
def test_callbacks_with_no_results_still_run(ordered, result_shape_dtypes):
    def run(api):
        log = []

        def cb(v):
            log.append(np.asarray(v).tolist())
            return result_shape_dtypes

        out = jax.jit(lambda v: (api(cb, result_shape_dtypes, v, ordered=ordered), v + 1))(jnp.arange(2.0))
        jax.effects_barrier()
        eager = api(cb, result_shape_dtypes, jnp.arange(3.0), ordered=ordered)
        return plain(out), plain(eager), log

    _, _, log = compare(run)
    assert log == [[0.0, 1.0], [0.0, 1.0, 2.0]]


def the_solver_diverges(v):
    if np.any(np.asarray(v) < 0):
        raise KeyError("the solver diverged")
    return np.asarray(v)


def failure_of(fn):
    """What ``fn()`` raised: its type and whether its text carries the callback's exception."""
    with pytest.raises(Exception) as info:
        jax.block_until_ready(fn())
        jax.effects_barrier()
    return type(info.value), "KeyError: 'the solver diverged'" in str(info.value)


@ORDERED
def test_a_failing_callback_is_logged_and_raises_as_jaxs_then_the_next_call_runs(ordered, caplog):
    def run(api):
        f = jax.jit(lambda v: api(the_solver_diverges, like(v), v, ordered=ordered) * 2)
        x = jnp.arange(3.0)
        result = []
        for call in (  # the first call of f, its cached program, an eager call
            lambda: f(-x),
            lambda: f(-x),
            lambda: api(the_solver_diverges, like(x), -x, ordered=ordered),
        ):
            caplog.clear()
            with caplog.at_level(logging.WARNING):
                result.append(failure_of(call))
            result.append([(r.name, r.levelname, r.getMessage(), r.exc_info is not None) for r in caplog.records])
            result.append(outcome(lambda: f(x)))  # the next call runs
        result.append(outcome(lambda: api(the_solver_diverges, like(x), x + 1, ordered=ordered)))
        return result

    result = compare(run)
    assert result[0] == (jax.errors.JaxRuntimeError, True)
    assert result[1] == [("jax._src.callback", "ERROR", "jax.io_callback failed", True)]
    assert result[2] == result[5] == ("ok", plain(2 * np.arange(3.0)))
    assert result[-1] == ("ok", plain(np.arange(3.0) + 1))


WRONG_RESULTS = {
    "shape": lambda v: np.ones(4),
    "dtype": lambda v: np.asarray(v) + 1j,
    "narrower dtype": lambda v: np.asarray(v, np.float32),
    "integer dtype": lambda v: np.asarray(v, np.int32),
    "count": lambda v: (v, v),
    "none": lambda v: None,
}


def refusal_of_wrong_results(api, cb, ordered):
    """Its type and the line that says what was wrong, jitted and eagerly (or "no error")."""
    x = jnp.arange(3.0)
    result = []
    for call in (
        lambda: jax.jit(lambda v: api(cb, like(v), v, ordered=ordered))(x),
        lambda: api(cb, like(x), x, ordered=ordered),
    ):
        try:
            jax.block_until_ready(call())
            jax.effects_barrier()
            result.append("no error")
        except Exception as err:  # its type and the line that says what was wrong
            result.append((type(err), re.findall(r"(?m)^\w+Error: (.*)$", str(err))[-1]))
    return result


@ORDERED
@pytest.mark.parametrize("wrong", list(WRONG_RESULTS))
def test_wrong_result_shapes_and_dtypes_are_refused_as_jax_refuses_them(ordered, wrong):
    ref = refusal_of_wrong_results(APIS["jax"], WRONG_RESULTS[wrong], ordered)
    got = refusal_of_wrong_results(APIS["jaxbind"], WRONG_RESULTS[wrong], ordered)
    assert "no error" not in ref
    for (got_type, got_line), (ref_type, ref_line) in zip(got, ref):
        assert got_type is ref_type
        assert got_line.endswith(ref_line)  # JAX's words, after the op's name
