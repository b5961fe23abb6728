"""Plain data from the kwargs pickle of a program made elsewhere (:func:`load`).

A program's kwargs bytes are untrusted. They are not given to ``pickle``: this module reads
their opcodes itself (through the standard library's pure-Python opcode reader, which never
allocates what an opcode's count says) and builds each value itself, so that nothing outside a
few plain types is ever made, and every step's work is bounded before it is done:

- A global (``numpy.dtype``, ``builtins.range``, ...) is only ever the callable of a REDUCE, whose
  arguments are checked before the call; anywhere else (a value, a key, an argument) it is refused.
- NumPy dtypes are rebuilt from their description (type code, byte order, fields, subarray
  shape, datetime unit), never by ``dtype.__setstate__`` from a pickled state (whose flags say
  whether the dtype holds objects); a dtype that holds objects is refused, wherever it is.
- Dict keys and set members are hashed only after their cost is known: each key's size is
  counted (at most :data:`MAX_DEPTH` deep, every part counted as often as it is reached) and
  charged to a budget the pickle's length sets, and a dict or set may hold at most
  :data:`MAX_SAME_HASH` different keys of one hash (keys forged to share a hash make every
  insertion compare with all of them).
"""

from __future__ import annotations

import collections
import pickletools

import numpy as np

from ._plain_reduces import NUMPY_MODULES, REDUCES, _Args, _Draft, _Global, _reconstruct, _refuse

__all__ = ["MAX_DEPTH", "MAX_SAME_HASH", "check_size", "load"]

MAX_DEPTH = 100  # containers in containers
MAX_SAME_HASH = 8  # different keys of one hash in one dict or set (honest data: -1 and -2, at most a few)

# ---------------------------------------------------------------------------
# What a value may be
# ---------------------------------------------------------------------------

_SCALARS = (type(None), bool, int, float, complex, str, bytes, bytearray, range)
_CONTAINERS = (list, tuple, set, frozenset, dict, collections.OrderedDict)


def _plain(value):
    """``value`` if it is plain data at its top level (its parts were checked when they were made)."""
    kind = type(value)
    if kind in _SCALARS or kind in _CONTAINERS or kind is slice:
        return value
    if kind is np.ndarray or isinstance(value, (np.dtype, np.generic)):
        if (value.dtype if kind is np.ndarray or isinstance(value, np.generic) else value).hasobject:
            raise _refuse("an object dtype")
        return value
    if kind is _Global:
        raise _refuse(f"the global {value.name} as a value (a global is only the callable of a reduce)")
    if kind is _Draft:
        raise _refuse("a dtype or array without its description (BUILD)")
    if kind is _Args:
        raise _refuse("a tuple holding a global as a value")
    raise _refuse(f"a value of type {kind.__name__}")


def check_size(values, budget: int) -> None:
    """Refuse values that are not plain data all through, nest deeper than MAX_DEPTH, or have
    more than ``budget`` parts, each counted as often as it is reached (a value shared k times is
    read, pickled and copied k times: a few bytes that refer to themselves over and over would
    expand without end). Dict keys count as values do."""
    stack, count = [(values, 0)], 0
    while stack:
        value, depth = stack.pop()
        count += 1
        if count > budget:
            raise _refuse(f"they expand to more than {budget} values (parts of them repeat themselves)")
        if depth > MAX_DEPTH:
            raise _refuse(f"they nest more than {MAX_DEPTH} levels deep")
        kind = type(_plain(value))
        if kind in (list, tuple, set, frozenset):
            children = value
        elif kind in (dict, collections.OrderedDict):
            children = [*value.keys(), *value.values()]
        elif kind is slice:
            children = (value.start, value.stop, value.step)
        else:
            continue
        stack.extend((child, depth + 1) for child in children)


def _key_cost(key, limit: int) -> int:
    """The work of hashing ``key`` (or comparing it with a key of equal hash), counted before it
    is done: every part as often as it is reached, large numbers and strings by their length."""
    stack, cost = [(key, 0)], 0
    while stack:
        value, depth = stack.pop()
        kind = type(value)
        if kind in (tuple, frozenset):
            if depth >= MAX_DEPTH:
                raise _refuse(f"a dict key or set member nests more than {MAX_DEPTH} levels deep")
            cost += 1
            stack.extend((part, depth + 1) for part in value)
        elif kind is int:
            cost += 1 + value.bit_length() // 2048
        elif kind in (str, bytes):
            cost += 1 + len(value) // 256
        elif kind in (type(None), bool, float, complex) or (
            isinstance(value, np.generic) and not isinstance(value, np.void) and not value.dtype.hasobject
        ):
            cost += 1
        else:
            raise _refuse(f"a dict key or set member of type {kind.__name__}")
        if cost > limit:
            raise _refuse("hashing their dict keys and set members would take more work than their size allows")
    return cost


# ---------------------------------------------------------------------------
# The reader
# ---------------------------------------------------------------------------

_PUTS = frozenset({"PUT", "BINPUT", "LONG_BINPUT"})
_GETS = frozenset({"GET", "BINGET", "LONG_BINGET"})
_CONSTANTS = frozenset(
    {
        "INT", "BININT", "BININT1", "BININT2", "LONG", "LONG1", "LONG4", "FLOAT", "BINFLOAT",
        "BINBYTES", "SHORT_BINBYTES", "BINBYTES8", "BYTEARRAY8",
        "UNICODE", "SHORT_BINUNICODE", "BINUNICODE", "BINUNICODE8",
    }
)  # fmt: skip
_FIXED = {"NONE": None, "NEWTRUE": True, "NEWFALSE": False}
_EMPTY = {"EMPTY_LIST": list, "EMPTY_TUPLE": tuple, "EMPTY_DICT": dict, "EMPTY_SET": set}


class _Reader:
    def __init__(self, budget: int):
        self.stack, self.marks, self.memo = [], [], {}
        self.work, self.work_limit = 0, 4 * budget
        self.hashes, self.kept = {}, []  # per dict or set (by id, kept alive): its keys' hashes

    def pop_mark(self):
        if not self.marks:
            raise _refuse("no MARK")
        items, self.stack = self.stack, self.marks.pop()
        return items

    def top(self, kinds, what):
        if not self.stack or type(self.stack[-1]) not in kinds:
            raise _refuse(f"{what} on anything but a {kinds[0].__name__}")
        return self.stack[-1]

    def admit(self, container, key) -> None:
        """Account for hashing ``key`` into ``container`` (and comparing it with the keys of
        equal hash there), before it is done; refuse a key with too many of equal hash."""
        cost = _key_cost(key, self.work_limit - self.work)
        if id(container) not in self.hashes:
            self.hashes[id(container)] = {}
            self.kept.append(container)
        seen = self.hashes[id(container)]
        code = hash(key)
        same = seen.get(code, 0)
        self.work += cost * (2 + same)
        if self.work > self.work_limit:
            raise _refuse("hashing their dict keys and set members would take more work than their size allows")
        if same and key in container:
            return
        if same >= MAX_SAME_HASH:
            raise _refuse(f"a dict or set has more than {MAX_SAME_HASH} different keys of one hash (forged to collide)")
        seen[code] = same + 1

    def set_items(self, target, items):
        if len(items) % 2:
            raise _refuse("SETITEMS of an odd number of items")
        for k in range(0, len(items), 2):
            key, value = _plain(items[k]), _plain(items[k + 1])
            self.admit(target, key)
            target[key] = value

    def members(self, items):
        made = set()
        for item in items:
            self.admit(made, _plain(item))
            made.add(item)
        return made

    def tuple(self, items):
        if any(type(item) is _Global for item in items):
            return _Args(item if type(item) is _Global else _plain(item) for item in items)
        return tuple(map(_plain, items))

    def reduce(self):
        args = self.stack.pop()
        func = self.stack.pop()
        if type(func) is not _Global:
            raise _refuse(f"a reduce of a {type(func).__name__}")
        if type(args) not in (tuple, _Args):
            raise _refuse(f"{func.name} of a {type(args).__name__}")
        if type(args) is _Args and func.reduce is not _reconstruct:  # (only it takes a global: ndarray)
            _plain(next(arg for arg in args if type(arg) is _Global))
        if func.name in ("builtins.set", "builtins.frozenset"):
            if len(args) > 1 or (args and type(args[0]) not in (list, tuple)):  # (a range would be as large as it says)
                raise _refuse(f"{func.name} of a {type(args[0]).__name__} (of anything but a list)")
            made = self.members(args[0] if args else ())
            return made if func.name == "builtins.set" else frozenset(made)
        return func.reduce(args)

    def build(self):
        state = self.stack.pop()
        draft = self.stack[-1] if self.stack else None
        if type(draft) is not _Draft or draft.finish is None:
            raise _refuse(f"BUILD of a {type(draft).__name__}")
        made, draft.finish = draft.finish(_plain(state)), None
        self.stack[-1] = made
        for slot in draft.slots:
            if self.memo.get(slot) is draft:
                self.memo[slot] = made

    def remember(self, slot):
        if not self.stack:
            raise _refuse("a memo of nothing")
        value = self.memo[slot] = self.stack[-1]
        if type(value) is _Draft:
            value.slots.append(slot)

    def step(self, n, name, arg):
        """Run opcode number ``n`` (its name and argument), or refuse it."""
        if not (self._value(name, arg) or self._container(name) or self._bookkeeping(n, name, arg)):
            if name in ("GLOBAL", "STACK_GLOBAL"):
                self.stack.append(self._global(name, arg))
            elif name == "REDUCE":
                self.stack.append(self.reduce())
            elif name == "BUILD":
                self.build()
            else:
                raise _refuse(f"opcode {name}")

    def _value(self, name, arg) -> bool:
        """Push a value an opcode holds (a constant, a string, an empty container); False if it holds none."""
        stack = self.stack
        if name in _CONSTANTS:
            stack.append(arg)
        elif name in _FIXED:
            stack.append(_FIXED[name])
        elif name in ("STRING", "BINSTRING", "SHORT_BINSTRING"):
            stack.append(arg.encode("latin-1").decode("ascii"))  # (as pickle.loads reads them)
        elif name in _EMPTY:
            stack.append(_EMPTY[name]())
        else:
            return False
        return True

    def _container(self, name) -> bool:
        """Build or fill a list, tuple, dict or set from the stack; False for another opcode."""
        stack = self.stack
        if name == "APPEND":
            item = _plain(stack.pop())
            self.top((list,), "APPEND").append(item)
        elif name == "APPENDS":
            items = list(map(_plain, self.pop_mark()))
            self.top((list,), "APPENDS").extend(items)
        elif name == "LIST":
            items = list(map(_plain, self.pop_mark()))
            self.stack.append(items)
        elif name == "TUPLE":
            items = self.tuple(self.pop_mark())
            self.stack.append(items)
        elif name in ("TUPLE1", "TUPLE2", "TUPLE3"):
            count = int(name[-1])
            if len(stack) < count:
                raise _refuse(f"{name} of too few items")
            items = stack[-count:]
            del stack[-count:]
            stack.append(self.tuple(items))
        elif name == "DICT":
            items, made = self.pop_mark(), {}
            self.set_items(made, items)
            self.stack.append(made)
        elif name == "SETITEM":
            value = stack.pop()
            key = stack.pop()
            self.set_items(self.top((dict, collections.OrderedDict), "SETITEM"), [key, value])
        elif name == "SETITEMS":
            items = self.pop_mark()
            self.set_items(self.top((dict, collections.OrderedDict), "SETITEMS"), items)
        elif name == "ADDITEMS":
            items = self.pop_mark()
            target = self.top((set,), "ADDITEMS")
            for item in items:
                self.admit(target, _plain(item))
                target.add(item)
        elif name == "FROZENSET":
            items = frozenset(self.members(self.pop_mark()))
            self.stack.append(items)
        else:
            return False
        return True

    def _bookkeeping(self, n, name, arg) -> bool:
        """The framing, marks, stack and memo opcodes; False for another opcode."""
        stack = self.stack
        if name in ("PROTO", "FRAME"):
            pass
        elif name == "MARK":
            self.marks.append(stack)
            self.stack = []
        elif name == "POP":
            if stack:
                stack.pop()
            else:
                self.pop_mark()
        elif name == "POP_MARK":
            self.pop_mark()
        elif name == "DUP":
            stack.append(stack[-1])
        elif name in _GETS:
            if arg not in self.memo:
                raise _refuse(f"memo index {arg} that was never filled")
            stack.append(self.memo[arg])
        elif name in _PUTS:
            if not 0 <= arg <= n:
                raise _refuse(f"memo index {arg} at opcode {n}")
            self.remember(arg)
        elif name == "MEMOIZE":
            self.remember(len(self.memo))
        else:
            return False
        return True

    def _global(self, name, arg) -> _Global:
        """A GLOBAL's callable: only one of :data:`REDUCES`, and only as what a REDUCE calls."""
        if name == "GLOBAL":
            module, _, attribute = arg.partition(" ")
        else:
            attribute, module = self.stack.pop(), self.stack.pop()
        if type(module) is not str or type(attribute) is not str or (module, attribute) not in REDUCES:
            raise _refuse(f"{module}.{attribute}"[:120])
        shown = f"{'numpy' if module in NUMPY_MODULES else module}.{attribute}"
        return _Global(shown, REDUCES[module, attribute])

    def load(self, dump: bytes):
        for n, (opcode, arg, _) in enumerate(pickletools.genops(dump)):
            if opcode.name == "STOP":
                if len(self.stack) != 1 or self.marks:
                    raise _refuse("STOP with more than a value on the stack")
                return _plain(self.stack.pop())
            try:
                self.step(n, opcode.name, arg)
            except IndexError:  # (an opcode that takes more than the stack holds)
                raise _refuse(f"{opcode.name} on an empty stack") from None
        raise _refuse("no STOP")


def load(dump: bytes, budget: int):
    """The value the pickle ``dump`` holds, if it is plain data of at most ``budget`` parts (see
    the module's docstring); raises ``pickle.UnpicklingError`` (or ValueError, TypeError, ...) if not."""
    value = _Reader(budget).load(dump)
    check_size(value, budget)
    return value
