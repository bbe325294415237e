"""BERT rebuilt from :mod:`qkv.nn` layers, loading Hugging Face checkpoints from safetensors.

Shape legend::

    B batch   N tokens (padded)   E hidden size   H heads   L layers

The model is embeddings (word + position + token type → LayerNorm) followed by ``L``
post-norm :class:`qkv.nn.TransformerEncoderLayer` blocks with exact (erf) GELU — the layer
BERT uses — so module paths read ``encoder.layers.3.self_attn``. Weights come from
``model.safetensors`` through an explicit name map (no pickle, no network, no Hugging Face
model code); the tokenizer comes from ``tokenizer.json`` through the ``tokenizers`` package.

A directory is "BERT-style" when it holds ``config.json`` (``model_type`` ``bert``),
``model.safetensors`` and ``tokenizer.json``; ``1_Pooling/config.json`` and
``sentence_bert_config.json`` (sentence-transformers) are read when present.
"""

from __future__ import annotations

import json
from dataclasses import dataclass, field, fields
from pathlib import Path
from typing import Any, Dict, List, Optional, Sequence, Tuple, Union

import numpy as np
import torch
import torch.nn.functional as F
from torch import Tensor, nn

from ..nn import TransformerEncoderLayer

__all__ = [
    "BertConfig",
    "PoolingConfig",
    "BertOutput",
    "BertEmbeddings",
    "BertLayer",
    "BertEncoder",
    "BertPooler",
    "BertModel",
    "hf_weight_map",
    "load_bert",
]

PathLike = Union[str, Path]

# Hugging Face ``hidden_act`` → the activation names of qkv.nn.
_ACTIVATIONS = {"gelu": "gelu", "gelu_new": "gelu_tanh", "gelu_pytorch_tanh": "gelu_tanh", "relu": "relu", "silu": "silu"}

REQUIRED_FILES = ("config.json", "model.safetensors", "tokenizer.json")


# ---------------------------------------------------------------------------------- config
@dataclass
class BertConfig:
    """The fields of a Hugging Face ``config.json`` that define a BERT encoder."""

    vocab_size: int = 30522
    hidden_size: int = 768
    num_hidden_layers: int = 12
    num_attention_heads: int = 12
    intermediate_size: int = 3072
    hidden_act: str = "gelu"
    max_position_embeddings: int = 512
    type_vocab_size: int = 2
    layer_norm_eps: float = 1e-12
    pad_token_id: int = 0
    position_embedding_type: str = "absolute"
    model_type: str = "bert"
    raw: Dict[str, Any] = field(default_factory=dict, repr=False, compare=False)

    @classmethod
    def from_dict(cls, d: Dict[str, Any]) -> "BertConfig":
        names = {f.name for f in fields(cls)} - {"raw"}
        cfg = cls(**{k: d[k] for k in names if k in d and d[k] is not None}, raw=dict(d))
        cfg.validate()
        return cfg

    @classmethod
    def from_file(cls, path: PathLike) -> "BertConfig":
        with open(path, encoding="utf-8") as f:
            return cls.from_dict(json.load(f))

    def validate(self) -> None:
        if self.model_type not in ("bert", ""):
            raise ValueError(
                f"config.json has model_type={self.model_type!r}; qkv.models loads BERT encoders "
                "(model_type 'bert'), e.g. all-MiniLM-L6-v2"
            )
        if self.hidden_act not in _ACTIVATIONS:
            raise ValueError(f"hidden_act={self.hidden_act!r} is not supported; use one of {sorted(_ACTIVATIONS)}")
        if self.position_embedding_type != "absolute":
            raise ValueError(
                f"position_embedding_type={self.position_embedding_type!r} is not supported; only "
                "'absolute' learned position embeddings are implemented"
            )
        if self.hidden_size % self.num_attention_heads:
            raise ValueError(
                f"hidden_size={self.hidden_size} is not divisible by num_attention_heads={self.num_attention_heads}"
            )

    @property
    def head_dim(self) -> int:
        return self.hidden_size // self.num_attention_heads


@dataclass
class PoolingConfig:
    """sentence-transformers' ``1_Pooling/config.json``: how token vectors become one vector."""

    pooling_mode_cls_token: bool = False
    pooling_mode_mean_tokens: bool = True
    pooling_mode_max_tokens: bool = False
    pooling_mode_mean_sqrt_len_tokens: bool = False

    @classmethod
    def from_file(cls, path: PathLike) -> "PoolingConfig":
        with open(path, encoding="utf-8") as f:
            d = json.load(f)
        names = {f.name for f in fields(cls)}
        unknown = [k for k, v in d.items() if k.startswith("pooling_mode_") and k not in names and v]
        if unknown:
            raise ValueError(f"{path}: pooling modes {unknown} are not supported; qkv supports {sorted(names)}")
        return cls(**{k: bool(d[k]) for k in names if k in d})

    @property
    def modes(self) -> List[str]:
        return [f.name[len("pooling_mode_") :] for f in fields(self) if getattr(self, f.name)]


# ---------------------------------------------------------------------------------- output
@dataclass
class BertOutput:
    """What :meth:`BertModel.forward` returns; also indexable like a dict (``out["last_hidden_state"]``).

    - ``last_hidden_state`` (B, N, E)
    - ``pooler_output`` (B, E) — tanh(dense(first token)), when the checkpoint has a pooler
    - ``hidden_states`` — L + 1 tensors (B, N, E): the embeddings, then each layer's output
    - ``attentions`` — L tensors (B, H, N, N): each layer's softmax weights (padded keys get 0)
    """

    last_hidden_state: Tensor
    pooler_output: Optional[Tensor] = None
    hidden_states: Optional[Tuple[Tensor, ...]] = None
    attentions: Optional[Tuple[Tensor, ...]] = None

    def __getitem__(self, name: str) -> Any:
        if not isinstance(name, str) or name not in self.keys():
            raise KeyError(f"{name!r}; BertOutput has {self.keys()}")
        return getattr(self, name)

    def keys(self) -> List[str]:
        return [f.name for f in fields(self) if getattr(self, f.name) is not None]

    def __repr__(self) -> str:
        parts = []
        for k in self.keys():
            v = getattr(self, k)
            parts.append(f"{k}={tuple(v.shape)}" if isinstance(v, Tensor) else f"{k}=({len(v)} × {tuple(v[0].shape)})")
        return f"BertOutput({', '.join(parts)})"


# ---------------------------------------------------------------------------------- modules
class BertEmbeddings(nn.Module):
    """word + position + token-type embeddings → LayerNorm (→ dropout, training only)."""

    def __init__(self, config: BertConfig, dropout: float = 0.0) -> None:
        super().__init__()
        e = config.hidden_size
        self.word_embeddings = nn.Embedding(config.vocab_size, e, padding_idx=config.pad_token_id)
        self.position_embeddings = nn.Embedding(config.max_position_embeddings, e)
        self.token_type_embeddings = nn.Embedding(config.type_vocab_size, e)
        self.norm = nn.LayerNorm(e, eps=config.layer_norm_eps)
        self.dropout = nn.Dropout(dropout)

    def forward(self, input_ids: Tensor, token_type_ids: Tensor) -> Tensor:
        n = input_ids.shape[1]
        max_n = self.position_embeddings.num_embeddings
        if n > max_n:
            raise ValueError(
                f"input has {n} tokens but the model has only {max_n} position embeddings; "
                f"truncate to at most {max_n} tokens (model.tokenize truncates for you)"
            )
        positions = torch.arange(n, device=input_ids.device)  # (N,)
        x = self.word_embeddings(input_ids) + self.token_type_embeddings(token_type_ids)  # (B, N, E)
        x = x + self.position_embeddings(positions)  # (B, N, E) + (N, E)
        return self.dropout(self.norm(x))


class BertLayer(TransformerEncoderLayer):
    """A post-norm :class:`qkv.nn.TransformerEncoderLayer` that can also return its attention weights.

    ``x = norm1(x + sa(x)); x = norm2(x + linear2(gelu(linear1(x))))`` — BERT's layer, with
    ``self_attn`` a :class:`qkv.nn.MultiHeadAttention`. ``forward`` returns ``(x, weights)``
    where ``weights`` is (B, H, N, N) with ``need_weights=True`` and None otherwise.
    """

    def forward(  # type: ignore[override]
        self,
        x: Tensor,
        *,
        key_padding_mask: Optional[Tensor] = None,
        need_weights: bool = False,
        backend: str = "auto",
    ) -> Tuple[Tensor, Optional[Tensor]]:
        a, weights = self.self_attn(
            x,
            key_padding_mask=key_padding_mask,
            need_weights=need_weights,
            average_attn_weights=False,
            backend=backend,
        )  # (B, N, E), (B, H, N, N) | None
        x = self.norm1(x + self.dropout1(a))  # (B, N, E)
        x = self.norm2(x + self.dropout2(self._ff_block(x)))  # (B, N, E)
        return x, weights


class BertEncoder(nn.Module):
    """``L`` :class:`BertLayer` blocks in ``layers`` (paths ``encoder.layers.{i}.self_attn``)."""

    def __init__(self, config: BertConfig, dropout: float = 0.0) -> None:
        super().__init__()
        self.layers = nn.ModuleList(
            BertLayer(
                config.hidden_size,
                config.num_attention_heads,
                dim_feedforward=config.intermediate_size,
                dropout=dropout,
                activation=_ACTIVATIONS[config.hidden_act],
                norm_first=False,
                layer_norm_eps=config.layer_norm_eps,
            )
            for _ in range(config.num_hidden_layers)
        )

    def forward(
        self,
        x: Tensor,
        *,
        key_padding_mask: Optional[Tensor] = None,
        output_attentions: bool = False,
        output_hidden_states: bool = False,
        backend: str = "auto",
    ) -> Tuple[Tensor, Optional[Tuple[Tensor, ...]], Optional[Tuple[Tensor, ...]]]:
        """``x`` (B, N, E) → (last (B, N, E), hidden states or None, attentions or None)."""
        hidden: List[Tensor] = [x]
        attentions: List[Tensor] = []
        for layer in self.layers:
            x, w = layer(x, key_padding_mask=key_padding_mask, need_weights=output_attentions, backend=backend)
            hidden.append(x)
            if w is not None:
                attentions.append(w)
        return (
            x,
            tuple(hidden) if output_hidden_states else None,
            tuple(attentions) if output_attentions else None,
        )


class BertPooler(nn.Module):
    """BERT's pooler: ``tanh(dense(h[:, 0]))`` (B, N, E) → (B, E)."""

    def __init__(self, hidden_size: int) -> None:
        super().__init__()
        self.dense = nn.Linear(hidden_size, hidden_size)

    def forward(self, h: Tensor) -> Tensor:
        return torch.tanh(self.dense(h[:, 0]))


# ---------------------------------------------------------------------------------- weights
def hf_weight_map(config: BertConfig, *, pooler: bool = True) -> Dict[str, str]:
    """Hugging Face ``BertModel`` parameter name → :class:`BertModel` parameter name."""
    m: Dict[str, str] = {}

    def linear(src: str, dst: str) -> None:
        m[f"{src}.weight"] = f"{dst}.weight"
        m[f"{src}.bias"] = f"{dst}.bias"

    for name in ("word_embeddings", "position_embeddings", "token_type_embeddings"):
        m[f"embeddings.{name}.weight"] = f"embeddings.{name}.weight"
    linear("embeddings.LayerNorm", "embeddings.norm")
    for i in range(config.num_hidden_layers):
        src, dst = f"encoder.layer.{i}", f"encoder.layers.{i}"
        linear(f"{src}.attention.self.query", f"{dst}.self_attn.q_proj")
        linear(f"{src}.attention.self.key", f"{dst}.self_attn.k_proj")
        linear(f"{src}.attention.self.value", f"{dst}.self_attn.v_proj")
        linear(f"{src}.attention.output.dense", f"{dst}.self_attn.out_proj")
        linear(f"{src}.attention.output.LayerNorm", f"{dst}.norm1")
        linear(f"{src}.intermediate.dense", f"{dst}.linear1")
        linear(f"{src}.output.dense", f"{dst}.linear2")
        linear(f"{src}.output.LayerNorm", f"{dst}.norm2")
    if pooler:
        linear("pooler.dense", "pooler.dense")
    return m


# Buffers or task heads a checkpoint may carry that the encoder does not use.
_IGNORED_KEYS = ("embeddings.position_ids",)
_IGNORED_PREFIXES = ("cls.",)  # masked-LM / next-sentence heads of BertForPreTraining checkpoints


def _strip_prefix(state: Dict[str, Tensor]) -> Dict[str, Tensor]:
    """``bert.encoder...`` (a BertFor* checkpoint) → ``encoder...``."""
    if any(k.startswith("bert.") for k in state) and not any(k.startswith("encoder.") for k in state):
        return {(k[len("bert.") :] if k.startswith("bert.") else k): v for k, v in state.items()}
    return state


def _remap(state: Dict[str, Tensor], config: BertConfig, source: str) -> Tuple[Dict[str, Tensor], bool]:
    state = _strip_prefix(state)
    has_pooler = "pooler.dense.weight" in state
    mapping = hf_weight_map(config, pooler=has_pooler)
    missing = sorted(k for k in mapping if k not in state)
    unexpected = sorted(
        k
        for k in state
        if k not in mapping and k not in _IGNORED_KEYS and not k.startswith(_IGNORED_PREFIXES)
    )
    if missing or unexpected:
        def show(keys: List[str]) -> str:
            return ", ".join(keys[:8]) + (f", … ({len(keys)} in all)" if len(keys) > 8 else "")

        lines = [f"{source} does not match a BERT encoder with {config.num_hidden_layers} layers:"]
        if missing:
            lines.append(f"  missing keys: {show(missing)}")
        if unexpected:
            lines.append(f"  unexpected keys: {show(unexpected)}")
        lines.append(
            "  qkv.models expects Hugging Face BertModel names (embeddings.word_embeddings.weight, "
            "encoder.layer.{i}.attention.self.query.weight, …); check that config.json "
            "(num_hidden_layers, model_type) belongs to these weights"
        )
        raise KeyError("\n".join(lines))
    return {dst: state[src] for src, dst in mapping.items()}, has_pooler


# ---------------------------------------------------------------------------------- tokenizer
def _read_json(path: Path) -> Dict[str, Any]:
    if not path.is_file():
        return {}
    with open(path, encoding="utf-8") as f:
        return json.load(f)


def load_tokenizer(directory: PathLike, config: BertConfig) -> Tuple[Any, int]:
    """``tokenizer.json`` with truncation and batch-longest padding set from the model's files.

    The maximum length is sentence-transformers' ``max_seq_length`` when
    ``sentence_bert_config.json`` exists, else ``tokenizer_config.json``'s
    ``model_max_length``, and never more than the position embeddings allow.
    """
    try:
        from tokenizers import Tokenizer
    except ImportError as e:  # pragma: no cover - depends on the environment
        raise ImportError("qkv.models needs the `tokenizers` package: pip install tokenizers") from e
    directory = Path(directory)
    tok = Tokenizer.from_file(str(directory / "tokenizer.json"))
    st_cfg = _read_json(directory / "sentence_bert_config.json")
    tok_cfg = _read_json(directory / "tokenizer_config.json")
    max_len = config.max_position_embeddings
    for candidate in (st_cfg.get("max_seq_length"), tok_cfg.get("model_max_length")):
        if isinstance(candidate, int) and candidate > 0:
            max_len = min(max_len, candidate)
            break
    tok.enable_truncation(max_length=max_len)
    pad_token = (tok.padding or {}).get("pad_token") or tok_cfg.get("pad_token") or "[PAD]"
    if isinstance(pad_token, dict):  # tokenizer_config may store AddedToken dicts
        pad_token = pad_token.get("content", "[PAD]")
    pad_id = tok.token_to_id(pad_token)
    if pad_id is None:
        pad_id = config.pad_token_id
    tok.enable_padding(pad_id=pad_id, pad_token=pad_token, pad_type_id=0, direction="right", length=None)
    return tok, max_len


# ---------------------------------------------------------------------------------- model
class BertModel(nn.Module):
    """A BERT encoder on :mod:`qkv.nn`, with its tokenizer and sentence-embedding pooling.

    Built by :func:`qkv.models.load`; in eval mode (no dropout) from the start.

    Attributes: ``config`` (:class:`BertConfig`), ``tokenizer`` (``tokenizers.Tokenizer``),
    ``pooling`` (:class:`PoolingConfig`), ``embeddings``, ``encoder`` (``encoder.layers[i]``
    are :class:`BertLayer`), ``pooler`` (or None), ``path`` (the directory loaded).
    """

    def __init__(self, config: BertConfig, *, pooler: bool = True, dropout: float = 0.0) -> None:
        super().__init__()
        self.config = config
        self.embeddings = BertEmbeddings(config, dropout)
        self.encoder = BertEncoder(config, dropout)
        self.pooler = BertPooler(config.hidden_size) if pooler else None
        self.tokenizer: Any = None
        self.max_length = config.max_position_embeddings
        self.pooling = PoolingConfig()
        self.path: Optional[Path] = None
        self.eval()

    @property
    def layers(self) -> nn.ModuleList:
        """The encoder layers (``encoder.layers``)."""
        return self.encoder.layers

    @property
    def device(self) -> torch.device:
        return self.embeddings.word_embeddings.weight.device

    # ------------------------------------------------------------------------- tokenizing
    def tokenize(self, texts: Union[str, Sequence[str]]) -> Tuple[Tensor, Tensor]:
        """Texts → ``(input_ids, attention_mask)``, both int64 (B, N) on the model's device.

        Padded on the right to the longest text of the batch, truncated to ``max_length``.
        """
        if self.tokenizer is None:
            raise RuntimeError("this model has no tokenizer; build it with qkv.models.load(...)")
        if isinstance(texts, str):
            texts = [texts]
        texts = list(texts)
        if not texts:
            raise ValueError("tokenize needs at least one text")
        enc = self.tokenizer.encode_batch(texts)
        ids = torch.tensor([e.ids for e in enc], dtype=torch.long, device=self.device)  # (B, N)
        mask = torch.tensor([e.attention_mask for e in enc], dtype=torch.long, device=self.device)  # (B, N)
        return ids, mask

    # ------------------------------------------------------------------------- forward
    def forward(
        self,
        input_ids: Tensor,
        attention_mask: Optional[Tensor] = None,
        token_type_ids: Optional[Tensor] = None,
        *,
        output_attentions: bool = False,
        output_hidden_states: bool = False,
        backend: str = "auto",
    ) -> BertOutput:
        """Token ids (B, N) → :class:`BertOutput`.

        ``attention_mask`` (B, N): 1/True for real tokens, 0/False for padding (Hugging Face's
        convention); padded keys are hidden from every query. ``token_type_ids`` default 0.
        ``output_attentions`` returns each layer's (B, H, N, N) weights (materialised);
        ``backend`` goes to :func:`qkv.attention` otherwise.
        """
        if input_ids.dim() == 1:
            input_ids = input_ids.unsqueeze(0)  # (1, N)
        if input_ids.dim() != 2:
            raise ValueError(f"input_ids must be (B, N), got shape {tuple(input_ids.shape)}")
        b, n = input_ids.shape
        key_padding_mask: Optional[Tensor] = None
        if attention_mask is not None:
            if attention_mask.dim() == 1:
                attention_mask = attention_mask.unsqueeze(0)
            if tuple(attention_mask.shape) != (b, n):
                raise ValueError(
                    f"attention_mask has shape {tuple(attention_mask.shape)} but input_ids has {(b, n)}; "
                    "it must mark each token 1 (real) or 0 (padding)"
                )
            key_padding_mask = attention_mask.to(device=input_ids.device, dtype=torch.bool)  # (B, N)
            if bool(key_padding_mask.all()):
                key_padding_mask = None  # nothing padded: let the fast path run unmasked
        if token_type_ids is None:
            token_type_ids = torch.zeros_like(input_ids)
        x = self.embeddings(input_ids, token_type_ids)  # (B, N, E)
        last, hidden, attentions = self.encoder(
            x,
            key_padding_mask=key_padding_mask,
            output_attentions=output_attentions,
            output_hidden_states=output_hidden_states,
            backend=backend,
        )
        pooled = self.pooler(last) if self.pooler is not None else None
        return BertOutput(last, pooled, hidden, attentions)

    # ------------------------------------------------------------------------- sentences
    def pool(self, last_hidden_state: Tensor, attention_mask: Tensor) -> Tensor:
        """Token vectors (B, N, E) → sentence vectors (B, k·E) per :attr:`pooling` (real tokens only)."""
        m = attention_mask.to(last_hidden_state.dtype).unsqueeze(-1)  # (B, N, 1)
        parts: List[Tensor] = []
        count = m.sum(dim=1).clamp(min=1e-9)  # (B, 1)
        if self.pooling.pooling_mode_cls_token:
            parts.append(last_hidden_state[:, 0])
        if self.pooling.pooling_mode_max_tokens:
            masked = last_hidden_state.masked_fill(m == 0, float("-inf"))
            parts.append(masked.max(dim=1).values)
        if self.pooling.pooling_mode_mean_tokens:
            parts.append((last_hidden_state * m).sum(dim=1) / count)
        if self.pooling.pooling_mode_mean_sqrt_len_tokens:
            parts.append((last_hidden_state * m).sum(dim=1) / count.sqrt())
        if not parts:
            raise ValueError("the pooling config enables no pooling mode")
        return torch.cat(parts, dim=-1)  # (B, k·E)

    @torch.no_grad()
    def encode(
        self,
        texts: Union[str, Sequence[str]],
        batch_size: int = 32,
        normalize: bool = True,
        *,
        backend: str = "auto",
    ) -> np.ndarray:
        """Sentence embeddings (len(texts), E) float32: pooled token vectors, L2-normalised.

        A single string gives one vector (E,). Texts are batched in length order (less
        padding) and returned in the input order.
        """
        single = isinstance(texts, str)
        items = [texts] if single else list(texts)
        if batch_size <= 0:
            raise ValueError(f"batch_size={batch_size} must be positive")
        if not items:
            return np.zeros((0, self.config.hidden_size), dtype=np.float32)
        order = sorted(range(len(items)), key=lambda i: -len(items[i]))
        out: List[Optional[np.ndarray]] = [None] * len(items)
        for start in range(0, len(order), batch_size):
            idx = order[start : start + batch_size]
            ids, mask = self.tokenize([items[i] for i in idx])  # (b, N) each
            h = self(ids, mask, backend=backend).last_hidden_state  # (b, N, E)
            v = self.pool(h, mask)  # (b, E)
            if normalize:
                v = F.normalize(v, p=2, dim=-1)
            for j, i in enumerate(idx):
                out[i] = v[j].float().cpu().numpy()
        result = np.stack(out)  # type: ignore[arg-type]
        return result[0] if single else result

    def extra_repr(self) -> str:
        c = self.config
        src = f", path={str(self.path)!r}" if self.path is not None else ""
        return f"layers={c.num_hidden_layers}, hidden={c.hidden_size}, heads={c.num_attention_heads}{src}"


# ---------------------------------------------------------------------------------- loading
def _check_directory(directory: Path) -> None:
    if not directory.is_dir():
        raise FileNotFoundError(f"{directory} is not a directory; pass the folder that holds {', '.join(REQUIRED_FILES)}")
    missing = [f for f in REQUIRED_FILES if not (directory / f).is_file()]
    if not missing:
        return
    hint = ""
    if "model.safetensors" in missing and any((directory / f).is_file() for f in ("pytorch_model.bin", "model.bin")):
        hint = (
            " (found pytorch_model.bin: qkv loads only safetensors, which cannot run code; convert it once "
            "with safetensors.torch.save_file(torch.load(path), 'model.safetensors'))"
        )
    if "model.safetensors" in missing and (directory / "model.safetensors.index.json").is_file():
        hint = " (sharded checkpoints are not supported; qkv.models loads one model.safetensors)"
    raise FileNotFoundError(
        f"{directory} is missing {', '.join(missing)}{hint}; a BERT-style model directory needs "
        f"{', '.join(REQUIRED_FILES)} (and optionally 1_Pooling/config.json)"
    )


def load_bert(directory: PathLike, *, dtype: Optional[torch.dtype] = None, device: Any = None) -> BertModel:
    """Build a :class:`BertModel` from a BERT-style directory (see the module docstring)."""
    try:
        from safetensors.torch import load_file
    except ImportError as e:  # pragma: no cover - depends on the environment
        raise ImportError("qkv.models needs the `safetensors` package: pip install safetensors") from e
    directory = Path(directory).expanduser().resolve()
    _check_directory(directory)
    config = BertConfig.from_file(directory / "config.json")
    state = load_file(str(directory / "model.safetensors"))
    mapped, has_pooler = _remap(state, config, str(directory / "model.safetensors"))
    model = BertModel(config, pooler=has_pooler)
    model.load_state_dict(mapped, strict=True)
    if dtype is not None or device is not None:
        model.to(device=device, dtype=dtype)
    model.tokenizer, model.max_length = load_tokenizer(directory, config)
    pooling_file = directory / "1_Pooling" / "config.json"
    if pooling_file.is_file():
        model.pooling = PoolingConfig.from_file(pooling_file)
    model.path = directory
    return model.eval()

