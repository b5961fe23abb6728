"""A variant: ``fn`` compiled for one combination of dtypes, ranks and kwarg types, behind the kernel
signature. Its code is generated as Python source for numba: it checks the call against the signature,
makes the arrays (``numba.carray`` over the data pointers) and the kwargs (a namedtuple) from the call
struct, and calls ``fn`` through the guard (:mod:`._codegen`)."""

from __future__ import annotations

import collections

from .._native_kwargs import KW_BOOL, KW_FLOAT, KW_FLOAT_ARRAY, KW_INT, KW_INT_ARRAY
from ._call_struct import ARRAY, ARRAY_WORDS, CALL, CALL_WORDS, KWARG, KWARG_WORDS
from ._callbacks import REPORTS, new_variant_id
from ._checks import KWARG_KINDS, NUMPY_DTYPES, check_dtype
from ._codegen import guard, machinery, read_only, text_source

__all__ = ["Variant"]


class Variant:
    """``fn`` for one combination of dtypes, ranks and kwargs, behind the kernel signature:
    one cfunc that makes the arrays and the kwargs from the call and calls fn through the guard.

    Found by its id in :data:`REPORTS` (for the name in its error messages) while it lives.
    """

    def __init__(self, program, in_sig: tuple, out_sig: tuple, kwargs: tuple):
        m = machinery()
        n_in = len(in_sig)
        where = f"numba kernel '{program.fn_name}'"
        self.fn_name = program.fn_name
        dtypes = _numpy_dtypes(in_sig + out_sig, n_in, where)
        ranks = [rank for _, rank in in_sig + out_sig]
        self.description = ", ".join(
            f"{_argument_label(k, n_in)}: {dtypes[k].name}[{ranks[k]}d]" for k in range(len(ranks))
        )
        self.in_tables = set()  # ids of the entries whose table has this variant
        _check_kwarg_types(kwargs, where)
        self.id = new_variant_id()
        self._texts = []  # the messages and names the compiled code reads by address
        mismatch = text_source(
            f"{where}: the call does not match the signature it was compiled for ({self.description}); a jaxbind bug",
            self._texts,
        )
        exiting = text_source(f"{where} raised an exception while Python was exiting", self._texts)
        namespace = {
            "guarded": guard(program.dispatcher, self.id),
            "KW": collections.namedtuple("kwargs", [n for n, _ in kwargs]),
        }
        source = _variant_source(dtypes, ranks, n_in, kwargs, mismatch, exiting, namespace, self._texts)
        # fn first, on its own, for numba's own message when it does not compile (the guard
        # compiles it for the same types again, which finds this compiled version)
        try:
            program.dispatcher.compile(_fn_argtypes(m, dtypes, ranks, n_in, kwargs, namespace["KW"]))
        except Exception as err:
            raise RuntimeError(_compile_error(program.fn_name, self.description, kwargs, err)) from None
        scope = dict(m, **namespace)
        exec(compile(source, f"<jaxbind numba variant of {program.fn_name}>", "exec"), scope)
        try:
            self.cfunc = m["numba"].cfunc(m["types"].int32(m["types"].voidptr), nopython=True)(scope["variant"])
        except Exception as err:
            raise RuntimeError(_compile_error(program.fn_name, self.description, kwargs, err)) from None
        self.address = self.cfunc.address
        REPORTS[self.id] = self  # (a weak table: the row goes with the variant)


def _argument_label(k: int, n_in: int) -> str:
    """``input k`` or ``output k - n_in``: argument ``k`` of a call's inputs then outputs, in messages."""
    return f"input {k}" if k < n_in else f"output {k - n_in}"


def _numpy_dtypes(signature: tuple, n_in: int, where: str) -> list:
    """The NumPy dtype of each ``(dtype code, rank)`` of the inputs then outputs; refuses one numba cannot take."""
    return [
        check_dtype(NUMPY_DTYPES.get(code), f"{where}: {_argument_label(k, n_in)}", code)
        for k, (code, _) in enumerate(signature)
    ]


def _check_kwarg_types(kwargs: tuple, where: str) -> None:
    """Refuses a kwarg type code, as the call gives it, that a numba kernel cannot take."""
    for name, code in kwargs:
        if code not in KWARG_KINDS:
            raise TypeError(f"{where}: keyword argument '{name}' has a type a numba kernel cannot take (code {code})")


def _variant_source(dtypes, ranks, n_in, kwargs, mismatch, exiting, namespace, texts) -> str:
    """The variant's Python source: check the call's counts, make fn's arrays and kwargs, call the guard.

    Adds the dtypes the source names to ``namespace``; ``mismatch`` and ``exiting`` are the
    sources of its two messages, ``texts`` keeps the kwarg names it reads by address.
    """
    n_out = len(ranks) - n_in
    checks = [
        f"c[{CALL['n_in']}] != {n_in}",
        f"c[{CALL['n_out']}] != {n_out}",
        f"c[{CALL['n_kwargs']}] != {len(kwargs)}",
    ]
    array_lines, arrays = _array_lines(dtypes, ranks, n_in, namespace)
    kwarg_lines, values = _kwarg_lines(kwargs, mismatch, texts)

    def tuple_of(names):
        return "(" + "".join(f"{n}, " for n in names) + ")"

    return (
        "\n".join(
            [
                "def variant(call):",
                f"    c = carray(call, {CALL_WORDS}, np.int64)",
                f"    if {checks[0]} or {checks[1]} or {checks[2]}:",
                f"        return _fail(c, {mismatch})",
            ]
            + array_lines
            + kwarg_lines  # (the entry checked the dtypes and ranks: it found this variant by them)
            + [
                f"    status = guarded(call, {tuple_of(arrays['o'])}, {tuple_of(arrays['i'])}, "
                f"KW({', '.join(values)}))",
                "    if status == 2:",
                f"        return _fail(c, {exiting})",
                "    return status",
            ]
        )
        + "\n"
    )


def _array_lines(dtypes, ranks, n_in, namespace) -> tuple:
    """The source lines that make each input and output array from the call (named ``i0``, ``o0``, ...),
    and those names by side; adds each array's dtype (``D_i0``, ...) to ``namespace``."""
    n_out = len(ranks) - n_in
    lines = [
        f"    i = carray(_ptr(c[{CALL['in_']}]), {ARRAY_WORDS * n_in}, np.int64)",
        f"    o = carray(_ptr(c[{CALL['out']}]), {ARRAY_WORDS * n_out}, np.int64)",
    ]
    arrays = {"i": [], "o": []}
    for k in range(n_in + n_out):
        side, index = ("i", k) if k < n_in else ("o", k - n_in)
        base = index * ARRAY_WORDS
        name = f"{side}{index}"
        namespace[f"D_{name}"] = dtypes[k]
        if ranks[k]:
            lines.append(f"    s = carray(_ptr({side}[{base + ARRAY['shape']}]), {ranks[k]}, np.int64)")
            shape = "(" + "".join(f"s[{d}], " for d in range(ranks[k])) + ")"
        else:
            shape = "()"
        lines.append(f"    {name} = carray(_ptr({side}[{base + ARRAY['data']}]), {shape}, D_{name})")
        arrays[side].append(name)
    return lines, arrays


def _kwarg_lines(kwargs, mismatch, texts) -> tuple:
    """The source lines that find each kwarg by name, check its type and read it (into ``v0``, ...),
    and those names; ``texts`` keeps the names the lines read by address."""
    lines = []
    if kwargs:
        lines += [
            f"    w = carray(_ptr(c[{CALL['kwargs']}]), {KWARG_WORDS * len(kwargs)}, np.int64)",
            f"    f = carray(_ptr(c[{CALL['kwargs']}]), {KWARG_WORDS * len(kwargs)}, np.float64)",
        ]
    values = []
    for k, (name, code) in enumerate(kwargs):
        lines += [
            f"    k = _find(w, {len(kwargs)}, {k}, {text_source(name, texts)})",
            f"    if k < 0 or w[k * {KWARG_WORDS} + {KWARG['type']}] != {code}:",
            f"        return _fail(c, {mismatch})",
            f"    b = k * {KWARG_WORDS}",
        ]
        if code == KW_INT:
            lines.append(f"    v{k} = w[b + {KWARG['int_value']}]")
        elif code == KW_BOOL:
            lines.append(f"    v{k} = w[b + {KWARG['int_value']}] != 0")
        elif code == KW_FLOAT:
            lines.append(f"    v{k} = f[b + {KWARG['float_value']}]")
        else:
            field, dtype = ("int_array", "np.int64") if code == KW_INT_ARRAY else ("float_array", "np.float64")
            lines.append(f"    v{k} = carray(_ptr(w[b + {KWARG[field]}]), w[b + {KWARG['size']}], {dtype})")
        values.append(f"v{k}")
    return lines, values


def _fn_argtypes(m: dict, dtypes, ranks, n_in, kwargs, kwargs_type) -> tuple:
    """numba's types of fn's ``(out, args, kwargs)`` as the guard passes them (inputs and kwargs read-only)."""
    types = m["types"]
    arrays = [types.Array(m["numba"].from_dtype(dtypes[k]), ranks[k], "C") for k in range(len(ranks))]
    field_types = {
        KW_INT: types.int64,
        KW_FLOAT: types.float64,
        KW_BOOL: types.boolean,
        KW_INT_ARRAY: types.Array(types.int64, 1, "C"),
        KW_FLOAT_ARRAY: types.Array(types.float64, 1, "C"),
    }
    return (
        types.BaseTuple.from_types(arrays[n_in:]),
        read_only(types.BaseTuple.from_types(arrays[:n_in])),
        read_only(types.BaseTuple.from_types([field_types[code] for _, code in kwargs], kwargs_type)),
    )


def _compile_error(fn_name, description, kwargs, err) -> str:
    """numba's error for a kernel that does not compile, without the frames of jaxbind's wrapper."""
    kinds = ", ".join(f"{name}: {KWARG_KINDS.get(code, '?')}" for name, code in kwargs) or "none"
    kept = []
    for line in str(err).strip().splitlines():
        if "During: resolving callee type" in line or "<jaxbind numba" in line:
            break
        if line.startswith("File ") and line in kept:  # (numba shows the place twice)
            break
        if not (kept and line == kept[-1]):
            kept.append(line)
    details = "\n".join(kept).strip()
    return f"numba could not compile kernel '{fn_name}' for {description} (kwargs: {kinds}):\n{details}"
