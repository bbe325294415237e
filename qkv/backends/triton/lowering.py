"""Lower the kernels to a GPU binary without a GPU (Triton ships ptxas): code that only the
interpreter accepts, or a launch table entry that overflows shared memory, fails here on any
machine. Run with ``TRITON_INTERPRET`` unset (the tests start a subprocess for it)."""

from __future__ import annotations

import triton
from triton.backends.compiler import GPUTarget

from . import configs
from . import decode as DEC
from . import kernels as K

_PTR = {"Q", "K", "V", "Out", "DOut", "DK", "DV_", "DQ"}
_F32_PTR = {"Lse", "Delta", "DLse", "Rel", "DRel", "Sinks", "PartO", "PartM", "PartL"}
_F32 = {"qk_scale", "sm_scale", "cap_in", "cap_log2"}
SHARED_LIMIT = 227 * 1024  # an H100's shared memory per block
OFF = dict(SOFTCAP=False, HAS_REL=False, REL_SHIFT=False, HAS_SINKS=False, REL_GRAD=False, HAS_DLSE=False, WARP_SPEC=False,
           CHECK=True)  # the decoding kernels as a call without gradients runs them: the non-finite rule inside
INF_BITS_OF = {"bf16": 0x7F80, "fp16": 0x7C00, "fp32": 0x7F800000}  # the decoding kernels' INF_BITS per dtype
_UNIT_STRIDES = {"stride_qd", "stride_kd", "stride_vd", "stride_od", "stride_dd", "stride_dqd", "stride_kpn"}


def compile_one(fn, dt: str, consts: dict, config: configs.Config, mask_dt: str, capability: int = 90) -> int:
    """Compile ``fn`` for ``sm_<capability>`` with these constexprs; returns its shared memory in bytes."""
    return compile_kernel(fn, dt, consts, config, mask_dt, capability).metadata.shared


def compile_kernel(fn, dt: str, consts: dict, config: configs.Config, mask_dt: str, capability: int = 90, aligned: bool = False):
    """The compiled kernel (its ``asm`` holds the PTX), its shared memory checked against the limit.

    ``aligned``: as Triton specialises a launch on contiguous tensors — pointers and strides
    multiples of 16 bytes or elements, head-dim strides 1 — which is what lets its loads be
    vectorised and pipelined (``cp.async``); without, the lowering assumes nothing about them."""
    consts = {n: v for n, v in {**OFF, **consts}.items() if n in fn.arg_names}
    if aligned:
        consts = {**{n: 1 for n in fn.arg_names if n in _UNIT_STRIDES}, **consts}
    sig, attrs = {}, {}
    for i, name in enumerate(fn.arg_names):
        sig[name] = ("constexpr" if name in consts else "*" + dt if name in _PTR else "*fp32" if name in _F32_PTR
                     else "*" + mask_dt if name == "Mask" else "*u8" if name == "KP" else "*i32" if name in ("CuQ", "CuK", "PartF")
                     else "fp32" if name in _F32 else "i32")  # fmt: skip
        if aligned and name not in consts and (sig[name].startswith("*") or name.startswith("stride_")):
            attrs[(i,)] = [["tt.divisibility", 16]]
    src = triton.compiler.ASTSource(fn=fn, signature=sig, constexprs=consts, attrs=attrs)
    k = triton.compile(src, target=GPUTarget("cuda", capability, 32), options=dict(num_warps=config.num_warps, num_stages=config.num_stages))
    assert k.metadata.shared <= SHARED_LIMIT, (fn.__name__, k.metadata.shared)
    return k


def compile_all(dt: str, d: int, flags: dict, mask_dt: str = "u8", arch: str = "sm90", mask: str = "any") -> dict[str, int]:
    """Every attention kernel for one dtype, head dim and flag set, with ``arch``'s table entries:
    ``{kernel: shared bytes}``."""
    item = 4 if dt == "fp32" else 2
    bd = triton.next_power_of_2(d)
    base = dict(flags, BLOCK_D=bd, BLOCK_DV=bd, EVEN_D=bd == d, EVEN_DV=bd == d, UPCAST=False, INF_BITS=INF_BITS_OF[dt])
    base.setdefault("FP32_DOT", "tf32")
    cap = int(arch[2:]) if arch.startswith("sm") else 90
    out = {}
    for fn, kind in ((K.fwd_kernel, "fwd"), (K.bwd_dkdv_kernel, "bwd_dkdv"), (K.bwd_dq_kernel, "bwd_dq"), (DEC.decode_kernel, "decode")):
        cfg = configs.lookup(arch, d, d, item, kind, mask)
        bm = 16 if kind == "decode" else cfg.BLOCK_M
        if kind == "bwd_dq" and base.get("REL_GRAD"):
            bm = min(bm, cfg.BLOCK_N)
        consts = dict(base, BLOCK_M=bm, BLOCK_N=cfg.BLOCK_N, WARP_SPEC=base.get("WARP_SPEC", cfg.warp_specialize))
        out[fn.__name__] = compile_one(fn, dt, consts, cfg, mask_dt, cap)
    cfg = configs.lookup(arch, d, d, item, "bwd_dq", mask)
    out["bwd_preprocess"] = compile_one(K.bwd_preprocess, dt, dict(HAS_DLSE=True, VARLEN=flags.get("VARLEN", False), BLOCK_M=cfg.BLOCK_M,
                                                                   BLOCK_DV=bd), cfg, dt, cap)  # fmt: skip
    out["decode_merge_kernel"] = compile_one(DEC.decode_merge_kernel, dt, dict(HAS_SINKS=flags.get("HAS_SINKS", False), CHECK=True,
                                                                               BLOCK_M=16, BLOCK_DV=bd), configs.Config(16, 16, 4, 1), dt, cap)  # fmt: skip
    return out
