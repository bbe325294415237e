"""Harness for the distributed tests: spawn W gloo ranks on loopback, collect results, never hang.

One spawn runs many cases; each rank returns a picklable result through a queue. Stragglers
are killed by pid after a deadline, so a deadlocked collective fails the test instead of
hanging the suite.
"""

from __future__ import annotations

import datetime
import multiprocessing as mp
import queue
import socket
import time
import traceback


def free_port() -> int:
    with socket.socket(socket.AF_INET, socket.SOCK_STREAM) as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def _entry(fn, rank, world, port, pg_timeout_s, q, args):
    import torch
    import torch.distributed as dist

    torch.set_num_threads(1)
    try:
        dist.init_process_group(
            "gloo", init_method=f"tcp://127.0.0.1:{port}", rank=rank, world_size=world,
            timeout=datetime.timedelta(seconds=pg_timeout_s),
        )
        q.put((rank, "ok", fn(rank, world, *args)))
    except BaseException:
        q.put((rank, "error", traceback.format_exc()))
    finally:
        if dist.is_initialized():
            try:
                dist.destroy_process_group()
            except Exception:
                pass


def spawn(fn, world: int, *args, timeout: float = 900.0, pg_timeout_s: float = 300.0) -> dict:
    """Run ``fn(rank, world, *args)`` on ``world`` gloo ranks; returns {rank: ("ok"|"error", value)}.

    Ranks that do not report within ``timeout`` seconds are killed and reported as "hung" (the
    limits are generous: they only keep a deadlock from hanging the suite, and a busy machine
    may take a minute to start a rank and import torch).
    """
    ctx = mp.get_context("spawn")
    q = ctx.Queue()
    port = free_port()
    procs = [ctx.Process(target=_entry, args=(fn, r, world, port, pg_timeout_s, q, args), daemon=True) for r in range(world)]
    for p in procs:
        p.start()
    results: dict = {}
    deadline = time.monotonic() + timeout
    while len(results) < world and time.monotonic() < deadline:
        try:
            rank, status, value = q.get(timeout=0.2)
            results[rank] = (status, value)
        except queue.Empty:
            if all(not p.is_alive() for p in procs) and q.empty():
                break
    for p in procs:
        p.join(timeout=max(0.1, min(5.0, deadline - time.monotonic())))
    for r, p in enumerate(procs):
        if p.is_alive():
            p.kill()
            p.join(timeout=5)
        results.setdefault(
            r, ("hung", f"rank {r} of {fn.__name__} gave no result within {timeout:g} s of spawning (exit code {p.exitcode})")
        )
    return results


def ok_values(results: dict) -> list:
    """The per-rank values, or an AssertionError quoting every failed rank."""
    bad = {r: v for r, v in results.items() if v[0] != "ok"}
    assert not bad, "\n".join(f"rank {r} {s}:\n{v}" for r, (s, v) in sorted(bad.items()))
    return [results[r][1] for r in sorted(results)]


def global_case(seed: int, hq: int, hk: int, n: int, d: int, dv: int, dtype, causal, gqa: bool):
    """The same global q, k, v, dO on every rank, and single-device reference gradients.

    Returns ``(q, k, v, do, ref_out, (fq, fk, fv))`` where ``f*`` hold the reference ``.grad``.
    """
    import torch

    import qkv

    g = torch.Generator().manual_seed(seed)  # every rank builds the same global tensors
    q = torch.randn(2, hq, n, d, generator=g, dtype=dtype)
    k = torch.randn(2, hk, n, d, generator=g, dtype=dtype)
    v = torch.randn(2, hk, n, dv, generator=g, dtype=dtype)
    do = torch.randn(2, hq, n, dv, generator=g, dtype=dtype)
    fq, fk, fv = (t.clone().requires_grad_() for t in (q, k, v))
    ref = qkv.attention(fq, fk, fv, is_causal=causal, enable_gqa=gqa, backend="math")
    ref.backward(do)
    return q, k, v, do, ref, (fq, fk, fv)
