"""Small tensors a call reads that sit on another device than its query follow the query there.

A user who writes ``ALiBi(alibi_slopes(8))`` (the slopes on the CPU) or builds a key padding mask
on the CPU for CUDA inputs gets what SDPA users expect: the call runs on the query's device. The
tensor is copied once per call, only when it is elsewhere, differentiably (a gradient reaches the
original), and without making the host wait: a plain copy from pageable CPU memory synchronises
the CUDA stream (torch waits for it to finish), so the bytes go through pinned memory and the
copy is queued on the stream like a kernel.
"""

from __future__ import annotations

import torch


def follow(t: torch.Tensor, device: torch.device) -> torch.Tensor:
    """``t`` on ``device``: itself when it is there already; else a differentiable copy, from the
    CPU to an accelerator through pinned memory without a host sync."""
    if t.device == device:
        return t
    if (t.device.type == "cpu" and device.type == "cuda" and not torch.compiler.is_compiling()
            and not torch._C._are_functorch_transforms_active()):  # fmt: skip
        return t.pin_memory().to(device, non_blocking=True)
    return t.to(device)


__all__ = ["follow"]
