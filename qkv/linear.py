"""Linear attention: ``φ(Q)(φ(K)ᵀV)`` normalised by ``φ(Q)·Σφ(K)``, in O(N) time and memory.

Shape legend::

    ...  batch dims (e.g. B, H)   Nq / Nk  query / key length   D head dim
    Dv   value dim                F  features of φ (D for elu/relu, num_features for favor)

The definition, with the N × N matrix written out, is :func:`qkv.reference.linear.linear_steps`;
this module computes the same numbers without that matrix:

- **non-causal**: the ``(F, Dv)`` state ``φ(K)ᵀV`` and the ``(F,)`` normaliser ``Σ_j φ(k_j)``
  once, then one product per query: O(N·F·Dv);
- **causal**: chunks of ``chunk_size`` positions. Inside a chunk the small ``(C, C)`` kernel
  matrix is masked and multiplied by V; across chunks each chunk starts from the prefix sum of
  the earlier chunks' states. Time O(N·(C + Dv)·F), memory O(N·F·Dv / C). Gradients flow
  through these torch operations (no N × N either);
- **recurrent** (decoding): ``state=`` carries ``Σ φ(k_j) v_jᵀ`` and ``Σ φ(k_j)`` from earlier
  calls (:class:`LinearAttentionState`); ``return_state=True`` returns the updated one.

16-bit inputs are computed in float32 (the state sums many positions) and rounded once.
FAVOR+ features are exponentials; they are computed with a shift (each query row's maximum,
and one maximum over the keys, carried in the state) that cancels between numerator and
denominator, and ``eps`` is scaled by the same factor, so the result is exactly the
definition's, without overflow.
"""

from __future__ import annotations

import math
from dataclasses import dataclass, replace
from typing import Callable, Optional, Union

import torch
import torch.nn.functional as F
from torch import Tensor

from .reference.linear import FEATURE_MAPS, favor_projection

__all__ = ["linear_attention", "LinearAttentionState", "favor_features"]

FeatureMap = Union[str, Callable[[Tensor], Tensor]]


@dataclass
class LinearAttentionState:
    """What causal linear attention remembers of the keys seen so far (for decoding).

    ``kv`` ``(..., F, Dv)`` = Σ_j φ(k_j) v_jᵀ and ``z`` ``(..., F)`` = Σ_j φ(k_j), in float32 (or
    float64); ``length`` positions seen. For FAVOR+, ``key_shift`` ``(..., 1, 1)`` is the shift
    the stored sums were computed with (they are ``exp(-key_shift)`` times the true sums)."""

    kv: Tensor
    z: Tensor
    length: int
    key_shift: Optional[Tensor] = None

    def __repr__(self) -> str:
        return f"LinearAttentionState(kv={tuple(self.kv.shape)}, z={tuple(self.z.shape)}, length={self.length}, dtype={self.kv.dtype})"


_PROJECTIONS: dict[tuple[int, int, int], Tensor] = {}


def favor_features(d: int, num_features: int, seed: int = 0) -> Tensor:
    """FAVOR+'s random projection ``W (num_features, d)`` as a float64 tensor (cached; the same
    numbers as :func:`qkv.reference.linear.favor_projection`)."""
    key = (d, num_features, seed)
    if key not in _PROJECTIONS:
        _PROJECTIONS[key] = torch.from_numpy(favor_projection(d, num_features, seed))
    return _PROJECTIONS[key]


def _check(q: Tensor, k: Tensor, v: Tensor, is_causal: bool, state: Optional[LinearAttentionState]) -> None:
    for name, t in (("query", q), ("key", k), ("value", v)):
        if not isinstance(t, Tensor):
            raise TypeError(f"{name} must be a torch.Tensor, got {type(t).__name__}")
        if t.dim() < 2:
            raise ValueError(f"{name} must be (..., N, D), got shape {tuple(t.shape)}; for one position use {name}.unsqueeze(0)")
        if not t.is_floating_point():
            raise TypeError(f"{name} must be a floating-point tensor, got {t.dtype}")
    if not (q.dtype == k.dtype == v.dtype):
        raise TypeError(f"query, key and value must share a dtype, got {q.dtype}, {k.dtype}, {v.dtype}")
    if not (q.device == k.device == v.device):
        raise ValueError(f"query, key and value must be on one device, got {q.device}, {k.device}, {v.device}")
    if q.shape[-1] != k.shape[-1]:
        raise ValueError(f"query has head dim {q.shape[-1]} but key has {k.shape[-1]}; φ(q)·φ(k) needs the same D")
    if k.shape[-2] != v.shape[-2]:
        raise ValueError(f"key has {k.shape[-2]} positions but value has {v.shape[-2]}; every key needs one value")
    try:
        torch.broadcast_shapes(q.shape[:-2], k.shape[:-2], v.shape[:-2])
    except RuntimeError:
        raise ValueError(
            f"the batch dims of query {tuple(q.shape[:-2])}, key {tuple(k.shape[:-2])} and value {tuple(v.shape[:-2])} "
            "do not broadcast; give them the same leading dims (B, H)"
        ) from None
    if is_causal and q.shape[-2] != k.shape[-2]:
        raise ValueError(
            f"is_causal=True pairs query i with key i, but there are {q.shape[-2]} queries and {k.shape[-2]} keys; "
            "pass as many of each (earlier positions go in state=)"
        )
    if state is not None and not isinstance(state, LinearAttentionState):
        raise TypeError(f"state must be a LinearAttentionState (from return_state=True), got {type(state).__name__}")


def _phi(x: Tensor, feature_map: FeatureMap, projection: Optional[Tensor], scale: float, shift_dims: tuple[int, ...],
         valid: Optional[Tensor] = None) -> tuple[Tensor, Optional[Tensor]]:
    """φ(x) ``(..., N, F)`` in x's dtype, and for favor the shift it was computed with (the true
    features are ``φ · exp(shift)``; the maximum over ``shift_dims``, over ``valid`` rows only)."""
    if callable(feature_map):
        out = feature_map(x)
        if not isinstance(out, Tensor) or out.shape[:-1] != x.shape[:-1]:
            got = tuple(out.shape) if isinstance(out, Tensor) else type(out).__name__
            raise ValueError(f"feature_map returned {got} for input {tuple(x.shape)}; it must map (..., N, D) to (..., N, F)")
        return out.to(x.dtype), None
    if feature_map == "elu":
        return F.elu(x) + 1.0, None
    if feature_map == "relu":
        return F.relu(x), None
    xs = x * math.sqrt(scale)  # x̃, so that x̃_q·x̃_k = scale · q·k
    logits = xs @ projection.to(x).transpose(0, 1) - 0.5 * (xs * xs).sum(-1, keepdim=True)  # (..., N, m)
    ref = logits.detach()
    if valid is not None:  # padding must not set the shift of the real keys
        ref = ref.masked_fill(~valid.unsqueeze(-1), float("-inf"))
    if ref.numel():
        shift = ref.amax(dim=shift_dims, keepdim=True)
    else:
        shift = ref.new_zeros([1 if d - ref.dim() in shift_dims else s for d, s in enumerate(ref.shape)])
    shift = torch.nan_to_num(shift, nan=0.0, posinf=0.0, neginf=0.0)  # all padding, or non-finite inputs
    return torch.exp(logits - shift) / math.sqrt(projection.shape[0]), shift


def _check_options(feature_map: FeatureMap, d: int, num_features: Optional[int], eps: float, chunk_size: int,
                   scale: Optional[float], key: Tensor, key_padding_mask: Optional[Tensor]) -> int:
    """Check the keyword arguments; return FAVOR+'s number of features m (0 for other feature maps)."""
    if not (callable(feature_map) or feature_map in FEATURE_MAPS):
        raise ValueError(f"feature_map={feature_map!r} is unknown; use one of {FEATURE_MAPS} or a callable")
    favor = feature_map == "favor"
    if num_features is not None and not favor:
        raise ValueError(f"num_features={num_features} only applies to feature_map='favor' (elu/relu use F = D = {d})")
    m = 0
    if favor:
        m = num_features if num_features is not None else max(d, math.ceil(d * math.log(max(d, 2))))
        if isinstance(m, bool) or not isinstance(m, int) or m < 1:
            raise ValueError(f"num_features={num_features!r} must be a positive int (FAVOR+'s number of random features)")
    if not (isinstance(eps, (int, float)) and math.isfinite(eps) and eps > 0):
        raise ValueError(f"eps={eps!r} must be a positive finite number (it keeps empty rows at 0 instead of NaN)")
    if isinstance(chunk_size, bool) or not isinstance(chunk_size, int) or chunk_size < 1:
        raise ValueError(f"chunk_size={chunk_size!r} must be a positive int")
    if scale is not None and not (math.isfinite(scale) and scale > 0):
        raise ValueError(f"scale={scale!r} must be a positive finite number for FAVOR+ (exp(scale · q·k) is what it estimates)")
    if key_padding_mask is not None:
        if not isinstance(key_padding_mask, Tensor) or key_padding_mask.dtype != torch.bool:
            raise TypeError("key_padding_mask must be a bool tensor (..., Nk) with True = a real key")
        if key_padding_mask.shape[-1:] != key.shape[-2:-1]:
            raise ValueError(f"key_padding_mask has shape {tuple(key_padding_mask.shape)}; its last dim must be Nk = {key.shape[-2]}")
    return m


def linear_attention(
    query: Tensor,
    key: Tensor,
    value: Tensor,
    *,
    feature_map: FeatureMap = "elu",
    is_causal: bool = False,
    num_features: Optional[int] = None,
    eps: float = 1e-6,
    seed: int = 0,
    scale: Optional[float] = None,
    key_padding_mask: Optional[Tensor] = None,
    chunk_size: int = 64,
    state: Optional[LinearAttentionState] = None,
    return_state: bool = False,
) -> Union[Tensor, tuple[Tensor, LinearAttentionState]]:
    """Linear attention ``φ(Q)(φ(K)ᵀV) / (φ(Q)·Σφ(K) + eps)``; see the module docstring.

    Args:
        query: ``(..., Nq, D)``; the batch dims of query, key and value broadcast.
        key: ``(..., Nk, D)``.
        value: ``(..., Nk, Dv)``.
        feature_map: ``"elu"`` (elu + 1), ``"relu"``, ``"favor"`` (FAVOR+ random features that
            approximate softmax attention with ``scale``, default 1/√D), or a callable
            ``(..., N, D) → (..., N, F)`` returning non-negative features.
        is_causal: query i sees keys 0..i (needs Nq == Nk; earlier positions come from ``state``).
        num_features: FAVOR+'s m (default ``ceil(D · ln D)``, at least D); favor only.
        eps: added to the denominator (> 0), so rows whose features vanish give 0, not NaN.
        seed: FAVOR+'s projection seed (the same seed gives the same features everywhere).
        key_padding_mask: bool ``(..., Nk)``, True = a real key; padding contributes nothing.
        chunk_size: positions per chunk of the causal form.
        state: continue from an earlier call's :class:`LinearAttentionState`.
        return_state: also return the updated state, as ``(out, new_state)``.

    Returns ``(..., Nq, Dv)`` in the input dtype (and the state when ``return_state``).
    """
    _check(query, key, value, is_causal, state)
    d = query.shape[-1]
    m = _check_options(feature_map, d, num_features, eps, chunk_size, scale, key, key_padding_mask)
    favor = m > 0
    compute = torch.float32 if query.dtype in (torch.float16, torch.bfloat16) else query.dtype
    q, k, v = query.to(compute), key.to(compute), value.to(compute)
    projection = favor_features(d, m, seed) if favor else None
    sc = 1.0 / math.sqrt(d) if scale is None else float(scale)

    fq, fk, q_shift, k_shift, state = _features(q, k, feature_map, projection, sc, key_padding_mask, state)
    kv0 = z0 = None
    if state is not None:
        kv0, z0 = state.kv.to(compute), state.z.to(compute)
    if is_causal:
        num, den, kv_all, z_all = _causal(fq, fk, v, chunk_size, kv0, z0)
    else:
        kv_all = fk.transpose(-1, -2) @ v  # (..., F, Dv)
        z_all = fk.sum(-2)  # (..., F)
        if kv0 is not None:
            kv_all, z_all = kv_all + kv0, z_all + z0
        num = fq @ kv_all  # (..., Nq, Dv)
        den = (fq @ z_all.unsqueeze(-1)).squeeze(-1)  # (..., Nq)
    eps_t = torch.tensor(eps, dtype=compute, device=q.device)
    if favor:  # the features were exp(-shift) of the true ones: scale eps alike
        eps_t = eps * torch.exp(-(q_shift.squeeze(-1) + k_shift.squeeze(-1)))
    out = (num / (den + eps_t).unsqueeze(-1)).to(query.dtype)
    if not return_state:
        return out
    length = (0 if state is None else state.length) + key.shape[-2]
    return out, LinearAttentionState(kv_all, z_all, length, k_shift if favor else None)


def _features(q: Tensor, k: Tensor, feature_map: FeatureMap, projection: Optional[Tensor], sc: float,
              key_padding_mask: Optional[Tensor], state: Optional[LinearAttentionState]
              ) -> tuple[Tensor, Tensor, Optional[Tensor], Optional[Tensor], Optional[LinearAttentionState]]:
    """φ(q) ``(..., Nq, F)``, φ(k) ``(..., Nk, F)`` (padding zeroed), their FAVOR+ shifts, and the state
    rescaled to the keys' new shift."""
    favor = projection is not None
    # FAVOR+ shifts: per query row (cancels in the ratio), one for all keys of a batch entry
    fq, q_shift = _phi(q, feature_map, projection, sc, (-1,))
    key_dims = (-2, -1)
    k_shift_given = None if state is None else state.key_shift
    fk, k_shift = _phi(k, feature_map, projection, sc, key_dims, key_padding_mask)
    if favor and k_shift_given is not None:  # one shift for the stored sums and the new keys
        new = torch.maximum(k_shift_given, k_shift)
        fk = fk * torch.exp(k_shift - new)
        state = replace(state, kv=state.kv * torch.exp(k_shift_given - new), z=state.z * torch.exp(k_shift_given - new)[..., 0], key_shift=new)
        k_shift = new
    if key_padding_mask is not None:
        fk = fk * key_padding_mask.unsqueeze(-1).to(fk.dtype)  # (..., Nk, F)
    return fq, fk, q_shift, k_shift, state


def _causal(fq: Tensor, fk: Tensor, v: Tensor, c: int, kv0: Optional[Tensor], z0: Optional[Tensor]) -> tuple[Tensor, Tensor, Tensor, Tensor]:
    """Chunked causal form: numerator (..., N, Dv), denominator (..., N), final state (kv, z)."""
    batch = torch.broadcast_shapes(fq.shape[:-2], fk.shape[:-2], v.shape[:-2])
    n, f, dv = fq.shape[-2], fq.shape[-1], v.shape[-1]
    fq, fk, v = fq.expand(*batch, n, f), fk.expand(*batch, n, f), v.expand(*batch, n, dv)
    nc = -(-n // c) if n else 0
    pad = nc * c - n
    if pad:  # zero features at the padded positions: they add nothing to any sum
        fq, fk, v = (F.pad(t, (0, 0, 0, pad)) for t in (fq, fk, v))
    fq_c = fq.reshape(*batch, nc, c, f)  # (..., nc, C, F)
    fk_c = fk.reshape(*batch, nc, c, f)
    v_c = v.reshape(*batch, nc, c, dv)  # (..., nc, C, Dv)
    tril = torch.ones(c, c, dtype=torch.bool, device=fq.device).tril()
    a = (fq_c @ fk_c.transpose(-1, -2)).masked_fill(~tril, 0.0)  # (..., nc, C, C): φ(q_i)·φ(k_j), j ≤ i in the chunk
    num = a @ v_c  # (..., nc, C, Dv)
    den = a.sum(-1)  # (..., nc, C)
    kv_c = fk_c.transpose(-1, -2) @ v_c  # (..., nc, F, Dv): each chunk's own state
    z_c = fk_c.sum(-2)  # (..., nc, F)
    # exclusive prefix sums (the chunks before each one), shifted rather than subtracted: exact
    kv_before = F.pad(torch.cumsum(kv_c, dim=-3), (0, 0, 0, 0, 1, 0))[..., :-1, :, :]  # (..., nc, F, Dv)
    z_before = F.pad(torch.cumsum(z_c, dim=-2), (0, 0, 1, 0))[..., :-1, :]  # (..., nc, F)
    if kv0 is not None:
        kv_before = kv_before + kv0.unsqueeze(-3)
        z_before = z_before + z0.unsqueeze(-2)
    num = num + fq_c @ kv_before
    den = den + (fq_c @ z_before.unsqueeze(-1)).squeeze(-1)
    kv_all = kv_c.sum(-3) if kv0 is None else kv_c.sum(-3) + kv0
    z_all = z_c.sum(-2) if z0 is None else z_c.sum(-2) + z0
    num = num.reshape(*batch, nc * c, dv)[..., :n, :]
    den = den.reshape(*batch, nc * c)[..., :n]
    return num, den, kv_all, z_all
