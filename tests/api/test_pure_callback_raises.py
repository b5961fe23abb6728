"""Where a failing pure callback raises (issue 40, item 14), and what jaxbind.pure_callback refuses before
it binds (items 12 and 8): each against jax.pure_callback on the same program.

JAX runs a program that holds a pure callback before the call returns, so a callback's exception comes
out of the call, even when nobody uses the result; an ordinary jaxbind op keeps JAX's asynchronous
dispatch. The programs here are large enough (10^5 elements, a loop) that XLA runs them on its worker
threads, where an asynchronous call returns at once.
"""

import jax
import jax.numpy as jnp
import numpy as np
import pytest

import jaxbind

APIS = {"jax": jax.pure_callback, "jaxbind": jaxbind.pure_callback}
N = 200_000


class Diverged(Exception):
    pass


def diverges(v):
    raise Diverged("the integral diverged")


def where_it_raises(call):
    """'the call' if ``call()`` raised the callback's error, else 'the use' (or 'nowhere')."""
    try:
        result = call()
    except Exception as err:  # JAX's JaxRuntimeError (XlaRuntimeError before jax 0.6)
        assert "the integral diverged" in str(err)
        return "the call"
    try:
        jax.block_until_ready(result)
    except Exception as err:
        assert "the integral diverged" in str(err)
        return "the use"
    return "nowhere"


def large_program(pure_callback):
    @jax.jit
    def f(x):
        y = jnp.sin(x) * jnp.cos(x) + jnp.exp(-(x**2))  # work XLA splits over its threads
        z = pure_callback(diverges, jax.ShapeDtypeStruct(y.shape, y.dtype), y, vmap_method="sequential")
        return jnp.sum(y), z

    return f


@pytest.mark.parametrize("repeat", [0, 1], ids=["first call", "cached call"])
def test_a_failing_callback_raises_from_the_call_as_jaxs_does(repeat):
    x = jnp.linspace(0.0, 1.0, N)
    seen = {}
    for name, api in APIS.items():
        f = large_program(api)
        for _ in range(repeat + 1):
            seen[name] = where_it_raises(lambda f=f: f(x))
    assert seen == {"jax": "the call", "jaxbind": "the call"}


def error_if(x, pred, pure_callback):
    """An ``equinox.error_if``-like check: a callback that raises, called when ``pred`` holds."""

    def check(p):
        if p:
            raise Diverged("the integral diverged")
        return np.zeros((), np.bool_)

    failed = pure_callback(check, jax.ShapeDtypeStruct((), jnp.bool_), pred)
    return jnp.where(failed, jnp.nan, x)


def test_a_dropped_result_of_a_failing_check_raises_at_the_call_in_a_try():
    x = jnp.linspace(0.0, 1.0, N)
    raised = {}
    for name, api in APIS.items():

        @jax.jit
        def integrate(v, api=api):
            def step(i, total):
                return total + jnp.sum(jnp.sin(v * i))

            total = jax.lax.fori_loop(0, 20, step, 0.0)
            return error_if(total, ~jnp.isfinite(total) | (total > 0), api)

        raised[name] = False
        try:
            integrate(x)  # the result dropped, as a check's often is
        except Exception as err:
            raised[name] = "the integral diverged" in str(err)
    assert raised == {"jax": True, "jaxbind": True}


def test_a_check_that_passes_returns_what_jax_returns():
    x = jnp.linspace(0.0, 1.0, N)
    results = {
        name: jax.jit(lambda v, api=api: error_if(jnp.sum(jnp.sin(v)), jnp.sum(v) < 0, api))(x)
        for name, api in APIS.items()
    }
    np.testing.assert_allclose(results["jaxbind"], results["jax"], rtol=1e-13)
    np.testing.assert_allclose(results["jaxbind"], np.sum(np.sin(np.linspace(0.0, 1.0, N))), rtol=1e-10)


def test_both_callbacks_in_one_program():
    x = jnp.linspace(0.0, 1.0, N)

    @jax.jit
    def f(v):
        a = jax.pure_callback(np.sin, jax.ShapeDtypeStruct(v.shape, v.dtype), v)
        b = jaxbind.pure_callback(np.cos, jax.ShapeDtypeStruct(v.shape, v.dtype), v)
        c = jax.pure_callback(np.exp, jax.ShapeDtypeStruct(v.shape, v.dtype), b)
        return a + c

    expected = np.sin(np.asarray(x)) + np.exp(np.cos(np.asarray(x)))
    np.testing.assert_allclose(f(x), expected, rtol=1e-14)
    np.testing.assert_allclose(f(x + 1.0), np.sin(np.asarray(x) + 1.0) + np.exp(np.cos(np.asarray(x) + 1.0)))


def test_an_ordinary_op_keeps_asynchronous_dispatch():
    """Only pure callbacks wait (JAX's behaviour): an op's failure comes where its result is used."""

    def forward(out, args, kwargs):
        raise Diverged("the integral diverged")

    op = jaxbind.get_nonlinear_call(forward, None, lambda x: [(x.shape, x.dtype)], None)
    x = jnp.linspace(0.0, 1.0, N)
    f = jax.jit(lambda v: op(jnp.sin(v) * jnp.cos(v))[0])
    assert where_it_raises(lambda: f(x)) == "the use"
    g = jax.jit(lambda v: jaxbind.pure_callback(diverges, jax.ShapeDtypeStruct(v.shape, v.dtype), jnp.sin(v)))
    assert where_it_raises(lambda: g(x)) == "the call"


# -- what is refused before binding (items 12 and 8) ---------------------------------------------


def echo(x, **kwargs):
    return np.asarray(x)


@pytest.mark.parametrize("jit", [False, True], ids=["eager", "jit"])
def test_a_byte_swapped_result_spec_is_refused_as_jax_refuses_it(jit):
    swapped = np.dtype(np.float64).newbyteorder("S")  # '>f8' on this machine
    x = jnp.arange(3.0)
    refusals = {}
    for name, api in APIS.items():

        def call(v, api=api):
            return api(echo, jax.ShapeDtypeStruct((3,), swapped), v)

        with pytest.raises(TypeError) as info:
            (jax.jit(call) if jit else call)(x)
        refusals[name] = str(info.value)
    assert swapped.str in refusals["jax"]
    message = refusals["jaxbind"]
    assert message.startswith("jaxbind.pure_callback(echo): result_shape_dtypes leaf 0")
    assert swapped.str in message and "Declare float64" in message
    # the same values in this machine's order are what both return
    native = {name: api(echo, jax.ShapeDtypeStruct((3,), np.float64), x) for name, api in APIS.items()}
    np.testing.assert_array_equal(native["jaxbind"], native["jax"])


@pytest.mark.parametrize("jit", [False, True], ids=["eager", "jit"])
def test_setup_is_refused_with_the_op_that_takes_it(jit):
    x = jnp.arange(3.0)
    spec = jax.ShapeDtypeStruct((3,), x.dtype)
    for name, api in APIS.items():

        def call(v, api=api):
            return api(echo, spec, v, setup=lambda: np.eye(3))

        with pytest.raises(TypeError) as info:  # (JAX: "Error interpreting argument ... as a JAX value")
            (jax.jit(call) if jit else call)(x)
        if name == "jaxbind":
            message = str(info.value)
            assert message.startswith("jaxbind.pure_callback(echo): jaxbind.pure_callback takes no setup=")
            assert "jaxbind.get_nonlinear_call(..., setup=...)" in message
    # an array passed as setup= is the callback's keyword argument, as JAX passes it
    seen = {}

    def keeps(v, setup):
        seen[len(seen)] = np.array(setup)
        return np.asarray(v) + np.sum(setup)

    for api in APIS.values():
        call = lambda v, api=api: api(keeps, spec, v, setup=jnp.ones(2))
        np.testing.assert_allclose((jax.jit(call) if jit else call)(x), np.arange(3.0) + 2)
    np.testing.assert_array_equal(seen[0], seen[1])


def test_other_arguments_that_are_not_arrays_are_refused_by_name():
    x = jnp.arange(3.0)
    spec = jax.ShapeDtypeStruct((3,), x.dtype)
    for args, kwargs, where in (
        ((x, len), {}, "argument 1 is a builtin_function_or_method"),
        (({"a": x, "b": "text"},), {}, "argument 0['b'] is a str"),
        ((x,), {"scale": object()}, "keyword argument scale is a object"),
    ):
        with pytest.raises(TypeError, match="Error interpreting argument to"):
            jax.pure_callback(echo, spec, *args, **kwargs)
        with pytest.raises(TypeError) as info:
            jaxbind.pure_callback(echo, spec, *args, **kwargs)
        assert str(info.value).startswith(f"jaxbind.pure_callback(echo): {where};")


def test_a_dict_with_keys_of_mixed_types_is_named_and_works_closed_over():
    table = {1: 2.0, "b": 3.0}
    x = jnp.arange(3.0)
    spec = jax.ShapeDtypeStruct(x.shape, x.dtype)

    def scaled(v, table):
        return v * table[1] + table["b"]

    with pytest.raises(ValueError, match="Comparator"):  # the reference: JAX cannot flatten it either
        jax.pure_callback(scaled, spec, x, table=table)
    with pytest.raises(TypeError, match=r"pure_callback\(.*scaled\): keyword argument 'table' is a pytree"):
        jaxbind.pure_callback(scaled, spec, x, table=table)
    closed = {name: jax.jit(lambda v, api=api: api(lambda w: scaled(w, table), spec, v)) for name, api in APIS.items()}
    np.testing.assert_allclose(closed["jaxbind"](x), closed["jax"](x))
    np.testing.assert_allclose(closed["jaxbind"](x), x * 2.0 + 3.0)
