"""Score functions (``score_mod=``) and attention sinks (``sinks=``) on every backend that claims
them, against the float64 oracle, forward and backward.

The score functions are the ones FlexAttention's documentation and attention-gym show:
softcapping, ALiBi, relative position bias (plain and T5-bucketed), document masking and a
prefix-LM written as score functions, and a bias table captured from the closure; sinks as in
GPT-OSS. Tolerances follow the project's rule (docs/guarantees.md): the candidate's error is
within 2× (outputs) or 3× (gradients) the math backend's in the same dtype, plus a floor.
"""

from __future__ import annotations

import numpy as np
import pytest
import torch

import qkv
from qkv.backends import BACKENDS, BackendError
from qkv.score_mods import ALiBi, RelativeBias, ScoreMod, Softcap, alibi_slopes, relative_buckets

from ..helpers import FLOOR, LargestAllocation, assert_within_rule, make_qkv, mask_kwargs, max_err

H = 4


def _doc_ids(n: int) -> torch.Tensor:
    return torch.tensor([min(i * 3 // n, 2) for i in range(n)])  # three documents, packed


def _mods(dtype: torch.dtype = torch.float64) -> dict:
    """name → a fresh score function (captured tensors requiring grad where they are learnable)."""
    table = torch.randn(H, 2 * 64 - 1, dtype=dtype).mul_(0.5).requires_grad_()
    docs = _doc_ids(64)

    def rel_table(score, b, h, q_idx, kv_idx):  # a learnable bias per head and offset, read from the closure
        return score + table[h, (kv_idx - q_idx).clamp(-63, 63) + 63]

    def document(score, b, h, q_idx, kv_idx):  # packed documents, as a score function
        return torch.where(docs[q_idx.clamp(max=63)] == docs[kv_idx.clamp(max=63)], score, -float("inf"))

    return {
        "softcap": Softcap(2.0),
        "softcap_lambda": lambda s, b, h, q, k: 2.0 * torch.tanh(s / 2.0),
        "alibi": ALiBi(alibi_slopes(H).to(dtype).requires_grad_()),
        "alibi_bottom_right": ALiBi(alibi_slopes(H).to(dtype).requires_grad_(), alignment="bottom_right"),
        "alibi_symmetric": ALiBi(alibi_slopes(H).to(dtype), symmetric=True),
        "relative_position": lambda s, b, h, q, k: s + 0.05 * (q - k),
        "t5_bidirectional": RelativeBias(torch.randn(32, H, dtype=dtype).requires_grad_(), max_distance=20),
        "t5_causal": RelativeBias(torch.randn(16, H, dtype=dtype).requires_grad_(), bidirectional=False, max_distance=20),
        "bias_table": rel_table,
        "document": document,
        "per_batch_head": lambda s, b, h, q, k: s * (1.0 + 0.25 * b) - 0.1 * h,
    }


def _params(mod) -> list[torch.Tensor]:
    from qkv.score_mods.base import captured_tensors

    return list(captured_tensors(mod))


def _run(q, k, v, mod, sinks=None, backend="math", **kw):
    """out, lse and the gradients of q, k, v, the function's tensors and the sinks."""
    leaves = [t.detach().clone().requires_grad_() for t in (q, k, v)]
    params = _params(mod) + ([sinks] if sinks is not None and sinks.requires_grad else [])
    for p in params:
        p.grad = None
    out, lse = qkv.attention(*leaves, score_mod=mod, sinks=sinks, backend=backend, return_lse=True, **kw)
    torch.manual_seed(1)
    w = torch.randn_like(out, dtype=torch.float64).to(out.dtype)
    wl = torch.randn_like(lse)
    loss = (out * w).sum() + (torch.where(torch.isneginf(lse), 0.0, lse) * wl).sum()
    loss.backward()
    grads = [t.grad for t in leaves] + [p.grad.clone() if p.grad is not None else torch.zeros_like(p) for p in params]
    return out, lse, grads


@pytest.mark.parametrize("name", list(_mods()))
@pytest.mark.parametrize("masks", ["none", "causal", "bottom_right", "window", "padding", "float_mask"])
def test_score_functions_match_the_float64_reference(name, masks):
    nq, nk = (40, 64) if "bottom_right" in (name + masks) else (64, 64)
    q, k, v = make_qkv(b=2, hq=H, hk=2, nq=nq, nk=nk, d=16, dtype=torch.float64)
    q, k = q * 2, k * 2  # peaked weights: a wrong score function is far off
    kw = mask_kwargs(masks, 2, H, nq, nk)
    mod = _mods()[name]
    ref_out, ref_lse = qkv.attention_ref(q, k, v, score_mod=mod, enable_gqa=True, return_lse=True, **kw)
    m64 = _run(q, k, v, mod, backend="math", enable_gqa=True, **kw)
    assert max_err(m64[0], ref_out) < 1e-10 and max_err(m64[1], ref_lse) < 1e-10
    for dtype in (torch.float32, torch.bfloat16):
        qc, kc, vc = (t.to(dtype) for t in (q, k, v))
        kwc = {n: (t.to(dtype) if isinstance(t, torch.Tensor) and t.is_floating_point() else t) for n, t in kw.items()}
        ref = _run(*(t.double() for t in (qc, kc, vc)), mod, backend="math", enable_gqa=True, **kw)
        base = _run(qc, kc, vc, mod, backend="math", enable_gqa=True, **kwc)
        cand = _run(qc, kc, vc, mod, backend="chunked", enable_gqa=True, **kwc)
        assert_within_rule(cand[0], base[0], ref[0], dtype, what=f"{name} {masks} {dtype} out")
        assert max_err(cand[1], ref[1]) <= 2 * max_err(base[1], ref[1]) + 1e-5 * max(1.0, float(ref[1].detach()[torch.isfinite(ref[1])].abs().max()))
        for i, (gc, gb, gr) in enumerate(zip(cand[2], base[2], ref[2])):
            assert_within_rule(gc, gb, gr, dtype, factor=3.0, what=f"{name} {masks} {dtype} grad {i}")


@pytest.mark.parametrize("backend", ["math", "chunked", "auto"])
@pytest.mark.parametrize("masks", ["none", "causal", "padding", "bool_mask"])
def test_sinks_match_the_float64_reference(backend, masks):
    q, k, v = make_qkv(b=2, hq=H, hk=1, nq=33, nk=47, d=8, dtype=torch.float32)
    kw = mask_kwargs(masks, 2, H, 33, 47)
    sinks = torch.randn(H).requires_grad_()
    ref_out, ref_lse = qkv.attention_ref(q, k, v, sinks=sinks.detach(), enable_gqa=True, return_lse=True, **kw)
    ref = _run(*(t.double() for t in (q, k, v)), None, sinks.detach().double().requires_grad_(), backend="math", enable_gqa=True, **kw)
    assert max_err(ref[0], ref_out) < 1e-10 and max_err(ref[1], ref_lse) < 1e-10
    base = _run(q, k, v, None, sinks, backend="math", enable_gqa=True, **kw)
    cand = _run(q, k, v, None, sinks, backend=backend, enable_gqa=True, **kw)
    assert_within_rule(cand[0], base[0], ref[0], torch.float32, what="out")
    assert max_err(cand[1], ref[1]) <= 2 * max_err(base[1], ref[1]) + 1e-5
    for i, (gc, gb, gr) in enumerate(zip(cand[2], base[2], ref[2])):
        assert_within_rule(gc, gb, gr, torch.float32, factor=3.0, what=f"grad {i}")


def test_sinks_semantics():
    """Weights sum to 1/(1 + e^(sink - lse)); a row that sees nothing outputs 0 with lse = sink;
    a sink of -inf changes nothing."""
    q, k, v = make_qkv(b=1, hq=2, nq=5, nk=6, d=4, dtype=torch.float64)
    sinks = torch.tensor([0.5, -float("inf")], dtype=torch.float64)
    kp = torch.tensor([[False] * 6])
    out, lse = qkv.attention(q, k, v, key_padding_mask=kp, sinks=sinks, return_lse=True, backend="chunked")
    assert torch.equal(out, torch.zeros_like(out))
    assert torch.equal(lse[0, 0], torch.full((5,), 0.5, dtype=torch.float64)) and torch.isneginf(lse[0, 1]).all()
    plain, plain_lse = qkv.attention(q, k, v, return_lse=True)
    out, lse = qkv.attention(q, k, v, sinks=sinks, return_lse=True)
    torch.testing.assert_close(out[:, 1], plain[:, 1])
    keep = torch.sigmoid(plain_lse[:, 0] - 0.5)
    torch.testing.assert_close(out[:, 0], plain[:, 0] * keep[..., None])
    torch.testing.assert_close(lse[:, 0], torch.logaddexp(plain_lse[:, 0], torch.tensor(0.5, dtype=torch.float64)))
    w = qkv.attention_weights(q, k, sinks=sinks)
    torch.testing.assert_close(w[:, 0].sum(-1), keep)


def test_sinks_gradient_where_a_row_and_its_sink_are_empty():
    q, k, v = make_qkv(b=1, hq=2, nq=3, nk=4, d=4, dtype=torch.float64, requires_grad=True)
    sinks = torch.tensor([-float("inf"), 1.0], dtype=torch.float64, requires_grad=True)
    kp = torch.zeros(1, 4, dtype=torch.bool)
    for backend in ("math", "chunked"):
        out, lse = qkv.attention(q, k, v, key_padding_mask=kp, sinks=sinks, return_lse=True, backend=backend)
        (out.sum() + torch.where(torch.isneginf(lse), 0.0, lse).sum()).backward()
        for t in (q, k, v, sinks):
            assert torch.isfinite(t.grad).all(), backend
            t.grad = None


def test_score_mod_with_every_mask_and_gqa_and_empty_rows():
    """Every existing argument keeps working: rows left empty by masks are 0 with lse -inf."""
    q, k, v = make_qkv(b=2, hq=4, hk=2, nq=20, nk=20, d=8, dtype=torch.float64)
    for kind in ("bool_mask", "bool_mask_causal", "causal_window"):
        kw = mask_kwargs(kind, 2, 4, 20, 20)
        ref_out, ref_lse = qkv.attention_ref(q, k, v, score_mod=Softcap(3.0), enable_gqa=True, return_lse=True, **kw)
        for backend in ("math", "chunked"):
            out, lse = qkv.attention(q, k, v, score_mod=Softcap(3.0), enable_gqa=True, return_lse=True, backend=backend, **kw)
            assert max_err(out, ref_out) < 1e-10 and max_err(lse, ref_lse) < 1e-10, (kind, backend)
            assert torch.isfinite(out).all()


def test_prefix_lm_and_document_mask_as_masks_with_a_score_function():
    """attention-gym's prefix-LM and document masks given as bool masks, next to a softcap."""
    n, prefix = 48, 16
    pos = torch.arange(n)
    prefix_lm = (pos[:, None] >= pos[None, :]) | (pos[None, :] < prefix)
    docs = _doc_ids(n)
    document = (docs[:, None] == docs[None, :]) & (pos[:, None] >= pos[None, :])
    q, k, v = make_qkv(b=1, hq=H, nq=n, d=8, dtype=torch.float64)
    for mask in (prefix_lm, document):
        ref = qkv.attention_ref(q, k, v, attn_mask=mask, score_mod=Softcap(4.0))
        for backend in ("math", "chunked"):
            assert max_err(qkv.attention(q, k, v, attn_mask=mask, score_mod=Softcap(4.0), backend=backend), ref) < 1e-10


def test_the_order_is_score_mod_then_float_mask():
    """A float attn_mask is added after the score function: a softcap does not squash it."""
    q, k, v = make_qkv(b=1, hq=1, nq=4, nk=4, d=4, dtype=torch.float64)
    bias = torch.full((4, 4), 100.0, dtype=torch.float64).triu(1)  # +100 on the future keys
    w = qkv.attention_weights(q, k, attn_mask=bias, score_mod=Softcap(1.0))
    assert float(w[0, 0, 0, 1:].sum()) > 0.99  # the bias dominates: it was not capped to 1
    scores = (q @ k.transpose(-1, -2) / 2.0).tanh() + bias
    torch.testing.assert_close(w, torch.softmax(scores, -1))


def test_builtins_agree_with_their_callable_form_and_with_flex_contract():
    """A built-in called as FlexAttention calls a score_mod (one element at a time) gives the
    same score as qkv's broadcast evaluation."""
    mods = {n: m for n, m in _mods().items() if isinstance(m, ScoreMod)}
    s = torch.randn(2, H, 6, 9, dtype=torch.float64)
    b, h = torch.arange(2).view(2, 1, 1, 1), torch.arange(H).view(1, H, 1, 1)
    qi, kj = torch.arange(6).view(1, 1, 6, 1), torch.arange(9).view(1, 1, 1, 9)
    for name, mod in mods.items():
        whole = mod(s, b, h, qi, kj)
        for idx in [(0, 0, 0, 0), (1, 3, 5, 8), (0, 2, 4, 1)]:
            one = mod(s[idx], *(torch.tensor(i) for i in idx))
            torch.testing.assert_close(one, whole[idx], msg=name)


def test_t5_buckets_match_transformers():
    t5 = pytest.importorskip("transformers.models.t5.modeling_t5")
    rel = torch.arange(-300, 300)
    for bidirectional, buckets, dist in ((True, 32, 128), (False, 32, 128), (True, 16, 40)):
        ours = relative_buckets(rel, buckets, dist, bidirectional)
        theirs = t5.T5Attention._relative_position_bucket(rel, bidirectional=bidirectional, num_buckets=buckets, max_distance=dist)
        assert torch.equal(ours, theirs), (bidirectional, buckets, dist)


def test_alibi_slopes_match_bloom():
    bloom = pytest.importorskip("transformers.models.bloom.modeling_bloom")
    for heads in (1, 4, 6, 12, 16, 20):
        mask = torch.ones(1, 5)
        alibi = bloom.build_alibi_tensor(mask, heads, torch.float32)  # (heads, 1, 5): slope · position
        torch.testing.assert_close(alibi[:, 0, 1], alibi_slopes(heads))


def test_python_score_mod_stays_linear_in_memory():
    """A plain Python function runs tile by tile: no tensor of Nq × Nk scores, forward or backward."""
    n = 2048
    q, k, v = make_qkv(b=1, hq=1, nq=n, d=16, dtype=torch.float32, requires_grad=True)
    slope = torch.tensor(0.01, requires_grad=True)
    with LargestAllocation() as big:
        out = qkv.attention(q, k, v, is_causal=True, score_mod=lambda s, b, h, i, j: s + slope * (j - i), backend="chunked")
        out.sum().backward()
    assert big.biggest < n * n // 4, big.biggest
    assert slope.grad is not None and torch.isfinite(slope.grad)


def test_auto_picks_a_backend_that_runs_the_function():
    q, k, v = make_qkv(b=1, hq=H, nq=300, d=16, dtype=torch.float32)
    ref = qkv.attention_ref(q, k, v, is_causal=True, score_mod=Softcap(5.0))
    out = qkv.attention(q, k, v, is_causal=True, score_mod=Softcap(5.0))
    assert max_err(out, ref) < 1e-5


# ---- bad input ------------------------------------------------------------------------------


def test_bad_score_functions_and_sinks_are_refused_with_the_argument_named():
    q, k, v = make_qkv(b=1, hq=H, nq=8, d=8)
    with pytest.raises(TypeError, match="score_mod must be callable"):
        qkv.attention(q, k, v, score_mod=3.0)
    with pytest.raises(TypeError, match=r"five positional arguments"):
        qkv.attention(q, k, v, score_mod=lambda s, b: s)
    with pytest.raises(ValueError, match="score_mod returned shape"):
        qkv.attention(q, k, v, score_mod=lambda s, b, h, i, j: s[..., :1, :2].repeat(1, 1, 1, 3, 1), backend="math")
    with pytest.raises(TypeError, match="score_mod returned"):
        qkv.attention(q, k, v, score_mod=lambda s, b, h, i, j: 1.0, backend="math")
    with pytest.raises(ValueError, match="ALiBi has 3 slopes but the call has 4 query heads"):
        qkv.attention(q, k, v, score_mod=ALiBi(alibi_slopes(3)))
    with pytest.raises(ValueError, match="RelativeBias table has 2 heads"):
        qkv.attention(q, k, v, score_mod=RelativeBias(torch.zeros(32, 2)))
    with pytest.raises(ValueError, match="cap must be a finite positive"):
        Softcap(0.0)
    with pytest.raises(ValueError, match=r"sinks has shape \(3\) but the call has 4 query heads"):
        qkv.attention(q, k, v, sinks=torch.zeros(3))
    with pytest.raises(TypeError, match="sinks must be a float tensor"):
        qkv.attention(q, k, v, sinks=torch.zeros(H, dtype=torch.long))
    with pytest.raises(ValueError, match="NaN or \\+inf"):
        qkv.attention(q, k, v, sinks=torch.tensor([0.0, float("nan"), 0.0, 0.0]))


def test_backends_without_score_functions_give_their_reason():
    q, k, v = make_qkv(b=1, hq=H, nq=8, d=8)
    with pytest.raises(BackendError, match="score_mod is not supported"):
        qkv.attention(q, k, v, score_mod=Softcap(2.0), backend="sdpa")
    with pytest.raises(BackendError, match="sinks"):
        qkv.attention(q, k, v, sinks=torch.zeros(H), backend="sdpa")
    reasons = BACKENDS["triton"].not_supported_reasons(
        qkv.call.validate(q, k, v, score_mod=lambda s, b, h, i, j: s)  # type: ignore[attr-defined]
    )
    assert any("score_mod" in r for r in reasons)


def test_float16_inputs_with_score_functions():
    q, k, v = make_qkv(b=1, hq=H, nq=70, d=16, dtype=torch.float16)
    mod = ALiBi(alibi_slopes(H))
    ref = qkv.attention_ref(q, k, v, is_causal=True, score_mod=mod)
    base = qkv.attention(q, k, v, is_causal=True, score_mod=mod, backend="math")
    out = qkv.attention(q, k, v, is_causal=True, score_mod=mod, backend="chunked")
    assert out.dtype == torch.float16
    assert_within_rule(out, base, torch.as_tensor(ref), torch.float16, what="fp16 out")
    assert max_err(base, ref) < 10 * FLOOR[torch.float16]
    assert np.isfinite(out.float().numpy()).all()
