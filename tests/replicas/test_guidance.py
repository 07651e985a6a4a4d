"""Classifier-free guidance through the batched speculative engine: a guided request's
unconditional row is verified beside it in the same forward, and its tokens are exactly the plain
guided decoder's (``imagegen.generate``) under greedy decoding, and distributed as LlamaGen's
guided distribution under sampling, with chains and trees, beside unguided requests."""

import pytest
import torch
from transformers import LlamaForCausalLM

from chi_square import chi_square_pvalue
from specserve.replicas.drafts.draft_lm import DraftLM
from specserve.replicas.drafts.prompt_lookup import PromptLookupDraft
from specserve.replicas.engine import in_process_server, run_batch
from specserve.replicas.imagegen import ImagegenLayout, generate, guided_logits
from specserve.replicas.request import Guidance, SpecRequest
from specserve.replicas.sampling import SamplingParams, logits_to_probs
from specserve.replicas.scheduler import Scheduler
from specserve.replicas.request import StaticPolicy
from specserve.replicas.step import TreeShape
from specserve.replicas.target import Target
from tiny_models import DEVICE, tiny_generator

LAYOUT = ImagegenLayout(codebook_size=24, classes=5)
GREEDY = SamplingParams()
TOKENS = 24
SCALE = 3.0


def generator(seed: int, noise: float = 0.0, source=None) -> LlamaForCausalLM:
    """A tiny class-conditional generator; with ``source``, its weights plus noise (a draft that
    agrees with it often but not always)."""
    model = tiny_generator(LAYOUT, hidden=64, heads=4, kv_heads=2, context=128, scale=6.0 if source is None else 1.0,
                           seed=seed)
    if source is not None:
        with torch.no_grad():
            model.load_state_dict(source.state_dict())
            gen = torch.Generator().manual_seed(seed)
            for param in model.parameters():
                param.add_(torch.randn(param.shape, generator=gen) * noise * param.std())
    return model.to(DEVICE)


@pytest.fixture(scope="module")
def models():
    target = generator(0)
    return target, {"near": DraftLM("near", generator(1, 0.3, target)), "prompt-lookup": PromptLookupDraft()}


def guided_request(label: int, request_id: str, draft: str = "none", window: int = 0, tree=None,
                   params: SamplingParams = GREEDY, tokens: int = TOKENS) -> SpecRequest:
    return SpecRequest([LAYOUT.class_token(label)], tokens, params, draft, window, tree, request_id,
                       guidance=Guidance((LAYOUT.unconditional,), SCALE, LAYOUT.codebook_size))


@pytest.mark.parametrize("speculation", [dict(window=3), dict(window=6), dict(tree=TreeShape(3, 2, 6))],
                         ids=["chain-3", "chain-6", "tree"])
def test_guided_greedy_output_is_the_plain_guided_decoders(models, speculation):
    target, drafts = models
    servers = {name: in_process_server(name, draft) for name, draft in drafts.items()}
    labels = [0, 3, 4, 1]
    expected = generate(target, LAYOUT, labels, TOKENS, cfg_scale=SCALE)
    requests = [guided_request(label, f"g{i}", "near" if i % 2 == 0 else "prompt-lookup", **speculation)
                for i, label in enumerate(labels)]
    # Unguided requests share the steps: a text-like prompt, decoded plainly by the same model.
    requests.insert(1, SpecRequest([LAYOUT.class_token(2), 5, 6, 7], 10, GREEDY, "near", 3, None, "plain"))
    gens = run_batch(Target(target, slots=10), servers, requests)
    guided = [g for g, r in zip(gens, requests) if r.guidance is not None]
    for i, gen in enumerate(guided):
        assert gen.token_ids == expected[i].tolist(), f"picture {i}: guided output left the plain decoder's"
    assert sum(gen.stats.accepted for gen in guided[::2]) > 0, "the near draft was never accepted"
    plain = run_batch(Target(target, slots=2), {}, [SpecRequest([LAYOUT.class_token(2), 5, 6, 7], 10, request_id="p")])
    assert gens[1].token_ids == plain[0].token_ids


def test_a_guided_request_holds_two_slots_and_frees_both(models):
    target, _ = models
    scheduler = Scheduler(Target(target, slots=3), StaticPolicy())
    state = scheduler.add(guided_request(1, "g"))
    scheduler.add(guided_request(2, "h"))   # needs two more slots: waits
    plan = scheduler.plan()
    assert scheduler.running == [state] and {state.slot, state.guide_slot} == {0, 1}
    assert len(scheduler.waiting) == 1 and [s for s, _ in plan.prefill] + plan.decode == [state]
    state.finish("abort")
    scheduler.plan()
    assert [s.id for s in scheduler.running] == ["h"]
    with pytest.raises(ValueError, match="two rows"):
        Scheduler(Target(target, slots=1), StaticPolicy()).add(guided_request(0, "x"))


def exact_joint(model, label: int, params: SamplingParams) -> torch.Tensor:
    """[V, V]: P(t1) P(t2 | t1) under the guided, warped distributions."""
    V = LAYOUT.vocab_size
    cond, uncond = LAYOUT.class_token(label), LAYOUT.unconditional
    with torch.inference_mode():
        def guided(rows_c, rows_u):
            c = model(torch.tensor(rows_c, device=DEVICE)).logits[:, -1]
            u = model(torch.tensor(rows_u, device=DEVICE)).logits[:, -1]
            return logits_to_probs(guided_logits(c, u, SCALE, LAYOUT.codebook_size), params).cpu()
        first = guided([[cond]], [[uncond]])[0]
        second = guided([[cond, t] for t in range(V)], [[uncond, t] for t in range(V)])
    return first[:, None] * second


@pytest.mark.parametrize("speculation", [dict(window=1), dict(tree=TreeShape(2, 2, 4))], ids=["bonus", "tree"])
def test_guided_samples_follow_the_guided_distribution(models, speculation):
    target, drafts = models
    params = SamplingParams(temperature=1.0, top_k=12)
    runs = 1500
    requests = [guided_request(2, f"s{seed}", "near", params=SamplingParams(1.0, top_k=12, seed=seed), tokens=2,
                               **speculation) for seed in range(runs)]
    gens = run_batch(Target(target, slots=16), {"near": in_process_server("near", drafts["near"])}, requests)
    counts = torch.zeros(LAYOUT.vocab_size, LAYOUT.vocab_size)
    for gen in gens:
        counts[gen.token_ids[0], gen.token_ids[1]] += 1
    pvalue = chi_square_pvalue(counts, exact_joint(target, 2, params))
    assert pvalue > 1e-3, f"chi-square p={pvalue:.2e}"
    assert sum(gen.stats.accepted for gen in gens) > runs // 20


def test_a_guided_continuation_resumes_both_rows_where_its_output_ended(models):
    """A replica failed after 9 tokens: the continuation's prompt holds them (``resumed_tokens``),
    and its unconditional row is the unconditional prompt plus the same 9."""
    target, drafts = models
    whole = generate(target, LAYOUT, [3], TOKENS, cfg_scale=SCALE)[0].tolist()
    first = guided_request(3, "c")
    rest = SpecRequest(first.prompt_ids + whole[:9], TOKENS - 9, GREEDY, "near", 3, None, "c-r1",
                       resumed_tokens=9, guidance=first.guidance)
    got = run_batch(Target(target, slots=4), {"near": in_process_server("near", drafts["near"])}, [rest])[0]
    assert got.token_ids == whole[9:]


def test_a_tree_near_the_end_of_the_context_keeps_its_nodes_within_the_cache(models):
    """The generator's context is 128 positions: a picture of 120 tokens under a 40-node tree
    would need more near its end. Its trees shrink to what the slots hold; the output is exact."""
    target, drafts = models
    whole = generate(target, LAYOUT, [1], 120, cfg_scale=SCALE)[0].tolist()
    request = guided_request(1, "long", "near", tree=TreeShape(4, 4, 40), tokens=120)
    got = run_batch(Target(target, slots=4), {"near": in_process_server("near", drafts["near"])}, [request])[0]
    assert got.token_ids == whole and got.finish_reason == "length"
    assert min(budget for _, _, budget in got.stats.trees) < 40   # the last trees were cut to fit
