"""The ``flex`` engine (compiled FlexAttention) gives qkv's answer — masks in both alignments,
padding, dense and block masks, mask and score functions, GQA, Dv ≠ D, batch dims — declines
what it cannot run with a reason, compiles once per kind of call, and steps aside after a
compiler error so that ``auto`` goes on. On the CPU it runs the forward only (torch's compiled
CPU template), in float32 and 16-bit.
"""

from __future__ import annotations

import pytest
import torch

import qkv
from qkv.backends import BACKENDS, BackendError, auto_order, dispatch, flex
from qkv.call import validate
from qkv.score_mods import ALiBi, RelativeBias, Softcap, alibi_slopes

from ..helpers import assert_within_rule, make_qkv, max_err

FLEX = BACKENDS["flex"]
pytestmark = pytest.mark.skipif(FLEX.available() is not None, reason=f"flex unavailable: {FLEX.available()}")


def _check(q, k, v, dtype=torch.float32, **kw):
    """flex's output against the float64 oracle, within the rule of the math backend's in ``dtype``."""
    out = qkv.attention(q, k, v, backend="flex", **kw)
    ref = torch.as_tensor(qkv.attention_ref(q, k, v, **{a: b for a, b in kw.items() if a != "enable_gqa"},
                                            enable_gqa=kw.get("enable_gqa", False)))  # fmt: skip
    base = qkv.attention(q, k, v, backend="math", **kw)
    assert out.shape == base.shape and out.dtype == base.dtype
    assert_within_rule(out, base, ref, dtype, what="flex")
    return out


def _scaled(factor: float):
    return lambda s, b, h, i, j: s * factor


def test_masks_alignments_gqa_and_value_dims():
    q, k, _ = make_qkv(2, 4, 2, 40, 48, 16, seed=1)
    v = torch.randn(2, 2, 48, 8)
    rel = lambda s, b, h, i, j: s + 0.05 * (i - j) * (h + 1)  # noqa: E731
    _check(q, k, v, is_causal="bottom_right", window=(12, None), enable_gqa=True, score_mod=rel)
    kp = torch.rand(2, 48, generator=torch.Generator().manual_seed(2)) > 0.3
    _check(q, k, v, key_padding_mask=kp, window=(5, 5), window_alignment="top_left", enable_gqa=True,
           score_mod=ALiBi(alibi_slopes(4)))  # fmt: skip


@pytest.mark.slow  # each new kind of call compiles (seconds on a CPU); the quick tier compiles a few
def test_dense_masks_and_built_in_score_functions():
    q, k, v = make_qkv(2, 4, 4, 40, 48, 16, seed=3)
    g = torch.Generator().manual_seed(4)
    bool_mask = torch.rand(4, 40, 48, generator=g) > 0.4
    bool_mask[:, 7] = False  # a row with nothing to attend to: 0, as qkv's contract says
    out = _check(q, k, v, attn_mask=bool_mask, score_mod=Softcap(3.0))
    assert torch.equal(out[:, :, 7], torch.zeros_like(out[:, :, 7]))
    _check(q, k, v, attn_mask=torch.randn(2, 1, 40, 48, generator=g), is_causal=True,
           score_mod=RelativeBias(torch.randn(16, 4, generator=g), max_distance=20))  # fmt: skip


def test_mask_functions_and_flex_block_masks():
    fa = pytest.importorskip("torch.nn.attention.flex_attention")
    q, k, v = make_qkv(2, 4, 4, 64, 64, 16, seed=5)
    docs = torch.arange(64).div(20, rounding_mode="floor").expand(2, 64).clone()
    docs[1] = torch.arange(64).div(9, rounding_mode="floor")

    def same_doc(b, h, i, j):
        return (docs[b, i] == docs[b, j]) & (i >= j)

    want = _check(q, k, v, mask_mod=same_doc)
    block_mask = fa.create_block_mask(same_doc, 2, None, 64, 64, device="cpu", BLOCK_SIZE=32)
    assert max_err(qkv.attention(q, k, v, attn_mask=block_mask, backend="flex"), want) < 1e-6


@pytest.mark.slow
def test_batch_dims_and_16_bit_inputs():
    q = torch.randn(2, 3, 4, 32, 16).to(torch.bfloat16)  # two batch dims
    k = torch.randn(1, 3, 4, 32, 16).to(torch.bfloat16)  # broadcast over the first
    v = torch.randn(2, 3, 4, 32, 16).to(torch.bfloat16)
    bias = torch.randn(32)
    _check(q, k, v, torch.bfloat16, is_causal=True, score_mod=lambda s, b, h, i, j: s + bias[j])


def test_what_it_declines_on_the_cpu_and_why(monkeypatch):
    q, k, v = make_qkv(1, 2, 2, 16, 16, 8)
    reasons = lambda **kw: " ".join(FLEX.not_supported_reasons(validate(q, k, v, **kw)))  # noqa: E731
    qg = q.clone().requires_grad_()
    assert "no backward on the CPU" in " ".join(FLEX.not_supported_reasons(validate(qg, k, v)))
    assert "does not return the lse" in reasons(return_lse=True)
    assert "float32, float16 and bfloat16 only" in " ".join(FLEX.not_supported_reasons(validate(q.double(), k.double(), v.double())))
    assert "dropout_p > 0 is not supported" in reasons(dropout_p=0.1)
    assert "sinks" in reasons(sinks=torch.zeros(2))
    with pytest.raises(BackendError, match="no backward on the CPU"):
        qkv.attention(qg, k, v, backend="flex")
    monkeypatch.setenv(flex.COMPILE_ENV, "0")
    assert "compilation is off" in reasons()


@pytest.mark.parametrize("width", [16, 8, 4])
def test_it_declines_the_shapes_torchs_cpu_kernel_computes_wrong(monkeypatch, width):
    """torch's compiled CPU kernel stores a whole 16-key block for a last block of keys whose
    count and head dim are multiples of the CPU's vector (head dim < 24): on 8-float vectors
    (AVX2), Nk ≡ 8 (mod 16) with head dim 8 or 16 gave wrong rows in most runs. flex declines
    those calls, by name, for the vector width this CPU has; auto answers them on chunked."""
    monkeypatch.setattr(flex, "_cpu_floats_per_vector", lambda: width)
    cases = {(24, 16): width < 16, (56, 8): width < 16, (20, 16): width == 4, (48, 16): False, (24, 32): False, (24, 20): width == 4}
    for (nk, d), declined in cases.items():
        q, k, v = make_qkv(1, 2, 2, 16, nk, d, seed=8)
        why = " ".join(FLEX.not_supported_reasons(validate(q, k, v)))
        assert ("computes wrong scores" in why) == declined, (nk, d, width, why)
    q, k, v = make_qkv(1, 2, 2, 24, 24, 16, seed=9)
    if width < 16:
        with pytest.raises(BackendError, match=f"wrong scores for 24 keys .* head dim 16 on this CPU's {width}-float vectors"):
            qkv.attention(q, k, v, backend="flex")
    monkeypatch.undo()  # this CPU's own width: auto takes flex only where its kernel is right
    monkeypatch.setattr(dispatch, "FLEX_CPU_MIN_SCORES", 1)
    fn = lambda s, b, h, i, j: s * 0.5  # noqa: E731
    out = qkv.attention(q, k, v, score_mod=fn)
    assert max_err(out, qkv.attention_ref(q, k, v, score_mod=fn)) < 1e-5


def test_auto_takes_flex_for_a_python_score_function_without_gradients(monkeypatch):
    """From FLEX_CPU_MIN_SCORES on (lowered here to keep the call small), and not with gradients,
    an lse, float64 or compilation off; the order's note says why."""
    monkeypatch.setattr(dispatch, "FLEX_CPU_MIN_SCORES", 32 * 32)
    q, k, v = make_qkv(1, 2, 2, 32, 32, 16, seed=6)
    fn = lambda s, b, h, i, j: s - 0.1 * (i - j).abs()  # noqa: E731
    call = validate(q, k, v, score_mod=fn)
    assert auto_order(call)[0] is FLEX and "flex first" in qkv.backends.order_notes(call)[0]
    out = qkv.attention(q, k, v, score_mod=fn)
    assert max_err(out, qkv.attention(q.double(), k.double(), v.double(), score_mod=fn)) < 1e-5
    for kw in (dict(return_lse=True), dict(score_mod=Softcap(5.0))):  # a built-in runs in qkv's C loops
        assert auto_order(validate(q, k, v, **{"score_mod": fn, **kw}))[0] is not FLEX
    assert auto_order(validate(q.requires_grad_(), k, v, score_mod=fn))[0] is not FLEX
    monkeypatch.setenv(flex.COMPILE_ENV, "0")
    with torch.no_grad():
        assert qkv.backends.select(validate(q, k, v, score_mod=fn)).NAME == "chunked"


def test_a_loop_compiles_once_and_a_compiler_error_steps_aside(monkeypatch, caplog):
    q, k, v = make_qkv(1, 2, 2, 32, 32, 16, seed=7)
    before = len(flex.compile_log())
    for step in range(3):  # a function made anew each step, with the same code: one kernel
        qkv.attention(q, k, v, backend="flex", score_mod=_scaled(step + 1.0))
    assert len(flex.compile_log()) == before + 1
    assert flex.compile_log()[-1].seconds > 0

    def broken(kind):
        def fail(*args):
            raise torch._dynamo.exc.BackendCompilerFailed(lambda: None, RuntimeError("planted compiler error"), None)

        return fail

    monkeypatch.setattr(flex, "_compiled", broken)
    monkeypatch.setattr(dispatch, "FLEX_CPU_MIN_SCORES", 1)
    odd = lambda s, b, h, i, j: s + 0.5 * (j % 2)  # noqa: E731  a new kind of call
    want = qkv.attention(q, k, v, score_mod=odd, backend="chunked")
    with caplog.at_level("WARNING", logger="qkv"):
        got = qkv.attention(q, k, v, score_mod=odd)  # auto: flex fails, chunked answers
    assert torch.equal(got, want) and "flex failed" in caplog.text
    assert "compiling FlexAttention for this kind of call failed" in " ".join(FLEX.not_supported_reasons(validate(q, k, v, score_mod=odd)))
    with pytest.raises(BackendError, match="compiling FlexAttention for this kind of call failed"):
        qkv.attention(q, k, v, score_mod=odd, backend="flex")


def test_qkv_info_reports_the_compile_time():
    from qkv.info import compile_flex, report

    q, k, v = make_qkv(1, 2, 2, 32, 32, 16)
    call = validate(q, k, v, score_mod=_scaled(0.5))  # the loop's kind of call: compiled once per worker
    assert "flex ran the call in" in compile_flex(call)
    assert "FlexAttention compiled for" in report(call) and "first calls (compilation included)" in report(call)
    assert "flex cannot run this call: " in compile_flex(validate(q.double(), k.double(), v.double()))


def test_qkv_info_command_describes_a_score_function_and_times_its_compile(capsys):
    from qkv.cli import main

    assert main(["info", "--shape", "1,2,32,16", "--score-mod", "python", "--compile"]) == 0
    out = capsys.readouterr().out
    assert "flex ran the call in" in out and "score_mod=<lambda>" in out and "flex     can run it" in out
    assert main(["info", "--shape", "1,2,32,16", "--score-mod", "alibi", "--dtype", "float64", "--compile"]) == 0
    assert "flex cannot run this call: compiled FlexAttention on the CPU takes float32" in capsys.readouterr().out
