"""inplace=: outputs that are arguments updated in place, against jax.numpy."""

import _kernels
import jax
import jax.numpy as jnp
import numpy as np
import pytest
from _shared import checking_unwritten

import jaxbind

LIB = _kernels.load()
same = lambda *args, **kwargs: ((args[-1].shape, args[-1].dtype),)
shared = []  # whether out[0] and args[j] were one memory, call by call


def relax(out, args, kwargs_dump):  # u <- u / 2 + 1, on the memory it finds u in
    shared.append(np.shares_memory(out[0], args[-1]))
    u = out[0]
    u *= 0.5
    u += 1.0


def relax_ref(u):
    return u / 2 + 1


def relax_jvp(out, args, kwargs_dump):  # (u, du) -> du / 2
    out[0][...] = args[1] / 2


op = jaxbind.get_nonlinear_call(relax, (relax_jvp, relax_jvp), same, same, inplace={0: 0})


@pytest.fixture(autouse=True)
def _clear():
    shared.clear()


def test_eager_jit_and_an_argument_used_afterwards():
    x = jnp.linspace(0.0, 1.0, 7)
    np.testing.assert_allclose(op(x)[0], relax_ref(x))
    np.testing.assert_allclose(jax.jit(lambda v: op(v)[0])(x), relax_ref(x))
    np.testing.assert_allclose(jax.jit(lambda v: op(v)[0] + v)(x), relax_ref(x) + x)  # v unchanged
    np.testing.assert_allclose(x, np.linspace(0.0, 1.0, 7))  # the caller's array too
    assert shared and all(shared)


def test_loop_carries_are_updated_where_they_stand():
    x = jnp.linspace(0.0, 1.0, 1000)
    ref = x
    for _ in range(50):
        ref = relax_ref(ref)
    fori = jax.jit(lambda v: jax.lax.fori_loop(0, 50, lambda i, c: op(c)[0], v))
    scan = jax.jit(lambda v: jax.lax.scan(lambda c, _: (op(c)[0], None), v, None, length=50)[0])
    np.testing.assert_allclose(fori(x), ref, rtol=1e-14)
    np.testing.assert_allclose(scan(x), ref, rtol=1e-14)
    np.testing.assert_allclose(x, np.linspace(0.0, 1.0, 1000))


def test_a_donated_argument_is_the_output():
    x = jnp.linspace(0.0, 1.0, 1 << 16)
    expected = relax_ref(np.asarray(x))
    pointer = x.unsafe_buffer_pointer()
    y = jax.jit(lambda v: op(v)[0], donate_argnums=0)(x)
    np.testing.assert_allclose(y, expected)
    assert y.unsafe_buffer_pointer() == pointer  # no new buffer: the argument's own
    assert x.is_deleted()


def test_grad_jvp_and_the_forward_call_stay_in_place():
    x = jnp.linspace(0.0, 1.0, 5)
    np.testing.assert_allclose(jax.grad(lambda v: jnp.sum(op(v)[0] ** 2))(x), relax_ref(x), rtol=1e-14)
    y, t = jax.jvp(lambda v: op(v)[0], (x,), (jnp.ones(5),))
    np.testing.assert_allclose(y, relax_ref(x))
    np.testing.assert_allclose(t, 0.5 * np.ones(5))
    jax.test_util.check_grads(lambda v: op(v)[0], (x,), order=1, modes=("fwd", "rev"))
    assert shared and all(shared)  # every forward call, under grad and jvp too, found u in place


@pytest.mark.parametrize("method", ["sequential", "expand_dims", "broadcast_all"])
def test_vmap_walks_and_whole_batches(method):
    batched = jaxbind.get_nonlinear_call(
        relax, None, same, None, inplace={0: 0}, vmap_method=method, name=f"relax_{method}"
    )
    x = jnp.arange(24.0).reshape(2, 3, 4)
    np.testing.assert_allclose(jax.jit(jax.vmap(lambda v: batched(v)[0]))(x), relax_ref(x))
    np.testing.assert_allclose(jax.jit(jax.vmap(jax.vmap(lambda v: batched(v)[0])))(x), relax_ref(x))
    np.testing.assert_allclose(jax.jit(jax.vmap(lambda v: batched(v)[0], in_axes=1, out_axes=1))(x), relax_ref(x))
    assert all(shared)


def test_an_unmapped_argument_updated_in_place_is_broadcast():
    def shift(out, args, kwargs_dump):  # (b, u) -> u + b, u in place
        out[0][...] += args[0]

    shifted = jaxbind.get_nonlinear_call(shift, None, same, None, inplace={0: 1})
    b, u = jnp.arange(4.0), jnp.ones(3)
    got = jax.jit(jax.vmap(lambda bb, uu: shifted(bb, uu)[0], in_axes=(0, None)))(b, u)
    np.testing.assert_allclose(got, u[None] + b[:, None])
    np.testing.assert_allclose(u, np.ones(3))


def test_self_batching_aliases_each_element():
    def scale_rows(out, args, kwargs_dump):  # func_can_batch: any layout; u <- 3 u
        out[0][...] *= 3.0

    def abstract(u, batch_axes=None):
        axis = batch_axes[0][-1] if batch_axes and batch_axes[0] else None
        return ((u.shape, u.dtype, axis),) if batch_axes is not None else ((u.shape, u.dtype),)

    native = jaxbind.get_nonlinear_call(scale_rows, None, abstract, None, func_can_batch=True, inplace={0: 0})
    x = jnp.arange(12.0).reshape(3, 4)
    np.testing.assert_allclose(jax.jit(jax.vmap(lambda v: native(v)[0]))(x), 3 * x)
    np.testing.assert_allclose(jax.jit(jax.vmap(lambda v: native(v)[0], in_axes=1, out_axes=1))(x), 3 * x)
    np.testing.assert_allclose(x, np.arange(12.0).reshape(3, 4))


def test_a_fixed_argument_beside_an_in_place_linear_one():
    def scale(out, args, kwargs_dump):  # (a, x) -> a x, x in place
        out[0][...] *= args[0]

    def scale_T(out, args, kwargs_dump):  # (a, ct) -> a ct, out of place
        out[0][...] = args[0] * args[1]

    lin = jaxbind.get_linear_call(scale, scale_T, same, same, first_n_args_fixed=1, inplace={0: 1})
    a, x = jnp.linspace(1.0, 2.0, 4), jnp.arange(4.0)
    np.testing.assert_allclose(jax.jit(lambda v: lin(a, v)[0])(x), a * x)
    np.testing.assert_allclose(jax.grad(lambda v: jnp.sum(lin(a, v)[0] ** 2))(x), 2 * a * a * x)
    np.testing.assert_allclose(jax.linear_transpose(lambda v: lin(a, v)[0], x)(jnp.ones(4))[0], a)
    jax.test_util.check_grads(lambda v: lin(a, v)[0], (x,), order=2, modes=("fwd", "rev"))


def test_two_outputs_of_which_one_is_in_place():
    def step(out, args, kwargs_dump):  # u <- u + 1 in place; and the old sum
        out[1][...] = np.sum(args[0])
        out[0][...] += 1.0

    both = jaxbind.get_nonlinear_call(step, None, lambda u: ((u.shape, u.dtype), ((), u.dtype)), None, inplace={0: 0})
    x = jnp.arange(5.0)
    u, s = jax.jit(lambda v: tuple(both(v)))(x)
    np.testing.assert_allclose(u, x + 1)
    np.testing.assert_allclose(s, np.sum(np.arange(5.0)))


def test_native_and_numba_kernels_in_place():
    pytest.importorskip("numba")
    c_op = jaxbind.get_linear_call(LIB.jb_scale, LIB.jb_scale, same, same, inplace={0: 0})

    def nb_scale(out, args, kwargs):  # reads each element before writing it: right in place or not
        for i in range(out[0].size):
            out[0].flat[i] = 2.0 * args[0].flat[i]

    nb_op = jaxbind.get_linear_call(
        jaxbind.numba_kernel(nb_scale), jaxbind.numba_kernel(nb_scale), same, same, inplace={0: 0}
    )
    x = jnp.linspace(0.0, 1.0, 6)
    for kernel_op in (c_op, nb_op):
        np.testing.assert_allclose(jax.jit(lambda v: kernel_op(v, factor=2.0)[0])(x), 2 * x)
        np.testing.assert_allclose(
            jax.jit(jax.vmap(lambda v: kernel_op(v, factor=2.0)[0]))(x.reshape(2, 3)), 2 * x.reshape(2, 3)
        )
        loop = jax.jit(lambda v: jax.lax.fori_loop(0, 10, lambda i, c: kernel_op(c, factor=2.0)[0], v))
        np.testing.assert_allclose(loop(x), 1024 * x)
        np.testing.assert_allclose(jax.grad(lambda v: jnp.sum(kernel_op(v, factor=2.0)[0]))(x), 2 * np.ones(6))
    np.testing.assert_allclose(x, np.linspace(0.0, 1.0, 6))


def test_the_checking_mode_accepts_elements_left_as_they_were():
    def half(out, args, kwargs_dump):  # updates only the first half
        out[0][: out[0].size // 2] = 0.0

    partial = jaxbind.get_nonlinear_call(half, None, same, None, inplace={0: 0})
    x = jnp.arange(6.0)
    with checking_unwritten():
        np.testing.assert_allclose(jax.jit(lambda v: partial(v)[0])(x), [0, 0, 0, 3, 4, 5])


@pytest.mark.parametrize(
    "inplace, error, match",
    [
        ([0, 0], TypeError, "inplace must be a dict"),
        ({0: -1}, ValueError, "argument index must be a non-negative integer"),
        ({"a": 0}, ValueError, "output index must be a non-negative integer"),
        ({0: 0, 1: 0}, ValueError, r"inplace puts outputs \[0, 1\] on argument 0"),
    ],
)
def test_bad_mappings_are_refused_when_the_op_is_made(inplace, error, match):
    with pytest.raises(error, match=match):
        jaxbind.get_nonlinear_call(relax, None, same, None, inplace=inplace)


@pytest.mark.parametrize(
    "inplace, abstract, match",
    [
        ({1: 0}, same, r"op 'relax': inplace maps output 1 to argument 0, but its abstract declares 1 output"),
        ({0: 3}, same, r"inplace maps output 0 to argument 3, but the op was called with 1 argument"),
        ({0: 0}, lambda u: (((2,), u.dtype),), r"the output is float64\[2\] and the argument float64\[5\]"),
        ({0: 0}, lambda u: ((u.shape, np.float32),), r"the output is float32\[5\] and the argument float64\[5\]"),
    ],
)
def test_bad_mappings_are_refused_at_the_first_call(inplace, abstract, match):
    bad = jaxbind.get_nonlinear_call(relax, None, abstract, None, inplace=inplace)
    for call in (lambda v: bad(v), jax.jit(lambda v: bad(v))):
        with pytest.raises(ValueError, match=match):
            call(jnp.ones(5))


def test_self_batching_must_keep_the_arguments_axis():
    def scale_rows(out, args, kwargs_dump):
        out[0][...] *= 3.0

    moved = jaxbind.get_nonlinear_call(
        scale_rows,
        None,
        lambda u, batch_axes=None: ((u.shape, u.dtype, 1) if batch_axes else (u.shape, u.dtype),),
        None,
        func_can_batch=True,
        inplace={0: 0},
    )
    with pytest.raises(ValueError, match="puts the output's batch axis at 1 and the argument's is at 0"):
        jax.vmap(lambda v: moved(v)[0])(jnp.ones((3, 3)))


def test_programs_name_the_mapping():
    # Two ops alike but for inplace are different ops to a program made elsewhere.
    from jaxbind import _sites

    plain = jaxbind.get_nonlinear_call(relax, None, same, None, name="relax_plain")
    assert "inplace" not in _sites.structure(plain.definition)
    assert _sites.structure(op.definition)["inplace"] == [[0, 0]]
