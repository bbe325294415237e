"""Any local Hugging Face checkpoint as a model for :func:`qkv.analysis.explain`.

:func:`load_hf` reads a directory offline (``config.json``, weights, tokenizer files), runs the
model with ``attn_implementation="qkv"`` (:mod:`qkv.hf`) and rebuilds every layer's attention
maps from what qkv's own capture sees — each call's q, k, mask and log-sum-exp — with
:func:`qkv.inspect.attention_map`. ``output_attentions`` is never asked for (several
transformers models no longer return it under fused attention). Decoders (GPT-2, LLaMA,
Mistral, Qwen2, …) give causal maps; encoders (BERT-style) full ones.

Shapes: ``input_ids``/``attention_mask`` (1, N); each map (1, H, N, N).
"""

from __future__ import annotations

import json
import os
from dataclasses import dataclass
from typing import Any, Optional

from ..extras import require

__all__ = ["HFExplainModel", "load_hf", "is_bert_directory"]

_BERT_TYPES = frozenset({"bert"})
_MARKERS = ("Ġ", "▁", "Ċ")  # byte-level BPE / sentencepiece word-start and newline markers


def is_bert_directory(path: str) -> bool:
    """Whether ``path`` holds a BERT checkpoint, which :func:`qkv.models.load` rebuilds natively
    (``model_type`` "bert", or no readable config: qkv.models then says what is missing)."""
    cfg = _config(path)
    return cfg is None or cfg.get("model_type", "bert") in _BERT_TYPES


def _config(path: str) -> Optional[dict[str, Any]]:
    """The directory's config.json, or None when it cannot be read."""
    try:
        with open(os.path.join(path, "config.json"), encoding="utf-8") as f:
            cfg = json.load(f)
    except (OSError, ValueError):
        return None
    return cfg if isinstance(cfg, dict) else None


@dataclass
class _Output:
    attentions: list[Any]
    vectors: list[tuple[Any, Any]]  # per layer: (q (1, H, N, D), k (1, Hk, N, D)) as the attention saw them


class HFExplainModel:
    """A transformers model and its tokenizer, callable as ``model(ids, mask) -> .attentions``."""

    def __init__(self, model: Any, tokenizer: Any, name: str) -> None:
        self.model, self.hf_tokenizer, self.name = model, tokenizer, name
        self.config = model.config
        self.is_decoder = bool(getattr(model.config, "is_decoder", False)) or any(
            a.endswith("ForCausalLM") or a.endswith("LMHeadModel") for a in (getattr(model.config, "architectures", None) or [])
        ) or getattr(model.config, "model_type", "") in ("gpt2", "llama", "mistral", "qwen2", "gemma", "phi3", "gpt_neox")

    @property
    def max_position_embeddings(self) -> int:
        for name in ("max_position_embeddings", "n_positions", "max_seq_len"):
            v = getattr(self.config, name, None)
            if isinstance(v, int) and v > 0:
                return v
        return 2048

    def encode(self, text: str) -> tuple[list[int], list[str], Optional[list[tuple[int, int]]]]:
        """Token ids, readable token strings and character offsets (fast tokenizers)."""
        tok = self.hf_tokenizer
        try:
            enc = tok(text, return_offsets_mapping=True, add_special_tokens=True)
            offsets = [tuple(o) for o in enc["offset_mapping"]]
        except (NotImplementedError, ValueError, TypeError):
            enc, offsets = tok(text, add_special_tokens=True), None
        ids = list(enc["input_ids"])
        tokens = [self.readable(t) for t in tok.convert_ids_to_tokens(ids)]
        return ids, tokens, offsets

    def encode_pair(self, text: str, pair: str) -> tuple[list[int], list[str], Optional[list[tuple[int, int]]],
                                                       Optional[list[int]], list[Optional[int]]]:
        """A sentence pair with the tokenizer's own template: ids, tokens, offsets (each into its
        own text), token type ids (when the model takes them) and which text each token is from."""
        tok = self.hf_tokenizer
        enc = tok(text, pair, return_offsets_mapping=True, add_special_tokens=True, return_token_type_ids=True)
        ids = list(enc["input_ids"])
        try:
            seq = list(enc.sequence_ids())
        except (ValueError, AttributeError) as e:  # a slow (Python) tokenizer
            raise ValueError(f"--pair needs a fast tokenizer (tokenizer.json) in the model directory ({e})") from None
        type_ids = list(enc["token_type_ids"]) if "token_type_ids" in enc else None
        offsets = [tuple(o) for o in enc["offset_mapping"]]
        return ids, [self.readable(t) for t in tok.convert_ids_to_tokens(ids)], offsets, type_ids, seq

    @staticmethod
    def readable(token: str) -> str:
        for m in _MARKERS:
            token = token.replace(m, "" if m != "Ċ" else "\\n")
        return token or "␣"

    def token_name(self, i: int) -> str:
        """The readable string of vocabulary entry ``i``."""
        return self.readable(str(self.hf_tokenizer.convert_ids_to_tokens(int(i))))

    def _inputs(self, input_ids: Any, attention_mask: Any, token_type_ids: Any) -> dict[str, Any]:
        kw = {"input_ids": input_ids, "attention_mask": attention_mask}
        if token_type_ids is not None and "token_type_ids" in getattr(self.hf_tokenizer, "model_input_names", ()):
            kw["token_type_ids"] = token_type_ids
        return kw

    def final(self, input_ids: Any, attention_mask: Any = None, token_type_ids: Any = None) -> tuple[Any, Any]:
        """Final hidden states ``(N, E)`` and, with a language-model head, logits ``(N, V)`` (float64 numpy)."""
        import torch

        with torch.inference_mode():
            out = self.model(**self._inputs(input_ids, attention_mask, token_type_ids), output_hidden_states=True)
        hidden = out.hidden_states[-1] if getattr(out, "hidden_states", None) is not None else out.last_hidden_state
        logits = getattr(out, "logits", None)
        return hidden[0].double().cpu().numpy(), None if logits is None else logits[0].double().cpu().numpy()

    def __call__(self, input_ids: Any, attention_mask: Any = None, token_type_ids: Any = None, **_: Any) -> _Output:
        import torch

        from ..hf import observe
        from ..inspect import observed_map

        maps: list[Any] = []
        vectors: list[tuple[Any, Any]] = []

        def on_call(c: Any) -> None:
            vectors.append((c.query.detach(), c.key.detach()))
            maps.append(observed_map(c).float())  # (1, H, N, N): every argument of the call, score function and sinks too

        with torch.inference_mode(), observe(on_call):
            self.model(**self._inputs(input_ids, attention_mask, token_type_ids))
        return _Output(maps, vectors)


def _tokenizer(transformers: Any, path: str) -> Any:
    """The directory's tokenizer: the class its tokenizer_config.json names when transformers has
    it (AutoTokenizer may otherwise pick the model type's own class and ignore tokenizer.json)."""
    try:
        with open(os.path.join(path, "tokenizer_config.json"), encoding="utf-8") as f:
            name = json.load(f).get("tokenizer_class")
    except (OSError, ValueError):
        name = None
    cls = getattr(transformers, name, None) if isinstance(name, str) else None
    if cls is not None and hasattr(cls, "from_pretrained"):
        return cls.from_pretrained(path, local_files_only=True)
    return transformers.AutoTokenizer.from_pretrained(path, local_files_only=True)


def load_hf(path: str) -> HFExplainModel:
    """Load a local checkpoint directory for :func:`qkv.analysis.explain` (offline)."""
    transformers = require("transformers", "explaining a Hugging Face checkpoint")
    from ..hf import NAME, register

    register()
    try:
        tokenizer = _tokenizer(transformers, path)
    except (OSError, ValueError) as e:
        raise ValueError(f"--model {path}: no tokenizer could be loaded from the directory ({e})") from e
    archs = (_config(path) or {}).get("architectures") or []
    # with its language-model head when it has one: --ablate then reports next-token changes
    lm = any(a.endswith(("ForCausalLM", "LMHeadModel")) for a in archs)
    auto = transformers.AutoModelForCausalLM if lm else transformers.AutoModel
    bars = transformers.utils.logging
    was_on = bars.is_progress_bar_enabled()
    bars.disable_progress_bar()  # a local read of a few files: no progress bar between the command and its report
    try:
        model = auto.from_pretrained(path, local_files_only=True, attn_implementation=NAME)
    except (OSError, ValueError) as e:
        raise ValueError(f"--model {path}: the model could not be loaded with qkv's attention ({e})") from e
    finally:
        if was_on:
            bars.enable_progress_bar()
    model.eval()
    return HFExplainModel(model, tokenizer, os.path.basename(os.path.normpath(path)))
