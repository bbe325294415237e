"""Ulysses attention on gloo ranks against single-device qkv.attention (outputs and gradients)."""

from __future__ import annotations

import time

import pytest
import torch

from . import global_case, ok_values, spawn

TOL = {torch.float64: 1e-10, torch.float32: 2e-5}


def _cases(world):
    # (name, dtype, causal, hq, hk, backend); heads are multiples of the world size
    return [
        ("float64-full-mha", "float64", False, 2 * world, 2 * world, "chunked"),
        ("float64-causal-mha", "float64", True, 2 * world, 2 * world, "chunked"),
        ("float64-causal-gqa", "float64", True, 2 * world, world, "math"),
        ("float32-causal-gqa", "float32", True, 2 * world, world, "auto"),
    ]


def _ulysses_worker(rank, world):
    from qkv.distributed import shard, ulysses_attention

    errs = {}
    for name, dt, causal, hq, hk, backend in _cases(world):
        gqa = hq != hk
        q, k, v, do, ref, (fq, fk, fv) = global_case(99, hq, hk, 7 * world, 8, 6, getattr(torch, dt), causal, gqa)
        lq, lk, lv = (shard(t).requires_grad_() for t in (q, k, v))
        out = ulysses_attention(lq, lk, lv, is_causal=causal, enable_gqa=gqa, backend=backend)
        out.backward(shard(do))
        e = {"out": (out - shard(ref.detach())).abs().max().item()}
        for nm, local, glob in (("dq", lq, fq), ("dk", lk, fk), ("dv", lv, fv)):
            e[nm] = (local.grad - shard(glob.grad)).abs().max().item()
        errs[name] = e

    msgs = []
    for hq, hk in ((world + 1, world + 1), (2 * world, 1)):
        x, y = torch.zeros(1, hq, 4, 2), torch.zeros(1, hk, 4, 2)
        try:
            ulysses_attention(x, y, y, enable_gqa=hq != hk)
            msgs.append(None)
        except ValueError as ex:
            msgs.append(str(ex))
    return errs, msgs


@pytest.mark.parametrize("world", [2, 3, 4])
def test_ulysses_matches_single_device(world):
    t0 = time.monotonic()
    per_rank = ok_values(spawn(_ulysses_worker, world, timeout=90))
    print(f"world {world}: ulysses in {time.monotonic() - t0:.1f}s")
    failures = []
    for rank, (errs, msgs) in enumerate(per_rank):
        for name, dt, *_ in _cases(world):
            tol = TOL[getattr(torch, dt)]
            for what, err in errs[name].items():
                print(f"rank {rank} {name} {what}: {err:.2e}")
                if not err <= tol:
                    failures.append(f"rank {rank} {name} {what}: {err:.3e} > {tol}")
        assert msgs[0] is not None and f"query has {world + 1} heads, not divisible by the world size {world}" in msgs[0], msgs
        assert msgs[1] is not None and "key/value has 1 heads" in msgs[1], msgs
    assert not failures, "\n".join(failures)


def test_single_process_falls_back_to_plain_attention():
    import qkv
    from qkv.distributed import ring_attention, ulysses_attention

    q, k, v = (torch.randn(1, 2, 9, 4, dtype=torch.float64) for _ in range(3))
    ref = qkv.attention(q, k, v, is_causal=True)
    assert torch.allclose(ring_attention(q, k, v, is_causal=True), ref, atol=1e-12)
    assert torch.allclose(ulysses_attention(q, k, v, is_causal=True), ref, atol=1e-12)


def _failing_peer_worker(rank, world, where):
    """Rank 1 stops at ``where``; rank 0 reports what its own call raised and how long it took."""
    from qkv.distributed import ulysses_attention

    x = torch.randn(1, 2, 8, 4, requires_grad=True)
    # forward: a rank-local mistake, rank 1's local attention raises between the two all-to-alls
    backend = "no-such-backend" if rank == 1 and where == "the output (forward)" else "auto"
    if rank == 1:
        ulysses_attention(x, x, x, backend=backend)
        raise RuntimeError("rank 1 fails on purpose before the backward")
    t0 = time.monotonic()
    try:
        ulysses_attention(x, x, x).sum().backward()
    except RuntimeError as ex:
        return ("raised", str(ex), time.monotonic() - t0)
    return ("returned", "", time.monotonic() - t0)


@pytest.mark.parametrize("where", ["the output (forward)", "the gradients of the output (backward)"])
def test_peer_failure_names_the_all_to_all(where):
    t0 = time.monotonic()
    res = spawn(_failing_peer_worker, 2, where, timeout=45, pg_timeout_s=10)
    assert res[1][0] == "error" and ("fails on purpose" in res[1][1] or "no-such-backend" in res[1][1]), res[1]  # its own error
    assert res[0][0] == "ok", res[0]
    kind, msg, elapsed = res[0][1]
    print(f"rank 0: {kind} after {elapsed:.1f}s (spawn total {time.monotonic() - t0:.1f}s): {msg[:300]}")
    assert kind == "raised" and f"ulysses_attention: rank 0 of 2 failed in the all-to-all of {where}" in msg
    assert "Cause: " in msg and elapsed < 20
