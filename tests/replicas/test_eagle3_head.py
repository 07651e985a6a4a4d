"""An EAGLE-3 head reads several of the target's layers: the target keeps exactly transformers'
hidden states of those layers, side by side, for every cached position (flat and padded
forwards alike); training computes what drafting computes through the fusion; a draft server
tells the target which layers, and the step loop taps them before the first prompt is read; a
single-layer head (the shipped ``smollm2-hsr``) is what it was."""

import asyncio
import copy

import pytest
import torch

from specserve.replicas.cost_probe import draft_ms_per_position
from specserve.replicas.draft_server import DraftServer
from specserve.replicas.drafts import hsr_forward
from specserve.replicas.drafts.hsr_draft import HSRDraft
from specserve.replicas.drafts.hsr_head import (
    HSRConfig, HSRHead, build_hsr_head, decoder_layer, feature_layers, stack_features,
)
from specserve.replicas.engine import speculative_generate
from specserve.replicas.model_store import zoo_dir
from specserve.replicas.model_worker import InlineWorker
from specserve.replicas.request import SpecRequest, StaticPolicy
from specserve.replicas.sampling import SamplingParams
from specserve.replicas.scheduler import Scheduler
from specserve.replicas.step import Proposal
from specserve.replicas.step_loop import StepLoop
from specserve.replicas.target import Target
from specserve.training.hsr_train import step_matches_inference
from tiny_hsr import FUSED_LAYERS, save_tiny_pair
from tiny_models import VOCAB, tiny_model

GREEDY = SamplingParams()
PROMPT = [5, 6, 7, 8, 5, 6, 9, 10, 11, 5, 6]


@pytest.fixture(scope="module")
def target():
    return tiny_model("llama", seed=0, layers=3)


@pytest.fixture(scope="module")
def head(target):
    """A fusing head whose fusion is not the identity on one layer: random weights show whether
    every layer's state reaches it (training changes nothing the equalities below depend on)."""
    head = build_hsr_head(target, list(range(VOCAB)), FUSED_LAYERS).eval()
    with torch.no_grad():
        head.fuse.weight.normal_(std=0.1, generator=torch.Generator().manual_seed(0))
    return head


def hidden_states(model, tokens: list[int]) -> tuple[torch.Tensor, ...]:
    with torch.inference_mode():
        return model(torch.tensor([tokens], device=model.device), output_hidden_states=True).hidden_states


def test_hidden_state_indices_name_decoder_layers():
    # transformers' tuple: embeddings, layers 0..L-2's outputs, then the last layer's after the norm.
    assert [decoder_layer(i, 30) for i in (1, 2, 15, 29, -2, -30)] == [0, 1, 14, 28, 28, 0]
    for no_layer in (0, -1, 30, 31, -31):
        with pytest.raises(ValueError, match="not a decoder layer's output"):
            decoder_layer(no_layer, 30)


def test_the_target_keeps_the_layers_side_by_side_as_transformers_computes_them(target):
    t = Target(target, slots=2)
    assert t.tap_features(FUSED_LAYERS)
    # 80 prompt tokens prefill in one chunk on the padded path (over cpu_attention's 64), the
    # verify step then runs flat: both must keep every tapped layer.
    prompt = torch.randint(1, VOCAB, (80,), generator=torch.Generator().manual_seed(1)).tolist()
    t.prefill(1, prompt[:-1], chunk=128, next_token=prompt[-1])
    result = t.verify_one(prompt, Proposal.chain([3, 4, 5]), GREEDY, slot=1)
    context = prompt + result.emitted_tokens
    hidden = hidden_states(target, context[:-1])
    kept = t.features(context, slot=1, layers=FUSED_LAYERS)
    assert kept.shape == (len(context) - 1, 2 * target.config.hidden_size)
    assert torch.allclose(kept, stack_features(hidden, FUSED_LAYERS)[0], atol=1e-5)
    # The single layer a Sparrow-style head reads is still there, as it was (a view, no copy).
    assert torch.allclose(t.features(context, slot=1), hidden[-2][0], atol=1e-5)
    assert torch.allclose(t.features(context, 4, 1, layers=[-2, 1]), stack_features(hidden, [-2, 1])[0, 4:], atol=1e-5)


def test_after_a_tree_verify_the_target_keeps_its_accepted_branchs_states(target):
    """The accepted path of a tree skips its rejected sibling: the states kept are those of the
    path's own positions, as transformers computes them for the context it makes."""
    t = Target(target, slots=1)
    assert t.tap_features(FUSED_LAYERS)
    prompt = torch.randint(1, VOCAB, (20,), generator=torch.Generator().manual_seed(2)).tolist()
    first = t.verify_one(prompt, Proposal.empty(), GREEDY).emitted_tokens[0]
    context = prompt + [first]
    greedy = target.generate(torch.tensor([context]), max_new_tokens=2, do_sample=False)[0, len(context):].tolist()
    wrong = (greedy[0] + 1) % VOCAB or 1
    # node 0: a wrong child of the root; node 1: the target's token; node 2: its next, under node 1
    result = t.verify_one(context, Proposal(tokens=[wrong, greedy[0], greedy[1]], parents=[-1, -1, 1]), GREEDY)
    assert result.accepted_path == [1, 2]
    context += result.emitted_tokens
    kept = t.features(context, layers=FUSED_LAYERS)
    assert kept.shape[0] == len(context) - 1
    assert torch.allclose(kept, stack_features(hidden_states(target, context[:-1]), FUSED_LAYERS)[0], atol=1e-5)


def test_a_layer_tapped_late_has_no_rows_until_a_slot_is_read_from_the_start(target):
    t = Target(target)   # taps -2 only
    t.verify_one(PROMPT, Proposal.empty(), GREEDY)
    t.tap_features([1])
    context = PROMPT + t.verify_one(PROMPT + [7], Proposal.empty(), GREEDY).emitted_tokens
    assert t.features(context, layers=[1]) is None        # earlier positions were never kept
    t.kv.reset(0)
    t.verify_one(PROMPT, Proposal.empty(), GREEDY)
    assert torch.allclose(t.features(PROMPT + [1], layers=[1]), hidden_states(target, PROMPT)[1][0], atol=1e-5)


@pytest.mark.parametrize("drafted", [1, 2, 4])
@pytest.mark.parametrize("exact", [1, 6, 17])
def test_unrolled_training_computes_what_drafting_computes_through_the_fusion(target, head, exact, drafted):
    tokens = list(range(30, 54))
    features = stack_features(hidden_states(target, tokens), FUSED_LAYERS)[0]
    assert step_matches_inference(head, tokens, features, exact, drafted) < 1e-4


def test_a_head_refuses_features_of_another_width(head):
    draft = HSRDraft("e3", head)
    rows = torch.zeros(5, head.config.hidden_size)   # one layer's width, two expected
    with pytest.raises(ValueError, match="this head reads 128"):
        draft.propose(list(range(1, 7)), 3, GREEDY, None, features=rows, features_start=0)


def test_the_fusion_starts_as_the_deepest_layer_alone(target):
    head = build_hsr_head(target, list(range(VOCAB)), FUSED_LAYERS)
    h = target.config.hidden_size
    x = torch.randn(3, 2 * h)
    # [1, -2] on 3 layers: layers 0 and 1; -2 (layer 1) is the deepest, the single-layer head's input.
    assert torch.equal(head.fused(x), x[:, h:])


def test_the_packed_fusion_computes_what_the_module_computes(head):
    half = copy.deepcopy(head).to(torch.bfloat16)
    x = torch.randn(5, half.features_size, generator=torch.Generator().manual_seed(2)).to(torch.bfloat16)
    with torch.inference_mode():
        if hsr_forward.for_head(half) is None:
            pytest.skip("no packed path here (no oneDNN or no C compiler for the row kernels)")
        packed = half.fused(x)
    with torch.no_grad():
        module = half.fuse(x)
    # Within bfloat16's rounding: oneDNN sums in another order than torch.
    assert torch.allclose(packed.float(), module.float(), rtol=0.01, atol=0.01 * float(module.float().abs().max()))


def test_the_shipped_single_layer_head_reads_one_layer_and_has_no_fusion():
    config = HSRConfig.from_pretrained(zoo_dir() / "smollm2-hsr")
    assert config.feature_layers is None and feature_layers(config) == [-2]
    tiny = HSRConfig(vocab_size=VOCAB, hidden_size=64, intermediate_size=128, num_attention_heads=4,
                     num_key_value_heads=2, head_token_ids=list(range(8)))
    assert HSRHead(tiny).fuse is None and HSRHead(tiny).features_size == 64


def test_a_fusing_config_round_trips(tmp_path):
    config = HSRConfig(vocab_size=VOCAB, hidden_size=64, intermediate_size=128, num_attention_heads=4,
                       num_key_value_heads=2, head_token_ids=list(range(8)), feature_layers=[2, 15, -2])
    config.save_pretrained(tmp_path)
    again = HSRConfig.from_pretrained(tmp_path)
    assert feature_layers(again) == [2, 15, -2]
    assert HSRHead(again).fuse.weight.shape == (64, 3 * 64) and HSRHead(again).features_size == 192
    with pytest.raises(ValueError, match="distinct"):
        HSRConfig(feature_layers=[2, 2])


@pytest.fixture(scope="module")
def saved_head(target, head, tmp_path_factory):
    return save_tiny_pair(target, head, tmp_path_factory.mktemp("eagle3"))


def test_a_draft_server_names_its_layers_and_the_loop_taps_them_before_the_first_prefill(target, head, saved_head):
    server = DraftServer("e3", str(saved_head), dtype="float32")
    info = asyncio.run(server.info())
    assert info["needs_features"] and info["feature_layers"] == FUSED_LAYERS
    assert server.features_size == 2 * target.config.hidden_size
    # The start-up cost probe sends rows of that width (random: the cost does not depend on them).
    assert draft_ms_per_position(server.propose_now, VOCAB, server.features_size) >= 0
    expected = speculative_generate(Target(target), None, PROMPT, 16, GREEDY).token_ids
    t = Target(target)   # taps -2 only: the loop must add layer 1 before the prompt is read
    loop = StepLoop(Scheduler(t, StaticPolicy()), {"e3": server}, InlineWorker())
    state = loop.add(SpecRequest(PROMPT, 16, GREEDY, "e3", 3, None, "s"))
    asyncio.run(loop.run_until_idle())
    assert state.out == expected
    # A full window from the first decoding step on: the prompt's states of both layers were kept
    # (a layer tapped after the prefill would leave this request without states to the end).
    assert state.stats.windows[0] == 3 and min(state.stats.windows[:-1]) > 0, state.stats.windows
    assert t.features(PROMPT, layers=FUSED_LAYERS).shape == (len(PROMPT) - 1, 2 * target.config.hidden_size)


def test_a_draft_reading_layers_the_target_lacks_decodes_plainly(saved_head):
    shallow = tiny_model("llama", seed=0, layers=2)   # hidden_states[1] and [-2] are its only layer
    deep_head = build_hsr_head(tiny_model("llama", seed=0, layers=4), list(range(VOCAB)), [3, -2])
    folder = save_tiny_pair(tiny_model("llama", seed=0, layers=4), deep_head, saved_head.parent / "deep")
    server = DraftServer("deep", str(folder), dtype="float32")
    expected = speculative_generate(Target(shallow), None, PROMPT, 12, GREEDY).token_ids
    loop = StepLoop(Scheduler(Target(shallow), StaticPolicy()), {"deep": server}, InlineWorker())
    state = loop.add(SpecRequest(PROMPT, 12, GREEDY, "deep", 3, None, "s"))
    asyncio.run(loop.run_until_idle())
    assert state.out == expected and max(state.stats.windows) == 0
    assert asyncio.run(loop.draft_info("deep")) is None   # disabled once, not asked again
