"""Peak memory of attention with K/V shared across a batch (stride-0 expanded), on the chunked
backend's C loops and on its torch formulation, each in a fresh process.

    python bench/shared_kv_memory.py            # q (512, 1, 16, 64), K/V (1, 1, 4096, 64) expanded

Prints the growth of the process's peak resident memory (``ru_maxrss``) over the forward and
over forward + backward. The C loops read the one shared K/V matrix through per-head offsets
(``qkv.backends.native.matrices``); a full-size copy of K and V would cost 1 GiB here.
"""

from __future__ import annotations

import subprocess
import sys
from pathlib import Path

CHILD = r"""
import resource, sys, torch
sys.path.insert(0, {root!r})
import qkv
from qkv.backends import native
if {path!r} == "torch":
    native.library = lambda: None
q = torch.randn(512, 1, 16, 64, requires_grad=True)
k = torch.randn(1, 1, 4096, 64).expand(512, 1, 4096, 64)
v = torch.randn(1, 1, 4096, 64).expand(512, 1, 4096, 64)
peak = lambda: resource.getrusage(resource.RUSAGE_SELF).ru_maxrss / 1024
base = peak()
out = qkv.attention(q, k, v, backend="chunked", is_causal="bottom_right")
fwd = peak()
out.sum().backward()
print(f"{{fwd - base:.0f}} {{peak() - base:.0f}}")
"""


def main() -> int:
    root = str(Path(__file__).resolve().parents[1])
    print("path                 forward   forward + backward   (peak RSS growth, MiB)")
    for path in ("C loops", "torch"):
        code = CHILD.format(root=root, path="torch" if path == "torch" else "c")
        fwd, both = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, check=True).stdout.split()
        print(f"{path:<20} {fwd:>7}   {both:>18}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
