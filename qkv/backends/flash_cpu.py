"""torch's fused CPU flash kernel, dispatched block by block under qkv's mask rules.

``aten._scaled_dot_product_flash_attention_for_cpu`` is torch's fastest CPU attention: an
online softmax over key blocks with vectorised exponentials and no ``Nq × Nk`` matrix, which
also returns the log-sum-exp. It knows only top-left causality. qkv's other rules are
expressed to it one row block at a time:

- the rows ``[q0, q1)`` are given only the keys ``[k_lo, k_hi)`` their band can reach, so the
  cost of a sliding window is proportional to the window, not to ``Nk``;
- inside that range the band is either top-left causal (``is_causal=True``, no mask at all) or
  needs an ``(R, k_hi - k_lo)`` additive mask of 0 and −inf, a view of one template;
- a band with no left edge that starts above the diagonal (bottom-right causal with Nq < Nk)
  is two unmasked calls over all rows: the keys every row sees, then top-left causality over
  the rest, merged through their log-sum-exps;
- key padding whose True entries form a prefix (ragged lengths) trims each batch entry's keys
  to its length; any other padding becomes a broadcast ``(B, 1, 1, Nk)`` mask. Under
  ``torch.compile`` padding always takes the broadcast mask, which needs no host sync;
- a block-sparse layout (:class:`qkv.sparse.BlockSparseMask`) is walked block by block
  (:func:`layout_forward`): each row block is given only the keys of its layout blocks, with no
  mask at all unless a rule inside the blocks, a head-varying layout or the band needs one for
  that small tile; no ``Nq × Nk`` mask is built or read;
- a bool ``attn_mask`` tensor is read once to find its non-empty 128 × 128 blocks, and each row
  block is given only the keys of those blocks (:func:`sparse_forward`), with no mask at all
  where those blocks are wholly True.

Apart from that merge, one call per row block means each row's output and log-sum-exp are
the kernel's own, as precise as torch SDPA's. This path serves calls without gradients:
torch's CPU backward recomputes the weights from the rounded log-sum-exp, which misses qkv's
accuracy rule where one key takes most of a row's weight (float32 dV up to 30× the rule's
bound), so gradient calls take the chunked backend's own loop.

Requirements of the kernel, checked by :func:`can_fuse` or met here: CPU tensors, value head
dim equal to the query head dim, no empty size (it divides by them), last dims of stride 1, a
float mask of the query's dtype; shared key/value heads are read through a stride-0 head dim.
It reports log-sum-exp 0 for a row with nothing to attend to; qkv's −inf is restored from the
rules (:func:`empty_rows`) or the mask.
"""

from __future__ import annotations

from typing import Optional

import torch

from ..call import AttentionCall, accumulate_dtype
from ..masks.tiles import additive_mask, prefix_lengths
from ..masks.rules import PositionalMask
from .tiles import SparseRows, gather_buffer, layout_groups, layout_rows, pick, pick_index

_flash = torch.ops.aten._scaled_dot_product_flash_attention_for_cpu

# Rows per kernel call where the positional rules need row blocks. A call covers its rows'
# whole key range, so a sliding window of width w costs (64 + w) keys per row instead of w;
# measured on a 2-core AVX-512 CPU (1 thread, D = 64, N = 4096, window 128/256/512): 64 rows
# 35/50/86 ms, 32 rows 47/51/83, 128 rows 43/55/89, 256 rows 58/70/107.
BLOCK_ROWS = 64


def can_fuse(call: AttentionCall) -> bool:
    """Can :func:`fused_attention` run this call? CPU, no gradient, no float ``attn_mask``,
    dropout, score function or sinks, equal query and value head dims, and no empty size (the kernel divides by them),
    and no lse asked of 16-bit inputs (:func:`lse_misses_rule`). A bool ``attn_mask`` shared by
    the key/value heads' query groups, or given per query head, is dispatched block-sparsely."""
    return (
        call.device.type == "cpu"
        and not call.requires_grad
        and not lse_misses_rule(call)
        and _mask_fits(call)
        and call.dropout_p == 0.0
        and call.score_mod is None
        and call.sinks is None
        and call.dv == call.d
        and call.batch_size * call.hq * call.nq * call.nk * call.d > 0
    )


def lse_misses_rule(call: AttentionCall) -> bool:
    """Does torch's fused CPU kernel miss the accuracy rule on this call's lse? For float16 and
    bfloat16 inputs it does: its lse is off by up to 1.8e-5 where the math path and the tile
    loops (float32 arithmetic on the upcast inputs) stay within 6e-7 (measured on 2 × 4 heads ×
    300 × 400 × 64 random inputs, 5 seeds); float32 inputs match (5.7e-7). The tile loops take
    0.65–0.68× torch's time for float16 and 1.08–1.29× for bfloat16 (bench/results/lse_cpu.md)."""
    return call.return_lse and call.dtype in (torch.float16, torch.bfloat16)


def _mask_fits(call: AttentionCall) -> bool:
    """No mask, a block-sparse layout (walked by :func:`layout_forward`; under ``torch.compile``
    its dense mask instead), or a bool mask :func:`_grouped_bool_mask` can view."""
    if call.block_sparse is not None and not torch.compiler.is_compiling():
        return True
    mask = call.attn_mask  # the dense mask
    return mask is None or (mask.dtype == torch.bool and _grouped_bool_mask(call) is not None)


def _grouped_bool_mask(call: AttentionCall) -> Optional[torch.Tensor]:
    """The bool attn_mask as a view broadcastable to the kernel layout of :func:`fused_attention`
    (``(B, H, Nq, Nk)``, or ``(B·Hk, G, Nq, Nk)`` for shared key/value heads); None where that
    would copy the mask (a per-batch mask shared by grouped heads)."""
    m = call.grouped_attn_mask()  # (B|1, Hk|1, G|1, Nq, Nk)
    if m is None:
        return None
    if call.group == 1:
        return m[:, :, 0]
    if m.shape[1] > 1:  # per query head: (B|1, Hk, G) → (B·Hk | Hk...) only without a batch dim mismatch
        return m.reshape(m.shape[0] * m.shape[1], call.group, call.nq, call.nk) if m.shape[0] == call.batch_size else None
    return m[:, 0] if m.shape[0] == 1 else None


def fused_attention(call: AttentionCall) -> tuple[torch.Tensor, Optional[torch.Tensor]]:
    """Run a call that :func:`can_fuse` on torch's kernel; returns (out, lse or None) in the caller's layout."""
    query, scale = call.positive_scale()
    q, k, v = call.grouped_qkv(query)  # (B, Hk, G, Nq, D), (B, Hk, 1, Nk, ·)
    kp = call.grouped_key_padding()
    if call.block_sparse is not None and not torch.compiler.is_compiling():  # (no host syncs under compile)
        groups = layout_groups(call)  # one walk per distinct layout
        if groups != [None]:
            out = q.new_empty(*q.shape[:4], call.dv)
            lse = q.new_empty(q.shape[:4], dtype=accumulate_dtype(q.dtype))
        for sel in groups:
            qs, ks, vs, kps = (pick(t, sel) for t in (q, k, v, kp))
            q4, k4, v4, pad = _kernel_layout(qs, ks, vs, kps)
            o, s = layout_forward(q4, k4, v4, layout_rows(call, sel=sel), pad, scale, tuple(qs.shape[:3]))
            o, s = o.reshape(*qs.shape[:4], call.dv), s.reshape(qs.shape[:4])
            if sel is None:
                out, lse = o, s
            else:
                out[pick_index(out, sel)], lse[pick_index(lse, sel)] = o, s
    else:
        q4, k4, v4, pad = _kernel_layout(q, k, v, kp)
        if call.has_attn_mask:
            out, lse = sparse_forward(q4, k4, v4, call.positional, pad, _grouped_bool_mask(call), scale)
        else:
            out, lse = fused_forward(q4, k4, v4, call.positional, pad, scale)
        out, lse = out.reshape(*q.shape[:4], call.dv), lse.reshape(q.shape[:4])
    return call.ungroup(out.to(call.dtype)), (call.ungroup(lse.to(call.lse_dtype)) if call.return_lse else None)


def _kernel_layout(
    q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, kp: Optional[torch.Tensor]
) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor, Optional[torch.Tensor]]:
    """Grouped q ``(B, Hk, G, Nq, D)``, k/v ``(B, Hk, 1, Nk, ·)`` and padding ``(B|1, 1, 1, 1, Nk)``
    as the kernel takes them: ``(B, H, N, ·)``, or for shared key/value heads ``(B·Hk)`` batch
    entries of G heads reading one K/V by stride 0; padding ``(B|1 or B·Hk, Nk)``."""
    b, hk, g, nq, d = q.shape
    pad = None if kp is None else kp[:, 0, 0, 0, :]  # (B|1, Nk)
    if g == 1:
        return q[:, :, 0], k[:, :, 0], v[:, :, 0], pad  # (B, H, N, ·)
    q4 = q.reshape(b * hk, g, nq, d)
    k4, v4 = (t.reshape(b * hk, 1, *t.shape[3:]).expand(-1, g, -1, -1) for t in (k, v))
    if pad is not None and pad.shape[0] > 1:
        pad = pad.repeat_interleave(hk, 0)  # (B·Hk, Nk)
    return q4, k4, v4, pad


def _kernel(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, causal: bool, mask: Optional[torch.Tensor], scale: float):
    # the kernel reads a last dim of stride != 1 wrongly; row slices and head expansion are fine
    q, k, v = (t if t.stride(-1) == 1 else t.contiguous() for t in (q, k, v))
    return _flash(q, k, v, 0.0, causal, attn_mask=mask, scale=scale)


def _empty_result(q: torch.Tensor, v: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """out 0 and lse −inf (the kernel's lse dtype) for rows that no kernel call reaches."""
    return q.new_zeros(*q.shape[:3], v.shape[3]), torch.full(q.shape[:3], float("-inf"), dtype=accumulate_dtype(q.dtype), device=q.device)


def _band_template(
    pm: PositionalMask, calls: list[tuple[int, int, int, int, bool]], dtype: torch.dtype, device: torch.device
) -> tuple[torch.Tensor, int]:
    """One additive mask ``(R, X)`` from which every masked call slices its own ``(R, w)`` view.

    The band depends only on ``j - i``, so a call's mask is a column window of one Toeplitz
    template: entry ``[r, x]`` holds the rule for ``j - i = x - r + d0``. Returns (template, d0).
    """
    masked = [(q0, q1, k0, k1) for q0, q1, k0, k1, causal in calls if not causal and pm.block_status(q0, q1, k0, k1) != "full"]
    if not masked:
        return torch.empty(0, 0, dtype=dtype, device=device), 0
    d0 = min(k0 - q0 for q0, _, k0, _ in masked)
    width = max(k0 - q0 - d0 + k1 - k0 for q0, _, k0, k1 in masked)
    rows = max(q1 - q0 for q0, q1, _, _ in masked)
    r = torch.arange(rows, device=device)[:, None]
    x = torch.arange(width, device=device)[None, :]
    return additive_mask(pm.allowed(r, x + d0), dtype), d0


def _calls(pm: PositionalMask, nq: int, nk: int) -> list[tuple[int, int, int, int, bool]]:
    """``(q0, q1, k0, k1, causal)`` kernel calls covering the band over the first ``nk`` keys
    (fewer than ``pm.nk`` when trailing padding was trimmed). ``causal``: the band inside the
    call is exactly the kernel's top-left rule; otherwise its edges need a mask."""
    lo, hi = pm.band()
    if pm.trivial or pm.block_status(0, nq, 0, nk) == "full":
        return [(0, nq, 0, nk, False)] if nk else []
    if lo is None and hi == 0:  # top-left causal over the whole call: the kernel's own rule
        return [(0, nq, 0, nk, True)] if nk else []
    calls = []
    for q0 in range(0, nq, BLOCK_ROWS):
        q1 = min(nq, q0 + BLOCK_ROWS)
        k0, k1 = pm.key_range(q0, q1)
        k1 = min(k1, nk)
        if k0 >= k1:
            continue
        lo_free = lo is None or pm.full_key_range(q0, q1)[0] <= k0  # no row's left edge inside
        calls.append((q0, q1, k0, k1, lo_free and hi == k0 - q0))
    return calls


def empty_rows(pm: PositionalMask, nq: int, padding: Optional[torch.Tensor], device: torch.device) -> Optional[torch.Tensor]:
    """Rows with no key to attend to, ``(B|1, Nq)`` bool, from the band and the padding without
    an ``Nq × Nk`` matrix (None when no row can be empty): row i sees the real keys in
    ``[i + lo, i + hi]``, counted by a prefix sum of the padding."""
    lo, hi = pm.band()
    nk = pm.nk
    if padding is None and nk > 0 and (lo is None or hi is None):
        # A one-sided band leaves a row empty only at its far end: no ~10 small ops for that.
        if (lo is None and (hi is None or hi >= 0)) or (hi is None and nq - 1 + lo < nk):
            return None
    i = torch.arange(nq, device=device)
    first = (i + lo).clamp(0, nk) if lo is not None else torch.zeros_like(i)
    last = (i + hi + 1).clamp(0, nk) if hi is not None else torch.full_like(i, nk)
    last = torch.maximum(first, last)
    if padding is None:
        if pm.trivial and nk > 0:
            return None
        return (last == first)[None]
    count = torch.nn.functional.pad(padding.cumsum(-1), (1, 0))  # (B, Nk + 1): real keys before j
    return count[:, last] == count[:, first]


def fused_forward(
    q: torch.Tensor,
    k: torch.Tensor,
    v: torch.Tensor,
    pm: PositionalMask,
    padding: Optional[torch.Tensor],
    scale: float,
) -> tuple[torch.Tensor, torch.Tensor]:
    """q ``(B, H, Nq, D)``, k/v ``(B, H, Nk, D)`` (heads already matched), padding ``(B|1, Nk)``
    bool or None → out ``(B, H, Nq, D)``, lse ``(B, H, Nq)`` (float32, or float64 for float64 inputs; −inf for empty rows)."""
    lengths = None if padding is None else prefix_lengths(padding)
    if lengths is not None and padding.shape[0] == q.shape[0] > 1:  # each entry attends to its own prefix
        parts = [_banded(q[i : i + 1], k[i : i + 1, :, :n], v[i : i + 1, :, :n], pm, None, scale) for i, n in enumerate(lengths)]
        out, lse = torch.cat([o for o, _ in parts]), torch.cat([s for _, s in parts])
    elif lengths is not None:
        out, lse = _banded(q, k[:, :, : lengths[0]], v[:, :, : lengths[0]], pm, None, scale)
    else:
        out, lse = _banded(q, k, v, pm, padding, scale)
    empty = empty_rows(pm, q.shape[2], padding, q.device)
    if empty is not None:
        lse = lse.masked_fill(empty[:, None], float("-inf"))  # the kernel reports 0 there
    return out, lse


def _banded(
    q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, pm: PositionalMask, padding: Optional[torch.Tensor], scale: float
) -> tuple[torch.Tensor, torch.Tensor]:
    """The kernel calls of :func:`_calls` over the keys of ``k`` (a prefix of the call's)."""
    nq, nk = q.shape[2], k.shape[2]
    lo, hi = pm.band()
    if padding is None and lo is None and hi is not None and 0 < hi < nk and pm.block_status(0, nq, 0, nk) != "full":
        return _open_left(q, k, v, hi, scale)
    calls = _calls(pm, nq, nk)
    template = _band_template(pm, calls, q.dtype, q.device)

    def run(q0: int, q1: int, k0: int, k1: int, causal: bool) -> tuple[torch.Tensor, torch.Tensor]:
        mask = None
        if not causal and pm.block_status(q0, q1, k0, k1) != "full":
            x0 = k0 - q0 - template[1]
            mask = template[0][: q1 - q0, x0 : x0 + k1 - k0]  # (R, w): a view, no allocation
        if padding is not None:
            pad = additive_mask(padding[:, None, None, k0:k1], q.dtype)  # (B, 1, 1, w)
            mask = pad if mask is None else mask + pad
        return _kernel(q[:, :, q0:q1], k[:, :, k0:k1], v[:, :, k0:k1], causal, mask, scale)

    if len(calls) == 1 and calls[0][:4] == (0, nq, 0, k.shape[2]):
        return run(*calls[0])
    out, lse = _empty_result(q, v)
    for q0, q1, k0, k1, causal in calls:
        out[:, :, q0:q1], lse[:, :, q0:q1] = run(q0, q1, k0, k1, causal)
    return out, lse


def _open_left(
    q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, hi: int, scale: float
) -> tuple[torch.Tensor, torch.Tensor]:
    """The band ``j ≤ i + hi`` (``hi > 0``, no left edge: bottom-right causal with Nq < Nk) in two
    unmasked kernel calls: every row sees the keys ``[0, hi)``, and over the keys ``[hi, …)`` the
    rule is the kernel's own top-left causality. The two halves merge through their lse."""
    out_a, lse_a = _kernel(q, k[:, :, :hi], v[:, :, :hi], False, None, scale)
    out_b, lse_b = _kernel(q, k[:, :, hi:], v[:, :, hi:], True, None, scale)  # every row sees key hi
    # Both halves are non-empty, so both lse are finite: the first half's share of the row's
    # weight is sigmoid(lse_a - lse_b), and one lerp merges the outputs (three small ops
    # instead of eight: 74 vs 149 µs at B·H = 8, Nq = 256, D = 64, float32, 1 thread).
    share_a = torch.sigmoid(lse_a - lse_b).unsqueeze(-1)  # (B, H, Nq, 1)
    acc = torch.lerp(out_b.to(lse_a.dtype), out_a.to(lse_a.dtype), share_a)
    return acc.to(q.dtype), torch.logaddexp(lse_a, lse_b)


def _kernel_mask(m: torch.Tensor, b: int, hk: int, g: int) -> torch.Tensor:
    """A grouped tile mask ``(B|1, Hk|1, G|1, R|1, C)`` in the kernel layout of :func:`fused_attention`
    (``(B, H, ·, C)``, or ``(B·Hk, G, ·, C)`` for shared key/value heads), broadcast dims kept."""
    if g == 1:
        return m[:, :, 0]
    if m.shape[0] == 1 and m.shape[1] == 1:
        return m[0]
    return m.expand(b, hk, *m.shape[2:]).reshape(b * hk, *m.shape[2:])


def layout_forward(
    q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, rows: list[SparseRows], padding: Optional[torch.Tensor],
    scale: float, grouped: tuple[int, int, int],
) -> tuple[torch.Tensor, torch.Tensor]:  # fmt: skip
    """Like :func:`fused_forward` for a block-sparse layout's row blocks (:func:`.tiles.layout_rows`):
    one kernel call per row block over the keys of its blocks (a view where they are adjacent,
    else gathered), masked only where its small tile needs it. ``grouped``: the call's (B, Hk, G)."""
    out, lse = _empty_result(q, v)  # rows that no block reaches: 0 and -inf
    g = grouped[2]
    if g > 1:  # gather each shared key/value head once, then read it for its G query heads by stride 0
        k, v = k[:, :1], v[:, :1]
    kbuf, vbuf = gather_buffer(rows, k, 2), gather_buffer(rows, v, 2)
    for r in rows:
        ks, vs = r.take(k, 2, kbuf).expand(-1, q.shape[1], -1, -1), r.take(v, 2, vbuf).expand(-1, q.shape[1], -1, -1)
        allowed = None if r.mask is None else _kernel_mask(r.mask, *grouped)
        if padding is not None:
            pad = r.take(padding, 1)[:, None, None, :]  # (B|1, 1, 1, C)
            allowed = pad if allowed is None else allowed & pad
        if allowed is None:
            out[:, :, r.q0 : r.q1], lse[:, :, r.q0 : r.q1] = _kernel(q[:, :, r.q0 : r.q1], ks, vs, False, None, scale)
            continue
        o, s = _kernel(q[:, :, r.q0 : r.q1], ks, vs, False, additive_mask(allowed, q.dtype), scale)
        out[:, :, r.q0 : r.q1] = o
        lse[:, :, r.q0 : r.q1] = s.masked_fill(~allowed.any(-1), float("-inf"))  # the kernel reports 0 there
    return out, lse


# Block-sparse dispatch of a bool attn_mask: rows are taken SPARSE_ROWS at a time, and each row
# block is given only the SPARSE_COLS-wide key blocks in which its mask has some True entry
# (gathered into one contiguous K/V), so the cost follows the mask's block density.
SPARSE_ROWS = 128
SPARSE_COLS = 128
# Above this fraction of occupied blocks the mask goes to one kernel call whole: per-block calls
# and gathers cost more than the skipped blocks save. Measured at N = 4096 (1 thread, 8 heads,
# random block layouts), block dispatch ÷ one masked call: 0.33 at 23% occupied, 0.74 at 60%,
# 0.96 at 70%, 1.04 at 80%, 1.13 at 91%.
DENSE_ABOVE = 0.72


def sparse_forward(
    q: torch.Tensor,
    k: torch.Tensor,
    v: torch.Tensor,
    pm: PositionalMask,
    padding: Optional[torch.Tensor],
    attn: torch.Tensor,
    scale: float,
) -> tuple[torch.Tensor, torch.Tensor]:
    """Like :func:`fused_forward`, with a bool ``attn`` broadcastable to ``(B, H, Nq, Nk)``.

    Finding the occupied blocks reads the mask once and needs a host sync; under
    ``torch.compile`` (no syncs) the whole mask goes to one kernel call instead."""
    nq = q.shape[2]
    nk = k.shape[2]
    if torch.compiler.is_compiling():
        blocks: list[tuple[int, int, int, int, Optional[torch.Tensor]]] = [(0, nq, 0, nk, None)]
    else:
        blocks = _occupied_blocks(attn, pm, nq, nk)
    out, lse = _empty_result(q, v)
    for q0, q1, k0, k1, keys in blocks:
        if keys is None:  # one contiguous key range: views, no gather
            ks, vs, allowed = k[:, :, k0:k1], v[:, :, k0:k1], attn[..., q0:q1, k0:k1]
            keys = torch.arange(k0, k1, device=q.device)
        else:
            ks, vs, allowed = k.index_select(2, keys), v.index_select(2, keys), attn[..., q0:q1, :].index_select(-1, keys)
        if not pm.trivial:
            allowed = allowed & pm.allowed(torch.arange(q0, q1, device=q.device)[:, None], keys[None, :])
        if padding is not None:
            allowed = allowed & padding[:, None, None, :].index_select(-1, keys)
        if len(blocks) > 1 and bool(allowed.all()):  # whole blocks (a block-sparse layout): no mask to build or read
            o, s = _kernel(q[:, :, q0:q1], ks, vs, False, None, scale)
            out[:, :, q0:q1], lse[:, :, q0:q1] = o, s
            continue
        o, s = _kernel(q[:, :, q0:q1], ks, vs, False, additive_mask(allowed, q.dtype), scale)
        out[:, :, q0:q1] = o
        lse[:, :, q0:q1] = s.masked_fill(~allowed.any(-1), float("-inf"))  # the kernel reports 0 there
    return out, lse


def _occupied_blocks(attn: torch.Tensor, pm: PositionalMask, nq: int, nk: int) -> list[tuple[int, int, int, int, Optional[torch.Tensor]]]:
    """``(q0, q1, k0, k1, keys)`` per row block: the key blocks that the mask (over all batch
    entries and heads) and the positional band leave non-empty for those rows — one range
    ``[k0, k1)`` when they are adjacent (``keys`` None), else their key indices."""
    keep = attn.reshape(-1, nq, nk).any(0) if attn.numel() > nq * nk else attn.reshape(nq, nk)
    r, c = SPARSE_ROWS, SPARSE_COLS
    nr, nc = -(-nq // r), -(-nk // c)
    if nq % r or nk % c:
        keep = torch.nn.functional.pad(keep, (0, nc * c - nk, 0, nr * r - nq))
    # a max over bytes is ~4x faster than Tensor.any over these views (16384² mask: 70 vs 255 ms)
    occupied = keep.contiguous().view(torch.uint8).view(nr * r, nc, c).amax(2).view(nr, r, nc).amax(1).bool()  # (nr, nc)
    if float(occupied.float().mean()) > DENSE_ABOVE:  # skipping saves less than the calls cost
        return [(0, nq, 0, nk, None)]
    occ = occupied.tolist()  # one host sync
    blocks: list[tuple[int, int, int, int, Optional[torch.Tensor]]] = []
    for i in range(nr):
        q0, q1 = i * r, min(nq, (i + 1) * r)
        cols = [j for j in range(nc) if occ[i][j] and pm.block_status(q0, q1, j * c, min(nk, (j + 1) * c)) != "empty"]
        if not cols:
            continue
        k0, k1 = cols[0] * c, min(nk, (cols[-1] + 1) * c)
        if len(cols) == cols[-1] - cols[0] + 1:
            blocks.append((q0, q1, k0, k1, None))
        else:
            keys = torch.cat([torch.arange(j * c, min(nk, (j + 1) * c), device=attn.device) for j in cols])
            blocks.append((q0, q1, k0, k1, keys))
    return blocks
