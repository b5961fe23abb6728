"""Ops without derivatives: ``get_nonlinear_call(f, None, abstract, None)``.

Such an op binds a black box (here a NumPy Newton solver for the real root of
``x**3 + x = c``) that jits and vmaps; differentiating it raises an error that
names the op and says how to give it derivatives in JAX: ``jax.custom_jvp``,
``jax.custom_vjp`` or ``jax.lax.custom_root``. Wrapped in those, it
differentiates like any JAX function, to any order. The reference is Cardano's
formula in ``jax.numpy``.
"""

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from jax.test_util import check_grads

import jaxbind


def cubic_root(out, args, kwargs_dump):
    """The real root of x**3 + x = c, elementwise, by Newton's method (a black box to JAX)."""
    c = args[0]
    x = np.cbrt(c)
    for _ in range(100):
        step = (x**3 + x - c) / (3 * x**2 + 1)
        x = x - step
        if np.all(np.abs(step) <= 1e-15 * (1 + np.abs(x))):
            break
    out[0][...] = x


def like_input(c, **kwargs):
    return ((c.shape, c.dtype),)


root_op = jaxbind.get_nonlinear_call(cubic_root, None, like_input, None)


def solve(c):
    return root_op(c)[0]


def cardano(c):
    """The same root in closed form, differentiable by JAX: the reference."""
    s = jnp.sqrt(c**2 / 4 + 1 / 27)
    return jnp.cbrt(c / 2 + s) + jnp.cbrt(c / 2 - s)


@pytest.fixture
def c(rng):
    return rng.uniform(-3.0, 3.0, 7)


# ---------------------------------------------------------------------------
# Without derivatives: values under jit and vmap
# ---------------------------------------------------------------------------


def test_value_jit_and_eager(c):
    np.testing.assert_allclose(solve(c), cardano(c), rtol=1e-12, atol=1e-13)
    np.testing.assert_allclose(jax.jit(solve)(c), cardano(c), rtol=1e-12, atol=1e-13)


def test_vmap(rng):
    cs = rng.uniform(-3.0, 3.0, (4, 5, 3))
    np.testing.assert_allclose(jax.vmap(solve, in_axes=1, out_axes=1)(cs), cardano(cs), rtol=1e-12, atol=1e-13)
    nested = jax.jit(jax.vmap(jax.vmap(solve)))(cs)
    np.testing.assert_allclose(nested, cardano(cs), rtol=1e-12, atol=1e-13)


def test_held_constant_it_is_differentiable_around(c):
    # stop_gradient: no tangent reaches the op, so a derivative through the
    # rest of the function is fine: d/dc [c * root(c0)] = root(c0).
    grad = jax.grad(lambda v: jnp.sum(v * solve(jax.lax.stop_gradient(v))))(c)
    np.testing.assert_allclose(grad, cardano(c), rtol=1e-12, atol=1e-13)


# ---------------------------------------------------------------------------
# Differentiating it is an error naming the op and the ways out
# ---------------------------------------------------------------------------

DIFFERENTIATIONS = {
    "jvp": lambda f, x: jax.jvp(f, (x,), (jnp.ones_like(x),)),
    "grad": lambda f, x: jax.grad(lambda v: jnp.sum(f(v)))(x),
    "vjp": lambda f, x: jax.vjp(f, x),
    "jacfwd": lambda f, x: jax.jacfwd(f)(x),
    "jacrev": lambda f, x: jax.jacrev(f)(x),
    "hessian": lambda f, x: jax.hessian(lambda v: jnp.sum(f(v)))(x),
    "linearize": lambda f, x: jax.linearize(f, x),
    "linear_transpose": lambda f, x: jax.linear_transpose(f, x)(x),
    "jit(grad)": lambda f, x: jax.jit(jax.grad(lambda v: jnp.sum(f(v))))(x),
    "vmap(grad)": lambda f, x: jax.vmap(jax.grad(lambda v: jnp.sum(f(v))))(x[:, None]),
}


@pytest.mark.parametrize("how", DIFFERENTIATIONS)
def test_differentiating_is_an_error_that_names_the_op_and_the_remedies(how, c):
    with pytest.raises(ValueError, match=r"jaxbind op 'cubic_root' was made without derivatives") as info:
        DIFFERENTIATIONS[how](solve, c)
    for remedy in ("jax.custom_jvp", "jax.custom_vjp", "jax.lax.custom_root"):
        assert remedy in str(info.value)


def test_the_error_carries_the_op_name_given():
    named = jaxbind.get_nonlinear_call(cubic_root, None, like_input, None, name="newton_cubic")
    with pytest.raises(ValueError, match=r"jaxbind op 'newton_cubic' was made without derivatives"):
        jax.grad(lambda v: jnp.sum(named(v)[0]))(np.ones(2))


def test_fixed_arguments_stay_fixed():
    def shifted_root(out, args, kwargs_dump):  # root of x**3 + x = c + shift
        cubic_root(out, (args[0] + args[1],), kwargs_dump)

    op = jaxbind.get_nonlinear_call(
        shifted_root, None, lambda shift, c: ((c.shape, c.dtype),), None, first_n_args_fixed=1
    )
    c = np.linspace(-1.0, 1.0, 4)
    np.testing.assert_allclose(jax.jit(lambda s, v: op(s, v)[0])(0.5 * c, c), cardano(1.5 * c), rtol=1e-12)
    with pytest.raises(ValueError, match=r"op 'shifted_root'.*fixed"):
        jax.grad(lambda s: jnp.sum(op(s, c)[0]))(c)


# ---------------------------------------------------------------------------
# Given derivatives in JAX
# ---------------------------------------------------------------------------


@jax.custom_jvp
def root_with_jvp(c):
    return solve(c)


@root_with_jvp.defjvp
def _root_jvp(primals, tangents):
    (c,), (c_dot,) = primals, tangents
    # x**3 + x = c  =>  (3 x**2 + 1) dx = dc. Calling root_with_jvp itself (not
    # the op) for x makes the rule differentiable again: any order.
    x = root_with_jvp(c)
    return x, c_dot / (3 * x**2 + 1)


def test_custom_jvp_differentiates_to_second_order(c):
    np.testing.assert_allclose(
        jax.grad(lambda v: jnp.sum(root_with_jvp(v)))(c), jax.grad(lambda v: jnp.sum(cardano(v)))(c), rtol=1e-10
    )
    hessian_diag = jax.vmap(jax.grad(jax.grad(root_with_jvp)))(c)
    np.testing.assert_allclose(hessian_diag, jax.vmap(jax.grad(jax.grad(cardano)))(c), rtol=1e-9, atol=1e-12)
    check_grads(root_with_jvp, (c,), order=2, modes=("fwd", "rev"))


def test_custom_jvp_under_jit_and_vmap(rng):
    cs = rng.uniform(-3.0, 3.0, (3, 4))
    got = jax.jit(jax.vmap(jax.grad(lambda v: jnp.sum(jnp.sin(root_with_jvp(v))))))(cs)
    want = jax.vmap(jax.grad(lambda v: jnp.sum(jnp.sin(cardano(v)))))(cs)
    np.testing.assert_allclose(got, want, rtol=1e-10)
    np.testing.assert_allclose(jax.jacfwd(root_with_jvp)(cs[0]), jax.jacfwd(cardano)(cs[0]), rtol=1e-10, atol=1e-13)


@jax.custom_vjp
def root_with_vjp(c):
    return solve(c)


def _root_fwd(c):
    x = solve(c)
    return x, x  # the root is all the backward pass needs


def _root_bwd(x, x_bar):
    return (x_bar / (3 * x**2 + 1),)


root_with_vjp.defvjp(_root_fwd, _root_bwd)


def test_custom_vjp_gives_reverse_mode(c):
    loss = lambda f: lambda v: jnp.sum(jnp.cos(f(v)))
    np.testing.assert_allclose(jax.jit(jax.grad(loss(root_with_vjp)))(c), jax.grad(loss(cardano))(c), rtol=1e-10)
    np.testing.assert_allclose(jax.jacrev(root_with_vjp)(c), jax.jacrev(cardano)(c), rtol=1e-10, atol=1e-13)
    check_grads(root_with_vjp, (c,), order=1, modes=("rev",))


def root_by_custom_root(c):
    """x**3 + x = c with the op as the solve of lax.custom_root: implicit derivatives."""
    return jax.lax.custom_root(
        lambda x: x**3 + x - c,
        jnp.zeros_like(c),
        lambda f, x0: solve(c),  # the black box; custom_root never differentiates it
        lambda g, y: y / g(jnp.ones_like(y)),  # g, the Jacobian of f at the root, is diagonal
    )


def test_custom_root_gives_implicit_derivatives(c):
    np.testing.assert_allclose(root_by_custom_root(c), cardano(c), rtol=1e-12, atol=1e-13)
    loss = lambda f: lambda v: jnp.sum(f(v) ** 3)
    np.testing.assert_allclose(jax.jit(jax.grad(loss(root_by_custom_root)))(c), jax.grad(loss(cardano))(c), rtol=1e-10)
    np.testing.assert_allclose(jax.jacfwd(root_by_custom_root)(c), jax.jacfwd(cardano)(c), rtol=1e-10, atol=1e-13)
    check_grads(root_by_custom_root, (c,), order=1, modes=("fwd", "rev"))


# ---------------------------------------------------------------------------
# Bad definitions
# ---------------------------------------------------------------------------


def ident(out, args, kwargs_dump):
    out[0][...] = args[-1]


def test_half_a_derivative_pair_is_an_error():
    with pytest.raises(
        TypeError,
        match=r"op 'ident': f_vjp \(f_derivative\[1\]\) must be a Python callable "
        r"or a native kernel, got None. Give both f_jvp and f_vjp, or pass "
        r"f_derivative=None",
    ):
        jaxbind.get_nonlinear_call(ident, (ident, None), like_input, like_input)
    with pytest.raises(TypeError, match=r"op 'ident': f_jvp \(f_derivative\[0\]\) must be .* got None. Give both"):
        jaxbind.get_nonlinear_call(ident, (None, ident), like_input, like_input)


def test_abstract_reverse_without_derivatives_is_an_error():
    with pytest.raises(TypeError, match=r"op 'ident': f_derivative is None .* but abstract_reverse is given"):
        jaxbind.get_nonlinear_call(ident, None, like_input, like_input)


def test_derivatives_without_abstract_reverse_is_an_error():
    with pytest.raises(TypeError, match=r"op 'ident': abstract_reverse is None but f_derivative is given"):
        jaxbind.get_nonlinear_call(ident, (ident, ident), like_input, None)


def test_without_derivatives_the_forward_is_still_checked():
    with pytest.raises(TypeError, match=r"op 'ident': abstract must be callable"):
        jaxbind.get_nonlinear_call(ident, None, None, None)
    with pytest.raises(TypeError, match=r"f must be a Python callable or a native kernel"):
        jaxbind.get_nonlinear_call("ident", None, like_input, None)
