"""``flex``: PyTorch's FlexAttention, compiled — an engine for what SDPA has no argument for.

What it runs, with qkv's meaning: windows and bands in both causal alignments, key padding, bool
masks, block-sparse layouts and mask functions (one Flex block mask and ``mask_mod`` made of all
of them), score functions (a built-in through its kernel form, a Python function as given), a
float ``attn_mask`` (added by the score function), shared key/value heads (``enable_gqa``, no
copies) and values of another head dim. A row with nothing to attend to comes back 0 (lse
``-inf``), and :func:`.base.follow_rule` applies qkv's non-finite rule, as for every backend.

What it does not run (each a reason, so ``auto`` goes on to the next engine): sinks, dropout,
gradients into a float ``attn_mask``, a differentiable lse, ``torch.func`` transforms; on the CPU
(torch's compiled CPU template) gradients, ``return_lse`` and float64; and nothing at all with
compilation off (``QKV_COMPILE=0``: eager FlexAttention builds the ``Nq × Nk`` scores, so qkv does
not offer it).

Compiled once per kind of call (:func:`_kind`: device, dtype, which masks, the score function's
code; on the CPU also the shapes, compiled static): a loop of calls compiles once, a function
made anew with the same code reuses the kernel, and each kind has its own code object and so
its own recompile budget in torch's compiler. Block masks of positional rules are kept per
shape; data-dependent ones (padding, bool masks, mask functions) are built once per key — the
masks' tensors by identity and version counter, a mask function's layout by its key
(:mod:`qkv.masks.fingerprint`) — and built anew when one of them changes (a compiled builder
from a few million pairs on); a FlexAttention BlockMask given as ``attn_mask`` runs as given.
A compiler error makes the engine decline that kind of call from then on
(:class:`.base.EngineFailed`: ``auto`` goes on to the next engine), after retrying one that ran
out of resources (shared memory, registers) with smaller tiles and fewer stages
(:data:`RETRY_OPTIONS`, Flex's ``kernel_options``; those that compiled are kept for the kind and
logged). :func:`compile_log` lists the first call of each kind with its time, compilation
included, and its kernel options (``qkv info`` prints it).
"""

from __future__ import annotations

import copy
import logging
import os
import re
import time
import types
from dataclasses import dataclass
from typing import Any, Callable, Optional

import torch

from ..call import AttentionCall
from ..masks.fingerprint import Key, KeyedCache, fingerprint
from .base import Backend, EngineFailed, follow_rule

_log = logging.getLogger("qkv")
COMPILE_ENV = "QKV_COMPILE"  # "0" turns compilation (and with it this engine) off
# What torch's compiler raises when it cannot build a kernel (dynamo's wrapper of a backend's
# error, inductor's own, a C++ compile error): the engine then declines that kind of call.
_COMPILE_ERRORS: tuple[type[BaseException], ...] = (torch._dynamo.exc.BackendCompilerFailed, torch._dynamo.exc.TorchRuntimeError)
try:
    from torch._inductor.exc import InductorError

    _COMPILE_ERRORS += (InductorError,)
except ImportError:  # an older torch
    pass
_POSITIONAL_CACHE_SIZE = 64
_COMPILED_BLOCK_MASK_PAIRS = 1 << 22


def compile_enabled() -> bool:
    """May qkv compile kernels (``QKV_COMPILE`` unset, or anything but 0/false/no/off)?"""
    return os.environ.get(COMPILE_ENV, "1").strip().lower() not in ("0", "false", "no", "off")


def _flex_module() -> Any:
    try:
        from torch.nn.attention import flex_attention as fa
    except ImportError:
        return None
    return fa


@dataclass(frozen=True)
class CompileRecord:
    """The first call of one kind of call, compilation included, and the ``kernel_options`` it
    compiled with (None: FlexAttention's own choice)."""

    kind: str
    seconds: float
    kernel_options: Optional[dict] = None


_LOG: list[CompileRecord] = []
_SEEN: set[tuple] = set()
_BROKEN: dict[tuple, str] = {}  # kinds of call whose compilation failed in this process, and why
_BLOCK_MASKS: dict[tuple, Any] = {}
# Block masks of data-dependent masks (padding, bool masks, mask functions), built once per key;
# a B·H·(Nq/128)·(Nk/128) set of int32 block lists each, within 256 MiB in all.
_DATA_BLOCK_MASKS = KeyedCache(entries=32, max_bytes=256 << 20)
_COMPILED: dict[tuple, Callable[..., Any]] = {}
MAX_KINDS = 64  # compiled kinds of call per process; past it the engine declines new kinds
# FlexAttention's kernel_options (FlexKernelOptions; these names since torch 2.5) tried in turn
# when a kind of call does not compile for lack of resources: smaller tiles, shallower pipelines,
# for the forward (BLOCK_M/N) and the backward (BLOCK_M1/N1 for dK/dV, BLOCK_M2/N2 for dQ; N1 a
# multiple of M1, M2 of N2, all dividing the block mask's 128). Measured on an H200 (torch 2.11):
# a 16-bit call whose score function reads a float32 table with gradients asked 245,760 bytes of
# shared memory for Flex's default 128×128 tiles in 3 stages, over the card's 232,448.
RETRY_OPTIONS: tuple[dict, ...] = (
    {"BLOCK_M": 64, "BLOCK_N": 64, "num_stages": 2, "BLOCK_M1": 32, "BLOCK_N1": 64, "BLOCK_M2": 64, "BLOCK_N2": 32},
    {"BLOCK_M": 64, "BLOCK_N": 32, "num_stages": 1, "BLOCK_M1": 16, "BLOCK_N1": 32, "BLOCK_M2": 32, "BLOCK_N2": 16},
)
# what a compiler error says when smaller kernel_options may help (Triton's OutOfResources,
# inductor's "No valid triton configs", PTXAS's register and shared-memory limits)
_RESOURCE_ERROR = re.compile(r"out of resource|No valid triton configs|shared memory|Reducing block sizes|registers", re.IGNORECASE)
_OPTIONS: dict[tuple, Optional[dict]] = {}  # kinds of call → the kernel_options they compiled with


def compile_log() -> list[CompileRecord]:
    """This process's first flex call of each kind and how long it took (compilation included)."""
    return list(_LOG)


def _flex_call(q, k, v, score_mod, block_mask, scale, enable_gqa, return_lse, kernel_options=None):  # type: ignore[no-untyped-def]
    return _flex_module().flex_attention(
        q, k, v, score_mod=score_mod, block_mask=block_mask, scale=scale, enable_gqa=enable_gqa, return_lse=return_lse,
        kernel_options=kernel_options,
    )


def kernel_options(kind: tuple) -> Optional[dict]:
    """The ``kernel_options`` a kind of call compiled with (None: Flex's own choice)."""
    return _OPTIONS.get(kind)


def _first_line(e: BaseException) -> str:
    text = str(e).strip()
    return f"{type(e).__name__}: {text.splitlines()[0][:200] if text else ''}"


def _run_compiled(kind: tuple, args: tuple) -> Any:
    """The compiled call, with the kernel_options that worked for this kind before; a kind's
    first call that fails for lack of resources is retried with :data:`RETRY_OPTIONS` in turn.
    Raises the first error when none compiles."""
    ladder = [_OPTIONS[kind]] if kind in _OPTIONS else [None, *RETRY_OPTIONS]
    first: Optional[BaseException] = None
    for options in ladder:
        try:
            found = _compiled(kind)(*args, options)
        except _COMPILE_ERRORS as e:
            if torch.compiler.is_compiling():
                raise
            first = first or e
            if not _RESOURCE_ERROR.search(str(e)):
                break  # smaller tiles do not mend other errors
            _log.info("flex: %s did not compile with kernel_options %s (%s)", kind[:4], options, _first_line(e))
            continue
        if options is not None and kind not in _OPTIONS:
            _log.info("flex: compiled with kernel_options %s after Flex's own choice ran out of resources", options)
        _OPTIONS[kind] = options
        return found
    assert first is not None
    raise first


def _compiled(kind: tuple) -> Callable[..., Any]:
    """The compiled FlexAttention call for one kind of call. Each kind gets a code object of its
    own, so torch's compiler keeps its kernels (and its recompile budget: dynamic shapes after the
    second) apart from other kinds' instead of sharing one budget among all of them."""
    if torch.compiler.is_compiling():  # inside the caller's torch.compile: its graph takes the call
        return _flex_call
    fn = _COMPILED.get(kind)
    if fn is None:
        code = _flex_call.__code__.replace(co_name=f"_flex_call_{len(_COMPILED)}")
        fresh = types.FunctionType(code, _flex_call.__globals__, code.co_name)
        # static shapes on the CPU: torch 2.13's dynamic-shape CPU template fails to compile some
        # calls (a C++ error, seen for a band whose bounds changed between calls)
        fn = _COMPILED[kind] = torch.compile(fresh, dynamic=False if kind[0] == "cpu" else None)
    return fn


def _kind(call: AttentionCall) -> tuple:
    """What one compiled kernel serves: device, dtype, gradients, lse, which masks, which function."""
    masks = (call.positional.band() != (None, None), call.key_padding_mask is not None, call.bool_mask,
             call.given_mask is not None and call.given_mask.is_floating_point())  # fmt: skip
    fn, mm = call.score_mod, None if call.block_sparse is None else call.block_sparse.mask_mod
    kind = (call.device.type, call.dtype, call.requires_grad, call.return_lse, masks,
            None if fn is None else getattr(fn, "__code__", type(fn)),
            None if mm is None else getattr(mm, "__code__", type(mm)))  # fmt: skip
    if call.device.type == "cpu":  # compiled for static shapes there (see _compiled): one kind per shape
        kind += (call.batch_shape, call.hq, call.hk, call.nq, call.nk, call.d, call.dv, call.positional.band())
    return kind


def _cpu_floats_per_vector() -> int:
    """Floats in one vector register of the CPU kernels torch compiles (its ATen capability):
    16 with AVX-512, 8 with AVX2 or 256-bit SVE, else taken as 4 (128-bit NEON, VSX)."""
    cap = torch.backends.cpu.get_cpu_capability().upper()
    return 16 if cap.startswith("AVX512") else 8 if cap in ("AVX2", "SVE256") else 4


def _cpu_template_miscomputes(call: AttentionCall) -> bool:
    """Would torch's compiled CPU FlexAttention kernel compute this call's scores wrong?

    Its transposed micro-GEMM (``q·kᵀ`` in blocks of 16 keys) takes a shortcut for a block's
    last keys when their count and the head dim are multiples of the CPU's vector and the head
    dim is below 24, and that shortcut stores a whole 16-key block: past the last key it writes
    whatever it read, over the next row's scores and the row maxima that follow the buffer. On a
    CPU with 8-float vectors (AVX2) that is every call with ``Nk ≡ 8 (mod 16)`` and a head dim
    of 8 or 16 (measured: 9 to 12 of 15 random calls wrong, errors up to 1.8, in float32 and
    bfloat16; none at Nk ≡ 0 or a head dim of 20, 24, 32 or 64). AVX-512's 16-float vectors
    never meet it. Seen in torch 2.13's ``CppMicroGemmFP32Vec`` (``GemmBlocking(1, 16, 1)``)."""
    width = _cpu_floats_per_vector()
    tail = call.nk % 16
    return width < 16 and tail % width == 0 and tail != 0 and call.d % width == 0 and call.d < 24


def _flat(t: torch.Tensor, batch: tuple[int, ...]) -> torch.Tensor:
    """``(..., H, N, D)`` → ``(B, H, N, D)``, the batch dims broadcast to ``batch`` and flattened
    (a view where the tensor already has them)."""
    t = t.expand(*batch, *t.shape[-3:])
    return t.reshape(-1, *t.shape[-3:]) if batch else t.unsqueeze(0)


def _grid(t: Optional[torch.Tensor], call: AttentionCall, trailing: tuple[int, ...]) -> Optional[Callable[..., torch.Tensor]]:
    """A mask broadcastable to ``(..., *trailing)`` — the scores ``(Hq, Nq, Nk)`` or a padding's
    ``(Nk,)`` — as a reader ``(b, *idx) -> entry`` for per-element code, ``b`` the flattened batch
    index. Broadcast dims are read at index 0, so nothing is expanded into memory (a copy is made
    only where several batch dims must be flattened and some of them broadcast)."""
    if t is None:
        return None
    nb = len(call.batch_shape)
    t = t.reshape((1,) * (nb + len(trailing) - t.dim()) + tuple(t.shape))  # the batch and trailing dims aligned
    lead = t.shape[:nb]
    if all(n == 1 for n in lead):
        t = t.reshape(1, *t.shape[nb:])
    elif nb > 1:
        t = t.expand(*call.batch_shape, *t.shape[nb:]).reshape(-1, *t.shape[nb:])
    elif nb == 0:
        t = t.unsqueeze(0)
    spread = [n > 1 for n in t.shape]  # a dim of size 1 is read at 0 whatever the index

    def read(b: torch.Tensor, *idx: torch.Tensor) -> torch.Tensor:
        return t[tuple(i if wide else i * 0 for i, wide in zip((b, *idx), spread))]

    return read


def _score_function(call: AttentionCall) -> Optional[Callable[..., torch.Tensor]]:
    """The call's score function and float mask as one Flex ``score_mod`` (None for neither)."""
    bound = call.bound_score()
    fmask = call.given_mask if call.given_mask is not None and call.given_mask.is_floating_point() else None
    fmask = _grid(fmask, call, (call.hq, call.nq, call.nk))
    if bound is None and fmask is None:
        return None
    form = None if bound is None else bound.form
    fn = None if bound is None or form is not None else bound.fn
    nq = call.nq

    def score_mod(s: torch.Tensor, b: torch.Tensor, h: torch.Tensor, i: torch.Tensor, j: torch.Tensor) -> torch.Tensor:
        if form is not None:
            if form.softcap is not None:
                s = form.softcap * torch.tanh(s / form.softcap)
            if form.rel is not None:
                s = s + form.rel[h, j - i + (nq - 1)].to(s.dtype)
        elif fn is not None:
            s = fn(s, b, h, i, j)
        if fmask is not None:
            s = s + fmask(b, h, i, j).to(s.dtype)
        return s

    return score_mod


def _block_mask(call: AttentionCall, batch: int) -> Any:
    """One Flex block mask for every masking rule of the call (None where nothing is masked)."""
    lo, hi = call.positional.band()
    kp = _grid(call.key_padding_mask, call, (call.nk,))
    bmask = call.given_mask if call.given_mask is not None and call.given_mask.dtype == torch.bool else None
    bs = call.block_sparse
    layout_fn = None if bs is None else getattr(bs, "mask_mod", None)
    scores = (call.hq, call.nq, call.nk)
    dense = _grid(bmask, call, scores) if bmask is not None else (_grid(call.attn_mask, call, scores) if bs is not None and layout_fn is None else None)
    if lo is None and hi is None and kp is None and dense is None and layout_fn is None:
        return None

    def mask_mod(b: torch.Tensor, h: torch.Tensor, i: torch.Tensor, j: torch.Tensor) -> torch.Tensor:
        ok = j >= 0
        if lo is not None:
            ok = ok & (j - i >= lo)
        if hi is not None:
            ok = ok & (j - i <= hi)
        if kp is not None:
            ok = ok & kp(b, j)
        if dense is not None:
            ok = ok & dense(b, h, i, j)
        if layout_fn is not None:
            ok = ok & layout_fn(b, h, i, j)
        return ok

    given = None if bs is None else bs.block_mask
    if given is not None and lo is None and hi is None and kp is None and bmask is None and _runs_as_given(given, call, batch):
        return given  # the user's FlexAttention BlockMask, built once, is the call's only mask
    fa = _flex_module()
    positional = kp is None and dense is None and layout_fn is None
    key = ("band", lo, hi, call.nq, call.nk, str(call.device))
    if positional and key in _BLOCK_MASKS:
        return _BLOCK_MASKS[key]
    data_key = None if positional or torch.compiler.is_compiling() else _data_key(call, bmask, batch)
    kept = None if data_key is None else _DATA_BLOCK_MASKS.get(data_key)
    if kept is not None:
        return _rebound(kept, mask_mod)
    # the compiled builder keeps no B·H·Nq·Nk mask in memory, but compiles per kind of mask:
    # worth it from a few million pairs on (a smaller mask is built eagerly in milliseconds)
    pairs = (1 if positional else batch) * (call.hq if dense is not None or layout_fn is not None else 1) * call.nq * call.nk
    build = not torch.compiler.is_compiling() and pairs >= _COMPILED_BLOCK_MASK_PAIRS
    found = fa.create_block_mask(
        mask_mod, None if positional else batch, None if positional or dense is None and layout_fn is None else call.hq,
        call.nq, call.nk, device=call.device, _compile=build,
    )  # fmt: skip
    if positional:
        if len(_BLOCK_MASKS) >= _POSITIONAL_CACHE_SIZE:
            _BLOCK_MASKS.clear()
        _BLOCK_MASKS[key] = found
    elif data_key is not None:  # kept without its mask_mod, which holds the call's tensors (a dense mask, say)
        _DATA_BLOCK_MASKS.put(data_key, _rebound(found, fa.noop_mask), _nbytes(found))
    return found


def _data_key(call: AttentionCall, bmask: Optional[torch.Tensor], batch: int) -> Optional[Key]:
    """A key for the block mask of the call's data-dependent masks — key padding and a bool mask
    by their tensors' identities and version counters, a mask function's layout by its key (see
    :mod:`qkv.masks.fingerprint`) — or None where one of them cannot be named."""
    bs, parts = call.block_sparse, []
    if bs is not None:
        if bs.mask_mod is not None:
            parts.append(bs.key)  # set only where every tensor the function read is named in it
        elif bs.rule is None:
            parts.append(fingerprint(bs.layout))  # the dense mask is the layout's blocks
        else:
            return None  # a rule read afresh on every call (its dense mask is built per call)
    for t in (call.key_padding_mask, bmask):
        if t is not None:
            parts.append(fingerprint(t))
    if any(p is None for p in parts):
        return None
    lo, hi = call.positional.band()
    return Key(("flex block mask", lo, hi, batch, call.hq, call.nq, call.nk, call.batch_shape, str(call.device))).join(keys=tuple(parts))


def _runs_as_given(block_mask: Any, call: AttentionCall, batch: int) -> bool:
    """Does a user's FlexAttention BlockMask fit the call as it is (lengths, batch and head dims
    of one or the call's, its device)?"""
    b, h = block_mask.kv_num_blocks.shape[:2]
    return (tuple(block_mask.seq_lengths) == (call.nq, call.nk) and b in (1, batch) and h in (1, call.hq)
            and block_mask.kv_num_blocks.device == call.device)  # fmt: skip


def _rebound(block_mask: Any, mask_mod: Callable[..., torch.Tensor]) -> Any:
    """The same blocks with another mask function (a kept block mask holds no call's tensors)."""
    found = copy.copy(block_mask)
    found.mask_mod = mask_mod
    return found


def _nbytes(block_mask: Any) -> int:
    return sum(t.numel() * t.element_size() for t in vars(block_mask).values() if isinstance(t, torch.Tensor))


class FlexBackend(Backend):
    NAME = "flex"
    DESCRIPTION = "torch's FlexAttention, compiled: windows, padding, block masks, mask and score functions"
    SUPPORTS_DROPOUT = False
    SUPPORTS_GENERATOR = False
    SUPPORTS_MASK_GRAD = False
    SCORE_MODS = "any"

    def available(self) -> Optional[str]:
        if _flex_module() is None:
            return f"this torch ({torch.__version__}) has no torch.nn.attention.flex_attention"
        if not compile_enabled():
            return f"compilation is off ({COMPILE_ENV}=0), and eager FlexAttention builds the Nq × Nk scores"
        return None

    def extra_reasons(self, call: AttentionCall) -> list[str]:
        reasons = []
        if call.device.type == "cpu":
            if call.requires_grad:
                reasons.append("FlexAttention has no backward on the CPU")
            if call.return_lse:
                reasons.append("compiled FlexAttention on the CPU does not return the lse")
            if call.dtype == torch.float64:
                reasons.append("compiled FlexAttention on the CPU takes float32, float16 and bfloat16 only")
            if _cpu_template_miscomputes(call):
                reasons.append(
                    f"torch's compiled CPU kernel computes wrong scores for {call.nk} keys (a last block of "
                    f"{call.nk % 16}) with head dim {call.d} on this CPU's {_cpu_floats_per_vector()}-float vectors; "
                    "backend='chunked' (or 'auto') runs the call"
                )
        elif call.return_lse and call.requires_grad:
            reasons.append("return_lse=True with gradients: qkv does not route an lse gradient through FlexAttention")
        if call.batch_size * call.hq * call.nq * call.nk * call.d * call.dv == 0:
            reasons.append("an empty size (FlexAttention divides by them)")
        if torch._C._functorch.peek_interpreter_stack() is not None:
            reasons.append("under torch.func transforms (grad, vmap) a compiled FlexAttention call cannot be traced")
        kind = _kind(call)
        if kind not in _COMPILED and len(_COMPILED) >= MAX_KINDS:
            reasons.append(f"FlexAttention was compiled for {MAX_KINDS} kinds of call in this process already")
        broken = _BROKEN.get(kind)
        if broken:
            reasons.append(f"compiling FlexAttention for this kind of call failed in this process ({broken})")
        return reasons

    def forward(self, call: AttentionCall) -> tuple[torch.Tensor, Optional[torch.Tensor]]:
        batch = call.batch_shape
        q, k, v = _flat(call.query, batch), _flat(call.key, batch), _flat(call.value, batch)
        kind = _kind(call)
        first = kind not in _SEEN and not torch.compiler.is_compiling()
        t0 = time.perf_counter()
        try:
            block_mask = _block_mask(call, q.shape[0])
            found = _run_compiled(kind, (q, k, v, _score_function(call), block_mask, call.scale, call.hq != call.hk, call.return_lse))
        except _COMPILE_ERRORS as e:  # torch's compiler could not build this kind of call: say so from now on
            if torch.compiler.is_compiling():
                raise
            tried = f" (also with smaller kernel_options: {len(RETRY_OPTIONS)} tried)" if _RESOURCE_ERROR.search(str(e)) else ""
            _BROKEN[kind] = _first_line(e) + tried
            raise EngineFailed(f"flex: {_BROKEN[kind]}") from e
        out, lse = found if call.return_lse else (found, None)
        if first:
            _SEEN.add(kind)
            _LOG.append(CompileRecord(call.describe(), time.perf_counter() - t0, _OPTIONS.get(kind)))
        out = out.reshape(*batch, call.hq, call.nq, call.dv)
        if lse is not None:
            lse = lse.reshape(*batch, call.hq, call.nq).to(call.lse_dtype)
        return follow_rule(call, out, lse)
