"""Small tensors a call reads follow the query's device (:mod:`qkv.devices`): ALiBi slopes or a
T5 table on the CPU, a key padding mask built on the CPU, for inputs on another device.

On an H200 these calls failed ("Pointer argument cannot be accessed from Triton (cpu tensor?)",
"key_padding_mask is on cpu but query is on cuda:0"). Here the other device is ``meta`` (shapes
without data), and the CUDA path — pinned memory, a copy queued without a host sync — is
watched through a TorchFunctionMode that records the calls instead of running them."""

from __future__ import annotations

import pytest
import torch
from torch.overrides import TorchFunctionMode

from qkv.call import validate
from qkv.devices import follow
from qkv.score_mods import ALiBi, RelativeBias, Softcap, alibi_slopes

META = torch.device("meta")


def _qkv(device=META, b=2, h=8, n=16, d=32):
    return [torch.randn(b, h, n, d, device=device) for _ in range(3)]


def _reaches(t: torch.Tensor, leaf: torch.Tensor) -> bool:
    """Does the autograd graph of ``t`` reach ``leaf`` (its gradient would arrive there)?"""
    seen, todo = set(), [t.grad_fn]
    while todo:
        fn = todo.pop()
        if fn is None or fn in seen:
            continue
        seen.add(fn)
        if getattr(fn, "variable", None) is leaf:
            return True
        todo += [f for f, _ in fn.next_functions]
    return False


class _Watch(TorchFunctionMode):
    """Records pin_memory and to(...) calls; answers them with stand-ins (no CUDA here)."""

    def __init__(self):
        super().__init__()
        self.calls = []

    def __torch_function__(self, func, types, args=(), kwargs=None):
        kwargs = kwargs or {}
        name = getattr(func, "__name__", "")
        if name == "pin_memory":
            self.calls.append("pin_memory")
            return args[0] * 1  # a copy, differentiable like pin_memory
        if name == "to":
            self.calls.append(("to", str(args[1]), kwargs.get("non_blocking", False)))
            return args[0].to(META)
        return func(*args, **kwargs)


def test_follow_leaves_a_tensor_on_its_device_alone():
    t = torch.randn(3)
    assert follow(t, torch.device("cpu")) is t


def test_follow_to_cuda_goes_through_pinned_memory_without_a_host_sync():
    t = torch.randn(4, requires_grad=True)
    with _Watch() as w:
        out = follow(t, torch.device("cuda", 0))
    assert w.calls == ["pin_memory", ("to", "cuda:0", True)]  # queued on the stream: the host does not wait
    assert _reaches(out, t)


def test_alibi_slopes_on_the_cpu_follow_the_query_once_and_differentiably():
    slopes = alibi_slopes(8).requires_grad_()
    mod = ALiBi(slopes)
    call = validate(*_qkv(), is_causal=True, score_mod=mod)
    assert call.score_mod.slopes.device == META and mod.slopes is slopes  # the user's object untouched
    assert call.score_mod.on(META) is call.score_mod  # moved once per call: binding it again moves nothing
    bound = call.bound_score()
    assert bound.form.rel.device == META and bound.form.rel.shape == (8, 31)
    assert bound.tensors and _reaches(bound.tensors[0], slopes)  # the slopes' gradient arrives on the CPU


def test_a_score_function_already_on_the_device_is_used_as_given():
    mod = ALiBi(alibi_slopes(8))
    assert mod.on(torch.device("cpu")) is mod
    call = validate(*_qkv(torch.device("cpu")), score_mod=mod)
    assert call.score_mod is mod
    assert validate(*_qkv(), score_mod=Softcap(30.0)).score_mod.softcap == 30.0  # no tensors: nothing to move


def test_a_t5_table_follows_too():
    table = (torch.randn(32, 8) * 0.1).requires_grad_()
    call = validate(*_qkv(), score_mod=RelativeBias(table))
    rel = call.bound_score().form.rel
    assert rel.device == META and _reaches(rel, table)


def test_kernel_form_makes_the_bias_where_it_is_asked():
    slopes = alibi_slopes(4).requires_grad_()
    rel = ALiBi(slopes).kernel_form(4, 5, 7, "top_left", torch.float32, META).rel
    assert rel.device == META and rel.shape == (4, 11) and _reaches(rel, slopes)
    here = ALiBi(slopes).kernel_form(4, 5, 7, "top_left", torch.float32).rel  # no device: where the slopes are
    assert here.device.type == "cpu"


def test_a_cpu_key_padding_mask_follows_the_query():
    kp = torch.ones(2, 16, dtype=torch.bool)
    call = validate(*_qkv(), key_padding_mask=kp)
    assert call.key_padding_mask.device == META and call.key_padding_mask.shape == (2, 16)
    spread = validate(*_qkv(), key_padding_mask=torch.ones(2, 1, dtype=torch.bool))  # one flag for every key
    assert spread.key_padding_mask.device == META and spread.key_padding_mask.shape == (2, 16)


def test_a_key_padding_mask_on_an_accelerator_for_cpu_inputs_is_refused_by_name():
    q, k, v = _qkv(torch.device("cpu"))
    with pytest.raises(ValueError, match=r"key_padding_mask is on meta but query is on cpu; move it with key_padding_mask.to\(query.device\)"):
        validate(q, k, v, key_padding_mask=torch.ones(2, 16, dtype=torch.bool, device=META))
