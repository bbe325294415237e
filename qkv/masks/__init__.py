"""Which keys a query may see: every mask argument's meaning, in one package.

- :mod:`~qkv.masks.rules` — the causal and sliding-window rules (:class:`PositionalMask`, the
  two alignments, ``is_causal``'s and ``window``'s parsing). Plain comparisons, so the NumPy
  oracle and every torch backend ask the same code. Imports no torch.
- :mod:`~qkv.masks.tiles` — those rules plus ``key_padding_mask`` and ``attn_mask`` as tiles of
  the score matrix (:class:`~qkv.masks.tiles.MaskTiles`), so a backend works block by block
  without an ``Nq × Nk`` mask. Imports torch; import it by its own name.

- :mod:`~qkv.masks.fingerprint` — when a mask built from a function or a tensor can be reused:
  a key naming everything the function reaches (tensors by identity and version counter), and a
  small cache under such keys. Import it by its own name.

Block-sparse layouts (Longformer, BigBird, ``mask_mod``) live in :mod:`qkv.sparse`.
"""

from __future__ import annotations

from .rules import ALIGNMENTS, Alignment, CausalArg, IsCausal, PositionalMask, WindowArg, parse_alignment, parse_causal, parse_window

__all__ = ["PositionalMask", "Alignment", "ALIGNMENTS", "IsCausal", "CausalArg", "WindowArg",
           "parse_causal", "parse_alignment", "parse_window"]
