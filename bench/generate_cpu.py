"""Greedy generation on the CPU: tokens per second of a small LLaMA decoder at 4k and 32k tokens of
context, ``attn_implementation="qkv"`` against ``"sdpa"``, in one run.

The model is a transformers ``LlamaForCausalLM`` built from a config (no download): 4 layers,
width 512, 8 query heads on 2 key/value heads of 64 dims, float32. Its cache is filled with
random keys and values for the context (a real prefill of 32k tokens would take minutes and
measures prefill, not decoding), then both implementations generate the same number of
tokens greedily from the same cache, alternating, best of the rounds. At 32k tokens each new
token reads 134 MB of cache, so attention is most of a step. Each context runs with
transformers' default ``DynamicCache`` and with a preallocated ``StaticCache``, for one sequence
and for a ragged batch of two (the first padded for a third of its context).

    python bench/generate_cpu.py            # → bench/results/generate_cpu.md
"""

from __future__ import annotations

import argparse
import sys
import time
from pathlib import Path
from typing import Optional

import torch

sys.path.insert(0, str(Path(__file__).resolve().parent))
from common import cpu_name  # noqa: E402

RESULTS = Path(__file__).resolve().parent / "results"


def build(impl: str):  # type: ignore[no-untyped-def]
    from transformers import LlamaConfig, LlamaForCausalLM

    torch.manual_seed(0)
    cfg = LlamaConfig(hidden_size=512, intermediate_size=1024, num_hidden_layers=4, num_attention_heads=8,
                      num_key_value_heads=2, head_dim=64, vocab_size=1000, max_position_embeddings=40_000)
    return LlamaForCausalLM._from_config(cfg, attn_implementation=impl).eval()


def filled_cache(model, context: int, cache: str, batch: int, seed: int = 1):  # type: ignore[no-untyped-def]
    """A cache holding ``context`` random keys and values per layer: transformers' default
    ``DynamicCache`` (which concatenates each new token onto the cache) or a ``StaticCache``
    preallocated for the context and the generated tokens (new tokens written in place; the
    attention then gets the whole preallocated length and a mask of the filled part)."""
    from transformers import DynamicCache, StaticCache

    cfg = model.config
    gen = torch.Generator().manual_seed(seed)
    kv = DynamicCache(config=cfg) if cache == "dynamic" else StaticCache(config=cfg, max_cache_len=context + 256)
    for layer in range(cfg.num_hidden_layers):
        k, v = (torch.randn(batch, cfg.num_key_value_heads, context, cfg.head_dim, generator=gen) for _ in range(2))
        kv.update(k, v, layer, {"cache_position": torch.arange(context)})
    return kv


@torch.no_grad()
def generate(model, context: int, tokens: int, cache: str, batch: int) -> tuple[float, list[list[int]]]:  # type: ignore[no-untyped-def]
    """Seconds for ``tokens`` greedy steps after ``context`` cached tokens, and the tokens. With
    ``batch`` 2 the batch is ragged: the first sequence's first third is padding (masked)."""
    kv = filled_cache(model, context, cache, batch)
    mask = torch.ones(batch, context + tokens, dtype=torch.long)
    if batch > 1:
        mask[0, : context // 3] = 0
    token = torch.ones(batch, 1, dtype=torch.long)
    out: list[list[int]] = []
    t0 = time.perf_counter()
    for step in range(tokens):
        pos = torch.tensor([context + step])
        logits = model(input_ids=token, past_key_values=kv, use_cache=True, cache_position=pos,
                       position_ids=pos[None].expand(batch, 1), attention_mask=mask[:, : context + step + 1]).logits
        token = logits[:, -1:].argmax(-1)
        out.append(token.flatten().tolist())
    return time.perf_counter() - t0, out


def main(argv: Optional[list[str]] = None) -> int:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--tokens", type=int, default=32)
    p.add_argument("--rounds", type=int, default=2)
    p.add_argument("--threads", type=int, nargs="+", default=[1, 2])
    p.add_argument("--out", type=Path, default=RESULTS)
    args = p.parse_args(argv)
    import qkv.hf

    qkv.hf.register()
    models = {impl: build(impl) for impl in ("sdpa", "qkv")}
    rows = []
    for threads in args.threads:
        torch.set_num_threads(threads)
        for cache, batch in (("dynamic", 1), ("static", 1), ("dynamic", 2), ("static", 2)):
            for context in (4096, 32768):
                best = {impl: float("inf") for impl in models}
                same = True
                for _ in range(args.rounds):
                    seqs = {}
                    for impl, model in models.items():
                        seconds, seqs[impl] = generate(model, context, args.tokens, cache, batch)
                        best[impl] = min(best[impl], seconds)
                    same = same and seqs["qkv"] == seqs["sdpa"]
                rate = {impl: batch * args.tokens / s for impl, s in best.items()}
                rows.append((threads, cache, batch, context, rate["qkv"], rate["sdpa"], same))
                print(f"{threads} thread(s), {cache} cache, batch {batch}, context {context}: qkv {rate['qkv']:.1f} "
                      f"tok/s, sdpa {rate['sdpa']:.1f} tok/s, same tokens: {same}", flush=True)
    lines = [
        "# Greedy generation on the CPU: tokens per second",
        "",
        f"{cpu_name()}, torch {torch.__version__}. LLaMA from a config: 4 layers, width 512, 8 query heads on 2 "
        f"key/value heads of 64 dims, float32; cache filled with random keys and values; {args.tokens} greedy tokens, "
        f"best of {args.rounds} rounds, the two implementations alternating. Tokens/s counts every sequence of the "
        "batch. Caches: transformers' `DynamicCache` (the default; concatenates each token onto the cache) and "
        "`StaticCache` (preallocated for the context + 256 tokens). Batch 2 is ragged: the first sequence's first "
        "third is padding, masked through `attention_mask`.",
        "",
        "| threads | cache | batch | context | qkv tok/s | sdpa tok/s | qkv ÷ sdpa time | same tokens |",
        "|---|---|---|---|---|---|---|---|",
    ]
    lines += [f"| {t} | {cache} | {b}{' (ragged)' if b > 1 else ''} | {c} | {q:.1f} | {s:.1f} | {s / q:.2f} | "
              f"{'yes' if same else 'no'} |" for t, cache, b, c, q, s, same in rows]
    args.out.mkdir(parents=True, exist_ok=True)
    (args.out / "generate_cpu.md").write_text("\n".join(lines) + "\n")
    print("\n".join(lines))
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
