"""A hidden-state-reuse head's chain step through static buckets (``head_graphs``) proposes what
the module path proposes: the same greedy tokens, the same sampled q, across bucket boundaries
and for a head that fuses several layers (EAGLE-3), and decoding through it equals target-only.
On the CPU the buckets run eagerly; with ``SPECSERVE_TEST_DEVICE=cuda`` they replay graphs."""

import pytest
import torch

from equality import assert_greedy_equal
from specserve.replicas.drafts import head_graphs
from specserve.replicas.drafts.head_graphs import HeadGraphs
from specserve.replicas.drafts.hsr_draft import HSRDraft
from specserve.replicas.engine import speculative_generate
from specserve.replicas.sampling import SamplingParams
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


@pytest.mark.parametrize("window", [3, 6])
def test_decoding_through_the_buckets_equals_target_only(target, head, window):
    for prompt in ([5, 6, 7, 8, 5, 6, 9, 10, 11, 5, 6], list(range(20, 90))):
        expected = speculative_generate(Target(target), None, prompt, 40, GREEDY).token_ids
        _, bucketed = drafts(head)
        got = speculative_generate(Target(target), bucketed, prompt, 40, GREEDY, window=window)
        assert_greedy_equal(target, prompt, got.token_ids, expected, f"bucketed head γ={window}")
        assert got.stats.accepted > 0
