"""``qkv trace --linear``: linear attention beside softmax attention, on the trace's own Q, K, V."""

from __future__ import annotations

import json

import numpy as np
import pytest

from qkv.cli import main
from qkv.reference.linear import favor_projection, linear_steps
from qkv.glass.toy import sentence_trace
from ..helpers import bundled_model_dir


def _phi_elu(x: np.ndarray) -> np.ndarray:
    return np.where(x > 0, x + 1.0, np.exp(x))


@pytest.mark.parametrize("causal", [False, True])
def test_json_weights_and_output_are_elu_features_of_the_first_head(capsys, causal):
    argv = ["trace", "the cat sat down", "--heads", "2", "--linear", "elu", "--json"] + (["--causal"] if causal else [])
    assert main(argv) == 0
    d = json.loads(capsys.readouterr().out)["linear"]
    h = sentence_trace("the cat sat down", heads=2, causal=causal).heads[0]
    kern = _phi_elu(h.q) @ _phi_elu(h.k).T  # the N × N form, written out independently
    if causal:
        kern = np.tril(kern)
    w = kern / kern.sum(-1, keepdims=True)
    assert d["feature_map"] == "elu" and d["is_causal"] is causal
    np.testing.assert_allclose(d["weights"], w, rtol=1e-12)
    np.testing.assert_allclose(d["output"], w @ h.v, rtol=1e-5)  # eps = 1e-6 in the denominator
    np.testing.assert_allclose(np.asarray(d["softmax_weights"]), h.weights, atol=1e-12)
    np.testing.assert_allclose(d["state"], _phi_elu(h.k).T @ h.v, rtol=1e-12)


def test_terminal_view_follows_the_softmax_trace(capsys):
    assert main(["trace", "the cat sat", "--linear", "relu", "--lang", "zh"]) == 0
    out = capsys.readouterr().out
    t = sentence_trace("the cat sat")
    steps = linear_steps(t.q, t.k, t.v, "relu")
    assert out.index(t.explain("zh", token=0)) < out.index(steps.to_string(lang="zh", tokens=t.tokens))


def test_favor_on_a_model_head_is_summarised_and_seeded(capsys):
    bundled_model_dir()
    assert main(["trace", "she led the team", "--model", "--layer", "1", "--head", "3", "--linear", "favor"]) == 0
    out = capsys.readouterr().out
    assert "F = 128 features" in out and "(columns 0–3, 126–127 of 128 shown" in out
    linear = out[out.index("Linear attention, step by step"):]
    assert max(len(line) for line in linear.splitlines()) < 200  # never 128 columns on one line
    assert main(["trace", "she led the team", "--model", "--layer", "1", "--head", "3", "--linear", "favor", "--json"]) == 0
    d = json.loads(capsys.readouterr().out)
    q, k, v = (np.asarray(d["steps"][n]) for n in ("q", "k", "v"))
    want = linear_steps(q, k, v, "favor", projection=favor_projection(32, 128, 0))
    np.testing.assert_allclose(d["linear"]["weights"], want.weights, rtol=1e-9)


def test_linear_with_block_is_a_usage_error(capsys):
    assert main(["trace", "a b", "--block", "--linear", "elu"]) == 2
    err = capsys.readouterr().err
    assert "--linear" in err and "--block" in err and "Traceback" not in err
