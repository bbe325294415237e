"""The flex engine builds each data-dependent block mask once: a loop of calls with the same
mask function, key padding or bool mask builds Flex's block mask for the first call only (the
route qkv takes on CUDA); a tensor edited in place, or another one, builds it anew; a Flex
BlockMask given as ``attn_mask`` runs as given; the kept block masks hold none of the calls'
tensors. Compiled FlexAttention's CPU forward, as on CUDA but small.
"""

from __future__ import annotations

import gc
import weakref

import pytest
import torch

import qkv
from qkv.backends import BACKENDS

from ..helpers import make_qkv, max_err
from ..masks.evaluations import Evaluations

FLEX = BACKENDS["flex"]
pytestmark = pytest.mark.skipif(FLEX.available() is not None, reason=f"flex unavailable: {FLEX.available()}")
N = 64  # keys a multiple of 16 and head dim 16: a shape torch's CPU kernel computes right everywhere


@pytest.fixture
def builds(monkeypatch):
    """How many block masks Flex's ``create_block_mask`` builds."""
    fa = pytest.importorskip("torch.nn.attention.flex_attention")
    count = [0]
    build = fa.create_block_mask

    def counted(*args, **kw):
        count[0] += 1
        return build(*args, **kw)

    monkeypatch.setattr(fa, "create_block_mask", counted)
    return count


def _oracle(q, k, v, **kw):
    return torch.as_tensor(qkv.attention_ref(q, k, v, **kw)).float()


def _same_doc_causal(doc):
    return lambda b, h, i, j: (doc[i] == doc[j]) & (i >= j)  # one code for every test: one compiled kernel


def test_a_loop_of_mask_mod_calls_runs_no_python_after_the_first(builds):
    q, k, v = make_qkv(2, 2, 2, N, N, 16, seed=11)
    doc = torch.arange(N) * 3 // N

    def step():
        fn = _same_doc_causal(doc)  # made anew each step
        with Evaluations(fn) as ev:
            out = qkv.attention(q, k, v, mask_mod=fn, backend="flex")
        return out, ev.calls, fn

    out, _, fn = step()
    built = builds[0]
    assert max_err(out, _oracle(q, k, v, mask_mod=fn)) < 1e-5
    for _ in range(3):
        again, calls, _ = step()
        assert calls == 0 and builds[0] == built  # no layout, no block mask, no Python evaluation
        assert torch.equal(again, out)
    doc[: N // 2] = 0  # edited in place: built anew, and the answer follows
    out, calls, fn = step()
    assert calls > 0 and builds[0] == built + 1
    assert max_err(out, _oracle(q, k, v, mask_mod=fn)) < 1e-5


def test_padding_and_bool_masks_are_built_once_per_tensor_state(builds):
    q, k, v = make_qkv(2, 2, 2, N, N, 16, seed=12)
    pad = torch.ones(2, N, dtype=torch.bool)
    pad[0, 40:] = False
    allowed = torch.rand(2, 1, N, N, generator=torch.Generator().manual_seed(13)) > 0.5
    for kw in ({"key_padding_mask": pad}, {"attn_mask": allowed}, {"attn_mask": allowed[:, :, :1, :]}):
        before = builds[0]
        for _ in range(3):
            out = qkv.attention(q, k, v, backend="flex", **kw)
        assert builds[0] == before + 1, kw
        assert max_err(out, _oracle(q, k, v, **kw)) < 1e-5
    pad[1, 10:] = False
    allowed[1, 0, 5:] = ~allowed[1, 0, 5:]
    for kw in ({"key_padding_mask": pad}, {"attn_mask": allowed}):
        before = builds[0]
        out = qkv.attention(q, k, v, backend="flex", **kw)
        assert builds[0] == before + 1 and max_err(out, _oracle(q, k, v, **kw)) < 1e-5


def test_a_flex_block_mask_runs_as_given(builds):
    fa = pytest.importorskip("torch.nn.attention.flex_attention")
    q, k, v = make_qkv(2, 2, 2, N, N, 16, seed=14)
    same_doc = _same_doc_causal(torch.arange(N) * 3 // N)
    block_mask = fa.create_block_mask(same_doc, None, None, N, N, device="cpu")
    before = builds[0]
    with Evaluations(same_doc) as ev:
        outs = [qkv.attention(q, k, v, attn_mask=block_mask, backend="flex") for _ in range(3)]
    assert builds[0] == before and ev.calls == 0
    assert max_err(outs[-1], _oracle(q, k, v, mask_mod=same_doc)) < 1e-5


def test_kept_block_masks_hold_no_call_tensor():
    q, k, v = make_qkv(2, 2, 2, N, N, 16, seed=15)
    allowed = torch.rand(2, 1, N, N, generator=torch.Generator().manual_seed(16)) > 0.3
    alive = weakref.ref(allowed)
    qkv.attention(q, k, v, attn_mask=allowed, backend="flex")
    del allowed
    gc.collect()
    assert alive() is None
