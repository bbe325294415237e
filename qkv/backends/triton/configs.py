"""Launch configurations of the Triton kernels, as one table (no triton import: ``qkv info`` and
the GPU check's autotune read it cheaply).

Key: ``(arch, head-dim bucket, dtype bytes, kind, mask kind)``

- ``arch``: ``"sm90"`` (H100, H200), ``"sm80"`` (A100), …, or ``"default"`` for any other GPU;
- head-dim bucket: ``max(D, Dv)`` rounded up to 64, 128 or 256;
- dtype bytes: 2 (fp16, bf16) or 4 (fp32: tiles take twice the shared memory);
- kind: ``fwd``, ``bwd_dkdv``, ``bwd_dq``, ``decode`` (:data:`KINDS`);
- mask kind: ``full`` (no band, no per-element mask), ``band`` (causal, windows: boundary tiles
  on the diagonal and window edges), ``masked`` (key padding or a dense mask: per-element work
  in every tile), or ``any``.

Value: ``(BLOCK_M, BLOCK_N, num_warps, num_stages, warp_specialize)``; for ``decode`` BLOCK_M is
unused (the row tile is ``G·Nq`` rounded up) and BLOCK_N is the key tile.

Lookup (:func:`lookup`): the exact key, then mask kind ``any``, then the same under
``"default"``. The ``default`` rows are FlashAttention-like starting points sized to an H100's
shared memory; Hopper's warp-group matrix instructions want 64-row tiles in 4-warp multiples,
so no backward tile has fewer than 64 rows at d ≤ 128. ``sm90`` rows are where the GPU check's
autotune (``bench/gpu_check.py``, :mod:`.autotune`) pastes its winners, each with the run that
measured it; rows no run has measured repeat the defaults.
"""

from __future__ import annotations

from typing import NamedTuple

KINDS = ("fwd", "bwd_dkdv", "bwd_dq", "decode")
MASK_KINDS = ("full", "band", "masked")
BUCKETS = (64, 128, 256)


class Config(NamedTuple):
    BLOCK_M: int
    BLOCK_N: int
    num_warps: int
    num_stages: int
    warp_specialize: bool = False

    def launch(self) -> dict:
        """Keyword arguments for a kernel launch (``WARP_SPEC`` only where the kernel has it)."""
        return dict(BLOCK_M=self.BLOCK_M, BLOCK_N=self.BLOCK_N, num_warps=self.num_warps, num_stages=self.num_stages)


C = Config
# fmt: off
CONFIGS: dict[tuple[str, int, int, str, str], Config] = {
    # forward: 128 query rows, 64 keys per tile (64 rows at d256, where 128 would not fit)
    ("default", 64, 2, "fwd", "any"): C(128, 64, 4, 3),
    ("default", 128, 2, "fwd", "any"): C(128, 64, 8, 2),
    ("default", 256, 2, "fwd", "any"): C(64, 32, 4, 2),
    ("default", 64, 4, "fwd", "any"): C(128, 64, 8, 2),
    ("default", 128, 4, "fwd", "any"): C(64, 32, 4, 2),
    ("default", 256, 4, "fwd", "any"): C(32, 32, 4, 1),
    # backward dK/dV: BLOCK_N keys own the accumulators, BLOCK_M query rows stream past
    ("default", 64, 2, "bwd_dkdv", "any"): C(64, 64, 4, 2),
    ("default", 128, 2, "bwd_dkdv", "any"): C(64, 64, 8, 2),
    ("default", 256, 2, "bwd_dkdv", "any"): C(32, 32, 4, 1),
    ("default", 64, 4, "bwd_dkdv", "any"): C(32, 64, 4, 2),
    ("default", 128, 4, "bwd_dkdv", "any"): C(32, 32, 4, 1),
    ("default", 256, 4, "bwd_dkdv", "any"): C(16, 32, 4, 1),
    # backward dQ: BLOCK_M rows own the accumulator (BLOCK_M <= BLOCK_N for a bias gradient)
    ("default", 64, 2, "bwd_dq", "any"): C(64, 64, 4, 2),
    ("default", 128, 2, "bwd_dq", "any"): C(64, 64, 8, 2),
    ("default", 256, 2, "bwd_dq", "any"): C(32, 32, 4, 1),
    ("default", 64, 4, "bwd_dq", "any"): C(32, 64, 4, 2),
    ("default", 128, 4, "bwd_dq", "any"): C(32, 32, 4, 1),
    ("default", 256, 4, "bwd_dq", "any"): C(16, 32, 4, 1),
    # decoding: G·Nq rows (≤ 64) against 64- or 128-key tiles, memory-bound
    ("default", 64, 2, "decode", "any"): C(16, 128, 4, 3),
    ("default", 128, 2, "decode", "any"): C(16, 64, 4, 3),
    ("default", 256, 2, "decode", "any"): C(16, 32, 4, 2),
    ("default", 64, 4, "decode", "any"): C(16, 64, 4, 2),
    ("default", 128, 4, "decode", "any"): C(16, 32, 4, 2),
    ("default", 256, 4, "decode", "any"): C(16, 16, 4, 1),
    # H100 / H200 (sm90), bf16/fp16: the GPU check's autotune table goes here. Measured rows cite
    # their run; the others repeat the defaults, unmeasured.
    ("sm90", 64, 2, "fwd", "any"): C(128, 64, 4, 3),
    ("sm90", 128, 2, "fwd", "any"): C(128, 64, 8, 2),
    # H200, main at a621e09, bf16, B 4, H 16, N 4096, do_bench medians (the autotune table of
    # bench/results/gpu_check_nvidia-h200.md): 64×64 tiles, 4 warps, 3 stages took 0.612 ms
    # causal against 0.834 ms for (128, 64, 8, 2) (1.36×), 1.091 ms full against 1.435 ms
    # (1.32×); (128, 128, 8, 2) and (128, 32, 4, 4) came in between.
    ("sm90", 128, 2, "fwd", "band"): C(64, 64, 4, 3),
    ("sm90", 128, 2, "fwd", "full"): C(64, 64, 4, 3),
    ("sm90", 64, 2, "bwd_dkdv", "any"): C(64, 64, 4, 2),
    ("sm90", 128, 2, "bwd_dkdv", "any"): C(64, 64, 8, 2),
    ("sm90", 64, 2, "bwd_dq", "any"): C(64, 64, 4, 2),
    ("sm90", 128, 2, "bwd_dq", "any"): C(64, 64, 8, 2),
    ("sm90", 64, 2, "decode", "any"): C(16, 128, 4, 3),
    ("sm90", 128, 2, "decode", "any"): C(16, 64, 4, 3),
}
# fmt: on

INTERPRETER = Config(16, 16, 1, 1)  # each tile is NumPy work in the interpreter: small tiles keep tests fast


def bucket(d: int, dv: int) -> int:
    """64, 128 or 256: the head-dim bucket of ``max(d, dv)``."""
    width = max(d, dv)
    return next((b for b in BUCKETS if width <= b), BUCKETS[-1])


def mask_kind(has_band: bool, has_elementwise: bool) -> str:
    """``masked`` when every tile reads a mask, else ``band`` with a causal/window band, else ``full``."""
    return "masked" if has_elementwise else "band" if has_band else "full"


def lookup(arch: str, d: int, dv: int, itemsize: int, kind: str, mask: str = "any", table=None) -> Config:
    """The configuration for a launch (see the module docstring for the order of fallbacks)."""
    table = CONFIGS if table is None else table
    size = 4 if itemsize >= 4 else 2
    bk = bucket(d, dv)
    for a in (arch, "default"):
        for m in (mask, "any"):
            c = table.get((a, bk, size, kind, m))
            if c is not None:
                return c
    raise KeyError(f"no launch configuration for {(arch, bk, size, kind, mask)} (nor a default one)")


def render(rows: dict) -> str:
    """Table rows as Python source ready to paste into :data:`CONFIGS`."""
    out = []
    for (arch, bk, size, kind, mask), c in sorted(rows.items()):
        ws = ", True" if c.warp_specialize else ""
        out.append(f'    ("{arch}", {bk}, {size}, "{kind}", "{mask}"): C({c.BLOCK_M}, {c.BLOCK_N}, {c.num_warps}, {c.num_stages}{ws}),')
    return "\n".join(out)


__all__ = ["CONFIGS", "Config", "INTERPRETER", "KINDS", "MASK_KINDS", "bucket", "lookup", "mask_kind", "render"]
