"""The encoder block in the glass box, checked step by step against torch's own encoder layer."""

from __future__ import annotations

import json

import numpy as np
import pytest

from qkv.glass.block import BLOCK_STEPS, BlockTrace, sinusoidal_positions, toy_block_trace, trace_block

torch = pytest.importorskip("torch")

SEED = 20240607


def _params(rng: np.random.Generator, d: int, heads: int, d_ff: int) -> dict:
    def m(*shape: int) -> np.ndarray:
        return rng.normal(scale=0.6, size=shape)

    return dict(
        w_q=m(d, d), w_k=m(d, d), w_v=m(d, d), w_o=m(d, d), num_heads=heads,
        w1=m(d, d_ff), b1=m(d_ff), w2=m(d_ff, d), b2=m(d),
        gamma1=1 + 0.2 * m(d), beta1=0.2 * m(d), gamma2=1 + 0.2 * m(d), beta2=0.2 * m(d),
    )


def _torch_layer(p: dict, d: int, heads: int, d_ff: int, eps: float) -> "torch.nn.TransformerEncoderLayer":
    layer = torch.nn.TransformerEncoderLayer(
        d, heads, dim_feedforward=d_ff, dropout=0.0, activation="relu", batch_first=True, norm_first=False,
        layer_norm_eps=eps, dtype=torch.float64,
    ).eval()
    t = lambda a: torch.tensor(a, dtype=torch.float64)  # noqa: E731
    with torch.no_grad():
        # torch computes x·Wᵀ with W (out, in); the glass box computes x·W with W (in, out).
        layer.self_attn.in_proj_weight.copy_(torch.cat([t(p["w_q"]).T, t(p["w_k"]).T, t(p["w_v"]).T]))
        layer.self_attn.in_proj_bias.zero_()
        layer.self_attn.out_proj.weight.copy_(t(p["w_o"]).T)
        layer.self_attn.out_proj.bias.zero_()
        layer.linear1.weight.copy_(t(p["w1"]).T)
        layer.linear1.bias.copy_(t(p["b1"]))
        layer.linear2.weight.copy_(t(p["w2"]).T)
        layer.linear2.bias.copy_(t(p["b2"]))
        layer.norm1.weight.copy_(t(p["gamma1"]))
        layer.norm1.bias.copy_(t(p["beta1"]))
        layer.norm2.weight.copy_(t(p["gamma2"]))
        layer.norm2.bias.copy_(t(p["beta2"]))
    return layer


@pytest.mark.parametrize("causal", [False, True])
@pytest.mark.parametrize("n,d,heads,d_ff", [(5, 6, 2, 10), (1, 4, 1, 3), (7, 8, 4, 16)])
def test_every_step_matches_torch_encoder_layer(n: int, d: int, heads: int, d_ff: int, causal: bool) -> None:
    seed = SEED + 97 * n + d + heads
    print(f"seed={seed}")
    rng = np.random.default_rng(seed)
    p = _params(rng, d, heads, d_ff)
    emb = rng.normal(size=(n, d))
    eps = 1e-5
    b = trace_block(emb, **p, eps=eps, is_causal=causal)
    layer = _torch_layer(p, d, heads, d_ff, eps)

    pe = torch.tensor(b.positional)
    from qkv.nn.positional import sinusoidal_table

    np.testing.assert_allclose(b.positional, sinusoidal_table(n, d, dtype=torch.float64).numpy(), rtol=0, atol=1e-12)
    x = torch.tensor(emb)[None] + pe[None]  # (1, N, d)
    np.testing.assert_allclose(b.x, x[0].numpy(), rtol=0, atol=1e-12)

    mask = torch.nn.Transformer.generate_square_subsequent_mask(n, dtype=torch.float64) if causal else None
    with torch.no_grad():
        att, w = layer.self_attn(x, x, x, attn_mask=mask, need_weights=True, average_attn_weights=False)
        r1 = x + att
        n1 = layer.norm1(r1)
        hidden = layer.linear1(n1)
        relu = torch.relu(hidden)
        ffn = layer.linear2(relu)
        r2 = n1 + ffn
        out = layer.norm2(r2)
        whole = layer(x, src_mask=mask, is_causal=causal)
    tol = dict(rtol=1e-10, atol=1e-10)
    weights = b.attention.weights if heads > 1 else b.attention.weights[None]
    np.testing.assert_allclose(weights, w[0].numpy(), **tol)
    np.testing.assert_allclose(b.attention.projected, att[0].numpy(), **tol)
    for name, ref in (("residual1", r1), ("norm1", n1), ("ffn_hidden", hidden), ("ffn_relu", relu),
                      ("ffn_out", ffn), ("residual2", r2), ("output", out)):
        np.testing.assert_allclose(getattr(b, name), ref[0].numpy(), **tol, err_msg=name)
    np.testing.assert_allclose(b.output, whole[0].numpy(), **tol)
    # LayerNorm before γ, β: every row has mean 0 and standard deviation 1 (up to eps)
    for normed, std in ((b.normalized1, b.std1), (b.normalized2, b.std2)):
        np.testing.assert_allclose(normed.mean(axis=1), 0, atol=1e-12)
        var = normed.var(axis=1)
        np.testing.assert_allclose(var, 1 - eps / std**2, rtol=1e-12)
    np.testing.assert_allclose(b.mean1, b.residual1.mean(axis=1), rtol=1e-12)
    np.testing.assert_allclose(b.std2, np.sqrt(b.residual2.var(axis=1) + eps), rtol=1e-12)


def test_toy_block_is_small_and_readable() -> None:
    b = toy_block_trace("Thinking Machines")
    assert b.tokens == ["Thinking", "Machines"]
    assert (b.d_model, b.d_ff, b.num_heads, b.attention.d_k) == (4, 8, 2, 3)
    for name in ("w1", "w2", "gamma1", "beta1", "gamma2", "beta2"):
        a = getattr(b, name)
        np.testing.assert_array_equal(a, a.round(1))  # one decimal: followable by hand
    assert not np.allclose(b.gamma1, 1) and not np.allclose(b.beta2, 0)  # γ, β visibly act
    assert toy_block_trace("Thinking Machines").to_dict() == b.to_dict()  # deterministic
    assert toy_block_trace("Thinking Machines", seed=1).to_dict() != b.to_dict()
    c = toy_block_trace(["a", "b", "c"], causal=True, d_model=6, d_k=2, heads=3, d_ff=5)
    assert c.attention.weights.shape == (3, 3, 3) and c.ffn_hidden.shape == (3, 5)
    assert np.all(np.triu(c.attention.weights[0], 1) == 0)  # causal: no weight on later tokens


def test_positional_false_keeps_the_embeddings() -> None:
    rng = np.random.default_rng(SEED)
    p = _params(rng, 4, 2, 6)
    emb = rng.normal(size=(3, 4))
    b = trace_block(emb, **p, positional=False)
    np.testing.assert_array_equal(b.x, emb)
    assert not b.positional.any()
    np.testing.assert_allclose(sinusoidal_positions(3, 4)[1], [np.sin(1), np.cos(1), np.sin(0.01), np.cos(0.01)])


def test_to_dict_schema_and_round_trip() -> None:
    b = toy_block_trace("the cat sat", causal=True)
    d = json.loads(json.dumps(b.to_dict(), allow_nan=False))
    assert d["schema_version"] == 1 and d["kind"] == "block"
    assert set(d) == {"schema_version", "kind", "tokens", "d_model", "d_ff", "num_heads", "eps", "steps", "stats",
                      "params", "attention"}
    assert set(d["steps"]) == set(BLOCK_STEPS)
    assert set(d["stats"]) == {"mean1", "std1", "mean2", "std2"}
    assert set(d["params"]) == {"w1", "b1", "w2", "b2", "gamma1", "beta1", "gamma2", "beta2"}
    assert d["attention"]["num_heads"] == 2
    np.testing.assert_allclose(d["steps"]["output"], b.output)
    back = BlockTrace.from_dict(d)
    for name in BLOCK_STEPS + ("mean1", "std2", "w1", "beta2"):
        np.testing.assert_array_equal(getattr(back, name), getattr(b, name))
    np.testing.assert_array_equal(back.attention.weights, b.attention.weights)
    with pytest.raises(ValueError, match="Trace.from_dict"):
        BlockTrace.from_dict({**d, "kind": "attention"})


def test_to_string_shows_every_step_with_its_numbers() -> None:
    b = toy_block_trace("Thinking Machines")
    s = b.to_string(precision=3)
    for formula in ("X = E + PE", "residual1 = X + MultiHead(X)", "hidden = norm1·W1 + b1", "relu = max(0, hidden)",
                    "residual2 = norm1 + ffn", "output = γ₂"):
        assert formula in s
    assert f"{b.output[1, 2]:.3f}" in s and f"{b.ffn_hidden[0, 5]:.3f}" in s
    assert "scores" in s  # the attention part is printed in full
    only = b.to_string(steps=["output"])
    assert "X = E + PE" not in only and "output = γ₂" in only
    zh = b.to_string(lang="zh")
    assert "层归一化" in zh and "残差连接" in zh and "the block's output" not in zh
    with pytest.raises(ValueError, match="unknown names"):
        b.to_string(steps=["nope"])
    assert "3×4" in repr(b) or "2×4" in repr(b)
    assert "<table>" in b.to_html() and b._repr_html_().startswith("<iframe srcdoc=")


@pytest.mark.parametrize("lang", ["en", "zh"])
def test_explain_quotes_the_numbers(lang: str) -> None:
    b = toy_block_trace("Thinking Machines rock")
    for token in (0, "rock"):
        s = b.explain(lang, token=token)
        i = b.tokens.index(token) if isinstance(token, str) else token
        assert f"{b.mean1[i]:.3f}".rstrip("0").rstrip(".") in s
        assert str(int(b.relu_off[i])) in s
        last = round(float(b.output[i, 0]), 3)
        assert f"{last:g}" in s or f"{last:.3f}".rstrip("0") in s
        for h in range(b.num_heads):
            assert (f"head {h}" if lang == "en" else f"第 {h} 个头") in s
    assert "层归一化" in b.explain("zh") and "LayerNorm" in b.explain("en")
    with pytest.raises(ValueError, match="index from"):
        b.explain(token=5)
    with pytest.raises(ValueError, match="lang"):
        b.explain("fr")


def test_bad_shapes_name_the_argument() -> None:
    rng = np.random.default_rng(SEED)
    p = _params(rng, 4, 2, 6)
    emb = rng.normal(size=(3, 4))
    for name, bad in (("w1", np.ones((5, 6))), ("b1", np.ones(5)), ("w2", np.ones((6, 3))), ("gamma2", np.ones(3)),
                      ("beta1", np.ones((4, 1)))):
        with pytest.raises(ValueError, match=name):
            trace_block(emb, **{**p, name: bad})
    with pytest.raises(ValueError, match="w_o is required"):
        trace_block(emb, **{**p, "w_o": None})
    with pytest.raises(ValueError, match="w_o"):
        trace_block(emb, **{**p, "w_o": np.ones((4, 3))})
    with pytest.raises(ValueError, match="x_embeddings"):
        trace_block(np.ones(4), **p)
    with pytest.raises(ValueError, match="eps"):
        trace_block(emb, **p, eps=0)
    with pytest.raises(ValueError, match="tokens"):
        trace_block(emb, **p, tokens=["a"])
    with pytest.raises(ValueError, match="NaN"):
        trace_block(emb, **{**p, "b2": np.array([1, np.nan, 0, 0])})
