"""``setup=``: a state made once per distinct inputs and kwargs, handed to the op and all its derivatives,
kept in a bounded cache that is never the owner of a result."""

import gc
import os
import subprocess
import sys
import textwrap
import threading
import weakref

import jax
import jax.numpy as jnp
import numpy as np
import pytest

import jaxbind
from jaxbind import _trampoline


class State:
    """What setup makes here: the inputs' values and kwargs it saw (weakly referenceable)."""

    def __init__(self, args, kwargs):
        self.x = np.array(args[-1])
        self.scale = kwargs.get("scale", 1.0)


def counting_setup(made):
    def setup(args, kwargs):
        state = State(args, kwargs)
        made.append(weakref.ref(state))
        return state

    return setup


def f(out, args, kwargs_dump, state):  # y = scale * sin(x), from the state's copy of x
    np.testing.assert_array_equal(state.x, args[-1])  # the state made for these very inputs
    out[0][...] = state.scale * np.sin(args[-1])


def f_jvp(out, args, kwargs_dump, state):
    np.testing.assert_array_equal(state.x, args[0])
    out[0][...] = state.scale * np.cos(state.x) * args[1]


def f_vjp(out, args, kwargs_dump, state):
    np.testing.assert_array_equal(state.x, args[0])
    out[0][...] = state.scale * np.cos(state.x) * args[1]


def like(x, *rest, **kwargs):
    return ((x.shape, x.dtype),)


def sine_op(made, **options):
    return jaxbind.get_nonlinear_call(f, (f_jvp, f_vjp), like, like, setup=counting_setup(made), **options)


def loss(op, **kwargs):
    return lambda x: jnp.sum(op(x, **kwargs)[0] ** 2)


def test_one_setup_serves_the_forward_and_its_derivatives():
    made = []
    op = sine_op(made, name="sine_state")
    x = jnp.linspace(0.1, 1.0, 5)
    value, grad = jax.jit(jax.value_and_grad(loss(op, scale=2.0)))(x)
    np.testing.assert_allclose(value, np.sum((2 * np.sin(x)) ** 2), rtol=1e-6)
    np.testing.assert_allclose(grad, 8 * np.sin(x) * np.cos(x), rtol=1e-5)
    assert len(made) == 1
    # a repeated call on equal inputs (a new array, equal bytes) runs none; other kwargs one more
    np.testing.assert_allclose(
        jax.jit(lambda v: op(v, scale=2.0)[0])(jnp.array(np.asarray(x))), 2 * np.sin(x), rtol=1e-6
    )
    assert len(made) == 1
    np.testing.assert_allclose(op(x, scale=3.0)[0], 3 * np.sin(x), rtol=1e-6)
    assert len(made) == 2
    # jacrev over k outputs: one (the vjp walks k cotangents at one primal point)
    jacobian = jax.jacrev(lambda v: op(v, scale=0.5)[0])(x)
    np.testing.assert_allclose(jacobian, np.diag(0.5 * np.cos(x)), rtol=1e-5, atol=1e-7)
    assert len(made) == 3
    # jvp and jacfwd
    _, tangent = jax.jvp(lambda v: op(v, scale=0.5)[0], (x,), (jnp.ones(5),))
    np.testing.assert_allclose(tangent, 0.5 * np.cos(x), rtol=1e-5)
    np.testing.assert_allclose(
        jax.jacfwd(lambda v: op(v, scale=0.5)[0])(x), np.diag(0.5 * np.cos(x)), rtol=1e-5, atol=1e-7
    )
    assert len(made) == 3


def test_an_eager_pullback_called_later_reuses_the_state():
    made = []
    op = sine_op(made, name="sine_pullback")
    x = jnp.linspace(0.1, 1.0, 4)
    y, pullback = jax.vjp(lambda v: op(v)[0], x)
    assert len(made) == 1
    np.testing.assert_allclose(op(x + 1)[0], np.sin(x + 1), rtol=1e-6)  # another input meanwhile
    (ct,) = pullback(jnp.ones(4))
    np.testing.assert_allclose(ct, np.cos(x), rtol=1e-5)
    assert len(made) == 2


@pytest.mark.parametrize("thread_safe", [False, True], ids=["walk", "parallel walk"])
def test_vmap_over_distinct_inputs_makes_one_state_each(thread_safe):
    made = []
    op = sine_op(made, name=f"sine_vmap_{thread_safe}", thread_safe=thread_safe, setup_cache=16)
    xs = jnp.linspace(0.1, 2.0, 12 * 3).reshape(12, 3)
    grads = jax.jit(jax.vmap(jax.grad(loss(op))))(xs)
    np.testing.assert_allclose(grads, 2 * np.sin(xs) * np.cos(xs), rtol=1e-5)
    assert len(made) == 12  # the forward walk made them, the vjp walk found them
    # the same input twelve times: one state, found by every element
    same = jax.jit(jax.vmap(lambda v: op(v)[0]))(jnp.broadcast_to(xs[0] + 5, (12, 3)))
    np.testing.assert_allclose(same, np.sin(np.broadcast_to(xs[0] + 5, (12, 3))), rtol=1e-6)
    assert len(made) == 13


def test_a_vmapped_gradient_with_fewer_kept_states_than_elements_makes_them_again():
    made = []
    op = sine_op(made, name="sine_small_cache", setup_cache=4)
    xs = jnp.linspace(0.1, 2.0, 10 * 2).reshape(10, 2)
    grads = jax.jit(jax.vmap(jax.grad(loss(op))))(xs)
    np.testing.assert_allclose(grads, 2 * np.sin(xs) * np.cos(xs), rtol=1e-5)
    assert len(made) == 20  # each element's state evicted before its vjp: made again, same values


def test_func_can_batch_makes_one_state_for_the_batch():
    made = []

    def setup(args, kwargs):
        made.append(kwargs["batch_axes"])
        return np.array(args[0])

    def batched_f(out, args, kwargs_dump, state):
        out[0][...] = np.sin(state)

    def batched_vjp(out, args, kwargs_dump, state):
        np.testing.assert_array_equal(state, args[0])
        out[0][...] = np.cos(state) * args[1]

    def batched_like(x, *rest, batch_axes=None):
        return ((x.shape, x.dtype, (batch_axes[0][0] if batch_axes and batch_axes[0] else None)),)

    op = jaxbind.get_nonlinear_call(
        batched_f,
        (batched_vjp, batched_vjp),
        batched_like,
        batched_like,
        func_can_batch=True,
        setup=setup,
        name="sine_can_batch",
    )
    xs = jnp.linspace(0.1, 2.0, 8).reshape(4, 2)
    grads = jax.jit(jax.vmap(jax.grad(lambda v: jnp.sum(op(v)[0]))))(xs)
    np.testing.assert_allclose(grads, np.cos(xs), rtol=1e-5)
    assert made == [((0,),)]  # one call for the batch, forward and vjp alike; setup sees its inputs' axes


def test_a_scan_of_gradient_steps_makes_one_state_per_step():
    made = []
    op = sine_op(made, name="sine_scan")

    def step(x, _):
        return x - 0.1 * jax.grad(loss(op))(x), None

    x, _ = jax.jit(lambda v: jax.lax.scan(step, v, None, length=5))(jnp.linspace(0.1, 1.0, 3))
    expected = np.linspace(0.1, 1.0, 3)
    for _ in range(5):
        expected = expected - 0.1 * 2 * np.sin(expected) * np.cos(expected)
    np.testing.assert_allclose(x, expected, rtol=1e-5)
    assert len(made) == 5


def test_kept_states_are_bounded_and_freed_with_the_op():
    made = []
    op = sine_op(made, name="sine_bounded", setup_cache=8)
    call = jax.jit(lambda v: op(v)[0])  # noqa: F821  (a closure over a name deleted later, to drop its last reference)
    for k in range(1000):
        call(jnp.full(2, float(k)))
    gc.collect()
    assert len(made) == 1000 and sum(ref() is not None for ref in made) <= 8
    del op, call
    jax.clear_caches()
    gc.collect()
    assert sum(ref() is not None for ref in made) == 0


def test_inputs_are_told_apart_by_every_byte_not_by_a_fingerprint(monkeypatch):
    # every fingerprint the same: states are still found by the inputs' bytes
    monkeypatch.setattr(_trampoline, "fingerprint", lambda arrays: 7)
    made = []
    op = sine_op(made, name="sine_collisions")
    inputs = [
        np.array([0.0, 1.0]),
        np.array([-0.0, 1.0]),
        np.array([0.0, np.nextafter(1.0, 2.0)]),
        np.array([0.0, 1.0, 0.0]),
    ]
    for x in inputs + inputs:
        np.testing.assert_array_equal(op(jnp.asarray(x))[0], np.sin(x))
    assert len(made) == 4
    # the same bytes in another dtype is another input
    floats = op(jnp.zeros(2, jnp.float32))[0]
    assert floats.dtype == jnp.float32 and len(made) == 5


def test_setup_gets_copies_it_may_keep_and_the_kwargs():
    seen = []

    def setup(args, kwargs):
        seen.append((args, kwargs))
        assert all(not a.flags.writeable for a in args)
        return args[0]  # kept: a copy, not a view of XLA's memory

    def weighted(out, args, kwargs_dump, weights):  # (weights, x) -> scale * weights * x
        out[0][...] = jaxbind.load_kwargs(kwargs_dump)["scale"] * weights * args[1]

    def weights_like(w, x, **kwargs):
        return ((x.shape, x.dtype),)

    op = jaxbind.get_linear_call(
        weighted, weighted, weights_like, weights_like, first_n_args_fixed=1, setup=setup, name="keeps_copies"
    )
    w, x = jnp.arange(3.0), jnp.ones(3)
    call = jax.jit(lambda w, v: op(w, v, scale=2.0)[0])
    np.testing.assert_allclose(call(w, x), 2 * np.arange(3.0))
    for k in range(3):  # XLA's buffers reused by other calls: the kept copy keeps its values
        np.testing.assert_allclose(call(w + 0.0, x * k), 2 * k * np.arange(3.0))
        jax.jit(lambda v: v * 7)(jnp.ones(3))
    ((args, kwargs),) = seen
    np.testing.assert_array_equal(args[0], np.arange(3.0))
    assert kwargs == {"scale": 2.0}


def dft_setup(args, kwargs):
    """A 'plan': the matrix of a non-uniform DFT at the points (the fixed argument)."""
    points = args[0]
    return np.exp(-1j * np.outer(points, np.arange(kwargs["n"])))


def dft(out, args, kwargs_dump, plan):  # (points, coefficients) -> values at the points
    out[0][...] = plan @ args[1]


def dft_T(out, args, kwargs_dump, plan):  # (points, values' cotangent) -> coefficients' cotangent
    out[0][...] = plan.T @ args[1]


def dft_abstract(points, coefficients, **kwargs):
    return ((points.shape, coefficients.dtype),)


def dft_T_abstract(points, values, *, n):
    return (((n,), values.dtype),)


def test_a_linear_op_makes_its_plan_from_the_fixed_arguments_and_its_transpose_reuses_it():
    made = []

    def setup(args, kwargs):
        made.append(1)
        return dft_setup(args, kwargs)

    op = jaxbind.get_linear_call(
        dft, dft_T, dft_abstract, dft_T_abstract, first_n_args_fixed=1, setup=setup, name="nudft"
    )
    rng = np.random.default_rng(0)
    points = jnp.asarray(rng.uniform(0, 2 * np.pi, 7))
    c = jnp.asarray(rng.standard_normal(5) + 1j * rng.standard_normal(5))
    dense = np.exp(-1j * np.outer(points, np.arange(5)))
    np.testing.assert_allclose(op(points, c, n=5)[0], dense @ c, rtol=1e-12)
    np.testing.assert_allclose(
        jax.linear_transpose(lambda v: op(points, v, n=5)[0], c)(jnp.ones(7, c.dtype))[0],
        dense.T @ np.ones(7),
        rtol=1e-12,
    )
    assert len(made) == 1
    for k in range(3):  # new coefficients, the same points: the plan is kept
        op(points, c * k, n=5)
    assert len(made) == 1
    grad = jax.grad(lambda v: jnp.sum(jnp.abs(op(points, v, n=5)[0]) ** 2))(c)
    np.testing.assert_allclose(grad, 2 * np.conj(dense.conj().T @ (dense @ c)), rtol=1e-10)
    assert len(made) == 1


def test_check_op_checks_an_op_with_state():
    made = []
    op = sine_op(made, name="sine_checked")
    report = jaxbind.testing.check_op(op, jnp.linspace(0.1, 1.0, 4))
    checked = {(c["check"], c["argument"]) for c in report.checks}
    assert {("state: kept or made again", "the outputs"), ("state: kept or made again", "the vjp")} <= checked
    assert len(made) > 2  # the states were made again

    # a state a result depends on (here: stale, from the first input it saw) fails the check
    first = []

    def stale_setup(args, kwargs):
        first.append(np.array(args[0]))
        return first[0]

    def uses_state(out, args, kwargs_dump, state):
        out[0][...] = np.sin(state)

    def vjp_uses_state(out, args, kwargs_dump, state):
        out[0][...] = np.cos(state) * args[1]

    wrong = jaxbind.get_nonlinear_call(
        uses_state, (vjp_uses_state, vjp_uses_state), like, like, setup=stale_setup, name="stale_state"
    )
    with pytest.raises(AssertionError, match="state"):
        jaxbind.testing.check_op(wrong, jnp.linspace(0.1, 1.0, 4))


def test_threads_calling_one_op_share_its_states():
    made = []
    op = sine_op(made, name="sine_threads")
    call = jax.jit(jax.value_and_grad(loss(op)))
    xs = [jnp.full(3, 0.1 * k) for k in range(4)]
    errors = []

    def worker():
        try:
            for x in xs * 5:
                value, grad = call(x)
                np.testing.assert_allclose(grad, 2 * np.sin(x) * np.cos(x), rtol=1e-5)
        except Exception as err:
            errors.append(err)

    threads = [threading.Thread(target=worker) for _ in range(4)]
    for t in threads:
        t.start()
    for t in threads:
        t.join()
    assert errors == [] and len(made) == 4  # one per distinct input, whatever the threads did


def test_bad_setups_are_refused_naming_setup():
    with pytest.raises(TypeError, match="jaxbind op 'f': setup must be a callable"):
        jaxbind.get_nonlinear_call(f, None, like, None, setup=3)
    with pytest.raises(ValueError, match="setup_cache must be a positive integer"):
        jaxbind.get_nonlinear_call(f, None, like, None, setup=counting_setup([]), setup_cache=0)
    with pytest.raises(TypeError, match=r"cannot be called as a callback, f\(out, args, kwargs_dump, state\)"):
        jaxbind.get_nonlinear_call(
            lambda out, args, kwargs_dump: None, None, like, None, setup=counting_setup([]), name="three"
        )
    import _kernels

    kernels = _kernels.load()
    with pytest.raises(TypeError, match="is a native kernel, which takes no Python object"):
        jaxbind.get_linear_call(kernels.jb_double, kernels.jb_double, like, like, setup=counting_setup([]))

    def failing(args, kwargs):
        raise np.linalg.LinAlgError("Singular matrix")

    op = jaxbind.get_nonlinear_call(f, (f_jvp, f_vjp), like, like, setup=failing, name="singular")
    with pytest.raises(
        Exception, match="jaxbind op 'singular': its setup 'failing' raised LinAlgError: Singular matrix"
    ) as info:
        jax.jit(lambda v: op(v)[0])(jnp.ones(2))
    assert "Traceback" in str(info.value)


EXPORT_SCRIPT = textwrap.dedent("""
    import sys
    import jax, jax.numpy as jnp, numpy as np
    import jax.export  # (jax < 0.6 does not import it with jax)
    import jaxbind
    jax.config.update("jax_enable_x64", True)
    made = []

    def setup(args, kwargs):
        made.append(1)
        return {"cos": np.cos(args[0])}

    def f(out, args, kwargs_dump, state):
        out[0][...] = np.sin(args[0])

    def f_vjp(out, args, kwargs_dump, state):
        out[0][...] = state["cos"] * args[1]

    like = lambda x, *rest, **kwargs: ((x.shape, x.dtype),)
    op = jaxbind.get_nonlinear_call(f, (f_vjp, f_vjp), like, like, setup=setup, name="sine_exported")
    x = jnp.linspace(0.1, 1.0, 4)
    if sys.argv[1] == "export":
        exported = jaxbind.export(jax.jit(jax.value_and_grad(lambda v: jnp.sum(op(v)[0]))))(x)
        open(sys.argv[2], "wb").write(exported.serialize())
    else:
        loaded = jax.export.deserialize(open(sys.argv[2], "rb").read())
        value, grad = loaded.call(x)
        assert np.allclose(value, np.sum(np.sin(x))) and np.allclose(grad, np.cos(x)), (value, grad)
        print("setups", len(made))
""")


def test_a_program_exported_elsewhere_makes_its_state_where_it_runs(tmp_path):
    pytest.importorskip("flatbuffers")
    script = tmp_path / "exported_state.py"
    script.write_text(EXPORT_SCRIPT)
    parent = os.path.dirname(os.path.dirname(os.path.abspath(jaxbind.__file__)))
    env = {**os.environ, "PYTHONPATH": parent + os.pathsep + os.environ.get("PYTHONPATH", "")}
    for step in ("export", "run"):
        run = subprocess.run(
            [sys.executable, str(script), step, str(tmp_path / "program.bin")],
            env=env,
            capture_output=True,
            text=True,
            timeout=240,
        )
        assert run.returncode == 0, run.stderr[-3000:]
    assert "setups 1" in run.stdout


def test_the_ducc0_nufft_makes_one_plan_per_set_of_points_for_itself_and_its_transpose():
    pytest.importorskip("ducc0")
    from jaxbind._state import state_cache
    from jaxbind.contrib import jaxducc0

    plans = state_cache(jaxducc0.nufft.definition)
    rng = np.random.default_rng(3)
    shape = (8, 6)
    coord = jnp.asarray(rng.uniform(-np.pi, np.pi, (20, 2)))
    grids = [jnp.asarray(rng.standard_normal(shape) + 1j * rng.standard_normal(shape)) for _ in range(3)]
    frequencies = np.stack(np.meshgrid(np.arange(-4, 4), np.arange(-3, 3), indexing="ij"), -1).reshape(-1, 2)
    dense = np.exp(-1j * np.asarray(coord) @ frequencies.T)  # the non-uniform DFT, (points, grid)
    transform = jax.jit(lambda c, g: jaxducc0.nufft(c, g, shape=shape, epsilon=1e-11)[0])
    before = plans.setups
    for grid in grids:  # new grids, the same points: one plan
        np.testing.assert_allclose(transform(coord, grid), dense @ np.asarray(grid).ravel(), rtol=1e-9, atol=1e-9)
    cotangent = jnp.asarray(rng.standard_normal(20) + 1j * rng.standard_normal(20))
    (transposed,) = jax.linear_transpose(lambda g: transform(coord, g), grids[0])(cotangent)
    np.testing.assert_allclose(np.asarray(transposed).ravel(), dense.T @ np.asarray(cotangent), rtol=1e-9, atol=1e-9)
    assert plans.setups - before == 1
    transform(coord + 0.5, grids[0])  # other points: another plan
    assert plans.setups - before == 2
