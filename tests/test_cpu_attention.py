"""The CPU attention kernel against attention computed in float64: bfloat16 and float32, grouped
query heads, strided cache views, sequences of different lengths, tree masks; a row's result does
not depend on the rest of the batch; without a C compiler torch's path is kept."""

import pytest
import torch

from conftest import run_without_a_compiler

from specserve.replicas import cpu_attention

pytestmark = pytest.mark.skipif(cpu_attention.library() is None, reason="no C compiler to build the kernel")


def reference(q, keys, values, mask):
    """float64 attention, grouped heads expanded."""
    group = q.shape[1] // keys.shape[1]
    k = keys.double().repeat_interleave(group, dim=1)
    v = values.double().repeat_interleave(group, dim=1)
    scores = q.double() @ k.transpose(-1, -2) * q.shape[-1] ** -0.5 + mask.double()
    return torch.softmax(scores, dim=-1) @ v


def case(B, S, lengths, nq=9, nkv=3, D=64, dtype=torch.bfloat16, tree=False, seed=0):
    """Views of a slot cache (capacity 256, slots 2..), and a mask: each sequence sees its cached
    prefix and, among its S new tokens, itself and earlier ones (or a random tree's ancestors)."""
    g = torch.Generator().manual_seed(seed)
    L = max(lengths)
    K = torch.randn(B + 4, nkv, 256, D, generator=g).to(dtype)
    V = torch.randn(B + 4, nkv, 256, D, generator=g).to(dtype)
    q = torch.randn(B, nq, S, D, generator=g).to(dtype)
    mask = torch.full((B, 1, S, L), torch.finfo(dtype).min, dtype=dtype)
    for b, n in enumerate(lengths):
        start = n - S
        mask[b, 0, :, :start] = 0
        parents = [i - 1 for i in range(S)] if not tree else [-1] + [int(torch.randint(0, i, (), generator=g)) for i in range(1, S)]
        for s in range(S):
            node = s
            while node >= 0:
                mask[b, 0, s, start + node] = 0
                node = parents[node]
    return q, K[2:2 + B, :, :L], V[2:2 + B, :, :L], mask


def kernel(q, keys, values, mask):
    return cpu_attention.attention(q, keys, values, cpu_attention.sequence_lengths(mask), mask[:, 0].float().contiguous())


@pytest.mark.parametrize("dtype,tolerance", [(torch.float32, 1e-5), (torch.bfloat16, 2e-2)])
@pytest.mark.parametrize("B,S,lengths,tree", [(1, 1, [7], False), (3, 1, [5, 130, 37], False),
                                              (4, 5, [20, 64, 9, 200], False), (2, 16, [40, 17], True),
                                              (3, 8, [8, 90, 33], True)])
def test_the_kernel_matches_float64_attention(dtype, tolerance, B, S, lengths, tree):
    q, keys, values, mask = case(B, S, lengths, dtype=dtype, tree=tree)
    with torch.no_grad():
        got = kernel(q, keys, values, mask)
    assert got.dtype == dtype and got.shape == q.shape
    assert (got.double() - reference(q, keys, values, mask)).abs().max().item() < tolerance


def test_a_rows_result_does_not_depend_on_the_rest_of_the_batch():
    q, keys, values, mask = case(4, 3, [30, 200, 12, 77])
    with torch.no_grad():
        together = kernel(q, keys, values, mask)
        for b in range(4):
            n = int(cpu_attention.sequence_lengths(mask[b:b + 1])[0])
            alone = kernel(q[b:b + 1], keys[b:b + 1, :, :n], values[b:b + 1, :, :n], mask[b:b + 1, :, :, :n])
            assert torch.equal(alone[0], together[b])


def test_sequence_lengths_end_after_the_last_position_any_query_sees():
    m = torch.finfo(torch.float32).min
    mask = torch.tensor([[[[0, 0, m, m], [0, 0, 0, m]]], [[[0, 0, 0, 0], [0, m, 0, 0]]], [[[m, 0, m, m], [m, m, m, m]]]])
    assert cpu_attention.sequence_lengths(mask).tolist() == [3, 4, 2]


def test_the_forward_uses_it_only_for_cpu_verify_steps():
    with torch.no_grad():
        assert cpu_attention.usable(torch.device("cpu"), torch.bfloat16, 5, 9, 3, 64)
        assert not cpu_attention.usable(torch.device("cpu"), torch.bfloat16, 64, 9, 3, 64)   # a prefill chunk
        assert not cpu_attention.usable(torch.device("cpu"), torch.float16, 1, 9, 3, 64)
        assert not cpu_attention.usable(torch.device("meta"), torch.float32, 1, 9, 3, 64)
    with torch.enable_grad():
        assert not cpu_attention.usable(torch.device("cpu"), torch.float32, 1, 9, 3, 64)


def test_without_a_compiler_torchs_path_is_kept(tmp_path):
    code = ("import torch; from specserve.replicas import cpu_attention as c; torch.set_grad_enabled(False); "
            "print(c.library() is None, c.usable(torch.device('cpu'), torch.float32, 1, 9, 3, 64))")
    assert run_without_a_compiler(code, tmp_path) == ["True", "False"]


@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float32])
def test_write_puts_each_rows_states_at_its_columns_like_torchs_indexed_assignment(dtype):
    g = torch.Generator().manual_seed(3)
    cache = torch.randn(6, 3, 40, 64, generator=g).to(dtype)
    # [B, H, S, D] with the layout the forward hands over: a transposed view of [B, S, H, D].
    states = torch.randn(3, 4, 3, 64, generator=g).to(dtype).transpose(1, 2)
    columns = torch.tensor([[5, 6, 7, 8], [0, 1, 2, 3], [30, 31, 32, 39]])
    want = cache.clone()
    want[torch.arange(2, 5)[:, None].expand(3, 4), :, columns] = states.transpose(1, 2)
    assert cpu_attention.write(cache, states, 2, columns)
    assert torch.equal(cache, want)
    assert not cpu_attention.write(cache[:, :, :20], states, 2, columns)   # not the buffer itself: torch's turn
