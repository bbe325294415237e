"""Run one drawn call and judge it against the spec: the fuzz test's judge.

For a case (see :mod:`.calls`) the judge runs the call on its backend (the *candidate*), on
qkv's ``math`` backend in the same dtype (the *baseline*), through the NumPy float64 oracle
``qkv.reference.attention_ref`` on the rounded inputs, through :mod:`.ref64` for gradients,
and — when torch SDPA has all the arguments — through torch SDPA for shape and dtype.

Checks (each failed check is a :class:`Finding`; its ``kind`` groups failures):

- a named backend raising ``qkv.BackendError`` is a *refusal*, not a failure; ``auto``
  raising it, or any other exception, is a failure (a TypeError/ValueError says whether
  torch SDPA accepts the same call); an invalid call must raise the documented error;
- the call returns a tensor (or the ``(out, lse)`` pair) and leaves its arguments unchanged;
- output/lse shape and dtype: ``(..., Hq, Nq, Dv)`` in the input dtype, as torch SDPA gives
  when it takes the call; lse ``(..., Hq, Nq)`` float32 (float64 for float64 inputs);
- the NaN rule: a row is NaN (output and lse) exactly where the oracle says so; nothing
  non-finite where the oracle is finite; empty rows exactly 0 with lse ``-inf``;
- accuracy (ENGINEERING.md's rule): ``err(candidate) <= 2 · err(baseline) + floor`` for
  outputs and lse, ``3 ·`` for gradients, errors measured against the oracle (gradients:
  against :mod:`.ref64`, whose forward must match the oracle). The ``math`` backend itself
  must stay within an absolute bound of a few rounding units (:func:`error_bounds`), and its
  error enters the rule capped at that bound, so a broken baseline cannot excuse a
  candidate. For 16-bit inputs, backends that may run FlashAttention-style kernels (torch's
  SDPA kernels, triton) take the worse of math and :func:`.ref64.flash_like` (P and dS
  rounded to 16 bits) as baseline, as ENGINEERING.md asks. The floor is FLOOR[dtype] ·
  max(1, max|ref|) plus the rounding of the logits (``2 · eps_c · max|score|`` times the
  output's, or the gradient's, natural scale): float32-sized, it matters only for large
  logits and for gradients that cancel to 0. Under Triton's CPU interpreter, whose float32 →
  bfloat16 conversion truncates, triton's bf16 calls get a truncating baseline and one more
  bf16 ulp (see :func:`interpreter_truncates`);
- gradients (by ``loss.backward()`` or ``torch.func.grad``): the leaf's shape and dtype,
  finite, within the rule; a backward that raises is a failure. Gradients are checked only
  for finite inputs (the spec defines only the forward of non-finite rows). A value beyond the
  leaf's dtype is right as the infinity of its sign; a leaf passed through an expand gets its
  copies' gradients summed by torch's autograd in the leaf's dtype, outside qkv, so where one
  copy's exact gradient passes that dtype's range a non-finite sum is not held against qkv.
"""

from __future__ import annotations

import math
import re
import time
import traceback
from dataclasses import dataclass, field
from typing import Any, Optional

import numpy as np
import torch
import torch.nn.functional as F

import qkv
from qkv.reference import attention_ref

from ..device import DEVICE
from .calls import DTYPES, Inputs, Spec, build, draw, score_mod_of
from ..rounding_baseline import device_truncates, truncate_bf16
from .ref64 import attention64, flash_like

# Absolute error floors per dtype, on outputs of size ~1 (the values of tests/conftest.py).
FLOOR = {torch.float64: 1e-12, torch.float32: 1e-6, torch.float16: 5e-4, torch.bfloat16: 4e-3}
OUT_FACTOR, GRAD_FACTOR = 2.0, 3.0
# The math backend's own bound, in rounding units (see error_bounds).
MATH_ULPS, MATH_GRAD_ULPS = 4.0, 4.0
# Backends that may run FlashAttention-style kernels rounding P and dS to 16 bits (torch's
# SDPA kernels, qkv's triton kernels; auto may pick SDPA). For 16-bit inputs their baseline
# is the worse of math and :func:`.ref64.flash_like` (ENGINEERING.md: a kernel that rounds P
# or dS is compared with a same-dtype baseline that does the same). chunked computes in
# float32 and rounds once, as math does, so math alone is its baseline.
FLASH_LIKE = ("sdpa", "auto", "triton")


@dataclass
class Finding:
    kind: str  # what failed, without numbers: failures group by (kind, backend)
    backend: str
    detail: str = ""  # the numbers


@dataclass
class Result:
    seed: int
    case: str
    backend: str
    status: str = "ok"  # "ok" | "refused" | "failed"
    findings: list[Finding] = field(default_factory=list)
    refusal: list[str] = field(default_factory=list)
    describe: str = ""
    tags: list[str] = field(default_factory=list)
    size: int = 0
    seconds: float = 0.0
    log: list[str] = field(default_factory=list)  # every check with its numbers (verbose replay)

    def fail(self, kind: str, detail: str = "", backend: Optional[str] = None) -> None:
        self.findings.append(Finding(kind, backend or self.backend, detail))
        self.log.append(f"FAIL {kind} [{backend or self.backend}] {detail}")
        self.status = "failed"

    def note(self, line: str) -> None:
        self.log.append(line)

    @property
    def repro(self) -> str:
        return f"python -m tests.fuzz --seed {self.seed} --case {self.case}"

    def message(self) -> str:
        """A failure report: the findings, the call, and the one-line reproducer."""
        lines = [f"case {self.case} (seed {self.seed}): {self.describe}"]
        lines += [f"  {f.kind} [{f.backend}]: {f.detail}" for f in self.findings]
        lines.append(f"  reproduce: {self.repro}")
        return "\n".join(lines)


def normalise(text: str, limit: int = 110) -> str:
    """An exception message without its numbers, so that one bug is one group."""
    line = text.strip().splitlines()[0] if text.strip() else ""
    line = re.sub(r"\d+(\.\d+)?(e[-+]?\d+)?", "N", line)
    return line[:limit]


# ---- running qkv --------------------------------------------------------------------------


@dataclass
class Outcome:
    out: Optional[torch.Tensor] = None
    lse: Optional[torch.Tensor] = None
    grads: dict[str, Optional[torch.Tensor]] = field(default_factory=dict)
    error: Optional[BaseException] = None  # from the forward call
    backward_error: Optional[BaseException] = None
    trace: str = ""
    modified: list[str] = field(default_factory=list)  # arguments whose values the call changed
    returned: str = ""  # what came back, when it is not the documented tensor / (out, lse) pair


def _loss_weights(spec: Spec, out_shape: tuple[int, ...], lse_shape: tuple[int, ...]) -> tuple[np.ndarray, np.ndarray]:
    rng = np.random.default_rng([spec.seed, int(spec.case.startswith("t")), int(spec.case.lstrip("t")), 2])
    return rng.standard_normal(out_shape), rng.standard_normal(lse_shape)


def expected_shapes(spec: Spec) -> tuple[tuple[int, ...], tuple[int, ...]]:
    if spec.two_d:
        return (spec.nq, spec.dv), (spec.nq,)
    return (*spec.batch, spec.hq, spec.nq, spec.dv), (*spec.batch, spec.hq, spec.nq)


def lse_dtype(spec: Spec) -> torch.dtype:
    return torch.float64 if spec.dtype == "float64" else torch.float32


def call_qkv(inputs: Inputs, backend: str, return_lse: bool, grad: bool) -> Outcome:
    """Run ``qkv.attention`` for the case on ``backend``; with ``grad``, differentiate the loss
    ``Σ out·w + Σ lse·w'`` (lse term when the spec returns lse) with respect to the spec's
    leaves, by ``loss.backward()`` or by ``torch.func.grad`` as the spec says.

    triton runs on the test device (tests/device.py): the CPU leaves are copied there, inside
    the differentiated function, before the spec's views are taken, so the kernels see the
    same strides, offsets and broadcasts; what comes back is on the CPU."""
    spec = inputs.spec
    res = Outcome()
    run_on = DEVICE if backend == "triton" else "cpu"
    names = [n for n in inputs.base if grad and n in spec.grad]
    out_shape, lse_shape = expected_shapes(spec)
    w_out, w_lse = _loss_weights(spec, out_shape, lse_shape)

    def forward(leaves: dict[str, torch.Tensor], snapshot: bool = True) -> tuple[torch.Tensor, Optional[torch.Tensor]]:
        args = {name: inputs.view(name, t.to(run_on)) for name, t in leaves.items()}
        mask = args.get("mask", inputs.causal_bias)
        positional: tuple[Any, ...] = ()
        kwargs: dict[str, Any] = {}
        if spec.positional:
            positional = (mask, 0.0, spec.is_causal, spec.scale, spec.enable_gqa)
        else:
            if mask is not None:
                kwargs["attn_mask"] = mask
            if spec.is_causal is not False:
                kwargs["is_causal"] = spec.is_causal
            if spec.scale is not None:
                kwargs["scale"] = spec.scale
            if spec.enable_gqa:
                kwargs["enable_gqa"] = True
        if spec.window is not None:
            kwargs["window"] = spec.window
        if spec.window_alignment is not None:
            kwargs["window_alignment"] = spec.window_alignment
        if "kp" in args:
            kwargs["key_padding_mask"] = args["kp"]
        if return_lse:
            kwargs["return_lse"] = True
        if spec.score is not None:
            kwargs["score_mod"] = score_mod_of(spec, args.get("mod"))
        if "sinks" in args:
            kwargs["sinks"] = args["sinks"]
        before = {n: a.detach().clone() for n, a in args.items()} if snapshot else {}
        if backend == "stats":  # the output and lse of the statistics pass (qkv.inspect)
            ret = kwargs.pop("return_lse", False)
            out, st = qkv.inspect.attention_with_stats(args["q"], args["k"], args["v"], **kwargs)
            got = (out, st.lse) if ret else out
        else:
            got = qkv.attention(args["q"], args["k"], args["v"], *positional, backend=backend, **kwargs)
        for n, b in before.items():
            a = args[n].detach()
            if not (torch.equal(torch.isnan(a), torch.isnan(b)) if a.is_floating_point() else True) or not torch.equal(
                torch.nan_to_num(a) if a.is_floating_point() else a, torch.nan_to_num(b) if b.is_floating_point() else b
            ):
                res.modified.append(n)
        if return_lse:
            if isinstance(got, tuple) and len(got) == 2 and all(isinstance(t, torch.Tensor) for t in got):
                return got
            res.returned = f"{type(got).__name__} of {len(got) if isinstance(got, tuple) else '?'}"
            raise TypeError(f"return_lse=True returned {res.returned}, not (out, lse)")
        if not isinstance(got, torch.Tensor):
            res.returned = type(got).__name__
            raise TypeError(f"returned {res.returned}, not a tensor")
        return got, None

    def loss_of(out: torch.Tensor, lse: Optional[torch.Tensor]) -> torch.Tensor:
        loss = (out.cpu().double() * torch.from_numpy(w_out)).sum()
        if spec.return_lse and lse is not None:
            lse = lse.cpu()
            loss = loss + (torch.where(torch.isfinite(lse), lse, 0).double() * torch.from_numpy(w_lse)).sum()
        return loss

    def _cpu(t: Optional[torch.Tensor]) -> Optional[torch.Tensor]:
        return None if t is None else t.detach().cpu()

    leaves = {n: b.clone() for n, b in inputs.base.items()}
    if grad and spec.grad_api == "func":

        def f(*diff: torch.Tensor) -> tuple[torch.Tensor, tuple[torch.Tensor, ...]]:
            out, lse = forward({**leaves, **dict(zip(names, diff))}, snapshot=False)
            return loss_of(out, lse), ((out,) if lse is None else (out, lse))  # aux: tensors only

        try:
            grads, aux = torch.func.grad(f, argnums=tuple(range(len(names))), has_aux=True)(*(leaves[n] for n in names))
            res.out, res.lse = _cpu(aux[0]), (_cpu(aux[1]) if len(aux) > 1 else None)
            res.grads = dict(zip(names, grads))
        except qkv.BackendError as e:  # a refusal, as with loss.backward()
            res.error, res.trace = e, traceback.format_exc()
        except Exception as e:  # noqa: BLE001
            try:  # a forward that fails is reported as such; else it is the gradient that fails
                with torch.no_grad():
                    out, lse = forward(leaves)
                res.out, res.lse = _cpu(out), _cpu(lse)
                res.backward_error, res.trace = e, traceback.format_exc()
            except Exception as e2:  # noqa: BLE001
                res.error, res.trace = e2, traceback.format_exc()
        return res

    for n in names:
        leaves[n].requires_grad_(True)
    try:  # in grad mode, as a user calls it, whether or not anything requires grad
        with torch.enable_grad():
            res.out, res.lse = forward(leaves)
    except Exception as e:  # noqa: BLE001 - every exception is data for the judge
        res.error, res.trace = e, traceback.format_exc()
        return res
    shapes_ok = tuple(res.out.shape) == out_shape and not (spec.return_lse and (res.lse is None or tuple(res.lse.shape) != lse_shape))
    if grad and shapes_ok:  # (wrong shapes: the shape checks report them)
        try:
            if not res.out.requires_grad:
                raise RuntimeError("the output does not require grad although an input does")
            loss_of(res.out, res.lse).backward()
            res.grads = {n: leaves[n].grad for n in names}
        except Exception as e:  # noqa: BLE001
            res.backward_error, res.trace = e, traceback.format_exc()
    res.out, res.lse = _cpu(res.out), _cpu(res.lse)
    return res


def call_sdpa(inputs: Inputs) -> tuple[Optional[torch.Tensor], Optional[BaseException]]:
    """torch SDPA on the same arguments (only for calls made of SDPA's arguments)."""
    spec = inputs.spec
    args = {n: inputs.view(n, b.clone()) for n, b in inputs.base.items()}
    mask = args.get("mask", inputs.causal_bias)
    try:
        with torch.no_grad():
            return F.scaled_dot_product_attention(
                args["q"], args["k"], args["v"], mask, 0.0, bool(spec.is_causal), scale=spec.scale, enable_gqa=spec.enable_gqa
            ), None
    except Exception as e:  # noqa: BLE001
        return None, e


def backend_reasons(e: BaseException) -> list[str]:
    """The reasons a BackendError lists (one per ``  - `` line)."""
    lines = [ln.strip()[2:] for ln in str(e).splitlines() if ln.strip().startswith("- ")]
    return lines or [str(e).splitlines()[0] if str(e) else type(e).__name__]


# ---- the references ----------------------------------------------------------------------


def _ref_args(inputs: Inputs, leaves: Optional[dict[str, torch.Tensor]] = None) -> tuple[list[Any], dict[str, Any]]:
    """Logical (expanded) float64 q, k, v and the mask keyword arguments of the references."""
    spec = inputs.spec
    src = leaves if leaves is not None else {n: b.double() if b.is_floating_point() else b for n, b in inputs.base.items()}
    qkv_ = [inputs.logical(n, src[n]) for n in ("q", "k", "v")]
    kw: dict[str, Any] = {"is_causal": spec.is_causal, "scale": spec.scale, "enable_gqa": True}
    if "mask" in src:
        kw["attn_mask"] = inputs.logical("mask", src["mask"])
    elif inputs.causal_bias is not None:
        kw["attn_mask"] = inputs.causal_bias
    if "kp" in src:
        kw["key_padding_mask"] = inputs.logical("kp", src["kp"])
    if spec.window is not None:
        kw["window"] = spec.window
    if spec.window_alignment is not None:
        kw["window_alignment"] = spec.window_alignment
    if spec.score is not None:
        kw["score_mod"] = score_mod_of(spec, src.get("mod"))
    if "sinks" in src:
        kw["sinks"] = src["sinks"]
    return qkv_, kw


def oracle(inputs: Inputs) -> tuple[np.ndarray, np.ndarray]:
    (q, k, v), kw = _ref_args(inputs)
    out, lse = attention_ref(q, k, v, return_lse=True, **kw)
    return np.asarray(out, dtype=np.float64), np.asarray(lse, dtype=np.float64)


def interpreter_truncates(spec: Spec) -> bool:
    """Triton 3.6's CPU interpreter converts float32 to bfloat16 by truncation (a GPU rounds to
    nearest), so under it the triton kernels' bf16 results sit up to one ulp toward zero; the
    flash-like baseline of such a call truncates too, and the rule's floor grows by one bf16
    ulp of the natural scale (truncating a weight just below 1 costs a whole ulp, which the
    baseline's natural-log arithmetic does not reproduce bit for bit)."""
    return spec.backend == "triton" and device_truncates(spec.torch_dtype)


def ref64_grads(inputs: Inputs, flash: bool = False) -> tuple[torch.Tensor, torch.Tensor, dict[str, torch.Tensor]]:
    """Forward and gradients of the case's loss in float64 (:mod:`.ref64`), with the loss
    weights rounded as the candidate's backward sees them.

    ``flash``: the same through :func:`.ref64.flash_like` (16-bit arithmetic of a
    FlashAttention kernel), gradients rounded to the leaves' dtypes."""
    spec = inputs.spec
    work = torch.float32 if flash else torch.float64
    leaves = {
        n: (b.detach().to(work, copy=True).requires_grad_(n in spec.grad) if b.is_floating_point() else b)
        for n, b in inputs.base.items()
    }
    (q, k, v), kw = _ref_args(inputs, leaves)
    kw.pop("enable_gqa")
    logical = {"q": q, "k": k, "v": v, "mask": kw.get("attn_mask") if "mask" in leaves else None}
    for t in logical.values():
        if isinstance(t, torch.Tensor) and t.requires_grad:
            t.retain_grad()  # each copy's gradient, for a leaf the call sees through an expand
    keep: dict[str, Any] = {}
    truncate = flash and interpreter_truncates(spec)
    if flash:
        out, lse = flash_like(q, k, v, spec.torch_dtype, truncate=truncate, **kw)
    else:
        out, lse = attention64(q, k, v, enable_gqa=spec.enable_gqa, keep=keep, **kw)
    out_shape, lse_shape = expected_shapes(spec)
    w_out, w_lse = _loss_weights(spec, out_shape, lse_shape)
    dtype = spec.torch_dtype
    loss = (out * torch.from_numpy(w_out).to(dtype).to(work)).sum()
    if spec.return_lse:
        # the candidate's loss takes the lse where it is finite in its own dtype: an lse beyond
        # float32's range is inf there (and out of the loss), so it is out of this one too
        held = torch.isfinite(lse) & (lse.abs() <= torch.finfo(lse_dtype(spec)).max)
        loss = loss + (torch.where(held, lse, 0) * torch.from_numpy(w_lse).to(lse_dtype(spec)).to(work)).sum()
    if loss.requires_grad:
        loss.backward()
    grads = {n: (leaves[n].grad if leaves[n].grad is not None else torch.zeros_like(leaves[n])) for n in spec.grad}
    if flash:
        grads = {n: (truncate_bf16(g) if truncate else g).to(inputs.base[n].dtype) for n, g in grads.items()}
    for n in spec.grad:
        t = logical.get(n)
        if isinstance(t, torch.Tensor) and t.grad is not None and inputs.layout(n).expand:
            # torch's autograd sums the copies' gradients in the leaf's dtype (outside qkv): where a
            # copy's passes that dtype's range, the sum of ±inf copies may be NaN
            big = (t.grad.abs() > torch.finfo(inputs.base[n].dtype).max).to(torch.float64)
            grads[f"{n}:copies_overflow"] = big.sum_to_size(inputs.base[n].shape) > 0
    if keep:
        dout = torch.from_numpy(w_out).to(dtype).double()
        dlse = torch.from_numpy(w_lse).to(lse_dtype(spec)).double() if spec.return_lse else None
        for n, t in natural_scales(spec, inputs, keep, out.detach(), dout, dlse).items():
            grads[f"{n}:scale"] = t
    return out.detach(), lse.detach(), grads


def natural_scales(
    spec: Spec, inputs: Inputs, keep: dict[str, Any], out: torch.Tensor, dout: torch.Tensor, dlse: Optional[torch.Tensor]
) -> dict[str, torch.Tensor]:
    """For each gradient, the root-sum-square of the terms that make it up.

    Rounding errors scale with these, not with the gradient itself, which may cancel to 0
    (a one-key window gives dS = P·(dP - δ) = 0; a mask broadcast along keys gets Σ_j dS = 0).
    With ``|dS| ≤ P ∘ (|dO||V|ᵀ + rowsum(|dO||O|) + |dlse|)`` and ``‖·‖`` the root of the
    summed squares over what each gradient element sums::

        dq: |scale|·max(‖dS·K‖, (rowsum(|dO||O|) + |dlse|)·P·|K|)
        dk: |scale|·‖dSᵀ·Q‖   dv: ‖Pᵀ·dO‖   dmask: ‖dS‖

    (dq's second term: a row's δ error is one number for all its keys, see below.)
    """
    q, k, v, p = keep["q"], keep["k"], keep["v"], keep["p"]
    if spec.two_d:
        out, dout = out[None], dout[None]
        dlse = None if dlse is None else dlse[None]
    do = dout.abs()
    ds = torch.matmul(do, v.abs().transpose(-1, -2)) + (do * out.abs()).sum(-1, keepdim=True)
    if dlse is not None:
        ds = ds + dlse.abs()[..., None]
    ds2 = (p * ds) ** 2
    hq, hk = spec.hq, spec.hk

    def fold(t: torch.Tensor) -> torch.Tensor:  # query heads -> key/value heads (GQA)
        if not spec.two_d and hq != hk and hk:
            t = t.unflatten(-3, (hk, hq // hk)).sum(-3)
        return t

    def to_leaf(t: torch.Tensor, name: str) -> torch.Tensor:  # sums of squares -> root
        shape = inputs.base[name].shape
        if spec.two_d and t.dim() == len(shape) + 1:
            t = t.sum(0)
        return t.sum_to_size(shape).sqrt()

    scale = abs(keep["scale"])
    # an error in a row's δ = rowsum(dO∘O) (or its lse) moves every dS_ij of the row the same
    # way, so in dq_i = scale·Σ_j dS_ij k_j it adds up over the row's keys instead of averaging
    # out: |scale|·row·Σ_j P_ij |k_j|, which the root-sum-square above underrates by up to the
    # square root of the keys a row spreads over (FlashAttention-style backwards compute δ so)
    row = (do * out.abs()).sum(-1, keepdim=True) + (0.0 if dlse is None else dlse.abs()[..., None])
    coherent = (row * torch.matmul(p, k.abs())) ** 2  # squared, as to_leaf sums squares
    scales = {
        "q": scale * to_leaf(torch.maximum(torch.matmul(ds2, k**2), coherent), "q"),
        "k": scale * to_leaf(fold(torch.matmul(ds2.transpose(-1, -2), q**2)), "k"),
        "v": to_leaf(fold(torch.matmul((p**2).transpose(-1, -2), do**2)), "v"),
    }
    if "mask" in inputs.base and inputs.base["mask"].is_floating_point():
        scales["mask"] = to_leaf(ds2, "mask")
    if "mod" in inputs.base:  # a slope or bias entry sums dS times offsets up to max(Nq, Nk)
        reach = float(max(spec.nq, spec.nk, 1))
        scales["mod"] = (reach * ds2.sum().sqrt()).expand(inputs.base["mod"].shape)
    if "sinks" in inputs.base:  # dsink = Σ_rows P_sink · (dlse - δ): bounded by the rows' terms
        rows = (do * out.abs()).sum(-1) + (0.0 if dlse is None else dlse.abs())
        scales["sinks"] = (rows**2).sum().sqrt().expand(inputs.base["sinks"].shape)
    return scales


# ---- measuring ----------------------------------------------------------------------------


def _np(t: torch.Tensor) -> np.ndarray:
    return t.detach().double().cpu().numpy()


def max_abs(a: np.ndarray) -> float:
    a = a[np.isfinite(a)]
    return float(np.abs(a).max()) if a.size else 0.0


def beyond_range(got: np.ndarray, ref: np.ndarray, dtype: torch.dtype) -> np.ndarray:
    """Where the exact value lies beyond ``dtype``'s largest finite number and ``got`` is the
    infinity of its sign: overflow is the right answer there (an lse of 1e39 in float32)."""
    big = np.isfinite(ref) & (np.abs(ref) > float(torch.finfo(dtype).max))
    return big & np.isinf(got) & (np.sign(got) == np.sign(ref))


def error(got: np.ndarray, ref: np.ndarray) -> float:
    """Max |got - ref| where the reference is finite; inf if got is not finite there."""
    fin = np.isfinite(ref)
    if not fin.any():
        return 0.0
    g, r = got[fin], ref[fin]
    if not np.isfinite(g).all():
        return math.inf
    return float(np.abs(g - r).max())


def _eps(dtype: torch.dtype) -> float:
    return float(torch.finfo(dtype).eps)


@dataclass
class Bounds:
    """Error allowances for one case (see :func:`error_bounds`)."""

    out: float  # the math backend's absolute bound on the output
    lse: float  # ... and on the lse
    rel: float  # relative rounding of a score in the compute dtype, worst case
    logit: float  # eps_c · (max|score| + 1): what rounding a score costs a weight, relatively
    vmax: float


def error_bounds(inputs: Inputs, ref_lse: np.ndarray) -> Bounds:
    """What rounding alone may cost, for the math backend's bound and for the rule's floor.

    Scores are computed in ``c`` = float32 (16-bit inputs) or the input dtype; a score
    ``s = scale·q·k + bias`` carries an error of at most about ``eps_c·(sqrt(D)·C + |bias|)``
    where ``C = |scale|·max Σ|q_d k_d|``; the softmax and the weighted sum add
    ``eps_c·sqrt(Nk)``; the output is rounded once to the input dtype (``eps``). With
    ``V = max|v|``, the math backend must stay within::

        out: V · (eps + MATH_ULPS · r)    lse: MATH_ULPS · (r + eps_lse · max|lse|)

    (rounding the output to nearest costs at most ``eps/2 · V``; ``eps · V`` leaves a margin).
        r = eps_c · (sqrt(D)·C + max|bias| + sqrt(Nk) + 4)

    ``max|bias|`` counts a float mask's largest entry and the score function's largest bias
    (:func:`score_bias_bound`), which ``max|s|`` below includes too.

    ``logit = eps_c · (max|s| + 1)`` is the unavoidable relative error of a weight
    ``exp(s - m)`` once ``s`` is rounded: with large logits (scale 10, or a mask offset of
    100) any two correct implementations differ by this much, so the rule's floor includes
    ``2 · logit`` times the output's (or gradient's) natural scale. It is float32-small for
    16-bit inputs and does not cover rounding a float32 mask to 16 bits.
    """
    spec = inputs.spec
    dtype = spec.torch_dtype
    eps = _eps(dtype)
    eps_c = _eps(torch.float32) if dtype in (torch.float16, torch.bfloat16) else eps
    (q, k, v), kw = _ref_args(inputs)
    qn, kn = (np.nan_to_num(_np(t), nan=0.0, posinf=0.0, neginf=0.0) for t in (q, k))
    if not spec.two_d and spec.hq != spec.hk and spec.hk:
        kn = np.repeat(kn, spec.hq // spec.hk, axis=-3)
    scale = 1.0 / math.sqrt(spec.d) if spec.scale is None else spec.scale
    if qn.size and kn.size:
        cond = abs(scale) * float(np.matmul(np.abs(qn), np.swapaxes(np.abs(kn), -1, -2)).max())
        scores = scale * np.matmul(qn, np.swapaxes(kn, -1, -2))
    else:
        cond, scores = 0.0, np.zeros(0)
    bias = kw.get("attn_mask") if "mask" in inputs.base else None  # (never a CausalBias)
    max_bias = 0.0
    if bias is not None and bias.is_floating_point():
        b = _np(bias)
        max_bias = max_abs(b)
        if scores.size:
            scores = scores + np.where(np.isfinite(b), b, 0.0)
    mod_bias = score_bias_bound(spec, inputs)
    max_bias += mod_bias
    r = eps_c * (math.sqrt(spec.d) * cond + max_bias + math.sqrt(spec.nk) + 4)
    vmax = max(max_abs(_np(v)), 1e-3)
    return Bounds(
        out=vmax * (eps + MATH_ULPS * r),
        lse=MATH_ULPS * (r + _eps(lse_dtype(spec)) * max_abs(ref_lse)),
        rel=r,
        logit=eps_c * (max_abs(scores) + mod_bias + 1),
        vmax=vmax,
    )


def score_bias_bound(spec: Spec, inputs: Inputs) -> float:
    """The largest bias a score function adds to a score (0 for none, and for softcapping, which
    only shrinks scores): ALiBi ``|slope| · max offset``, a relative-bias table's largest entry,
    the offset-bias function's table plus its cosine term."""
    table = inputs.base.get("mod")
    if spec.score is None or spec.score == "softcap" or table is None or not table.numel():
        return 0.0
    top = max_abs(_np(table))
    if spec.score == "alibi":
        return top * max(spec.nq, spec.nk)
    return top + (0.25 if spec.score == "fn" else 0.0)


# ---- the checks ---------------------------------------------------------------------------


def _check_values(res: Result, what: str, got: torch.Tensor, ref: np.ndarray, row_ref_lse: np.ndarray, backend: str) -> Optional[float]:
    """NaN rule, non-finite values, empty rows; returns the error where both are finite.

    ``what`` is "out" (rows along the last dim) or "lse"; ``row_ref_lse`` is the oracle's lse
    (``-inf`` marks an empty row, NaN a NaN row). A value beyond the dtype's range counts as
    right when it is the infinity of its sign (:func:`beyond_range`), and leaves the error out."""
    g = _np(got)
    overflow = beyond_range(g, ref, got.dtype)
    ref = np.where(overflow, np.nan, ref)  # judged here, and left out of the error below
    if what == "out":
        nan_row = np.isnan(row_ref_lse)
        empty_row = np.isneginf(row_ref_lse)
        g_rows_nan = np.isnan(g).all(-1) if g.shape[-1] else np.ones(g.shape[:-1], bool)
        bad_nan = nan_row & ~g_rows_nan
        fin_ref = np.isfinite(ref)
        nonfinite = fin_ref & ~np.isfinite(g)
        zero_ok = (g == 0).all(-1) if g.shape[-1] else np.ones(g.shape[:-1], bool)
        bad_empty = empty_row & ~zero_ok & np.isfinite(g).all(-1)
    else:
        bad_nan = np.isnan(ref) & ~np.isnan(g) & ~overflow
        empty = np.isneginf(ref)
        bad_empty = empty & ~np.isneginf(g) & ~np.isnan(g)
        fin_ref = np.isfinite(ref)
        nonfinite = (fin_ref & ~np.isfinite(g)) | (empty & np.isnan(g))
    if bad_nan.any():
        must = int(np.isnan(row_ref_lse if what == "out" else ref).sum())
        res.fail(f"NaN rule: {what} row not NaN", f"{int(bad_nan.sum())} of {must} rows that must be NaN are not", backend)
    if nonfinite.any():
        res.fail(f"non-finite {what} where the oracle is finite", f"{int(nonfinite.sum())} of {int(nonfinite.size)} elements", backend)
    if bad_empty.any():
        res.fail(
            f"empty row: {what} not {'exactly 0' if what == 'out' else '-inf'}",
            f"{int(bad_empty.sum())} of {int(np.isneginf(row_ref_lse).sum())} empty rows; "
            f"e.g. {g[bad_empty][0] if what == 'lse' else max_abs(g[bad_empty])}",
            backend,
        )
    both = fin_ref & np.isfinite(g)
    return float(np.abs(g[both] - ref[both]).max()) if both.any() else 0.0


def _floor(dtype: torch.dtype, ref: np.ndarray) -> float:
    return FLOOR[dtype] * max(1.0, max_abs(ref))


def judge(spec: Spec) -> Result:
    """Run and judge one case."""
    t0 = time.perf_counter()
    res = Result(spec.seed, spec.case, spec.backend, describe=spec.describe(), tags=spec.tags(), size=spec.size)
    try:
        _judge(spec, res)
    except Exception as e:  # noqa: BLE001 - a harness crash is reported, never hidden
        res.fail("harness error", f"{type(e).__name__}: {normalise(str(e))}", "harness")
        res.note(traceback.format_exc())
    res.seconds = time.perf_counter() - t0
    return res


def _judge(spec: Spec, res: Result) -> None:
    inputs = build(spec)
    dtype = spec.torch_dtype
    want_grad = bool(spec.grad)
    cand = call_qkv(inputs, spec.backend, spec.return_lse, want_grad)

    if spec.expect:
        if cand.error is None:
            res.fail(f"accepts an invalid call (must raise {spec.expect})")
        elif type(cand.error).__name__ != spec.expect and not (spec.expect == "ValueError" and isinstance(cand.error, ValueError)):
            res.fail(f"raises {type(cand.error).__name__} instead of {spec.expect}", normalise(str(cand.error)))
        else:
            res.note(f"raises {spec.expect} as it must: {str(cand.error).splitlines()[0]}")
        return

    sdpa_out, sdpa_error = call_sdpa(inputs) if spec.sdpa_compatible else (None, None)
    if cand.modified:
        res.fail("modifies its arguments", ", ".join(sorted(set(cand.modified))))
    if cand.returned:
        res.fail("returns the wrong type", cand.returned)
        return
    if cand.error is not None:
        e = cand.error
        res.note(cand.trace)
        if isinstance(e, qkv.BackendError) and spec.backend != "auto":
            res.status = "refused"
            res.refusal = backend_reasons(e)
            res.note(f"refused: {res.refusal}")
            return
        if isinstance(e, qkv.BackendError):
            res.fail("auto raises BackendError", normalise("; ".join(backend_reasons(e))))
        elif isinstance(e, (TypeError, ValueError)) and sdpa_out is not None:
            res.fail(f"rejects a call torch SDPA accepts: {type(e).__name__}: {normalise(str(e))}")
        else:
            res.fail(f"raises {type(e).__name__}: {normalise(str(e))}")
        return

    # shapes and dtypes
    out_shape, lse_shape = expected_shapes(spec)
    out = cand.out
    assert out is not None
    if tuple(out.shape) != out_shape:
        res.fail("wrong output shape", f"{tuple(out.shape)}, want {out_shape}")
    if out.dtype != dtype:
        res.fail("wrong output dtype", f"{out.dtype}, want {dtype}")
    if sdpa_out is not None and (sdpa_out.shape != out.shape or sdpa_out.dtype != out.dtype):
        if tuple(sdpa_out.shape) != out_shape and sdpa_out.dtype == out.dtype:
            res.note(f"torch SDPA's own shape {tuple(sdpa_out.shape)} breaks broadcasting (want {out_shape}); not held against qkv")
        else:
            res.fail(
                "output shape/dtype differs from torch SDPA",
                f"{tuple(out.shape)} {out.dtype} vs SDPA {tuple(sdpa_out.shape)} {sdpa_out.dtype}",
            )
    if sdpa_out is not None:
        sdpa_says = f"SDPA gives {tuple(sdpa_out.shape)} {sdpa_out.dtype}"
    else:
        sdpa_says = f"SDPA: {type(sdpa_error).__name__ if sdpa_error else 'not asked'}"
    res.note(f"out {tuple(out.shape)} {out.dtype}; {sdpa_says}")
    lse_ok = True
    if spec.return_lse:
        lse = cand.lse
        if lse is None or tuple(lse.shape) != lse_shape:
            res.fail("wrong lse shape", f"{None if lse is None else tuple(lse.shape)}, want {lse_shape}")
            lse_ok = False
        elif lse.dtype != lse_dtype(spec):
            res.fail("wrong lse dtype", f"{lse.dtype}, want {lse_dtype(spec)}")
    if tuple(out.shape) != out_shape:
        return

    # the baselines: qkv's math backend in the same dtype, on the same call; for kernels that
    # may round P and dS to 16 bits, also FlashAttention's arithmetic (see FLASH_LIKE)
    base: Optional[Outcome] = None
    if spec.backend != "math":
        base = call_qkv(inputs, "math", True, want_grad)
        if base.error is not None or base.backward_error is not None:
            res.note(f"baseline math failed: {base.error or base.backward_error!r}; judging against the absolute bound")
            if base.error is not None:
                base = None
    flash = None
    # (auto never runs a score function or sinks on a kernel that rounds P: SDPA refuses them)
    if spec.backend in FLASH_LIKE and dtype in (torch.float16, torch.bfloat16) and not spec.nonfinite and spec.score is None and not spec.sinks:
        flash = ref64_grads(inputs, flash=True)

    ref_out, ref_lse = oracle(inputs)
    if ref_out.shape != out_shape or ref_lse.shape != lse_shape:
        res.fail("oracle result has the wrong shape", f"out {ref_out.shape}, lse {ref_lse.shape}; want {out_shape}, {lse_shape}", "reference")
        if ref_out.size != math.prod(out_shape) or ref_lse.size != math.prod(lse_shape):
            return
        ref_out, ref_lse = ref_out.reshape(out_shape), ref_lse.reshape(lse_shape)
    bounds = error_bounds(inputs, ref_lse)
    res.note(f"math bounds: out {bounds.out:.3e}  lse {bounds.lse:.3e}  (r = {bounds.rel:.3e})")

    def rule(
        what: str, err: float, ref: np.ndarray, base_t: Optional[torch.Tensor], flash_t: Optional[torch.Tensor],
        bound: float, factor: float, natural: float,
    ) -> None:
        """err <= factor · baseline error + floor; math itself: err <= bound.

        floor = FLOOR[dtype] · max(1, max|ref|) + 2 · logit · natural (see error_bounds)."""
        if spec.backend == "math":
            res.note(f"{what}: err {err:.3e}  math bound {bound:.3e}")
            if err > bound:
                res.fail(f"{what} error beyond the math bound", f"err {err:.3e} > bound {bound:.3e}")
            return
        eb = error(_np(base_t), ref) if base_t is not None and tuple(base_t.shape) == ref.shape else math.inf
        used = min(eb, bound)  # a broken baseline excuses nothing
        ef = error(_np(flash_t), ref) if flash_t is not None and tuple(flash_t.shape) == ref.shape else None
        if ef is not None:
            used = max(used, ef)
        # the lse is float32 (float64) whatever the inputs: its floor is that dtype's
        floor = _floor(lse_dtype(spec) if what == "lse" else dtype, ref) + 2 * bounds.logit * natural
        if what != "lse" and interpreter_truncates(spec):
            floor += _eps(dtype) * natural  # the kernels' P and results may each lose an ulp
        limit = factor * used + floor
        also = "" if ef is None else f", flash-like err {ef:.3e}"
        res.note(f"{what}: err {err:.3e}  math err {eb:.3e} (bound {bound:.3e}){also}  limit {limit:.3e}")
        if err > limit:
            res.fail(f"{what} error beyond the rule", f"err {err:.3e} > {factor:g}·{used:.3e} + {floor:.1e} (math err {eb:.3e}{also})")

    err = _check_values(res, "out", out, ref_out, ref_lse, spec.backend)
    rule("out", err, ref_out, None if base is None else base.out, None if flash is None else flash[0], bounds.out, OUT_FACTOR, bounds.vmax)
    if spec.return_lse and lse_ok and cand.lse is not None:
        err = _check_values(res, "lse", cand.lse, ref_lse, ref_lse, spec.backend)
        rule("lse", err, ref_lse, None if base is None else base.lse, None if flash is None else flash[1], bounds.lse, OUT_FACTOR, 1.0)

    if not want_grad:
        return
    if cand.backward_error is not None:
        e = cand.backward_error
        res.note(cand.trace)
        res.fail(f"backward raises {type(e).__name__}: {normalise(str(e))}")
        return
    r_out, r_lse, r_grads = ref64_grads(inputs)
    # the two references must agree, or the harness is wrong
    for what, a, b in (("out", r_out, ref_out), ("lse", r_lse, ref_lse)):
        d = error(_np(a), b)
        if d > 1e-9 * max(1.0, max_abs(b)):
            res.fail(f"harness: ref64 {what} disagrees with the oracle", f"{d:.3e}", "reference")
    for name in spec.grad:
        g = cand.grads.get(name)
        leaf = inputs.base[name]
        r = _np(r_grads[name])
        if g is None:
            g = torch.zeros_like(leaf)  # not reached: a zero gradient
            res.note(f"d{name}: None (taken as 0)")
        if tuple(g.shape) != tuple(leaf.shape) or g.dtype != leaf.dtype:
            res.fail(f"wrong d{name} shape/dtype", f"{tuple(g.shape)} {g.dtype}, want {tuple(leaf.shape)} {leaf.dtype}")
            continue
        gn = _np(g)
        r = np.where(beyond_range(gn, r, leaf.dtype), np.nan, r)  # overflowing to ±inf is right there
        copies = r_grads.get(f"{name}:copies_overflow")
        if copies is not None:  # summed ±inf copies (ref64_grads): not judged
            r = np.where(copies.numpy() & ~np.isfinite(gn), np.nan, r)
        nonfinite = np.isfinite(r) & ~np.isfinite(gn)
        if nonfinite.any():
            res.fail(f"non-finite d{name}", f"{int(nonfinite.sum())} of {gn.size} elements")
            continue
        err = error(gn, r)
        # math's gradient: rounded once to the leaf's dtype, after float32 (or float64) work
        # whose relative error is about bounds.rel per score (amplified through dS)
        nat = r_grads.get(f"{name}:scale")  # absent when no key is attended at all
        natural = max(max_abs(r), 0.0 if nat is None else max_abs(_np(nat)))
        compute = torch.float32 if spec.torch_dtype in (torch.float16, torch.bfloat16) else spec.torch_dtype
        # below the smallest normal number of the compute dtype or of the leaf's (a float32 mask
        # on float64 inputs) the terms are subnormal and keep only a few bits (a sink that takes
        # all but e^-100 of a row leaves gradients near 1e-41, or 1e-46 rounded to the leaf)
        tiny = max(torch.finfo(compute).tiny, torch.finfo(leaf.dtype).tiny)
        bound = MATH_GRAD_ULPS * (_eps(leaf.dtype) * max_abs(r) + bounds.rel * natural + tiny)
        if _eps(leaf.dtype) > _eps(compute):
            # a leaf coarser than the scores (a float32 mask on float64 inputs, a 16-bit mask):
            # autograd rounds each term to the leaf's dtype before summing the terms that a
            # broadcast (expanded) leaf receives, so its error follows the terms, not their sum
            bound += MATH_GRAD_ULPS * _eps(leaf.dtype) * natural
        bg = None
        if base is not None and base.backward_error is None:
            bg = base.grads.get(name)
            if bg is None:
                bg = torch.zeros_like(leaf)
        fg = None if flash is None else flash[2].get(name)
        rule(f"d{name}", err, r, bg, fg, bound, GRAD_FACTOR, natural)


def run(seed: int, case: str | int) -> Result:
    """Draw and judge case ``case`` of base seed ``seed``."""
    return judge(draw(seed, case))


__all__ = ["Finding", "Result", "judge", "run", "FLOOR", "DTYPES"]
