"""qkv studio: a live local page to type a sentence and step through a real model's attention.

- :mod:`~qkv.studio.engine` — :class:`Studio`: the models chosen at start, each loaded once, and
  the page's questions answered by qkv's own analyses (:mod:`qkv.analysis`, :mod:`qkv.glass`,
  :mod:`qkv.inspect`), packed as JSON-ready dicts. No attention arithmetic of its own.
- :mod:`~qkv.studio.server` — the ASGI app (FastAPI on uvicorn): validated requests, the host
  check, one offline page. Needs the ``studio`` extra.

Start it with ``qkv studio`` (see ``qkv studio --help``).
"""

from __future__ import annotations

from .engine import LIMITS, Studio, StudioError

__all__ = ["Studio", "StudioError", "LIMITS"]
