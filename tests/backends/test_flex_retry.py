"""The flex engine retries a kind of call that ran out of resources with smaller ``kernel_options``
before declining it (an H200 could not fit Flex's default tiles for a 16-bit call whose score
function reads a table with gradients: 245,760 bytes of shared memory over 232,448). The
compiler is stood in for here: its errors are what torch 2.11 raised on the H200, word for word."""

from __future__ import annotations

import logging

import pytest
import torch

import qkv
from qkv.backends import BackendError, flex
from qkv.call import validate

pytestmark = pytest.mark.skipif(flex.FlexBackend().available() is not None, reason="needs torch's FlexAttention and compilation")

H200_ERROR = ("RuntimeError: No valid triton configs. OutOfMemoryError: out of resource: triton_tem_fused_flex_attention_0 "
              "Required: 245760 Hardware limit:232448 Reducing block sizes or `num_stages` may help.")  # fmt: skip


class FakeCompileError(RuntimeError):
    """Stands in for inductor's InductorError (one of flex's compile errors)."""


@pytest.fixture
def compiler(monkeypatch):
    """A compiled call that fails for the options listed in ``fails`` (None: Flex's default),
    and runs eager attention otherwise; each call's options are recorded."""
    state = {"fails": {None}, "calls": [], "error": H200_ERROR}

    def compiled(kind):
        def run(q, k, v, score_mod, block_mask, scale, enable_gqa, return_lse, kernel_options):
            state["calls"].append(kernel_options)
            key = None if kernel_options is None else tuple(sorted(kernel_options.items()))
            if key in state["fails"] or (kernel_options is not None and "all" in state["fails"]):
                raise FakeCompileError(state["error"])
            out = torch.nn.functional.scaled_dot_product_attention(q, k, v, scale=scale, enable_gqa=enable_gqa)
            return (out, torch.zeros(out.shape[:-1])) if return_lse else out

        return run

    for name in ("_OPTIONS", "_BROKEN", "_SEEN"):
        monkeypatch.setattr(flex, name, type(getattr(flex, name))())
    monkeypatch.setattr(flex, "_LOG", [])
    monkeypatch.setattr(flex, "_compiled", compiled)
    monkeypatch.setattr(flex, "_COMPILE_ERRORS", (FakeCompileError,))
    return state


def _call(seed=0, **kw):
    g = torch.Generator().manual_seed(seed)
    q, k, v = (torch.randn(1, 2, 48, 32, generator=g) for _ in range(3))
    return validate(q, k, v, **kw)


def _key(options):
    return tuple(sorted(options.items()))


def test_out_of_resources_retries_smaller_tiles_and_keeps_them(compiler, caplog):
    call = _call()
    with caplog.at_level(logging.INFO, logger="qkv"):
        out, _ = flex.FlexBackend().forward(call)
    first = flex.RETRY_OPTIONS[0]
    assert compiler["calls"] == [None, first]
    torch.testing.assert_close(out, torch.nn.functional.scaled_dot_product_attention(call.query, call.key, call.value))
    kind = flex._kind(call)
    assert flex.kernel_options(kind) == first and flex.compile_log()[-1].kernel_options == first
    assert any("compiled with kernel_options" in r.getMessage() and "BLOCK_M" in r.getMessage() for r in caplog.records)
    flex.FlexBackend().forward(_call(seed=1))  # the same kind again: straight to the options that compiled
    assert compiler["calls"][2:] == [first]


def test_the_second_rung_and_then_a_named_refusal(compiler):
    compiler["fails"] = {None, _key(flex.RETRY_OPTIONS[0])}
    flex.FlexBackend().forward(_call())
    assert compiler["calls"] == [None, *flex.RETRY_OPTIONS]
    compiler["fails"], compiler["calls"] = {None, "all"}, []
    call = _call(is_causal=True)  # another kind
    with pytest.raises(flex.EngineFailed, match=r"Required: 245760 .*also with smaller kernel_options: 2 tried"):
        flex.FlexBackend().forward(call)
    assert compiler["calls"] == [None, *flex.RETRY_OPTIONS]
    assert "also with smaller kernel_options" in " ".join(flex.FlexBackend().extra_reasons(call))  # declined from now on


def test_other_compile_errors_are_not_retried(compiler):
    compiler["error"] = "CppCompileError: C++ compile error"
    with pytest.raises(flex.EngineFailed, match="CppCompileError") as e:
        flex.FlexBackend().forward(_call())
    assert compiler["calls"] == [None] and "kernel_options" not in str(e.value)


def test_a_named_flex_call_says_why_it_cannot_run(compiler):
    compiler["fails"] = {None, "all"}
    g = torch.Generator().manual_seed(0)
    q, k, v = (torch.randn(1, 2, 48, 32, generator=g) for _ in range(3))
    with pytest.raises(BackendError, match="(?s)backend 'flex' cannot run this call .*out of resource.*smaller kernel_options"):
        qkv.attention(q, k, v, backend="flex")
