"""Context parallelism over ``torch.distributed``: attention over a sequence sharded across ranks.

- :func:`ring_attention` — K/V blocks travel around a ring; scales with sequence length.
- :func:`ulysses_attention` — all-to-all to head sharding; needs heads divisible by the world size.
- :func:`shard` / :func:`unshard` — contiguous or zigzag (causal load-balanced) sequence layouts.
"""

from __future__ import annotations

from .layout import shard, shard_local, unshard, unshard_local
from .ring import ring_attention
from .ulysses import ulysses_attention

__all__ = ["ring_attention", "shard", "shard_local", "ulysses_attention", "unshard", "unshard_local"]
