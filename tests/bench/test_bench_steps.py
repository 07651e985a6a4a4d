"""``bench steps``: bad settings fail before a model loads, and a small real run writes every row
at every load, each with the target-only output (greedy, float32) and the step's parts."""

import json

import pytest

from specserve.bench.steps import PARTS, ROWS, StepsBenchConfig, run_steps_bench


@pytest.mark.parametrize("settings", [{"window": 0}, {"prompts": 0}, {"loads": ()}, {"loads": (0, 4)}, {"rounds": 0}])
def test_bad_settings_fail_when_made(settings):
    with pytest.raises(ValueError):
        StepsBenchConfig(**settings)


@pytest.mark.reference
@pytest.mark.slow
def test_a_small_run_writes_every_row_lossless_with_the_parts_of_a_step(tmp_path):
    config = StepsBenchConfig(json_path=tmp_path / "steps.json", plot_path=tmp_path / "steps.png", loads=(1, 2),
                              prompts=2, max_tokens=12, rounds=1, dtype="float32")
    rows = run_steps_bench(config)
    assert [(r["load"], r["row"]) for r in rows] == [(load, row) for load in (1, 2) for row in ROWS]
    for r in rows:
        assert r["same_as_target_only"] == 2, r   # drafting on any thread, ahead or not, changes no token
        assert r["tokens"] > 0 and r["tokens_per_s"] > 0 and set(r["ms_per_step"]) == set(PARTS)
        assert (r["row"] == "ahead") == ("ahead" in r)
    saved = json.loads(config.json_path.read_text())
    assert saved["meta"]["machine"]["cpu_model"] and config.plot_path.stat().st_size > 0
