"""When something built from a function can be reused: a key naming everything the function reaches.

A mask function (``mask_mod``) is a pure function of its arguments and of what it reaches: its
code, its closure, its defaults, the globals its code names, the attributes of the objects it
holds. :func:`fingerprint` walks those and gives a hashable :class:`Key`:

- plain values (numbers, strings, dtypes, devices; tuples, lists, sets and dicts of them) by value;
- code, builtins, library functions, classes and modules of libraries (torch, numpy, qkv, ...)
  by identity — a library's globals do not change, a closure made by one still does (walked);
- a user's functions by code, closure, defaults and the globals their code names; a user's
  objects by class and attributes; a user's modules and classes by the attributes the code names;
- tensors by identity (of the tensor a view was taken from), version counter, data pointer,
  shape, strides, dtype and device — so a closure made anew over another tensor, a tensor edited
  in place or given other storage, or a changed Python value gives another key.

What it cannot name safely — an object of a C extension or of a library class it does not know,
a generator, more than a few thousand values, a tensor under a ``torch.func`` transform or made
in inference mode (no version counter) — gives None, and nothing is cached for it. A function
that reaches tensors some other way is caught by the caller, who watches what the function
reads while it builds (:class:`qkv.score_mods.reads.Reads` with ``every=True``) and caches only
when every tensor read is in the key (:meth:`Key.covers`).

:class:`KeyedCache` keeps a few dozen small results (block layouts, Flex block masks) under such
keys, the least recently used out first, within a byte budget; an entry whose key's tensors have
died is never served (a new tensor may take a dead one's id).
"""

from __future__ import annotations

import functools
import threading
import types
import weakref
from collections import OrderedDict
from typing import Any, Hashable, Optional

import torch
from torch import Tensor

__all__ = ["Key", "KeyedCache", "fingerprint"]

# Packages whose functions' globals, classes and modules do not change while a program runs.
_LIBRARIES = frozenset({"torch", "numpy", "math", "operator", "_operator", "functools", "_functools",
                        "itertools", "builtins", "collections", "typing", "einops", "qkv"})  # fmt: skip
_BUDGET = 4096  # values walked per key, at most (a closure over a large container is not cached)
_PLAIN = frozenset({type(None), bool, int, float, complex, str, bytes, torch.dtype, torch.device, torch.layout,
                    torch.memory_format, type(Ellipsis), type(NotImplemented)})  # fmt: skip
_BUILTINS = (types.BuiltinFunctionType, types.MethodWrapperType, types.WrapperDescriptorType,
             types.MethodDescriptorType, types.ClassMethodDescriptorType, types.GetSetDescriptorType,
             types.MemberDescriptorType)  # fmt: skip
_UNSET = ("unset",)  # a slot with no value
_NAMES: dict[types.CodeType, tuple[str, ...]] = {}
_MAX_CODES = 1024


class _Refused(Exception):
    """Something reached cannot be named safely: no key."""


class Key:
    """A hashable name of what something was built from: equal keys, equal results. Tensors in it
    are named by identity; :meth:`alive` says whether those tensors still exist (were one gone, a
    new tensor could have taken its id, and the key would name something else)."""

    __slots__ = ("parts", "refs", "_hash")

    def __init__(self, parts: tuple, refs: tuple["weakref.ref[Tensor]", ...] = ()) -> None:
        self.parts = parts
        self.refs = refs
        self._hash = hash(parts)

    def __hash__(self) -> int:
        return self._hash

    def __eq__(self, other: object) -> bool:
        return isinstance(other, Key) and self._hash == other._hash and self.parts == other.parts

    def __repr__(self) -> str:
        return f"Key({len(self.refs)} tensor(s), hash {self._hash:#x})"

    def alive(self) -> bool:
        return all(r() is not None for r in self.refs)

    def covers(self, tensors: "list[Tensor] | tuple[Tensor, ...]") -> bool:
        """Is every one of ``tensors`` (or the tensor it is a view of) named in this key?"""
        named = {id(r()) for r in self.refs}
        return all(id(_root(t)) in named for t in tensors)

    def join(self, *parts: Hashable, keys: tuple["Key", ...] = ()) -> "Key":
        """A key for something built from this key's things, ``keys``' things and ``parts``."""
        return Key((self.parts, *(k.parts for k in keys), *parts), self.refs + tuple(r for k in keys for r in k.refs))


def _root(t: Tensor) -> Tensor:
    """The tensor a view was taken from (views share its storage and version counter)."""
    return t._base if t._base is not None else t


def _module_root(name: Optional[str]) -> str:
    return (name or "").split(".", 1)[0]


def _code_names(code: types.CodeType) -> tuple[str, ...]:
    """The names a code object (and the code nested in it) may look up: its globals and
    attributes, and its string constants (``getattr(module, "name")``)."""
    found = _NAMES.get(code)
    if found is None:
        names: set[str] = set(code.co_names)
        for c in code.co_consts:
            if isinstance(c, types.CodeType):
                names.update(_code_names(c))
            elif isinstance(c, str) and c.isidentifier():
                names.add(c)
        if len(_NAMES) >= _MAX_CODES:
            _NAMES.clear()
        found = _NAMES[code] = tuple(sorted(names))
    return found


class _Walk:
    """One walk over what a value reaches (see the module docstring); ``refs`` holds a weak
    reference to every tensor named."""

    def __init__(self) -> None:
        self.budget = _BUDGET
        self.seen: dict[int, int] = {}
        self.refs: dict[int, "weakref.ref[Tensor]"] = {}

    def value(self, v: Any, names: tuple[str, ...]) -> Hashable:
        self.budget -= 1
        if self.budget < 0:
            raise _Refused("too many values")
        t = type(v)
        if t in _PLAIN:
            return (t, v)
        if isinstance(v, Tensor):
            return self.tensor(v)
        if id(v) in self.seen:  # reached before (or a cycle): named by the order it was first reached
            return ("again", self.seen[id(v)])
        self.seen[id(v)] = len(self.seen)
        if isinstance(v, (tuple, list)):
            return (t, tuple(self.value(x, names) for x in v))
        if isinstance(v, dict):
            return (t, tuple((self.value(a, names), self.value(b, names)) for a, b in v.items()))
        if isinstance(v, (set, frozenset)):
            return (t, tuple(self.value(x, names) for x in v))
        if t in (slice, range):
            return (t, self.value(v.start, names), self.value(v.stop, names), self.value(v.step, names))
        return self.callable_or_object(v, names)

    def callable_or_object(self, v: Any, names: tuple[str, ...]) -> Hashable:
        if isinstance(v, types.FunctionType):
            return self.function(v)
        if isinstance(v, types.MethodType):
            return ("method", self.value(v.__func__, names), self.value(v.__self__, names))
        if isinstance(v, functools.partial):
            return ("partial", self.value(v.func, names), self.value(v.args, names), self.value(v.keywords, names))
        if isinstance(v, (staticmethod, classmethod)):
            return (type(v), self.value(v.__func__, names))
        if isinstance(v, property):
            return (property, self.value(v.fget, names), self.value(v.fset, names))
        if isinstance(v, _BUILTINS):
            owner = getattr(v, "__self__", None)
            if owner is None or isinstance(owner, (types.ModuleType, type)):
                return ("builtin", v)
            return ("builtin", getattr(v, "__name__", ""), self.value(owner, names))  # a bound method of an object
        if isinstance(v, types.ModuleType):
            return self.namespace("module", v, vars(v), _module_root(v.__name__), names)
        if isinstance(v, type):
            return self.klass(v, names)
        if isinstance(v, (torch._ops.OpOverload, torch._ops.OpOverloadPacket)):
            return ("op", v)
        return self.instance(v, names)

    def tensor(self, v: Tensor) -> Hashable:
        if type(v) not in (Tensor, torch.nn.Parameter) or torch._C._functorch.is_functorch_wrapped_tensor(v):
            raise _Refused("a tensor subclass or a transform's tensor")
        root = _root(v)
        try:
            token = ("T", id(root), v._version, v.data_ptr(), v.shape, v.stride(), v.dtype, v.device)
        except RuntimeError as e:  # inference tensors keep no version counter
            raise _Refused(str(e)) from None
        if id(root) not in self.refs:
            self.refs[id(root)] = weakref.ref(root)
        return token

    def function(self, fn: types.FunctionType) -> Hashable:
        own = _code_names(fn.__code__)
        cells = []
        for cell in fn.__closure__ or ():
            try:
                cells.append(self.value(cell.cell_contents, own))
            except ValueError:  # a cell not filled yet
                cells.append(("empty",))
        found = ("F", fn.__code__, self.value(fn.__defaults__, own), self.value(fn.__kwdefaults__, own), tuple(cells))
        if not own or _module_root(fn.__module__) in _LIBRARIES:
            return found
        g = fn.__globals__
        return (*found, tuple([(n, self.value(g[n], own)) for n in own if n in g]))

    def namespace(self, tag: str, owner: Any, space: Any, root: str, names: tuple[str, ...]) -> Hashable:
        """A module or class: by identity, and (a user's) by the attributes ``names`` may read."""
        if root in _LIBRARIES:
            return (tag, owner)
        return (tag, owner, tuple((n, self.value(space[n], names)) for n in names if n in space))

    def klass(self, c: type, names: tuple[str, ...]) -> Hashable:
        if _module_root(c.__module__) in _LIBRARIES:
            return ("class", c)
        attrs = []
        for base in c.__mro__:  # every attribute of a user's class: methods reach each other through self
            if _module_root(base.__module__) not in _LIBRARIES:
                for n, a in vars(base).items():
                    if not (n.startswith("__") and n.endswith("__")) or n == "__call__":
                        attrs.append((n, self.value(a, names)))
        return ("class", c, tuple(attrs))

    def instance(self, v: Any, names: tuple[str, ...]) -> Hashable:
        t = type(v)
        if _module_root(t.__module__) in _LIBRARIES and not isinstance(v, torch.nn.Module):
            raise _Refused(f"an object of {t.__module__}.{t.__qualname__}")
        call = getattr(t, "__call__", None)
        own = _code_names(call.__code__) if isinstance(call, types.FunctionType) else names
        state = getattr(v, "__dict__", None)
        if state is None and not hasattr(t, "__slots__"):
            raise _Refused(f"an object of {t.__qualname__} without attributes to read")
        slots = [(s, getattr(v, s, _UNSET)) for c in t.__mro__ for s in getattr(c, "__slots__", ()) if isinstance(s, str)]
        return ("object", self.value(t, own), self.value(state, own), self.value(slots, own))


def fingerprint(value: Any) -> Optional[Key]:
    """A :class:`Key` for ``value`` (a function, usually) and everything it reaches, or None where
    something reached cannot be named safely (see the module docstring). Costs microseconds for
    a closure over a few tensors and values."""
    walk = _Walk()
    try:
        parts = walk.value(value, ())
    except _Refused:
        return None
    return Key(("fingerprint", parts), tuple(walk.refs.values()))


class KeyedCache:
    """Up to ``entries`` small values under :class:`Key` s, the least recently used out first, at
    most ``max_bytes`` in all (a larger value is not kept); an entry whose key's tensors have died
    is dropped instead of served."""

    def __init__(self, entries: int = 32, max_bytes: int = 64 << 20) -> None:
        self.entries, self.max_bytes = entries, max_bytes
        self._data: "OrderedDict[Key, tuple[Key, Any, int]]" = OrderedDict()
        self._lock = threading.Lock()

    def __len__(self) -> int:
        return len(self._data)

    def get(self, key: Key) -> Any:
        """The value kept under ``key`` (None for none, or for one whose tensors died)."""
        with self._lock:
            found = self._data.get(key)
            if found is None:
                return None
            if not found[0].alive():
                del self._data[key]
                return None
            self._data.move_to_end(key)
            return found[1]

    def put(self, key: Key, value: Any, nbytes: int) -> None:
        """Keep ``value`` (``nbytes`` large) under ``key``, the least recently used out as needed."""
        if nbytes > self.max_bytes or not key.alive():
            return
        with self._lock:
            self._data.pop(key, None)
            for k in [k for k, (stored, _, _) in self._data.items() if not stored.alive()]:
                del self._data[k]
            used = sum(n for _, _, n in self._data.values())
            while self._data and (len(self._data) >= self.entries or used + nbytes > self.max_bytes):
                used -= self._data.popitem(last=False)[1][2]
            self._data[key] = (key, value, nbytes)

    def clear(self) -> None:
        with self._lock:
            self._data.clear()

