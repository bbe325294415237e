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


@pytest.mark.slow  # process groups (10 s each; the ring's two-process case stays in the quick tier); CI's slow tier runs it
@pytest.mark.parametrize("world", [2, 3, 4])
def test_ulysses_matches_single_device(world):
    t0 = time.monotonic()
    per_rank = ok_values(spawn(_ulysses_worker, world))
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


@pytest.mark.slow  # process groups that fail on purpose (9 s each); CI's slow tier runs them
@pytest.mark.parametrize("where", ["the output (forward)", "the gradients of the output (backward)"])
def test_peer_failure_names_the_all_to_all(where):
    t0 = time.monotonic()
    res = spawn(_failing_peer_worker, 2, where, pg_timeout_s=60)  # gloo reports the closed peer at once; the timeout only bounds a miss
    assert res[1][0] == "error" and ("fails on purpose" in res[1][1] or "no-such-backend" in res[1][1]), res[1]  # its own error
    assert res[0][0] == "ok", res[0]
    kind, msg, elapsed = res[0][1]
    print(f"rank 0: {kind} after {elapsed:.1f}s (spawn total {time.monotonic() - t0:.1f}s): {msg[:300]}")
    assert kind == "raised" and f"ulysses_attention: rank 0 of 2 failed in the all-to-all of {where}" in msg
    assert "Cause: " in msg


# ---- the caller's shapes and flags, checked before any exchange ------------------------------------

# (Hq, Hk, enable_gqa) per rank's shard on 2 ranks: what qkv.attention refuses, ulysses_attention
# refuses with the same words and the caller's head counts (not the per-rank Hq/W, Hk/W)
_REFUSED = [
    (4, 2, False),  # Hk = W: after the exchange one key/value head per rank would broadcast silently
    (8, 4, False),  # per rank 4 and 2: the message must quote 8 and 4
    (6, 4, True),  # 6 is not a multiple of 4
]


def _refusal_worker(rank, world):
    """Each refused call on every rank: its ValueError, qkv.attention's on the same shards, and
    how many all-to-alls it started (none may start: a rank that raised after one would leave
    its peers waiting)."""
    import torch.distributed as dist

    import qkv
    from qkv.distributed import ulysses_attention

    exchanges = []
    real = dist.all_to_all_single

    def counted(*args, **kwargs):
        exchanges.append(args[0].shape)
        return real(*args, **kwargs)

    dist.all_to_all_single = counted
    found = []
    try:
        for hq, hk, gqa in _REFUSED:
            g = torch.Generator().manual_seed(rank)
            q = torch.randn(2, hq, 4, 8, generator=g)
            k, v = torch.randn(2, hk, 4, 8, generator=g), torch.randn(2, hk, 4, 8, generator=g)
            before = len(exchanges)
            try:
                ulysses_attention(q, k, v, enable_gqa=gqa)
                got = None
            except ValueError as ex:
                got = str(ex)
            try:
                qkv.attention(q, k, v, enable_gqa=gqa)
                want = None
            except ValueError as ex:
                want = str(ex)
            found.append((got, want, len(exchanges) - before))
        # the same shapes with the flag (where qkv.attention takes them) still run, and exchange
        q, k = torch.randn(2, 4, 4, 8), torch.randn(2, 2, 4, 8)
        out = ulysses_attention(q, k, k, enable_gqa=True)
        found.append((tuple(out.shape), None, len(exchanges)))
    finally:
        dist.all_to_all_single = real
    return found


@pytest.mark.slow  # starts process groups (9 s); CI's slow tier runs it
def test_ulysses_refuses_what_attention_refuses_with_the_callers_numbers_before_any_exchange():
    per_rank = ok_values(spawn(_refusal_worker, 2))
    for rank, found in enumerate(per_rank):
        for (hq, hk, gqa), (got, want, exchanges) in zip(_REFUSED, found):
            print(f"rank {rank} Hq={hq} Hk={hk} enable_gqa={gqa}: {got!r} ({exchanges} all-to-alls)")
            assert want is not None, f"qkv.attention takes Hq={hq}, Hk={hk}, enable_gqa={gqa}: not a refused case"
            assert got == want, f"rank {rank}, Hq={hq} Hk={hk} enable_gqa={gqa}: ulysses_attention raised {got!r}, qkv.attention {want!r}"
            assert f"key has {hk} heads but query has {hq}" in got, got
            assert exchanges == 0, f"rank {rank} started {exchanges} all-to-alls before refusing Hq={hq}, Hk={hk}"
        shape, _, exchanges = found[-1]
        assert shape == (2, 4, 4, 8) and exchanges >= 2, (
            f"rank {rank}: the accepted GQA call gave {shape} after {exchanges} all-to-alls (want (2, 4, 4, 8), at least 2)"
        )
