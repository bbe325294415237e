"""pytest's hooks and fixtures for qkv's tests; what tests share otherwise is in helpers.py."""

from __future__ import annotations

import os

# The device tests run on CUDA when there is a GPU, else through Triton's CPU interpreter;
# tests/device.py decides and sets TRITON_INTERPRET, which must happen before triton is first
# imported, so it is imported before anything else.
from .device import DEVICE, INTERPRETED  # noqa: I001

import numpy as np
import pytest
import torch

from .helpers import bundled_model_dir

if os.environ.get("PYTEST_XDIST_WORKER"):
    torch.set_num_threads(1)  # one thread per worker: xdist already runs one worker per core


def pytest_configure(config: pytest.Config) -> None:
    config.addinivalue_line(
        "markers", f"device: runs its kernels on the test device (here {DEVICE}; see tests/device.py); `pytest -m device` selects them"
    )


def pytest_collection_modifyitems(config: pytest.Config, items: list[pytest.Item]) -> None:
    """A test parametrized with ``backend="triton"`` runs the kernels: it is a device test too."""
    for item in items:
        callspec = getattr(item, "callspec", None)
        if callspec is not None and callspec.params.get("backend") == "triton":
            item.add_marker(pytest.mark.device)


def pytest_report_header(config: pytest.Config) -> str:
    how = "Triton's CPU interpreter" if INTERPRETED else torch.cuda.get_device_name()
    return f"qkv test device: {DEVICE} ({how}; QKV_TEST_DEVICE=cpu|cuda chooses)"


@pytest.fixture(autouse=True)
def _fresh_seed():
    """Fresh random inputs every run; the seed is printed so that a failure can be replayed
    with ``QKV_TEST_SEED=<seed> pytest <test id>``."""
    seed = int(os.environ.get("QKV_TEST_SEED") or int.from_bytes(os.urandom(4), "little"))
    torch.manual_seed(seed)
    np.random.seed(seed)
    print(f"torch seed {seed} (replay with QKV_TEST_SEED={seed})")
    yield


@pytest.fixture(scope="session")
def bundled_model():
    """The bundled all-MiniLM-L6-v2, loaded once per test session (skips without the models extra)."""
    bundled_model_dir()
    from qkv.models import load_shared

    return load_shared()
