"""Older home of head ablation: it now lives in :mod:`qkv.analysis.ablation` (viz only draws)."""

from __future__ import annotations

from ..analysis.ablation import Ablation, ablation_effect, check_heads, parse_head  # noqa: F401

__all__ = ["Ablation", "ablation_effect", "parse_head", "check_heads"]
