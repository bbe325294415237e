"""Helpers shared by the benchmark scripts."""

from __future__ import annotations

from pathlib import Path


def proc_status_kib(field: str) -> int:
    """A memory field of /proc/self/status in KiB: ``VmRSS`` (now) or ``VmHWM`` (peak so far)."""
    for line in Path("/proc/self/status").read_text().splitlines():
        if line.startswith(field + ":"):
            return int(line.split()[1])
    raise RuntimeError(f"{field} not in /proc/self/status (Linux only)")
