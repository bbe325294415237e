"""Separate W_Q and W_K vs a tied projection (q = k).

With one projection for queries and keys the score matrix S = (XW)(XW)ᵀ is symmetric, so
"i looks at j" scores exactly as much as "j looks at i"; and by Cauchy–Schwarz a token's score
with itself bounds its score with any equally long key. "Look up my successor" (token a reads
token a+1) is asymmetric: a tied model that raises the score of (a, a+1) raises (a+1, a) by
as much, so it cannot learn the relation where the untied one does.
"""

from __future__ import annotations

import time
from pathlib import Path

import numpy as np

from ._common import Progress, Result, pyplot, save_figure, seed_all, write_csv

NAME = "tied_qk"
TITLE = "Tied W_Q = W_K forces symmetric scores"
CLAIM = (
    "Tying the query and key projections (q = k) makes the score matrix symmetric (S = Sᵀ), which cannot "
    "express an asymmetric relation: when each token must read the token that follows it in the vocabulary "
    "(a → a+1), the untied model learns the relation and the tied one does not."
)


def _model(vocab: int, colours: int, d: int, tied: bool):
    import torch
    from torch import nn

    from ..functional import attention

    class OneHead(nn.Module):
        def __init__(self) -> None:
            super().__init__()
            self.emb = nn.Embedding(vocab, d)
            self.colour = nn.Embedding(colours, d)
            self.q_proj = nn.Linear(d, d, bias=False)
            self.k_proj = self.q_proj if tied else nn.Linear(d, d, bias=False)
            self.v_proj = nn.Linear(d, d, bias=False)
            self.head = nn.Linear(d, vocab)

        def qk(self, tokens: torch.Tensor, colour: torch.Tensor):
            x = self.emb(tokens) + self.colour(colour)  # (B, N, d); no positions: the relation is on content
            return self.q_proj(x)[:, None], self.k_proj(x)[:, None], x  # (B, 1, N, d) ×2

        def forward(self, tokens: torch.Tensor, colour: torch.Tensor) -> torch.Tensor:
            q, k, x = self.qk(tokens, colour)
            v = self.v_proj(x)[:, None]  # (B, 1, N, d)
            out = attention(q, k, v, backend="math")[:, 0]  # (B, N, d)
            return self.head(out)  # (B, N, colours); no residual: only attention can fetch the successor's colour

    return OneHead()


def _batch(gen, batch: int, vocab: int, colours: int):
    """Each sequence is a shuffle of the whole vocabulary with a random colour on every token;
    the target at each position is the colour carried by the token's successor (a+1 mod vocab)."""
    import torch

    tokens = torch.argsort(torch.rand(batch, vocab, generator=gen), dim=1)  # (B, V) a permutation
    colour = torch.randint(0, colours, (batch, vocab), generator=gen)  # (B, V)
    where = torch.argsort(tokens, dim=1)  # where[b, t] = position of token t
    succ_pos = where.gather(1, (tokens + 1) % vocab)  # (B, V)
    return tokens, colour, colour.gather(1, succ_pos)


def run(out: Path, quick: bool = False, seed: int = 0) -> Result:
    import torch

    t_start = time.perf_counter()
    seed_all(seed)
    plt = pyplot()
    vocab, colours, d = 16, 4, 32
    steps, batch = (300, 64) if quick else (1200, 64)
    curves, acc, asym, example = {}, {}, {}, {}
    for tied in (False, True):
        key = "tied" if tied else "untied"
        torch.manual_seed(seed)
        model = _model(vocab, colours, d, tied)
        opt = torch.optim.Adam(model.parameters(), lr=3e-3)
        gen = torch.Generator().manual_seed(seed + 1)
        bar = Progress(steps, key)
        losses = []
        for _ in range(steps):
            tokens, colour, target = _batch(gen, batch, vocab, colours)
            logits = model(tokens, colour)  # (B, V, colours)
            loss = torch.nn.functional.cross_entropy(logits.flatten(0, 1), target.flatten())
            opt.zero_grad()
            loss.backward()
            opt.step()
            losses.append(loss.item())
            bar.step(f"loss {losses[-1]:.3f}")
        curves[key] = losses
        with torch.no_grad():
            tokens, colour, target = _batch(torch.Generator().manual_seed(seed + 99), 1000, vocab, colours)
            acc[key] = float((model(tokens, colour).argmax(-1) == target).float().mean())
            ordered = torch.arange(vocab)[None]  # tokens 0..V-1 in order, so the relation is the superdiagonal
            q, k, _ = model.qk(ordered, torch.zeros_like(ordered))
            s = (q @ k.transpose(-1, -2))[0, 0].double()  # (V, V)
            asym[key] = float((s - s.T).abs().max() / s.abs().max())
            example[key] = s.numpy()
    held = bool(acc["untied"] > 0.9 and acc["tied"] < acc["untied"] - 0.2 and asym["tied"] < 1e-6
                and asym["untied"] > 0.1)

    fig, ax = plt.subplots(1, 3, figsize=(14, 4.6))
    for key, color in (("untied", "C0"), ("tied", "C3")):
        ax[0].plot(curves[key], color=color, label=f"{key}: accuracy {100 * acc[key]:.1f}%")
    ax[0].axhline(np.log(colours), color="k", ls=":", label=f"chance (ln {colours})")
    ax[0].set(xlabel="training step", ylabel="cross-entropy (nats)", title="Read the colour of token a+1")
    ax[0].legend()
    for a, key in ((ax[1], "untied"), (ax[2], "tied")):
        m = example[key]
        lim = float(np.abs(m).max())
        im = a.imshow(m, cmap="RdBu_r", vmin=-lim, vmax=lim)
        a.set(xlabel="key token b", ylabel="query token a",
              title=f"{key} scores q_a·k_b\nasymmetry max|S−Sᵀ|/max|S| = {asym[key]:.2g}")
        fig.colorbar(im, ax=a, label="score before softmax (dimensionless)")
    save_figure(fig, out / "tied_qk.png")
    write_csv(out / "tied_qk.csv", ["step", "loss_untied", "loss_tied"],
              [[i, a, b] for i, (a, b) in enumerate(zip(curves["untied"], curves["tied"]))])

    result = (
        f"Accuracy at reading the successor's colour: untied {100 * acc['untied']:.1f}%, tied "
        f"{100 * acc['tied']:.1f}% (chance {100 / colours:.0f}%). Relative asymmetry max|S−Sᵀ|/max|S| of the learned scores: untied "
        f"{asym['untied']:.3g}, tied {asym['tied']:.2g}."
    )
    setup = (
        f"One attention head (`qkv.attention`, d = {d}, no mask, no positions) over token + colour embeddings; each "
        f"sequence is a shuffle of all {vocab} tokens, each with one of {colours} random colours; the target at token a "
        "is the colour of token a+1 (mod vocab). No residual path, so only attention can fetch it. Untied: "
        f"separate W_Q, W_K; tied: one matrix for both. Adam lr 3e-3, {steps} steps of batch {batch}, same seed. "
        "Verdict: untied accuracy > 90%, tied at least 20 points lower, tied asymmetry < 1e-6 and untied > 0.1."
    )
    metrics = {"acc_untied": acc["untied"], "acc_tied": acc["tied"], "asym_untied": asym["untied"],
               "asym_tied": asym["tied"]}
    return Result(NAME, TITLE, CLAIM, setup, result, held, metrics, ["tied_qk.png"], "tied_qk.csv",
                  time.perf_counter() - t_start)
