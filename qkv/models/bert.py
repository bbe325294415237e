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

from ..call import BackendName
from ..extras import require
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
    "CheckpointMismatchError",
    "expected_shapes",
]

PathLike = Union[str, Path]

# Hugging Face ``hidden_act`` → the activation names of qkv.nn.
_ACTIVATIONS = {"gelu": "gelu", "gelu_new": "gelu_tanh", "gelu_pytorch_tanh": "gelu_tanh", "relu": "relu", "silu": "silu"}

REQUIRED_FILES = ("config.json", "model.safetensors", "tokenizer.json")

# Sizes that build layers: a zero, negative or non-integer one would fail deep inside torch.
_POSITIVE_INTS = (
    "vocab_size", "hidden_size", "num_hidden_layers", "num_attention_heads", "intermediate_size",
    "max_position_embeddings", "type_vocab_size",
)  # fmt: skip
_FLOAT_DTYPES = frozenset({"F16", "BF16", "F32", "F64"})  # safetensors' names


class CheckpointMismatchError(KeyError, ValueError):
    """model.safetensors does not hold the weights config.json describes (names or shapes).

    A ``KeyError`` for the names it lists, and a ``ValueError`` like the other bad-file errors;
    its message prints as written (a plain ``KeyError`` would quote it onto one line).
    """

    def __str__(self) -> str:
        return str(self.args[0]) if self.args else ""


def _read_json(path: Path, required: bool = True) -> Any:
    """The JSON in ``path``; a file that is not JSON raises ``ValueError`` naming it and the spot."""
    if not required and not path.is_file():
        return {}
    try:
        with open(path, encoding="utf-8") as f:
            return json.load(f)
    except UnicodeDecodeError as e:
        raise ValueError(f"{path.name} at {path} is not text (UTF-8) JSON: {e}") from None
    except json.JSONDecodeError as e:
        raise ValueError(f"{path.name} at {path} is not valid JSON: {e}") from None


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
    def from_dict(cls, d: Dict[str, Any], source: str = "config.json") -> "BertConfig":
        """Build and validate; ``source`` names the file in error messages."""
        if not isinstance(d, dict):
            raise ValueError(
                f"{source} holds a JSON {type(d).__name__}, not an object of settings like {{\"hidden_size\": 384, ...}}"
            )
        names = {f.name for f in fields(cls)} - {"raw"}
        cfg = cls(**{k: d[k] for k in names if k in d and d[k] is not None}, raw=dict(d))
        cfg.validate(source)
        return cfg

    @classmethod
    def from_file(cls, path: PathLike) -> "BertConfig":
        return cls.from_dict(_read_json(Path(path)), source=f"config.json at {path}")

    def validate(self, source: str = "config.json") -> None:
        """Types and values, so that a bad file fails here and not inside a layer (or an allocation)."""
        for name in _POSITIVE_INTS:
            v = getattr(self, name)
            if not isinstance(v, int) or isinstance(v, bool) or v < 1:
                raise ValueError(f"{source}: {name}={v!r} must be a positive whole number (a JSON integer such as 384)")
        pad = self.pad_token_id
        if not isinstance(pad, int) or isinstance(pad, bool) or not 0 <= pad < self.vocab_size:
            raise ValueError(
                f"{source}: pad_token_id={pad!r} must be a token id in 0..{self.vocab_size - 1} (vocab_size={self.vocab_size})"
            )
        eps = self.layer_norm_eps
        if not isinstance(eps, (int, float)) or isinstance(eps, bool) or not 0 < eps < 1:
            raise ValueError(f"{source}: layer_norm_eps={eps!r} must be a small positive number such as 1e-12")
        for name in ("hidden_act", "position_embedding_type", "model_type"):
            if not isinstance(getattr(self, name), str):
                raise ValueError(f"{source}: {name}={getattr(self, name)!r} must be a string")
        if self.model_type not in ("bert", ""):
            raise ValueError(
                f"{source} has model_type={self.model_type!r}; qkv.models loads BERT encoders "
                "(model_type 'bert'), e.g. all-MiniLM-L6-v2"
            )
        if self.hidden_act not in _ACTIVATIONS:
            raise ValueError(f"{source}: hidden_act={self.hidden_act!r} is not supported; use one of {sorted(_ACTIVATIONS)}")
        if self.position_embedding_type != "absolute":
            raise ValueError(
                f"{source}: position_embedding_type={self.position_embedding_type!r} is not supported; only "
                "'absolute' learned position embeddings are implemented"
            )
        if self.hidden_size % self.num_attention_heads:
            raise ValueError(
                f"{source}: hidden_size={self.hidden_size} is not divisible by num_attention_heads="
                f"{self.num_attention_heads}; each head gets hidden_size / num_attention_heads dimensions"
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
        path = Path(path)
        d = _read_json(path)
        if not isinstance(d, dict):
            raise ValueError(f"{path.name} at {path} holds a JSON {type(d).__name__}, not an object of pooling_mode_* settings")
        names = {f.name for f in fields(cls)}
        unknown = [k for k, v in d.items() if k.startswith("pooling_mode_") and k not in names and v]
        if unknown:
            raise ValueError(f"{path.name} at {path}: pooling modes {unknown} are not supported; qkv supports {sorted(names)}")
        not_bool = {k: d[k] for k in names if k in d and not isinstance(d[k], bool)}
        if not_bool:
            raise ValueError(f"{path.name} at {path}: {not_bool} must be true or false (JSON booleans)")
        return cls(**{k: d[k] for k in names if k in d})

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
        backend: BackendName = "auto",
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
        backend: BackendName = "auto",
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


def _strip_prefix(state: Dict[str, Any]) -> Dict[str, Any]:
    """``bert.encoder...`` (a BertFor* checkpoint) → ``encoder...``."""
    if any(k.startswith("bert.") for k in state) and not any(k.startswith("encoder.") for k in state):
        return {(k[len("bert.") :] if k.startswith("bert.") else k): v for k, v in state.items()}
    return state


def _remap(state: Dict[str, Any], config: BertConfig, source: str) -> Tuple[Dict[str, Any], bool]:
    """Checkpoint name → value (a tensor, or a shape when checking the header) → qkv names, and has-pooler."""
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
        raise CheckpointMismatchError("\n".join(lines))
    return {dst: state[src] for src, dst in mapping.items()}, has_pooler


# ---------------------------------------------------------------------------------- tokenizer
def _optional_settings(path: Path) -> Dict[str, Any]:
    """An optional JSON settings file (``{}`` when absent); a broken one is an error naming it."""
    d = _read_json(path, required=False)
    if not isinstance(d, dict):
        raise ValueError(f"{path.name} at {path} holds a JSON {type(d).__name__}, not an object of settings")
    return d


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
    path = directory / "tokenizer.json"
    try:
        tok = Tokenizer.from_file(str(path))
    except Exception as e:  # the tokenizers package raises a bare Exception for any bad file
        raise ValueError(
            f"tokenizer.json at {path} is not a tokenizer the `tokenizers` package can read ({e}); "
            "it should be the tokenizer.json saved with the model (tokenizer.save_pretrained)"
        ) from None
    vocab = tok.get_vocab_size(with_added_tokens=True)
    if vocab > config.vocab_size:
        raise ValueError(
            f"tokenizer.json at {path} has {vocab} tokens but config.json says vocab_size={config.vocab_size}: "
            "ids beyond the embedding table would fail; the tokenizer belongs to another model"
        )
    st_cfg = _optional_settings(directory / "sentence_bert_config.json")
    tok_cfg = _optional_settings(directory / "tokenizer_config.json")
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
def _check_ids(name: str, ids: Tensor, n: int, hint: str) -> None:
    """Integer ids in ``[0, n)``: an embedding lookup would otherwise fail with a bare IndexError."""
    if ids.dtype.is_floating_point or ids.dtype.is_complex or ids.dtype == torch.bool:
        raise TypeError(f"{name} must be integer token ids (torch.long), got {ids.dtype}; {hint}")
    if ids.numel() and (int(ids.min()) < 0 or int(ids.max()) >= n):
        lo, hi = int(ids.min()), int(ids.max())
        raise ValueError(f"{name} holds ids from {lo} to {hi} but the model has {n} (0 to {n - 1}); {hint}")


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
        backend: BackendName = "auto",
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
        _check_ids("input_ids", input_ids, self.config.vocab_size, "tokenize texts with model.tokenize")
        if token_type_ids is not None:
            if token_type_ids.dim() == 1:
                token_type_ids = token_type_ids.unsqueeze(0)
            if tuple(token_type_ids.shape) != (b, n):
                raise ValueError(f"token_type_ids has shape {tuple(token_type_ids.shape)} but input_ids has {(b, n)}")
            _check_ids("token_type_ids", token_type_ids, self.config.type_vocab_size, "0 for the first segment, 1 for the second")
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
        backend: BackendName = "auto",
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


def _header_shapes(path: Path) -> Dict[str, Tuple[Tuple[int, ...], str]]:
    """Tensor name → (shape, safetensors dtype) from the file's header, without reading any weight."""
    safe_open = require("safetensors", "reading a model's weights").safe_open

    try:
        with safe_open(str(path), framework="pt") as f:
            return {name: (tuple(f.get_slice(name).get_shape()), f.get_slice(name).get_dtype()) for name in f.keys()}
    except Exception as e:  # safetensors raises its own SafetensorError (an Exception) for a bad header
        raise ValueError(
            f"model.safetensors at {path} is not a safetensors file ({e}); qkv.models reads the model.safetensors "
            "saved with the model (safetensors.torch.save_file)"
        ) from None


def expected_shapes(config: BertConfig, *, pooler: bool = True) -> Dict[str, Tuple[int, ...]]:
    """Hugging Face parameter name → the shape ``config`` gives it (keys as :func:`hf_weight_map`).

    Written out rather than read from a model built on the ``meta`` device: that would import
    ``torch._dynamo`` (a second and ~100 MB) just to check a file.
    """
    e, i = config.hidden_size, config.intermediate_size
    tables = {
        "embeddings.word_embeddings": (config.vocab_size, e),
        "embeddings.position_embeddings": (config.max_position_embeddings, e),
        "embeddings.token_type_embeddings": (config.type_vocab_size, e),
    }
    shapes: Dict[str, Tuple[int, ...]] = {}
    for src in hf_weight_map(config, pooler=pooler):
        module, kind = src.rsplit(".", 1)
        if module in tables:
            shape = tables[module]
        elif module.endswith("LayerNorm"):
            shape = (e,)
        elif module.endswith("intermediate.dense"):
            shape = (i, e)  # (out, in)
        elif module.endswith(".output.dense") and ".attention." not in module:
            shape = (e, i)  # the feed-forward's second linear
        else:
            shape = (e, e)  # query, key, value, attention output, pooler
        shapes[src] = shape if kind == "weight" else shape[:1]
    return shapes


def _check_weights(config: BertConfig, header: Dict[str, Tuple[Tuple[int, ...], str]], source: str, config_path: Path) -> bool:
    """Names, shapes and dtypes in the header against ``config``, before any layer is built; returns has-pooler.

    A config asking for huge layers thus fails here instead of allocating them.
    """
    header = _strip_prefix(header)
    _, has_pooler = _remap(header, config, source)
    want = expected_shapes(config, pooler=has_pooler)
    wrong = [
        f"  {name}: {header[name][0]} in the file, {shape} from config.json"
        for name, shape in want.items() if header[name][0] != shape
    ]  # fmt: skip
    if wrong:
        c = config
        raise CheckpointMismatchError(
            "\n".join([
                f"{source} does not match config.json at {config_path} "
                f"(hidden_size={c.hidden_size}, intermediate_size={c.intermediate_size}, vocab_size={c.vocab_size}, "
                f"max_position_embeddings={c.max_position_embeddings}, type_vocab_size={c.type_vocab_size}):",
                *wrong[:8],
                *([f"  … ({len(wrong)} in all)"] if len(wrong) > 8 else []),
                "  check that config.json belongs to these weights",
            ])
        )  # fmt: skip
    not_float = [f"{name} ({header[name][1]})" for name in want if header[name][1] not in _FLOAT_DTYPES]
    if not_float:
        raise ValueError(f"{source}: weights must be floating point; {', '.join(not_float[:4])} are not")
    return has_pooler


def load_bert(directory: PathLike, *, dtype: Optional[torch.dtype] = None, device: Any = None) -> BertModel:
    """Build a :class:`BertModel` from a BERT-style directory (see the module docstring).

    Every file is checked before any layer is built: ``config.json`` (types, sizes),
    ``model.safetensors`` (its header's names and shapes against the config) and
    ``tokenizer.json``; a bad one raises ``ValueError`` naming its path.
    """
    load_file = require("safetensors.torch", "reading a model's weights").load_file
    if dtype is not None and not (isinstance(dtype, torch.dtype) and dtype.is_floating_point):
        raise TypeError(f"dtype={dtype!r} must be a floating torch dtype, e.g. torch.float32 or torch.bfloat16")
    if device is not None:
        try:
            device = torch.device(device)
        except (RuntimeError, TypeError) as e:
            raise ValueError(f"device={device!r} is not a torch device ({e}); use e.g. 'cpu' or 'cuda:0'") from None
    directory = Path(directory).expanduser().resolve()
    _check_directory(directory)
    config = BertConfig.from_file(directory / "config.json")
    weights = directory / "model.safetensors"
    has_pooler = _check_weights(config, _header_shapes(weights), f"model.safetensors at {weights}", directory / "config.json")
    tokenizer, max_length = load_tokenizer(directory, config)
    pooling_file = directory / "1_Pooling" / "config.json"
    pooling = PoolingConfig.from_file(pooling_file) if pooling_file.is_file() else PoolingConfig()
    try:
        state = load_file(str(weights))
    except Exception as e:  # a header that reads but data that does not (truncated after the header check)
        raise ValueError(f"model.safetensors at {weights} could not be read ({e})") from None
    mapped, _ = _remap(state, config, str(weights))
    model = BertModel(config, pooler=has_pooler)
    model.load_state_dict(mapped, strict=True)
    if dtype is not None or device is not None:
        model.to(device=device, dtype=dtype)
    model.tokenizer, model.max_length = tokenizer, max_length
    model.pooling = pooling
    model.path = directory
    return model.eval()
