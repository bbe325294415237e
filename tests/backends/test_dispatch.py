"""auto's table (qkv.backends.dispatch): the engine its log names is the engine that ran, on every
row of the table and after an engine fails while running; the rows that decide calls on a GPU
cite their measurements; the orders kept per shape are the table's; and the path of a plain call
issues no tensor operation of its own besides the engine's kernel."""

from __future__ import annotations

import itertools
import logging
import pathlib
from typing import Optional

import pytest
import torch
from torch.utils._python_dispatch import TorchDispatchMode

import qkv
from qkv import functional
from qkv.backends import BACKENDS, ROUTES, dispatch
from qkv.backends.base import Backend, EngineFailed
from qkv.nonfinite import Checked
from qkv.sparse import strided

from ..helpers import make_qkv

ROOT = pathlib.Path(qkv.__file__).resolve().parents[1]


# ---- what ran, and what the log says ran ------------------------------------------------------


class _Ran:
    """The engines whose forward ran, in order, each with whether it answered (False: it raised),
    and the fast path's direct SDPA call as ``sdpa``."""

    def __init__(self) -> None:
        self.calls: list[tuple[str, bool]] = []

    def wrap(self, name: str, forward):  # type: ignore[no-untyped-def]
        def run(call):  # type: ignore[no-untyped-def]
            try:
                out = forward(call)
            except BaseException:
                self.calls.append((name, False))
                raise
            self.calls.append((name, True))
            return out

        return run


def _direct_sdpa(record: _Ran, monkeypatch) -> None:
    """Record the fast path's own SDPA call (it calls torch's kernel without a backend)."""
    direct = functional._sdpa

    def sdpa(*args, **kw):  # type: ignore[no-untyped-def]
        return record.wrap("sdpa", lambda _: direct(*args, **kw))(None)

    monkeypatch.setattr(functional, "_sdpa", sdpa)


def _said(caplog) -> list[tuple[str, str]]:
    return [(r.qkv_engine, r.getMessage()) for r in caplog.records if r.name == "qkv" and hasattr(r, "qkv_engine")]


def assert_log_tells(caplog, record: _Ran) -> list[str]:
    """The engines the debug log says answered are, in order, those that did; each line says so in
    words; each engine that failed while running has its warning. Returns the engines that answered."""
    said = _said(caplog)
    answered = [name for name, ok in record.calls if ok]
    print("ran:", record.calls, "\nlog:", *(m for _, m in said), sep="\n  ")
    assert [name for name, _ in said] == answered
    for name, message in said:
        assert f"auto ran {name}" in message or f"backend {name} ran" in message, message
    failed = [name for name, ok in record.calls if not ok]
    warned = [r.getMessage() for r in caplog.records if r.name == "qkv" and r.levelno == logging.WARNING]
    assert len(warned) == len(failed)
    for name, message in zip(failed, warned):
        assert f": {name} failed (" in message and "auto goes on to the next engine" in message, message
    return answered


# ---- every row, on the CPU, with the real engines ---------------------------------------------


def _python_score(s, b, h, i, j):  # noqa: ANN001, ANN202
    return s + 0.01 * (i - j)


def _cpu_cases() -> dict[str, tuple[tuple, dict]]:
    """One call per row of the table that decides CPU calls: (q, k, v), keywords."""
    small = make_qkv(1, 2, 2, 16, 16, 8, seed=1)
    cases: dict[str, tuple[tuple, dict]] = {
        "shortcut": (small, dict(is_causal=True)),
        "small, validated": (small, dict(is_causal="top_left")),
        "decoding": (make_qkv(1, 2, 2, 1, 600, 16, seed=2), {}),
        "causal prefill": (make_qkv(1, 1, 1, 512, 512, 16, seed=3), dict(is_causal="top_left")),
        "16-bit lse": (make_qkv(1, 2, 2, 32, 32, 16, dtype=torch.bfloat16, seed=4), dict(return_lse=True)),
        "values of another dim": (make_qkv(1, 1, 1, 256, 256, 16, dv=8, seed=5), dict(is_causal=None)),
        "window": (make_qkv(1, 1, 1, 300, 300, 16, seed=6), dict(window=(8, 0))),
        "large dense mask": (make_qkv(1, 8, 8, 1024, 1024, 8, requires_grad=True, seed=7), dict(window=(4, 0))),
        "plain": (make_qkv(1, 1, 1, 256, 256, 16, seed=8), dict(is_causal=None)),
        "gradients": (make_qkv(1, 2, 2, 16, 16, 8, requires_grad=True, seed=9), dict(is_causal="top_left")),
        # compiled Flex first: it fails while running here, and auto goes on to chunked
        "python score function": (make_qkv(1, 1, 1, 512, 512, 32, seed=10), dict(score_mod=_python_score)),
    }
    cases["block-sparse"] = (make_qkv(1, 1, 1, 256, 256, 16, requires_grad=True, seed=12),
                             dict(attn_mask=strided(256, 64, 2)))  # fmt: skip
    return cases


CPU_CASES = _cpu_cases()


@pytest.mark.parametrize("case", list(CPU_CASES))
def test_the_log_names_the_engine_that_ran_on_the_cpu(case, caplog, monkeypatch):
    """Real engines, one call per row: what the debug log says ran is what ran (the fast path's
    direct SDPA call included), and a compiled-Flex failure while running is a warning followed
    by the engine that answered instead."""
    record = _Ran()
    for name, backend in BACKENDS.items():
        monkeypatch.setattr(backend, "forward", record.wrap(name, backend.forward))
    _direct_sdpa(record, monkeypatch)
    if case == "python score function":
        def broken(call):  # type: ignore[no-untyped-def]
            raise EngineFailed("flex: a compiler error, as torch's would be")

        monkeypatch.setattr(BACKENDS["flex"], "forward", record.wrap("flex", broken))
    (q, k, v), kw = CPU_CASES[case]
    with caplog.at_level(logging.DEBUG, logger="qkv"):
        qkv.attention(q, k, v, **kw)
    answered = assert_log_tells(caplog, record)
    assert len(answered) == 1
    if case == "python score function" and BACKENDS["flex"].available() is None:
        assert record.calls[0] == ("flex", False) and answered == ["chunked"]


def test_every_cpu_row_has_a_case():
    """The cases above reach every row that decides a CPU call (a new row needs its case)."""
    hit = set()
    for (q, k, v), kw in CPU_CASES.values():
        call = qkv.call.validate(q, k, v, **kw)
        hit.add(id(dispatch.route(call)))
        hit.update(id(r) for r in ROUTES if r.last and r.applies(call))
    for row in [*_deciding_rows("cpu"), *(r for r in ROUTES if r.last)]:
        assert id(row) in hit, f"no case for the row: {row.why}"


def test_a_float64_answer_is_told_in_order(caplog, monkeypatch):
    """Finite inputs whose float32 scores all round to -inf: the shortcut's SDPA ran, then the
    validated call's engine, then the float64 call's; the log tells each, in that order."""
    record = _Ran()
    for name, backend in BACKENDS.items():
        monkeypatch.setattr(backend, "forward", record.wrap(name, backend.forward))
    _direct_sdpa(record, monkeypatch)
    q = torch.tensor([[[[1e20, 0.0], [1e20, 0.0]]]])  # (two rows: not a decoding call, the shortcut takes it)
    k = torch.tensor([[[[-1e20, 0.0], [-2e20, 0.0]]]])
    v = torch.tensor([[[[1.0, 0.0], [0.0, 1.0]]]])
    with caplog.at_level(logging.DEBUG, logger="qkv"):
        out = qkv.attention(q, k, v)
    assert torch.allclose(out, torch.tensor([[[[1.0, 0.0], [1.0, 0.0]]]]))
    answered = assert_log_tells(caplog, record)
    assert len(answered) == 3 and answered[0] == "sdpa"
    lines = [r.getMessage() for r in caplog.records if r.name == "qkv"]
    assert any("may have overflowed" in line for line in lines) and any("runs in float64" in line for line in lines)
    assert "float64" in _said(caplog)[-1][1]  # the answer's engine ran the float64 call


# ---- the rows that decide GPU calls: routed as on CUDA, engines stubbed -------------------------


class _Stub(Backend):
    """An engine that answers ones (or fails while running, or declines with a reason)."""

    def __init__(self, name: str, reason: Optional[str] = None, fails: bool = False) -> None:
        self.NAME, self.reason, self.fails, self.failed = name, reason, fails, False  # type: ignore[misc]

    def not_supported_reasons(self, call):  # type: ignore[no-untyped-def]
        return [r for r in (self.reason, "it failed before" if self.failed else None) if r]

    def forward(self, call):  # type: ignore[no-untyped-def]
        if self.fails:
            self.failed = True
            raise EngineFailed(f"{self.NAME}: no kernel for this call")
        out = torch.ones(*call.batch_shape, call.hq, call.nq, call.dv)
        return Checked(out, torch.zeros(*call.batch_shape, call.hq, call.nq) if call.return_lse else None)


def _as_on_cuda(monkeypatch) -> None:
    """The table read as for CUDA tensors (the calls stay on the CPU: the stubs run them)."""
    of = dispatch.Shape.of
    monkeypatch.setattr(dispatch.Shape, "of", staticmethod(lambda call: of(call)._replace(device="cuda")))


CUDA_CASES: dict[str, tuple[tuple, dict]] = {
    "sinks": (make_qkv(1, 2, 2, 16, 16, 8, seed=20), dict(is_causal=True, sinks=torch.zeros(2))),
    "decoding": (make_qkv(1, 4, 2, 1, 64, 16, seed=21), dict(enable_gqa=True)),
    "window": (make_qkv(1, 2, 2, 64, 64, 16, seed=22), dict(window=(8, 0))),
    "score function": (make_qkv(1, 2, 2, 64, 64, 16, seed=23), dict(score_mod=_python_score)),
    "plain": (make_qkv(1, 2, 2, 64, 64, 16, seed=24), dict(is_causal="top_left")),
}


def _cuda_row(case: str):  # type: ignore[no-untyped-def]
    (q, k, v), kw = CUDA_CASES[case]
    call = qkv.call.validate(q, k, v, **kw)
    return dispatch.route(call, dispatch.Shape.of(call)._replace(device="cuda"))


@pytest.mark.parametrize("what", ["answers", "declines", "fails", "all fail"])
@pytest.mark.parametrize("case", list(CUDA_CASES))
def test_the_log_names_the_engine_that_ran_on_a_gpu_route(case, what, caplog, monkeypatch):
    """Each row that decides CUDA calls, with its first engine answering, declining (a reason),
    failing while running (EngineFailed) or every engine failing: the log names the engine whose
    forward answered — the second of the order where the first did not — and nothing where
    none did."""
    _as_on_cuda(monkeypatch)
    order = _cuda_row(case).order
    stubs = {name: _Stub(name, fails=what == "all fail") for name in BACKENDS}
    first = stubs[order[0]]
    if what == "declines":
        first.reason = "a reason against it"
    elif what == "fails":
        first.fails = True
    record = _Ran()
    for name, stub in stubs.items():
        stub.forward = record.wrap(name, stub.forward)  # type: ignore[method-assign]
        monkeypatch.setitem(BACKENDS, name, stub)
    (q, k, v), kw = CUDA_CASES[case]
    with caplog.at_level(logging.DEBUG, logger="qkv"):
        if what == "all fail":
            with pytest.raises(qkv.BackendError, match="no backend can run this call") as info:
                qkv.attention(q, k, v, **kw)
            assert all(f"{name} failed" in str(info.value) for name in order)
        else:
            qkv.attention(q, k, v, **kw)
    answered = assert_log_tells(caplog, record)
    assert [name for name, _ in record.calls] == (list(order) if what == "all fail" else [order[0]] if what == "answers"
                                                  else [order[0], order[1]] if what == "fails" else [order[1]])  # fmt: skip
    assert answered == ([] if what == "all fail" else [order[0]] if what == "answers" else [order[1]])
    if what == "declines":
        assert f"cannot run it: {order[0]}: a reason against it" in _said(caplog)[0][1]


def test_every_gpu_row_has_a_case():
    cases = {id(_cuda_row(c)) for c in CUDA_CASES}
    for row in _gpu_rows():
        assert id(row) in cases, f"no case for the row: {row.why}"


# ---- the rows that decide GPU calls cite their measurements -------------------------------------


def _shapes(device: str) -> list[dispatch.Shape]:
    """Shapes over every field the rows read (a few sizes each)."""
    sizes = ((1, 1), (1, 600), (8, 64), (128, 128), (512, 512), (4096, 4096), (64, 8))
    out = []
    for (nq, nk), dtype, causal, mask, grad, lse, positional, block, score, sinks, dropout, br in itertools.product(
        sizes, (torch.bfloat16, torch.float32, torch.float64), (False, True), (None, "bool", "float"), (False, True),
        (False, True), (False, True), (False, True), (None, "builtin", "python"), (False, True), (False, True), (False, True),
    ):  # fmt: skip
        out.append(dispatch.Shape(device, dtype, nq, nk, 8, 64, 64 if nq != 64 else 32, causal, mask, grad, lse,
                                  positional, block, score, sinks, dropout, br))  # fmt: skip
    return out


def _deciding_rows(device: str) -> list[dispatch.Route]:
    """The rows that decide some call on ``device``: those that apply to some shape there, up to
    the first that applies to every one (a ``last`` row only moves engines)."""
    shapes, rows = _shapes(device)[::7], []
    for row in ROUTES:
        if row.last:
            continue
        applies = [row.when(s) for s in shapes]
        if any(applies):
            rows.append(row)
        if all(applies):
            break
    return rows


def _gpu_rows() -> list[dispatch.Route]:
    return _deciding_rows("cuda")


def test_every_gpu_row_cites_its_measurement():
    """Each row that decides calls on a GPU names the report it was measured in (a file in this
    repository), the H200 run, and numbers from it."""
    rows = _gpu_rows()
    assert len(rows) >= 4
    for row in rows:
        assert row.measured, f"the row {row.why!r} decides GPU calls without a measurement"
        path = row.measured.split(" ")[0]
        assert path.startswith("bench/results/") and (ROOT / path).is_file(), row.measured
        assert any(ch.isdigit() for ch in row.measured.split(":", 1)[1]), row.measured
        assert "H200" in row.measured
    assert rows[-1].when(dispatch.Shape("cuda", torch.float32, 8, 8, 1, 8, 8, False, None, False))  # the catch-all, last


# ---- the orders kept per shape are the table's ---------------------------------------------------


def test_kept_orders_are_the_tables(monkeypatch):
    """order_names keeps an answer per Shape only where no applying row reads the call: the kept
    answer equals the table's own for calls of every case, asked twice; a threshold assigned
    anew empties what was kept."""
    for (q, k, v), kw in [*CPU_CASES.values(), *CUDA_CASES.values()]:
        call = qkv.call.validate(q, k, v, **kw)
        fresh, _ = dispatch._order(call, dispatch.Shape.of(call))
        assert tuple(map(tuple, dispatch.order_names(call))) == fresh
        assert tuple(map(tuple, dispatch.order_names(call))) == fresh
    q, k, _ = make_qkv(1, 2, 2, 128, 128, 64, seed=30)
    v = torch.randn(1, 2, 128, 32)
    call = qkv.call.validate(q, k, v)
    assert dispatch.order_names(call)[0][0] == "sdpa"
    monkeypatch.setattr(dispatch, "VALUE_DIM_MIN_SCORES", 128 * 128)
    assert dispatch.order_names(call)[0][0] == "chunked"


# ---- the host path issues no tensor operation of its own ------------------------------------------

class _Ops(TorchDispatchMode):
    def __init__(self) -> None:
        super().__init__()
        self.ops: list[str] = []

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):  # type: ignore[no-untyped-def]
        self.ops.append(func.overloadpacket.__name__)
        return func(*args, **(kwargs or {}))


@pytest.mark.parametrize("kw", [dict(is_causal="top_left"), dict(is_causal=None), dict(is_causal=True)], ids=str)
def test_a_plain_call_issues_only_the_engines_kernel(kw, monkeypatch):
    """Validation, the choice of engine and SDPA's launch preparation issue no tensor operation
    (no view, no reduction, no read-back): with the non-finite rule and the float64 check set
    aside (they are measured apart), a plain call validated and routed to sdpa issues SDPA's
    kernel and nothing else. Before, validation alone made a view of each input."""
    from qkv.backends import base

    monkeypatch.setattr(base, "guard", lambda q, k, v, out, lse=None, **_: (out, lse))
    monkeypatch.setattr(functional, "guard", lambda q, k, v, out, lse=None, **_: (out, lse))
    monkeypatch.setattr(functional, "overflowed_float32", lambda call, out: False)
    monkeypatch.setattr(functional.overflow, "suspect", lambda *a, **k: False)
    q, k, v = make_qkv(1, 8, 8, 16, 16, 16, seed=31)
    qkv.attention(q, k, v, **kw)
    with _Ops() as seen:
        qkv.attention(q, k, v, **kw)
    assert seen.ops == ["_scaled_dot_product_flash_attention_for_cpu"], seen.ops


def test_a_plain_calls_checks_are_kept_per_kind():
    """validate keeps a plain call's checked fields per kind (shapes, dtypes, devices, the scalar
    arguments and their types): a kept kind answers the same fields, and every argument its
    checks read still decides — a value of another type, another head count with enable_gqa off,
    a 0-d tensor scale changed in place."""
    from qkv.call import validate

    q, k, v = make_qkv(1, 4, 2, 8, 8, 16, seed=32)
    first = validate(q, k, v, is_causal=True, enable_gqa=True)
    again = validate(q, k, v, is_causal=True, enable_gqa=True)
    assert again is not first and again.query is q and again.key is k and again.value is v
    assert {f: getattr(again, f) for f in ("batch_shape", "hq", "hk", "nq", "nk", "d", "dv", "scale", "causal", "alignment")} == {
        f: getattr(first, f) for f in ("batch_shape", "hq", "hk", "nq", "nk", "d", "dv", "scale", "causal", "alignment")}
    with pytest.raises(ValueError, match="is_causal=1 is not understood"):
        validate(q, k, v, is_causal=1, enable_gqa=True)  # 1 == True, but not a bool
    with pytest.raises(ValueError, match="pass enable_gqa=True"):
        validate(q, k, v, is_causal=True)
    with pytest.raises(ValueError, match=r"dropout_p=1.5 must be in \[0, 1\)"):
        validate(q, k, v, None, 1.5, enable_gqa=True)
    scale = torch.tensor(0.5)
    assert validate(q, k, v, scale=scale, enable_gqa=True).scale == 0.5
    scale.fill_(0.25)
    assert validate(q, k, v, scale=scale, enable_gqa=True).scale == 0.25
    flat = validate(q[0, 0], k[0, 0], v[0, 0])  # 2-D inputs, and ranks that differ, still checked whole
    assert flat.hq == 1 and validate(q, k[0], v[0], enable_gqa=True).batch_shape == (1,)


def test_the_plain_shortcuts_kept_decision_follows_the_table(monkeypatch):
    """plain_sdpa_call keeps its answer per Shape; a new table (or threshold) empties what was
    kept, so the shortcut never answers from rows that are gone."""
    q, k, v = make_qkv(1, 2, 2, 8, 8, 16, seed=33)
    assert dispatch.plain_sdpa_call(q, k, v, None, 0.0, True, None)
    assert dispatch.plain_sdpa_call(q, k, v, None, 0.0, True, None)  # kept
    math_first = dispatch.Route(when=lambda s: True, order=("math", "sdpa"), why="a test's table")
    monkeypatch.setattr(dispatch, "ROUTES", (math_first,))
    assert not dispatch.plain_sdpa_call(q, k, v, None, 0.0, True, None)
    monkeypatch.undo()
    assert dispatch.plain_sdpa_call(q, k, v, None, 0.0, True, None)
