"""The seeded fuzz test: thousands of random ``qkv.attention`` calls against the float64 oracle.

Each chunk judges ``CHUNK`` consecutive cases of the run's base seed (see :mod:`.calls` for
what is drawn and :mod:`.judge` for what is checked). The base seed follows tests/seeds.py
(fixed under ``make test``, fresh in a plain ``pytest`` run, shared by the xdist workers); a
failure prints it with one reproducer line per case:

    QKV_FUZZ_SEED=123 pytest tests/fuzz           # the same calls again
    QKV_FUZZ_CASES=20000 pytest -n 2 tests/fuzz   # more calls
    python -m tests.fuzz --seed 123 --case 456    # one case, verbosely
    python -m tests.fuzz --long                   # 20,000 calls with a grouped summary

The triton slice runs on the test device (tests/device.py): a few small cases through
Triton's CPU interpreter (slow) on a CPU machine, more on a GPU (``QKV_FUZZ_TRITON_CASES``).
"""

from __future__ import annotations

import os

import pytest

from ..device import DEVICE
from .judge import run
from .report import CASES_ENV, base_seed, failure_message
from .runner import quiet

SEED = base_seed()
CASES = int(os.environ.get(CASES_ENV, 3000))
CHUNK = 125
# On a GPU each new shape compiles its kernels (seconds each), so the slice is not much larger there.
TRITON_CASES = int(os.environ.get("QKV_FUZZ_TRITON_CASES", 16 if DEVICE == "cpu" else 48))
TRITON_CHUNK = 4 if DEVICE == "cpu" else 3
# The quick tier draws the first half of each slice; the second half is marked slow (CI's slow
# tier draws it), unless a count was asked for, which runs whole.
QUICK_CASES = CASES if CASES_ENV in os.environ else CASES // 2
QUICK_TRITON_CASES = TRITON_CASES if "QKV_FUZZ_TRITON_CASES" in os.environ or DEVICE != "cpu" else TRITON_CASES // 2


def _chunks(cases: int, chunk: int, quick: int) -> list:
    return [pytest.param(c, marks=pytest.mark.slow) if c * chunk >= quick else c for c in range(-(-cases // chunk))]


quiet()
# torch warns that causal_lower_right with Nq > Nk leaves rows with nothing to attend to: the point
pytestmark = pytest.mark.filterwarnings("ignore:Lower right causal bias")


def _check(cases: list[str]) -> None:
    print(f"qkv fuzz: base seed {SEED} (QKV_FUZZ_SEED={SEED} draws the same calls), cases {cases[0]}..{cases[-1]}")
    results = [run(SEED, c) for c in cases]
    refused = sum(r.status == "refused" for r in results)
    print(f"{len(results)} calls, {refused} refused (qkv.BackendError from a named backend)")
    if any(r.status == "failed" for r in results):
        pytest.fail(failure_message(results, SEED), pytrace=False)


@pytest.mark.parametrize("chunk", _chunks(CASES, CHUNK, QUICK_CASES), ids=lambda c: f"cases{c * CHUNK}-{min(CASES, (c + 1) * CHUNK) - 1}")
def test_fuzz(chunk: int) -> None:
    _check([str(i) for i in range(chunk * CHUNK, min(CASES, (chunk + 1) * CHUNK))])


@pytest.mark.device
@pytest.mark.filterwarnings("ignore:Conversion of an array with ndim > 0 to a scalar:DeprecationWarning")
@pytest.mark.parametrize(
    "chunk", _chunks(TRITON_CASES, TRITON_CHUNK, QUICK_TRITON_CASES), ids=lambda c: f"t{c * TRITON_CHUNK}-t{min(TRITON_CASES, (c + 1) * TRITON_CHUNK) - 1}"
)
def test_fuzz_triton(chunk: int) -> None:
    pytest.importorskip("triton")
    _check([f"t{i}" for i in range(chunk * TRITON_CHUNK, min(TRITON_CASES, (chunk + 1) * TRITON_CHUNK))])
