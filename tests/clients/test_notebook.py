"""How qkv's results look in a notebook, run on a real Jupyter kernel (nbclient), not only by
calling ``_repr_html_``: a trace shows the interactive stepper (one self-contained iframe), a
block trace too, and patching effects a table."""

from __future__ import annotations

import pytest

from ..helpers import SUBPROCESS_TIMEOUT

nbformat = pytest.importorskip("nbformat")
nbclient = pytest.importorskip("nbclient")
pytest.importorskip("ipykernel")

CELLS = [
    "from qkv.cli import sentence_trace\nt = sentence_trace('Thinking Machines learn', heads=2, causal=True)\nt",
    "from qkv.glass.block import toy_block_trace\ntoy_block_trace(['Thinking', 'Machines'])",
    "import torch\nfrom qkv.inspect.intervene import PatchingEffects\n"
    "PatchingEffects(torch.tensor([[0.5, -0.25]]), torch.zeros(1, 2), 3.0, 1.0, ['layer0'])",
]


def test_results_render_as_their_best_view_on_a_real_kernel(tmp_path):
    nb = nbformat.v4.new_notebook(cells=[nbformat.v4.new_code_cell(c) for c in CELLS])
    nbclient.NotebookClient(nb, timeout=SUBPROCESS_TIMEOUT, kernel_name="python3", resources={"metadata": {"path": str(tmp_path)}}).execute()
    html = []
    for cell in nb.cells:
        errors = [o for o in cell.outputs if o.output_type == "error"]
        assert not errors, errors
        shown = [o for o in cell.outputs if o.output_type == "execute_result"]
        assert shown and "text/html" in shown[0]["data"], cell.source
        html.append(shown[0]["data"]["text/html"])
    trace_frame, block_frame, table = html
    for frame in (trace_frame, block_frame):
        assert frame.startswith('<iframe srcdoc="') and 'sandbox="allow-scripts"' in frame
        assert "&lt;script" in frame and "https://" not in frame and "http://" not in frame
    assert "Thinking" in trace_frame
    assert "<table>" in table and "share of the" in table
