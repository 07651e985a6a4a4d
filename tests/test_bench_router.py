"""The router benchmark: its strategies on literal tables, and one tiny real run on the reference
target whose JSON and plot are checked for schema and invariants (not timings)."""

import json

import pytest

from specserve.cluster.bench_router import (
    AUTO, BEST_SINGLE, LEAST_SQUARES, ORACLE, RANDOM, ROUTER, STRATEGIES, Generation, aims, best_single_choice,
    regret, run_router_bench, strategy_rows, table_of,
)


def gen(prompt, category, draft, tokens, seconds, phase="eval", choice=None):
    return Generation(phase, prompt, category, draft, tokens, seconds, choice=choice)


# Prompt 0 (code): lm is fastest; prompt 1 (edit): lookup is. Over the mix lookup wins (best single).
TABLE = [gen(0, "code", "lookup", 100, 2.0), gen(0, "code", "lm", 100, 1.0), gen(0, "code", "none", 100, 2.5),
         gen(1, "edit", "lookup", 100, 1.0), gen(1, "edit", "lm", 100, 2.5), gen(1, "edit", "none", 100, 2.5)]


def by(rows, strategy, category="all"):
    return next(r["tokens_per_s"] for r in rows if r["strategy"] == strategy and r["category"] == category)


def approx(x):
    return pytest.approx(x, abs=0.01)   # rows are rounded to hundredths


def test_strategies_from_the_table():
    router = [gen(0, "code", AUTO, 100, 1.25, choice="lm"), gen(1, "edit", AUTO, 100, 1.25, choice="lookup")]
    rows = strategy_rows(TABLE + router, {0: "lookup", 1: "lookup"}, ["code", "edit"])
    assert {r["strategy"] for r in rows} == set(STRATEGIES)
    assert best_single_choice(table_of(TABLE, "eval")) == "lookup"
    assert by(rows, ORACLE) == approx(200 / 2.0)
    assert by(rows, BEST_SINGLE) == approx(200 / 3.0)
    assert by(rows, RANDOM) == approx(200 / ((2.0 + 1.0 + 2.5) / 3 + (1.0 + 2.5 + 2.5) / 3))
    assert by(rows, LEAST_SQUARES) == approx(200 / 3.0) and by(rows, LEAST_SQUARES, "edit") == 100.0
    assert by(rows, ROUTER) == approx(200 / 2.5)
    result = aims(rows)
    assert result["router_over_oracle"]["value"] == pytest.approx(0.8, abs=1e-3) and not result["router_over_oracle"]["met"]
    assert result["router_over_best_single"]["value"] == pytest.approx(1.2, abs=1e-3) and result["router_over_best_single"]["met"]


def test_regret_is_measured_against_each_prompts_oracle():
    router = [gen(0, "code", AUTO, 100, 2.0, choice="lookup"), gen(1, "edit", AUTO, 100, 1.0, choice="lookup")]
    out = regret(TABLE + router)
    assert [r["oracle"] for r in out] == ["lm", "lookup"]
    assert out[0]["seconds_lost"] == pytest.approx(1.0) and out[1]["seconds_lost"] == pytest.approx(0.0)


@pytest.mark.reference
def test_a_tiny_real_run_writes_every_strategy(tmp_path):
    report = run_router_bench(tmp_path / "r.json", tmp_path / "r.png", prompts_per_category=1, warmup_per_category=1,
                              max_tokens=8, categories=["code", "edit"], progress=False, repeats=3)
    saved = json.loads((tmp_path / "r.json").read_text())
    assert saved["rows"] == report["rows"] and (tmp_path / "r.png").stat().st_size > 0
    assert {(r["strategy"], r["category"]) for r in saved["rows"]} == {(s, c) for s in STRATEGIES for c in ("code", "edit", "all")}
    candidates = saved["meta"]["candidates"]
    assert "prompt-lookup" in candidates and "none" in candidates
    # Every evaluation prompt has each candidate pinned and one router run; the oracle beats every
    # table strategy on every category by construction.
    evaluation = [g for g in saved["requests"] if g["phase"] == "eval"]
    assert len(evaluation) == 2 * (len(candidates) + 1)
    for category in ("code", "edit", "all"):
        oracle = by(saved["rows"], ORACLE, category)
        assert all(by(saved["rows"], s, category) <= oracle + 1e-6 for s in (BEST_SINGLE, RANDOM, LEAST_SQUARES))
    routed = [g for g in saved["requests"] if g["draft"] == AUTO]
    assert routed and all(g["choice"] in candidates and g["reason"] for g in routed)
    # Evaluation generations are timed three times, by the median; warm-up ones once.
    for g in saved["requests"]:
        assert len(g["timings"]) == (3 if g["phase"] == "eval" else 1)
        assert g["seconds"] == pytest.approx(sorted(g["timings"])[len(g["timings"]) // 2], abs=1e-3)
    assert len(saved["regret"]) == len(routed)
