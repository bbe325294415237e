"""The glass box: attention in NumPy float64, step by step. Imports no torch.

``attention_ref`` is the oracle every fast path is tested against; ``trace`` records every
intermediate matrix of a self-attention pass so it can be printed, explained and exported.
"""

from .block import BlockTrace, toy_block_trace, trace_block
from .attention import attention_ref, combined_mask, positional_mask, softmax_rows
from .masks import PositionalMask, parse_causal, parse_window
from .tokens import split_words
from .trace import Trace, trace

__all__ = [
    "attention_ref",
    "combined_mask",
    "positional_mask",
    "softmax_rows",
    "PositionalMask",
    "parse_causal",
    "parse_window",
    "Trace",
    "trace",
    "BlockTrace",
    "trace_block",
    "toy_block_trace",
    "split_words",
]
