"""A function's key changes whenever what it reaches changes — a captured tensor edited in place
or replaced, a Python value in its closure, defaults, globals, a user's object or module — and
stays equal for the same function, one made anew over the same things, and a view made anew of
the same tensor; what cannot be named safely has no key. The cache serves nothing under a key
whose tensors died, drops the least recently used first and keeps within its byte budget.
"""

from __future__ import annotations

import functools
import gc
import types

import torch

from qkv.masks.fingerprint import Key, KeyedCache, fingerprint

COUNT = [3]  # a global a function below reads


def _doc_mask(doc):
    return lambda b, h, i, j: doc[i] == doc[j]


def test_the_same_things_give_the_same_key():
    doc = torch.tensor([0, 0, 1, 1])
    assert fingerprint(_doc_mask(doc)) == fingerprint(_doc_mask(doc))  # made anew over the same tensor
    other = torch.tensor([0, 0, 1, 1])
    assert fingerprint(_doc_mask(doc)) != fingerprint(_doc_mask(other))  # equal values, another tensor
    mask = torch.ones(2, 1, 1, 4, dtype=torch.bool)
    assert fingerprint(mask[..., 0, 0, :]) == fingerprint(mask[..., 0, 0, :])  # a view made anew: its base
    assert fingerprint(mask[..., 0, 0, :]) != fingerprint(mask[..., 0, 0, 1:])  # another part of it


def test_a_tensor_edited_in_place_or_given_new_storage_changes_the_key():
    doc = torch.tensor([0, 0, 1, 1])
    fn = _doc_mask(doc)
    before = fingerprint(fn)
    doc[2] = 0
    assert fingerprint(fn) != before
    again = fingerprint(fn)
    doc.set_(torch.tensor([5, 5, 5, 5]))
    assert fingerprint(fn) != again
    view = doc[1:]
    key = fingerprint(lambda b, h, i, j: view[i] > 0)
    doc.add_(1)  # the base edited: the view sees it
    assert fingerprint(lambda b, h, i, j: view[i] > 0) != key


def test_python_values_in_closures_defaults_globals_objects_and_modules():
    def window(w):
        return lambda b, h, i, j: (i - j).abs() <= w

    assert fingerprint(window(3)) == fingerprint(window(3)) != fingerprint(window(4))
    spans = [0, 10, 20]
    fn = lambda b, h, i, j, spans=spans: i >= spans[1]  # noqa: E731
    before = fingerprint(fn)
    spans[1] = 12  # a list edited in place
    assert fingerprint(fn) != before

    def reads_global(b, h, i, j):
        return i >= COUNT[0]

    before = fingerprint(reads_global)
    COUNT[0] = 4
    try:
        assert fingerprint(reads_global) != before
    finally:
        COUNT[0] = 3

    class Window:
        def __init__(self, w):
            self.w = w

        def __call__(self, b, h, i, j):
            return (i - j).abs() <= self.w

    obj = Window(2)
    before = fingerprint(obj)
    assert fingerprint(Window(2)) == before
    obj.w = 5
    assert fingerprint(obj) != before and fingerprint(obj.__call__) != fingerprint(Window(2).__call__)
    before = fingerprint(obj)
    Window.w_max = 1  # a class attribute
    assert fingerprint(obj) != before

    config = types.ModuleType("config")
    config.LIMIT = 7
    fn = lambda b, h, i, j: i < config.LIMIT  # noqa: E731
    before = fingerprint(fn)
    config.LIMIT = 8
    assert fingerprint(fn) != before
    part = functools.partial(lambda lim, b, h, i, j: i < lim, 3)
    assert fingerprint(part) == fingerprint(functools.partial(part.func, 3)) != fingerprint(functools.partial(part.func, 4))


def test_modules_and_their_buffers():
    m = torch.nn.Module()
    m.register_buffer("doc", torch.tensor([0, 1, 1]))
    fn = lambda b, h, i, j: m.doc[i] == m.doc[j]  # noqa: E731
    before = fingerprint(fn)
    assert before is not None and before == fingerprint(fn)
    m.doc[0] = 1
    assert fingerprint(fn) != before


def test_cycles_and_library_functions():
    def recursive(b, h, i, j):
        return recursive if False else i >= j

    assert fingerprint(recursive) == fingerprint(recursive)
    loop: list = [1]
    loop.append(loop)
    assert fingerprint(loop) is not None
    assert fingerprint(torch.where) == fingerprint(torch.where)
    assert fingerprint(torch.ops.aten.eq) is not None


def test_what_cannot_be_named_has_no_key():
    with torch.inference_mode():
        t = torch.ones(3)
    assert fingerprint(lambda b, h, i, j: t[i] > 0) is None  # no version counter
    gen = (x for x in range(3))
    assert fingerprint(lambda b, h, i, j: next(gen)) is None
    assert fingerprint(torch.Generator()) is None
    assert fingerprint(list(range(10_000))) is None  # too much to walk on every call


def test_the_cache_serves_live_keys_least_recently_used_out_first_within_its_bytes():
    cache = KeyedCache(entries=2, max_bytes=100)
    keys = [Key(("k", n)) for n in range(3)]
    cache.put(keys[0], "a", 10)
    cache.put(keys[1], "b", 10)
    assert cache.get(keys[0]) == "a"  # now the most recently used
    cache.put(keys[2], "c", 10)
    assert cache.get(keys[1]) is None and cache.get(keys[0]) == "a" and cache.get(keys[2]) == "c"
    cache.put(Key(("big",)), "d", 101)  # past the budget alone: not kept
    assert cache.get(Key(("big",))) is None
    cache.put(Key(("fat",)), "e", 95)  # keeps within the budget: the others go
    assert len(cache) == 1 and cache.get(Key(("fat",))) == "e"

    t = torch.ones(3)
    key = fingerprint(t)
    cache.put(key, "t", 1)
    assert cache.get(fingerprint(t)) == "t"
    same_parts = Key(key.parts)  # the same id and version numbers, but the tensor is gone
    del t
    gc.collect()
    assert not key.alive() and cache.get(same_parts) is None


def test_covers_names_every_tensor_read():
    doc, other = torch.arange(4), torch.arange(4)
    key = fingerprint(_doc_mask(doc))
    assert key.covers([doc, doc[1:]]) and not key.covers([other])
