"""Where the device tests run: a CUDA GPU when there is one, else the CPU through Triton's interpreter.

Tests marked ``device`` (the triton kernels, the statistics kernel, the varlen kernel and the
fuzz slice that draws triton calls) put their candidate tensors on :data:`DEVICE` and keep the
float64 oracle and the same-dtype baselines on the CPU, so the judges and the tolerance rule
are the same on both. ``QKV_TEST_DEVICE`` chooses:

- unset or ``auto``: ``cuda`` when torch sees a CUDA device (and ``TRITON_INTERPRET`` is not
  set on), else ``cpu``;
- ``cpu``: the interpreter, even on a GPU machine;
- ``cuda``: the GPU, and an error when there is none (a GPU check must not pass by quietly
  testing the interpreter).

On ``cpu`` this sets ``TRITON_INTERPRET=1``, on ``cuda`` it clears it; either way before
triton is imported (qkv imports it lazily), which is why ``conftest.py`` imports this first.
"""

from __future__ import annotations

import os
from collections.abc import Callable, Mapping, MutableMapping

ENV = "QKV_TEST_DEVICE"
CHOICES = ("auto", "cpu", "cuda")


def _truthy(value: str | None) -> bool:
    return (value or "0").strip() not in ("", "0")


def choose(env: Mapping[str, str], cuda_available: Callable[[], bool]) -> str:
    """``"cuda"`` or ``"cpu"`` for these environment variables; ``cuda_available`` is asked
    only when the answer depends on it (it imports torch)."""
    want = env.get(ENV, "").strip().lower() or "auto"
    if want not in CHOICES:
        raise ValueError(f"{ENV}={env[ENV]!r}: choose one of {', '.join(CHOICES)}")
    if want == "cpu":
        return "cpu"
    if want == "cuda":
        if _truthy(env.get("TRITON_INTERPRET")):
            raise ValueError(f"{ENV}=cuda with TRITON_INTERPRET={env['TRITON_INTERPRET']}: unset TRITON_INTERPRET to test the GPU")
        if not cuda_available():
            raise RuntimeError(f"{ENV}=cuda but torch sees no CUDA device; unset {ENV} to test through Triton's CPU interpreter")
        return "cuda"
    if _truthy(env.get("TRITON_INTERPRET")):  # asked for the interpreter explicitly
        return "cpu"
    return "cuda" if cuda_available() else "cpu"


def _torch_sees_cuda() -> bool:
    import torch

    return torch.cuda.is_available()


def configure(env: MutableMapping[str, str]) -> str:
    """Choose the device and set ``TRITON_INTERPRET`` to match it."""
    device = choose(env, _torch_sees_cuda)
    if device == "cpu":
        env["TRITON_INTERPRET"] = "1"
    else:
        env.pop("TRITON_INTERPRET", None)
    return device


DEVICE: str = configure(os.environ)
INTERPRETED: bool = DEVICE == "cpu"

__all__ = ["DEVICE", "INTERPRETED", "ENV", "choose", "configure"]
