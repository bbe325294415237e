"""The mask-function benchmark's logic (`bench/mask_mod_cpu.py`): its contenders build the same
mask, a "built once" contender builds once per function, and the report renders what a run
wrote. Nothing here measures anything."""

from __future__ import annotations

import torch
from torch.nn.attention.flex_attention import create_block_mask

from qkv import sparse

from ..helpers import load_bench_script

bench = load_bench_script("mask_mod_cpu")


def test_qkv_and_flex_build_the_same_blocks():
    n = 1000  # documents and blocks out of step
    fn = bench.same_doc_causal(bench.documents(n))
    ours = sparse.from_mask_mod(fn, None, None, n, block_size=128, cache=False)
    flex = create_block_mask(fn, None, None, n, n, device="cpu")
    assert torch.equal(ours.layout[0], flex.to_dense().bool()[0, 0])  # (heads, query blocks, key blocks)
    assert not torch.equal(bench.documents(n), bench.documents(n, shift=7))  # the warm-up has another key


def test_built_once_builds_once_per_function():
    made = []
    call = bench.built_once(lambda m: m, lambda f: made.append(f) or len(made))
    f, g = object(), object()
    assert [call(f), call(f), call(g), call(g)] == [1, 1, 2, 2] and made == [f, g]


def test_the_report_renders_a_run():
    build = dict.fromkeys(["qkv layout, 64-blocks (as a call)", "Flex create_block_mask, eager"], 0.01)
    loops = {name: [0.02] + [0.01] * (bench.LOOP - 1) for name in ["auto, mask_mod=", "peer: Flex, BlockMask built once"]}
    run = {"cells": [{"n": 2048, "build": build, "loops": loops, "loadavg": [1.0, 1.5]}], "threads": 1, "tree": "/x",
           "commit": "abc1234", "torch": "2", "python": "3", "cpu": "a CPU", "date": "today"}  # fmt: skip
    text = bench.report([run, run], ["before", "after"])
    assert "| after | 2048 | auto, mask_mod= | 20.0 | 10.0 | 210.0 | 1.00 | 1.00–1.50 |" in text
    assert "| before | 2048 | 10.00 | 10.00 | 1.00 |" in text and "`after`: abc1234" in text
