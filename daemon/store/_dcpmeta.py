"""Inert reader for torch.distributed.checkpoint ``.metadata`` files.

``.metadata`` is a pickle of DCP's ``Metadata``. The daemon never unpickles untrusted data
and never imports torch, so this module *parses* the pickle: it walks the opcodes with
:func:`pickletools.genops` and simulates the unpickler's stack and memo with inert values.
No global is imported and nothing named by the data is called. Bounds: input size, stack
size and MARK nesting are capped, and dict keys / set members are size-checked before
CPython hashes them (tuple hashing recurses and is not cached). Nothing walks the parsed
values recursively; deeply nested values are only freed, which CPython does iteratively.
"""

from __future__ import annotations

import io
import pickletools
from dataclasses import dataclass
from typing import TypeGuard

DEFAULT_MAX_BYTES = 256 * 1024 * 1024
_MAX_STACK = 1 << 20  # values on the stack, all MARK levels together
_MAX_MARKS = 1000  # MARK nesting; CPython's pickler recurses no deeper than this
_MAX_KEY_NODES = 1000  # tuple elements walked per dict key / set member
_MAX_SHOWN = 200  # characters of a hostile input shown in a problem string

_PUSH_ARG = frozenset(
    "INT BININT BININT1 BININT2 LONG LONG1 LONG4 STRING BINSTRING SHORT_BINSTRING BINBYTES"
    " SHORT_BINBYTES BINBYTES8 BYTEARRAY8 UNICODE SHORT_BINUNICODE BINUNICODE BINUNICODE8"
    " FLOAT BINFLOAT".split()
)
_CONST: dict[str, object] = {"NONE": None, "NEWTRUE": True, "NEWFALSE": False, "EMPTY_TUPLE": ()}
_EMPTY = {"EMPTY_LIST": list, "EMPTY_DICT": dict, "EMPTY_SET": set}
# Any other opcode is refused, notably PERSID/BINPERSID, EXT1/2/4 and the protocol 5
# out-of-band buffers NEXT_BUFFER/READONLY_BUFFER.


class DcpMetadataError(ValueError):
    """Raised when a .metadata file cannot be parsed as DCP metadata."""


@dataclass(frozen=True, slots=True)
class Global:
    """An inert reference to ``module.name``; it is never imported."""

    module: str
    name: str


@dataclass(eq=False, slots=True)
class Instance:
    """An inert record of an object the pickle would have constructed.

    Attributes:
        cls: The callable or class the pickle names (REDUCE, NEWOBJ, OBJ, INST).
        args: Positional arguments it would have been called with.
        kwargs: Keyword arguments (NEWOBJ_EX only), else None.
        state: The BUILD state: usually a dict, or a ``(dict, slotstate)`` tuple.
        listitems: Items APPENDed to it (list subclasses), else None.
        dictitems: Items SETITEMed into it (dict subclasses such as OrderedDict), else None.
    """

    cls: Global
    args: tuple[object, ...]
    kwargs: dict[object, object] | None = None
    state: object = None
    listitems: list[object] | None = None
    dictitems: dict[object, object] | None = None


@dataclass(frozen=True, slots=True)
class ShardRef:
    """A file referenced by DCP metadata and the size it must at least have.

    Attributes:
        relative_path: File name relative to the DCP directory, e.g. ``"__0_0.distcp"``.
        min_size: ``max(offset + length)`` over all items stored in that file.
    """

    relative_path: str
    min_size: int


def _key(value: object) -> object:
    """Return ``value`` if it can be hashed cheaply and safely, else raise."""
    todo, budget = [value], _MAX_KEY_NODES
    while todo:
        item = todo.pop()
        if isinstance(item, tuple):
            budget -= len(item)
            if budget < 0:
                raise DcpMetadataError("dict key or set member is too large")
            todo.extend(item)
        elif isinstance(item, list | dict | set | bytearray):
            raise DcpMetadataError("unhashable dict key or set member")
    return value


def _new(cls: object, args: object, kwargs: object = None) -> Instance:
    """Record an object construction; see through copyreg's protocol 0/1 helpers."""
    if not isinstance(cls, Global) or not isinstance(args, tuple):
        raise DcpMetadataError("object construction needs a global and an argument tuple")
    if not isinstance(kwargs, dict | None):
        raise DcpMetadataError("keyword arguments are not a dict")
    if cls.module in ("copyreg", "copy_reg") and args and isinstance(args[0], Global):
        if cls.name == "_reconstructor":
            return Instance(args[0], ())
        if cls.name == "__newobj__":
            return Instance(args[0], args[1:])
    return Instance(cls, args, kwargs)


class _Machine:
    """The unpickler's stack, MARK positions and memo, holding inert values only."""

    __slots__ = ("marks", "memo", "stack")

    def __init__(self) -> None:
        self.stack: list[object] = []
        self.marks: list[int] = []  # stack length at each open MARK
        self.memo: dict[int, object] = {}

    def pop_n(self, count: int) -> list[object]:
        """Pop ``count`` values (oldest first) without crossing the innermost MARK."""
        start = len(self.stack) - count
        if start < (self.marks[-1] if self.marks else 0):
            raise DcpMetadataError("pickle stack underflow")
        items = self.stack[start:]
        del self.stack[start:]
        return items

    def top(self) -> object:
        if len(self.stack) <= (self.marks[-1] if self.marks else 0):
            raise DcpMetadataError("pickle stack underflow")
        return self.stack[-1]

    def pop_mark(self) -> list[object]:
        if not self.marks:
            raise DcpMetadataError("no MARK on the pickle stack")
        items = self.stack[self.marks[-1] :]
        del self.stack[self.marks.pop() :]
        return items

    def step(self, name: str, arg: object) -> None:
        """Apply one opcode; it adds at most one value to the stack."""
        push, memo = self.stack.append, self.memo
        if name == "MEMOIZE" or name in ("PUT", "BINPUT", "LONG_BINPUT"):
            index = len(memo) if name == "MEMOIZE" else arg
            if not isinstance(index, int) or index < 0:
                raise DcpMetadataError(f"{name}: bad memo index")
            memo[index] = self.top()
        elif name in ("BINGET", "LONG_BINGET", "GET"):
            if not isinstance(arg, int) or arg not in memo:
                raise DcpMetadataError(f"{name}: memo index {arg!s:.20} is not defined")
            push(memo[arg])
        elif name in _PUSH_ARG:
            push(arg)
        elif name in _CONST:
            push(_CONST[name])
        elif name in _EMPTY:
            push(_EMPTY[name]())
        elif name == "MARK":
            if len(self.marks) >= _MAX_MARKS:
                raise DcpMetadataError("MARK nesting exceeds the limit")
            self.marks.append(len(self.stack))
        elif name in ("TUPLE1", "TUPLE2", "TUPLE3"):
            push(tuple(self.pop_n(int(name[-1]))))
        elif name in ("TUPLE", "LIST"):
            items = self.pop_mark()
            push(tuple(items) if name == "TUPLE" else items)
        elif name in ("APPEND", "APPENDS"):
            items = self.pop_n(1) if name == "APPEND" else self.pop_mark()
            target = self.top()
            if isinstance(target, Instance):
                if target.listitems is None:
                    target.listitems = []
                target = target.listitems
            if not isinstance(target, list):
                raise DcpMetadataError(f"{name}: target is not a list")
            target.extend(items)
        elif name in ("DICT", "SETITEM", "SETITEMS"):
            items = self.pop_n(2) if name == "SETITEM" else self.pop_mark()
            target = {} if name == "DICT" else self.top()
            if isinstance(target, Instance):
                if target.dictitems is None:
                    target.dictitems = {}
                target = target.dictitems
            if not isinstance(target, dict) or len(items) % 2:
                raise DcpMetadataError(f"{name}: target is not a dict or odd item count")
            for i in range(0, len(items), 2):
                key = items[i]
                target[key if isinstance(key, str) else _key(key)] = items[i + 1]
            if name == "DICT":
                push(target)
        elif name == "ADDITEMS":
            items = self.pop_mark()
            target = self.top()
            if not isinstance(target, set):
                raise DcpMetadataError(f"{name}: target is not a set")
            target.update(_key(item) for item in items)
        elif name == "FROZENSET":
            push(frozenset(_key(item) for item in self.pop_mark()))
        elif name == "POP":
            if self.marks and self.marks[-1] == len(self.stack):
                self.marks.pop()  # like CPython: POP right after MARK discards the MARK
            else:
                self.pop_n(1)
        elif name == "POP_MARK":
            self.pop_mark()
        elif name == "DUP":
            push(self.top())
        elif name in ("GLOBAL", "STACK_GLOBAL"):
            module, attr = str(arg).partition(" ")[::2] if name == "GLOBAL" else self.pop_n(2)
            if not isinstance(module, str) or not isinstance(attr, str):
                raise DcpMetadataError(f"{name}: module and name must be str")
            push(Global(module, attr))
        elif name in ("REDUCE", "NEWOBJ"):
            push(_new(*self.pop_n(2)))
        elif name == "NEWOBJ_EX":
            push(_new(*self.pop_n(3)))
        elif name in ("OBJ", "INST"):
            items = self.pop_mark()
            if name == "INST":
                items.insert(0, Global(*str(arg).partition(" ")[::2]))
            if not items:
                raise DcpMetadataError(f"{name}: missing class")
            push(_new(items[0], tuple(items[1:])))
        elif name == "BUILD":
            (state,) = self.pop_n(1)
            target = self.top()
            if not isinstance(target, Instance):
                raise DcpMetadataError(f"{name}: target is not an object")
            if isinstance(target.state, dict) and isinstance(state, dict):
                target.state.update(state)
            else:
                target.state = state
        elif name == "PROTO":
            if not isinstance(arg, int) or arg > 5:
                raise DcpMetadataError(f"{name}: unsupported pickle protocol {arg}")
        elif name != "FRAME":  # FRAME only groups opcodes for buffered reads
            raise DcpMetadataError(f"unsupported pickle opcode {name}")


def parse_pickle(data: bytes, *, max_bytes: int = DEFAULT_MAX_BYTES) -> object:
    """Parse a pickle into inert values without unpickling it.

    Args:
        data: The pickle bytes (protocols 0-5).
        max_bytes: Refuse input longer than this.

    Returns:
        The pickled value, built from plain containers, scalars, :class:`Global` and
        :class:`Instance`.

    Raises:
        DcpMetadataError: The input is too large, malformed, truncated, exceeds a
            bound, or uses an unsupported opcode (persistent IDs, the extension
            registry, out-of-band buffers).
    """
    if len(data) > max_bytes:
        raise DcpMetadataError(f"pickle is {len(data)} bytes, limit is {max_bytes}")
    machine = _Machine()
    pos: int | None = 0
    try:
        for opcode, arg, at in pickletools.genops(io.BytesIO(data)):
            pos = at
            if opcode.name == "STOP":
                if machine.marks:
                    raise DcpMetadataError("STOP inside an unclosed MARK")
                (result,) = machine.pop_n(1)
                if machine.stack:
                    raise DcpMetadataError("STOP with extra values on the stack")
                return result
            machine.step(opcode.name, arg)
            if len(machine.stack) > _MAX_STACK:
                raise DcpMetadataError("pickle stack exceeds the limit")
    except DcpMetadataError as exc:
        raise DcpMetadataError(f"at byte {pos}: {exc}") from None
    except (ValueError, TypeError, OverflowError) as exc:  # raised by genops on bad input
        detail = str(exc)[:_MAX_SHOWN]
        raise DcpMetadataError(f"malformed pickle near byte {pos}: {detail}") from exc
    raise DcpMetadataError("pickle ended before STOP")


def _fields(value: object, cls_name: str) -> dict[str, object]:
    """Return the BUILD state of an Instance of class ``cls_name`` as one dict."""
    if not isinstance(value, Instance) or value.cls.name != cls_name:
        raise DcpMetadataError(f"expected a {cls_name} object")
    state = value.state
    parts = state if isinstance(state, tuple) and len(state) == 2 else (state,)
    fields: dict[str, object] = {}
    for part in parts:
        if isinstance(part, dict):
            fields.update((k, v) for k, v in part.items() if isinstance(k, str))
        elif part is not None:
            raise DcpMetadataError(f"{cls_name} state is not a dict")
    return fields


def _is_count(value: object) -> TypeGuard[int]:
    return isinstance(value, int) and not isinstance(value, bool) and value >= 0


def referenced_shards(data: bytes, *, max_bytes: int = DEFAULT_MAX_BYTES) -> list[ShardRef]:
    """Parse DCP .metadata bytes without unpickling them.

    Returns each referenced file with the size it must at least have, sorted by path.

    Args:
        data: The content of a DCP ``.metadata`` file.
        max_bytes: Refuse input longer than this.

    Returns:
        One :class:`ShardRef` per distinct ``relative_path`` in ``storage_data``.

    Raises:
        DcpMetadataError: The bytes are not a parseable pickle of DCP ``Metadata`` whose
            ``storage_data`` maps to ``_StorageInfo`` objects.
    """
    metadata = _fields(parse_pickle(data, max_bytes=max_bytes), "Metadata")
    storage = metadata.get("storage_data")
    if isinstance(storage, Instance):  # a dict subclass, e.g. OrderedDict
        storage = storage.dictitems or {}
    if not isinstance(storage, dict):
        raise DcpMetadataError("Metadata.storage_data is not a dict")
    sizes: dict[str, int] = {}
    for info in storage.values():
        item = _fields(info, "_StorageInfo")
        path, offset, length = item.get("relative_path"), item.get("offset"), item.get("length")
        if not isinstance(path, str):
            raise DcpMetadataError("_StorageInfo.relative_path is not a str")
        if not (_is_count(offset) and _is_count(length)):
            raise DcpMetadataError("_StorageInfo offset/length is not a non-negative int")
        sizes[path] = max(sizes.get(path, 0), offset + length)
    return [ShardRef(path, size) for path, size in sorted(sizes.items())]
