"""Transformer encoder/decoder layers and stacks on top of :class:`MultiHeadAttention`.

Shape legend::

    B batch   S source length   T target length   E d_model   F dim_feedforward

Embeddings in, embeddings out, like ``torch.nn.Transformer`` but batch-first ``(B, N, E)``
and with qkv mask conventions: boolean masks are True where a query **may attend**
(padding masks included: True = real token). Attribute names follow
``torch.nn.TransformerEncoderLayer`` / ``TransformerDecoderLayer`` (``self_attn``,
``linear1``, ``linear2``, ``norm1``…, with the decoder's ``multihead_attn`` called
``cross_attn``), so weights map over name for name; stacks keep their layers in
``layers`` (``encoder.layers.3.self_attn``).
"""

from __future__ import annotations

import copy
from functools import partial
from typing import Any, Callable, List, Mapping, Optional, Sequence, Tuple, Union

import torch
import torch.nn.functional as F
from torch import Tensor, nn

from .attention import CausalArg, MultiHeadAttention
from .cache import KVCache
from .positional import RotaryEmbedding

__all__ = [
    "TransformerEncoderLayer",
    "TransformerDecoderLayer",
    "TransformerEncoder",
    "TransformerDecoder",
    "Transformer",
]

Activation = Union[str, Callable[[Tensor], Tensor]]
Window = Optional[Tuple[Optional[int], Optional[int]]]

_ACTIVATIONS: dict[str, Callable[[Tensor], Tensor]] = {
    "relu": F.relu,
    "gelu": F.gelu,  # exact (erf) GELU, as BERT and torch.nn.Transformer use
    "gelu_tanh": partial(F.gelu, approximate="tanh"),
    "silu": F.silu,
}


def _get_activation(activation: Activation) -> Callable[[Tensor], Tensor]:
    if callable(activation):
        return activation
    if activation not in _ACTIVATIONS:
        raise ValueError(
            f"activation={activation!r} is not known; use one of {sorted(_ACTIVATIONS)} or pass a callable"
        )
    return _ACTIVATIONS[activation]


class _FeedForward:
    """Mixin: the position-wise feed-forward block ``linear2(dropout(act(linear1(x))))``."""

    linear1: nn.Linear
    linear2: nn.Linear
    dropout: nn.Dropout
    activation: Callable[[Tensor], Tensor]

    def _ff_block(self, x: Tensor) -> Tensor:
        return self.linear2(self.dropout(self.activation(self.linear1(x))))  # (B, N, E)

    def _init_ff_and_norms(
        self,
        sublayers: int,
        d_model: int,
        dim_feedforward: Optional[int],
        dropout: float,
        activation: "Activation",
        norm_first: bool,
        layer_norm_eps: float,
        bias: bool,
        factory: dict[str, Any],
    ) -> None:
        """The feed-forward block, plus ``normN``/``dropoutN`` for each of ``sublayers`` residual blocks."""
        dim_feedforward = 4 * d_model if dim_feedforward is None else dim_feedforward
        self.linear1 = nn.Linear(d_model, dim_feedforward, bias=bias, **factory)
        self.dropout = nn.Dropout(dropout)
        self.linear2 = nn.Linear(dim_feedforward, d_model, bias=bias, **factory)
        self.activation = _get_activation(activation)
        self.norm_first = norm_first
        for i in range(1, sublayers + 1):  # torch.nn's names, so state dicts line up
            setattr(self, f"norm{i}", nn.LayerNorm(d_model, eps=layer_norm_eps, bias=bias, **factory))
            setattr(self, f"dropout{i}", nn.Dropout(dropout))


class TransformerEncoderLayer(nn.Module, _FeedForward):
    """Self-attention then feed-forward, each wrapped in residual + LayerNorm.

    ``norm_first=False`` (post-norm, the original Transformer and BERT):
    ``x = norm1(x + sa(x)); x = norm2(x + ff(x))``. ``norm_first=True`` (pre-norm):
    ``x = x + sa(norm1(x)); x = x + ff(norm2(x))``.

    Input and output ``(B, N, E)``. ``dim_feedforward`` defaults to ``4 * d_model``.
    """

    norm1: nn.LayerNorm
    norm2: nn.LayerNorm
    dropout1: nn.Dropout
    dropout2: nn.Dropout

    def __init__(
        self,
        d_model: int,
        num_heads: int,
        dim_feedforward: Optional[int] = None,
        dropout: float = 0.1,
        activation: Activation = "relu",
        norm_first: bool = False,
        layer_norm_eps: float = 1e-5,
        num_kv_heads: Optional[int] = None,
        bias: bool = True,
        *,
        device: Optional[Union[torch.device, str]] = None,
        dtype: Optional[torch.dtype] = None,
    ) -> None:
        super().__init__()
        factory: dict[str, Any] = {"device": device, "dtype": dtype}
        self.self_attn = MultiHeadAttention(
            d_model, num_heads, num_kv_heads=num_kv_heads, bias=bias, dropout=dropout, **factory
        )
        self._init_ff_and_norms(2, d_model, dim_feedforward, dropout, activation, norm_first, layer_norm_eps, bias, factory)

    def _sa_block(self, x: Tensor, **attn_kwargs: Any) -> Tensor:
        return self.dropout1(self.self_attn(x, **attn_kwargs)[0])  # (B, N, E)

    def forward(
        self,
        x: Tensor,
        *,
        attn_mask: Optional[Tensor] = None,
        key_padding_mask: Optional[Tensor] = None,
        is_causal: CausalArg = False,
        rotary: Optional[RotaryEmbedding] = None,
        window: Window = None,
    ) -> Tensor:
        """``x`` (B, N, E) → (B, N, E). Masks as in :meth:`MultiHeadAttention.forward`."""
        kw = dict(
            attn_mask=attn_mask, key_padding_mask=key_padding_mask, is_causal=is_causal, rotary=rotary, window=window
        )
        if self.norm_first:
            x = x + self._sa_block(self.norm1(x), **kw)
            x = x + self.dropout2(self._ff_block(self.norm2(x)))
        else:
            x = self.norm1(x + self._sa_block(x, **kw))
            x = self.norm2(x + self.dropout2(self._ff_block(x)))
        return x


class TransformerDecoderLayer(nn.Module, _FeedForward):
    """Causal self-attention, cross-attention to ``memory``, feed-forward; residual + LayerNorm.

    Post-norm by default (``norm1``/``norm2``/``norm3`` after each residual sum); pre-norm
    with ``norm_first=True``. ``x`` (B, T, E), ``memory`` (B, S, E) → (B, T, E).
    """

    norm1: nn.LayerNorm
    norm2: nn.LayerNorm
    norm3: nn.LayerNorm
    dropout1: nn.Dropout
    dropout2: nn.Dropout
    dropout3: nn.Dropout

    def __init__(
        self,
        d_model: int,
        num_heads: int,
        dim_feedforward: Optional[int] = None,
        dropout: float = 0.1,
        activation: Activation = "relu",
        norm_first: bool = False,
        layer_norm_eps: float = 1e-5,
        num_kv_heads: Optional[int] = None,
        bias: bool = True,
        *,
        device: Optional[Union[torch.device, str]] = None,
        dtype: Optional[torch.dtype] = None,
    ) -> None:
        super().__init__()
        factory: dict[str, Any] = {"device": device, "dtype": dtype}
        mha = partial(MultiHeadAttention, d_model, num_heads, num_kv_heads=num_kv_heads, bias=bias, dropout=dropout)
        self.self_attn = mha(**factory)
        self.cross_attn = mha(**factory)
        self._init_ff_and_norms(3, d_model, dim_feedforward, dropout, activation, norm_first, layer_norm_eps, bias, factory)

    def forward(
        self,
        x: Tensor,
        memory: Tensor,
        *,
        tgt_mask: Optional[Tensor] = None,
        memory_mask: Optional[Tensor] = None,
        tgt_key_padding_mask: Optional[Tensor] = None,
        memory_key_padding_mask: Optional[Tensor] = None,
        tgt_is_causal: CausalArg = True,
        cache: Optional[KVCache] = None,
        rotary: Optional[RotaryEmbedding] = None,
    ) -> Tensor:
        """``x`` (B, T, E), ``memory`` (B, S, E) → (B, T, E).

        ``tgt_is_causal=True`` (the default) masks future target positions; unlike torch it
        is an instruction, not a hint about ``tgt_mask``. With ``cache`` (this layer's
        :class:`KVCache`), ``x`` holds only the new target positions and self-attention runs
        over everything cached; ``tgt_key_padding_mask`` may cover the new or all positions.
        ``rotary`` applies to the self-attention only.
        """

        def sa(h: Tensor) -> Tensor:
            out = self.self_attn(
                h,
                attn_mask=tgt_mask,
                key_padding_mask=tgt_key_padding_mask,
                is_causal=tgt_is_causal,
                cache=cache,
                rotary=rotary,
            )[0]
            return self.dropout1(out)  # (B, T, E)

        def ca(h: Tensor) -> Tensor:
            out = self.cross_attn(h, memory, attn_mask=memory_mask, key_padding_mask=memory_key_padding_mask)[0]
            return self.dropout2(out)  # (B, T, E)

        if self.norm_first:
            x = x + sa(self.norm1(x))
            x = x + ca(self.norm2(x))
            x = x + self.dropout3(self._ff_block(self.norm3(x)))
        else:
            x = self.norm1(x + sa(x))
            x = self.norm2(x + ca(x))
            x = self.norm3(x + self.dropout3(self._ff_block(x)))
        return x


def _clones(layer: Union[nn.Module, Mapping[str, Any]], cls: type, num_layers: int) -> nn.ModuleList:
    """``num_layers`` layers: deep copies of a layer, or fresh ``cls(**params)`` each."""
    if num_layers < 0:
        raise ValueError(f"num_layers={num_layers} must be >= 0")
    if isinstance(layer, Mapping):
        return nn.ModuleList(cls(**layer) for _ in range(num_layers))
    if isinstance(layer, cls):
        return nn.ModuleList(copy.deepcopy(layer) for _ in range(num_layers))
    raise TypeError(f"expected a {cls.__name__} or a dict of its arguments, got {type(layer).__name__}")


class TransformerEncoder(nn.Module):
    """A stack of encoder layers, then an optional final ``norm``. (B, S, E) → (B, S, E).

    ``encoder_layer`` is either a layer (deep-copied ``num_layers`` times, so every copy
    starts from the same weights, as in torch) or a dict of
    :class:`TransformerEncoderLayer` arguments (each layer initialised independently).
    """

    def __init__(
        self,
        encoder_layer: Union[TransformerEncoderLayer, Mapping[str, Any]],
        num_layers: int,
        norm: Optional[nn.Module] = None,
    ) -> None:
        super().__init__()
        self.layers = _clones(encoder_layer, TransformerEncoderLayer, num_layers)
        self.num_layers = num_layers
        self.norm = norm

    def forward(
        self,
        x: Tensor,
        *,
        attn_mask: Optional[Tensor] = None,
        key_padding_mask: Optional[Tensor] = None,
        is_causal: CausalArg = False,
        rotary: Optional[RotaryEmbedding] = None,
        window: Window = None,
    ) -> Tensor:
        """``x`` (B, S, E) → (B, S, E); the arguments go to every layer."""
        for layer in self.layers:
            x = layer(
                x,
                attn_mask=attn_mask,
                key_padding_mask=key_padding_mask,
                is_causal=is_causal,
                rotary=rotary,
                window=window,
            )
        return x if self.norm is None else self.norm(x)


class TransformerDecoder(nn.Module):
    """A stack of decoder layers, then an optional final ``norm``. (B, T, E) → (B, T, E).

    For incremental decoding pass ``cache=decoder.make_cache()`` (one :class:`KVCache` per
    layer) and feed the target one step (or chunk) at a time.
    """

    def __init__(
        self,
        decoder_layer: Union[TransformerDecoderLayer, Mapping[str, Any]],
        num_layers: int,
        norm: Optional[nn.Module] = None,
    ) -> None:
        super().__init__()
        self.layers = _clones(decoder_layer, TransformerDecoderLayer, num_layers)
        self.num_layers = num_layers
        self.norm = norm

    def make_cache(self, max_len: Optional[int] = None) -> List[KVCache]:
        """Empty self-attention caches, one per layer (``max_len=None`` grows on demand)."""
        return KVCache.for_layers(len(self.layers), max_len)

    def forward(
        self,
        x: Tensor,
        memory: Tensor,
        *,
        tgt_mask: Optional[Tensor] = None,
        memory_mask: Optional[Tensor] = None,
        tgt_key_padding_mask: Optional[Tensor] = None,
        memory_key_padding_mask: Optional[Tensor] = None,
        tgt_is_causal: CausalArg = True,
        cache: Optional[Sequence[KVCache]] = None,
        rotary: Optional[RotaryEmbedding] = None,
    ) -> Tensor:
        """``x`` (B, T, E), ``memory`` (B, S, E) → (B, T, E); see :class:`TransformerDecoderLayer`."""
        if cache is not None and len(cache) != len(self.layers):
            raise ValueError(
                f"cache has {len(cache)} entries but the decoder has {len(self.layers)} layers; "
                "build it with decoder.make_cache()"
            )
        for i, layer in enumerate(self.layers):
            x = layer(
                x,
                memory,
                tgt_mask=tgt_mask,
                memory_mask=memory_mask,
                tgt_key_padding_mask=tgt_key_padding_mask,
                memory_key_padding_mask=memory_key_padding_mask,
                tgt_is_causal=tgt_is_causal,
                cache=None if cache is None else cache[i],
                rotary=rotary,
            )
        return x if self.norm is None else self.norm(x)


class Transformer(nn.Module):
    """Encoder–decoder Transformer (Vaswani et al., 2017): embeddings in, embeddings out.

    ``src`` (B, S, E), ``tgt`` (B, T, E) → (B, T, E). Like ``torch.nn.Transformer`` (final
    LayerNorm on both stacks), but batch-first, with True = may attend masks, and causal
    target self-attention by default (``tgt_is_causal=True``). Embedding, positional encoding
    and the output head are the caller's.
    """

    def __init__(
        self,
        d_model: int = 512,
        num_heads: int = 8,
        num_encoder_layers: int = 6,
        num_decoder_layers: int = 6,
        dim_feedforward: int = 2048,
        dropout: float = 0.1,
        activation: Activation = "relu",
        norm_first: bool = False,
        layer_norm_eps: float = 1e-5,
        num_kv_heads: Optional[int] = None,
        bias: bool = True,
        *,
        device: Optional[Union[torch.device, str]] = None,
        dtype: Optional[torch.dtype] = None,
    ) -> None:
        super().__init__()
        params: dict[str, Any] = dict(
            d_model=d_model,
            num_heads=num_heads,
            dim_feedforward=dim_feedforward,
            dropout=dropout,
            activation=activation,
            norm_first=norm_first,
            layer_norm_eps=layer_norm_eps,
            num_kv_heads=num_kv_heads,
            bias=bias,
            device=device,
            dtype=dtype,
        )
        norm = partial(nn.LayerNorm, d_model, eps=layer_norm_eps, bias=bias, device=device, dtype=dtype)
        self.encoder = TransformerEncoder(params, num_encoder_layers, norm())
        self.decoder = TransformerDecoder(params, num_decoder_layers, norm())
        self.d_model = d_model
        self.num_heads = num_heads

    def encode(
        self,
        src: Tensor,
        *,
        src_mask: Optional[Tensor] = None,
        src_key_padding_mask: Optional[Tensor] = None,
        src_is_causal: CausalArg = False,
    ) -> Tensor:
        """``src`` (B, S, E) → memory (B, S, E)."""
        return self.encoder(src, attn_mask=src_mask, key_padding_mask=src_key_padding_mask, is_causal=src_is_causal)

    def decode(
        self,
        tgt: Tensor,
        memory: Tensor,
        *,
        tgt_mask: Optional[Tensor] = None,
        memory_mask: Optional[Tensor] = None,
        tgt_key_padding_mask: Optional[Tensor] = None,
        memory_key_padding_mask: Optional[Tensor] = None,
        tgt_is_causal: CausalArg = True,
        cache: Optional[Sequence[KVCache]] = None,
    ) -> Tensor:
        """``tgt`` (B, T, E), ``memory`` (B, S, E) → (B, T, E); ``cache`` from ``decoder.make_cache()``."""
        return self.decoder(
            tgt,
            memory,
            tgt_mask=tgt_mask,
            memory_mask=memory_mask,
            tgt_key_padding_mask=tgt_key_padding_mask,
            memory_key_padding_mask=memory_key_padding_mask,
            tgt_is_causal=tgt_is_causal,
            cache=cache,
        )

    def forward(
        self,
        src: Tensor,
        tgt: Tensor,
        *,
        src_mask: Optional[Tensor] = None,
        tgt_mask: Optional[Tensor] = None,
        memory_mask: Optional[Tensor] = None,
        src_key_padding_mask: Optional[Tensor] = None,
        tgt_key_padding_mask: Optional[Tensor] = None,
        memory_key_padding_mask: Optional[Tensor] = None,
        src_is_causal: CausalArg = False,
        tgt_is_causal: CausalArg = True,
    ) -> Tensor:
        """``src`` (B, S, E), ``tgt`` (B, T, E) → (B, T, E).

        ``memory_key_padding_mask`` defaults to ``src_key_padding_mask`` (padded source
        positions are hidden from the decoder too); pass an all-True mask to override.
        """
        if src.shape[-1] != self.d_model or tgt.shape[-1] != self.d_model:
            raise ValueError(
                f"src and tgt must be (B, N, d_model={self.d_model}) embeddings, got shapes "
                f"{tuple(src.shape)} and {tuple(tgt.shape)}"
            )
        if src.shape[0] != tgt.shape[0]:
            raise ValueError(f"src has batch {src.shape[0]} but tgt has batch {tgt.shape[0]}; they must match")
        if memory_key_padding_mask is None:
            memory_key_padding_mask = src_key_padding_mask
        memory = self.encode(
            src, src_mask=src_mask, src_key_padding_mask=src_key_padding_mask, src_is_causal=src_is_causal
        )
        return self.decode(
            tgt,
            memory,
            tgt_mask=tgt_mask,
            memory_mask=memory_mask,
            tgt_key_padding_mask=tgt_key_padding_mask,
            memory_key_padding_mask=memory_key_padding_mask,
            tgt_is_causal=tgt_is_causal,
        )
