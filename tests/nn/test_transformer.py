"""Transformer layers and stacks: parity with torch.nn, masking properties, decoding, training."""

import time

import pytest
import torch

from qkv.nn import (
    KVCache,
    RotaryEmbedding,
    SinusoidalPositionalEncoding,
    Transformer,
    TransformerDecoder,
    TransformerDecoderLayer,
    TransformerEncoder,
    TransformerEncoderLayer,
)

f64 = torch.float64


def torch_state_to_qkv(sd):
    """Rename a torch.nn.Transformer* state dict to qkv names (split in_proj, multihead_attn → cross_attn)."""
    out = {}
    for name, t in sd.items():
        name = name.replace("multihead_attn.", "cross_attn.")
        prefix, _, leaf = name.rpartition(".")
        if leaf in ("in_proj_weight", "in_proj_bias"):
            kind = "weight" if leaf.endswith("weight") else "bias"
            for part, chunk in zip("qkv", t.chunk(3, dim=0)):
                out[f"{prefix}.{part}_proj.{kind}"] = chunk
        else:
            out[name] = t
    return out


def copy_from_torch(ours, theirs):
    missing, unexpected = ours.load_state_dict(torch_state_to_qkv(theirs.state_dict()), strict=True)
    assert not missing and not unexpected
    return ours.eval(), theirs.eval()


def future_mask(n):
    return torch.ones(n, n, dtype=torch.bool).triu(1)  # torch convention: True = masked


# ------------------------------------------------------------------------ parity with torch
@pytest.mark.parametrize("norm_first", [False, True])
@pytest.mark.parametrize("activation", ["relu", "gelu"])
def test_encoder_layer_parity_with_torch(norm_first, activation):
    kw = dict(dim_feedforward=40, dropout=0.0, activation=activation, norm_first=norm_first)
    ours = TransformerEncoderLayer(24, 4, dtype=f64, **kw)
    theirs = torch.nn.TransformerEncoderLayer(24, 4, batch_first=True, dtype=f64, **kw)
    copy_from_torch(ours, theirs)
    x = torch.randn(3, 10, 24, dtype=f64)
    ignore = torch.zeros(3, 10, dtype=torch.bool)
    ignore[1, 7:] = True
    want = theirs(x, src_mask=future_mask(10), src_key_padding_mask=ignore)
    got = ours(x, is_causal=True, key_padding_mask=~ignore)
    torch.testing.assert_close(got, want, rtol=1e-10, atol=1e-10)
    torch.testing.assert_close(ours(x), theirs(x), rtol=1e-10, atol=1e-10)


@pytest.mark.parametrize("norm_first", [False, True])
def test_decoder_layer_parity_with_torch(norm_first):
    kw = dict(dim_feedforward=32, dropout=0.0, activation="gelu", norm_first=norm_first)
    ours = TransformerDecoderLayer(16, 2, dtype=f64, **kw)
    theirs = torch.nn.TransformerDecoderLayer(16, 2, batch_first=True, dtype=f64, **kw)
    copy_from_torch(ours, theirs)
    x, mem = torch.randn(2, 7, 16, dtype=f64), torch.randn(2, 9, 16, dtype=f64)
    mem_ignore = torch.zeros(2, 9, dtype=torch.bool)
    mem_ignore[0, 5:] = True
    want = theirs(x, mem, tgt_mask=future_mask(7), memory_key_padding_mask=mem_ignore)
    got = ours(x, mem, memory_key_padding_mask=~mem_ignore)
    torch.testing.assert_close(got, want, rtol=1e-10, atol=1e-10)


def test_transformer_parity_with_torch():
    kw = dict(num_encoder_layers=2, num_decoder_layers=2, dim_feedforward=48, dropout=0.0)
    ours = Transformer(16, 4, dtype=f64, **kw)
    theirs = torch.nn.Transformer(16, 4, batch_first=True, dtype=f64, **kw)
    copy_from_torch(ours, theirs)
    src, tgt = torch.randn(2, 11, 16, dtype=f64), torch.randn(2, 6, 16, dtype=f64)
    ignore = torch.zeros(2, 11, dtype=torch.bool)
    ignore[1, 8:] = True
    want = theirs(
        src, tgt, tgt_mask=future_mask(6), src_key_padding_mask=ignore, memory_key_padding_mask=ignore
    )
    got = ours(src, tgt, src_key_padding_mask=~ignore)  # memory mask defaults to the source mask
    torch.testing.assert_close(got, want, rtol=1e-10, atol=1e-10)


# ----------------------------------------------------------------------------- structure
def test_shapes_names_and_gqa():
    model = Transformer(32, 8, 2, 3, 64, num_kv_heads=2)
    out = model(torch.randn(2, 13, 32), torch.randn(2, 5, 32))
    assert out.shape == (2, 5, 32)
    names = dict(model.named_modules())
    for path in ("encoder.layers.1.self_attn", "decoder.layers.2.cross_attn", "decoder.layers.0.norm3", "encoder.norm"):
        assert path in names
    assert names["decoder.layers.2.cross_attn.k_proj"].out_features == 2 * 4
    assert len(model.encoder.layers) == 2 and len(model.decoder.layers) == 3


def test_layer_defaults_and_activation():
    layer = TransformerEncoderLayer(12, 3)
    assert layer.linear1.out_features == 48 and not layer.norm_first
    assert layer.dropout.p == 0.1 and layer.self_attn.dropout == 0.1
    tanh_layer = TransformerEncoderLayer(12, 3, activation=torch.tanh, dropout=0.0).eval()
    x = torch.randn(2, 4, 12)
    h = tanh_layer.norm1(x + tanh_layer.self_attn(x)[0])
    want = tanh_layer.norm2(h + tanh_layer.linear2(torch.tanh(tanh_layer.linear1(h))))
    torch.testing.assert_close(tanh_layer(x), want)
    with pytest.raises(ValueError, match="activation='swish'"):
        TransformerEncoderLayer(12, 3, activation="swish")


def test_stacks_from_layer_copy_or_params():
    layer = TransformerEncoderLayer(8, 2, dim_feedforward=16)
    enc = TransformerEncoder(layer, 3)
    assert enc.layers[0] is not enc.layers[1]
    torch.testing.assert_close(enc.layers[0].linear1.weight, enc.layers[2].linear1.weight)
    enc2 = TransformerEncoder(dict(d_model=8, num_heads=2, dim_feedforward=16), 2, norm=torch.nn.LayerNorm(8))
    assert not torch.equal(enc2.layers[0].linear1.weight, enc2.layers[1].linear1.weight)
    assert enc2(torch.randn(1, 3, 8)).shape == (1, 3, 8)
    with pytest.raises(TypeError, match="TransformerDecoderLayer"):
        TransformerDecoder(layer.linear1, 2)


def test_bias_false_removes_every_bias():
    model = Transformer(16, 2, 1, 1, 32, bias=False)
    assert not any(name.endswith("bias") for name, _ in model.named_parameters())


# -------------------------------------------------------------------------- properties
def test_decoder_output_ignores_future_targets():
    model = Transformer(16, 4, 1, 2, 32, dropout=0.0, dtype=f64).eval()
    src, tgt = torch.randn(2, 7, 16, dtype=f64), torch.randn(2, 9, 16, dtype=f64)
    out = model(src, tgt)
    t = 4
    tgt2 = tgt.clone()
    tgt2[:, t + 1 :] = torch.randn(2, 9 - t - 1, 16, dtype=f64)
    out2 = model(src, tgt2)
    torch.testing.assert_close(out2[:, : t + 1], out[:, : t + 1], rtol=1e-12, atol=1e-12)
    assert not torch.allclose(out2[:, t + 1 :], out[:, t + 1 :])
    # and without the causal mask the past does see the future
    out_nc = model(src, tgt, tgt_is_causal=False)
    out2_nc = model(src, tgt2, tgt_is_causal=False)
    assert not torch.allclose(out_nc[:, :t], out2_nc[:, :t])


def test_padded_keys_do_not_affect_outputs():
    model = Transformer(16, 4, 2, 1, 32, dropout=0.0, dtype=f64).eval()
    src, tgt = torch.randn(2, 10, 16, dtype=f64), torch.randn(2, 5, 16, dtype=f64)
    real = torch.ones(2, 10, dtype=torch.bool)
    real[:, 6:] = False
    out = model(src, tgt, src_key_padding_mask=real)
    src2 = src.clone()
    src2[:, 6:] = 100 * torch.randn(2, 4, 16, dtype=f64)
    torch.testing.assert_close(model(src2, tgt, src_key_padding_mask=real), out, rtol=1e-12, atol=1e-12)
    # equal to running on the unpadded source
    torch.testing.assert_close(model(src[:, :6], tgt), out, rtol=1e-10, atol=1e-10)
    mem = model.encode(src, src_key_padding_mask=real)
    torch.testing.assert_close(mem[:, :6], model.encode(src[:, :6]), rtol=1e-10, atol=1e-10)


# ------------------------------------------------------------------------- incremental decoding
@pytest.mark.parametrize("norm_first", [False, True])
@pytest.mark.parametrize("use_rotary", [False, True])
def test_decoder_cache_matches_full(norm_first, use_rotary):
    dec = TransformerDecoder(
        dict(d_model=24, num_heads=6, num_kv_heads=2, dim_feedforward=32, dropout=0.0, norm_first=norm_first, dtype=f64),
        3,
        norm=torch.nn.LayerNorm(24, dtype=f64),
    ).eval()
    rotary = RotaryEmbedding(4) if use_rotary else None
    x, mem = torch.randn(2, 10, 24, dtype=f64), torch.randn(2, 8, 24, dtype=f64)
    mem_real = torch.ones(2, 8, dtype=torch.bool)
    mem_real[1, 5:] = False
    full = dec(x, mem, memory_key_padding_mask=mem_real, rotary=rotary)
    cache = dec.make_cache(max_len=16)
    steps, start = [3, 1, 1, 1, 2, 1, 1], 0
    outs = []
    for n in steps:
        outs.append(dec(x[:, start : start + n], mem, memory_key_padding_mask=mem_real, cache=cache, rotary=rotary))
        start += n
    torch.testing.assert_close(torch.cat(outs, 1), full, rtol=1e-10, atol=1e-10)
    assert all(c.length == 10 for c in cache)
    with pytest.raises(ValueError, match="make_cache"):
        dec(x, mem, cache=[KVCache()])


def test_transformer_greedy_decode_with_cache():
    model = Transformer(16, 4, 1, 2, 32, dropout=0.0, dtype=f64).eval()
    src, tgt = torch.randn(3, 6, 16, dtype=f64), torch.randn(3, 5, 16, dtype=f64)
    mem = model.encode(src)
    cache = model.decoder.make_cache()
    steps = [model.decode(tgt[:, t : t + 1], mem, cache=cache) for t in range(5)]
    torch.testing.assert_close(torch.cat(steps, 1), model(src, tgt), rtol=1e-10, atol=1e-10)


# --------------------------------------------------------------------------------- training
def test_gradients_reach_every_parameter():
    model = Transformer(16, 4, 2, 2, 32, num_kv_heads=2, dropout=0.1)
    src, tgt = torch.randn(2, 5, 16), torch.randn(2, 4, 16)
    real = torch.ones(2, 5, dtype=torch.bool)
    real[0, 3:] = False
    model(src, tgt, src_key_padding_mask=real).square().mean().backward()
    for name, p in model.named_parameters():
        assert p.grad is not None and p.grad.abs().sum() > 0, name


class Seq2Seq(torch.nn.Module):
    def __init__(self, vocab, d_model=32):
        super().__init__()
        self.embed = torch.nn.Embedding(vocab, d_model)
        self.pos = SinusoidalPositionalEncoding(d_model, max_len=32)
        self.core = Transformer(d_model, 4, 2, 2, 64, dropout=0.0)
        self.head = torch.nn.Linear(d_model, vocab)

    def forward(self, src, tgt_in):
        e = lambda t: self.pos(self.embed(t) * self.core.d_model**0.5)  # noqa: E731
        return self.head(self.core(e(src), e(tgt_in)))


@pytest.mark.slow  # trains a model (6 s); CI's slow tier runs it
def test_small_transformer_learns_to_reverse():
    bos, vocab, n = 0, 10, 6
    threads = torch.get_num_threads()
    # One thread: this model is too small to gain from more, and on a busy shared machine
    # spinning worker threads can slow it down a hundredfold.
    torch.set_num_threads(1)
    try:
        losses, elapsed = _train_reverse(bos, vocab, n)
    finally:
        torch.set_num_threads(threads)
    first, last = sum(losses[:5]) / 5, sum(losses[-5:]) / 5
    print(f"reverse task: loss {first:.3f} -> {last:.3f} in {elapsed:.1f}s")
    assert last < 0.3 * first  # about 2.3 -> 0.35 with this seed, in ~2 s on one core


def _train_reverse(bos, vocab, n):
    with torch.random.fork_rng():
        torch.manual_seed(0)
        model = Seq2Seq(vocab)
        opt = torch.optim.Adam(model.parameters(), lr=3e-3)
        losses, start = [], time.perf_counter()
        for _ in range(200):
            src = torch.randint(1, vocab, (64, n))
            tgt = src.flip(1)
            tgt_in = torch.cat((torch.full((64, 1), bos), tgt[:, :-1]), 1)
            logits = model(src, tgt_in)
            loss = torch.nn.functional.cross_entropy(logits.reshape(-1, vocab), tgt.reshape(-1))
            opt.zero_grad()
            loss.backward()
            opt.step()
            losses.append(loss.item())
        elapsed = time.perf_counter() - start
    return losses, elapsed
