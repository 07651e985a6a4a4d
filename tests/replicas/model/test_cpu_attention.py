"""The CPU attention kernel against attention computed in float64: bfloat16 and float32, grouped
query heads, flat steps of sequences with different new-token counts and cache lengths, tree
masks; a sequence's result does not depend on the rest of the step; without a C compiler torch's
path is kept."""

import pytest
import torch

from conftest import run_without_a_compiler

from specserve.replicas.model import cpu_attention

pytestmark = pytest.mark.skipif(cpu_attention.library() is None, reason="no C compiler to build the kernel")


def reference(q, keys, values, mask):
    """float64 attention of one sequence, grouped heads expanded: q [nq, S, D], keys/values
    [nkv, n, D], mask [S, n] additive."""
    group = q.shape[0] // keys.shape[0]
    k = keys.double().repeat_interleave(group, dim=0)
    v = values.double().repeat_interleave(group, dim=0)
    scores = q.double() @ k.transpose(-1, -2) * q.shape[-1] ** -0.5 + mask.double()
    return torch.softmax(scores, dim=-1) @ v            # [nq, S, D]


def case(counts, cached, nq=9, nkv=3, D=64, dtype=torch.bfloat16, tree=False, seed=0):
    """A flat step over a slot cache (capacity 256; sequence i in slot 2 + 2i, so slots are not
    the batch rows): sequence i has ``cached[i]`` positions and ``counts[i]`` new tokens that see
    the cached prefix and themselves and earlier ones (or a random tree's ancestors)."""
    g = torch.Generator().manual_seed(seed)
    N = len(counts)
    K = torch.randn(2 * N + 3, nkv, 256, D, generator=g).to(dtype)
    V = torch.randn(2 * N + 3, nkv, 256, D, generator=g).to(dtype)
    T, W = sum(counts), max(counts)
    q = torch.randn(nq, T, D, generator=g).to(dtype)
    mask = torch.full((T, W), float("-inf"))
    sequences, start = [], 0
    for n, c in zip(counts, cached):
        parents = [i - 1 for i in range(n)] if not tree else [-1] + [int(torch.randint(0, i, (), generator=g)) for i in range(1, n)]
        for s in range(n):
            node = s
            while node >= 0:
                mask[start + s, node] = 0
                node = parents[node]
        sequences.append((2 + 2 * len(sequences), start, n, c))
        start += n
    length = max(c + n for c, n in zip(cached, counts))
    return q, K, V, torch.tensor(sequences), mask, length


def expected(q, K, V, sequences, mask):
    """Each sequence's attention alone, in float64: [T, nq, D]."""
    out = torch.zeros(q.shape[1], q.shape[0], q.shape[2], dtype=torch.float64)
    for slot, start, n, c in sequences.tolist():
        full = torch.cat([torch.zeros(n, c), mask[start:start + n, :n]], dim=1)
        out[start:start + n] = reference(q[:, start:start + n], K[slot, :, :c + n], V[slot, :, :c + n], full).transpose(0, 1)
    return out


@pytest.mark.parametrize("dtype,tolerance", [(torch.float32, 1e-5), (torch.bfloat16, 2e-2)])
@pytest.mark.parametrize("counts,cached,tree", [([1], [6], False), ([1, 1, 1], [4, 129, 36], False),
                                                ([5, 5, 5, 5], [15, 59, 4, 195], False),
                                                ([1, 5, 1, 3], [40, 17, 200, 0], False),   # ragged
                                                ([16, 7], [24, 10], True), ([8, 2, 5], [0, 88, 28], True)])
def test_the_kernel_matches_float64_attention(dtype, tolerance, counts, cached, tree):
    q, K, V, sequences, mask, length = case(counts, cached, dtype=dtype, tree=tree)
    with torch.no_grad():
        got = cpu_attention.attention(q, K, V, sequences, mask, length)
    assert got.dtype == dtype and got.shape == (sum(counts), q.shape[0] * q.shape[2])
    want = expected(q, K, V, sequences, mask).reshape(got.shape)
    assert (got.double() - want).abs().max().item() < tolerance


def test_a_sequences_result_does_not_depend_on_the_rest_of_the_step():
    q, K, V, sequences, mask, length = case([3, 1, 5, 2], [30, 200, 12, 77])
    with torch.no_grad():
        together = cpu_attention.attention(q, K, V, sequences, mask, length)
        for slot, start, n, c in sequences.tolist():
            alone = cpu_attention.attention(q[:, start:start + n], K, V, torch.tensor([(slot, 0, n, c)]),
                                            mask[start:start + n, :n].contiguous(), c + n)
            assert torch.equal(alone, together[start:start + n])


def test_the_forward_uses_it_only_for_cpu_verify_steps():
    with torch.no_grad():
        assert cpu_attention.usable(torch.device("cpu"), torch.bfloat16, 5, 9, 3, 64)
        assert cpu_attention.usable(torch.device("cpu"), torch.bfloat16, 31, 9, 3, 64)       # a tree of 31 nodes
        assert not cpu_attention.usable(torch.device("cpu"), torch.bfloat16, 256, 9, 3, 64)  # a prefill chunk
        assert not cpu_attention.usable(torch.device("cpu"), torch.float16, 1, 9, 3, 64)
        assert not cpu_attention.usable(torch.device("cpu"), torch.bfloat16, 1, 9, 3, 40)   # 16-lane loops over D
        assert not cpu_attention.usable(torch.device("meta"), torch.float32, 1, 9, 3, 64)
    with torch.enable_grad():
        assert not cpu_attention.usable(torch.device("cpu"), torch.float32, 1, 9, 3, 64)


def test_without_a_compiler_torchs_path_is_kept(tmp_path):
    code = ("import torch; from specserve.replicas.model import cpu_attention as c; torch.set_grad_enabled(False); "
            "print(c.library() is None, c.usable(torch.device('cpu'), torch.float32, 1, 9, 3, 64))")
    assert run_without_a_compiler(code, tmp_path) == ["True", "False"]


@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float32])
def test_write_puts_each_rows_states_at_its_columns_like_torchs_indexed_assignment(dtype):
    g = torch.Generator().manual_seed(3)
    cache = torch.randn(6, 3, 40, 64, generator=g).to(dtype)
    # [B, H, S, D] with the layout the forward hands over: a transposed view of [B, S, H, D].
    states = torch.randn(3, 4, 3, 64, generator=g).to(dtype).transpose(1, 2)
    columns = torch.tensor([[5, 6, 7, 8], [0, 1, 2, 3], [30, 31, 32, 39]])
    slots = torch.tensor([[2, 2, 2, 2], [5, 5, 5, 5], [3, 3, 0, 0]])   # a flat step mixes slots in a row
    want = cache.clone()
    want[slots, :, columns] = states.transpose(1, 2)
    assert cpu_attention.write(cache, states, slots, columns)
    assert torch.equal(cache, want)
    assert not cpu_attention.write(cache[:, :, :20], states, slots, columns)   # not the buffer itself: torch's turn
