"""The learned draft router: its decision rule on literal models and costs, how it learns and
explores, mid-flight switches, and (on tiny real models) that routed and switched requests still
produce exactly the target's greedy output."""

import logging

import pytest
import torch

from specserve.replicas.model_worker import InlineWorker
from specserve.replicas.sampling import SamplingParams
from specserve.replicas.request import AUTO_DRAFT, NO_DRAFT, RequestState, SpecRequest
from specserve.replicas.step import PLAIN, RequestStep, Speculation, StepRecord
from specserve.replicas.target import Target
from specserve.router.draft_router import NO_GAIN, PINNED, PREDICTED, LearnedDraftRouter
from specserve.replicas.engine import run_batch, speculative_generate
from tiny_servers import servers
from tiny_models import tiny_model

GREEDY = SamplingParams()
REPETITIVE = [5, 6, 7, 8] * 10          # what prompt lookup lives on
VARIED = list(range(100, 140))          # nothing repeats


def state(prompt, draft=AUTO_DRAFT, request_id="r0", window=4, grammar=None):
    return RequestState(SpecRequest(list(prompt), 32, GREEDY, draft, window, request_id=request_id, grammar=grammar),
                        frozenset(), torch.device("cpu"))


def priced(router, verify_ms=20.0, per_token_ms=1.0, **draft_ms):
    """Costs measured as a replica would: a few verify steps of different sizes, and each draft's
    ms per drafted position."""
    for tokens in (1, 3, 5, 9):
        router.costs.observe(StepRecord(1, tokens, 0, 0.0, verify_ms + per_token_ms * tokens, 0.0, ()))
    for draft, ms in draft_ms.items():
        router.costs.seed(draft, ms)


def teach(router, draft, prompt, alpha, times=20, grammar=None):
    x = router.features(state(prompt, grammar=grammar)).vector()
    for _ in range(times):
        router.models[draft].update(x, alpha)


def test_cold_router_tries_a_draft_rather_than_giving_up():
    router = LearnedDraftRouter(["lookup", "lm"], log=False)
    priced(router, lookup=0.05, lm=3.0)
    s = state(VARIED)
    choice = router.route(s, 1)
    # Nothing observed: every draft is predicted the prior α₀ = 0.5, at which drafting beats plain
    # decoding; at equal α the cheaper draft wins.
    assert choice == "lookup" and s.routing["reason"] == PREDICTED
    assert s.routing["predicted_alpha"] == {"lookup": 0.5, "lm": 0.5}


def test_the_request_carries_the_alpha_its_draft_was_chosen_on():
    """The load-aware policy starts a routed request from this α, so a draft chosen for the
    prompt drafts there even where it served other prompts badly."""
    router = LearnedDraftRouter(["lookup", "lm"], log=False)
    priced(router, lookup=0.05, lm=3.0)
    teach(router, "lm", VARIED, 0.7)
    s = state(VARIED)
    choice = router.route(s, 1)
    chosen = next(c for d, c in router.scores(router.features(s).vector(), 1).items() if d == choice)
    assert s.expected_alpha == pytest.approx(min(0.95, chosen["alpha"] + router.explore * chosen["width"]), abs=1e-3)
    pinned = state(VARIED, draft="lm", request_id="r1")
    router.route(pinned, 1)
    assert pinned.routing["reason"] == PINNED and pinned.expected_alpha is None


def test_learned_router_picks_the_predicted_best_per_prompt():
    router = LearnedDraftRouter(["lookup", "lm"], log=False)
    priced(router, lookup=0.05, lm=3.0)
    teach(router, "lookup", REPETITIVE, 0.9)
    teach(router, "lm", REPETITIVE, 0.4)
    teach(router, "lookup", VARIED, 0.05)
    teach(router, "lm", VARIED, 0.7)
    a, b = state(REPETITIVE, request_id="a"), state(VARIED, request_id="b")
    assert router.route(a, 1) == "lookup" and a.routing["reason"] == PREDICTED
    assert router.route(b, 1) == "lm" and b.routing["reason"] == PREDICTED


def test_a_draft_that_does_badly_under_a_grammar_is_not_chosen_for_a_constrained_request():
    """One prompt, two requests: free text, and the same under a JSON schema (the router's
    ``constrained`` feature)."""
    schema = '{"type": "object"}'
    router = LearnedDraftRouter(["lookup", "lm"], log=False)
    priced(router, lookup=0.05, lm=3.0)
    teach(router, "lm", VARIED, 0.8)
    teach(router, "lookup", VARIED, 0.1)
    teach(router, "lm", VARIED, 0.05, grammar=schema)
    teach(router, "lookup", VARIED, 0.6, grammar=schema)
    free, constrained = state(VARIED, request_id="free"), state(VARIED, request_id="json", grammar=schema)
    assert router.route(free, 1) == "lm" and router.route(constrained, 1) == "lookup"


def test_no_speculation_when_no_draft_pays():
    router = LearnedDraftRouter(["lm"], explore=0.0, log=False)
    priced(router, lm=30.0)            # a draft forward dearer than a verify
    teach(router, "lm", VARIED, 0.1)
    s = state(VARIED)
    assert router.route(s, 1) == NO_DRAFT and s.routing["reason"] == NO_GAIN


def test_exploration_fades_as_observations_accumulate():
    router = LearnedDraftRouter(["lookup", "lm"], log=False)
    priced(router, lookup=0.05, lm=3.0)
    x = router.features(state(VARIED)).vector()
    before = router.models["lm"].width(x)
    teach(router, "lm", VARIED, 0.5, times=50)
    assert router.models["lm"].width(x) < before / 5


def test_a_pinned_draft_is_respected_recorded_and_teaches_its_model():
    router = LearnedDraftRouter(["lookup", "lm"], log=False)
    s = state(REPETITIVE, draft="lm")
    assert router.route(s, 1) == "lm" and s.routing["reason"] == PINNED
    for i in range(16):   # every step: 3 of 4 accepted
        router.observe(StepRecord(1, 5, 0, 1.0, 20.0, 0.0, (RequestStep("r0", "lm", Speculation(4), 4, 3, 4, None),)))
    s.finish_reason = "length"
    router.finish(s)
    outcome = router.recent[-1]
    assert outcome["final_draft"] == "lm" and outcome["observed"]["alpha"] == pytest.approx(0.75)
    assert router.models["lm"].observations == pytest.approx(1.0)
    assert router.models["lm"].predict(outcome["features"]) > 0.3


def test_steps_without_a_proposal_count_as_rejections_and_plain_steps_do_not():
    router = LearnedDraftRouter(["lookup"], log=False)
    s = state(VARIED, draft="lookup")
    router.route(s, 1)
    steps = [RequestStep("r0", "lookup", Speculation(4), 4, 4, 4, None),   # all 4 accepted
             RequestStep("r0", "lookup", Speculation(4), 0, 0, 0, None),   # asked, nothing proposed
             RequestStep("r0", "lookup", PLAIN, 0, 0, 0, None)]            # policy switched it off
    for step in steps:
        router.observe(StepRecord(1, 1, 0, 0.0, 20.0, 0.0, (step,)))
    segment = router._segments["r0"]
    assert segment.history == [(4, 4), (0, 4)]
    assert router.realised_alpha(segment) == pytest.approx(0.8)   # 4 / (4 + 1)


def test_a_request_whose_draft_disappoints_switches_once():
    router = LearnedDraftRouter(["lookup", "lm"], explore=0.0, revisit_every=4, max_switches=1, log=False)
    priced(router, lookup=0.05, lm=1.0)
    teach(router, "lookup", VARIED, 0.8)   # the model expects lookup to do well here ...
    teach(router, "lm", VARIED, 0.6)
    s = state(VARIED)
    assert router.route(s, 1) == "lookup"
    miss = StepRecord(1, 5, 0, 0.1, 22.0, 0.0, (RequestStep("r0", "lookup", Speculation(4), 4, 0, 4, None),))
    for _ in range(3):
        router.observe(miss)
        assert router.revisit(s, 1) is None          # not before revisit_every counted steps
    router.observe(miss)                              # ... but it rejects everything
    assert router.revisit(s, 1) == "lm"
    assert s.routing["switches"][0]["from"] == "lookup" and s.routing["switches"][0]["to"] == "lm"
    # The disappointing segment taught lookup's model on the spot.
    assert router.models["lookup"].predict(router._features["r0"]) < 0.8
    for _ in range(8):
        router.observe(StepRecord(1, 5, 0, 1.0, 22.0, 0.0, (RequestStep("r0", "lm", Speculation(4), 4, 0, 4, None),)))
    assert router.revisit(s, 1) is None               # at most max_switches


def test_an_unavailable_draft_is_not_chosen_and_its_requests_move_off_it():
    """A draft deployment down, or late with a call still running (the step loop says which):
    priced at nothing, so the next best is chosen, and a request on it switches at its revisit."""
    router = LearnedDraftRouter(["lookup", "lm"], explore=0.0, revisit_every=4, log=False)
    priced(router, lookup=0.05, lm=1.0)
    teach(router, "lm", VARIED, 0.8)
    teach(router, "lookup", VARIED, 0.3)
    assert router.route(state(VARIED, request_id="a"), 1) == "lm"
    router.unavailable = frozenset({"lm"})
    b = state(VARIED, request_id="b")
    assert router.route(b, 1) == "lookup" and b.routing["tokens_per_s"]["lm"] == 0.0
    on_lm = state(VARIED, request_id="c")
    router.unavailable = frozenset()
    assert router.route(on_lm, 1) == "lm"
    good = StepRecord(1, 5, 0, 1.0, 22.0, 0.0, (RequestStep("c", "lm", Speculation(4), 4, 3, 4, None),))
    for _ in range(4):
        router.observe(good)
    assert router.revisit(on_lm, 1) is None   # doing well, available: it stays
    router.unavailable = frozenset({"lm"})
    for _ in range(4):
        router.observe(good)
    assert router.revisit(on_lm, 1) in ("lookup", NO_DRAFT)


def test_decision_and_outcome_are_json_log_lines(caplog):
    import json
    router = LearnedDraftRouter(["lookup"])
    s = state(REPETITIVE)
    with caplog.at_level(logging.INFO, logger="ray.serve"):
        router.route(s, 1)
        s.finish_reason = "stop"
        router.finish(s)
    lines = [json.loads(r.getMessage().removeprefix("specserve.routing ")) for r in caplog.records
             if r.getMessage().startswith("specserve.routing ")]
    assert [line["event"] for line in lines] == ["decision", "outcome"]
    decision = lines[0]
    assert decision["request_id"] == "r0" and decision["choice"] == s.routing["choice"]
    assert set(decision["scores"]) == {"lookup", NO_DRAFT} and "repeat_rate" in decision["features"]


# --- on tiny real models: routing never changes the output ---------------------------------


PROMPTS = [[5, 6, 7, 8, 5, 6, 9, 10, 11, 5, 6], [1, 2, 3, 4, 1, 2, 3, 4, 1], list(range(20, 50)), [3, 3, 3, 9]]


def test_routed_and_switched_requests_equal_the_target_alone():
    model = tiny_model("llama", seed=0)
    # Switch at every chance (a negative margin), twice, so requests change draft mid-flight.
    router = LearnedDraftRouter(["prompt-lookup", "near"], revisit_every=2, switch_margin=-1.0, max_switches=2, log=False)
    for draft in router.drafts:   # priced, as a replica's start-up probe prices its drafts
        router.costs.seed(draft, 0.5)
    requests = [SpecRequest(p, 24, GREEDY, AUTO_DRAFT, 3, request_id=f"r{i}") for i, p in enumerate(PROMPTS)]
    got = run_batch(Target(model, slots=8), servers(model), requests, router=router)
    for prompt, gen in zip(PROMPTS, got):
        assert gen.token_ids == speculative_generate(Target(model), None, prompt, 24, GREEDY).token_ids
        assert gen.routing is not None and gen.routing["choice"] in ("prompt-lookup", "near", NO_DRAFT)
    assert any(gen.routing["switches"] for gen in got), "no request switched draft: the test would not catch a bad switch"
    assert len(router.recent) == len(PROMPTS)
    # The perplexity feature came from the prefill.
    assert all(outcome["features"] is not None for outcome in router.recent)


def test_a_busy_replica_scores_no_perplexity_rows():
    """The prompt's perplexity costs an output layer over PERPLEXITY_ROWS rows in the prefill:
    scored on an idle replica, left out (the router sees it missing) once PERPLEXITY_BUSY
    requests are in the batch."""
    import asyncio

    from specserve.replicas.request import StaticPolicy
    from specserve.replicas.scheduler import PERPLEXITY_BUSY, Scheduler
    from specserve.replicas.step_loop import StepLoop

    model = tiny_model("llama", seed=0)
    router = LearnedDraftRouter(["prompt-lookup"], log=False)
    scheduler = Scheduler(Target(model, slots=8), StaticPolicy(), router=router)
    loop = StepLoop(scheduler, servers(model), InlineWorker())
    idle = loop.add(SpecRequest(PROMPTS[2], 24, GREEDY, AUTO_DRAFT, 3, request_id="idle"))

    async def run():
        while not idle.prefilled:
            await loop.step()
        for i in range(PERPLEXITY_BUSY - 2):
            loop.add(SpecRequest(PROMPTS[i], 24, GREEDY, NO_DRAFT, 0, request_id=f"plain{i}"))
        # The batch holds PERPLEXITY_BUSY requests with this one.
        busy = loop.add(SpecRequest(PROMPTS[2], 24, GREEDY, AUTO_DRAFT, 3, request_id="busy"))
        while not busy.prefilled:
            await loop.step()
        return busy

    busy = asyncio.run(run())
    assert idle.prompt_scored > 0 and router.features(idle).perplexity is not None
    assert busy.prompt_scored == 0 and router.features(busy).perplexity is None
    assert router.features(busy).vector()[3] == 1.0   # the "perplexity_missing" indicator


def test_a_switch_drops_the_old_drafts_cluster_prior():
    """A request's prior (α and carried state) is its draft's: a draft chosen for an ``auto``
    request gets its own from the replica's warm start; a switch leaves the new draft none."""
    from specserve.replicas.request import StaticPolicy
    from specserve.replicas.scheduler import Scheduler

    model = tiny_model("llama", seed=0)
    scheduler = Scheduler(Target(model, slots=4), StaticPolicy())
    warm = scheduler.add(SpecRequest(PROMPTS[0], 8, GREEDY, "prompt-lookup", 3, request_id="warm", prior_alpha=0.7,
                                     prior_learned={"version": 1, "sums": {}}))
    routed = scheduler.add(SpecRequest(PROMPTS[1], 8, GREEDY, AUTO_DRAFT, 3, request_id="auto", prior_alpha=0.5))
    scheduler.set_draft(warm, "near")
    scheduler.set_draft(routed, "prompt-lookup")
    assert warm.request.draft == "near" and warm.request.prior_alpha is None and warm.request.prior_learned is None
    assert routed.request.prior_alpha == 0.5   # an auto request's start is set where it is routed


def test_a_failing_router_costs_the_choice_not_the_request():
    class Broken(LearnedDraftRouter):
        def route(self, state, batch_size):
            raise RuntimeError("boom")

    model = tiny_model("llama", seed=0)
    requests = [SpecRequest(PROMPTS[0], 12, GREEDY, AUTO_DRAFT, 3, request_id="r0")]
    got = run_batch(Target(model, slots=4), servers(model), requests, router=Broken(["near"], log=False))
    assert got[0].token_ids == speculative_generate(Target(model), None, PROMPTS[0], 12, GREEDY).token_ids
    assert got[0].stats.draft == NO_DRAFT   # the scheduler's default draft


def test_route_metrics_take_an_outcome():
    """Built as a replica builds them (Ray's metric names and descriptions must be ASCII)."""
    from specserve.router.route_metrics import RouteMetrics

    router = LearnedDraftRouter(["lookup"], log=False)
    router.on_outcome.append(RouteMetrics("t").observe)
    s = state(REPETITIVE)
    router.route(s, 1)
    for _ in range(4):
        router.observe(StepRecord(1, 5, 0, 0.1, 20.0, 0.0, (RequestStep("r0", s.request.draft, Speculation(4), 4, 2, 4, None),)))
    s.finish_reason = "length"
    router.finish(s)
    assert router.recent[-1]["choice"] in ("lookup", NO_DRAFT)
