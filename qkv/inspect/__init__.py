"""Look inside attention: exact maps of chosen rows and heads, streaming statistics, capture points.

- :func:`attention_map` / :func:`attention_scores` — exact weights (or scores) of chosen heads and
  query rows, recomputed tile by tile from a fused pass's log-sum-exp.
- :func:`attention_stats` — entropy, top-k, mean distance, sink and previous-token weights of
  every row in one tiled pass, never holding ``Nq × Nk``.
- :func:`record` — capture ``q``/``k``/``v``/``scores``/``weights``/``lse``/``output`` (or only
  statistics) from every :class:`qkv.nn.MultiHeadAttention` in a model during a forward pass;
  :func:`observed_map` / :func:`observed_stats` — the same from a Hugging Face model's calls
  (:func:`qkv.hf.observe`), with the call's score function and sinks; :func:`record_stats` —
  statistics of every call of a Hugging Face model.
- :func:`head_summary` — rank and classify heads (previous-token, sink, broad, self).
- :func:`ablate`, :func:`patch`, :func:`patch_from`, :func:`patching_effects` — change what heads
  compute during a forward pass (qkv.nn models and Hugging Face models on qkv) and measure it.

Recording and editing both register on the hook points of :mod:`qkv.hooks`.
"""


from .capture import POINTS, Recorder, Recording, observed_arguments, observed_map, observed_stats, record, record_stats
from .intervene import (
    EDIT_POINTS,
    Editor,
    PatchingEffects,
    ablate,
    attention_modules,
    capture_outputs,
    patch,
    patch_from,
    patching_effects,
)
from .maps import attention_map, attention_scores
from .stats import AttentionStats, attention_stats, attention_with_stats
from .summary import HeadSummary, head_summary

__all__ = [
    "attention_map",
    "attention_scores",
    "attention_stats",
    "attention_with_stats",
    "AttentionStats",
    "record",
    "Recording",
    "Recorder",
    "record_stats",
    "observed_arguments",
    "observed_map",
    "observed_stats",
    "POINTS",
    "head_summary",
    "HeadSummary",
    "EDIT_POINTS",
    "attention_modules",
    "patch",
    "ablate",
    "patch_from",
    "capture_outputs",
    "patching_effects",
    "PatchingEffects",
    "Editor",
]

