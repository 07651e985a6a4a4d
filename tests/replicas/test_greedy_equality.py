"""Speculative greedy output equals target-only greedy output, for every draft, window and tree,
on tiny random models of three architectures (greedy equality holds for any weights), and for an
EAGLE-3 head fusing several of a Llama target's layers."""

import pytest
from equality import assert_greedy_equal
from specserve.replicas.drafts.draft_lm import DraftLM
from specserve.replicas.drafts.hsr_draft import HSRDraft
from specserve.replicas.drafts.prompt_lookup import PromptLookupDraft
from specserve.replicas.drafts.suffix import SuffixDraft
from specserve.replicas.sampling import SamplingParams
from specserve.replicas.step import TreeShape
from specserve.replicas.target import Target
from specserve.replicas.engine import speculative_generate
from tiny_hsr import FUSED_LAYERS, one_thread, trained_hsr_head
from tiny_models import ARCHITECTURES, perturbed, tiny_model

GREEDY = SamplingParams()
PROMPTS = [[5, 6, 7, 8, 5, 6, 9, 10, 11, 5, 6], [1, 2, 3, 4, 1, 2, 3, 4, 1], list(range(20, 50))]
REPETITIVE = PROMPTS[:2]   # prompt lookup finds n-grams to copy in these from the first step
TREES = [TreeShape(3, 2, 6), TreeShape(5, 3, 12), TreeShape(4, 4, 30)]
NEW_TOKENS = 40


@pytest.fixture(scope="module", params=ARCHITECTURES)
def models(request):
    target = tiny_model(request.param, seed=0)
    return target, {
        "prompt-lookup": PromptLookupDraft(),
        "suffix": SuffixDraft(),
        # The cluster's arrays drafting too: continuations of these prompts the target never says.
        "suffix-seeded": SuffixDraft(seed=[list(range(20, 70)), [1, 2, 3, 4, 5, 6, 7, 8] * 3, [5, 6, 9, 10, 11, 12, 13]]),
        "near": DraftLM("near", perturbed(target, seed=1)),
        "far": DraftLM("far", tiny_model(request.param, seed=7, layers=1)),
    }


def reference(target, prompt):
    return speculative_generate(Target(target), None, prompt, NEW_TOKENS, GREEDY).token_ids


def assert_equal_and_accepted(models, label: str, **speculation) -> None:
    """Every draft on every prompt gives the target-only output, and the drafts that agree with
    the target had tokens accepted. Equality alone passes when nothing is ever accepted (every
    step is then plain decoding), so a bug in what an accepted step keeps (a compaction that
    keeps the wrong cache slots, a wrong bonus row) would go unseen."""
    target, drafts = models
    accepted = dict.fromkeys(drafts, 0)
    for prompt in PROMPTS:
        expected = reference(target, prompt)
        for name, draft in drafts.items():
            got = speculative_generate(Target(target), draft, prompt, NEW_TOKENS, GREEDY, **speculation)
            assert_greedy_equal(target, prompt, got.token_ids, expected, f"{name} {label}")
            accepted[name] += got.stats.accepted
            if name in ("prompt-lookup", "suffix") and prompt in REPETITIVE:
                # Measured: 8 to 31 accepted tokens per run over the three architectures.
                assert got.stats.accepted > 0, f"{name} {label} accepted nothing on {prompt}"
    # Per prompt "near" can miss everything (llama, PROMPTS[1], chains: 0); over the three
    # prompts it was accepted 15 to 105 times per run.
    assert accepted["near"] > 0, f"near {label} accepted nothing on any prompt"


@pytest.mark.parametrize("window", range(1, 9))
def test_chain_equals_target_only(models, window):
    assert_equal_and_accepted(models, f"γ={window}", window=window)


@pytest.mark.parametrize("shape", TREES, ids=str)
def test_tree_equals_target_only(models, shape):
    assert_equal_and_accepted(models, str(shape), tree=shape)


def test_near_draft_is_accepted_often_so_the_test_exercises_acceptance(models):
    # Guards the test itself: a draft that is never accepted would make equality trivial.
    target, drafts = models
    stats = speculative_generate(Target(target), drafts["near"], PROMPTS[2], NEW_TOKENS, GREEDY, window=4).stats
    assert 0.2 < stats.acceptance_rate, stats.summary()


@pytest.fixture(scope="module")
def fused():
    """An EAGLE-3 head fusing two layers of a 3-layer Llama (an HSR head's layer is a copy of a
    Llama layer, so Llama only; a 2-layer target has one layer to tap), briefly trained so that
    its tokens are accepted and the equality covers accepted steps."""
    target = tiny_model("llama", seed=0, layers=3)
    return target, HSRDraft("eagle3", one_thread(lambda: trained_hsr_head(target, steps=100, unroll=3, layers=FUSED_LAYERS)))


def assert_fused_equal(fused, label: str, **speculation) -> None:
    target, draft = fused
    accepted = 0
    for prompt in PROMPTS:
        got = speculative_generate(Target(target), draft, prompt, NEW_TOKENS, GREEDY, **speculation)
        assert_greedy_equal(target, prompt, got.token_ids, reference(target, prompt), f"eagle3 {label}")
        accepted += got.stats.accepted
    assert accepted > 0, f"eagle3 {label} accepted nothing on any prompt"


@pytest.mark.parametrize("window", range(1, 9))
def test_fused_hsr_chain_equals_target_only(fused, window):
    assert_fused_equal(fused, f"γ={window}", window=window)


@pytest.mark.parametrize("shape", TREES, ids=str)
def test_fused_hsr_tree_equals_target_only(fused, shape):
    assert_fused_equal(fused, str(shape), tree=shape)
