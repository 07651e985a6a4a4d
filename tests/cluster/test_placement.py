"""Draft placement: the decision on literal costs, and the measurement that feeds it."""

import pytest

from specserve.cluster.config import INSIDE, PROMPT_LOOKUP, SEPARATE, AppConfig, DraftSpec
from dataclasses import replace

from specserve.cluster.placement import HANDLE_CALL_MS, PlacementCosts, measure, place, plan
from specserve.cluster.serve_config import local_serve_config

LM = DraftSpec(name="lm", model="/models/lm")


def test_a_model_free_draft_is_always_inside():
    decided = place(DraftSpec(name=PROMPT_LOOKUP))
    assert decided.where == INSIDE and "model-free" in decided.reason


def test_a_model_draft_on_the_same_hardware_goes_inside_by_the_handle_call():
    # γ·a_in = 4·2.5 = 10 ms against h + γ·a_sep = 6 + 10 ms.
    decided = place(LM, PlacementCosts(inside_ms_per_position=2.5, handle_ms=6.0, window=4), draft_ahead=False)
    assert decided.where == INSIDE
    assert decided.figures == {"window": 4, "inside_ms_per_step": 10.0, "separate_ms_per_step": 16.0,
                               "inside_ms_per_position": 2.5, "handle_ms": 6.0}


@pytest.mark.parametrize("a_sep, where", [(0.5, SEPARATE), (0.9, SEPARATE), (1.0, INSIDE), (1.1, INSIDE)])
def test_a_model_draft_goes_separate_only_when_its_own_hardware_repays_the_call(a_sep, where):
    # inside 4·2.5 = 10 ms; separate 6 + 4·a_sep: 9.6 ms at 0.9 (separate), 10 ms at 1.0 (a tie stays inside).
    decided = place(LM, PlacementCosts(inside_ms_per_position=2.5, handle_ms=6.0, separate_ms_per_position=a_sep))
    assert decided.where == where


def test_drafting_ahead_prices_a_separate_draft_by_what_it_adds_to_the_verify():
    # γ = 4, a = 2.5, h = 6, V = 30: ahead the draft needs h + 5·2.5 = 18.5 ms < V, so a hit costs
    # nothing; a miss asks again: 6 + 10 ms. P = α^5.
    costs = PlacementCosts(inside_ms_per_position=2.5, handle_ms=6.0, verify_ms=30.0, alpha=0.9)
    assert costs.hit_rate == pytest.approx(0.9 ** 5)
    assert costs.separate_ahead_ms == pytest.approx((1 - 0.9 ** 5) * 16.0)
    decided = place(LM, costs)
    assert decided.where == SEPARATE and "drafting ahead" in decided.reason
    assert decided.figures["separate_ahead_ms_per_step"] == pytest.approx((1 - 0.9 ** 5) * 16.0, abs=1e-3)
    # The same draft without drafting ahead, or rarely right, or too slow to finish within a verify.
    assert place(LM, costs, draft_ahead=False).where == INSIDE
    assert place(LM, replace(costs, alpha=0.5)).where == INSIDE
    slow = replace(costs, verify_ms=5.0)   # a miss also waits for the ahead call still running
    assert slow.separate_ahead_ms == pytest.approx(slow.hit_rate * 13.5 + (1 - slow.hit_rate) * (16.0 + 7.5))
    assert place(LM, slow).where == INSIDE
    # A draft beside the verify on one host slows it: that slowdown is the separate side's cost too.
    shared = replace(costs, verify_beside_ms=45.0)
    assert shared.separate_ahead_ms == pytest.approx(15.0 + (1 - 0.9 ** 5) * 16.0)
    assert place(LM, shared).where == INSIDE
    # A hidden-state-reuse head cannot draft ahead: priced as a plain separate draft.
    assert replace(costs, drafts_ahead=False).separate_ahead_ms is None
    assert place(LM, replace(costs, drafts_ahead=False)).where == INSIDE


@pytest.mark.reference
@pytest.mark.slow
def test_measured_costs_choose_either_side():
    """Measured on this host: the zoo's draft LM, the reference target's verify and the draft's
    recorded acceptance. On one kind of hardware, inside; on hardware twice as fast for it, or
    for a draft accepted as often as a near-copy of the target is, separate."""
    config = AppConfig.model_validate({"drafts": [{"name": "draft-2l", "model": "smollm2-draft-2l"}], "default_draft": "none"})
    costs = measure(config.drafts[0], config)
    assert 0 < costs.inside_ms_per_position < 100 and 0 < costs.verify_ms < 1000
    assert 0.3 < costs.alpha < 0.9 and costs.drafts_ahead   # the zoo record's held-out acceptance
    assert place(config.drafts[0], costs, draft_ahead=False).where == INSIDE
    faster = replace(costs, separate_ms_per_position=costs.inside_ms_per_position / 2,
                     handle_ms=costs.inside_ms_per_position)
    assert place(config.drafts[0], faster, draft_ahead=False).where == SEPARATE
    assert costs.verify_beside_ms is not None and costs.verify_beside_ms > 0   # timed with the draft beside it
    assert costs.separate_ahead_ms >= max(0.0, costs.verify_beside_ms - costs.verify_ms)
    # On a device of its own (nothing shared with the verify), drafting ahead a near-copy of the target.
    near_copy = replace(costs, alpha=0.97, handle_ms=min(HANDLE_CALL_MS, costs.verify_ms / 4), verify_beside_ms=None)
    decided = place(config.drafts[0], near_copy)
    if (costs.window + 1) * costs.inside_ms_per_position < 0.75 * costs.verify_ms:   # the draft fits in the verify
        assert decided.where == SEPARATE, decided.figures
    hsr = AppConfig.model_validate({"drafts": [{"name": "eagle3", "model": "smollm2-eagle3"}], "default_draft": "none"})
    assert not measure(hsr.drafts[0], hsr).drafts_ahead


def test_a_draft_whose_views_read_pictures_goes_inside_and_cannot_be_placed_apart():
    for views in (["multimodal"], ["text-only", "pooled"], ["caption", "text-only"]):
        decided = place(DraftSpec(name="vlm-lm", model="/models/lm", ensemble={"views": views}))   # no costs needed
        assert decided.where == INSIDE and "pictures" in decided.reason
    with pytest.raises(ValueError, match="placement separate is not possible"):
        DraftSpec(name="vlm-lm", model="/models/lm", ensemble={"views": ["multimodal"]}, placement=SEPARATE)
    assert not DraftSpec(name="lm", model="/models/lm", ensemble={"views": ["text-only", "full"]}).reads_pictures
    # A plan measures nothing for it (built apart, it could not even be measured).
    config = AppConfig.model_validate({"drafts": [{"name": PROMPT_LOOKUP}, {"name": "vlm-lm", "model": "/models/lm",
                                                   "ensemble": {"views": ["multimodal"]}}]})
    assert plan(config, measure_costs=lambda spec, config: pytest.fail("measured")).get("vlm-lm").where == INSIDE


def test_a_configured_placement_is_kept_and_measures_nothing():
    for where in (INSIDE, SEPARATE):
        decided = place(DraftSpec(name="lm", model="/models/lm", placement=where))
        assert (decided.where, decided.reason, decided.figures) == (where, "configured", {})
    with pytest.raises(ValueError, match="needs its measured costs"):
        place(LM)


def test_the_shipped_default_measures_its_model_drafts_and_places_everything_inside():
    args = local_serve_config()["applications"][0]["args"]
    placements = plan(AppConfig.model_validate(args))
    assert [p.where for p in placements.values()] == [INSIDE] * len(args["drafts"])
    for spec in [d for d in args["drafts"] if d.get("model")]:   # the zoo's drafts: measured on this host
        figures = placements[spec["name"]].figures
        assert 0 < figures["inside_ms_per_position"] < 100 and figures["handle_ms"] == HANDLE_CALL_MS
        assert figures["inside_ms_per_step"] < figures["separate_ms_per_step"]
