"""An entry: the address call sites get (one per kwarg signature). It finds the call's signature in its
table and runs the variant made for it, or has the hook make one; a trampoline of a few lines of LLVM IR
gives each entry an address of its own."""

from __future__ import annotations

import weakref

import numpy as np

from ._call_struct import call_signature
from ._callbacks import ENTRIES, new_entry_id
from ._codegen import TABLE_WORDS, machinery

__all__ = ["Entry"]


class Entry:
    """The address call sites get: finds the call's signature in its table and runs the variant
    made for it, or has the hook make one.

    A call site's address serves every call the site makes, and jaxbind keeps one site for
    calls that differ in their avals (dtypes, ranks, even arity: a site is keyed by the op's
    callback, kwargs and batch), so the entry reads all of that from each call. The table is
    a flat int64 array of rows ``[n_in, n_out, n_kwargs, (dtype, rank) per input and output,
    address]``, ended by -1; the hook appends rows under the program's lock, writing the
    first word last, so that a reader sees -1 or a whole row. The code is one generic entry,
    compiled once; each entry is a trampoline passing it the entry's table.
    """

    def __init__(self, program):
        self.program = program
        self.table = np.full(TABLE_WORDS, -1, np.int64)
        self.used = 0  # words of the table in rows
        self.id = new_entry_id()
        ENTRIES[self.id] = self
        generic = machinery()["entry"]
        self.address, engine = compile_trampoline(generic.address, self.table.ctypes.data, self.id)
        self._code = generic  # (the trampoline calls the generic entry by its address)
        weakref.finalize(self, _free_engine, engine)

    def variant_address(self, call_address: int) -> int:
        """The variant for this call's signature, compiled if new, entered in the table."""
        in_sig, out_sig, kwargs = call_signature(call_address)
        variant = self.program.variant(in_sig, out_sig, kwargs)
        row = [len(in_sig), len(out_sig), len(kwargs)] + [w for pair in in_sig + out_sig for w in pair]
        row.append(variant.address)
        with self.program.lock:
            if self.id not in variant.in_tables and self.used + len(row) <= TABLE_WORDS:
                self.table[self.used + 1 : self.used + len(row)] = row[1:]
                self.table[self.used] = row[0]  # last: a reader sees -1 or a whole row
                self.used += len(row)
                variant.in_tables.add(self.id)
        return variant.address


# Engines of trampolines whose entries were freed, disposed of by the next trampoline compiled (under
# numba's compiler lock): an engine freed by the collector could be disposed of in the middle of a
# compilation of numba's, on the same thread.
_FREED_ENGINES = []


def _free_engine(engine):
    _FREED_ENGINES.append(engine)


def compile_trampoline(target: int, *constants: int):
    """``int f(const jaxbind_call *call)`` calling ``int target(call, *constants)`` (int64 constants).

    A few lines of LLVM IR, compiled in milliseconds: what gives each entry an
    address of its own. Returns (address, the owner of the code). Under numba's
    compiler lock: LLVM's context is not to be used by two threads at once.
    """
    from numba.core.compiler_lock import global_compiler_lock

    with global_compiler_lock:
        return _build_trampoline(target, constants)


def _build_trampoline(target: int, constants: tuple):
    import llvmlite.binding as llvm
    from llvmlite import ir

    while _FREED_ENGINES:
        _FREED_ENGINES.pop().close()
    # A target machine of its own: an engine owns the one it is made with and frees it with itself.
    machine = llvm.Target.from_default_triple().create_target_machine()
    i8p, i32, i64 = ir.IntType(8).as_pointer(), ir.IntType(32), ir.IntType(64)
    module = ir.Module(name="jaxbind_numba_trampoline")
    module.triple = llvm.get_process_triple()
    function = ir.Function(module, ir.FunctionType(i32, [i8p]), name="jaxbind_numba_trampoline")
    builder = ir.IRBuilder(function.append_basic_block())
    target_type = ir.FunctionType(i32, [i8p] + [i64] * len(constants))
    callee = builder.inttoptr(ir.Constant(i64, target), target_type.as_pointer())
    # (a tail call: the trampoline jumps to the entry, it adds no frame to the call)
    builder.ret(builder.call(callee, [function.args[0]] + [ir.Constant(i64, c) for c in constants], tail=True))
    parsed = llvm.parse_assembly(str(module))
    parsed.verify()
    engine = llvm.create_mcjit_compiler(parsed, machine)
    engine.finalize_object()
    return engine.get_function_address("jaxbind_numba_trampoline"), engine
