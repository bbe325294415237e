"""Ring attention on gloo ranks against single-device qkv.attention (outputs and gradients)."""

from __future__ import annotations

import os
import time

import pytest
import torch

from qkv.distributed import shard_local, unshard_local
from qkv.distributed.layout import check_length, chunk_slices

from . import global_case, ok_values, spawn

TOL = {torch.float64: 1e-10, torch.float32: 2e-5}

# (name, dtype, causal, layout, hq, hk, backend)
RING_CASES = [
    (f"{dt}-{'causal' if c else 'full'}-{lay}-{'gqa' if hk != 4 else 'mha'}-{be}", dt, c, lay, 4, hk, be)
    for dt in ("float64",)
    for c in (False, True)
    for lay in ("contiguous", "zigzag")
    for hk in (4, 2)
    for be in ("chunked",)
] + [
    ("float64-causal-zigzag-mha-math", "float64", True, "zigzag", 4, 4, "math"),
    ("float64-bottom_right-contiguous-mha-auto", "float64", "bottom_right", "contiguous", 4, 4, "auto"),
    ("float32-causal-zigzag-gqa-chunked", "float32", True, "zigzag", 4, 2, "chunked"),
    ("float32-full-contiguous-mha-auto", "float32", False, "contiguous", 4, 4, "auto"),
]


def _ring_worker(rank, world, cases):
    import qkv
    from qkv.distributed import ring_attention, shard, unshard

    errs = {}
    for name, dt, causal, layout, hq, hk, backend in cases:
        gqa = hq != hk
        q, k, v, do, ref, (fq, fk, fv) = global_case(1234, hq, hk, 10 * world, 8, 5, getattr(torch, dt), causal, gqa)

        lq, lk, lv = (shard(t, dim=-2, layout=layout).requires_grad_() for t in (q, k, v))
        out = ring_attention(lq, lk, lv, is_causal=causal, enable_gqa=gqa, backend=backend, layout=layout)
        out.backward(shard(do, layout=layout))
        full = unshard(out.detach(), layout=layout)
        e = {
            "out": (out - shard(ref.detach(), layout=layout)).abs().max().item(),
            "unshard": (full - ref.detach()).abs().max().item(),
        }
        for nm, local, glob in (("dq", lq, fq), ("dk", lk, fk), ("dv", lv, fv)):
            e[nm] = (local.grad - shard(glob.grad, layout=layout)).abs().max().item()
        errs[name] = e

    if world == 4:
        # two independent rings on sub-groups {0, 1} and {2, 3}: group ranks differ from global ranks
        import torch.distributed as dist

        groups = [dist.new_group([0, 1]), dist.new_group([2, 3])]
        grp = groups[rank // 2]
        g = torch.Generator().manual_seed(77 + rank // 2)  # each sub-group its own sequence
        q, k, v, do = (torch.randn(2, h, 24, 8, generator=g, dtype=torch.float64) for h in (4, 2, 2, 4))  # GQA 4/2
        fq, fk, fv = (t.clone().requires_grad_() for t in (q, k, v))
        ref = qkv.attention(fq, fk, fv, is_causal=True, enable_gqa=True, backend="math")
        ref.backward(do)
        lq, lk, lv = (shard(t, grp, layout="zigzag").requires_grad_() for t in (q, k, v))
        out = ring_attention(lq, lk, lv, group=grp, is_causal=True, enable_gqa=True, layout="zigzag")
        out.backward(shard(do, grp, layout="zigzag"))
        e = {"out": (unshard(out.detach(), grp, layout="zigzag") - ref.detach()).abs().max().item()}
        for nm, local, glob in (("dq", lq, fq), ("dk", lk, fk), ("dv", lv, fv)):
            e[nm] = (local.grad - shard(glob.grad, grp, layout="zigzag")).abs().max().item()
        errs["float64-subgroup-causal-zigzag-gqa"] = e

    # strided local shards without gradients: auto takes torch's lse kernel, which must read
    # the strides (it once read a transposed q as if it were contiguous)
    q, k, v, _, ref, _ = global_case(99, 4, 4, 10 * world, 8, 8, torch.float64, True, False)
    lq, lk, lv = (shard(t, layout="zigzag") for t in (q, k, v))
    lq = lq.transpose(-1, -2).contiguous().transpose(-1, -2)  # same values, column-major
    lv = torch.stack([lv, lv], -1).flatten(-2)[..., ::2]  # same values, strided last dim
    with torch.no_grad():
        out = ring_attention(lq, lk, lv, is_causal=True, layout="zigzag")
    errs["float64-extra-strided-nograd-auto"] = {"out": (out - shard(ref.detach(), layout="zigzag")).abs().max().item()}

    # uneven lengths are rejected with a message that says how to fix them
    msgs = []
    for n, layout in ((10 * world + 1, "zigzag"), (10 * world + 1, "contiguous")):
        try:
            shard(torch.zeros(1, 1, n, 2), layout=layout)
            msgs.append(None)
        except ValueError as ex:
            msgs.append(str(ex))
    try:
        x = torch.zeros(1, 1, 3, 2)
        ring_attention(x, x, x, is_causal=True, layout="zigzag")
        msgs.append(None)
    except ValueError as ex:
        msgs.append(str(ex))
    return errs, msgs


@pytest.mark.parametrize("world", [2, pytest.param(3, marks=pytest.mark.slow), pytest.param(4, marks=pytest.mark.slow)])
def test_ring_matches_single_device(world):
    t0 = time.monotonic()
    per_rank = ok_values(spawn(_ring_worker, world, RING_CASES))
    print(f"world {world}: {len(RING_CASES)} cases in {time.monotonic() - t0:.1f}s")
    failures = []
    for rank, (errs, msgs) in enumerate(per_rank):
        names = [(name, dt) for name, dt, *_ in RING_CASES] + [(n, "float64") for n in errs if n.startswith(("float64-subgroup", "float64-extra"))]
        assert world != 4 or "float64-subgroup-causal-zigzag-gqa" in errs
        for name, dt in names:
            tol = TOL[getattr(torch, dt)]
            for what, err in errs[name].items():
                print(f"rank {rank} {name} {what}: {err:.2e}")
                if not err <= tol:
                    failures.append(f"rank {rank} {name} {what}: {err:.3e} > {tol}")
        assert all(m is not None and "not divisible" in m and "pad" in m for m in msgs), msgs
    assert not failures, "\n".join(failures)


def _failing_worker(rank, world):
    from qkv.distributed import ring_attention

    if rank == 1:
        raise RuntimeError("rank 1 fails on purpose before the ring step")
    x = torch.randn(1, 2, 8, 4)
    t0 = time.monotonic()
    try:
        ring_attention(x, x, x)
    except RuntimeError as ex:
        return ("raised", str(ex), time.monotonic() - t0)
    return ("returned", "", time.monotonic() - t0)


@pytest.mark.slow  # 11 s of process start-up and waiting; CI's slow tier runs it
def test_peer_failure_raises_instead_of_hanging():
    t0 = time.monotonic()
    res = spawn(_failing_worker, 2, pg_timeout_s=60)  # gloo reports the closed peer at once; the timeout only bounds a miss
    assert res[1][0] == "error" and "fails on purpose" in res[1][1]
    assert res[0][0] == "ok", res[0]
    kind, msg, elapsed = res[0][1]
    print(f"rank 0: {kind} after {elapsed:.1f}s (spawn total {time.monotonic() - t0:.1f}s): {msg[:300]}")
    assert kind == "raised" and "ring_attention: rank 0 failed" in msg


@pytest.mark.parametrize("world", [1, 2, 3, 4])
@pytest.mark.parametrize("layout", ["contiguous", "zigzag"])
def test_shard_unshard_round_trip(world, layout):
    x = torch.randn(2, 3, 8 * world, 5)
    parts = [shard_local(x, r, world, dim=-2, layout=layout) for r in range(world)]
    assert torch.equal(unshard_local(parts, dim=-2, layout=layout), x)
    if layout == "zigzag":
        c = 4  # 8W rows in 2W chunks
        assert torch.equal(parts[0][..., :c, :], x[..., :c, :])
        assert torch.equal(parts[0][..., c:, :], x[..., -c:, :])


def test_uneven_length_message():
    with pytest.raises(ValueError, match=r"sequence length 1001 is not divisible by 2·world_size = 8.*pad the sequence to 1008"):
        check_length(1001, 4, "zigzag")
    with pytest.raises(ValueError, match=r"or use layout='contiguous'"):
        check_length(1004, 4, "zigzag")
    with pytest.raises(ValueError, match=r"not divisible by world_size = 3"):
        check_length(100, 3, "contiguous")


@pytest.mark.parametrize("world", [2, 3, 4])
def test_zigzag_block_plan_covers_causal_mask_exactly(world):
    """The sub-blocks each rank computes tile exactly the causal mask, in global positions."""
    nl = 6
    n = nl * world
    pos = [shard_local(torch.arange(n).view(n, 1), r, world, dim=0, layout="zigzag").view(-1) for r in range(world)]
    cover = torch.zeros(n, n, dtype=torch.int64)
    for r in range(world):
        for s in range(world):
            for qs, ks, causal in chunk_slices(r, s, nl, "zigzag", True):
                qp, kp = pos[r][qs], pos[s][ks]
                allowed = torch.ones(len(qp), len(kp), dtype=torch.bool)
                if causal:
                    allowed = torch.ones_like(allowed).tril()
                cover[qp.view(-1, 1), kp.view(1, -1)] += allowed.long()
    assert torch.equal(cover, torch.ones(n, n, dtype=torch.int64).tril())


def _stalled_worker(rank, world, done: str):
    from qkv.distributed import ring_attention

    x = torch.randn(1, 2, 8, 4)
    if rank == 1:
        # alive but never joins the ring, until rank 0 has given up: only the process group's
        # timeout can end rank 0's wait (had this rank exited, gloo would report the closed peer)
        while not os.path.exists(done):
            time.sleep(0.05)
        return ("waited", "", 0.0)
    t0 = time.monotonic()
    try:
        ring_attention(x, x, x)
    except RuntimeError as ex:
        return ("raised", str(ex), time.monotonic() - t0)
    finally:
        open(done, "w").close()
    return ("returned", "", time.monotonic() - t0)


@pytest.mark.slow  # waits for its timeout (11 s); CI's slow tier runs it
def test_stalled_peer_times_out(tmp_path):
    res = spawn(_stalled_worker, 2, str(tmp_path / "rank0-done"), pg_timeout_s=2.5)
    assert res[0][0] == "ok", res[0]
    kind, msg, elapsed = res[0][1]
    print(f"rank 0: {kind} after {elapsed:.1f}s: {msg[:300]}")
    assert kind == "raised" and "timeout" in msg.lower()
    assert elapsed >= 2.0  # a timeout never fires early; how late it fires is the machine's business
