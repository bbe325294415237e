"""qkv.hf against eager and sdpa on tiny random models of many Hugging Face architectures.

Modelled on transformers' ``_test_eager_matches_sdpa_inference`` (tests/test_modeling_common.py):
one set of random weights loaded into the eager, sdpa and qkv versions of a model, padded (and,
for encoder-decoders, unpadded) batches through each in float32 and bfloat16, and the logits and
last hidden states (the decoder's) compared on the real tokens. qkv runs twice: as ``auto``
chooses (often torch's SDPA itself for a plain call without gradients) and on its ``chunked``
backend (registered as ``CHUNKED``: its tile loops, or torch's fused kernel block by block for a
call without a float mask). Beyond that test: greedy ``generate()`` through the KV cache, one training step (the loss and
the gradient of every parameter), and each model again with its attention sharpened (every
module's ``scaling`` multiplied by 16, as if q and k were 4× larger): random initialisation
makes attention nearly uniform, where a wrong scale, mask, softcap or sink barely shows.

Every model is built from a config (nothing is downloaded). float32 is held to 1e-4 of the
largest eager output. bfloat16 is held where its error is the attention's own: every attention
call of the bfloat16 model, replayed on its own inputs, is within the accuracy rule
(tests/helpers.py) against the float64 answer, with sdpa's bfloat16 as the baseline, and where
chunked runs its tile loops within half a bfloat16 ulp (it rounds once). The whole model's
output is held to twice the error of the furthest bfloat16 peer (eager, sdpa, and eager computed
exactly and rounded once) against float32 eager, plus a floor: there the error is mostly the
other layers' rounding, and which of several exact attentions lands nearest float32 is chance
(see :func:`_bfloat16_within_bound`). A token that a bfloat16 mixture of experts sends to other
experts at a tie of its router is left out (:func:`_routing_ties`). Architectures whose
attention transformers does not route through its interface must be refused when built. The
seed is printed (tests/seeds.py: ``QKV_TEST_SEED`` replays it).
"""

from __future__ import annotations

import copy
import os
import sys
from dataclasses import dataclass
from typing import Any, Dict, Optional

import pytest
import torch

os.environ.setdefault("HF_HUB_OFFLINE", "1")
os.environ.setdefault("TRANSFORMERS_OFFLINE", "1")

transformers = pytest.importorskip("transformers")
pytest.importorskip("transformers.masking_utils")

import qkv.hf  # noqa: E402
from qkv.backends import BACKENDS  # noqa: E402

from .. import seeds  # noqa: E402
from ..helpers import assert_within_rule, max_err  # noqa: E402

SEED = seeds.derive("hf_parity")
VOCAB, N = 99, 12
SHARPEN, WIDEN = 16.0, 5.0  # attention scaling ×16 on weights initialised 5× wider
TOL32 = 1e-4  # float32: relative to the largest eager output
BF16_FLOOR = 2e-2  # bfloat16: added to 2 × sdpa's error, relative to the largest output
CHUNKED = "qkv_chunked"  # qkv on its own tile loops (qkv.hf.register(CHUNKED, backend="chunked"))
EXACT = "eager_exact"  # transformers' eager attention computed in float64 and rounded once (_eager_exact)


@dataclass
class Arch:
    name: str
    model: str  # class name in transformers
    config: str
    kw: Dict[str, Any]
    kind: str = "decoder"  # decoder | encoder | seq2seq | speech
    sdpa: bool = True  # whether transformers offers sdpa for it (else eager is the bf16 baseline)
    init: Optional[str] = "initializer_range"  # the config's weight scale, widened for sharp runs


def _dec(**kw):
    base = dict(vocab_size=VOCAB, hidden_size=32, intermediate_size=37, num_hidden_layers=2,
                num_attention_heads=4, num_key_value_heads=2, max_position_embeddings=64,
                pad_token_id=0, bos_token_id=1, eos_token_id=2)  # fmt: skip
    base.update(kw)
    return base


_BART = dict(vocab_size=VOCAB, d_model=32, encoder_layers=2, decoder_layers=2, encoder_attention_heads=4,
             decoder_attention_heads=4, encoder_ffn_dim=37, decoder_ffn_dim=37, max_position_embeddings=64,
             pad_token_id=0, bos_token_id=1, eos_token_id=2, decoder_start_token_id=2, forced_eos_token_id=None)  # fmt: skip

# fmt: off
ARCHS = [
    Arch("llama", "LlamaForCausalLM", "LlamaConfig", _dec()),
    Arch("mistral", "MistralForCausalLM", "MistralConfig", _dec(sliding_window=5)),
    Arch("mixtral", "MixtralForCausalLM", "MixtralConfig", _dec(intermediate_size=32, num_local_experts=4, num_experts_per_tok=2, sliding_window=None)),
    Arch("qwen2", "Qwen2ForCausalLM", "Qwen2Config", _dec(use_sliding_window=True, sliding_window=4, max_window_layers=1)),
    Arch("qwen2_moe", "Qwen2MoeForCausalLM", "Qwen2MoeConfig",
         _dec(num_experts=4, num_experts_per_tok=2, moe_intermediate_size=16, shared_expert_intermediate_size=24)),
    Arch("qwen3", "Qwen3ForCausalLM", "Qwen3Config", _dec(head_dim=8)),
    Arch("qwen3_moe", "Qwen3MoeForCausalLM", "Qwen3MoeConfig",
         _dec(head_dim=8, num_experts=4, num_experts_per_tok=2, moe_intermediate_size=16)),
    Arch("gemma", "GemmaForCausalLM", "GemmaConfig", _dec(head_dim=8)),
    Arch("gemma2", "Gemma2ForCausalLM", "Gemma2Config",  # softcap: scores squashed to (-5, 5)
         _dec(head_dim=8, attn_logit_softcapping=5.0, final_logit_softcapping=None, sliding_window=4,
              query_pre_attn_scalar=8), sdpa=False),
    Arch("gemma3", "Gemma3ForCausalLM", "Gemma3TextConfig",
         _dec(head_dim=8, sliding_window=4, query_pre_attn_scalar=8, layer_types=["sliding_attention", "full_attention"])),
    Arch("gpt_oss", "GptOssForCausalLM", "GptOssConfig",  # attention sinks (s_aux)
         _dec(head_dim=8, intermediate_size=32, num_local_experts=4, num_experts_per_tok=2, sliding_window=4,
              layer_types=["sliding_attention", "full_attention"]), sdpa=False),
    Arch("phi", "PhiForCausalLM", "PhiConfig", _dec(num_key_value_heads=4, resid_pdrop=0.0, embd_pdrop=0.0)),
    Arch("phi3", "Phi3ForCausalLM", "Phi3Config", _dec()),
    Arch("starcoder2", "Starcoder2ForCausalLM", "Starcoder2Config", _dec(sliding_window=None)),
    Arch("olmo", "OlmoForCausalLM", "OlmoConfig", _dec()),
    Arch("olmo2", "Olmo2ForCausalLM", "Olmo2Config", _dec()),
    Arch("cohere", "CohereForCausalLM", "CohereConfig", _dec(use_qk_norm=False)),
    Arch("stablelm", "StableLmForCausalLM", "StableLmConfig", _dec(qk_layernorm=False)),
    Arch("granite", "GraniteForCausalLM", "GraniteConfig", _dec(attention_multiplier=0.25)),
    Arch("gpt_neox", "GPTNeoXForCausalLM", "GPTNeoXConfig", _dec(num_key_value_heads=None)),
    Arch("gpt2", "GPT2LMHeadModel", "GPT2Config",
         dict(vocab_size=VOCAB, n_embd=32, n_layer=2, n_head=4, n_positions=64, pad_token_id=0, bos_token_id=1, eos_token_id=2)),
    Arch("gpt_bigcode", "GPTBigCodeForCausalLM", "GPTBigCodeConfig",  # multi-query attention
         dict(vocab_size=VOCAB, n_embd=32, n_layer=2, n_head=4, n_positions=64, multi_query=True,
              pad_token_id=0, bos_token_id=1, eos_token_id=2)),
    Arch("gptj", "GPTJForCausalLM", "GPTJConfig",
         dict(vocab_size=VOCAB, n_embd=32, n_layer=2, n_head=4, n_positions=64, rotary_dim=4,
              pad_token_id=0, bos_token_id=1, eos_token_id=2)),
    Arch("opt", "OPTForCausalLM", "OPTConfig",
         dict(vocab_size=VOCAB, hidden_size=32, num_hidden_layers=2, num_attention_heads=4, ffn_dim=37,
              word_embed_proj_dim=32, max_position_embeddings=64, pad_token_id=0, bos_token_id=1, eos_token_id=2), init="init_std"),
    Arch("bert", "BertForMaskedLM", "BertConfig",
         dict(vocab_size=VOCAB, hidden_size=32, num_hidden_layers=2, num_attention_heads=4, intermediate_size=37,
              max_position_embeddings=64, pad_token_id=0), kind="encoder"),
    Arch("roberta", "RobertaForMaskedLM", "RobertaConfig",
         dict(vocab_size=VOCAB, hidden_size=32, num_hidden_layers=2, num_attention_heads=4, intermediate_size=37,
              max_position_embeddings=64, pad_token_id=0), kind="encoder"),
    Arch("t5", "T5ForConditionalGeneration", "T5Config",  # relative bias through position_bias
         dict(vocab_size=VOCAB, d_model=32, d_kv=8, d_ff=37, num_layers=2, num_heads=4, pad_token_id=0,
              eos_token_id=2, decoder_start_token_id=0, relative_attention_num_buckets=8,
              relative_attention_max_distance=16), kind="seq2seq", init=None),  # already sharp
    Arch("bart", "BartForConditionalGeneration", "BartConfig", dict(_BART), kind="seq2seq", init="init_std"),
    Arch("whisper", "WhisperForConditionalGeneration", "WhisperConfig",
         dict(vocab_size=VOCAB, d_model=32, encoder_layers=2, decoder_layers=2, encoder_attention_heads=4,
              decoder_attention_heads=4, encoder_ffn_dim=37, decoder_ffn_dim=37, num_mel_bins=8,
              max_source_positions=8, max_target_positions=32, pad_token_id=0, bos_token_id=1, eos_token_id=2,
              decoder_start_token_id=1, suppress_tokens=None, begin_suppress_tokens=None), kind="speech", init="init_std"),
]

# Attention computed inside the model's own layers: qkv must refuse them, never be bypassed.
REFUSED = [
    ("bloom", "BloomForCausalLM", "BloomConfig", dict(vocab_size=VOCAB, hidden_size=32, n_layer=2, n_head=4)),
    ("xglm", "XGLMForCausalLM", "XGLMConfig", dict(vocab_size=VOCAB, d_model=32, num_layers=2, attention_heads=4, ffn_dim=37)),
    ("falcon", "FalconForCausalLM", "FalconConfig", dict(vocab_size=VOCAB, hidden_size=32, num_hidden_layers=2, num_attention_heads=4)),
    ("gpt_neo", "GPTNeoForCausalLM", "GPTNeoConfig",
     dict(vocab_size=VOCAB, hidden_size=32, num_layers=2, num_heads=4, attention_types=[[["global", "local"], 1]])),
    ("mpt", "MptForCausalLM", "MptConfig", dict(vocab_size=VOCAB, d_model=32, n_layers=2, n_heads=4)),
]
# fmt: on


@pytest.fixture(scope="module", autouse=True)
def _registered():
    qkv.hf.register()
    qkv.hf.register(CHUNKED, backend="chunked")
    from transformers import AttentionInterface
    from transformers.masking_utils import AttentionMaskInterface, eager_mask

    AttentionInterface.register(EXACT, _eager_exact)
    AttentionMaskInterface.register(EXACT, eager_mask)
    print(f"seed {SEED} ({seeds.describe()})")


def _eager_exact(module, query, key, value, attention_mask, **kwargs):
    """The attention module's own eager function (transformers') in float64 on the call's
    inputs, its output rounded to their dtype once: what an exact attention gives inside a
    bfloat16 model, with nothing of qkv in it."""
    eager = sys.modules[type(module).__module__].eager_attention_forward

    def wide(t):
        return t.double() if isinstance(t, torch.Tensor) and t.is_floating_point() else t

    out, weights = eager(module, wide(query), wide(key), wide(value), wide(attention_mask),
                         **{k: wide(v) for k, v in kwargs.items()})  # fmt: skip
    return out.to(query.dtype), weights


def _seed(arch: str, what: str) -> torch.Generator:
    s = (SEED + sum(map(ord, arch + what)) * 7919) % 2**31
    torch.manual_seed(s)
    return torch.Generator().manual_seed(s)


def _classes(arch: Arch):
    cls, cfg = getattr(transformers, arch.model, None), getattr(transformers, arch.config, None)
    if cls is None or cfg is None:
        missing = arch.model if cls is None else arch.config
        msg = f"{arch.name}: transformers {transformers.__version__} has no {missing}"
        print(msg)
        pytest.skip(msg)
    return cls, cfg


def _no_dropout(model: torch.nn.Module) -> None:
    """Training-mode forward without randomness: every dropout probability to 0."""
    for m in model.modules():
        if isinstance(m, torch.nn.Dropout):
            m.p = 0.0
        for k, v in list(vars(m).items()):
            if "drop" in k and isinstance(v, float):
                setattr(m, k, 0.0)


def _sharpen(model: torch.nn.Module, factor: float) -> int:
    """Multiply every attention module's ``scaling`` (what HF passes to the attention function
    or multiplies the queries by): scores grow ``factor``-fold, weights stop being uniform."""
    n = 0
    for m in model.modules():
        if isinstance(getattr(m, "scaling", None), float):
            m.scaling *= factor
            n += 1
    return n


def _models(arch: Arch, impls=("eager", "sdpa", "qkv"), sharpen: float = 1.0):
    """The same random weights under each implementation (float32, eval mode); with
    ``sharpen``, initialised ``WIDEN``× wider and with attention scaling × ``sharpen``."""
    cls, cfg_cls = _classes(arch)
    _seed(arch.name, "weights")
    config = cfg_cls(**arch.kw)
    if sharpen != 1.0 and arch.init is not None:
        setattr(config, arch.init, getattr(config, arch.init) * WIDEN)
    out = {}
    for impl in impls:
        if impl == "sdpa" and not arch.sdpa:
            continue
        m = cls._from_config(copy.deepcopy(config), attn_implementation=impl).eval()
        got = m.config._attn_implementation
        assert got == impl, f"{arch.name}: asked for {impl}, got {got}"
        if out:
            m.load_state_dict(next(iter(out.values())).state_dict())
        else:
            with torch.no_grad():  # sinks that matter: GPT-OSS initialises them to ~0
                for name, p in m.named_parameters():
                    if name.endswith("sinks"):
                        p.normal_(0.0, 2.0)
        if sharpen != 1.0:
            assert _sharpen(m, sharpen) > 0, f"{arch.name}: no module has a float `scaling` to sharpen"
        out[impl] = m
    return out


def _inputs(arch: Arch, side: str, b: int = 3, n: int = N) -> Dict[str, torch.Tensor]:
    g = _seed(arch.name, "inputs" + side)
    ids = torch.randint(3, VOCAB, (b, n), generator=g)
    mask = torch.ones(b, n, dtype=torch.long)
    for i, length in enumerate([n, n - 4, n - 9][:b]):
        if side == "left":
            mask[i, : n - length] = 0
        elif side == "right":
            mask[i, length:] = 0
    ids = ids.masked_fill(mask == 0, 0)
    if arch.kind == "speech":  # (B, mel bins, 2 × max_source_positions) features, no padding
        feats = torch.randn(b, arch.kw["num_mel_bins"], 2 * arch.kw["max_source_positions"], generator=g)
        return {"input_features": feats, "decoder_input_ids": ids[:, :8].clamp(min=3)}
    if arch.kind == "seq2seq":
        dec = torch.randint(3, VOCAB, (b, 7), generator=g)
        if side == "none":  # no attention_mask at all: T5's position bias is the only float mask
            return {"input_ids": ids, "decoder_input_ids": dec}
        return {"input_ids": ids, "attention_mask": mask, "decoder_input_ids": dec}
    return {"input_ids": ids, "attention_mask": mask}


def _real(arch: Arch, inputs) -> torch.Tensor:
    """(B, N) True where the logits belong to a real token."""
    if arch.kind in ("seq2seq", "speech"):
        return torch.ones_like(inputs["decoder_input_ids"], dtype=torch.bool)
    return inputs["attention_mask"].bool()


def _logits(model, inputs) -> torch.Tensor:
    dtype = next(model.parameters()).dtype  # float inputs (Whisper's features) follow the model
    inputs = {k: v.to(dtype) if v.is_floating_point() else v for k, v in inputs.items()}
    with torch.no_grad():
        return model(**inputs).logits.float()


def _outputs(model, inputs) -> Dict[str, Any]:
    """The logits and the last hidden state (the decoder's, for encoder-decoders), (B, N, ·)
    float32; for a mixture of experts also each layer's router logits ``(B, N, experts)``."""
    dtype = next(model.parameters()).dtype
    inputs = {k: v.to(dtype) if v.is_floating_point() else v for k, v in inputs.items()}
    moe = bool(getattr(model.config, "num_experts_per_tok", None))
    with torch.no_grad():
        out = model(**inputs, output_hidden_states=True, **({"output_router_logits": True} if moe else {}))
    hidden = out.decoder_hidden_states if "decoder_hidden_states" in out else out.hidden_states
    got = {"logits": out.logits.float(), "hidden": hidden[-1].float()}
    if moe:
        got["router"] = [r.float().reshape(*out.logits.shape[:2], -1) for r in out.router_logits]
    return got


def _routing_ties(ref: Dict[str, Any], got: Dict[str, Any], k: int, real: torch.Tensor) -> torch.Tensor:
    """(B, N) True where a bfloat16 mixture of experts sends a real token to other experts than
    float32 eager does, in some layer, at a tie: eager's k-th and (k+1)-th router logits closer
    than twice the largest change bfloat16 made to a router logit. Either choice is then as
    right as the other, and the token's output jumps by a whole expert's difference (GPT-OSS,
    seed 2: a gap of 2.9e-4 on router logits up to 0.34 gave logits 0.074 apart)."""
    ties = torch.zeros_like(real)
    for a, b in zip(ref.get("router", ()), got.get("router", ())):  # (B, N, experts) per layer
        chosen = (a.topk(k, -1).indices.sort(-1).values != b.topk(k, -1).indices.sort(-1).values).any(-1)
        ranked = a.sort(-1, descending=True).values
        reach = 2 * float((b - a).abs()[real & ~ties].max())  # (tokens already apart excluded)
        ties |= real & chosen & (ranked[..., k - 1] - ranked[..., k] < reach)
    return ties


def _calls_within_rule(model, inputs, what: str) -> int:
    """Every attention call of ``model`` (bfloat16, run by qkv) replayed on its own inputs by
    qkv's ``chunked`` and ``auto``: within the accuracy rule against the float64 answer, with
    the same call in bfloat16 on torch's SDPA as the baseline (qkv's ``math`` where SDPA cannot
    express it: a score function, sinks, a window). Where chunked runs its tile loops (a float
    mask such as T5's position bias, a score function, sinks), which compute in float32 and
    round once, its error is also at most half a bfloat16 ulp of the largest output (ulp(x) ≤
    2^-7·|x|) plus float32's own: no rounding of the weights or the scores to bfloat16 on the
    way (torch's fused kernel, which chunked calls for the other calls, rounds the weights to
    bfloat16 before P·V, as SDPA does). Returns the number of calls."""
    inputs = {k: v.to(torch.bfloat16) if v.is_floating_point() else v for k, v in inputs.items()}
    with qkv.hf.observe() as calls, torch.no_grad():
        model(**inputs)
    for n, c in enumerate(calls):
        sinks = None if c.sinks is None else c.sinks.detach()
        kw = dict(attn_mask=c.attn_mask, is_causal=c.is_causal, scale=c.scale, window=c.window, score_mod=c.score_mod,
                  sinks=sinks, enable_gqa=c.query.shape[1] != c.key.shape[1])  # fmt: skip
        wide = {k: v.double() if isinstance(v, torch.Tensor) and v.is_floating_point() else v for k, v in kw.items()}
        ref = qkv.attention(c.query.double(), c.key.double(), c.value.double(), backend="math", **wide)
        if c.score_mod is None and sinks is None and c.window is None:
            plain = {k: v for k, v in kw.items() if k not in ("window", "score_mod", "sinks")}
            base = torch.nn.functional.scaled_dot_product_attention(c.query, c.key, c.value, **plain)
        else:
            base = qkv.attention(c.query, c.key, c.value, backend="math", **kw)
        at = f"{what} call {n} (layer {c.layer_idx})"
        got = {b: qkv.attention(c.query, c.key, c.value, backend=b, **kw) for b in ("chunked", "auto")}
        for backend, out in got.items():
            assert_within_rule(out, base, ref, torch.bfloat16, what=f"{at} {backend}")
        if BACKENDS["chunked"].kernel(qkv.call.validate(c.query, c.key, c.value, **kw)) == "tiles":
            top = float(ref.abs().max())
            err, bound = max_err(got["chunked"], ref), 2.0**-8 * top + 1e-5 * max(1.0, top)
            print(f"{at} chunked's tile loops: err={err:.3e}, half an ulp of the largest output {2.0**-8 * top:.3e}")
            assert err <= bound, f"{at}: chunked's tile loops miss by {err:.3e}, more than rounding once ({bound:.3e})"
    return len(calls)


def _err(got: torch.Tensor, ref: torch.Tensor, real: torch.Tensor) -> float:
    assert torch.isfinite(got[real]).all(), "non-finite outputs on real tokens"
    return float((got - ref).abs()[real].max())


def _row_max_weight(model, inputs) -> float:
    """Mean over attention rows that see at least 4 keys of their largest weight (≤ 0.25 for
    uniform attention), from qkv's own record of each call."""
    maxima = []

    def on_call(c):
        w = qkv.attention_weights(
            c.query, c.key, attn_mask=c.attn_mask, is_causal=c.is_causal, scale=c.scale,
            enable_gqa=c.query.shape[1] != c.key.shape[1], window=c.window, score_mod=c.score_mod, sinks=c.sinks,
        )  # fmt: skip
        top, seen = w.amax(-1), (w > 0).sum(-1)  # (B, H, Nq)
        if bool((seen >= 4).any()):
            maxima.append(top[seen >= 4].mean())

    with qkv.hf.observe(on_call), torch.no_grad():
        model(**inputs)
    assert maxima, "the model made no attention call through qkv"
    return float(torch.stack(maxima).mean())


SIDES = {"decoder": ("left",), "encoder": ("right", "left"), "seq2seq": ("right", "none"), "speech": ("none",)}


def _ids(archs):
    return [pytest.param(a, id=a.name) for a in archs]


# ------------------------------------------------------------------------------------- forward
@pytest.mark.parametrize("arch", _ids(ARCHS))
def test_forward_matches_eager_and_sdpa(arch: Arch):
    """float32 logits within 1e-4 of eager (and sdpa), on auto and on chunked; bfloat16 logits
    and last hidden states no further from float32 eager than sdpa's bfloat16 (2× + floor), and
    each bfloat16 attention call within the accuracy rule; with default and sharpened attention."""
    for sharpen in (1.0, SHARPEN):
        models = _models(arch, impls=("eager", "sdpa", "qkv", CHUNKED, EXACT), sharpen=sharpen)
        for side in SIDES[arch.kind]:
            inputs = _inputs(arch, side)
            real = _real(arch, inputs)
            ref = _logits(models["eager"], inputs)
            scale = float(ref[real].abs().max())
            what = f"{arch.name} sharpen={sharpen:g} padding={side}"
            for name in ("qkv", CHUNKED):
                with qkv.hf.observe() as calls:
                    got = _logits(models[name], inputs)
                assert calls, f"{what}: {name} never called qkv"
                err = _err(got, ref, real)
                print(f"{what}: float32 |{name} - eager| {err:.2e} (logits up to {scale:.3g})")
                bound = TOL32 * scale
                assert err <= bound, f"{what}: float32 {name} logits differ from eager by {err:.3e} > {bound:.3e}"
                if "sdpa" in models:
                    e_sdpa = _err(got, _logits(models["sdpa"], inputs), real)
                    assert e_sdpa <= TOL32 * scale, f"{what}: float32 {name} logits differ from sdpa by {e_sdpa:.3e}"
            if sharpen != 1.0:
                peak = _row_max_weight(models["qkv"], inputs)
                print(f"{what}: mean largest attention weight {peak:.2f}")
                assert peak > 0.5, f"{what}: sharpening left attention nearly uniform (mean row max {peak:.2f})"
            _bfloat16_within_bound(models, inputs, real, what)


def _bfloat16_within_bound(models, inputs, real, what: str) -> None:
    """The bfloat16 models' logits and last hidden states against float32 eager: qkv (auto and
    chunked) within 2 × the furthest bfloat16 peer's error + ``BF16_FLOOR`` of the largest
    output; then each attention call on its own (:func:`_calls_within_rule`).

    The peers are eager, sdpa (where the model has it) and eager computed exactly
    (:data:`EXACT`). Which of several equally exact attentions lands nearest float32 at the
    model's output is chance: the other layers' bfloat16 rounding, carried through sharp
    attention or a router, decides it. chunked rounds once, like the exact peer; sdpa rounds
    the weights to bfloat16 before P·V. T5, sharpened, unpadded, QKV_TEST_SEED=13: chunked's
    logits 1.52 from float32 eager, bit for bit the exact peer's, where sdpa's land 0.30 away
    and eager's 0.79. A bound on sdpa alone fails the exact answer there."""
    ref = _outputs(models["eager"], inputs)
    peers = ["eager", EXACT] + (["sdpa"] if "sdpa" in models else [])
    half = {k: copy.deepcopy(models[k]).to(torch.bfloat16) for k in (*peers, "qkv", CHUNKED)}
    outs = {k: _outputs(m, inputs) for k, m in half.items()}
    k = getattr(models["eager"].config, "num_experts_per_tok", None) or 0
    ties = {name: _routing_ties(ref, out, k, real) for name, out in outs.items()}
    for name in ("qkv", CHUNKED):
        seen = real & ~ties[name]
        for p in peers:
            seen &= ~ties[p]
        if bool((seen != real).any()):
            print(f"{what}: {name}: tokens at a routing tie left out: {(real & ~seen).nonzero().tolist()}")
        for part in ("logits", "hidden"):
            r = ref[part]
            top = float(r[real].abs().max())

            def err(key):
                d = (outs[key][part] - r).abs()[seen]
                assert torch.isfinite(d).all(), f"{what}: {key}: non-finite {part} on real tokens"
                return float(d.max()), float(d.mean())

            e, mean = err(name)
            e_peers = {p: err(p) for p in peers}
            bound = 2 * max(m for m, _ in e_peers.values()) + BF16_FLOOR * top
            said = ", ".join(f"{p} {m:.2e} ({a:.2e})" for p, (m, a) in e_peers.items())
            print(f"{what}: bfloat16 {part} vs float32 eager, max (mean): {name} {e:.2e} ({mean:.2e}); {said}; "
                  f"bound {bound:.2e}, {e / bound:.0%} used")  # fmt: skip
            assert e <= bound, f"{what}: bfloat16 {name} {part} error {e:.3e} > 2 × the furthest peer's + floor ({said})"
    n = _calls_within_rule(half["qkv"], inputs, what)
    print(f"{what}: {n} bfloat16 attention calls within the rule on chunked and auto")


# ------------------------------------------------------------------------------------ generate
def _first_divergence(a: torch.Tensor, b: torch.Tensor) -> Optional[int]:
    diff = (a != b).any(0).nonzero()
    return int(diff[0]) if diff.numel() else None


@pytest.mark.parametrize("arch", _ids([a for a in ARCHS if a.kind != "encoder"]))
def test_greedy_generate_with_cache_matches_eager(arch: Arch):
    models = _models(arch, impls=("eager", "qkv"), sharpen=SHARPEN)
    inputs = _inputs(arch, "left" if arch.kind == "decoder" else SIDES[arch.kind][0])
    if arch.kind in ("seq2seq", "speech"):
        inputs.pop("decoder_input_ids")
    kw = dict(max_new_tokens=6, do_sample=False, use_cache=True, pad_token_id=0, eos_token_id=None)
    with torch.no_grad():
        ref = models["eager"].generate(**inputs, **kw)
        with qkv.hf.observe() as calls:
            got = models["qkv"].generate(**inputs, **kw)
    assert calls, f"{arch.name}: generate never called qkv"
    decoding = [c for c in calls if c.query.shape[2] == 1]  # one new token against the cache
    longest = max((c.key.shape[2] for c in decoding), default=0)
    assert longest >= kw["max_new_tokens"] - 1, f"{arch.name}: no cached decoding through qkv ({longest} keys at most)"
    assert got.shape == ref.shape, f"{arch.name}: generated shapes {tuple(got.shape)} vs eager {tuple(ref.shape)}"
    at = _first_divergence(got, ref)
    if at is not None:
        # Only a tie in eager's own logits at that step may excuse a different token.
        rows = got[:, at] != ref[:, at]
        with torch.no_grad():
            if arch.kind in ("seq2seq", "speech"):
                logits = models["eager"](**inputs, decoder_input_ids=ref[:, :at]).logits[:, -1]
            else:
                grown = torch.ones(ref.shape[0], at - inputs["input_ids"].shape[1], dtype=torch.long)
                mask = torch.cat([inputs["attention_mask"], grown], 1)
                logits = models["eager"](input_ids=ref[:, :at], attention_mask=mask).logits[:, -1]
        top2 = logits[rows].topk(2, -1).values
        gap = float((top2[:, 0] - top2[:, 1]).max())
        assert gap < 1e-4 * float(logits.abs().max()), (
            f"{arch.name}: greedy tokens differ from eager at position {at}, where eager's best logit "
            f"leads by {gap:.3e}:\n"
            f"eager {ref.tolist()}\nqkv   {got.tolist()}"
        )
    print(f"{arch.name}: generated {got.shape[1]} tokens, {len(decoding)} cached decoding calls through qkv")


# ------------------------------------------------------------------------------------ training
@pytest.mark.parametrize("arch", _ids(ARCHS))
def test_training_step_gradients_match_eager(arch: Arch):
    models = _models(arch, impls=("eager", "qkv"), sharpen=SHARPEN)
    inputs = _inputs(arch, SIDES[arch.kind][0])
    if arch.kind in ("seq2seq", "speech"):
        labels = inputs["decoder_input_ids"].clone()
    else:
        pad = inputs["attention_mask"] == 0
        if arch.kind == "decoder":
            # A causal LM predicts token i + 1 from position i: the first real token of a
            # left-padded row would be scored from a padding row, which sees no key and whose
            # output eager (uniform weights) and sdpa (zero, as qkv) define differently.
            pad[:, 1:] |= pad[:, :-1].clone()
        labels = inputs["input_ids"].masked_fill(pad, -100)
    grads, losses = {}, {}
    for impl, m in models.items():
        _no_dropout(m)
        m.train()
        m.zero_grad(set_to_none=True)
        loss = m(**inputs, labels=labels).loss
        loss.backward()
        losses[impl] = float(loss.detach())
        grads[impl] = {n: p.grad for n, p in m.named_parameters() if p.requires_grad}
        opt = torch.optim.SGD(m.parameters(), lr=0.1)
        opt.step()
    assert abs(losses["qkv"] - losses["eager"]) <= TOL32 * abs(losses["eager"]), f"{arch.name}: loss {losses}"
    top = max(float(g.abs().max()) for g in grads["eager"].values() if g is not None)
    worst = (0.0, "")  # the largest error as a share of its bound
    for name, ge in grads["eager"].items():
        gq = grads["qkv"][name]
        assert (ge is None) == (gq is None), f"{arch.name}: {name} has a gradient under one implementation only"
        if ge is None:
            continue
        err = float((gq - ge).abs().max())
        bound = 2e-4 * float(ge.abs().max()) + 1e-5 * top
        assert torch.isfinite(gq).all(), f"{arch.name}: non-finite gradient for {name}"
        assert err <= bound, f"{arch.name}: gradient of {name} differs from eager by {err:.3e} > {bound:.3e}"
        worst = max(worst, (err / bound, name))
    print(f"{arch.name}: loss {losses['qkv']:.5f} (eager {losses['eager']:.5f}); gradients of {len(grads['eager'])} "
          f"parameters within bounds, the closest at {worst[0]:.1%} of its bound ({worst[1]})")
    # the step itself: both models moved the same way
    with torch.no_grad():
        after = {impl: float(m(**inputs, labels=labels).loss) for impl, m in models.items()}
    assert abs(after["qkv"] - after["eager"]) <= 10 * TOL32 * abs(after["eager"]), f"{arch.name}: after a step {after}"


# ------------------------------------------------------------------------------------- refusal
@pytest.mark.parametrize("name,model,config,kw", [pytest.param(*r, id=r[0]) for r in REFUSED])
def test_models_that_bypass_the_interface_are_refused(name, model, config, kw):
    cls, cfg_cls = getattr(transformers, model, None), getattr(transformers, config, None)
    if cls is None or cfg_cls is None:
        pytest.skip(f"{name}: transformers {transformers.__version__} has no {model}")
    cls._from_config(cfg_cls(**kw), attn_implementation="eager")  # the model itself is fine
    with pytest.raises(qkv.hf.UnsupportedModelError) as info:
        cls._from_config(cfg_cls(**kw), attn_implementation="qkv")
    msg = str(info.value)
    print(msg)
    assert model in msg and "attn_implementation='eager'" in msg and "interface" in msg, msg
    assert qkv.hf.unsupported_reason(cls) is not None


def test_a_model_calling_the_interface_is_not_refused():
    for arch in ARCHS:
        cls = getattr(transformers, arch.model, None)
        if cls is not None:
            assert qkv.hf.unsupported_reason(cls) is None, f"{arch.model}: {qkv.hf.unsupported_reason(cls)}"


# ------------------------------------------------------------------------------ the test's power
_WRONG = {
    "scale x1.5": lambda kw: {**kw, "scaling": (kw.get("scaling") or 1.0) * 1.5},
    "no softcap": lambda kw: {**kw, "softcap": None},
    "no sinks": lambda kw: {**kw, "s_aux": None},
}


@pytest.mark.parametrize(
    "bug,archs",
    [("scale x1.5", ("llama", "bert", "t5", "gpt2")), ("no softcap", ("gemma2",)), ("no sinks", ("gpt_oss",))],
)
def test_a_wrong_attention_fails_the_comparison(bug, archs):
    """A registered attention that is qkv with one mistake misses eager by orders of magnitude
    more than the float32 tolerance on sharpened models: the comparison above would catch it."""
    from transformers import AttentionInterface
    from transformers.masking_utils import AttentionMaskInterface, sdpa_mask

    def wrong(module, query, key, value, attention_mask, **kw):
        kw = _WRONG[bug](kw)
        return qkv.hf.attention_forward(module, query, key, value, attention_mask, **kw)

    name = "qkv_test_wrong"
    AttentionInterface.register(name, wrong)
    AttentionMaskInterface.register(name, sdpa_mask)
    for arch in (a for a in ARCHS if a.name in archs):
        models = _models(arch, impls=("eager", name), sharpen=SHARPEN)
        inputs = _inputs(arch, SIDES[arch.kind][0])
        real = _real(arch, inputs)
        ref = _logits(models["eager"], inputs)
        err = _err(_logits(models[name], inputs), ref, real)
        scale = float(ref[real].abs().max())
        print(f"{bug} on {arch.name}: error {err:.2e}, {err / (TOL32 * scale):.0f}× the tolerance")
        assert err > 100 * TOL32 * scale, f"{bug} on {arch.name}: error {err:.3e} is within 100× the tolerance"
