"""The elementwise pieces of a decoder layer, compiled by inductor, compute what eager torch
computes. Off CUDA the compile is inductor's C++ backend: the same graphs, another code generator
(``SPECSERVE_TEST_DEVICE=cuda`` runs them through Triton)."""

import logging

import pytest
import torch

from specserve.replicas.model import fused_elementwise
from tiny_models import DEVICE


def inputs(B: int, S: int, dtype: torch.dtype, q_heads: int = 4, kv_heads: int = 2, D: int = 16, hidden: int = 64):
    torch.manual_seed(B * 10 + S)
    r = lambda *shape: torch.randn(*shape, dtype=dtype, device=DEVICE)   # noqa: E731
    return dict(h=r(B, S, hidden), delta=r(B, S, hidden), weight=r(hidden),
                qkv=r(B, S, q_heads + 2 * kv_heads, D), cos=r(B, S, 1, D), sin=r(B, S, 1, D), gate_up=r(B, S, 96),
                heads=(q_heads, kv_heads))


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_each_compiled_piece_computes_the_eager_ops(dtype):
    fused, eager = fused_elementwise.compiled(), fused_elementwise.EAGER
    assert fused.fused and not eager.fused
    # A replica's models need more compiles per function than dynamo's default keeps.
    assert torch._dynamo.config.recompile_limit >= fused_elementwise.RECOMPILE_LIMIT
    # Batch and width 1 (a decode step at batch 1) and wider, and another head count: dynamic
    # shapes, one compile for all but inductor's size-1 specialisations.
    for B, S, heads in ((1, 1, (4, 2)), (3, 5, (4, 2)), (2, 3, (6, 3))):
        x = inputs(B, S, dtype, *heads)
        with torch.inference_mode():
            got = [*fused.add_rms_norm(x["h"], x["delta"], x["weight"], 1e-5),
                   *fused.add_rms_norm(x["h"], None, x["weight"], 1e-6),
                   *fused.rope(x["qkv"], x["cos"], x["sin"], *heads), fused.silu_mul(x["gate_up"])]
            want = [*eager.add_rms_norm(x["h"], x["delta"], x["weight"], 1e-5),
                    *eager.add_rms_norm(x["h"], None, x["weight"], 1e-6),
                    *eager.rope(x["qkv"], x["cos"], x["sin"], *heads), eager.silu_mul(x["gate_up"])]
        q, k = got[4], got[5]
        assert q.shape == (B, heads[0], S, 16) and k.shape == (B, heads[1], S, 16)
        assert q.is_contiguous() and k.is_contiguous()   # as attention and the cache write take them
        # Every rounding is eager torch's: only the norm's float32 sum may run in another order.
        # (On CUDA eager torch's own kernels compute exp and the norm otherwise: a last-bit
        # difference before a rounding to bfloat16 may move a value by one bfloat16 step.)
        if dtype == torch.float32:
            rtol, atol = 0.0, 1e-6 if DEVICE.type == "cpu" else 1e-5
        else:
            rtol, atol = (0.0, 0.0) if DEVICE.type == "cpu" else (2 ** -7, 1e-3)
        for g, w in zip(got, want):
            torch.testing.assert_close(g, w, rtol=rtol, atol=atol)


def test_rope_is_rotate_half():
    x = inputs(1, 2, torch.float32)
    q, k = fused_elementwise.rope(x["qkv"], x["cos"], x["sin"], 4, 2)
    qk, half = x["qkv"][:, :, :6], 8
    rotated = torch.cat((-qk[..., half:], qk[..., :half]), dim=-1)
    want = (qk * x["cos"] + rotated * x["sin"]).transpose(1, 2)
    torch.testing.assert_close(torch.cat((q, k), dim=1), want, rtol=0, atol=0)


def test_a_piece_whose_compile_fails_runs_eagerly_from_then_on(caplog):
    calls = []

    def broken(*args):
        calls.append(args)
        raise RuntimeError("no compiler for this device")

    piece = fused_elementwise._falls_back(broken, fused_elementwise.silu_mul)
    x = torch.randn(2, 8)
    with caplog.at_level(logging.WARNING, logger=fused_elementwise.__name__):
        first, second = piece(x), piece(x)
    torch.testing.assert_close(first, fused_elementwise.silu_mul(x), rtol=0, atol=0)
    torch.testing.assert_close(second, first, rtol=0, atol=0)
    assert len(calls) == 1   # not tried again
    assert [r.message for r in caplog.records] == [
        "silu_mul runs unfused from now on: its compiled kernel failed (no compiler for this device)"]


def test_fused_kernels_are_cudas_and_switch_off_by_env(monkeypatch):
    assert not fused_elementwise.available(torch.device("cpu"))
    assert fused_elementwise.for_device(torch.device("cpu")) is fused_elementwise.EAGER
    monkeypatch.setenv(fused_elementwise.ENV_SWITCH, "0")
    assert not fused_elementwise.available(torch.device("cuda"))
    assert fused_elementwise.for_device(torch.device("cuda")) is fused_elementwise.EAGER


def test_a_forward_with_gradients_runs_the_eager_pieces():
    from specserve.replicas.model import llama_forward
    from tiny_models import tiny_model

    forward = llama_forward.for_model(tiny_model("llama", seed=1))
    h = torch.zeros(1, 1, 8, device=DEVICE)
    with torch.enable_grad():
        assert forward.elementwise_ops(h) is fused_elementwise.EAGER
    forward.elementwise = fused_elementwise.compiled()   # asked for: compiled either way
    with torch.enable_grad():
        assert forward.elementwise_ops(h) is forward.elementwise
