"""A variant: ``fn`` compiled for one combination of dtypes, ranks and kwarg types, behind the kernel
signature. Its code is generated as Python source for numba: it checks the call against the signature,
makes the arrays (``numba.carray`` over the data pointers) and the kwargs (a namedtuple) from the call
struct, and calls ``fn`` through the guard (:mod:`._codegen`)."""

from __future__ import annotations

import collections

from .._kwargs import KW_BOOL, KW_FLOAT, KW_FLOAT_ARRAY, KW_INT, KW_INT_ARRAY
from ._call_struct import ARRAY, ARRAY_WORDS, CALL, CALL_WORDS, KWARG, KWARG_WORDS
from ._callbacks import REPORTS, new_variant_id
from ._checks import KWARG_KINDS, NUMPY_DTYPES, check_dtype
from ._codegen import machinery, text_source

__all__ = ["Variant"]


class Variant:
    """``fn`` for one combination of dtypes, ranks and kwargs, behind the kernel signature:
    one cfunc that makes the arrays and the kwargs from the call and calls fn through the guard."""

    def __init__(self, program, in_sig: tuple, out_sig: tuple, kwargs: tuple):
        m = machinery()
        n_in, n_out = len(in_sig), len(out_sig)
        where = f"numba kernel '{program.fn_name}'"
        dtypes = [code for code, _ in in_sig + out_sig]
        ranks = [rank for _, rank in in_sig + out_sig]
        dtypes_np = [check_dtype(NUMPY_DTYPES.get(code), f"{where}: " + (
            f"input {k}" if k < n_in else f"output {k - n_in}"), code) for k, code in enumerate(dtypes)]
        self.description = ", ".join(
            (f"input {k}" if k < n_in else f"output {k - n_in}") + f": {dtypes_np[k].name}[{ranks[k]}d]"
            for k in range(n_in + n_out))
        self.in_tables = set()  # ids of the entries whose table has this variant
        for name, code in kwargs:
            if code not in KWARG_KINDS:
                raise TypeError(f"{where}: keyword argument '{name}' has a type a numba kernel cannot take "
                                f"(code {code})")
        self.id = new_variant_id()
        REPORTS[self.id] = program.fn_name
        self._texts = []  # the messages and names the compiled code reads by address
        mismatch = text_source(f"{where}: the call does not match the signature it was compiled for "
                         f"({self.description}); a jaxbind bug", self._texts)
        exiting = text_source(f"{where} raised an exception while Python was exiting", self._texts)

        namespace = {"guarded": m["guard"](program.dispatcher, self.id),
                     "KW": collections.namedtuple("kwargs", [n for n, _ in kwargs])}
        checks = [f"c[{CALL['n_in']}] != {n_in}", f"c[{CALL['n_out']}] != {n_out}",
                  f"c[{CALL['n_kwargs']}] != {len(kwargs)}"]
        lines = [f"    i = carray(_ptr(c[{CALL['in_']}]), {ARRAY_WORDS * n_in}, np.int64)",
                 f"    o = carray(_ptr(c[{CALL['out']}]), {ARRAY_WORDS * n_out}, np.int64)"]
        arrays = {"i": [], "o": []}
        for k in range(n_in + n_out):
            side, index = ("i", k) if k < n_in else ("o", k - n_in)
            base = index * ARRAY_WORDS
            name = f"{side}{index}"
            namespace[f"D_{name}"] = dtypes_np[k]
            if ranks[k]:
                lines.append(f"    s = carray(_ptr({side}[{base + ARRAY['shape']}]), {ranks[k]}, np.int64)")
                shape = "(" + "".join(f"s[{d}], " for d in range(ranks[k])) + ")"
            else:
                shape = "()"
            lines.append(f"    {name} = carray(_ptr({side}[{base + ARRAY['data']}]), {shape}, D_{name})")
            arrays[side].append(name)
        if kwargs:
            lines += [f"    w = carray(_ptr(c[{CALL['kwargs']}]), {KWARG_WORDS * len(kwargs)}, np.int64)",
                      f"    f = carray(_ptr(c[{CALL['kwargs']}]), {KWARG_WORDS * len(kwargs)}, np.float64)"]
        values = []
        for k, (name, code) in enumerate(kwargs):
            lines += [f"    k = _find(w, {len(kwargs)}, {k}, {text_source(name, self._texts)})",
                      f"    if k < 0 or w[k * {KWARG_WORDS} + {KWARG['type']}] != {code}:",
                      f"        return _fail(c, {mismatch})",
                      f"    b = k * {KWARG_WORDS}"]
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
        tuple_of = lambda names: "(" + "".join(f"{n}, " for n in names) + ")"  # noqa: E731
        source = "\n".join(
            ["def variant(call):",
             f"    c = carray(call, {CALL_WORDS}, np.int64)",
             f"    if {checks[0]} or {checks[1]} or {checks[2]}:",
             f"        return _fail(c, {mismatch})"]
            + lines  # (the entry checked the dtypes and ranks: it found this variant by them)
            + [f"    status = guarded(call, {tuple_of(arrays['o'])}, {tuple_of(arrays['i'])}, KW({', '.join(values)}))",
               "    if status == 2:",
               f"        return _fail(c, {exiting})",
               "    return status"]) + "\n"
        # fn first, on its own, for numba's own message when it does not compile (the guard
        # compiles it for the same types again, which finds this compiled version)
        types = m["types"]
        arrays_t = [types.Array(m["numba"].from_dtype(dtypes_np[k]), ranks[k], "C") for k in range(n_in + n_out)]
        field_t = {KW_INT: types.int64, KW_FLOAT: types.float64, KW_BOOL: types.boolean,
                   KW_INT_ARRAY: types.Array(types.int64, 1, "C"), KW_FLOAT_ARRAY: types.Array(types.float64, 1, "C")}
        argtypes = (types.BaseTuple.from_types(arrays_t[n_in:]),
                    m["read_only"](types.BaseTuple.from_types(arrays_t[:n_in])),
                    m["read_only"](types.BaseTuple.from_types([field_t[code] for _, code in kwargs],
                                                              namespace["KW"])))
        try:
            program.dispatcher.compile(argtypes)
        except Exception as err:
            raise RuntimeError(_compile_error(program.fn_name, self.description, kwargs, err)) from None
        scope = dict(m, **namespace)
        exec(compile(source, f"<jaxbind numba variant of {program.fn_name}>", "exec"), scope)
        try:
            self.cfunc = m["numba"].cfunc(m["types"].int32(m["types"].voidptr), nopython=True)(scope["variant"])
        except Exception as err:
            raise RuntimeError(_compile_error(program.fn_name, self.description, kwargs, err)) from None
        self.address = self.cfunc.address


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
