"""Helpers shared by the benchmark scripts."""

from __future__ import annotations

import platform
from pathlib import Path


def proc_status_kib(field: str) -> int:
    """A memory field of /proc/self/status in KiB: ``VmRSS`` (now) or ``VmHWM`` (peak so far)."""
    for line in Path("/proc/self/status").read_text().splitlines():
        if line.startswith(field + ":"):
            return int(line.split()[1])
    raise RuntimeError(f"{field} not in /proc/self/status (Linux only)")


def cpu_name() -> str:
    """The CPU model from /proc/cpuinfo, for report headers."""
    try:
        for line in Path("/proc/cpuinfo").read_text().splitlines():
            if line.startswith("model name"):
                return line.split(":", 1)[1].strip()
    except OSError:
        pass
    return platform.processor() or "unknown CPU"
