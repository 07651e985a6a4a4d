"""Draft placement: the decision on literal costs, and the measurement that feeds it."""

import pytest

from specserve.cluster.config import INSIDE, PROMPT_LOOKUP, SEPARATE, AppConfig, DraftSpec
from specserve.cluster.placement import HANDLE_CALL_MS, PlacementCosts, place, plan
from specserve.cluster.serve_config import local_serve_config

LM = DraftSpec(name="lm", model="/models/lm")


def test_a_model_free_draft_is_always_inside():
    decided = place(DraftSpec(name=PROMPT_LOOKUP))
    assert decided.where == INSIDE and "model-free" in decided.reason


def test_a_model_draft_on_the_same_hardware_goes_inside_by_the_handle_call():
    # γ·a_in = 4·2.5 = 10 ms against h + γ·a_sep = 6 + 10 ms.
    decided = place(LM, PlacementCosts(inside_ms_per_position=2.5, handle_ms=6.0, window=4))
    assert decided.where == INSIDE
    assert decided.figures == {"window": 4, "inside_ms_per_step": 10.0, "separate_ms_per_step": 16.0,
                               "inside_ms_per_position": 2.5, "handle_ms": 6.0}


@pytest.mark.parametrize("a_sep, where", [(0.5, SEPARATE), (0.9, SEPARATE), (1.0, INSIDE), (1.1, INSIDE)])
def test_a_model_draft_goes_separate_only_when_its_own_hardware_repays_the_call(a_sep, where):
    # inside 4·2.5 = 10 ms; separate 6 + 4·a_sep: 9.6 ms at 0.9 (separate), 10 ms at 1.0 (a tie stays inside).
    decided = place(LM, PlacementCosts(inside_ms_per_position=2.5, handle_ms=6.0, separate_ms_per_position=a_sep))
    assert decided.where == where


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
