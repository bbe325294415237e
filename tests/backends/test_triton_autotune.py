"""The launch table's autotune (:mod:`qkv.backends.triton.autotune`), on a CPU: which candidates
each kernel gets, how the budget is shared so that every kernel is reached, what a candidate that
fails to compile does, and the report whose rows paste into ``configs.py``. Timings here come
from a fake clock and a fake timer; the dry run goes through Triton's interpreter."""

from __future__ import annotations

import json

import pytest
import torch

from ..helpers import INTERPRETED

pytest.importorskip("triton")

from qkv.backends.triton import autotune, configs  # noqa: E402
from qkv.backends.triton import backend as launch  # noqa: E402

C = configs.Config
pytestmark = pytest.mark.filterwarnings("ignore:Conversion of an array with ndim > 0 to a scalar:DeprecationWarning")  # the interpreter's


def test_every_kernel_has_candidates_fit_for_hopper():
    for d, kind, _ in autotune.TARGETS:
        cands = autotune.CANDIDATES[kind, d]
        assert 2 <= len(cands) <= 4, (kind, d)  # a compile each: short lists
        for c in cands:
            assert c.num_warps in (4, 8) and 1 <= c.num_stages <= 4, c
            assert c.BLOCK_N in (32, 64, 128, 256) and (c.BLOCK_M >= 64 or kind == "decode"), c  # 64-row tiles for wgmma
    assert {k for _, k, _ in autotune.TARGETS} == set(configs.KINDS)  # every kernel, decoding included
    assert {(k, d) for d, k, _ in autotune.TARGETS} == set(autotune.CANDIDATES)
    # what the H200 measured fastest for the d128 forward, and Flex's Hopper forward defaults
    assert C(64, 64, 4, 3) in autotune.CANDIDATES["fwd", 128] and C(128, 64, 8, 3) in autotune.CANDIDATES["fwd", 128]
    assert C(128, 128, 4, 3) in autotune.CANDIDATES["fwd", 64]


def test_the_current_entry_is_timed_first_once():
    cur = configs.lookup("sm90", 128, 128, 2, "fwd", "band")
    assert cur == C(64, 64, 4, 3)  # the row pasted from the H200's autotune
    got = autotune.candidates("fwd", 128, cur, dry=False)
    assert got[0] == cur and len(got) == len(set(got)) == len(autotune.CANDIDATES["fwd", 128])
    other = C(128, 64, 8, 2)
    assert autotune.candidates("fwd", 128, other, dry=False)[0] == other
    assert autotune.candidates("fwd", 128, other, dry=True) == autotune.DRY_CANDIDATES


@pytest.mark.parametrize("version,works", [("3.6.0", False), ("3.6.1", False), ("3.5.1", False), ("3.7.0", True), ("3.10.0", True),
                                           ("4.0.0+git1234", True), ("nightly", False)])  # fmt: skip
def test_warp_specialisation_is_not_tried_on_triton_3_6(version, works):
    assert autotune.warp_specialization_works(version) is works


class _Clock:
    """Seconds that pass only when a candidate is timed (each costs ``step``)."""

    def __init__(self, step: float):
        self.now, self.step = 0.0, step

    def __call__(self) -> float:
        return self.now

    def tick(self) -> None:
        self.now += self.step


def _fake(monkeypatch, clock: _Clock, broken=()):
    """Targets whose 'kernel' is a matmul, candidates whose time is a function of their tiles;
    configs in ``broken`` fail as a compile error would."""
    x = torch.randn(8, 8, generator=torch.Generator().manual_seed(0))
    monkeypatch.setattr(autotune, "_inputs", lambda d, kind, dry, device: (x, x, x))

    def runner(kind, mask, q, k, v):
        def run():
            cfg = launch._OVERRIDE.get(kind)
            if cfg in broken:
                raise RuntimeError("PassManager::run failed")
            return q @ k

        return run

    def timer(dry):
        def time_ms(fn):
            clock.tick()
            cfg = launch._OVERRIDE[next(iter(launch._OVERRIDE))]
            return 1.0 + 1.0 / (cfg.BLOCK_M * cfg.BLOCK_N * cfg.num_stages)

        return time_ms

    monkeypatch.setattr(autotune, "_runner", runner)
    monkeypatch.setattr(autotune, "_timer", timer)


def test_a_short_budget_still_reaches_every_kernel(monkeypatch):
    """Ten targets, 20 s, 1 s a candidate: each target gets its share and at least the baseline
    and one challenger, so the backward and decoding kernels are reached (the H200's run timed
    six forward candidates and stopped)."""
    clock = _Clock(1.0)
    _fake(monkeypatch, clock)
    saved = []
    data = autotune.tune(20, dry=False, arch="sm90", log=lambda *_: None, save=lambda d: saved.append(json.dumps(d)), clock=clock)
    assert [tuple(r["target"]) for r in data["results"]] == autotune.TARGETS and not data["unmeasured"]
    for r in data["results"]:
        timed = [c for c in r["candidates"] if "ms" in c]
        assert len(timed) >= autotune.MIN_CANDIDATES and r["candidates"][0]["config"] == r["default"], r
        assert r["best"] == min(timed, key=lambda c: c["ms"])
    assert len(saved) == sum(len(r["candidates"]) for r in data["results"]) + 1  # after every candidate, and at the end
    first = json.loads(saved[0])  # what a run killed after one candidate leaves: the rest unmeasured
    assert [tuple(t) for t in first["unmeasured"]] == autotune.TARGETS[1:] and len(first["results"]) == 1
    assert launch._OVERRIDE == {}


def test_a_long_budget_times_every_candidate_and_skips_what_cannot_compile(monkeypatch):
    clock = _Clock(1.0)
    broken = {C(128, 128, 4, 3)}
    _fake(monkeypatch, clock, broken)
    data = autotune.tune(1000, dry=False, arch="sm90", log=lambda *_: None, clock=clock)
    fwd64 = next(r for r in data["results"] if r["target"] == [64, "fwd", "band"])
    failed = [c for c in fwd64["candidates"] if "error" in c]
    assert [c["config"] for c in failed] == [list(C(128, 128, 4, 3))] and "PassManager::run failed" in failed[0]["error"]
    fwd128 = next(r for r in data["results"] if r["target"] == [128, "fwd", "full"])
    ws = [c for c in fwd128["candidates"] if c["config"][4]]
    assert ws and all(c.get("skipped") == autotune.WS_SKIPPED for c in ws)  # Triton 3.6 here
    for r in data["results"]:
        assert len(r["candidates"]) == len(autotune.candidates(r["target"][1], r["target"][0], C(*r["default"]), False))
    text = "\n".join(autotune.report(data))
    assert "Failed: `(128, 128, 4, 3, False)` d64 fwd: RuntimeError: PassManager::run failed" in text
    assert "Warp-specialised candidates skipped: Triton 3.6's NVGPUWarpSpecialization pass" in text


def test_a_spent_budget_leaves_the_rest_unmeasured(monkeypatch):
    clock = _Clock(30.0)
    _fake(monkeypatch, clock)
    data = autotune.tune(50, dry=False, arch="sm90", log=lambda *_: None, kinds=("fwd", "decode"), clock=clock)
    done = [tuple(r["target"]) for r in data["results"]]
    assert done and all(k in ("fwd", "decode") for _, k, _ in done)
    assert done + [tuple(t) for t in data["unmeasured"]] == [t for t in autotune.TARGETS if t[1] in ("fwd", "decode")]
    assert data["unmeasured"] and "| unmeasured |" in "\n".join(autotune.report(data))


def test_report_pastes_into_the_table():
    best = {"config": [128, 128, 8, 2, True], "ms": 1.0}
    data = {"arch": "sm90", "dry_run": False, "seconds": 30, "unmeasured": [[64, "decode", "any"]], "results": [
        {"target": [128, "fwd", "band"], "default": [128, 64, 8, 2, False], "best": best,
         "candidates": [{"config": [128, 64, 8, 2, False], "ms": 1.5}, best, {"config": [64, 64, 4, 3, False], "error": "OutOfResources"}]}]}  # fmt: skip
    text = "\n".join(autotune.report(data))
    assert "| 128 | fwd | band | (128, 64, 8, 2, False) | 1.500 | (128, 128, 8, 2, True) | 1.000 | 1.50× | 2 | 1 |" in text
    assert "| 64 | decode | any | — | unmeasured | — | unmeasured | — | 0 | 0 |" in text
    block = text.split("```python\n")[1].split("```")[0]
    ns = {"C": configs.Config}
    exec("T = {\n" + block + "}", ns)
    assert ns["T"] == {("sm90", 128, 2, "fwd", "band"): configs.Config(128, 128, 8, 2, True)}
    assert autotune.report(None) == ["Autotune: unmeasured (the step did not run or wrote nothing)."]


def test_the_command_refuses_unknown_kernels(tmp_path):
    with pytest.raises(SystemExit):
        autotune.main(["--out", str(tmp_path / "t.json"), "--kinds", "fwd,nope", "--dry-run"])


@pytest.mark.slow  # (the GPU check's dry run runs it too)
@pytest.mark.skipif(not INTERPRETED, reason="the dry run is the interpreter's")
def test_dry_run_reaches_every_kernel_and_measures_nothing(tmp_path):
    out = tmp_path / "tune.json"
    assert autotune.main(["--budget", "120", "--dry-run", "--out", str(out)]) == 0
    data = json.loads(out.read_text())
    assert data["dry_run"] and [tuple(r["target"]) for r in data["results"]] == autotune.DRY_TARGETS
    assert {r["target"][1] for r in data["results"]} == set(configs.KINDS)
    for r in data["results"]:
        assert r["best"] is not None and all("ms" in c for c in r["candidates"]), r
    text = "\n".join(autotune.report(data))
    assert "nothing measured" in text and "```python" not in text  # no table from a dry run
    assert launch._OVERRIDE == {}  # every override was undone
