"""pytest's hooks and fixtures for qkv's tests; what tests share otherwise is in helpers.py."""

from __future__ import annotations

import os
import random

# The device tests run on CUDA when there is a GPU, else through Triton's CPU interpreter;
# tests/device.py decides and sets TRITON_INTERPRET, which must happen before triton is first
# imported, so it is imported before anything else.
from .device import DEVICE, INTERPRETED  # noqa: I001

import numpy as np
import pytest
import torch
from hypothesis import HealthCheck, settings

from . import seeds
from .helpers import bundled_model_dir

if os.environ.get("PYTEST_XDIST_WORKER"):
    torch.set_num_threads(1)  # one thread per worker: xdist already runs one worker per core

# hypothesis follows the seed policy: derandomized (examples derived from each test, no example
# database) when the seeds are fixed; never a wall-clock deadline or "too slow" health check,
# which a busy machine can trip
_hypothesis = dict(deadline=None, suppress_health_check=[HealthCheck.too_slow])
settings.register_profile("qkv-fixed", derandomize=True, database=None, **_hypothesis)
settings.register_profile("qkv-fresh", **_hypothesis)
settings.load_profile("qkv-fixed" if seeds.FIXED else "qkv-fresh")


def pytest_configure(config: pytest.Config) -> None:
    config.addinivalue_line(
        "markers", f"device: runs its kernels on the test device (here {DEVICE}; see tests/device.py); `pytest -m device` selects them"
    )
    config.addinivalue_line(
        "markers",
        "heavy: a device case beyond the representative subset of a large grid (the ported suites' triton cases); "
        "the GPU check runs the subset first and these on the time left (bench/gpu_check.py)",
    )
    config.addinivalue_line(
        "markers",
        "slow: a further case of a path the quick tier already proves (another size, another build); "
        "`make test` leaves these out, `make test-slow` runs them, and CI (.ci/run) runs both",
    )


def pytest_collection_modifyitems(config: pytest.Config, items: list[pytest.Item]) -> None:
    """A test parametrized with ``backend="triton"`` runs the kernels: it is a device test too."""
    for item in items:
        callspec = getattr(item, "callspec", None)
        if callspec is not None and callspec.params.get("backend") == "triton":
            item.add_marker(pytest.mark.device)


def pytest_report_header(config: pytest.Config) -> list[str]:
    how = "Triton's CPU interpreter" if INTERPRETED else torch.cuda.get_device_name()
    return [f"qkv test device: {DEVICE} ({how}; QKV_TEST_DEVICE=cpu|cuda chooses)", seeds.describe()]


@pytest.fixture(autouse=True)
def _seeded(request: pytest.FixtureRequest):
    """Every test starts torch, NumPy and ``random`` from its own seed (tests/seeds.py: fixed
    under ``make test``, fresh in a plain local run), printed with the line that replays it."""
    seed = seeds.derive(request.node.nodeid)
    torch.manual_seed(seed)
    np.random.seed(seed)
    random.seed(seed)
    print(f"test seed {seed}; replay: {seeds.replay_hint(request.node.nodeid)}")
    yield


@pytest.fixture(scope="session")
def bundled_model():
    """The bundled all-MiniLM-L6-v2, loaded once per test session (skips without the models extra)."""
    bundled_model_dir()
    from qkv.models import load_shared

    return load_shared()
