"""The hidden-state-reuse head: training computes what inference computes, the target hands it
its hidden states (in-process, through ``Target.features``), a trained head agrees with the
target far beyond chance, and nothing it proposes changes the greedy output."""

import pytest
import torch

from equality import assert_greedy_equal
from specserve.replicas.drafts.factory import draft_from_model
from specserve.replicas.drafts.hsr_draft import HSRDraft, MissingFeatures
from specserve.replicas.drafts.hsr_head import HSRHead, build_hsr_head
from specserve.replicas.model_store import load_causal_lm
from specserve.replicas.sampling import SamplingParams
from specserve.replicas.step import Proposal, TreeShape
from specserve.replicas.target import Target
from specserve.replicas.engine import speculative_generate
from specserve.training.hsr_train import step_matches_inference
from tiny_hsr import save_tiny_pair, trained_hsr_head
from tiny_models import VOCAB, tiny_model

GREEDY = SamplingParams()
PROMPTS = [[5, 6, 7, 8, 5, 6, 9, 10, 11, 5, 6], list(range(20, 50)), [3]]


@pytest.fixture(scope="module")
def target():
    return tiny_model("llama", seed=0, layers=3)


@pytest.fixture(scope="module")
def head(target):
    return trained_hsr_head(target)


def states(target, tokens: list[int]) -> torch.Tensor:
    with torch.inference_mode():
        return target(torch.tensor([tokens], device=target.device), output_hidden_states=True).hidden_states[-2][0]


def test_a_first_feed_is_causal_over_its_own_positions(target, head):
    """Without a cache a feed runs the fused kernels' causal attention: what the explicit mask
    of each position seeing itself and those before gives."""
    tokens = list(range(30, 50))
    z = head.inputs(torch.tensor([tokens[1:]], device=head.device), states(target, tokens)[None, :-1])
    positions = torch.arange(1, len(tokens), device=head.device)
    causal = torch.ones(len(positions), len(positions), dtype=torch.bool, device=head.device).tril()
    with torch.inference_mode():
        fed, masked = head.step(z, positions, None, None), head.step(z, positions, None, None, causal)
        shifted = head.step(z, positions, None, None, causal.roll(1, 1))
    for a, b in zip(fed, masked):
        torch.testing.assert_close(a, b, rtol=0, atol=1e-5)
    assert not torch.allclose(fed[0], shifted[0], atol=1e-3)   # the mask matters here


@pytest.mark.parametrize("drafted", [1, 2, 3])
@pytest.mark.parametrize("exact", [1, 6, 17])
@pytest.mark.slow
def test_unrolled_training_computes_what_drafting_computes(target, head, exact, drafted):
    tokens = list(range(30, 54))
    assert step_matches_inference(head, tokens, states(target, tokens), exact, drafted) < 1e-4


def test_the_target_keeps_the_states_of_exactly_its_cached_positions(target):
    t = Target(target)
    prompt = PROMPTS[0]
    result = t.verify_one(prompt, Proposal.chain([1, 2, 3]), GREEDY)
    context = prompt + result.emitted_tokens
    kept = t.features(context)
    assert len(kept) == len(context) - 1 == len(t.kv.tokens[0])
    assert torch.allclose(kept, states(target, context[:-1]), atol=1e-5)


@pytest.mark.slow
def test_first_step_proposes_nothing_and_stale_states_are_asked_for_again(head):
    draft = HSRDraft("hsr", head)
    assert draft.propose([1, 2, 3], 3, GREEDY, None).tokens == []      # no target states yet
    rows = torch.zeros(5, head.config.hidden_size)
    draft.propose(list(range(1, 7)), 3, GREEDY, None, features=rows, features_start=0)
    fresh = HSRDraft("hsr", head)   # another replica: it holds nothing for this session
    with pytest.raises(MissingFeatures) as err:
        fresh.propose(list(range(1, 9)), 3, GREEDY, None, features=rows[:2], features_start=5)
    assert err.value.have == 0


@pytest.mark.slow
def test_a_trained_head_reads_the_targets_states(target, head):
    untrained = build_hsr_head(target, list(range(VOCAB))).eval()
    rates = {}
    for name, h in (("trained", head), ("untrained", untrained)):
        accepted = proposed = 0
        for seed in range(4):
            prompt = torch.randint(1, VOCAB, (6,), generator=torch.Generator().manual_seed(100 + seed)).tolist()
            gen = speculative_generate(Target(target), HSRDraft("h", h), prompt, 40, GREEDY, window=3)
            accepted += gen.stats.accepted
            proposed += gen.stats.accepted + gen.stats.rejections
        rates[name] = accepted / proposed
    # Untrained, FC = [0 | I] and the target's last layer already echo the target's previous
    # prediction, which a tiny random model's repetitive output often matches.
    assert rates["trained"] > 0.45 and rates["trained"] > rates["untrained"] + 0.1, rates


@pytest.mark.parametrize("window", [1, 2, 4, 7])
@pytest.mark.slow
def test_chain_equals_target_only(target, head, window):
    for prompt in PROMPTS:
        expected = speculative_generate(Target(target), None, prompt, 40, GREEDY).token_ids
        got = speculative_generate(Target(target), HSRDraft("h", head), prompt, 40, GREEDY, window=window)
        assert_greedy_equal(target, prompt, got.token_ids, expected, f"hsr γ={window}")
        assert got.stats.accepted > 0 or len(prompt) == 1


@pytest.mark.parametrize("shape", [TreeShape(3, 2, 6), TreeShape(5, 3, 12), TreeShape(4, 4, 30)], ids=str)
@pytest.mark.slow
def test_tree_equals_target_only(target, head, shape):
    for prompt in PROMPTS:
        expected = speculative_generate(Target(target), None, prompt, 40, GREEDY).token_ids
        got = speculative_generate(Target(target), HSRDraft("h", head), prompt, 40, GREEDY, tree=shape)
        assert_greedy_equal(target, prompt, got.token_ids, expected, f"hsr tree {shape}")


@pytest.mark.slow
def test_saved_without_embeddings_loads_by_folder_as_an_hsr_draft(target, head, tmp_path):
    folder = save_tiny_pair(target, head, tmp_path)
    from safetensors import safe_open
    with safe_open(str(next(folder.glob("*.safetensors"))), framework="pt") as saved:
        assert "embed_tokens.weight" not in saved.keys() and "fc.weight" in saved.keys()
    loaded = load_causal_lm(str(folder), dtype="float32", device="cpu")
    assert isinstance(loaded.model, HSRHead)
    assert torch.equal(loaded.model.embed_tokens.weight, target.get_input_embeddings().weight.cpu())
    draft = draft_from_model("h", loaded.model)
    assert isinstance(draft, HSRDraft)
    prompt = PROMPTS[0]
    expected = speculative_generate(Target(target), HSRDraft("h", head.half().float()), prompt, 30, GREEDY, window=3)
    got = speculative_generate(Target(target), draft, prompt, 30, GREEDY, window=3)
    assert got.token_ids == expected.token_ids
    assert got.stats.accepted == expected.stats.accepted
