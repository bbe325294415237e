"""The glass box: self-attention step by step, in float64, with every number shown.

- :mod:`.trace` — :func:`trace`: Q, K, V, scores, scaled scores, score function, mask, weights
  and output of one attention pass (:class:`Trace`)
- :mod:`.block` — :func:`trace_block`: a whole encoder block around it (:class:`BlockTrace`)
- :mod:`.toy` — seeded toy numbers and the tutorials' worked example
- :mod:`.tokens` — :func:`split_words`: the toy tokenizer (BERT's word splitting)
- :mod:`.model` — :func:`trace_model`: one head of a real pretrained model, traced
- :mod:`.story` — the step-by-step narrative of a trace, in English or Chinese
- :mod:`.render` — terminal text and notebook HTML of a trace
- :mod:`.page` — :func:`save_trace_page`: the interactive offline page
- :mod:`.png` — :func:`save_trace_png`: one static figure for slides

The arithmetic every step is checked against is :mod:`qkv.reference`; wording comes from
:mod:`qkv.locale`. Importing this package needs no torch, matplotlib or jinja2 (each is
imported when first used).
"""

from __future__ import annotations

from .block import BlockTrace, toy_block_trace, trace_block
from .model import trace_model
from .page import render_trace_page, save_trace_page
from .png import save_trace_png, trace_figure
from .story import explain as narrate
from .tokens import split_words
from .toy import SENTENCE, sentence_trace, worked_example
from .trace import Trace, trace

__all__ = [
    "Trace", "trace", "BlockTrace", "trace_block", "toy_block_trace", "trace_model",
    "sentence_trace", "worked_example", "SENTENCE", "split_words", "narrate",
    "render_trace_page", "save_trace_page", "save_trace_png", "trace_figure",
]
