"""The seeded fuzz test of ``qkv.attention``: random calls over every argument, judged against
the float64 oracle with ENGINEERING.md's tolerance rule.

- :mod:`.calls` draws a call from (seed, case) and builds its tensors;
- :mod:`.ref64` is an independent float64 torch attention (gradients) and a FlashAttention-like
  16-bit baseline;
- :mod:`.judge` runs a case and checks it; :mod:`.report` summarises many;
- :mod:`.test_fuzz` is the pytest entry, ``python -m tests.fuzz`` the command line
  (``--long``, ``--seed S --case I``).
"""
