"""The router's exploration on real routers: LinUCB's bonus tries a draft the prediction ranks
below another; the α it realises teaches its model (on the replica at once, and through the
policy service's retraining on every replica), after which the prediction alone chooses it. A
draft whose cost is not measured yet is explored at the dearest known draft's cost; a draft that
cannot propose now never is, and nothing is explored at ``explore = 0``.

Every case routes one prompt, VARIED, between "known", observed 20 times at α 0.6 (predicted
≈ 0.6, width ≈ 0.22), and "fresh", never observed (predicted the prior 0.5, width ≈ 1.54 for
VARIED's features): at equal cost the prediction prefers known, while at the default
``explore`` 0.2 fresh's optimistic α (0.5 + 0.2·1.54 ≈ 0.81) beats known's (≈ 0.64)."""

import pytest
import torch

from specserve.policies.redis_stats import RedisStats
from specserve.replicas.request import AUTO_DRAFT, NO_DRAFT, RequestState, SpecRequest
from specserve.replicas.sampling import SamplingParams
from specserve.replicas.step import RequestStep, Speculation, StepRecord
from specserve.router.draft_router import EXPLORE, NO_GAIN, PREDICTED, LearnedDraftRouter
from specserve.router.retrain import retrain, weights_for
from specserve.router.route_learning import RouteLearning

TARGET = "t"
VARIED = list(range(100, 140))   # nothing repeats: the prompt itself favours no draft
EXPLORE_WEIGHT = 0.2             # the served default (RouterFactory.explore)


def state(request_id, prompt=VARIED):
    return RequestState(SpecRequest(list(prompt), 64, SamplingParams(), AUTO_DRAFT, 4, request_id=request_id),
                        frozenset(), torch.device("cpu"))


def replica_router(drafts=("known", "fresh"), explore=EXPLORE_WEIGHT, **draft_ms) -> LearnedDraftRouter:
    """A router as a replica holds it before serving: verify steps measured (20 ms + 1 ms per
    token fed), each draft in ``draft_ms`` priced per drafted position (default: all at 1 ms),
    and known observed 20 times at α 0.6 on VARIED."""
    router = LearnedDraftRouter(list(drafts), explore=explore, log=False)
    for tokens in (1, 3, 5, 9):
        router.costs.observe(StepRecord(1, tokens, 0, 0.0, 20.0 + tokens, 0.0, ()))
    for draft, ms in (draft_ms or dict.fromkeys(drafts, 1.0)).items():
        router.costs.seed(draft, ms)
    x = router.features(state("teach")).vector()
    for _ in range(20):
        router.models["known"].update(x, 0.6)
    return router


def serve(router, request, accepted, steps=16, window=4, draft_ms=4.0):
    """The routed request's steps as the step loop records them (its draft proposing ``window``
    tokens in ``draft_ms``, ``accepted`` of them accepted), then its end."""
    draft = request.routing["choice"]
    for _ in range(steps):
        step = RequestStep(request.id, draft, Speculation(window), window, accepted, window, None)
        router.observe(StepRecord(1, window + 1, 0, draft_ms, 25.0, 0.0, (step,), ((draft, draft_ms),)))
    request.finish_reason = "length"
    router.finish(request)


@pytest.mark.parametrize("explore, choice, reason", [(EXPLORE_WEIGHT, "fresh", EXPLORE), (0.0, "known", PREDICTED)])
def test_the_bonus_tries_an_uncertain_draft_the_prediction_ranks_below_a_known_one(explore, choice, reason):
    router = replica_router(explore=explore)
    request = state("r0")
    assert router.route(request, 1) == choice and request.routing["reason"] == reason, request.routing
    predicted = request.routing["predicted_alpha"]
    assert predicted["fresh"] < predicted["known"], "the prediction alone must prefer known, or nothing was explored"
    assert request.routing["tokens_per_s"]["fresh"] < request.routing["tokens_per_s"]["known"]


def test_once_the_explored_draft_does_well_the_prediction_chooses_it_on_every_replica():
    """Replica a explores fresh, which accepts 3 of 4 per step (realised α = 3 / (3 + 1) = 0.75,
    above known's 0.6). Its own model learns at the request's end; the outcome goes the way a
    replica sends it (``RouteLearning``'s buffer), the policy service's ``retrain`` turns it into
    weights, and replica b, which never served fresh, loads them: both then choose fresh on the
    prediction."""
    a, b = replica_router(), replica_router()
    # a's outbox to Redis, never flushed here: the batch it would send goes to retrain directly.
    sent = RouteLearning(a, TARGET, RedisStats("redis://127.0.0.1:9", "unused"))
    explored = state("a0")
    assert a.route(explored, 1) == "fresh" and explored.routing["reason"] == EXPLORE
    before = explored.routing["predicted_alpha"]["fresh"]
    serve(a, explored, accepted=3)
    assert a.recent[-1]["observed"] == {"draft": "fresh", "alpha": 0.75, "steps": 16, "weight": 1.0}

    again = state("a1")
    assert a.route(again, 1) == "fresh" and again.routing["reason"] == PREDICTED, again.routing
    learned = again.routing["predicted_alpha"]["fresh"]
    assert before < learned and learned > again.routing["predicted_alpha"]["known"]

    # b decides as a did before it learned ...
    first = state("b0")
    assert b.route(first, 1) == "fresh" and first.routing["reason"] == EXPLORE
    # ... until it loads the cluster's weights, retrained from a's outcome.
    document = retrain(sent.outcomes.drain())
    weights = weights_for(document, TARGET, b.basis_id, b.models["fresh"].dims)
    assert set(weights) == {"fresh"}, "only the draft a observed is retrained"
    b.load_weights(weights)
    after = state("b1")
    assert b.route(after, 1) == "fresh" and after.routing["reason"] == PREDICTED, after.routing
    # Ridge over the same one observation is the model a learned online.
    assert after.routing["predicted_alpha"]["fresh"] == pytest.approx(learned, abs=1e-3)


def test_a_draft_whose_cost_is_not_measured_yet_is_explored_at_the_dearest_known_cost():
    """"fresh" is priced by nothing (a separate deployment without a probe): prediction gives it
    0 tokens/s, exploration prices it as the dearest measured draft, and its own steps then
    measure it."""
    router = replica_router(known=1.0)
    request = state("r0")
    assert router.route(request, 1) == "fresh" and request.routing["reason"] == EXPLORE, request.routing
    assert request.routing["tokens_per_s"]["fresh"] == 0.0   # no prediction rests on a guessed cost
    x = router.features(request).vector()
    scores = router.scores(x, 1)
    optimistic = min(router.alpha_max, scores["fresh"]["alpha"] + router.explore * scores["fresh"]["width"])
    # Priced exactly as known (1 ms per position) would be at fresh's optimistic α.
    assert scores["fresh"]["ucb_tokens_per_s"] == round(router.costs.best(optimistic, "known", 1)[0], 2)
    assert replica_router(explore=0.0, known=1.0).route(state("r1"), 1) == "known"

    serve(router, request, accepted=3, draft_ms=2.0)   # 2 ms a step over 4 drafted positions
    assert router.costs.draft_ms("fresh") == pytest.approx(0.5)
    assert router.scores(x, 1)["fresh"]["tokens_per_s"] > 0


def test_no_draft_is_explored_without_a_measured_one_to_price_it_by():
    router = LearnedDraftRouter(["fresh"], explore=EXPLORE_WEIGHT, log=False)
    request = state("r0")
    assert router.route(request, 1) == NO_DRAFT and request.routing["reason"] == NO_GAIN


@pytest.mark.parametrize("draft_ms", [{"known": 1.0, "fresh": 1.0}, {"known": 1.0}], ids=["priced", "unmeasured"])
def test_an_unavailable_draft_is_never_chosen_however_wide_its_bonus(draft_ms):
    """At ``explore = 1`` fresh's optimistic α is α_max (0.5 + 1.54, capped at 0.95) and known's
    0.82: fresh would win any decision it could."""
    router = replica_router(explore=1.0, **draft_ms)
    assert router.route(state("r0"), 1) == "fresh"
    router.unavailable = frozenset({"fresh"})
    request = state("r1")
    assert router.route(request, 1) == "known", request.routing
    assert request.routing["tokens_per_s"]["fresh"] == 0.0
    assert router.scores(router.features(request).vector(), 1)["fresh"]["ucb_tokens_per_s"] == 0.0
    router.unavailable = frozenset({"fresh", "known"})
    alone = state("r2")
    assert router.route(alone, 1) == NO_DRAFT and alone.routing["reason"] == NO_GAIN
