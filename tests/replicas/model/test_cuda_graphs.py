"""The bucketed layout CUDA graphs replay, checked on any device: a step padded to its bucket
(slots 0..B-1, S columns, L keys) gives every feed the logits of the plain padded step and of
Hugging Face, fills the feature tap alike, and leaves the cache as the plain step does. On CUDA
the same tests replay real graphs (``SPECSERVE_TEST_DEVICE=cuda``); off CUDA graphs switch off.
"""

import pytest
import torch

from specserve.replicas.model import cpu_attention, cpu_row_ops, cuda_graphs, fused_elementwise, llama_forward, small_gemm
from specserve.replicas.model.batch_kv import BatchKV, Feed
from specserve.replicas.target import feature_tap
from tiny_models import tiny_model

PREFIX = [5, 17, 3, 42, 8, 8, 61, 2, 30, 11]


def hf_logits(model, ids: list[int]) -> torch.Tensor:
    with torch.inference_mode():
        return model(torch.tensor([ids], device=model.device)).logits[0]


def padded(kv: BatchKV) -> BatchKV:
    """Steps through the padded layout (the CPU's flat one is its own path)."""
    kv._fast.flat_usable = lambda *args: False
    return kv


def bucketed(model, slots: int, capacity: int = 512) -> BatchKV:
    """A cache whose padded steps run through bucket graphs: captured on CUDA, else the same
    buffers run eagerly."""
    kv = padded(BatchKV(model, slots=slots, capacity=capacity))
    if kv.graphs is None:
        kv.graphs = cuda_graphs.StepGraphs(kv._fast, kv.device, slots, mode="buffers")
    return kv


def test_buckets():
    assert cuda_graphs.batch_buckets(12) == (1, 2, 4, 8, 12)
    assert cuda_graphs.batch_buckets(1) == (1,)
    assert cuda_graphs.key_buckets(1000) == (256, 512, 1000)
    assert cuda_graphs.smallest_at_least(5, cuda_graphs.TOKEN_BUCKETS) == 8
    assert cuda_graphs.smallest_at_least(61, cuda_graphs.TOKEN_BUCKETS) == 64   # EAGLE-2's 60 nodes and the root
    assert cuda_graphs.smallest_at_least(65, cuda_graphs.TOKEN_BUCKETS) is None


def test_a_wide_tree_replays_a_graph_at_small_batches_and_runs_eagerly_at_large_ones():
    """A tree of 40 nodes verifies in a 64-token bucket at batch 1 and matches the plain step; a
    bucket of more rows x tokens than ``MAX_BUCKET_TOKENS`` is not made."""
    model = tiny_model("llama", seed=6, layers=2)
    plain, graphed = padded(BatchKV(model, slots=8)), bucketed(model, slots=8)
    parents = [-1, -1, -1, -1] + [i // 3 for i in range(36)]   # four roots' children, three each below
    tree = [Feed(0, [(3 * i + 1) % 90 + 1 for i in range(41)], 41, [-1] + [p + 1 for p in parents])]
    for feeds in ([Feed(0, PREFIX)], tree):
        for w, g in zip(plain.forward(feeds), graphed.forward(feeds)):
            torch.testing.assert_close(g, w, rtol=0, atol=1e-5)
    assert graphed.graphs.replays == 2 and graphed.graphs.eager == 0
    assert graphed.graphs.bucket(8, 41, [0] * 8, graphed.capacity) is None   # 8 x 64 > 256
    assert graphed.graphs.bucket(4, 41, [0] * 8, graphed.capacity).tokens == 64


def test_graphs_are_off_the_cpu_and_switch_off_on_cuda(monkeypatch):
    model = tiny_model("llama", seed=1)
    kv = BatchKV(model, slots=2)
    assert (kv.graphs is not None) == (kv.device.type == "cuda")
    assert kv.use_cuda_graphs(False) is False
    monkeypatch.setenv(cuda_graphs.ENV_SWITCH, "0")
    assert not cuda_graphs.available(torch.device("cuda"))
    assert not cuda_graphs.available(torch.device("cpu"))


def test_bucketed_steps_give_every_feed_the_plain_steps_logits():
    model = tiny_model("llama", seed=9, layers=3)
    plain, graphed = padded(BatchKV(model, slots=6)), bucketed(model, slots=6)
    graphed.forward([Feed(4, PREFIX[:7])])   # an idle slot inside the bucket, with its own prefix cache
    steps = [
        [Feed(0, PREFIX), Feed(1, PREFIX[:6]), Feed(2, PREFIX[:3])],   # a short prefill fits a bucket too
        [Feed(2, [20, 21, 22, 23], 4, [-1, 0, 0, 1]), Feed(0, [9]), Feed(1, [4, 77, 5, 6, 1], 5)],
        [Feed(0, [3]), Feed(1, [8]), Feed(2, [21])],
        [Feed(1, [7, 7], 2)],
    ]
    for feeds in steps:
        want = plain.forward(feeds)
        got = graphed.forward(feeds)
        for w, g in zip(want, got):
            torch.testing.assert_close(g, w, rtol=0, atol=1e-5)
    assert graphed.graphs.replays == 1 + len(steps) and len(graphed.graphs) >= 2
    assert graphed.tokens[:3] == plain.tokens[:3]
    assert graphed.tokens[4] == PREFIX[:7]   # the idle slot's prefix cache is untouched
    # Its keys too: a request that finds that prefix gets Hugging Face's logits from it.
    got = graphed.forward([Feed(4, [PREFIX[7]])])[0]
    torch.testing.assert_close(got, hf_logits(model, PREFIX[:8])[-1:], rtol=0, atol=1e-4)


def test_a_replayed_bucket_matches_hugging_face_step_after_step():
    model = tiny_model("llama", seed=3, layers=2)
    kv = bucketed(model, slots=3)
    kv.forward([Feed(0, PREFIX[:4]), Feed(1, PREFIX[:2])])
    seq0, seq1 = PREFIX[:4], PREFIX[:2]
    for token in (9, 4, 61, 30, 12):   # the same bucket every step: its graph replays
        got = kv.forward([Feed(0, [token]), Feed(1, [token + 1])])
        seq0, seq1 = seq0 + [token], seq1 + [token + 1]
        torch.testing.assert_close(got[0], hf_logits(model, seq0)[-1:], rtol=0, atol=1e-4)
        torch.testing.assert_close(got[1], hf_logits(model, seq1)[-1:], rtol=0, atol=1e-4)
    assert len(kv.graphs) <= 2


def test_the_feature_tap_gets_each_replays_own_outputs():
    model = tiny_model("llama", seed=2, layers=3)
    tap = feature_tap(model)
    tap.watch(1)
    plain, graphed = padded(BatchKV(model, slots=2)), bucketed(model, slots=2)
    for feeds in ([Feed(0, PREFIX[:5])], [Feed(0, [7, 9], 2)], [Feed(0, [4, 4], 2)]):
        plain.forward(feeds)
        want = plain.fed_rows(tap.last[1], 0).clone()
        graphed.forward(feeds)
        torch.testing.assert_close(graphed.fed_rows(tap.last[1], 0), want, rtol=0, atol=1e-5)


def test_growing_the_cache_drops_the_graphs_that_read_it():
    model = tiny_model("llama", seed=4)
    kv = bucketed(model, slots=1, capacity=64)   # room to grow below the model's context
    kv.forward([Feed(0, PREFIX[:3])])
    assert len(kv.graphs) == 1
    kv._ensure_capacity(kv.capacity + 1)
    assert len(kv.graphs) == 0


def test_graphs_captured_at_start_serve_the_first_steps():
    model = tiny_model("llama", seed=5)
    kv = bucketed(model, slots=2, capacity=300)
    held = kv.capture_graphs(widths=(1, 5))
    assert held == len(cuda_graphs.key_buckets(300)) * 2 * 2 == len(kv.graphs)
    assert kv.tokens == [[], []]
    got = kv.forward([Feed(0, PREFIX[:6]), Feed(1, PREFIX[:3])])
    torch.testing.assert_close(got[0], hf_logits(model, PREFIX[:6])[-1:], rtol=0, atol=1e-4)
    assert len(kv.graphs) == held   # a bucket already captured


def test_a_start_past_the_graph_cap_keeps_the_shortest_keys_and_a_replay_is_used_recently(monkeypatch):
    monkeypatch.setattr(cuda_graphs, "MAX_GRAPHS", 3)
    model = tiny_model("llama", seed=5)
    kv = bucketed(model, slots=2, capacity=300)
    assert kv.capture_graphs(widths=(1, 5)) == 3 == len(kv.graphs)   # 16 buckets asked for
    captured = list(kv.graphs._graphs)
    assert {bucket.keys for bucket, _ in captured} == {cuda_graphs.key_buckets(300)[0]}
    oldest = captured[0]
    kv.forward([Feed(slot, [0] * oldest[0].tokens) for slot in range(oldest[0].rows)])   # the oldest, replayed
    kv.reset()
    kv.forward([Feed(0, PREFIX * 26)])   # a prefill past the bucket of 256 keys (eager)
    kv.forward([Feed(0, [3])])            # a decode in the next: a new graph, one goes
    assert oldest in kv.graphs._graphs and captured[1] not in kv.graphs._graphs and len(kv.graphs) == 3


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_sdpa_attention_computes_the_grouped_eager_attention(dtype):
    torch.manual_seed(0)
    B, nq, nkv, S, L, D = 2, 6, 2, 3, 11, 16
    q = torch.randn(B, nq, S, D, dtype=dtype)
    keys, values = torch.randn(B, nkv, L, D, dtype=dtype), torch.randn(B, nkv, L, D, dtype=dtype)
    allowed = torch.rand(B, 1, S, L) < 0.7
    allowed[..., -S:] |= torch.eye(S, dtype=torch.bool)   # every row sees at least itself
    mask = torch.zeros(B, 1, S, L, dtype=dtype).masked_fill_(~allowed, torch.finfo(dtype).min)
    want = llama_forward._attention_block(q, keys, values, mask)
    got = llama_forward.sdpa_attention(q, keys, values, llama_forward.sdpa_mask(mask, nq // nkv))
    tolerance = 1e-5 if dtype == torch.float32 else 2e-2
    torch.testing.assert_close(got, want, rtol=0, atol=tolerance)
    assert not llama_forward.uses_sdpa(torch.device("cpu")) and llama_forward.uses_sdpa(torch.device("cuda"))


def test_sdpa_attention_takes_the_kernels_output_in_any_memory_order(monkeypatch):
    """CUDA's fused kernels return [B, heads, rows, D] laid out as [B, rows, heads, D]; heads and
    rows are then not one contiguous span, so the grouped rows are regrouped by copy, not view."""
    torch.manual_seed(0)
    B, nq, nkv, S, L, D = 1, 6, 2, 3, 9, 8
    q = torch.randn(B, nq, S, D)
    keys, values = torch.randn(B, nkv, L, D), torch.randn(B, nkv, L, D)
    grouped = llama_forward.sdpa_mask(torch.zeros(B, 1, S, L), nq // nkv)
    want = llama_forward.sdpa_attention(q, keys, values, grouped)
    fused = torch.nn.functional.scaled_dot_product_attention

    def rows_major(*args, **kwargs):   # the same values, stored as the fused kernels store them
        return fused(*args, **kwargs).transpose(1, 2).contiguous().transpose(1, 2)

    monkeypatch.setattr(llama_forward.F, "scaled_dot_product_attention", rows_major)
    torch.testing.assert_close(llama_forward.sdpa_attention(q, keys, values, grouped), want, rtol=0, atol=0)


def test_bucketed_steps_with_fused_elementwise_kernels_give_hugging_faces_logits():
    """The padded step with its elementwise pieces compiled (``fused_elementwise``; on CUDA
    inside the captured graphs): chains, a tree and the feature tap as with the eager pieces."""
    model, twin = tiny_model("llama", seed=6, layers=3), tiny_model("llama", seed=6, layers=3)   # one forward each
    tap = feature_tap(model)
    tap.watch(1)
    twin_tap = feature_tap(twin)
    twin_tap.watch(1)
    plain, fused = padded(BatchKV(twin, slots=3)), bucketed(model, slots=3)
    plain._fast.elementwise = fused_elementwise.EAGER   # the C kernels on the CPU, torch's ops elsewhere
    fused._fast.elementwise = fused_elementwise.compiled()
    with torch.inference_mode():
        assert fused._fast.elementwise_ops(torch.zeros(1, device=fused.device)) is fused._fast.elementwise
    assert not fused._fast.flat_usable(1, fused.device, fused._dtype)   # the flat step is the C kernels'
    steps = [
        [Feed(0, PREFIX), Feed(2, PREFIX[:4])],
        [Feed(0, [9, 4, 77], 3), Feed(2, [20, 21, 22], 3, [-1, -1, 0])],
        [Feed(0, [5]), Feed(1, PREFIX[:2])],
    ]
    outputs = []
    for feeds in steps:
        want = plain.forward(feeds)
        want_tap = [plain.fed_rows(twin_tap.last[1], i).clone() for i in range(len(feeds))]
        got = fused.forward(feeds)
        outputs.append(got)
        for w, g in zip(want, got):
            torch.testing.assert_close(g, w, rtol=0, atol=1e-5)
        for i, w in enumerate(want_tap):
            torch.testing.assert_close(fused.fed_rows(tap.last[1], i), w, rtol=0, atol=1e-5)
    tree = outputs[1][1]
    for node, path in ((0, [20]), (1, [21]), (2, [20, 22])):
        torch.testing.assert_close(tree[node], hf_logits(model, PREFIX[:4] + path)[-1], rtol=0, atol=1e-4)
    torch.testing.assert_close(outputs[2][0], hf_logits(model, PREFIX + [9, 4, 77, 5])[-1:], rtol=0, atol=1e-4)


def test_the_forward_compiled_whole_over_the_buckets_gives_the_plain_steps_logits(monkeypatch):
    """``mode="compile"``: torch.compile of the whole forward (on CUDA with its own CUDA graphs),
    traced without a break (``fullgraph``), computes the plain padded step. Off CUDA the CPU's C
    kernels, which no trace enters, are switched off: the step is torch's, as on CUDA."""
    for module in (cpu_row_ops, cpu_attention, small_gemm):
        monkeypatch.setattr(module, "library", lambda: None)
    model = tiny_model("llama", seed=8, layers=2)
    plain, compiled = padded(BatchKV(model, slots=2)), bucketed(model, slots=2)
    compiled.graphs.set_mode("compile")
    assert compiled._fast.elementwise is fused_elementwise.EAGER   # inductor fuses the whole forward
    steps = [
        [Feed(0, PREFIX[:6]), Feed(1, PREFIX[:3])],
        [Feed(0, [9]), Feed(1, [4])],
        [Feed(0, [7]), Feed(1, [61])],                 # the same bucket: no new compile
        [Feed(0, [5, 6, 1], 3), Feed(1, [2])],
    ]
    for feeds in steps:
        want = plain.forward(feeds)
        got = compiled.forward(feeds)
        for w, g in zip(want, got):
            torch.testing.assert_close(g, w, rtol=0, atol=1e-5)
    assert compiled.graphs.replays == len(steps) and len(compiled.graphs) == 3
    torch.testing.assert_close(got[0], hf_logits(model, PREFIX[:6] + [9, 7, 5, 6, 1])[-3:], rtol=0, atol=1e-4)
    tap = feature_tap(model)
    tap.watch(0)
    with pytest.raises(ValueError, match="no feature tap"):
        compiled.forward([Feed(0, [3]), Feed(1, [3])])
    with tap.paused():   # a target-only measurement: the tap watches nothing for the block
        compiled.forward([Feed(0, [3]), Feed(1, [3])])
    assert tap.watched_layers == {0} and not tap.last
    with pytest.raises(ValueError, match="mode must be one of"):
        compiled.graphs.set_mode("trace")
