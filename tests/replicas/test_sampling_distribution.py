"""End to end on a tiny model: with speculation, the first two generated tokens are distributed
exactly as under the target alone, with every request sharing its steps' forwards with 15 others
(the batched scheduler, as served).

The exact joint ``P(t1, t2)`` is computed from the target's warped distributions; speculative
samples are compared with it by a chi-square goodness-of-fit test (cells with an expected count
below 5 pooled), fixed seeds, so the test is deterministic. A wrong acceptance rule (e.g.
accepting greedy draft tokens with ``min(1, p/q)`` of the draft's softmax) fails it by a wide
margin. The ``bonus-`` cases draft one token and stop at two: whenever the draft token is
accepted, the second token is the bonus token drawn after a fully accepted proposal.
"""

import pytest
import torch

from chi_square import chi_square_pvalue
from specserve.replicas.drafts.draft_lm import DraftLM
from specserve.replicas.drafts.hsr_draft import HSRDraft
from specserve.replicas.drafts.prompt_lookup import PromptLookupDraft
from specserve.replicas.drafts.suffix import SuffixDraft
from specserve.replicas.sampling import SamplingParams, logits_to_probs
from specserve.replicas.step import TreeShape
from specserve.replicas.target import Target
from specserve.replicas.request import SpecRequest
from specserve.replicas.engine import in_process_server, run_batch
from tiny_hsr import FUSED_LAYERS, one_thread, trained_hsr_head
from tiny_models import VOCAB, perturbed, pruned_copy, tiny_model

RUNS = 3000
BATCH = 16


def lookup_friendly_prompt(model) -> list[int]:
    """``seed + (the target's greedy continuation) + seed``: prompt lookup then proposes the
    target's own likely tokens, so its acceptance path is exercised under sampling too."""
    seed = [4, 9]
    with torch.inference_mode():
        out = model.generate(torch.tensor([seed], device=model.device), max_new_tokens=4, do_sample=False)[0].tolist()
    return out + seed


def exact_joint(model, prompt: list[int], params: SamplingParams) -> torch.Tensor:
    """[V, V] on the CPU: P(t1) P(t2 | t1) under the target's warped distributions."""
    with torch.inference_mode():
        first = logits_to_probs(model(torch.tensor([prompt], device=model.device)).logits[0, -1], params)
        batch = torch.tensor([prompt + [t] for t in range(VOCAB)], device=model.device)
        second = logits_to_probs(model(batch).logits[:, -1], params)
    return (first[:, None] * second).cpu()


@pytest.fixture(scope="module")
def target():
    model = tiny_model("llama", seed=0)
    return model, lookup_friendly_prompt(model)


@pytest.fixture(scope="module")
def hsr_head(target):
    return trained_hsr_head(target[0])


@pytest.fixture(scope="module")
def deep_target():
    """For the EAGLE-3 head, which fuses two layers: a 2-layer target has one layer to tap."""
    model = tiny_model("llama", seed=0, layers=3)
    return model, lookup_friendly_prompt(model)


@pytest.fixture(scope="module")
def fused_head(deep_target):
    return one_thread(lambda: trained_hsr_head(deep_target[0], layers=FUSED_LAYERS))


@pytest.mark.parametrize(
    "case",
    ["plain", "draft-lm-chain", "draft-lm-tree", "prompt-lookup-chain", "prompt-lookup-tree", "suffix-tree", "suffix-chain", "pruned-head-chain",
     "hsr-chain", "hsr-tree", "hsr-fused-chain", "hsr-fused-tree", "bonus-draft-lm-chain", "bonus-prompt-lookup-chain",
     "tabed-chain", "tabed-pruned-head-chain"],
)
@pytest.mark.parametrize("params", [SamplingParams(temperature=1.0), SamplingParams(temperature=0.8, top_p=0.9, top_k=20)], ids=["t1", "warped"])
@pytest.mark.slow
def test_first_two_tokens_follow_the_target(request, target, hsr_head, case, params):
    target, prompt = target
    draft = {
        "plain": None,
        "draft-lm-chain": DraftLM("near", perturbed(target, seed=1)),
        "draft-lm-tree": DraftLM("near", perturbed(target, seed=1)),
        "prompt-lookup-chain": PromptLookupDraft(),
        "prompt-lookup-tree": PromptLookupDraft(),
        "suffix-tree": SuffixDraft(),
        # A chain ask: the suffix draft spends its window's nodes best-first, a tree where it branches.
        "suffix-chain": SuffixDraft(),
        # q = 0 on every odd token: the residual max(0, p - q) must give them their mass.
        "pruned-head-chain": DraftLM("pruned", pruned_copy(target, head=list(range(0, VOCAB, 2)))),
        # Reads the target's hidden states, which the prefill already gives it: it drafts from step 1.
        "hsr-chain": HSRDraft("hsr", hsr_head),
        "hsr-tree": HSRDraft("hsr", hsr_head),
        # EAGLE-3: the target's states of two layers, side by side, fused by the head.
        "hsr-fused-chain": lambda: HSRDraft("eagle3", request.getfixturevalue("fused_head")),
        "hsr-fused-tree": lambda: HSRDraft("eagle3", request.getfixturevalue("fused_head")),
        "bonus-draft-lm-chain": DraftLM("near", perturbed(target, seed=1)),
        # TABED: two views of the draft LM (the whole prompt, and from its last [4, 9] on) mixed.
        "tabed-chain": DraftLM("tabed", perturbed(target, seed=1)),
        # ... and over a pruned head's tokens only (q = 0 on every odd token in every view).
        "tabed-pruned-head-chain": DraftLM("tabed", pruned_copy(perturbed(target, seed=1), list(range(0, VOCAB, 2)))),
        "bonus-prompt-lookup-chain": PromptLookupDraft(),
    }[case]
    if "fused" in case:   # its target and head are built for its own cases only
        target, prompt = request.getfixturevalue("deep_target")
        draft = draft()
    tree = TreeShape(2, 3, 6) if case.endswith("tree") else None
    # max_tokens = window + 1: room for a full window, so the second token can be a draft token
    # (window 2) or the bonus token after an accepted one (window 1).
    window = 1 if case.startswith("bonus-") else 2
    ensemble = {"turn_marker": [4, 9]} if case.startswith("tabed") else None
    pvalue, accepted = goodness_of_fit(target, prompt, draft, params, tree, range(RUNS), window, ensemble)
    if pvalue <= 1e-3:
        # Seeds are fixed, so a correct sampler still fails 1 case in 1,000 by chance, once and
        # for all. A second, disjoint block decides: a real bias fails both by a wide margin.
        pvalue, accepted = goodness_of_fit(target, prompt, draft, params, tree, range(RUNS, 2 * RUNS), window,
                                           ensemble)
    assert pvalue > 1e-3, f"{case}: chi-square p={pvalue:.2e} on two disjoint blocks of seeds"
    if draft is not None:   # the test means something only if draft tokens were accepted
        assert accepted > RUNS // 20, f"{case}: only {accepted} accepted draft tokens"


def goodness_of_fit(target, prompt, draft, params, tree, seeds, window: int, ensemble: dict | None = None,
                    seeded: bool = True) -> tuple[float, int]:
    """Chi-square p-value of the sampled (t1, t2) pairs against the exact joint, and the number
    of accepted draft tokens. One request per seed, all through one batched scheduler.
    ``ensemble``: the draft LM's chains as a TABED ensemble with these settings. ``seeded=False``:
    the requests name no seed, each drawing from a generator of fresh entropy (not reproducible:
    a correct sampler fails two blocks about once in a million runs)."""
    name = "none" if draft is None else draft.name
    servers = {} if draft is None else {name: in_process_server(name, draft, ensemble)}
    requests = [SpecRequest(prompt, window + 1, SamplingParams(params.temperature, params.top_p, params.top_k,
                                                               seed=seed if seeded else None),
                            name, window, tree, f"seed-{seed}") for seed in seeds]
    gens = run_batch(Target(target, slots=BATCH), servers, requests)
    counts = torch.zeros(VOCAB, VOCAB)
    accepted = 0
    for gen in gens:
        counts[gen.token_ids[0], gen.token_ids[1]] += 1
        accepted += gen.stats.accepted
    return chi_square_pvalue(counts, exact_joint(target, prompt, params)), accepted


@pytest.mark.parametrize("case", ["plain", "draft-lm-tree", "prompt-lookup-chain", "hsr-tree"])
@pytest.mark.slow
def test_rows_drawn_before_the_walk_keep_the_first_two_tokens_the_targets(monkeypatch, target, hsr_head, case):
    """Unseeded point-mass requests with every row drawn beforehand, all requests' draws read at
    once (``sampled_choices``, the path off the CPU), forced here on the CPU."""
    import specserve.replicas.target as target_module
    from specserve.replicas import rejection_sampler

    calls = []

    def counted(rows, params, generators, depth_draws):
        calls.append(len(rows))
        return rejection_sampler.sampled_choices(rows, params, generators, depth_draws)

    monkeypatch.setattr(target_module, "draws_every_row", lambda rows: True)
    monkeypatch.setattr(target_module, "sampled_choices", counted)
    model, prompt = target
    draft = {"plain": None, "draft-lm-tree": DraftLM("near", perturbed(model, seed=1)),
             "prompt-lookup-chain": PromptLookupDraft(), "hsr-tree": HSRDraft("hsr", hsr_head)}[case]
    tree = TreeShape(2, 3, 6) if case.endswith("tree") else None
    params = SamplingParams(temperature=0.8, top_p=0.9, top_k=20)
    pvalue, accepted = goodness_of_fit(model, prompt, draft, params, tree, range(RUNS), 2, seeded=False)
    if pvalue <= 1e-3:   # as in the seeded test: a second, disjoint block decides
        pvalue, accepted = goodness_of_fit(model, prompt, draft, params, tree, range(RUNS, 2 * RUNS), 2,
                                           seeded=False)
    assert pvalue > 1e-3, f"{case}: chi-square p={pvalue:.2e} on two disjoint blocks"
    assert max(calls) >= BATCH // 2, calls   # many requests' draws read at once
    if draft is not None:
        assert accepted > RUNS // 20, f"{case}: only {accepted} accepted draft tokens"


@pytest.mark.parametrize("make, window, tree", [
    (lambda model: PromptLookupDraft(), 4, None),
    (lambda model: DraftLM("near", perturbed(model, seed=1, noise=0.1)), 0, TreeShape(depth=3, top_k=3, budget=8)),
], ids=["prompt-lookup-chain", "draft-lm-tree"])
@pytest.mark.parametrize("beforehand", [False, True], ids=["drawn-on-arrival", "drawn-beforehand"])
def test_a_seeded_request_with_a_point_mass_draft_emits_target_onlys_tokens(monkeypatch, target, make, window, tree,
                                                                            beforehand):
    """Point-mass proposals are verified by drawing each row's token from the target's p, as
    target-only decoding draws it, and following the child equal to it: the same seed emits the
    same tokens, proposals accepted or not (float32, where verifying several rows rounds as one).
    Drawn beforehand (the path off the CPU, forced here): one draw per depth in target-only's
    order, the draws past the walk taken back (``DepthDraws``)."""
    import specserve.replicas.target as target_module
    from specserve.replicas.engine import speculative_generate

    made = []
    if beforehand:
        depth_draws = target_module.DepthDraws

        def counted(*args):
            made.append(depth_draws(*args))
            return made[-1]

        monkeypatch.setattr(target_module, "draws_every_row", lambda rows: True)
        monkeypatch.setattr(target_module, "DepthDraws", counted)
    model, prompt = target
    params = SamplingParams(temperature=0.6, top_k=5, seed=5)
    alone = speculative_generate(Target(model), None, prompt, 40, params)
    made.clear()
    spec = speculative_generate(Target(model), make(model), prompt, 40, params, window=window, tree=tree)
    assert spec.token_ids == alone.token_ids and len(alone.token_ids) == 40
    assert spec.stats.accepted > 5, spec.stats   # proposals were accepted along the way
    assert len(made) == (spec.stats.steps if beforehand else 0)   # every step's draws made beforehand
