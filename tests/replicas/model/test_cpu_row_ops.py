"""The per-row C kernels against torch: the greedy argmax (ties, infinities, NaN, strided rows),
residual add + RMSNorm in Hugging Face's order (bit-equal in bfloat16, within float32 rounding),
the rotary embedding (bit-equal),
rows independent of the batch, the forward and the greedy verifier using them; without a C
compiler torch's ops are kept."""

import pytest
import torch
import torch.nn.functional as F

from conftest import run_without_a_compiler

from specserve.replicas.model import cpu_row_ops
from specserve.replicas.rejection_sampler import verify
from specserve.replicas.sampling import SamplingParams
from specserve.replicas.step import Proposal

pytestmark = pytest.mark.skipif(cpu_row_ops.library() is None, reason="no C compiler to build the kernel")

DTYPES = [torch.bfloat16, torch.float32]


@pytest.mark.parametrize("dtype", DTYPES)
def test_argmax_is_torchs_first_largest_index(dtype):
    g = torch.Generator().manual_seed(0)
    x = torch.randn(12, 49152, generator=g).to(dtype)
    x[0, 100] = x[0, 200] = 50          # a tie: the first wins
    x[1, -1] = 60                       # the very last element (past the last block of 64)
    x[2, 0] = 60                        # the very first
    x[3] = -x[3].abs()                  # all negative
    x[4, 5] = float("inf")
    x[5] = 0.0                          # all zero: index 0
    x[6, 7] = -float("inf")
    x[7, 3] = float("nan")              # NaN counts as the largest (torch's rule)
    x[8] = -x[8].abs()
    x[8, 9], x[8, 10] = -0.0, 0.0       # -0 and +0 tie as floats
    x[9, 11] = float("-nan")
    assert cpu_row_ops.argmax(x) == x.argmax(-1).tolist()
    # Asked to, NaN rows say so instead (the greedy verifier refuses them without another pass).
    assert cpu_row_ops.argmax(x, nan=-1) == [-1 if r in (7, 9) else c for r, c in enumerate(x.argmax(-1).tolist())]
    strided = torch.randn(6, 2, 1000, generator=g).to(dtype)[:, 1]   # rows 2000 apart
    assert cpu_row_ops.argmax(strided) == strided.argmax(-1).tolist()
    short = torch.randn(3, 37, generator=g).to(dtype)                # shorter than a block
    assert cpu_row_ops.argmax(short) == short.argmax(-1).tolist()


def torch_add_rms_norm(h, delta, weight, eps):
    h = h + delta
    return h, weight * F.rms_norm(h.float(), (h.shape[-1],), eps=eps).to(h.dtype)


@pytest.mark.parametrize("dtype", DTYPES)
def test_add_rms_norm_is_hugging_faces_order(dtype):
    g = torch.Generator().manual_seed(1)
    h = torch.randn(7, 3, 576, generator=g).to(dtype)
    delta = torch.randn(7, 3, 576, generator=g).to(dtype)
    weight = torch.randn(576, generator=g).to(dtype)
    want_h, want = torch_add_rms_norm(h, delta, weight, 1e-5)
    got_h = h.clone()
    got = cpu_row_ops.add_rms_norm(got_h, delta, weight, 1e-5)
    assert torch.equal(got_h, want_h)   # the residual sum rounds once, as torch's add
    if dtype == torch.bfloat16:
        # float32 sums in another order: at most one bfloat16 step apart, and rarely at all.
        assert (got != want).float().mean() < 0.01
        torch.testing.assert_close(got, want, rtol=1e-2, atol=1e-2)
    else:
        torch.testing.assert_close(got, want, rtol=1e-5, atol=1e-5)
    alone = cpu_row_ops.add_rms_norm(h[2:3].clone(), delta[2:3], weight, 1e-5)
    assert torch.equal(alone, got[2:3]), "a row's norm depends on the rest of the batch"
    plain = cpu_row_ops.add_rms_norm(h.clone(), None, weight, 1e-5)
    torch.testing.assert_close(plain, weight * F.rms_norm(h.float(), (576,), eps=1e-5).to(dtype), rtol=1e-2, atol=1e-2)


@pytest.mark.parametrize("dtype", DTYPES)
def test_rope_rounds_as_hugging_faces_three_ops_and_lays_q_and_k_out_for_attention(dtype):
    g = torch.Generator().manual_seed(2)
    B, S, nq, nkv, D = 4, 3, 9, 3, 64
    qkv = torch.randn(B, S, nq + 2 * nkv, D, generator=g).to(dtype)
    cos, sin = torch.randn(B, S, D, generator=g).to(dtype), torch.randn(B, S, D, generator=g).to(dtype)
    qk = qkv[:, :, :nq + nkv]
    rotated = torch.cat((-qk[..., D // 2:], qk[..., :D // 2]), dim=-1)
    want = qk * cos[:, :, None] + rotated * sin[:, :, None]
    q, k = cpu_row_ops.rope(qkv, cos, sin, nq, nkv)
    assert torch.equal(q, want[:, :, :nq].transpose(1, 2)) and torch.equal(k, want[:, :, nq:].transpose(1, 2))
    assert q.is_contiguous() and k.is_contiguous()


def test_greedy_verification_follows_the_kernels_argmax():
    logits = torch.full((4, 50), -1.0, dtype=torch.bfloat16)
    for row, token in enumerate([7, 9, 3, 11]):
        logits[row, token] = 2.0
    path, bonus = verify(logits, Proposal.chain([7, 9, 4]), SamplingParams())
    assert (path, bonus) == ([0, 1], 3)


def test_without_a_compiler_torchs_ops_are_kept(tmp_path):
    code = ("import torch; from specserve.replicas.model import cpu_row_ops as c; "
            "print(c.library() is None, c.usable(torch.zeros(2, 4)))")
    assert run_without_a_compiler(code, tmp_path) == ["True", "False"]
