"""Programs forged as an attacker forges them: a real ``jaxbind.export`` artifact, its StableHLO edited
with JAX's own MLIR tools and serialized again. A program runs only what its description says, or is
refused naming the op; what a program's kwargs may build, and how large, is bounded by its bytes."""

import base64
import gc
import json
import pickle
import re
import resource
import struct
import threading

import _forging
import jax
import jax.export  # (jax < 0.6 does not import it with jax)
import jax.numpy as jnp
import numpy as np
import pytest
from _shared import Planted

import jaxbind
from jaxbind import _sites

like = lambda *args, **kwargs: ((args[-1].shape, args[-1].dtype),)
_CALL = re.compile(r'jaxbind = "((?:[^"\\]|\\.)*)", site = (\d+) : i64')


def _ran(counter):
    def doubling(out, args, kwargs_dump):
        counter.append(args[-1].shape)
        out[0][...] = 2 * args[-1]

    return doubling


def _exported(op, shape):
    return jaxbind.export(jax.jit(lambda v: op(v)[0]))(jax.ShapeDtypeStruct(shape, jnp.float32))


def _calls(exported):
    """The (description, key) of each jaxbind call in an exported program."""
    return [(text.replace("\\22", '"'), int(key)) for text, key in _CALL.findall(exported.mlir_module())]


def _forged(exported, description=None, key=None):
    """``exported`` with its one jaxbind call's description and/or key replaced, serialized and
    deserialized again as a file from elsewhere would be."""

    def edit(match):
        text = match.group(1) if description is None else description.replace('"', "\\22")
        return f'jaxbind = "{text}", site = {match.group(2) if key is None else key} : i64'

    text, n = _CALL.subn(edit, exported.mlir_module())
    assert n == 1
    return jax.export.deserialize(_forging.serialized_with(exported, text))


def _live_key(name):
    """The key of the live call site of op ``name`` (there is one)."""
    keys = [key for key, handle in list(_sites._live.items()) if json.loads(handle.description)["op"] == name]
    assert len(keys) == 1
    return keys[0]


def _encode(description):
    return json.dumps(description, sort_keys=True, separators=(",", ":"))


def test_a_program_runs_only_the_site_its_description_names():
    secret_calls, pub_calls = [], []
    secret = jaxbind.get_linear_call(_ran(secret_calls), _ran(secret_calls), like, like, name="secret")
    pub = jaxbind.get_linear_call(_ran(pub_calls), _ran(pub_calls), like, like, name="pub")
    live = jax.jit(lambda v: secret(v)[0])
    np.testing.assert_allclose(live(jnp.ones((2, 4), jnp.float32)), 2.0)  # secret's site is live
    secret_key = _live_key("secret")
    exported = _exported(pub, (4,))
    x = jnp.arange(4.0, dtype=jnp.float32)
    np.testing.assert_allclose(jax.export.deserialize(exported.serialize()).call(x), 2 * x)  # as made
    del pub_calls[:], secret_calls[:]
    # pub's program with secret's key: it describes pub on a (4,) array and must not run secret
    with pytest.raises(
        Exception,
        match=r"jaxbind op 'pub': the program names call site 0x[0-9a-f]+, "
        r"which in this process belongs to op 'secret'",
    ) as info:
        _forged(exported, key=secret_key).call(x)
    assert "altered" in str(info.value)
    # the description made to say secret's name, the key left (that of pub's live site)
    ((text, _),) = _calls(exported)
    renamed = _encode(dict(json.loads(text), op="secret"))
    with pytest.raises(Exception, match="jaxbind op 'secret': .* belongs to op 'pub'"):
        _forged(exported, description=renamed).call(x)
    assert secret_calls == [] and pub_calls == []
    # with secret's site gone, the same forged program is refused too, and stays refused after
    # secret is live again (checked once per compiled program, before any call)
    del live
    gc.collect()
    assert secret_key not in _sites._live
    program = jax.jit(_forged(exported, key=secret_key).call)
    with pytest.raises(Exception, match="does not match its description"):
        program(x)
    np.testing.assert_allclose(jax.jit(lambda v: secret(v)[0])(jnp.ones((2, 4), jnp.float32)), 2.0)
    with pytest.raises(Exception, match="does not match its description|belongs to op 'secret'"):
        program(x)
    assert secret_calls == [(2, 4)] and pub_calls == []


def test_trust_in_a_programs_kwargs_is_not_decided_by_a_public_digest(monkeypatch):
    # An attacker who can find descriptions with a given key (emulated: a key function with
    # collisions everywhere) forges one with a full pickle under the key of a site this process
    # made and released. Its kwargs must still be read as plain data only.
    monkeypatch.setattr(_sites, "key_of", lambda text: 0x5EC2E7)

    def reads_kwargs(out, args, kwargs_dump):
        jaxbind.load_kwargs(kwargs_dump)
        out[0][...] = 2 * args[-1]

    op = jaxbind.get_linear_call(reads_kwargs, reads_kwargs, like, like, name="trusted")
    x = jnp.arange(4.0, dtype=jnp.float32)
    exported = _exported(op, (4,))
    made_here = jax.jit(lambda v: op(v, factor=2)[0])
    np.testing.assert_allclose(made_here(x), 2 * x)
    assert _live_key("trusted") == 0x5EC2E7
    del made_here
    gc.collect()
    assert 0x5EC2E7 in _sites._made_here and 0x5EC2E7 not in _sites._live
    description = json.loads(_calls(exported)[0][0])
    description["kwargs"] = base64.b64encode(pickle.dumps({"factor": Planted()})).decode()
    with pytest.raises(Exception, match="plain data"):
        _forged(exported, description=_encode(description), key=0x5EC2E7).call(x)
    assert not Planted.called


def _with_kwargs(exported, dump):
    description = json.loads(_calls(exported)[0][0])
    description["kwargs"] = base64.b64encode(dump).decode()
    text = _encode(description)
    return _forged(exported, description=text, key=_sites.key_of(text))


class _Reduce:
    def __init__(self, fn, args):
        self.fn, self.args = fn, args

    def __reduce__(self):
        return self.fn, self.args


def _nested(kind, levels):
    value = kind([1])
    for _ in range(levels):
        value = kind([value, value])
    return value


_multiarray = getattr(np, "_core", getattr(np, "core", None)).multiarray
_GiB = 2**30
_FORGED_KWARGS = {
    "bytearray(2 GiB)": (pickle.dumps({"r": _Reduce(bytearray, (2 * _GiB,))}, 4), "builtins.bytearray"),
    "a 2 GiB string that is not there": (b"\x80\x05}\x8c\x01r\x8e" + struct.pack("<Q", 2 * _GiB) + b"s.", "bytes8"),
    "a memo slot 2**28 long": (b"\x80\x05}r" + struct.pack("<I", 2**28) + b".", "memo index"),
    "set(range(10**9))": (pickle.dumps({"r": _Reduce(set, (range(10**9),))}), "set of a range"),
    "an empty array of 2 GiB": (
        pickle.dumps({"r": _Reduce(_multiarray._reconstruct, (np.ndarray, (2 * _GiB,), b"b"))}),
        "anything but an empty array",
    ),
    "ndarray((2 GiB,))": (pickle.dumps({"r": _Reduce(np.ndarray, ((2 * _GiB,),))}), "takes no arguments"),
    "lists sharing 2**60 paths": (pickle.dumps({"r": _nested(list, 60)}), "expand to more than"),
    "tuples sharing 2**60 paths": (pickle.dumps({"r": _nested(tuple, 60)}), "expand to more than"),
    "a list that holds itself": (b"\x80\x05}\x8c\x01r]\x94h\x00as.", "expand to more than"),
    "100,000 levels of lists": (
        b"\x80\x05}\x8c\x01r" + b"]" * 100_000 + b"a" * 99_999 + b"s.",
        "nest more than 100 levels deep",
    ),
    "an object by number (copyreg)": (b"\x80\x05}\x8c\x01r\x82\x01s.", "opcode EXT1"),
}


_bounded_calls = []
_bounded = jaxbind.get_linear_call(_ran(_bounded_calls), _ran(_bounded_calls), like, like, name="bounded_kwargs")
_nonsense = jaxbind.get_linear_call(_ran([]), _ran([]), like, like, name="nonsense")


@pytest.mark.parametrize("case", list(_FORGED_KWARGS))
def test_a_programs_kwargs_build_plain_data_bounded_by_its_bytes(case):
    dump, why = _FORGED_KWARGS[case]
    calls = _bounded_calls
    calls.clear()
    exported = _exported(_bounded, (4,))
    before = resource.getrusage(resource.RUSAGE_SELF).ru_maxrss
    with pytest.raises(
        Exception, match="jaxbind op 'bounded_kwargs': the program's kwargs cannot be read here"
    ) as info:
        _with_kwargs(exported, dump).call(jnp.ones(4, jnp.float32))
    assert why in str(info.value) and "plain data" in str(info.value)
    grown_kib = resource.getrusage(resource.RUSAGE_SELF).ru_maxrss - before
    assert grown_kib < 256 * 1024 and calls == []
    # plain data within the bounds travels
    fine = {
        "a": [1, 2.5, 3j],
        "b": np.arange(3),
        "s": {1, "x"},
        "d": {"e": (None, True)},
        "n": _nested(list, 5),
        "deep": [[[[[[1]]]]]],
    }
    np.testing.assert_allclose(_with_kwargs(exported, pickle.dumps(fine, 5)).call(jnp.ones(4, jnp.float32)), 2.0)
    assert calls == [(4,)]


@pytest.mark.parametrize(
    "field,value,why",
    [
        ("padded", True, "a padded call has no batch"),
        ("padded", "yes", "'padded' is not true or false"),
        ("role", [0, "1", 0, [1]], "not integers"),
        ("in", [[[4]]], "not valid"),
        ("batch", {"native": 3}, "not valid"),
        ("kwargs", "%%%", "not base64"),
    ],
)
def test_a_description_that_makes_no_sense_is_refused_in_words(field, value, why):
    exported = _exported(_nonsense, (4,))
    description = dict(json.loads(_calls(exported)[0][0]), **{field: value})
    text = _encode(description)
    with pytest.raises(Exception, match="jaxbind op 'nonsense'") as info:
        _forged(exported, description=text, key=_sites.key_of(text)).call(jnp.ones(4, jnp.float32))
    assert why in str(info.value) and "NoneType" not in str(info.value)


def test_an_op_defined_again_is_found_by_name_after_the_first_goes():
    # a notebook cell run twice: the second definition is equal to the first
    def make():
        return jaxbind.get_linear_call(_doubling, _doubling, like, like, name="defined_twice")

    first = make()
    blob = _exported(first, (3,)).serialize()
    again = make()
    del first
    gc.collect()
    x = jnp.arange(3.0, dtype=jnp.float32)
    np.testing.assert_allclose(jax.export.deserialize(blob).call(x), 2 * x)
    np.testing.assert_allclose(again(x)[0], 2 * x)


def _doubling(out, args, kwargs_dump):
    out[0][...] = 2 * args[-1]


def test_ops_replaced_by_equal_ones_while_caches_are_cleared_keep_running():
    blob = _exported(jaxbind.get_linear_call(_doubling, _doubling, like, like, name="churned"), (3,)).serialize()
    errors, stop = [], threading.Event()

    def caller(seed):
        x = jnp.arange(3.0, dtype=jnp.float32) + seed
        for _ in range(60):
            op = jaxbind.get_linear_call(_doubling, _doubling, like, like, name="churned")
            try:
                np.testing.assert_allclose(jax.jit(lambda v: op(v)[0])(x), 2 * x)
                np.testing.assert_allclose(jax.export.deserialize(blob).call(x), 2 * x)
            except Exception as err:
                errors.append(err)

    def clearer():
        while not stop.is_set():
            jax.clear_caches()
            gc.collect()
            stop.wait(0.005)

    threads = [threading.Thread(target=caller, args=(s,)) for s in range(3)]
    cleaning = threading.Thread(target=clearer)
    cleaning.start()
    for t in threads:
        t.start()
    for t in threads:
        t.join()
    stop.set()
    cleaning.join()
    assert errors == []
