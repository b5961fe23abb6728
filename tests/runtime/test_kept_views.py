"""What counts as keeping a callback's array: real SciPy, JAX and numba callbacks pass; real keeps are cut off.

A callback's ``out`` and ``args`` view XLA's memory for the duration of the
call. A view held only by unreachable garbage (reference cycles a solver left
behind, not yet collected) is not kept: such callbacks must run, every time,
whenever the collector last ran. A view that something live still reaches (a
list, a closure stored away, a weak reference, a slice, a DLPack import) is
reported naming the op, and every NumPy array reaching that memory is cut off.
"""

import ctypes
import gc
import weakref

import jax
import jax.numpy as jnp
import numpy as np
import pytest
import scipy.integrate
import scipy.optimize

import jaxbind

try:
    import numba
except ImportError:  # (no numba for free-threaded CPython: the tests of numba's objects skip there)
    numba = None
needs_numba = pytest.mark.skipif(numba is None, reason="numba is not installed (it has no free-threaded wheel)")

C = np.array([0.5, 1.0, 2.0, 3.0])  # x**3 + x = c has one real root for each
BATCH = np.array([C, 2 * C, C + 0.25])


def same_shape(*args, **kwargs):
    return tuple((a.shape, a.dtype) for a in args[:1])


def cubic_root_reference(c):
    # x**3 + x - c is increasing: Newton from x = c converges to its one real root.
    x = np.array(c, dtype=np.float64)
    for _ in range(60):
        x = x - (x**3 + x - c) / (3 * x**2 + 1)
    return x


def decay_reference(c):
    return np.exp(-np.asarray(c))  # y' = -c y, y(0) = 1, at t = 1


# Each callback hands a closure over (or the array itself) to a library that
# leaves reference cycles behind, and keeps nothing.
def root_with(method):
    def solve(out, args, kwargs_dump):
        c = args[0]
        out[0][...] = scipy.optimize.root(lambda x: x**3 + x - c, np.zeros_like(c), method=method, tol=1e-13).x

    solve.__name__ = f"root_{method.replace('-', '_')}"
    # Broyden's and Krylov's methods stop short of (or away from) the root on
    # this problem: what they give called directly is their reference.
    return solve, None if method in ("broyden1", "krylov") else cubic_root_reference, 1e-8


def fsolve(out, args, kwargs_dump):
    c = args[0]
    out[0][...] = scipy.optimize.fsolve(lambda x: x**3 + x - c, np.zeros_like(c), xtol=1e-13)


def ivp_with(method, **options):
    def solve(out, args, kwargs_dump):
        c = args[0]
        result = scipy.integrate.solve_ivp(
            lambda t, y: -c * y, (0.0, 1.0), np.ones_like(c), method=method, rtol=1e-10, atol=1e-12, **options
        )
        out[0][...] = result.y[:, -1]

    solve.__name__ = f"solve_ivp_{method}" + "".join(f"_{k}" for k in options)
    return solve, decay_reference, 1e-6


def ivp_without_closure(out, args, kwargs_dump):
    # The view passed through solve_ivp's own `args=`, no closure of ours.
    result = scipy.integrate.solve_ivp(
        lambda t, y, c: -c * y, (0.0, 1.0), np.ones_like(args[0]), args=(args[0],), rtol=1e-10, atol=1e-12
    )
    out[0][...] = result.y[:, -1]


def jax_numpy_on_a_view(out, args, kwargs_dump):
    out[0][...] = np.asarray(jnp.sin(args[0]))


@jax.jit
def _jitted_cos(x):
    return jnp.cos(x) * 2


def jitted_jax_on_a_view(out, args, kwargs_dump):
    out[0][...] = np.asarray(_jitted_cos(args[0]))


def root_then_allocations(out, args, kwargs_dump):
    # Whether a collection runs before the check used to decide the outcome.
    fsolve(out, args, kwargs_dump)
    _ = [[k] for k in range(700)]


CALLBACKS = [
    *(root_with(m) for m in ("hybr", "lm", "df-sane", "broyden1", "krylov")),
    (fsolve, cubic_root_reference, 1e-10),
    (root_then_allocations, cubic_root_reference, 1e-10),
    *(ivp_with(m) for m in ("RK45", "LSODA", "BDF")),
    ivp_with("RK45", dense_output=True),
    (ivp_without_closure, decay_reference, 1e-6),
    (jax_numpy_on_a_view, np.sin, 1e-12),
    (jitted_jax_on_a_view, lambda c: 2 * np.cos(c), 1e-12),
]


def called_directly(callback):
    """The callback run on NumPy arrays of its own, outside any op."""

    def run(c):
        out = np.empty_like(c)
        callback((out,), (np.array(c, dtype=np.float64),), b"")
        return out

    return run


@pytest.mark.parametrize("callback, reference, rtol", CALLBACKS, ids=[c[0].__name__ for c in CALLBACKS])
def test_real_callbacks_that_keep_nothing_run_on_every_path(callback, reference, rtol):
    op = jaxbind.get_nonlinear_call(callback, None, same_shape, None)
    if reference is None:
        reference, rtol = called_directly(callback), 1e-12
    else:  # the solver's own answer is the root too
        np.testing.assert_allclose(called_directly(callback)(C), reference(C), rtol=rtol)
    jitted = jax.jit(lambda c: op(c)[0])
    for k in range(6):  # repeated: each call leaves its own garbage, collected or not
        c = C + 0.1 * k
        np.testing.assert_allclose(jitted(c), reference(c), rtol=rtol)
    np.testing.assert_allclose(op(C)[0], reference(C), rtol=rtol)  # eager
    batched = jax.jit(jax.vmap(lambda c: op(c)[0]))(BATCH)  # the walk: one call per row
    np.testing.assert_allclose(batched, np.stack([reference(c) for c in BATCH]), rtol=rtol)


def test_a_callback_keeping_nothing_passes_whenever_the_collector_last_ran():
    op = jaxbind.get_nonlinear_call(root_then_allocations, None, same_shape, None)
    f = jax.jit(lambda c: op(c)[0])
    for k in range(40):
        if k % 3 == 0:
            gc.collect()
        np.testing.assert_allclose(f(C + k), cubic_root_reference(C + k), rtol=1e-10)


@pytest.mark.parametrize("collector", ["enabled", "disabled"])
def test_views_held_only_by_reference_cycles_are_not_kept(collector):
    """Garbage holding a view, a slice of one and a weak reference: the call succeeds, also
    with the collector switched off by the user (jaxbind collects explicitly)."""

    def leaves_cycles(out, args, kwargs_dump):
        cycle = {"x": args[0], "slice": out[0][1:], "ref": weakref.ref(out[0])}
        cycle["self"] = cycle
        np.multiply(args[0], 3, out=out[0])

    op = jaxbind.get_linear_call(leaves_cycles, leaves_cycles, same_shape, same_shape)
    f = jax.jit(lambda x: op(x)[0])
    was_enabled = gc.isenabled()
    if collector == "disabled":
        gc.disable()
    try:
        for k in range(5):
            np.testing.assert_array_equal(f(C + k), 3 * (C + k))
        np.testing.assert_array_equal(jax.vmap(lambda x: op(x)[0])(BATCH), 3 * BATCH)
    finally:
        if was_enabled:
            gc.enable()


@needs_numba
def test_a_numba_function_given_the_views_compiles_and_runs():
    @numba.njit
    def twice(out, args):  # compiled on the first call, from the tuples' types
        for i in range(args[0].shape[0]):
            out[0][i] = 2.0 * args[0][i]

    def callback(out, args, kwargs_dump):
        twice(out, args)

    op = jaxbind.get_linear_call(callback, callback, same_shape, same_shape)
    for k in range(5):
        np.testing.assert_array_equal(jax.jit(lambda x: op(x)[0])(C + k), 2 * (C + k))
    np.testing.assert_array_equal(jax.vmap(lambda x: op(x)[0])(BATCH), 2 * BATCH)
    np.testing.assert_array_equal(jax.grad(lambda x: op(x)[0].sum())(C), np.full(4, 2.0))


# ---------------------------------------------------------------------------
# Real keeps: reported, and cut off XLA's memory
# ---------------------------------------------------------------------------

KEPT = []  # a live holder, like a user's global cache


class Holder:
    def __init__(self, x):
        self.x = x


# Each keeper returns what it stores and the NumPy arrays and memoryviews through
# which that store reaches the call's memory.
KEEPERS = {
    "appended to a global list": lambda out, args: [args[0]] * 2,
    "a slice": lambda out, args: [out[0][1:]] * 2,
    "a slice in a tuple (a tuple the collector stops tracking)": lambda out, args: ((out[0][::2],),) * 2,
    "a slice in a dict in a tuple": lambda out, args: (({"x": args[0][2:]},),) * 2,
    "a closure stored in a live object": lambda out, args: (Holder(lambda: args[0]),) * 2,
    "a weak reference": lambda out, args: (weakref.ref(out[0]),) * 2,
    "np.frombuffer": lambda out, args: [np.frombuffer(args[0], dtype=np.float64)] * 2,
    "np.from_dlpack of an input": lambda out, args: [np.from_dlpack(args[0])] * 2,
    "np.from_dlpack of an output": lambda out, args: [np.from_dlpack(out[0])] * 2,
    "a memoryview": lambda out, args: [memoryview(out[0])] * 2,
    "an array over a memoryview of a slice": lambda out, args: [np.asarray(memoryview(out[0][1:]))] * 2,
    "an output itself": lambda out, args: [out[0]] * 2,
    "a transposed input": lambda out, args: [args[0].T] * 2,
    "an array over a memoryview": lambda out, args: [np.asarray(memoryview(out[0]))] * 2,
    "the whole tuple of outputs": lambda out, args: (out,) * 2,
}


def _reaching(kept):
    """The arrays and memoryviews a kept object still reaches."""
    if isinstance(kept, (list, tuple)):
        return [a for item in kept for a in _reaching(item)]
    if isinstance(kept, dict):
        return _reaching(list(kept.values()))
    if isinstance(kept, Holder):
        return _reaching(kept.x())
    if isinstance(kept, weakref.ref):
        return _reaching(kept())
    if kept is None:
        return []
    return [kept]


def _assert_cut_off(array):
    if isinstance(array, memoryview):
        with pytest.raises(ValueError, match="released"):
            array.tobytes()
    else:
        assert array.size == 0 and not array.flags.writeable, (array.shape, array.flags)


@pytest.mark.parametrize("keeper", list(KEEPERS))
def test_a_real_keep_is_reported_and_every_alias_is_cut_off(keeper):
    KEPT.clear()

    def hoard(out, args, kwargs_dump):
        np.multiply(args[0], 2, out=out[0])
        if jaxbind.load_kwargs(kwargs_dump)["keep"]:
            KEPT.append(KEEPERS[keeper](out, args)[0])

    op = jaxbind.get_linear_call(hoard, hoard, same_shape, same_shape)
    f = jax.jit(lambda x: op(x, keep=False)[0])
    x = jnp.arange(8.0)
    np.testing.assert_array_equal(f(x), 2 * np.arange(8.0))
    with pytest.raises(RuntimeError, match=r"op 'hoard'.*kept a reference"):
        jax.block_until_ready(jax.jit(lambda x: op(x, keep=True)[0])(x + 1))
    if keeper == "a slice":  # (an eager call too)
        with pytest.raises(RuntimeError, match=r"op 'hoard'.*kept a reference"):
            jax.block_until_ready(op(x + 2, keep=True)[0])
        assert len(KEPT) == 2
    reached = _reaching(KEPT)
    assert reached or keeper == "a weak reference", "the keeper kept nothing to check"
    for array in reached:
        _assert_cut_off(array)
    # the op goes on working, and what was kept never sees a later call's memory
    for k in range(3):
        np.testing.assert_array_equal(f(x + k), 2 * (np.arange(8.0) + k))
    for array in reached:
        _assert_cut_off(array)
    KEPT.clear()


def test_a_kept_jax_array_over_an_output_is_reported_and_deleted():
    kept = []

    def hoard(out, args, kwargs_dump):
        np.multiply(args[0], 2, out=out[0])
        kept.append(jnp.from_dlpack(out[0]))  # no copy: a JAX array over XLA's memory

    op = jaxbind.get_linear_call(hoard, hoard, same_shape, same_shape)
    with pytest.raises(RuntimeError, match=r"op 'hoard'.*kept a reference"):
        jax.block_until_ready(jax.jit(lambda x: op(x)[0])(jnp.arange(6.0) + 1))
    with pytest.raises(RuntimeError, match="deleted"):
        np.asarray(kept[0])


def test_a_ctypes_alias_is_reported_and_its_view_cut_off():
    """A ctypes object over an array cannot be cut off (README: raw pointers and ctypes)."""
    kept = []

    def hoard(out, args, kwargs_dump):
        np.multiply(args[0], 2, out=out[0])
        kept.append((ctypes.c_double * 4).from_buffer(out[0]))

    op = jaxbind.get_linear_call(hoard, hoard, same_shape, same_shape)
    with pytest.raises(RuntimeError, match=r"op 'hoard'.*kept a reference"):
        jax.block_until_ready(jax.jit(lambda x: op(x)[0])(jnp.arange(4.0)))
    assert len(kept) == 1  # reported; the README says not to keep such aliases


def test_an_input_array_the_user_views_themselves_is_not_cut_off():
    """A zero-copy NumPy view the user holds of their own JAX input is theirs, not the callback's."""
    kept = []

    def hoard(out, args, kwargs_dump):
        np.multiply(args[0], 2, out=out[0])
        kept.append(args[0])

    op = jaxbind.get_linear_call(hoard, hoard, same_shape, same_shape)
    x = jnp.arange(1024.0) + 1
    mine = np.asarray(x)  # zero-copy on the CPU: a view of x's buffer
    with pytest.raises(RuntimeError, match=r"op 'hoard'.*kept a reference"):
        jax.block_until_ready(op(x)[0])
    assert kept[0].size == 0
    np.testing.assert_array_equal(mine, np.arange(1024.0) + 1)


def test_aliases_are_cut_off_with_dead_weak_proxies_on_the_heap():
    # isinstance() of a weak proxy whose object died raises ReferenceError: the
    # heap walk must step over such proxies (a full test run leaves some).
    class Target:
        pass

    target = Target()
    dead = [weakref.proxy(target), weakref.proxy(lambda: None)]
    del target
    KEPT.clear()

    def hoard(out, args, kwargs_dump):
        np.multiply(args[0], 2, out=out[0])
        KEPT.append(out[0][1:])

    op = jaxbind.get_linear_call(hoard, hoard, same_shape, same_shape)
    with pytest.raises(RuntimeError, match=r"op 'hoard'.*kept a reference"):
        jax.block_until_ready(jax.jit(lambda x: op(x)[0])(jnp.arange(8.0)))
    _assert_cut_off(KEPT[0])
    assert len(dead) == 2
    KEPT.clear()


# Objects that copy a view's data pointer (and shape) when they are made: retiring the view alone
# would leave them reading XLA's memory. Each keeper returns the object and a check that it reaches
# none of that memory any more.
if numba is not None:

    @numba.njit
    def _first_item_size(items):
        return items[0].size


def _numba_list_of(view):
    items = numba.typed.List()
    items.append(view)
    return items


def _numba_dict_of(view):
    items = numba.typed.Dict.empty(numba.types.int64, numba.typeof(view))
    items[0] = view
    return items


POINTER_KEEPERS = {
    "a flat iterator": (
        lambda out, args: out[0].flat,
        lambda kept, _: list(kept) == [] and pytest.raises(IndexError, kept.__getitem__, 0),
    ),
    "np.nditer": (
        lambda out, args: np.nditer(args[0]),
        lambda kept, _: list(kept) == [] and pytest.raises(ValueError, getattr, kept, "operands"),
    ),
    "np.broadcast": (
        lambda out, args: np.broadcast(args[0], 1.0),
        lambda kept, _: list(kept) == [] and all(list(it) == [] for it in kept.iters),
    ),
    "an array's ctypes object": (
        lambda out, args: out[0].ctypes,
        lambda kept, memory: tuple(kept.shape) == (0,) and not memory[0] <= kept.data < memory[1],
    ),
}
NUMBA_POINTER_KEEPERS = {
    "a numba typed List": (
        lambda out, args: _numba_list_of(args[0]),
        lambda kept, _: _first_item_size(kept) == 0 and kept[0].size == 0,
    ),
    "a numba typed Dict": (lambda out, args: _numba_dict_of(out[0]), lambda kept, _: kept[0].size == 0),
}
POINTER_KEEPERS.update(NUMBA_POINTER_KEEPERS)


@pytest.mark.parametrize(
    "keeper", [pytest.param(k, marks=needs_numba) if k in NUMBA_POINTER_KEEPERS else k for k in POINTER_KEEPERS]
)
def test_a_kept_object_holding_a_pointer_is_cut_off(keeper):
    make, is_cut_off = POINTER_KEEPERS[keeper]
    kept, memory = [], []

    def hoard(out, args, kwargs_dump):
        np.multiply(args[0], 2, out=out[0])
        for array in (args[0], out[0]):
            memory.append((array.ctypes.data, array.ctypes.data + array.nbytes))
        kept.append(make(out, args))

    op = jaxbind.get_linear_call(hoard, hoard, same_shape, same_shape)
    x = jnp.arange(float(1 << 16))  # (large enough that XLA's allocator returns reading it to the system)
    with pytest.raises(RuntimeError, match=r"op 'hoard'.*kept a reference"):
        jax.block_until_ready(jax.jit(lambda v: op(v)[0])(x))
    low, high = min(m[0] for m in memory), max(m[1] for m in memory)
    assert is_cut_off(kept[0], (low, high)), keeper
