"""qkv studio on the CPU: how long the page waits for each view, over real HTTP.

    python bench/studio_cpu.py            # writes bench/results/studio_cpu.md
    python bench/studio_cpu.py --quick    # fewer repeats, for a smoke run

The server is the real app (FastAPI on uvicorn, in a thread of this process) serving the bundled
all-MiniLM-L6-v2 with one torch thread. Each request is timed from sending it to having read the
whole JSON answer, as the page's ``fetch`` sees it: best of the repeats after a warm-up. The
peer, measured in the same run: Hugging Face transformers' ``BertModel`` loaded from the same
weights, asked for every attention map (``output_attentions=True``) of the same sentence with
no server in between — what a researcher would run to get the maps alone.

Targets (issue: the studio): the views for a 32-token sentence ≤ 300 ms after the request,
128 tokens ≤ 1 s; an ablation re-run ≤ 300 ms at 32 tokens; the first page load ≤ 1 s after the
server is up.
"""

from __future__ import annotations

import argparse
import json
import sys
import threading
import time
import urllib.request
from pathlib import Path
from typing import Any, Callable

import torch

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))
from bench.common import best_time, report_header, write_report  # noqa: E402

RESULTS = Path(__file__).resolve().parent / "results"
WORDS = ("Alice met Bob at the old station near the river and she gave him the keys to the house because "
         "he had asked her twice about the garden the roof the windows and the small red door that never "
         "closed properly in winter when the wind came down from the hills over the fields and the farms").split()


def sentence(model: Any, tokens: int) -> str:
    """A text of exactly ``tokens`` word pieces (with [CLS] and [SEP]) for ``model``'s tokenizer."""
    from qkv.analysis.explain import encode

    words: list[str] = []
    i = 0
    while len(encode(model, " ".join(words)).ids) < tokens if words else True:
        words.append(WORDS[i % len(WORDS)])
        i += 1
    while len(encode(model, " ".join(words)).ids) > tokens:
        words.pop()
    return " ".join(words)


def serve() -> tuple[Any, str, float]:
    """Start the studio in a thread; returns the server, its address and the seconds until it served."""
    import uvicorn

    from qkv.studio import Studio
    from qkv.studio.server import create_app

    t0 = time.perf_counter()
    server = uvicorn.Server(uvicorn.Config(create_app(Studio()), host="127.0.0.1", port=0, log_level="warning"))
    threading.Thread(target=server.run, daemon=True).start()
    for _ in range(600):
        if server.started:
            break
        time.sleep(0.01)
    port = server.servers[0].sockets[0].getsockname()[1]
    return server, f"http://127.0.0.1:{port}", time.perf_counter() - t0


def request(url: str, body: Any = None) -> Callable[[], bytes]:
    data = None if body is None else json.dumps(body).encode()
    headers = {"Content-Type": "application/json"} if data is not None else {}

    def call() -> bytes:
        with urllib.request.urlopen(urllib.request.Request(url, data=data, headers=headers), timeout=60) as r:
            payload = r.read()
        if data is not None:
            json.loads(payload)  # the page parses what it gets
        return payload
    return call


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--quick", action="store_true")
    ap.add_argument("--out", default=str(RESULTS / "studio_cpu.md"))
    args = ap.parse_args()
    torch.set_num_threads(1)
    repeats = 3 if args.quick else 7

    from qkv.models import default_model_dir, load_shared
    from transformers import BertModel, BertTokenizerFast

    server, base, startup = serve()
    t0 = time.perf_counter()
    request(base + "/")()
    first_page = time.perf_counter() - t0
    page_bytes = len(request(base + "/")())
    request(base + "/api/analyze", {"model": "minilm", "text": "warm up"})()  # loads the model once, as the first view does
    model = load_shared()
    hf = BertModel.from_pretrained(str(default_model_dir()), attn_implementation="eager").eval()
    tok = BertTokenizerFast.from_pretrained(str(default_model_dir()))

    rows = []
    for n in (32, 128):
        text = sentence(model, n)
        views = {
            "analyze (every map + head statistics)": {"path": "/api/analyze", "body": {"model": "minilm", "text": text}},
            "one head in the glass box": {"path": "/api/head", "body": {"model": "minilm", "text": text, "layer": 2, "head": 7, "token": 5}},
            "knock out 2 heads (output + every map after)": {"path": "/api/intervene",
                                                             "body": {"model": "minilm", "text": text, "heads": [[1, 3], [2, 5]]}},
        }
        enc = tok(text, return_tensors="pt")
        assert enc["input_ids"].shape[1] == n, (enc["input_ids"].shape, n)

        def peer() -> None:
            with torch.inference_mode():
                hf(**enc, output_attentions=True)

        peer()
        peer_s = best_time(peer, repeats)
        for name, v in views.items():
            call = request(base + v["path"], v["body"])
            size = len(call())  # warm-up
            rows.append((n, name, best_time(call, repeats), size, peer_s))
    server.should_exit = True

    lines = report_header("qkv studio on the CPU: time from request to answer", 1)
    lines += [
        "The real app (FastAPI on uvicorn, in-process thread) serving the bundled all-MiniLM-L6-v2 (6 layers × 12 heads); "
        "each request timed from sending it to having read and parsed its JSON over HTTP on 127.0.0.1, best of "
        f"{repeats} after a warm-up. Peer, same run: transformers' `BertModel` (eager attention, same weights) computing "
        "every attention map of the same input (`output_attentions=True`), in-process, no server.",
        "",
        f"Server up (app built, socket bound) in {startup * 1000:.0f} ms; the first page load took {first_page * 1000:.0f} ms "
        f"({page_bytes / 1000:.0f} kB, scripts and styles inline).",
        "",
        "| tokens | view | ms | answer kB | transformers maps ms | target ms | met |",
        "|---:|---|---:|---:|---:|---:|---|",
    ]
    for n, name, s, size, peer_s in rows:
        target = (300 if n == 32 else 1000) if not name.startswith("knock") else (300 if n == 32 else None)
        met = "" if target is None else ("yes" if s * 1000 <= target else "NO")
        lines.append(f"| {n} | {name} | {s * 1000:.0f} | {size / 1000:.0f} | {peer_s * 1000:.0f} | "
                     f"{'' if target is None else target} | {met} |")
    write_report(lines, args.out)


if __name__ == "__main__":
    main()
