"""Call sites: what a compiled program names them by, what it cannot make this process
call, and how long they live (freed with their op and the last program that names them)."""

import gc
import json
import pickle
import weakref

import jax
import jax.export  # (jax < 0.6 does not import it with jax)
import jax.numpy as jnp
import numpy as np
import pytest
from _shared import Planted

import jaxbind
from jaxbind import _kwargs, _sites, _trampoline
from jaxbind._runtime import TARGET

like = lambda *args, **kwargs: ((args[-1].shape, args[-1].dtype),)


def doubling(out, args, kwargs_dump):
    out[0][...] = 2 * args[-1]


def make_op(name, f=doubling):
    return jaxbind.get_linear_call(f, f, like, like, name=name)


def description_of(fn, *args):
    """The (description, key) pairs of the jaxbind calls in fn's program."""
    text = jax.jit(fn).lower(*args).as_text()
    found = []
    for line in text.splitlines():
        if "jaxbind_dispatch" in line and "jaxbind = " in line:
            raw = line.split('jaxbind = "', 1)[1].split('", site = ', 1)
            key = int(raw[1].split(" ", 1)[0])
            found.append((raw[0].replace("\\22", '"'), key))
    return found


def call_forged(text, key=None, shape=(2,)):
    key = _sites.key_of(text) if key is None else key
    call = jax.ffi.ffi_call(TARGET, jax.ShapeDtypeStruct(shape, jnp.float32))
    x = jnp.arange(1, 1 + np.prod(shape), dtype=jnp.float32).reshape(shape)
    return np.asarray(jax.jit(lambda v: call(v, jaxbind=text, site=np.int64(key)))(x))


def test_a_program_names_its_sites_by_what_defines_them():
    op = make_op("named_site")
    x = jnp.ones(3)
    first = description_of(lambda v: op(v, factor=2)[0], x)
    again = description_of(lambda v: op(v, factor=2)[0], x)
    assert first == again and len(first) == 1
    description = json.loads(first[0][0])
    assert description["op"] == "named_site" and description["schema"] == _sites.SCHEMA
    assert description["index"] == 0 and first[0][1] == _sites.key_of(first[0][0])
    assert pickle.loads(__import__("base64").b64decode(description["kwargs"])) == {"factor": 2}
    # another op of the same name (other callbacks) is another site: index 1
    other = make_op("named_site", f=lambda out, args, kw: out[0].__setitem__(..., 3 * args[0]))
    theirs = description_of(lambda v: other(v, factor=2)[0], x)
    assert json.loads(theirs[0][0])["index"] == 1 and theirs[0][1] != first[0][1]
    np.testing.assert_allclose(op(x, factor=2)[0], 2 * np.ones(3))
    np.testing.assert_allclose(other(x, factor=2)[0], 3 * np.ones(3))
    # an equal definition (same functions, flags, name) shares the index and the site
    same = make_op("named_site")
    assert description_of(lambda v: same(v, factor=2)[0], x) == first


def test_forged_and_foreign_programs_are_errors_naming_the_op():
    op = make_op("forge_target")
    ((text, key),) = description_of(lambda v: op(v)[0], jnp.ones(2, jnp.float32))
    description = json.loads(text)
    encode = lambda d: json.dumps(d, sort_keys=True, separators=(",", ":"))
    # the real site, and the same call as another process would describe it (no index)
    np.testing.assert_allclose(call_forged(text, key), [2, 4])
    exported = dict(description)
    del exported["index"]
    np.testing.assert_allclose(call_forged(encode(exported)), [2, 4])
    cases = {
        "does not define": dict(description, op="never_defined_op"),
        "different op of this name": dict(description, **{"def": dict(description["def"], residuals=2)}),
        "schema is 9": dict(description, schema=9),
        "no such callback": dict(description, role=[3, 0, 0, [1]]),
    }
    for message, forged in cases.items():
        with pytest.raises(Exception, match=message) as info:
            call_forged(encode(forged))
        assert "jaxbind" in str(info.value)
    with pytest.raises(Exception, match="does not match its description"):
        call_forged(text, key=key + 1)
    with pytest.raises(Exception, match="not readable"):
        call_forged("{not json")


def test_kwargs_from_a_program_are_plain_data_only():
    op = make_op("plain_kwargs")
    ((text, _),) = description_of(lambda v: op(v)[0], jnp.ones(2, jnp.float32))
    description = json.loads(text)
    del description["index"]
    evil = pickle.dumps({"factor": Planted()})
    description["kwargs"] = __import__("base64").b64encode(evil).decode()
    with pytest.raises(Exception, match="plain data"):
        call_forged(json.dumps(description, sort_keys=True, separators=(",", ":")))
    assert not Planted.called
    # numbers, arrays and containers do travel
    fine = {"a": [1, 2.5, 3j], "b": np.arange(3), "c": {"d": (None, True)}, "e": np.float32(2)}
    assert _kwargs.load_plain(pickle.dumps(fine), "op 'x'")["b"].tolist() == [0, 1, 2]


def test_export_in_process_and_duplicate_names():
    op = make_op("exported_here")
    x = jnp.arange(3.0)
    exp = jaxbind.export(jax.jit(lambda v: op(v)[0] ** 2))(x)
    assert "jaxbind_dispatch" in exp.mlir_module()
    np.testing.assert_allclose(exp.call(x), (2 * x) ** 2)
    np.testing.assert_allclose(jax.grad(lambda v: exp.call(v).sum())(x), 8 * x)
    # without jaxbind.export, jax.export refuses the unknown target (JAX's check)
    with pytest.raises(ValueError, match="jaxbind_dispatch"):
        jax.export.export(jax.jit(lambda v: op(v)[0]))(x)
    twin = make_op("exported_here", f=lambda out, args, kw: out[0].__setitem__(..., args[0]))
    with pytest.raises(ValueError, match="2 different ops named 'exported_here'.*distinct name="):
        jaxbind.export(jax.jit(lambda v: twin(v)[0]))(x)


# ---------------------------------------------------------------------------
# Lifetimes
# ---------------------------------------------------------------------------


def scaled_by(big):
    def apply(out, args, kwargs_dump):
        out[0][...] = big[: args[0].size].reshape(args[0].shape) * args[0]

    return apply


def factory(big):
    apply = scaled_by(big)
    return jaxbind.get_linear_call(apply, apply, like, like, name="factory_op")


def collect():
    for _ in range(3):
        gc.collect()


@pytest.mark.parametrize("how", ["eager", "jit", "grad_vmap"])
def test_ops_dropped_after_use_are_freed(how):
    x = jnp.ones((2, 3))
    live_before = _trampoline.num_live_sites()
    refs = []
    for k in range(5):
        big = np.full(10**6, float(k + 1))  # 8 MB each
        refs.append(weakref.ref(big))
        op = factory(big)
        if how == "eager":
            value = op(x)[0]
        elif how == "jit":
            value = jax.jit(lambda v: op(v)[0] + 0)(x)  # noqa: F821  (a closure over a name deleted later, to drop its last reference)
        else:
            value = jax.jit(jax.vmap(jax.grad(lambda v: op(v)[0].sum())))(x)  # noqa: F821  (a closure over a name deleted later, to drop its last reference)
        np.testing.assert_allclose(value, (k + 1) * np.ones((2, 3)))
        del big, op, value
    collect()
    assert [r() is None for r in refs] == [True] * 5
    assert _trampoline.num_live_sites() <= live_before


def test_equal_ops_share_one_eager_executable_which_leaves_with_the_last():
    from jaxbind import _op

    big = np.full(10**6, 3.0)
    ref = weakref.ref(big)

    apply = scaled_by(big)
    op1, op2 = (jaxbind.get_linear_call(apply, apply, like, like, name="shared_op") for _ in range(2))
    del big, apply
    assert op1 == op2 and op1 is not op2
    x = jnp.ones((2, 3))
    compiles = []
    jax.monitoring.register_event_duration_secs_listener(
        lambda event, _, **kw: (
            compiles.append(event)
            if event == "/jax/compilation_cache/compile_requests_use_cache"
            or event.endswith("backend_compile_duration")
            else None
        )
    )
    try:
        np.testing.assert_allclose(op1(x)[0], 3 * np.ones((2, 3)))
        n = len(compiles)
        assert n >= 1  # (the listener sees compilations)
        np.testing.assert_allclose(op2(x)[0], 3 * np.ones((2, 3)))
        assert len(compiles) == n, "the second equal op compiled its eager call again"
    finally:
        jax.monitoring.clear_event_listeners()
    (entry,) = [e for k, e in _op._EAGER.items() if k[0].op == op1.definition]
    assert entry[1] == {id(op1), id(op2)}
    del op1
    collect()
    assert ref() is not None and any(k[0].op == op2.definition for k in _op._EAGER)  # op2 still uses it
    np.testing.assert_allclose(op2(x)[0], 3 * np.ones((2, 3)))
    definition = op2.definition
    del op2, entry
    collect()
    assert not any(k[0].op is definition for k in _op._EAGER)
    del definition
    collect()
    assert ref() is None  # the executable and what the callback captured are gone


def test_a_kept_program_keeps_its_sites_and_frees_them_with_it():
    big = np.full(10**6, 3.0)
    ref = weakref.ref(big)
    op = factory(big)
    x = jnp.ones(4)
    compiled = jax.jit(lambda v: op(v)[0] * 2).lower(x).compile()  # noqa: F821  (a closure over a name deleted later, to drop its last reference)
    kept = jax.jit(lambda v: op(v)[0] - 1)  # noqa: F821  (a closure over a name deleted later, to drop its last reference)
    np.testing.assert_allclose(kept(x), 2 * np.ones(4))
    live = _trampoline.num_live_sites()
    del big, op
    collect()
    assert ref() is not None  # programs that can still run hold it
    np.testing.assert_allclose(compiled(x), 6 * np.ones(4))
    np.testing.assert_allclose(kept(x), 2 * np.ones(4))
    del compiled, kept
    collect()
    assert ref() is None and _trampoline.num_live_sites() < live


def test_native_sites_are_freed_too(kernels):
    live_before = _trampoline.num_live_sites()
    for factor in (2.0, 3.0):
        op = jaxbind.get_linear_call(kernels.jb_scale, kernels.jb_scale, like, like, name="native_freed")
        np.testing.assert_allclose(op(jnp.ones(3), factor=factor)[0], factor * np.ones(3))
        np.testing.assert_allclose(
            jax.jit(jax.vmap(lambda v: op(v, factor=factor)[0]))(jnp.ones((2, 3))),  # noqa: F821  (a closure over a name deleted later, to drop its last reference)
            factor * np.ones((2, 3)),
        )
        del op
    collect()
    assert _trampoline.num_live_sites() <= live_before


def numba_factory(big):
    pytest.importorskip("numba")

    def apply(out, args, kwargs):  # a closure: numba compiles `big` into the kernel
        for i in range(args[0].size):
            out[0].flat[i] = big[i] * args[0].flat[i]

    return jaxbind.get_nonlinear_call(jaxbind.numba_kernel(apply), None, like, None, name="numba_closure")


@pytest.mark.parametrize("how", ["eager", "jit_vmap"])
def test_numba_kernels_made_from_closures_are_freed(how):
    x = jnp.ones((2, 3))
    live_before = _trampoline.num_live_sites()
    refs = []
    for k in range(4):
        big = np.full(10**6, float(k + 1))  # 8 MB each, captured by the kernel's function
        refs.append(weakref.ref(big))
        op = numba_factory(big)
        value = op(x)[0] if how == "eager" else jax.jit(jax.vmap(lambda v: op(v)[0] + 0))(x)  # noqa: F821  (a closure over a name deleted later, to drop its last reference)
        np.testing.assert_allclose(value, (k + 1) * np.ones((2, 3)))
        del big, op, value
    collect()
    assert [r() is None for r in refs] == [True] * 4
    assert _trampoline.num_live_sites() <= live_before
    # and kernels made afterwards compile and run (the freed code is disposed of safely)
    np.testing.assert_allclose(numba_factory(np.full(6, 7.0))(x)[0], 7 * np.ones((2, 3)))


def test_a_freed_site_named_again_is_resolved_or_refused():
    # A serialized program outlives the op it resolved: calling it after the op
    # is gone is an error naming the op; defining the op again makes it run.
    op = make_op("comes_and_goes")
    x = jnp.arange(3.0)
    # (an Exported holds the function it was made from: keep only its bytes)
    exp = jax.export.deserialize(jaxbind.export(jax.jit(lambda v: op(v)[0]))(x).serialize())  # noqa: F821  (a closure over a name deleted later, to drop its last reference)
    np.testing.assert_allclose(exp.call(x), 2 * x)
    del op
    jax.clear_caches()
    collect()
    with pytest.raises(Exception, match="op 'comes_and_goes'.*does not define"):
        np.asarray(exp.call(x))
    again = make_op("comes_and_goes", f=lambda out, args, kw: out[0].__setitem__(..., 5 * args[0]))  # noqa: F841  (kept alive: the op the program names)
    np.testing.assert_allclose(exp.call(x), 5 * x)


def test_the_eager_cache_is_bounded():
    from jaxbind import _op

    op = make_op("many_kwargs")
    for k in range(_op.EAGER_CACHE_SIZE + 20):
        np.testing.assert_allclose(op(jnp.ones(1), k=k)[0], [2.0])
    assert len(_op._EAGER) <= _op.EAGER_CACHE_SIZE
    assert len(op._eager_keys) <= _op.EAGER_CACHE_SIZE + 1


def scale_by_factor(out, args, kwargs_dump):
    out[0][...] = jaxbind.load_kwargs(kwargs_dump)["factor"] * args[0]


def test_a_long_lived_op_keeps_no_site_of_a_program_that_is_gone():
    from jaxbind import _op

    op = make_op("many_kwargs", f=scale_by_factor)
    x = jnp.ones(3)
    collect()
    live_before = _trampoline.num_live_sites()
    for k in range(300):  # a new jitted function per value, as a script's loop makes them
        np.testing.assert_allclose(jax.jit(lambda v: op(v, factor=float(k))[0])(x), k * np.ones(3))
    collect()
    # (before: 300 more, one per value, for as long as the op lived; JAX's own caches may keep a few)
    assert _trampoline.num_live_sites() - live_before < 20
    for k in range(300):  # eager calls: the eager cache's size bounds them
        np.testing.assert_allclose(op(x, factor=float(k))[0], k * np.ones(3))
    collect()
    assert _trampoline.num_live_sites() - live_before <= _op.EAGER_CACHE_SIZE + 20
    np.testing.assert_allclose(jax.jit(lambda v: op(v, factor=0.5)[0])(x), 0.5 * np.ones(3))


class Factor:  # a kwarg that is not plain data: a program made elsewhere could not carry it
    def __init__(self, value):
        self.value = value

    def __eq__(self, other):
        return isinstance(other, Factor) and other.value == self.value

    def __hash__(self):
        return hash(self.value)


def scale_by_object(out, args, kwargs_dump):
    out[0][...] = jaxbind.load_kwargs(kwargs_dump)["factor"].value * args[0]


def test_a_program_that_outlives_its_sites_holders_still_runs():
    # JAX may run an executable after its Python half (which holds the sites)
    # is gone: in flight, or from its C++ dispatch cache. Here the site's
    # handle is released under a compiled program that still runs.
    op = make_op("outlived", f=scale_by_object)
    x = jnp.arange(3.0)
    compiled = jax.jit(lambda v: op(v, factor=Factor(3.0))[0]).lower(x).compile()
    np.testing.assert_allclose(compiled(x), 3 * x)
    (key,) = [k for k, h in _sites._live.items() if "outlived" in h.description]
    held = _sites._live.pop(key)  # as when its last holder is collected (its program lives on)
    released = held.serial
    live_before = _trampoline.num_live_sites()
    _trampoline.release_site(released)
    assert _trampoline.num_live_sites() == live_before - 1
    for _ in range(3):  # made anew from the program's own description, its kwargs included
        np.testing.assert_allclose(compiled(x), 3 * x)
    remade = op.definition._resolved[key]
    assert remade.serial != released and _sites._live[key] is remade
    assert _trampoline.num_live_sites() == live_before


def test_a_site_released_while_its_walk_runs_finishes_the_walk():
    # The last holder of a site may go while XLA runs it (the collector, on
    # another thread): the running dispatch keeps what it calls until it ends.
    serials = []

    def body(out, args, kwargs_dump):
        if serials:  # as when the handle's last holder is collected
            key, serial = serials.pop()
            _sites._live.pop(key)
            _trampoline.release_site(serial)
        out[0][...] = jaxbind.load_kwargs(kwargs_dump)["factor"] * args[0]

    op = jaxbind.get_nonlinear_call(body, None, like, None, name="released_mid_walk")
    x = jnp.arange(12.0).reshape(4, 3)
    f = jax.jit(jax.vmap(lambda v: op(v, factor=2.5)[0]))
    lowered = f.lower(x).compile()
    (handle,) = [h for h in _sites._live.values() if "released_mid_walk" in h.description]
    serials.append((handle.key, handle.serial))
    np.testing.assert_allclose(lowered(x), 2.5 * x)  # all 4 elements, the first releasing the site
    assert not serials
    np.testing.assert_allclose(lowered(x), 2.5 * x)  # and the next call makes it anew


def test_a_site_released_during_its_own_call_lets_go_of_its_callback_after_it():
    # The call keeps what it runs (the callback, what it captures, the kwargs) until it
    # returns, and nothing of it afterwards.
    class Captured:
        pass

    captured, pending, alive_when_released = Captured(), [], []
    probe = weakref.ref(captured)

    def body(out, args, kwargs_dump, captured=captured):
        if pending:  # as when the handle's last holder is collected on another thread
            key, serial = pending.pop()
            _sites._live.pop(key)
            _trampoline.release_site(serial)
            gc.collect()
            alive_when_released.append(probe() is not None)
        out[0][...] = 2 * args[0]

    op = jaxbind.get_nonlinear_call(body, None, like, None, name="released_in_its_call")
    del captured, body
    x = jnp.arange(3.0)
    compiled = jax.jit(lambda v: op(v)[0]).lower(x).compile()  # noqa: F821  (a closure over a name deleted later, to drop its last reference)
    (handle,) = [h for h in _sites._live.values() if "released_in_its_call" in h.description]
    pending.append((handle.key, handle.serial))
    np.testing.assert_allclose(compiled(x), 2 * x)
    assert alive_when_released == [True] and probe() is not None
    del handle, compiled, op
    jax.clear_caches()
    gc.collect()
    assert probe() is None


def _outliving_program(name):
    """A compiled program of a fresh op whose own site was released under it, and the key it names."""
    op = make_op(name, f=scale_by_object)
    x = jnp.arange(3.0)
    compiled = jax.jit(lambda v: op(v, factor=Factor(3.0))[0]).lower(x).compile()
    (key,) = [k for k, h in _sites._live.items() if name in h.description]
    held = _sites._live.pop(key)  # as when the program's Python half is gone (its executable lives on)
    for memo in [m for m, h in op.definition._sites.items() if h is held]:
        del op.definition._sites[memo]
    _trampoline.release_site(held.serial)
    return op, compiled, key, x


@pytest.mark.parametrize("when", ["before", "after"])
def test_a_handle_that_is_going_is_never_found_again(monkeypatch, when):
    # A handle goes (its last holder dropped on one thread) while another
    # thread, which took the GIL meanwhile, lowers the same call and runs
    # programs naming its key. It used to get the dying handle back, keep it
    # alive with its site released, and fail with "the resolver registered no
    # site" on every later call (seen under shard_map, where several threads
    # run one program). Here that thread's work runs inside the release,
    # before or after the site is marked dead.
    op, compiled, key, x = _outliving_program(f"going_{when}")
    compiled(x)  # the site made anew for the program's key, held by the op
    going = op.definition._resolved.pop(key)  # its only holder now
    serial, release, seen = going.serial, _sites._release, []

    def release_meanwhile(released):
        if when == "after":
            release(released)
        found = _sites._live.get(key)
        fresh = jax.jit(lambda v: op(v, factor=Factor(3.0))[0]).lower(x).compile()
        seen.append((released, found, fresh, np.asarray(fresh(x)), np.asarray(compiled(x))))
        if when == "before":
            release(released)

    live = _trampoline.num_live_sites()
    monkeypatch.setattr(_sites, "_release", release_meanwhile)
    del going
    monkeypatch.setattr(_sites, "_release", release)
    [(released, found, fresh, by_fresh, by_compiled)] = seen
    assert released == serial and found is None  # never the handle that is going
    np.testing.assert_allclose(by_fresh, 3 * x)
    np.testing.assert_allclose(by_compiled, 3 * x)
    made = _sites._live[key]  # registered by the lowering, taking the key over
    assert made.serial != serial
    for _ in range(3):
        np.testing.assert_allclose(fresh(x), 3 * x)
        np.testing.assert_allclose(compiled(x), 3 * x)
    assert _sites._live[key] is made and key not in op.definition._resolved  # nothing made again
    assert _trampoline.num_live_sites() == live  # the old site released, the new one live
