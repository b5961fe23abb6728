"""The kwargs of a program made elsewhere: plain data only, bounded in size and in work by the
program's bytes; and kwargs as the ops take them (keys of mixed types, values read anew).

Forged programs are made here (a real ``jaxbind.export`` artifact, its kwargs edited, serialized
again with JAX's MLIR tools: _forging.py) and run by another process (_program_kwargs_job.py), so
that a crash fails the tests instead of ending pytest."""

import collections
import json
import os
import pickle
import struct
import sys

import _forging
import _subprocesses
import jax
import jax.numpy as jnp
import numpy as np
import pytest

import jaxbind
from jaxbind import _kwargs, _plain_data

JOB = os.path.join(os.path.dirname(os.path.abspath(__file__)), "_program_kwargs_job.py")
_numeric = getattr(np, "_core", getattr(np, "core", None))


class _Reduce:
    def __init__(self, *reduce):
        self.reduce = reduce

    def __reduce__(self):
        return self.reduce


def _object_dtype(flags=0):
    """numpy.dtype('O') with its pickled state's flags cleared: it no longer says it holds objects."""
    return _Reduce(np.dtype, ("O8", False, True), (3, "|", None, None, None, -1, -1, flags))


def _nested_tuples(k):
    """Pickle opcodes leaving on the stack k tuples nested in themselves through the memo:
    t0 = (), t(i+1) = (t(i), t(i)): 2**k parts, hashed in 2**k steps."""
    get = lambda i: b"j" + struct.pack("<I", i)  # LONG_BINGET
    ops = b")\x940"  # EMPTY_TUPLE MEMOIZE POP
    for i in range(k):
        ops += get(i) + get(i) + b"\x86\x940"  # TUPLE2 MEMOIZE POP
    return ops + get(k)


def _long1(value):
    data = value.to_bytes((value.bit_length() + 8) // 8, "little", signed=True)
    return b"\x8a" + bytes([len(data)]) + data


def _kwarg(name, ops):
    """A kwargs pickle {name: <what ops leave on the stack>}."""
    return b"\x80\x05}\x8c" + bytes([len(name)]) + name.encode() + ops + b"s."


_COLLIDING = 2**61 - 1  # ints k * (2**61 - 1) all hash to 0
PLAIN = {
    "a": [1, 2.5, 3j, None, True],
    "b": np.arange(6.0).reshape(2, 3),
    "d": {1: "a", "b": (2, b"x"), (3, 4): frozenset({5})},
    "dt": np.dtype(">i4"),
    "f": np.asfortranarray(np.arange(6).reshape(3, 2)),
    "o": collections.OrderedDict(z=1, y=2),
    "r": range(2, 9, 3),
    "s": np.zeros(2, [("x", "<f4"), ("y", ">i8", (2,))]),
    "t": np.array(["2020-01-01"], "M8[D]"),
    "v": np.float32(0.5),
}
# case -> (kwargs bytes, what the refusal says; None: the program runs and reads them as pickle.loads does)
CASES = {
    "object dtype, flags cleared": (
        pickle.dumps({"r": _Reduce(_numeric.numeric._frombuffer, (b"A" * 8, _object_dtype(), (1,), "C"))}, 5),
        "an object dtype",
    ),
    "object dtype, as _reconstruct's": (
        pickle.dumps(
            {
                "r": _Reduce(
                    _numeric.multiarray._reconstruct,
                    (np.ndarray, (0,), b"b"),
                    (1, (1,), _object_dtype(), False, b"A" * 8),
                )
            },
            4,
        ),
        "an object dtype",
    ),
    "structured dtype with an object field": (
        pickle.dumps(
            {
                "r": _Reduce(
                    _numeric.numeric._frombuffer,
                    (
                        b"A" * 8,
                        _Reduce(
                            np.dtype, ("V8", False, True), (3, "|", None, ("a",), {"a": (_object_dtype(), 0)}, 8, 8, 0)
                        ),
                        (1,),
                        "C",
                    ),
                )
            },
            5,
        ),
        "an object dtype",
    ),
    "subarray dtype of objects": (
        pickle.dumps(
            {
                "r": _Reduce(
                    _numeric.numeric._frombuffer,
                    (
                        b"A" * 16,
                        _Reduce(
                            np.dtype, ("V16", False, True), (3, "|", (_object_dtype(), (2,)), None, None, 16, 8, 0)
                        ),
                        (1,),
                        "C",
                    ),
                )
            },
            5,
        ),
        "an object dtype",
    ),
    "NumPy scalar of an object dtype": (
        pickle.dumps({"r": _Reduce(_numeric.multiarray.scalar, (_object_dtype(63), b"A" * 8))}, 5),
        "an object dtype",
    ),
    "range as a value": (pickle.dumps({"r": range}, 5), "the global builtins.range as a value"),
    "_frombuffer as a value": (
        pickle.dumps({"r": _numeric.numeric._frombuffer}, 5),
        "the global numpy._frombuffer as a value",
    ),
    "numpy scalar in a list": (pickle.dumps({"r": [1, _numeric.multiarray.scalar]}, 5), "numpy.scalar as a value"),
    "OrderedDict as a dict value": (
        pickle.dumps({"r": {"k": collections.OrderedDict}}, 5),
        "collections.OrderedDict as a value",
    ),
    "a global as a dict key": (pickle.dumps({"r": {range: 1}}, 5), "builtins.range as a value"),
    "a global as an argument": (pickle.dumps({"r": _Reduce(complex, (range, 1))}, 5), "builtins.range as a value"),
    "int keys forged to share a hash": (
        _kwarg("t", b"}(" + b"".join(_long1(k * _COLLIDING) + b"K\x00" for k in range(1, 5001)) + b"u"),
        f"more than {_plain_data.MAX_SAME_HASH} different keys of one hash",
    ),
    "a dict key of tuples nested in themselves": (_kwarg("t", b"}" + _nested_tuples(60) + b"K\x01s"), "more work"),
    "a set member of tuples nested in themselves": (_kwarg("t", b"\x8f(" + _nested_tuples(60) + b"\x90"), "more work"),
    "a frozenset of tuples nested in themselves": (_kwarg("t", b"(" + _nested_tuples(60) + b"\x91"), "more work"),
    "plain data": (pickle.dumps(PLAIN, 5), None),
    "plain data, protocol 4": (pickle.dumps(PLAIN, 4), None),
}


@pytest.fixture(scope="module")
def ran(tmp_path_factory):
    """What another process made of each forged program: case -> its JSON line. A program that
    ends that process (or hangs it for 60 s) is recorded as {"crashed": exit status, "stderr": ...}, and
    the process is started again for the programs after it."""
    folder = tmp_path_factory.mktemp("programs")
    program = _forging.exported(_forging.reader([]), (4,))
    names = {}
    for n, (case, (dump, _)) in enumerate(CASES.items()):
        names[f"{n:02d}.bin"] = case
        (folder / f"{n:02d}.bin").write_bytes(_forging.with_kwargs(program, dump))
    env = dict(os.environ, JAX_PLATFORMS="cpu")
    results = {}
    while len(results) < len(CASES):
        left = sorted(set(names) - {name for name, case in names.items() if case in results})
        returncode, out, err = _subprocesses.run([sys.executable, JOB, str(folder), *left], 240, "job", env=env)
        for line in out.splitlines():
            if line.startswith("{"):
                line = json.loads(line)
                results[names[line["case"]]] = line
        if returncode != 0:
            stopped = next(name for name in left if names[name] not in results)
            results[names[stopped]] = {"crashed": returncode, "stderr": err[-3000:]}
    return results


@pytest.mark.parametrize("case", list(CASES))
def test_a_program_from_elsewhere_reads_its_kwargs_as_plain_data_only(ran, case):
    dump, why = CASES[case]
    result = ran[case]
    assert "crashed" not in result, result
    if why is None:
        assert result.get("out") == [2.0] * 4, result
        assert result["seen"] == [repr(pickle.loads(dump))]  # what the callback read: pickle's own value
    else:
        message = result.get("refused", "")
        assert "jaxbind op 'kwargs_reader': the program's kwargs cannot be read here" in message, result
        assert why in message and "plain data" in message, message


# ---------------------------------------------------------------------------
# load_plain on pickles of plain data: the value pickle.loads makes
# ---------------------------------------------------------------------------


def _same(a, b):
    if type(a) is not type(b):
        return False
    if isinstance(a, np.ndarray):
        return (a.dtype, a.shape, a.tobytes(), a.flags.writeable) == (b.dtype, b.shape, b.tobytes(), b.flags.writeable)
    if isinstance(a, (list, tuple)):
        return len(a) == len(b) and all(map(_same, a, b))
    if isinstance(a, dict):
        return list(a) == list(b) and all(_same(a[k], b[k]) for k in a)
    if isinstance(a, np.generic):
        return (a.dtype, a.tobytes()) == (b.dtype, b.tobytes())
    if isinstance(a, np.dtype):
        return (a, a.byteorder, a.isalignedstruct) == (b, b.byteorder, b.isalignedstruct)
    return a == b if a == a else b != b


_VALUES = [
    *PLAIN.values(),
    2**100,
    float("nan"),
    "é",
    bytearray(b"yz"),
    {1, "x", (1, 2)},
    slice(1, None, 2),
    np.int64(-3),
    np.void(b"ab"),
    np.arange(6.0)[::2],
    np.zeros((0, 3)),
    np.array(["ab", "c"]),
    np.zeros(2, np.dtype([("a", "u1"), ("b", "f8")], align=True)),
    np.zeros(3, np.dtype({"names": ["a"], "formats": ["f4"], "titles": ["T"]})),
    np.zeros(2, np.dtype(("f4", (2, 3)))),
    np.array([1], "m8[ms]"),
    np.array([1, 2], "M8[10s]"),
    np.array(3.0),
    np.zeros(2, [("x", [("y", "i2")])]),
    {-1: 1, -2: 2},  # (which hash alike)
]


@pytest.mark.parametrize("protocol", [3, 4, 5])
def test_plain_data_reads_as_pickle_reads_it(protocol):
    for value in _VALUES:
        dump = pickle.dumps({"v": value}, protocol)
        assert _same(_kwargs.load_plain(dump, "op 'x'"), pickle.loads(dump)), value


def test_keys_of_one_hash_are_read_up_to_a_bound():
    keys = [k * _COLLIDING for k in range(1, _plain_data.MAX_SAME_HASH + 2)]
    pairs = lambda n: b"".join(_long1(key) + b"K\x00" for key in keys[:n])
    fine = _kwarg("t", b"}(" + pairs(_plain_data.MAX_SAME_HASH) + b"u")
    assert _kwargs.load_plain(fine, "op 'x'") == pickle.loads(fine)
    with pytest.raises(jaxbind.JaxbindError, match="different keys of one hash"):
        _kwargs.load_plain(_kwarg("t", b"}(" + pairs(_plain_data.MAX_SAME_HASH + 1) + b"u"), "op 'x'")
    # the same key again is no other key
    again = _kwarg("t", b"}(" + pairs(_plain_data.MAX_SAME_HASH) + _long1(keys[0]) + b"K\x01u")
    assert _kwargs.load_plain(again, "op 'x'") == pickle.loads(again)


def _parts(value):
    """Every part of ``value``, counted as often as it is reached (dict keys too): the reference."""
    if isinstance(value, dict):
        return 1 + sum(_parts(k) + _parts(v) for k, v in value.items())
    if isinstance(value, (list, tuple, set, frozenset)):
        return 1 + sum(map(_parts, value))
    return 1


def test_the_size_bound_counts_dict_keys():
    shared = tuple(range(20))
    key = (shared,) * 20  # 20 paths to one tuple: 421 parts
    for values in ({"t": {key: 1}}, {"t": {1: key}}):
        assert _parts(values) == 425
        _plain_data.check_size(values, budget=425)
        with pytest.raises(pickle.UnpicklingError, match="expand to more than 424 values"):
            _plain_data.check_size(values, budget=424)


# ---------------------------------------------------------------------------
# Kwargs as ops take them
# ---------------------------------------------------------------------------


def test_a_list_in_a_tuple_is_read_anew_at_every_read():
    # An abstract that changes a kwarg it was given changes nothing the next reads get.
    seen = []

    def abstract(x, table):
        seen.append(list(table[0]))
        table[0].append(99)
        return ((x.shape, x.dtype),)

    def double(out, args, kwargs_dump):
        seen.append(list(jaxbind.load_kwargs(kwargs_dump)["table"][0]))
        out[0][...] = 2 * args[-1]

    op = jaxbind.get_linear_call(double, double, abstract, abstract, name="reads_a_list_in_a_tuple")
    x = jnp.arange(3.0)
    y, transpose = jax.vjp(lambda v: op(v, table=([1, 2],))[0], x)
    (x_ct,) = transpose(jnp.ones(3))
    np.testing.assert_allclose(y, 2 * x)
    np.testing.assert_allclose(x_ct, 2.0)
    assert len(seen) >= 3 and all(read == [1, 2] for read in seen), seen


def _lookup(x, table):
    return x * len(table) + table[1].__len__() + table["b"]


def test_a_kwarg_dict_with_keys_of_mixed_types_works_as_a_closure_does():
    table = {1: "a", "b": 2}

    def scale(out, args, kwargs_dump):
        out[0][...] = _lookup(args[-1], jaxbind.load_kwargs(kwargs_dump)["table"])

    def scale_T(out, args, kwargs_dump):
        out[0][...] = args[-1] * len(jaxbind.load_kwargs(kwargs_dump)["table"])

    def jvp(out, args, kwargs_dump):
        out[0][...] = args[-1] * len(jaxbind.load_kwargs(kwargs_dump)["table"])

    nonlinear = jaxbind.get_nonlinear_call(
        scale, (jvp, scale_T), _forging.like, _forging.like, name="mixed_keys_nonlinear"
    )
    # the reference: jax.pure_callback closing over the same dict
    reference = lambda v: jax.pure_callback(
        lambda a: np.asarray(_lookup(a, table), a.dtype), jax.ShapeDtypeStruct(v.shape, v.dtype), v
    )
    x = jnp.arange(3.0)
    np.testing.assert_allclose(nonlinear(x, table=table)[0], reference(x))
    np.testing.assert_allclose(jax.jit(lambda v: nonlinear(v, table=table)[0])(x), reference(x))
    np.testing.assert_allclose(jax.grad(lambda v: nonlinear(v, table=table)[0].sum())(x), 2.0)
    linear = jaxbind.get_linear_call(scale_T, scale_T, _forging.like, _forging.like, name="mixed_keys_linear")
    np.testing.assert_allclose(jax.jit(jax.vmap(lambda v: linear(v, table=table)[0]))(x[:, None]), 2 * x[:, None])
