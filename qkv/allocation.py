"""Refuse an ``Nq × Nk`` allocation that cannot fit, before it is tried, and say what avoids it.

Some paths build a matrix with one entry per (query, key) pair: the ``math`` backend's scores and
weights, :func:`qkv.attention_weights`, the dense mask SDPA needs for rules it has no argument
for. At N = 100,000 that is 40 GB per head; torch would answer with its allocator's "can't
allocate memory: you tried to allocate 40000000000 bytes", which names neither the matrix nor
the call that avoids it. :func:`check_fits` compares the size with the memory the device has
free and raises :class:`AllocationTooLarge` (a :class:`MemoryError`) naming both.

Free memory: a CUDA device's ``torch.cuda.mem_get_info``; on a CPU, Linux's ``MemAvailable``.
Where it cannot be read nothing is checked (the allocator still has the last word).
"""

from __future__ import annotations

import math
from pathlib import Path
from typing import Optional, Sequence

import torch


SMALL = 1 << 26  # below 64 MiB no call reads the free memory (a file read per call)


class AllocationTooLarge(MemoryError):
    """A matrix a call would build does not fit in the memory its device has free."""


def free_bytes(device: torch.device) -> Optional[int]:
    """Bytes free on ``device`` now, or None where that cannot be read."""
    try:
        if device.type == "cuda":
            return int(torch.cuda.mem_get_info(device)[0])
        if device.type == "cpu":
            for line in Path("/proc/meminfo").read_text().splitlines():
                if line.startswith("MemAvailable:"):
                    return int(line.split()[1]) * 1024
    except (OSError, RuntimeError, ValueError):
        pass
    return None


def _size(n: float) -> str:
    for unit in ("bytes", "KiB", "MiB", "GiB", "TiB"):
        if n < 1024 or unit == "TiB":
            return f"{n:.0f} {unit}" if unit == "bytes" else f"{n:.1f} {unit}"
        n /= 1024
    return f"{n:.1f} TiB"  # unreachable


def check_fits(what: str, shape: Sequence[int], dtype: torch.dtype, device: torch.device, instead: str,
               copies: int = 1) -> None:
    """Raise :class:`AllocationTooLarge` if ``copies`` tensors of ``shape`` and ``dtype`` cannot
    fit in ``device``'s free memory. ``what`` names the matrix, ``instead`` says what avoids it."""
    nbytes = math.prod(shape) * dtype.itemsize * copies
    if nbytes < SMALL:
        return
    free = free_bytes(device)
    if free is None or nbytes <= free:
        return
    dims = " × ".join(str(s) for s in shape)
    raise AllocationTooLarge(
        f"{what} would be {dims} {str(dtype).replace('torch.', '')}"
        + (f" (×{copies} while it is computed)" if copies > 1 else "")
        + f": {_size(nbytes)}, and {device.type} has {_size(free)} free. {instead}"
    )


__all__ = ["AllocationTooLarge", "check_fits", "free_bytes"]
