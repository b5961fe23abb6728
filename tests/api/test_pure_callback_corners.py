"""jaxbind.pure_callback in the corners issue 33 found: how long a callback lives, what is written on
it, the dtypes of its results, export, derived views it keeps, and how a failing callback reaches the
caller and the log; each against jax.pure_callback on the same callback where that makes sense."""

import dataclasses
import functools
import gc
import json
import logging
import sys
import textwrap
import threading
import weakref

import _subprocesses
import jax
import jax.export  # (jax < 0.6 does not import it with jax)
import jax.numpy as jnp
import numpy as np
import pytest

import jaxbind
from jaxbind import _pure_callback

pc = jaxbind.pure_callback
APIS = {"jax": jax.pure_callback, "jaxbind": pc}


def like(x):
    return jax.ShapeDtypeStruct(jnp.shape(x), jnp.result_type(x))


# -- how long a callback lives, and nothing written on it (findings 5 and 7a) -------------------


class Slotted:
    __slots__ = ("k", "big")

    def __init__(self, k, big):
        self.k, self.big = k, big

    def apply(self, v):
        return v * self.k


@dataclasses.dataclass(frozen=True)
class Frozen:
    k: float
    big: object = dataclasses.field(compare=False, repr=False)

    def apply(self, v):
        return v * self.k


class CallableSlots(Slotted):
    __slots__ = ()

    def __call__(self, v):
        return v * self.k


class Strict:
    """A model whose ``__setattr__`` refuses names it does not declare, as pydantic's models do."""

    def __init__(self, k, big):
        object.__setattr__(self, "k", k)
        object.__setattr__(self, "big", big)

    def __setattr__(self, name, value):
        if name not in ("k", "big"):
            raise ValueError(f'"Strict" object has no field "{name}"')
        object.__setattr__(self, name, value)

    def apply(self, v):
        return v * self.k


def scaled(v, k, big):
    return v * k


OWNERS = {
    "bound method of a __slots__ instance": lambda k, big: Slotted(k, big).apply,
    "bound method of a frozen dataclass": lambda k, big: Frozen(k, big).apply,
    "callable __slots__ instance": lambda k, big: CallableSlots(k, big),
    "bound method of a model refusing new attributes": lambda k, big: Strict(k, big).apply,
    "functools.partial": lambda k, big: functools.partial(scaled, k=k, big=big),
    "closure": lambda k, big: lambda v: v * k + 0 * big[0],
}


def alive_after_use(api, make, n=6):
    """Objects of 1 MiB, each behind one callback called once jitted and once eagerly, then dropped:
    how many are alive after jax.clear_caches()."""
    refs = []
    x = jnp.arange(3.0)
    for k in range(n):
        big = np.full(2**17, float(k))
        refs.append(weakref.ref(big))
        cb = make(float(k), big)
        np.testing.assert_allclose(jax.jit(lambda v: api(cb, like(v), v))(x), k * x)  # noqa: F821  (a closure over a name deleted later, to drop its last reference)
        np.testing.assert_allclose(api(cb, like(x), x), k * x)
        del big, cb
    jax.clear_caches()
    gc.collect()
    return sum(r() is not None for r in refs)


@pytest.mark.parametrize("owner", OWNERS)
def test_a_dropped_callback_is_freed_whatever_its_owner(owner):
    assert alive_after_use(pc, OWNERS[owner]) == alive_after_use(jax.pure_callback, OWNERS[owner]) == 0


def test_nothing_is_written_on_the_callback_or_its_owner():
    @dataclasses.dataclass
    class Record:
        scale: float

        def apply(self, v):
            return v * self.scale

    def plain(v):
        return v + 1.0

    record, x = Record(2.0), jnp.arange(3.0)
    before = dict(vars(record)), dict(vars(plain))
    for cb, expected in ((record.apply, 2 * x), (plain, x + 1), (Strict(3.0, None).apply, 3 * x)):
        for api in APIS.values():
            np.testing.assert_allclose(jax.jit(lambda v: api(cb, like(v), v))(x), expected)
            np.testing.assert_allclose(api(cb, like(x), x), expected)
    assert (vars(record), vars(plain)) == before
    assert json.loads(json.dumps(vars(record))) == {"scale": 2.0}


class Touchy:
    """Its own equality and hash raise: jaxbind must tell callbacks apart without them."""

    def __init__(self, k):
        self.k = k

    def __eq__(self, other):
        raise AssertionError("__eq__ called")

    def __hash__(self):
        raise AssertionError("__hash__ called")

    def apply(self, v):
        return v * self.k


def test_one_op_per_callback_however_often_it_is_traced():
    x = jnp.arange(3.0)
    one_array = jax.tree_util.tree_structure(((x,), {}))
    touchy = Touchy(2.0)
    for cb in (np.sin, touchy.apply, Slotted(2.0, None).apply, functools.partial(scaled, k=2.0, big=None)):
        # (a bound method is a new object at each attribute access: still one op)
        again = getattr(cb.__self__, cb.__name__) if hasattr(cb, "__func__") else cb
        definition = _pure_callback._op_for(cb, one_array, None, None).definition
        assert _pure_callback._op_for(again, one_array, None, None).definition is definition
        assert _pure_callback._op_for(cb, one_array, "sequential", None).definition != definition
        # one made anew for the same callback is equal to it, so JAX's caches and the call sites hit
        made_again = _pure_callback._make_definition(again, one_array, None, None)
        assert made_again == definition and hash(made_again) == hash(definition)
    assert _pure_callback._make_definition(Touchy(2.0).apply, one_array, None, None) != _pure_callback._make_definition(
        touchy.apply, one_array, None, None
    )
    np.testing.assert_allclose(jax.jit(lambda v: pc(touchy.apply, like(v), v))(x), 2 * x)


def test_equal_calls_compile_once():
    solver, x = Slotted(3.0, None), jnp.arange(3.0)

    def fun(v):
        return pc(solver.apply, like(v), v)

    compiled = jax.jit(fun)
    for _ in range(3):
        np.testing.assert_allclose(compiled(x), 3 * x)
        np.testing.assert_allclose(jax.jit(fun)(x), 3 * x)
    assert compiled._cache_size() == 1
    lowered = [jax.jit(lambda v: pc(solver.apply, like(v), v)).lower(x).as_text() for _ in range(2)]
    assert lowered[0] == lowered[1]  # the same call site: one program, which the caches find


def test_ops_are_found_from_many_threads_at_once():
    solver = Slotted(2.0, None)
    one_array = jax.tree_util.tree_structure(((0,), {}))
    found, start = [], threading.Barrier(4)
    held = _pure_callback._op_for(solver.apply, one_array, None, None).definition  # (as a jaxpr would)

    def trace():
        start.wait()
        found.extend(id(_pure_callback._op_for(solver.apply, one_array, None, None).definition) for _ in range(200))

    threads = [threading.Thread(target=trace) for _ in range(4)]
    for t in threads:
        t.start()
    for t in threads:
        t.join()
    assert len(found) == 800 and set(found) == {id(held)}


# -- the dtypes of the results (finding 7b) -----------------------------------------------------

DTYPES = textwrap.dedent("""
    import json
    import jax, jax.numpy as jnp, numpy as np
    import jaxbind
    jax.config.update("jax_enable_x64", True)
    x = jnp.arange(3.0)
    same = {}
    # jaxbind first: JAX's own results must not depend on what ran before either
    for api in (jaxbind.pure_callback, jax.pure_callback):
        for name in ("complex128", "float32", "int16", "bool", "bfloat16", "float8_e4m3fn"):
            spec = jax.ShapeDtypeStruct((3,), np.dtype(name))
            cb = lambda a: np.asarray(a).astype(name)
            jitted = jax.jit(lambda v: api(cb, spec, v))(x)
            eager = api(cb, spec, x)
            same[f"{api.__module__} {name}"] = [jitted.dtype is np.dtype(name), eager.dtype is np.dtype(name)]
    print(json.dumps(same))
""")


def test_results_carry_numpys_own_dtype_objects(tmp_path):
    # (run from elsewhere: in the repository the source folder jaxbind/ would shadow the installed package)
    code, out, err = _subprocesses.run([sys.executable, "-c", DTYPES], 300, "the dtypes script", cwd=tmp_path)
    assert code == 0, err[-4000:]
    same = json.loads(out.strip().splitlines()[-1])
    assert same == {key: [True, True] for key in same} and len(same) == 12


def test_float0_results_stay_float0():
    spec = (jax.ShapeDtypeStruct((3,), jnp.float64), jax.ShapeDtypeStruct((2,), jax.dtypes.float0))

    def cb(v):
        return v * 2, np.zeros(2, jax.dtypes.float0)

    x = jnp.arange(3.0)
    for api in APIS.values():
        for y, z in (jax.jit(lambda v: api(cb, spec, v))(x), api(cb, spec, x)):
            np.testing.assert_allclose(y, 2 * x)
            assert z.dtype == jax.dtypes.float0 and z.shape == (2,)


# -- export (finding 7c) ------------------------------------------------------------------------


def test_exporting_a_pure_callback_is_refused_whatever_ran_before():
    x = jnp.arange(3.0)
    with pytest.raises(NotImplementedError, match="serialization of host_callbacks is not yet implemented"):
        jax.export.export(jax.jit(lambda v: jax.pure_callback(np.sin, like(v), v)))(x).serialize()
    for _k in range(2):  # the second time another lambda of the same name has been traced
        jax.jit(lambda v: pc(lambda a: a * 2, like(v), v))(x)
        with pytest.raises(NotImplementedError) as info:
            jaxbind.export(jax.jit(lambda v: pc(lambda a: a + 1, like(v), v)))(x)
        message = str(info.value)
        assert "pure_callback(test_exporting_a_pure_callback_is_refused_whatever_ran_before.<locals>." in message
        assert "serialization of host_callbacks is not yet implemented" in message
        assert "jaxbind.get_nonlinear_call(" in message and 'name="' in message

    def plus_one(out, args, kwargs_dump):
        np.add(args[0], 1, out=out[0])

    op = jaxbind.get_nonlinear_call(plus_one, None, lambda v: ((v.shape, v.dtype),), None, name="plus_one_exported")
    exported = jaxbind.export(jax.jit(lambda v: op(v)[0]))(x)  # what the message advises works
    np.testing.assert_allclose(exported.call(x), x + 1)


# -- derived views a callback keeps (finding 7d) ------------------------------------------------

KEPT_LIST: list = []
KEPT_DICT: dict = {}
KEEPERS = {
    "a slice": lambda v, d: KEPT_LIST.append(v[1:]),
    "a reshape": lambda v, d: KEPT_LIST.append(v.reshape(2, -1)),
    "a transposed reshape": lambda v, d: KEPT_DICT.setdefault(len(KEPT_DICT), v.reshape(2, -1).T),
    "another dtype's view": lambda v, d: KEPT_LIST.append(v.view(np.int64)),
    "slices in a list": lambda v, d: KEPT_LIST.append([v[:2], v[2:]]),
    "a slice of a dict leaf": lambda v, d: KEPT_DICT.setdefault(len(KEPT_DICT), d["w"][::2]),
    "the input and its slice": lambda v, d: KEPT_LIST.append((v, v[3:])),
}


def kept_values(api, keep):
    KEPT_LIST.clear()
    KEPT_DICT.clear()

    def cb(v, d):
        keep(v, d)
        return v + d["w"]

    f = jax.jit(lambda v, w: api(cb, like(v), v, {"w": w}))
    for k in range(3):
        x = jnp.arange(8.0) + 10 * k
        np.testing.assert_allclose(f(x, -x), 0 * x)
    for k in range(3):  # later programs reuse XLA's buffers
        jax.jit(lambda v: v * -7.0)(jnp.arange(8.0) + k).block_until_ready()
    kept = jax.tree_util.tree_leaves((KEPT_LIST, KEPT_DICT))
    values = [np.asarray(a).tolist() for a in kept]
    writeable = [bool(a.flags.writeable) for a in kept if isinstance(a, np.ndarray)]
    KEPT_LIST.clear()
    KEPT_DICT.clear()
    return values, writeable


@pytest.mark.parametrize("keep", KEEPERS)
def test_derived_views_a_callback_keeps_keep_their_values(keep):
    ref, _ = kept_values(jax.pure_callback, KEEPERS[keep])
    got, writeable = kept_values(pc, KEEPERS[keep])
    assert got == ref and len(got) >= 3
    assert writeable == [False] * len(got)  # read-only, as they were given


POINTER_HOLDERS = {
    "a memoryview": memoryview,
    "a flat iterator": lambda a: a.flat,
    "an nditer": np.nditer,
    "a ctypes object": lambda a: a.ctypes,
}


@pytest.mark.parametrize("holder", POINTER_HOLDERS)
def test_what_cannot_be_given_a_copy_is_refused_and_cut_off(holder):
    kept = []

    def cb(v):
        kept.append(POINTER_HOLDERS[holder](v[1:]))
        return v

    x = jnp.arange(6.0)
    with pytest.raises(jax.errors.JaxRuntimeError, match="kept a reference to one of its"):
        jax.jit(lambda v: pc(cb, like(v), v))(x).block_until_ready()
    if holder == "a memoryview":
        with pytest.raises(ValueError, match="released memoryview"):
            kept[0].tobytes()
    elif holder == "a flat iterator":
        assert list(kept[0]) == []


# -- a failing callback: what the caller gets, what is logged (findings 7e and 7f) -------------


def the_solver_diverges(v):
    raise ValueError("the solver diverged")


def test_an_eager_call_fails_as_a_jitted_call_does():
    x = jnp.arange(3.0)
    for api in APIS.values():
        with pytest.raises(jax.errors.JaxRuntimeError, match="ValueError: the solver diverged"):
            api(the_solver_diverges, like(x), x)
    with pytest.raises(jax.errors.JaxRuntimeError) as eager:
        pc(the_solver_diverges, like(x), x)
    with pytest.raises(jax.errors.JaxRuntimeError) as jitted:
        jax.jit(lambda v: pc(the_solver_diverges, like(v), v))(x).block_until_ready()
    for err in (eager.value, jitted.value):
        text = str(err)
        assert text.startswith(
            "INTERNAL: jaxbind op 'pure_callback(the_solver_diverges)': the callback "
            "raised ValueError: the solver diverged\nTraceback (most recent call last):"
        )
        assert 'in the_solver_diverges\n    raise ValueError("the solver diverged")' in text
    assert type(eager.value.__cause__) is ValueError and str(eager.value.__cause__) == "the solver diverged"
    for cb, what in (
        (lambda v: np.ones(4), "Incorrect output shape for return value #0"),
        (lambda v: (v, v), "Mismatched number of outputs from callback"),
    ):
        for api in APIS.values():
            with pytest.raises(jax.errors.JaxRuntimeError, match=what):
                api(cb, like(x), x)


class EquinoxFilter(logging.Filter):
    """What Equinox adds to the logger "jax._src.callback" while a checked function runs."""

    def filter(self, record):
        return not (record.name == "jax._src.callback" and record.getMessage() == "jax.pure_callback failed")


def logged(api, cb, caplog):
    x = jnp.arange(3.0)
    records = []
    for call in (lambda: jax.jit(lambda v: api(cb, like(v), v))(x).block_until_ready(), lambda: api(cb, like(x), x)):
        caplog.clear()
        with caplog.at_level(logging.WARNING):
            with pytest.raises(jax.errors.JaxRuntimeError):
                call()
        records.append([(r.name, r.levelname, r.getMessage(), r.exc_info is not None) for r in caplog.records])
    return records


def test_a_failing_callback_is_logged_as_jax_logs_it(caplog):
    ref = logged(jax.pure_callback, the_solver_diverges, caplog)
    assert ref == [[("jax._src.callback", "ERROR", "jax.pure_callback failed", True)]] * 2
    assert logged(pc, the_solver_diverges, caplog) == ref
    wrong_shape = lambda v: np.ones(4)
    assert logged(pc, wrong_shape, caplog) == logged(jax.pure_callback, wrong_shape, caplog)
    jax_logger = logging.getLogger("jax._src.callback")
    equinox = EquinoxFilter()
    jax_logger.addFilter(equinox)
    try:  # Equinox's filter leaves nothing to print
        assert logged(pc, the_solver_diverges, caplog) == [[], []]
    finally:
        jax_logger.removeFilter(equinox)


IN_FLIGHT = textwrap.dedent("""
    import gc, json
    import jax, jax.numpy as jnp, numpy as np
    from jax.sharding import Mesh, NamedSharding, PartitionSpec as P
    import jaxbind
    sharding = NamedSharding(Mesh(np.array(jax.devices()), ("x",)), P("x"))
    x = jnp.arange(8.0)
    out = {}
    for name, api in (("jax", jax.pure_callback), ("jaxbind", jaxbind.pure_callback)):
        values = []
        for k in range(20):  # (XLA runs the sharded program on its threads, after jit is dropped)
            y = jax.jit(lambda v: api(np.sin, v, v) + k, in_shardings=sharding, out_shardings=sharding)(x)
            gc.collect()  # (a collection before XLA runs the call frees what only a cycle holds)
            values.append(np.asarray(y).tolist())
        out[name] = values
    print(json.dumps(out))
""")


def test_a_program_queued_by_a_dropped_jit_still_finds_its_callback(tmp_path):
    env = _subprocesses.environment()
    env["XLA_FLAGS"] = f"{env.get('XLA_FLAGS', '')} --xla_force_host_platform_device_count=4".strip()
    code, out, err = _subprocesses.run(
        [sys.executable, "-c", IN_FLIGHT], 300, "the in-flight script", env=env, cwd=tmp_path
    )
    assert code == 0, err[-4000:]
    results = json.loads(out.strip().splitlines()[-1])
    assert results["jaxbind"] == results["jax"]
    np.testing.assert_allclose(results["jaxbind"][3], np.sin(np.arange(8.0)) + 3, rtol=1e-6)
