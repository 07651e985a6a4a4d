"""A hidden-state-reuse head's chain step and tree levels through static buckets (``head_graphs``)
propose what the module path proposes: the same greedy tokens and trees (EAGLE-2's grown on the
device, ``device_growth``; SAGE's on the host), the same sampled q,
across bucket boundaries and for a head that fuses several layers (EAGLE-3), and decoding
through them equals target-only. On the CPU the buckets run eagerly; with
``SPECSERVE_TEST_DEVICE=cuda`` they replay graphs."""

import pytest
import torch

from device_reads import reads
from equality import assert_greedy_equal
from specserve.replicas.drafts import head_graphs
from specserve.replicas.drafts.head_graphs import HeadGraphs
from specserve.replicas.drafts.hsr_draft import HSRDraft
from specserve.replicas.engine import speculative_generate
from specserve.replicas.sampling import SamplingParams
from specserve.replicas.step import TreeShape
from specserve.replicas.target import Target
from tiny_hsr import FUSED_LAYERS, one_thread, trained_hsr_head
from tiny_models import DEVICE, VOCAB, tiny_model

GREEDY = SamplingParams()
CAPTURE = DEVICE.type == "cuda"


@pytest.fixture(scope="module")
def target():
    return tiny_model("llama", seed=0, layers=3)


@pytest.fixture(scope="module", params=["one-layer", "fused"])
def head(request, target):
    return one_thread(lambda: trained_hsr_head(target, steps=60, layers=FUSED_LAYERS if request.param == "fused" else None))


def states(target, tokens: list[int], layers) -> torch.Tensor:
    """The target's states of ``tokens`` as the head reads them ([n, n_layers·H])."""
    with torch.inference_mode():
        hidden = target(torch.tensor([tokens], device=target.device), output_hidden_states=True).hidden_states
    return torch.cat([hidden[layer if layer < 0 else layer + 1][0] for layer in layers], dim=-1)


def drafts(head):
    module, bucketed = HSRDraft("module", head), HSRDraft("bucketed", head)
    module.graphs, bucketed.graphs = None, HeadGraphs(head, capture=CAPTURE)
    return module, bucketed


def test_buckets_are_powers_of_two_and_end():
    assert [head_graphs.bucket_for(n) for n in (1, 64, 65, 300, 32768)] == [64, 64, 128, 512, 32768]
    assert head_graphs.bucket_for(head_graphs.SMALLEST_BUCKET << head_graphs.MAX_BUCKETS) is None


def test_the_rotary_table_holds_the_heads_own_angles(head):
    """The buckets read cos and sin from a table built once: the values ``HSRHead.rope``
    computes for each position, bit for bit; a position past the head's context reads the last."""
    last = head.config.max_position_embeddings - 1
    positions = torch.tensor([0, 1, 63, 1000, last, last + 5], device=head.device)
    cos, sin = HeadGraphs(head, capture=False)._rotary(positions, head.dtype)
    want_cos, want_sin = head.rope(positions.clamp(max=last), head.dtype)
    assert torch.equal(cos, want_cos) and torch.equal(sin, want_sin) and torch.equal(cos[-1], cos[-2])


def test_the_buckets_stack_the_projections_without_copying_the_weights(target):
    """q/k/v and gate/up run as one product each over the layer's own weights: its projections
    become views of one stacked tensor each, their values unchanged."""
    head = trained_hsr_head(target, steps=0)
    attn, mlp = head.layer.self_attn, head.layer.mlp
    groups = [[attn.q_proj, attn.k_proj, attn.v_proj], [mlp["gate_proj"], mlp["up_proj"]]]
    before = [[linear.weight.clone() for linear in group] for group in groups]
    HeadGraphs(head, capture=False)
    for group, values in zip(groups, before):
        assert len({linear.weight.untyped_storage().data_ptr() for linear in group}) == 1
        assert all(torch.equal(linear.weight, value) for linear, value in zip(group, values))


@pytest.mark.parametrize("length", [5, 60, 63, 64, 130])
@pytest.mark.parametrize("window", [2, 5])
def test_a_greedy_chain_proposes_the_module_paths_tokens(target, head, length, window):
    """Lengths on both sides of the first bucket's end: the cache plus the chain crosses it."""
    layers = head.config.feature_layers or [-2]
    context = [(7 * i + 3) % (VOCAB - 1) + 1 for i in range(length)]
    features = states(target, context, layers)
    module, bucketed = drafts(head)
    want = module.propose(context, window, GREEDY, None, features=features[:-1], features_start=0)
    got = bucketed.propose(context, window, GREEDY, None, features=features[:-1], features_start=0)
    assert got.tokens == want.tokens and len(got.tokens) == window
    assert got.token_probs == pytest.approx(want.token_probs, abs=1e-5)
    assert bucketed.graphs.steps == window - 1


def test_a_sampled_chain_draws_from_the_module_paths_q(target, head):
    layers = head.config.feature_layers or [-2]
    context = [(5 * i + 1) % (VOCAB - 2) + 2 for i in range(40)]
    features = states(target, context, layers)
    params = SamplingParams(temperature=0.9, top_k=30)
    module, bucketed = drafts(head)
    want = module.propose(context, 4, params, torch.Generator(DEVICE).manual_seed(3), features=features[:-1])
    got = bucketed.propose(context, 4, params, torch.Generator(DEVICE).manual_seed(3), features=features[:-1])
    assert got.tokens == want.tokens
    torch.testing.assert_close(got.draft_probs, want.draft_probs, rtol=0, atol=1e-5)


@pytest.mark.parametrize("params", [GREEDY, SamplingParams(temperature=0.9)], ids=["greedy", "sampled"])
def test_a_chain_through_the_buckets_reads_the_device_as_often_for_six_tokens_as_for_two(target, head, params):
    """Each drafted token is chosen and fed to the next step on the device, and the chain is read
    once, at its end: a longer chain adds no wait."""
    layers = head.config.feature_layers or [-2]
    context = [(3 * i + 2) % (VOCAB - 1) + 1 for i in range(30)]
    features = states(target, context, layers)
    _, bucketed = drafts(head)

    def chain(window: int):
        bucketed.session.reset()
        generator = None if params.greedy else torch.Generator(DEVICE).manual_seed(0)
        return bucketed.propose(context, window, params, generator, features=features[:-1], features_start=0)

    chain(6)   # buckets and graphs made
    (two, short), (six, long) = reads(lambda: chain(2), DEVICE), reads(lambda: chain(6), DEVICE)
    assert len(two.tokens) == 2 and len(six.tokens) == 6 and six.tokens[:2] == two.tokens
    assert long == short, (short, long)


@pytest.fixture
def attached(head):
    """The head's graphs as its served drafts use them (each session's draft is made anew)."""
    graphs = HeadGraphs.attach(head, capture=CAPTURE)
    yield graphs
    HeadGraphs.detach(head)


@pytest.mark.parametrize("speculation", [dict(window=3), dict(window=6), dict(tree=TreeShape(4, 3, 10)),
                                         dict(tree=TreeShape(5, 4, 24)),
                                         dict(tree=TreeShape(4, 4, 20, width_decay=True))], ids=str)
def test_decoding_through_the_buckets_equals_target_only(target, head, attached, speculation):
    """Chains and trees (EAGLE-2's grown on the device, SAGE's on the host), through the buckets
    the served drafts use."""
    counter = "levels" if "tree" in speculation else "steps"
    for prompt in ([5, 6, 7, 8, 5, 6, 9, 10, 11, 5, 6], list(range(20, 90))):
        expected = speculative_generate(Target(target), None, prompt, 40, GREEDY).token_ids
        before = getattr(attached, counter)
        got = speculative_generate(Target(target), HSRDraft("bucketed", head), prompt, 40, GREEDY, **speculation)
        assert_greedy_equal(target, prompt, got.token_ids, expected, f"bucketed head {speculation}")
        assert got.stats.accepted > 0 and getattr(attached, counter) > before


PICTURE = 3   # a VLM request's image placeholder, as the windowed head reads it


@pytest.mark.parametrize("windowed", [False, True], ids=["text", "windowed"])
@pytest.mark.parametrize("tree", [None, TreeShape(4, 3, 10)], ids=["chain", "tree"])
def test_the_feed_up_to_the_root_runs_in_the_bucket_the_proposal_drafts_in(target, head, tree, windowed):
    """Step after step the context grows by what a verify accepted (1 to 5 tokens, and the
    same context again): each feed runs in a bucket and leaves the session the module path's
    exact cache, and each proposal is the module path's. Windowed (Sparrow's text anchors), the
    placeholders inside an accepted run are skipped, so the cache's positions have gaps."""
    layers = head.config.feature_layers or [-2]
    context = [PICTURE if 20 <= i < 28 or 34 <= i < 35 else (7 * i + 5) % (VOCAB - 1) + 1 for i in range(90)]
    features = states(target, context, layers)
    module, bucketed = HSRDraft("module", head, windowed), HSRDraft("bucketed", head, windowed)
    module.graphs, bucketed.graphs = None, HeadGraphs(head, capture=CAPTURE)
    for end in (30, 31, 33, 33, 36, 40, 45, 62, 63, 64, 66):   # across the 64- and 128-key buckets
        inputs = dict(features=features[:end - 1], features_start=0, image_placeholder=PICTURE)
        if tree is None:
            want = module.propose(context[:end], 4, GREEDY, None, **inputs)
            got = bucketed.propose(context[:end], 4, GREEDY, None, **inputs)
        else:
            want = module.propose_tree(context[:end], tree, **inputs)
            got = bucketed.propose_tree(context[:end], tree, **inputs)
        assert (got.tokens, got.parents) == (want.tokens, want.parents), end
        assert got.token_probs == pytest.approx(want.token_probs, abs=1e-5)
        torch.testing.assert_close(bucketed.session.keys, module.session.keys, rtol=0, atol=1e-5)
        torch.testing.assert_close(bucketed.session.values, module.session.values, rtol=0, atol=1e-5)
    assert bucketed.session.cached == module.session.cached
    assert (PICTURE in [context[p] for p in bucketed.session.cached[:-1]]) != windowed
    # Every step but the first (the prompt) and 45 -> 62, longer than a feed bucket takes.
    assert bucketed.graphs.feeds == 9


# EAGLE-2's rule with a level width that is no power of two (padding rows), a wide first level,
# and SAGE's width decay (levels as wide as the budget allows).
TREES = [TreeShape(4, 3, 10), TreeShape(3, 10, 24), TreeShape(4, 4, 20, width_decay=True)]


@pytest.mark.parametrize("length", [5, 40, 63, 130])
@pytest.mark.parametrize("shape", TREES, ids=str)
def test_a_tree_proposes_the_module_paths_tree(target, head, length, shape):
    """Lengths on both sides of a bucket's end once the tree's nodes are counted."""
    layers = head.config.feature_layers or [-2]
    context = [(11 * i + 2) % (VOCAB - 1) + 1 for i in range(length)]
    features = states(target, context, layers)
    module, bucketed = drafts(head)
    want = module.propose_tree(context, shape, features=features[:-1])
    got = bucketed.propose_tree(context, shape, features=features[:-1])
    assert (got.tokens, got.parents) == (want.tokens, want.parents) and len(got.tokens) > shape.top_k
    assert got.token_probs == pytest.approx(want.token_probs, abs=1e-5)
    assert bucketed.graphs.levels == shape.depth - 1   # every level but the last is fed


@pytest.mark.parametrize("held", [head_graphs.MAX_TREE_GRAPHS, 1, 0], ids=["whole", "one-whole", "per-level"])
def test_trees_past_the_whole_tree_graphs_replay_their_levels(target, head, monkeypatch, held):
    """An EAGLE-2 tree runs whole (one graph per bucket and shape) while the head holds fewer
    than ``MAX_TREE_GRAPHS``, else level by level (as when ``whole_trees`` is off); shapes and
    trees of SAGE's kind interleaved in one bucket, each proposal is the module path's."""
    monkeypatch.setattr(head_graphs, "MAX_TREE_GRAPHS", held)
    layers = head.config.feature_layers or [-2]
    context = [(5 * i + 3) % (VOCAB - 1) + 1 for i in range(30)]
    features = states(target, context, layers)
    module, bucketed = drafts(head)
    shapes = [TreeShape(4, 3, 10), TreeShape(3, 4, 12), TreeShape(4, 3, 10, width_decay=True), TreeShape(3, 4, 12)]
    for shape in shapes:
        module.session.reset()
        bucketed.session.reset()
        want = module.propose_tree(context, shape, features=features[:-1])
        got = bucketed.propose_tree(context, shape, features=features[:-1])
        assert (got.tokens, got.parents) == (want.tokens, want.parents), shape
        assert got.token_probs == pytest.approx(want.token_probs, abs=1e-5)
        assert got.root_probs == pytest.approx(want.root_probs, abs=1e-5)
    trees = bucketed.graphs._buckets[head_graphs.SMALLEST_BUCKET].trees
    assert list(trees) == [TreeShape(4, 3, 10), TreeShape(3, 4, 12)][:held]
    assert bucketed.graphs.trees == {0: 0, 1: 1}.get(held, 3)
    assert bucketed.graphs.levels == 3 + 2 + 3 + 2


def test_a_tree_after_a_longer_one_sees_none_of_its_keys(target, head):
    """The buckets' buffers and masks outlive a proposal: a second, shorter context in the same
    bucket (64 positions: the cache and twice the nodes) must not attend to what the first left
    past its own cache."""
    layers = head.config.feature_layers or [-2]
    long, short = ([(13 * i + 5) % (VOCAB - 1) + 1 for i in range(n)] for n in (40, 16))
    module, bucketed = drafts(head)
    shape = TreeShape(4, 3, 12)
    for context in (long, short):
        features = states(target, context, layers)
        module.session.reset()
        bucketed.session.reset()
        want = module.propose_tree(context, shape, features=features[:-1])
        got = bucketed.propose_tree(context, shape, features=features[:-1])
        assert (got.tokens, got.parents) == (want.tokens, want.parents)
        assert got.token_probs == pytest.approx(want.token_probs, abs=1e-5)
    assert list(bucketed.graphs._buckets) == [head_graphs.SMALLEST_BUCKET]


def test_a_tree_too_large_for_the_buckets_drafts_through_the_module_path(target, head):
    layers = head.config.feature_layers or [-2]
    context = list(range(3, 30))
    features = states(target, context, layers)
    module, bucketed = drafts(head)
    shape = TreeShape(2, 2, head_graphs.MAX_TREE_NODES + 1)
    got = bucketed.propose_tree(context, shape, features=features[:-1])
    assert got.tokens == module.propose_tree(context, shape, features=features[:-1]).tokens
    assert bucketed.graphs.levels == 0


def test_graphs_captured_before_any_proposal_serve_chains_and_trees(target, head):
    """``capture_buckets`` makes every graph of the buckets a length admits (on the CPU it runs
    each step once eagerly over placeholders); proposals afterwards are the module path's and,
    on CUDA, capture nothing more."""
    layers = head.config.feature_layers or [-2]
    module, bucketed = drafts(head)
    shape = TreeShape(4, 3, 10)
    held = bucketed.graphs.capture_buckets(100, trees=(shape, TreeShape(4, 3, 10, width_decay=True)))
    assert list(bucketed.graphs._buckets) == [64, 128]
    # Each bucket: its chain step, 5 feed widths, the tree-level widths below its size, and the
    # EAGLE-2 shape's whole tree (SAGE's grows on the host).
    assert held == (2 + 2 * 5 + 6 + 7 + 2 if CAPTURE else 0)
    assert all(list(b.trees) == [shape] for b in bucketed.graphs._buckets.values())
    context = [(3 * i + 4) % (VOCAB - 1) + 1 for i in range(70)]
    features = states(target, context, layers)
    for end in (20, 21, 24, 60, 61, 70):
        inputs = dict(features=features[:end - 1], features_start=0)
        want = module.propose(context[:end], 4, GREEDY, None, **inputs)
        got = bucketed.propose(context[:end], 4, GREEDY, None, **inputs)
        assert got.tokens == want.tokens and got.token_probs == pytest.approx(want.token_probs, abs=1e-5)
        want = module.propose_tree(context[:end], shape, **inputs)
        got = bucketed.propose_tree(context[:end], shape, **inputs)
        assert (got.tokens, got.parents) == (want.tokens, want.parents), end
        assert got.token_probs == pytest.approx(want.token_probs, abs=1e-5)
    assert bucketed.graphs.captured == held and bucketed.graphs.feeds > 0 and bucketed.graphs.trees == 6
    assert all(list(b.trees) == [shape] for b in bucketed.graphs._buckets.values())


@pytest.mark.skipif(not CAPTURE, reason="what waits for the host is seen on CUDA only")
@pytest.mark.parametrize("whole", [True, False], ids=["whole", "per-level"])
def test_a_tree_grown_on_the_device_waits_for_the_host_only_at_its_end(target, head, monkeypatch, whole):
    """EAGLE-2's tree through the graphs: a level's choice and the next level's inputs run on the
    device, so nothing between the root and the read of the whole tree synchronises, whether the
    tree replays as one graph or level by level."""
    from specserve.replicas.drafts.head_graphs import TreeLevels

    def no_sync(method):
        def checked(*args, **kwargs):
            torch.cuda.set_sync_debug_mode("error")
            try:
                return method(*args, **kwargs)
            finally:
                torch.cuda.set_sync_debug_mode(0)
        return checked

    layers = head.config.feature_layers or [-2]
    context = [(11 * i + 2) % (VOCAB - 1) + 1 for i in range(40)]
    features = states(target, context, layers)
    module, bucketed = drafts(head)
    bucketed.graphs.whole_trees = whole
    shape = TreeShape(6, 10, 60)
    bucketed.propose_tree(context, shape, features=features[:-1])   # captures the graphs
    bucketed.session.reset()
    captured = bucketed.graphs.captured
    monkeypatch.setattr(TreeLevels, "grown", no_sync(TreeLevels.grown))
    got = bucketed.propose_tree(context, shape, features=features[:-1])
    want = module.propose_tree(context, shape, features=features[:-1])
    assert (got.tokens, got.parents) == (want.tokens, want.parents) and len(got.tokens) == 60
    assert bucketed.graphs.captured == captured and bucketed.graphs.trees == (2 if whole else 0)
