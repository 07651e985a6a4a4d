"""bench imagegen on a tiny generator and draft: every row over the same pictures, the exact rows'
greedy pictures equal target-only's (the relaxed rows' compared with them), τ maps by grid position, the JSON and the plot."""

import json

import pytest

from specserve.bench.imagegen import RELAXED, ROWS, ImagegenBenchConfig, picture_labels, run_imagegen_bench
from specserve.data.scenes import SMOOTH_BACKGROUNDS, label_parts
from specserve.replicas.step import TreeShape
from tiny_models import tiny_generator_draft, tiny_generator_folder


def test_pictures_alternate_smooth_and_busy_backgrounds():
    labels = picture_labels(6)
    assert [label_parts(label)[2] in SMOOTH_BACKGROUNDS for label in labels] == [True, False] * 3
    assert len(set(labels)) == 6


def test_bad_settings_fail_before_any_model_loads():
    with pytest.raises(ValueError, match="unknown row"):
        ImagegenBenchConfig(rows=("target-only", "beam"))
    with pytest.raises(ValueError, match="pictures"):
        ImagegenBenchConfig(pictures=1)
    with pytest.raises(ValueError, match="at-once"):
        ImagegenBenchConfig(at_once=0)
    with pytest.raises(ValueError, match="delta"):
        ImagegenBenchConfig(lantern_delta=1.5)


@pytest.mark.parametrize("at_once", [1, 2])
def test_every_row_runs_the_same_pictures_side_by_side(tmp_path, monkeypatch, at_once):
    folder = tiny_generator_folder(tmp_path / "models", grid=4)
    draft = tiny_generator_draft(folder)
    # The tiny generator knows 6 classes: the benchmark's labels, taken modulo.
    monkeypatch.setattr("specserve.bench.imagegen.picture_labels", lambda n: [i % 6 for i in range(n)])
    config = ImagegenBenchConfig(json_path=tmp_path / "b.json", plot_path=tmp_path / "b.png", pictures=2,
                                 at_once=at_once, tree=TreeShape(3, 4, 8), generator=folder, draft=draft)
    report = run_imagegen_bench(config)
    assert len(json.loads((tmp_path / "b.json").read_text())["rows"]) == len(report["rows"])
    assert report["meta"]["at_once"] == at_once
    assert (tmp_path / "b.png").stat().st_size > 0
    rows = {(r["row"], r["temperature"]): r for r in report["rows"]}
    assert set(rows) == {(row, t) for row in ROWS for t in (0.0, 1.0)}
    for (row, t), r in rows.items():
        assert r["tokens_per_s"] > 0 and r["mean_accepted_len"] >= 1 and "speedup" in r
        if t == 0 and row not in RELAXED:
            assert r["matches_target_only"] == 2 and r["token_agreement"] == 1 and r["pixel_error"] == 0, row
        elif t == 0:   # lossy: compared, not required equal
            assert 0 <= r["token_agreement"] <= 1 and r["pixel_error"] >= 0, row
    assert rows[("target-only", 0.0)]["mean_accepted_len"] == 1
    assert max(r["mean_accepted_len"] for r in report["rows"]) > 1   # drafts were accepted
    tau = report["tau_maps"]["adt-tree@T=0"]
    assert len(tau) == 4 and len(tau[0]) == 4 and tau[0][0] >= 1
