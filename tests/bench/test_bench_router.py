"""The router benchmark: its strategies on literal tables, and one tiny real run on the reference
target whose JSON and plot are checked for schema and invariants (not timings)."""

import json

import pytest

from specserve.bench.router import (
    AUTO, BEST_SINGLE, LEAST_SQUARES, ORACLE, ORACLE_IN_SAMPLE, RANDOM, ROUTER, STRATEGIES, Generation,
    RouterBenchConfig, ablation, aims, best_single_choice, feature_groups, held_out_oracle, regret, run_router_bench,
    strategy_rows, table_of,
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
    assert by(rows, ORACLE) == approx(200 / 2.0) == by(rows, ORACLE_IN_SAMPLE)   # one timing each: no hold-out
    assert by(rows, BEST_SINGLE) == approx(200 / 3.0)
    assert by(rows, RANDOM) == approx(200 / ((2.0 + 1.0 + 2.5) / 3 + (1.0 + 2.5 + 2.5) / 3))
    assert by(rows, LEAST_SQUARES) == approx(200 / 3.0) and by(rows, LEAST_SQUARES, "edit") == 100.0
    assert by(rows, ROUTER) == approx(200 / 2.5)
    result = aims(rows)
    assert result["router_over_oracle"]["value"] == pytest.approx(0.8, abs=1e-3) and not result["router_over_oracle"]["met"]
    assert result["router_over_best_single"]["value"] == pytest.approx(1.2, abs=1e-3) and result["router_over_best_single"]["met"]


def test_the_oracle_is_scored_on_timings_that_did_not_choose_it():
    """Candidate b is as fast as a but noisy: its best median (0.95 s) wins in sample by luck. Held
    out, each repeat is read from the candidate the other two chose: a, a, then b's slow 1.4 s."""
    steady, noisy = gen(0, "code", "a", 100, 1.0), gen(0, "code", "b", 100, 0.95)
    steady.timings, noisy.timings = [1.0, 1.0, 1.0], [0.7, 0.95, 1.4]
    assert held_out_oracle({"a": steady, "b": noisy}) == (100, 1.0)
    rows = strategy_rows([steady, noisy], {}, ["code"])
    assert by(rows, ORACLE) == approx(100.0) and by(rows, ORACLE_IN_SAMPLE) == approx(100 / 0.95)
    # Two repeats: the mean of the two held-out readings (b chosen on 0.7 and read at 1.4, then a).
    steady.timings, noisy.timings = [1.0, 1.0], [0.7, 1.4]
    assert held_out_oracle({"a": steady, "b": noisy}) == (100, pytest.approx(1.2))


def test_regret_is_measured_against_each_prompts_oracle():
    router = [gen(0, "code", AUTO, 100, 2.0, choice="lookup"), gen(1, "edit", AUTO, 100, 1.0, choice="lookup")]
    out = regret(TABLE + router)
    assert [r["oracle"] for r in out] == ["lm", "lookup"]
    assert out[0]["seconds_lost"] == pytest.approx(1.0) and out[1]["seconds_lost"] == pytest.approx(0.0)


def test_the_ablation_shows_which_feature_carries_alpha():
    """Prompt lookup's α is the prompt's repeat rate here, the other features noise: left out,
    repetition makes least squares miss α and pick the slow candidate; the others cost nothing."""
    import random

    rng = random.Random(0)

    def features(repeat):   # bias, log_length, log_perplexity, perplexity_missing, repeat_rate, 1 topic
        return [1.0, rng.uniform(0.3, 0.9), rng.uniform(0.2, 0.8), 0.0, repeat, rng.uniform(-1, 1)]

    generations = []
    for i, repeat in enumerate(0.9 * k / 23 for k in range(24)):   # α from 0 to 0.9, mean 0.45
        g = gen(i, "edit", "lookup", 100, 1.0, phase="warmup")
        g.features, g.realised_alpha = features(repeat), repeat
        generations.append(g)
    for i, repeat in enumerate([0.85, 0.05]):   # eval: lookup is fast on prompt 0 and slow on prompt 1
        for draft, seconds in (("lookup", 1.0 if repeat > 0.5 else 3.0), ("none", 2.0)):
            g = gen(i, "edit", draft, 100, seconds)
            g.features, g.realised_alpha = features(repeat), repeat if draft == "lookup" else None
            generations.append(g)

    def choose(models, x):
        return "lookup" if models["lookup"].predict(x) > 0.6 else "none"

    rows = {r["features"]: r for r in ablation(generations, choose, dims=1)}
    assert set(rows) == {"all", *(f"-{g}" for g in feature_groups(1))}
    assert rows["all"]["alpha_mae"] < 0.05 and rows["all"]["tokens_per_s"] == approx(200 / 3.0)   # both right
    # Without it every prediction is about the mean α (0.45): "none" for both, 200 tokens in 4 s.
    assert rows["-repeat_rate"]["alpha_mae"] > 0.2 and rows["-repeat_rate"]["tokens_per_s"] == approx(50.0)
    for group in ("length", "perplexity", "topics"):
        assert rows[f"-{group}"]["alpha_mae"] < 0.1 and rows[f"-{group}"]["tokens_per_s"] == approx(200 / 3.0)


@pytest.mark.reference
@pytest.mark.slow
def test_a_tiny_real_run_writes_every_strategy(tmp_path):
    config = RouterBenchConfig(json_path=tmp_path / "r.json", plot_path=tmp_path / "r.png", prompts_per_category=1,
                               warmup_per_category=1, max_tokens=8, categories=("code", "edit"), repeats=3)
    report = run_router_bench(config, progress=False)
    saved = json.loads((tmp_path / "r.json").read_text())
    assert saved["rows"] == report["rows"] and (tmp_path / "r.png").stat().st_size > 0
    assert {(r["strategy"], r["category"]) for r in saved["rows"]} == {(s, c) for s in STRATEGIES for c in ("code", "edit", "all")}
    candidates = saved["meta"]["candidates"]
    assert "prompt-lookup" in candidates and "none" in candidates
    # Every evaluation prompt has each candidate pinned and one router run; the in-sample oracle
    # beats every table strategy on every category by construction.
    evaluation = [g for g in saved["requests"] if g["phase"] == "eval"]
    assert len(evaluation) == 2 * (len(candidates) + 1)
    for category in ("code", "edit", "all"):
        oracle = by(saved["rows"], ORACLE_IN_SAMPLE, category)
        assert by(saved["rows"], ORACLE, category) > 0 and all(by(saved["rows"], s, category) <= oracle + 1e-6 for s in (BEST_SINGLE, RANDOM, LEAST_SQUARES))
    routed = [g for g in saved["requests"] if g["draft"] == AUTO]
    assert routed and all(g["choice"] in candidates and g["reason"] for g in routed)
    # Evaluation generations are timed three times, by the median; warm-up ones once.
    for g in saved["requests"]:
        assert len(g["timings"]) == (3 if g["phase"] == "eval" else 1)
        assert g["seconds"] == pytest.approx(sorted(g["timings"])[len(g["timings"]) // 2], abs=1e-3)
    assert len(saved["regret"]) == len(routed)
