"""jaxbind.pure_callback against jax.pure_callback on the same callbacks."""

import gc
import os
import subprocess
import sys
import textwrap
import weakref

import _subprocesses
import jax
import jax.numpy as jnp
import numpy as np
import pytest

import jaxbind

pc = jaxbind.pure_callback
APIS = {"jax": jax.pure_callback, "jaxbind": pc}


def both(fn, *args):
    """fn(api, *args) for each API: jaxbind's result, checked against JAX's."""
    ref = fn(jax.pure_callback, *args)
    got = fn(pc, *args)
    assert jax.tree_util.tree_structure(got) == jax.tree_util.tree_structure(ref)
    for g, r in zip(jax.tree_util.tree_leaves(got), jax.tree_util.tree_leaves(ref)):
        assert g.shape == r.shape and g.dtype == r.dtype
        np.testing.assert_array_equal(np.asarray(g), np.asarray(r))
    return got


def like(x):
    return jax.ShapeDtypeStruct(jnp.shape(x), jnp.result_type(x))


def test_pytrees_and_kwargs_in_and_out():
    def cb(pair, y, *, scale, extra=None):
        a, b = pair
        return {"sum": np.asarray(a + b * scale), "parts": (np.asarray(y).astype(np.int32), np.float32(2.5))}

    def call(api, x, y):
        spec = {
            "sum": like(x),
            "parts": (jax.ShapeDtypeStruct(y.shape, np.int32), jax.ShapeDtypeStruct((), np.float32)),
        }
        return api(cb, spec, (x, 2 * x), y, scale=x[0], extra={"n": y})

    x, y = jnp.linspace(1.0, 2.0, 5), jnp.arange(3.0)
    out = both(jax.jit(call, static_argnums=0), x, y)
    np.testing.assert_allclose(out["sum"], x + 2 * x * x[0])
    both(call, x, y)  # eagerly


@pytest.mark.parametrize(
    "dtype",
    [
        np.bool_,
        np.int8,
        np.uint16,
        np.int32,
        np.int64,
        np.float16,
        jnp.bfloat16,
        np.float32,
        np.float64,
        np.complex64,
        np.complex128,
    ],
)
@pytest.mark.parametrize("shape", [(), (0,), (2, 3)])
def test_every_dtype_and_shape(dtype, shape):
    rng = np.random.default_rng(0)
    x = rng.standard_normal(shape) * 3
    if np.issubdtype(dtype, np.complexfloating):
        x = x + 1j * rng.standard_normal(shape)
    x = jnp.asarray(x.astype(dtype) if dtype is not np.bool_ else x > 0)

    def cb(v):
        return np.logical_not(v) if v.dtype == np.bool_ else (v + v).astype(v.dtype)

    both(lambda api, v: jax.jit(lambda w: api(cb, like(w), w))(v), x)
    both(lambda api, v: api(cb, like(v), v), x)


def test_float0_arguments_and_results():
    # The cotangent custom_vjp gives an integer input is float0: it reaches the callback as bool zeros.
    seen = []

    def cb(x, z):
        seen.append((np.asarray(z).dtype, np.asarray(z).shape, bool(np.any(z))))
        return x * 2, np.zeros(z.shape, jax.dtypes.float0)

    z = np.zeros((3,), jax.dtypes.float0)
    x = jnp.arange(3.0)
    y, z_out = jax.jit(lambda a, b: pc(cb, (like(a), jax.ShapeDtypeStruct((3,), jax.dtypes.float0)), a, b))(x, z)
    np.testing.assert_allclose(y, 2 * x)
    assert z_out.dtype == jax.dtypes.float0 and z_out.shape == (3,)
    assert seen == [(np.dtype(np.bool_), (3,), False)]


def test_float0_arguments_to_ops():
    def f(out, args, kwargs_dump):
        assert args[1].dtype == np.bool_ and not args[1].any()
        out[0][...] = 3 * args[0]

    op = jaxbind.get_nonlinear_call(f, None, lambda x, z: ((x.shape, x.dtype),), None)
    x = jnp.arange(4.0)
    np.testing.assert_allclose(jax.jit(lambda a, b: op(a, b)[0])(x, np.zeros((2,), jax.dtypes.float0)), 3 * x)
    np.testing.assert_allclose(op(x, np.zeros((2,), jax.dtypes.float0))[0], 3 * x)


def test_a_refused_dtype_is_named_not_spelled_as_a_record():
    op = jaxbind.get_nonlinear_call(lambda out, args, kw: None, None, lambda x: ((x.shape, x.dtype),), None)
    with pytest.raises(TypeError, match=r"dtype int4, which jaxbind cannot pass.*float0"):
        op(jnp.zeros(2, jnp.int4))


def test_the_callback_sees_numpy_inside_jit_and_jax_arrays_eagerly():
    kinds = []

    def cb(x):
        kinds.append(type(x))
        return x

    x = jnp.arange(3.0)
    pc(cb, like(x), x)
    jax.jit(lambda v: pc(cb, like(v), v))(x)
    assert issubclass(kinds[0], jax.Array) and kinds[1] is np.ndarray


def recorded_shapes(api, method, in_axes, x, y, levels):
    shapes = []

    def cb(a, b):
        shapes.append((np.shape(a), np.shape(b)))
        a, b = np.asarray(a), np.asarray(b)
        return (np.sin(a) + b).astype(np.result_type(a.dtype, b.dtype))

    def f(a, b):
        return api(
            cb,
            jax.ShapeDtypeStruct(np.broadcast_shapes(a.shape, b.shape), jnp.result_type(a, b)),
            a,
            b,
            vmap_method=method,
        )

    for axes in [in_axes] * levels:
        f = jax.vmap(f, in_axes=axes)
    return jax.jit(f)(x, y), shapes


@pytest.mark.parametrize("method", ["sequential", "sequential_unrolled", "expand_dims", "broadcast_all"])
@pytest.mark.parametrize("in_axes", [(0, 0), (0, None), (None, 0)])
@pytest.mark.parametrize("levels", [1, 2])
def test_each_vmap_method_calls_the_callback_with_jaxs_shapes(method, in_axes, levels):
    x = jnp.arange(24.0).reshape((2, 3, 4)) if levels == 2 else jnp.arange(12.0).reshape((3, 4))
    y = jnp.linspace(0.0, 1.0, x.size).reshape(x.shape)
    if in_axes[0] is None:
        x = x[(0,) * levels]
    if in_axes[1] is None:
        y = y[(0,) * levels]
    ref, ref_shapes = recorded_shapes(jax.pure_callback, method, in_axes, x, y, levels)
    got, got_shapes = recorded_shapes(pc, method, in_axes, x, y, levels)
    np.testing.assert_allclose(got, ref, rtol=1e-14)
    assert got_shapes == ref_shapes


def test_legacy_vectorized_passes_unmapped_arguments_as_they_are():
    def run(api):
        shapes = []

        def cb(a, b):
            shapes.append((a.shape, np.shape(b)))
            return np.sin(a) + b

        f = jax.vmap(
            lambda a, b: api(cb, like(a), a, b, vmap_method="legacy_vectorized"), in_axes=(1, None), out_axes=1
        )
        return jax.jit(f)(jnp.arange(4.0)[None], 4.0), shapes

    (got, got_shapes), (ref, ref_shapes) = run(pc), run(jax.pure_callback)
    np.testing.assert_allclose(got, ref)
    assert got_shapes == ref_shapes


# jax < 0.6 still runs a vmap of jax.pure_callback given no vmap_method sequentially, with a
# DeprecationWarning; jaxbind.pure_callback raises there too, as newer JAX does (docs/guides/porting.md).
JAX_WARNS_WITHOUT_A_VMAP_METHOD = tuple(int(p) for p in jax.__version__.split(".")[:2]) < (0, 6)


def test_vmap_without_a_method_and_grad_raise_as_jax_does():
    x = jnp.arange(3.0)
    for name, api in APIS.items():
        if name == "jax" and JAX_WARNS_WITHOUT_A_VMAP_METHOD:
            with pytest.warns(DeprecationWarning, match="default behavior of pure_callback under vmap"):
                jax.vmap(lambda v: api(np.sin, like(v), v))(x)
        else:
            with pytest.raises(NotImplementedError, match="vmap is only supported"):
                jax.vmap(lambda v: api(np.sin, like(v), v))(x)
        with pytest.raises(ValueError, match="Pure callbacks do not support JVP"):
            jax.grad(lambda v: api(np.sin, like(v), v))(2.0)
    with pytest.raises(ValueError, match="vmap_method must be"):
        pc(np.sin, like(x), x, vmap_method="bogus")


def test_under_custom_jvp_and_custom_vjp():
    @jax.custom_jvp
    def sin(x):
        return pc(np.sin, like(x), x, vmap_method="sequential")  # (jacfwd vmaps)

    @sin.defjvp
    def sin_jvp(primals, tangents):
        (x,), (t,) = primals, tangents
        return sin(x), pc(np.cos, like(x), x, vmap_method="expand_dims") * t

    @jax.custom_vjp
    def cube(x):
        return pc(lambda v: v**3, like(x), x, vmap_method="sequential")

    cube.defvjp(
        lambda x: (cube(x), x), lambda x, g: (pc(lambda v, w: 3 * v**2 * w, like(x), x, g, vmap_method="sequential"),)
    )
    x = jnp.linspace(0.1, 1.0, 4)
    np.testing.assert_allclose(jax.jit(jax.grad(lambda v: jnp.sum(sin(v))))(x), jnp.cos(x), rtol=1e-14)
    np.testing.assert_allclose(jax.jacfwd(sin)(x), jnp.diag(jnp.cos(x)), rtol=1e-14)
    np.testing.assert_allclose(jax.jit(jax.vmap(jax.grad(lambda v: sin(v))))(x), jnp.cos(x), rtol=1e-14)
    np.testing.assert_allclose(jax.jit(jax.grad(lambda v: jnp.sum(cube(v))))(x), 3 * x**2, rtol=1e-14)
    np.testing.assert_allclose(jax.vmap(jax.grad(lambda v: cube(v)))(x), 3 * x**2, rtol=1e-14)
    jax.test_util.check_grads(lambda v: jnp.sum(sin(v) * cube(v)), (x,), order=1, modes=("rev",))


def test_control_flow():
    x = jnp.arange(2.0)

    def in_cond(api, p, v):
        return jax.lax.cond(
            p, lambda w: api(lambda a: a + 1.0, like(w), w), lambda w: api(lambda a: a - 1.0, like(w), w), v
        )

    def in_scan(api, v):
        return jax.lax.scan(lambda c, _: (api(lambda a: a + 1.0, like(c), c), None), v, None, length=10)[0]

    def in_while(api, v):
        return jax.lax.while_loop(
            lambda c: api(lambda a: np.any(a < 10), jax.ShapeDtypeStruct((), np.bool_), c),
            lambda c: api(lambda a: a + 1.0, like(c), c),
            v,
        )

    for p in (True, False):
        both(jax.jit(in_cond, static_argnums=0), p, x)
    np.testing.assert_allclose(both(jax.jit(in_scan, static_argnums=0), x), x + 10)
    np.testing.assert_allclose(both(jax.jit(in_while, static_argnums=0), x), [10.0, 11.0])


def test_an_unused_result_is_never_computed():
    calls = []

    def cb(x):
        calls.append(1)
        return x

    f = jax.jit(lambda v: (pc(cb, like(v), v), 2 * v)[1])
    np.testing.assert_allclose(f(jnp.ones(3)), 2 * np.ones(3))
    assert calls == []


def test_errors_reach_the_caller_with_their_type_and_message():
    def fails(x):
        raise KeyError("the solver diverged")

    x = jnp.arange(3.0)
    for call in (
        lambda: jax.jit(lambda v: pc(fails, like(v), v))(x).block_until_ready(),
        lambda: pc(fails, like(x), x),
    ):
        with pytest.raises(Exception, match="KeyError: 'the solver diverged'|the solver diverged"):
            call()
    bad = {
        "Incorrect output shape for return value #0: Expected: \\(3,\\), Actual: \\(4,\\)": lambda v: np.ones(4),
        "Incorrect output dtype for return value #0: Expected: float64, Actual: complex128": lambda v: v + 1j,
        "Mismatched number of outputs from callback. Expected: 1, Actual: 2": lambda v: (v, v),
    }
    for message, cb in bad.items():
        with pytest.raises(RuntimeError, match=message):
            jax.jit(lambda v: pc(cb, like(v), v))(x).block_until_ready()
        with pytest.raises(RuntimeError, match=message):
            pc(cb, like(x), x)
    # a 64-bit result in a narrower canonical type, as JAX accepts it
    x64 = jax.enable_x64 if hasattr(jax, "enable_x64") else jax.experimental.enable_x64
    with x64(False):
        y = jnp.arange(3.0, dtype=jnp.float32)
        np.testing.assert_allclose(
            jax.jit(lambda v: pc(lambda a: np.asarray(a, np.float64) / 3, like(v), v))(y), np.arange(3.0) / 3, rtol=1e-6
        )


def test_a_kept_input_keeps_its_values():
    kept = []

    def cb(x):
        kept.append(x)
        return x + 1

    f = jax.jit(lambda v: pc(cb, like(v), v))
    for k in range(3):
        f(jnp.full(4, float(k))).block_until_ready()
    assert [list(np.asarray(a)) for a in kept] == [[float(k)] * 4 for k in range(3)]


def test_many_callbacks_made_and_dropped_are_freed():
    refs = []
    x = jnp.arange(3.0)
    for k in range(20):
        big = np.full(10**5, float(k))
        refs.append(weakref.ref(big))

        def cb(v, big=big):
            return v + big[0]

        np.testing.assert_allclose(jax.jit(lambda v: pc(cb, like(v), v))(x), x + k)  # noqa: F821  (a closure over a name deleted later, to drop its last reference)
        np.testing.assert_allclose(pc(cb, like(x), x), x + k)
        del big, cb
    jax.clear_caches()
    gc.collect()
    assert sum(r() is not None for r in refs) == 0


def test_one_op_per_callback_and_structure():
    x = jnp.arange(3.0)

    def op_of(fun):
        (eqn,) = jax.make_jaxpr(fun)(x).eqns
        return eqn.params["role"].op

    sin = op_of(lambda v: pc(np.sin, like(v), v))
    assert op_of(lambda v: pc(np.sin, like(v), v)) is sin  # another trace, another function
    assert op_of(lambda v: pc(np.cos, like(v), v)) is not sin
    assert op_of(lambda v: pc(np.sin, like(v), v, vmap_method="sequential")) is not sin
    assert op_of(lambda v: pc(np.sin, like(v), x=v)) is not sin  # (another argument structure)


def test_no_arguments_and_no_results():
    out = jax.jit(lambda: pc(lambda: np.arange(3.0), jax.ShapeDtypeStruct((3,), np.float64)))()
    np.testing.assert_allclose(out, np.arange(3.0))
    assert jax.jit(lambda v: pc(lambda a: None, (), v))(jnp.ones(2)) == ()


SHARDED = textwrap.dedent("""
    import json
    import jax, jax.numpy as jnp, numpy as np
    from jax.sharding import Mesh, NamedSharding, PartitionSpec as P, SingleDeviceSharding
    import jaxbind
    from _shared import shard_map
    devices = jax.devices()
    mesh = Mesh(np.array(devices), ("x",))
    sharding = NamedSharding(mesh, P("x"))
    def func(v):
        return v + np.arange(v.shape[0], dtype=v.dtype)
    x = jnp.arange(8.0)
    out = {}
    for name, api in (("jax", jax.pure_callback), ("jaxbind", jaxbind.pure_callback)):
        whole = jax.jit(lambda v: api(func, v, v), in_shardings=sharding, out_shardings=sharding)(x)
        pinned_fn = jax.jit(lambda v: api(func, v, v, sharding=SingleDeviceSharding(devices[-1])),
                            in_shardings=sharding, out_shardings=sharding)
        pinned = pinned_fn(x)
        text = pinned_fn.lower(x).as_text()
        manual = jax.jit(shard_map(lambda v: api(func, v, v), mesh=mesh, in_specs=P("x"), out_specs=P("x")),
                         in_shardings=sharding, out_shardings=sharding)(x)
        pm = jax.pmap(lambda v: api(np.sin, v, v))(jnp.arange(4.0))
        out[name] = {"whole": np.asarray(whole).tolist(), "pinned": np.asarray(pinned).tolist(),
                     "manual": np.asarray(manual).tolist(), "pmap": np.asarray(pm).tolist(),
                     "pinned_to_last": ("maximal_mesh_3" in text) or ("maximal device=3" in text)}
    print(json.dumps(out))
""")


def test_sharded_jit_shard_map_and_pmap_as_jax_does():
    env = _subprocesses.environment()
    env["XLA_FLAGS"] = f"{env.get('XLA_FLAGS', '')} --xla_force_host_platform_device_count=4".strip()
    tests = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))  # (_shared.py)
    env["PYTHONPATH"] = os.pathsep.join(
        filter(None, [os.path.dirname(os.path.dirname(jaxbind.__file__)), tests, env.get("PYTHONPATH")])
    )
    process = subprocess.Popen(
        [sys.executable, "-c", SHARDED],
        env=env,
        stdout=subprocess.PIPE,
        stderr=subprocess.PIPE,
        text=True,
        cwd=os.path.dirname(os.path.abspath(__file__)),
    )
    ((out, err),) = _subprocesses.communicate_all([process], 300, "the sharded pure_callback script")
    assert process.returncode == 0, err[-4000:]
    import json

    results = json.loads(out.strip().splitlines()[-1])
    assert results["jaxbind"] == results["jax"]
    assert results["jaxbind"]["pinned_to_last"]
    np.testing.assert_allclose(results["jaxbind"]["manual"], np.arange(8.0) + np.tile(np.arange(2.0), 4))
    np.testing.assert_allclose(results["jaxbind"]["whole"], 2 * np.arange(8.0))


def test_a_bound_method_keeps_one_op_and_frees_its_object():
    class Solver:
        def __init__(self, k):
            self.k, self.big = k, np.full(10**5, float(k))

        def apply(self, v):
            return v * self.k

    x = jnp.arange(3.0)
    solver = Solver(3)
    ops = set()
    for _ in range(3):  # solver.apply is a new object each time: still one op
        np.testing.assert_allclose(pc(solver.apply, like(x), x), 3 * x)
        np.testing.assert_allclose(jax.jit(lambda v: pc(solver.apply, like(v), v))(x), 3 * x)  # noqa: F821  (a closure over a name deleted later, to drop its last reference)
        ops.add(jax.make_jaxpr(lambda v: pc(solver.apply, like(v), v))(x).eqns[0].params["role"].op)  # noqa: F821  (a closure over a name deleted later, to drop its last reference)
    assert len(ops) == 1 and sorted(vars(solver)) == ["big", "k"]
    ref = weakref.ref(solver.big)
    del solver, ops
    jax.clear_caches()
    gc.collect()
    assert ref() is None
