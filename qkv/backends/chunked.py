"""``chunked``: exact attention by online softmax over key blocks, in plain torch ops.

The score matrix is visited tile by tile (``block_q`` query rows × ``block_k`` keys), so the
extra memory is ``O(block_q · block_k)`` per head on top of the ``O(N · D)`` inputs and
outputs — never ``Nq × Nk``. Tiles that the causal/window rules mask completely are skipped,
so the cost of sliding-window attention falls with the window.

Forward (per query block, running over key blocks)::

    m  = max(m, rowmax(S))                 running maximum (an actual score: see below)
    P  = exp(S - m)                        unnormalised weights of this tile
    l  = l · exp(m_old - m) + rowsum(P)    running denominator
    O  = O · exp(m_old - m) + P · V        running numerator
    out = O / l,  lse = m + log(l)         (out = 0, lse = -inf for an empty row)

Backward recomputes each tile from the saved ``m`` and ``l`` instead of storing weights::

    P̃ = exp(S - m)  (= P · l);  dV += P̃ᵀ (dO / l);  dP̃ = (dO / l) Vᵀ
    dS = P̃ ∘ (dP̃ - δ / l),  δ = rowsum(dO ∘ O) - dlse;  dQ += dS K · scale;  dK += dSᵀ Q · scale

Precision (float32 gradients as accurate as a float32 softmax's, even with logits in the
hundreds or one key taking all the weight):

- ``m`` is a score that was actually computed, and the backward computes the same tile
  products, so ``S - m`` is exact near the maximum, where the weights are large. ``m`` and ``l``
  are kept apart rather than folded into one ``lse``: an lse of 300 has an ulp of 3e-5, which
  ``exp(S - lse)`` would pass on to every weight.
- Tiles hold the raw products ``q·kᵀ`` and the scale multiplies only ``S - m``, so no rounded
  ``scale · log2 e`` stretches the large scores (exponentials are ``exp2``, about three times
  cheaper than ``exp`` on a CPU). With a float ``attn_mask`` tiles hold ``q·kᵀ·scale + bias``
  in natural units, rounded exactly as the math path rounds them.
- ``l`` is a pairwise ``sum``, not a ones column in the matmul (BLAS sums sequentially).
- Where one key holds more than half of a row's weight, its ``dS`` is recomputed from
  ``v_j - O_i`` (see :func:`.online_softmax.chunked_backward`).

Heads are processed in groups small enough that a tile (``1 MiB`` of float32 scores across
the group) stays in cache for the elementwise pass. 16-bit inputs are computed in float32
and rounded once. A negative or zero scale moves into the query first
(:meth:`AttentionCall.positive_scale`), so the row maximum of ``q·kᵀ`` is the largest score.
Differences from ``math``: no dropout, and no gradient to a float ``attn_mask``.

Calls without gradients on a CPU (and without a float ``attn_mask``, score function or sinks)
run on torch's fused flash kernel instead, dispatched block by block under the same rules
(:mod:`.flash_cpu`): the same tiles skipped, at the speed of torch's vectorised kernel. Calls
with gradients on a CPU (no ``attn_mask``), and calls with a built-in score function or sinks
with or without them, run the forward and backward below as C loops over cache-sized tiles
with torch's own BLAS (:mod:`.chunked_native`): the same tiles, units and precision measures
(a built-in's softcap and offset bias applied to each tile in C); the torch formulation here
stays their reference, and runs a score function given as a Python callable. The loops here are torch custom ops, so
``torch.compile`` keeps a call in one graph without tracing into them.

A block-sparse layout (:class:`qkv.sparse.BlockSparseMask`) is walked by its row blocks
(:func:`.tiles.layout_rows`): each is a call of its own over the keys of its blocks, gathered
into one buffer where they are not adjacent — the C loops where the blocks need no mask or a
band (a rule inside them), the torch formulation for the tiles that need another — and the
keys' gradients are added back to their places. No ``Nq × Nk`` mask is built.

Where each part lives: the loops in :mod:`.online_softmax`, their autograd (custom ops, a
``vmap`` rule for ``torch.func``) in :mod:`.chunked_autograd`, the block-sparse walk in
:mod:`.layout_walk`, the choice of CPU kernel in :mod:`.dispatch`; this module is the backend.
"""

from __future__ import annotations

from typing import Optional

import torch

from ..call import AttentionCall, compute_dtype
from ..elementwise import runs_on_tiles
from ..masks.tiles import MaskTiles
from ..sinks import add_sinks, grouped_sinks
from .base import Backend, follow_rule
from .chunked_autograd import ChunkedAttention, scored_attention
from .decode_cpu import decode_attention
from .dispatch import chunked_kernel
from .flash_cpu import fused_attention
from .layout_walk import layout_attention, walks_layout
from .tiles import check_tile_size, plan_tiles

__all__ = ["ChunkedBackend"]


class ChunkedBackend(Backend):
    NAME = "chunked"
    DESCRIPTION = "online softmax over key blocks in torch; O(N·block) extra memory; recomputing backward"
    SUPPORTS_DROPOUT = False
    SUPPORTS_GENERATOR = False
    SUPPORTS_MASK_GRAD = False
    SCORE_MODS = "any"
    SUPPORTS_SINKS = True

    def __init__(self, block_q: Optional[int] = None, block_k: Optional[int] = None) -> None:
        self.block_q, self.block_k = check_tile_size("block_q", block_q), check_tile_size("block_k", block_k)

    def extra_reasons(self, call: AttentionCall) -> list[str]:
        if call.score_mod is None or call.builtin_score or torch._C._functorch.peek_interpreter_stack() is None:
            return []
        if call.score_reads:
            return [
                "under torch.func transforms (grad, jacrev, vmap) the tensors a Python score_mod reads cannot receive "
                "gradients tile by tile; use loss.backward(), a built-in from qkv.score_mods, or backend='math'"
            ]
        if not runs_on_tiles(call.score_mod, (call.batch_size, call.hq, call.nq, call.nk), compute_dtype(call.dtype)):
            return [  # torch.vmap inside the tile loops' autograd.Function under a transform: torch refuses
                "under torch.func transforms a score_mod written per element (mapped with torch.vmap) cannot run inside "
                "the tile loops; write it on broadcasting index tensors, use loss.backward(), or backend='math'"
            ]
        return []

    def kernel(self, call: AttentionCall) -> str:
        """Which of chunked's kernels runs ``call`` (:data:`.dispatch.KERNELS`), all under the same
        tile rules: ``"decode"`` (:mod:`.decode_cpu`), ``"flash_cpu"`` (torch's fused kernel block
        by block, :mod:`.flash_cpu`) or ``"tiles"``: the tile loops — torch custom ops run as C
        loops (:mod:`.chunked_native`) where those have the dtype and device, else the torch
        formulation here; a score function given as a Python callable is applied tile by tile
        in torch (:func:`_scored_attention`). Tile sizes of one's own choosing always get the tiles."""
        return chunked_kernel(call, default_tiles=self.block_q is None and self.block_k is None)

    def forward(self, call: AttentionCall) -> tuple[torch.Tensor, Optional[torch.Tensor]]:
        kernel = self.kernel(call)
        if kernel == "decode":
            return decode_attention(call)  # no gradient; the kernel's own check, or qkv.attention's guard
        if kernel == "flash_cpu":
            return follow_rule(call, *fused_attention(call))  # no gradient: torch's fused kernel, block by block
        # every kernel's backward (C loops, torch formulation, layout walk, dense batched formula)
        # computes what its tiles give; follow_rule then adds the rule's NaN (qkv.nonfinite)
        return follow_rule(call, *self._tiled(call))

    def _tiled(self, call: AttentionCall) -> tuple[torch.Tensor, Optional[torch.Tensor]]:
        """``(out, lse or None)`` from the tile loops (or the layout walk), before the rule."""
        query, scale = call.positive_scale()  # the row maximum of q·kᵀ must be the largest score
        # the tiles compute in float32 anyway; with gradients, upcast before the broadcast so that
        # a shared tensor's gradient is summed in float32 (call.grouped_qkv)
        q, k, v = call.grouped_qkv(query, upcast=call.requires_grad and call.device.type == "cpu")
        if walks_layout(call):
            out, lse = layout_attention(call, q, k, v, scale, (self.block_q, self.block_k))
        else:
            out, lse = self._tile_attention(call, q, k, v, scale)
        if call.sinks is not None:
            out, lse = add_sinks(out, lse, grouped_sinks(call.sinks, call.hk, call.group))
        return call.ungroup(out.to(call.dtype)), (call.ungroup(lse.to(call.lse_dtype)) if call.return_lse else None)

    def _tile_attention(self, call: AttentionCall, q, k, v, scale: float) -> tuple[torch.Tensor, torch.Tensor]:
        """(out, lse) in the grouped layout from the tile loops (custom ops, or the scored loop)."""
        tiles = MaskTiles.from_call(call)
        lo, hi = tiles.positional.band()
        span = None  # how many consecutive keys a row can see at most, where a band limits them
        if q.device.type == "cpu" and (lo is not None or hi is not None):  # measured on CPUs only
            span = hi - lo + 1 if lo is not None and hi is not None else call.nk
        plan = plan_tiles(*q.shape[:3], call.nq, call.nk, self.block_q, self.block_k, span)
        if tiles.score is None or tiles.score.form is not None:  # no score function, or a built-in: the custom ops
            rel = None if tiles.score is None else tiles.score.form.rel  # type: ignore[union-attr]
            out, lse, _, _ = ChunkedAttention.apply(q, k, v, tiles, scale, plan, rel)
            return out, lse
        return scored_attention(q, k, v, tiles, scale, plan)
