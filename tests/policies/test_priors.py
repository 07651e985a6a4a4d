"""Cluster priors from counters: the window objective of "A Drop-in Solution for On-the-Fly
Adaptation of Speculative Decoding in Large Language Models" (Eq. 1) with the cluster's measured
costs."""

from collections import Counter

import pytest

from specserve.policies.priors import best_window, compute_snapshot, find_prior
from specserve.policies.stats import StatsKey
from counters import counts



def test_best_window_is_zero_when_alpha_is_tiny_and_the_largest_when_alpha_is_high_and_verify_flat():
    assert best_window(0.01, draft_ms_per_token=1.0, b0=10.0, b1=0.0, window_max=8) == 0
    assert best_window(0.95, draft_ms_per_token=0.0, b0=10.0, b1=0.0, window_max=8) == 8
    # A steep verify cost pulls the window in: each token costs half a forward.
    assert best_window(0.6, draft_ms_per_token=0.0, b0=10.0, b1=5.0, window_max=8) < best_window(0.6, 0.0, 10.0, 0.0, 8)


def test_snapshot_alpha_cost_fit_and_latency_ratio():
    key = StatsKey("t", "pl", "p64", 0)
    c = counts(accepted=300, rejections=100) + counts(accepted=50, rejections=50, window=1, verify_ms=8.0, draft_ms=0.5)
    snapshot = compute_snapshot({key: c}, now=0.0)
    assert sorted(p["bucket"] for p in snapshot["priors"]) == ["all", "p64"]
    p = find_prior(snapshot, "t", "pl", "p64")
    assert p["alpha"] == pytest.approx(350 / 500, abs=1e-4)
    # verify ms 8 at γ = 1 and 10 at γ = 4: b(γ) = 7.333 + 0.667·γ
    assert p["verify_ms"] == pytest.approx([22 / 3, 2 / 3], abs=1e-3)
    assert p["draft_ms_per_token"] == pytest.approx((200 + 50) / (400 + 100))
    assert p["latency_ratio"] == pytest.approx(0.5 / (22 / 3), abs=1e-3)


def test_older_windows_weigh_less():
    old, new = StatsKey("t", "pl", "p64", 0), StatsKey("t", "pl", "p64", 3600)
    snapshot = compute_snapshot({old: counts(400, 0), new: counts(0, 100)}, now=3600.0, half_life_s=3600.0)
    p = find_prior(snapshot, "t", "pl", "p64")
    assert p["alpha"] == pytest.approx(200 / 300, abs=1e-4)       # the old window's 400 count as 200


def test_find_prior_falls_back_to_the_pooled_bucket():
    snapshot = compute_snapshot({StatsKey("t", "pl", "p64", 0): counts(300, 100)}, now=0.0)
    assert find_prior(snapshot, "t", "pl", "p1024")["bucket"] == "all"
    assert find_prior(snapshot, "t", "other", "p64") is None and find_prior(None, "t", "pl", "p64") is None


def test_a_topic_bucket_pools_into_its_length_bucket_and_a_topic_not_measured_starts_from_that():
    code, chat = counts(900, 100), counts(100, 300, window=1)
    snapshot = compute_snapshot({StatsKey("t", "pl", "p256-t0", 0): code, StatsKey("t", "pl", "p256-t1", 0): chat},
                                now=0.0)
    assert sorted(p["bucket"] for p in snapshot["priors"]) == ["all", "p256", "p256-t0", "p256-t1"]
    alpha = {b: find_prior(snapshot, "t", "pl", b)["alpha"] for b in ("p256-t0", "p256-t1", "p256")}
    assert alpha["p256-t0"] > alpha["p256"] > alpha["p256-t1"]
    assert alpha["p256"] == pytest.approx(1000 / 1400, abs=1e-4)    # counts add up across topics
    assert find_prior(snapshot, "t", "pl", "p256-t3")["bucket"] == "p256"   # a topic not measured yet
    assert find_prior(snapshot, "t", "pl", "p64-t0")["bucket"] == "all"     # nor its length
    assert find_prior(snapshot, "t", "pl", "p256-t1-grammar")["bucket"] == "all"


def test_the_best_tree_is_the_measured_fastest_shape_with_enough_steps():
    c = counts(300, 100)
    c.update({"tree_4x2_steps": 50, "tree_4x2_emitted": 150, "tree_4x2_us": 50 * 20_000,     # 0.15 tokens/ms
              "tree_3x3_steps": 50, "tree_3x3_emitted": 200, "tree_3x3_us": 50 * 25_000,     # 0.16
              "tree_6x4_steps": 5, "tree_6x4_emitted": 100, "tree_6x4_us": 5 * 10_000})      # too few steps
    p = find_prior(compute_snapshot({StatsKey("t", "pl", "p64", 0): c}, now=0.0), "t", "pl", "p64")
    assert p["best_tree"] == {"depth": 3, "top_k": 3, "tokens_per_ms": pytest.approx(0.16)}
    assert find_prior(compute_snapshot({StatsKey("t", "pl", "p64", 0): counts(300, 100)}, now=0.0),
                      "t", "pl", "p64")["best_tree"] is None


def test_the_best_window_never_exceeds_the_largest_window_measured():
    # Only γ = 4 seen at α = 0.9 with a flat verify cost: the objective would say 8, the data say
    # nothing beyond 4.
    p = find_prior(compute_snapshot({StatsKey("t", "pl", "p64", 0): counts(900, 100, draft_ms=0.0)}, now=0.0),
                   "t", "pl", "p64")
    assert p["best_window"] == 4


def test_a_flat_line_over_a_few_windows_says_nothing_about_longer_ones():
    # Windows 1-4 all cost 20 ms: the line is flat, and G(γ) on it would grow to γ = 8 at α = 0.9.
    c = sum((counts(225, 25, window=g, verify_ms=20.0, draft_ms=0.0) for g in (1, 2, 3, 4)), Counter())
    p = find_prior(compute_snapshot({StatsKey("t", "pl", "p64", 0): c}, now=0.0), "t", "pl", "p64")
    assert p["verify_ms"] == pytest.approx([20.0, 0.0]) and p["alpha"] == pytest.approx(0.9)
    assert best_window(0.9, 0.0, 20.0, 0.0, 8) == 8
    assert p["best_window"] == 4


def test_each_window_is_priced_at_what_it_cost_where_it_was_used():
    # Verification flat to γ = 5 and 4 ms dearer from γ = 6 (the CPU's matrix tiles), α = 0.6.
    c = sum((counts(150, 100, window=g, verify_ms=20.0 if g <= 5 else 24.0, draft_ms=0.0) for g in range(1, 9)),
            Counter())
    p = find_prior(compute_snapshot({StatsKey("t", "pl", "p64", 0): c}, now=0.0), "t", "pl", "p64")
    b0, b1 = p["verify_ms"]
    assert (b0, b1) == pytest.approx((18.29, 0.714), abs=1e-2)
    # The line smears the step over every window, so window 5 looks dearer than it was:
    # G(4) = 2.306 / 21.14 = .1091 beats G(5) = 2.383 / 21.86 = .1090 on it.
    assert best_window(0.6, 0.0, b0, b1, 8) == 4
    # Measured: G(5) = 2.383 / 20.0 = .119 beats G(4) = 2.306 / 20.0 and G(6) = 2.430 / 24.0 = .101.
    assert p["best_window"] == 5


def test_windows_are_best_per_load_and_warm_starts_pick_the_load_they_start_under():
    """Literal steps: alone, verifying 8 drafts costs about as much as 1 (flat); in a batch of 16
    every extra token costs (steep). The same α must then recommend a long window to a request
    starting on an idle replica and a short one to a request joining a busy one."""
    from specserve.policies.priors import warm_start
    from specserve.policies.stats import StatsCollector
    from specserve.replicas.step import RequestStep, Speculation, StepRecord

    collector = StatsCollector("t")
    collector.start("r", "pl", "p64")
    for gamma in (1, 2, 4, 8):
        for _ in range(30):
            # α ≈ 0.8: the chain breaks after 0.8 / 0.2 accepted tokens on average
            accepted = min(gamma, 3)
            step = RequestStep("r", "pl", Speculation(gamma), gamma, accepted, gamma, None)
            collector.observe(StepRecord(1, 1 + gamma, 0, 0.1, 20.0 + 0.1 * gamma, 0.0, (step,)))
            others = tuple(RequestStep(f"o{i}", "pl", Speculation(gamma), gamma, accepted, gamma, None) for i in range(15))
            collector.observe(StepRecord(16, 16 * (1 + gamma), 0, 0.1, 40.0 + 25.0 * gamma, 0.0, (step, *others)))
    snapshot = {**compute_snapshot(collector.drain(), now=0.0), "version": 3}
    prior = find_prior(snapshot, "t", "pl", "p64")
    by_load = prior["best_window_by_load"]
    assert set(by_load) == {"b1", "b8+"} and by_load["b1"] == 8 and by_load["b8+"] < 4
    idle, busy = (warm_start(snapshot, "t", "pl", "p64", batch_size=b) for b in (1, 16))
    assert (idle["load"], idle["window"]) == ("b1", 8) and (busy["load"], busy["window"]) == ("b8+", by_load["b8+"])
    # A load never measured takes the nearest one measured (b4 -> b1, b8 -> b8+).
    assert warm_start(snapshot, "t", "pl", "p64", batch_size=3)["load"] == "b1"
    assert warm_start(snapshot, "t", "pl", "p64", batch_size=7)["load"] == "b8+"
    # A snapshot from before load buckets: the pooled window, no load.
    old = {**snapshot, "priors": [{k: v for k, v in p.items() if k not in ("best_window_by_load", "costs_by_load")}
                                  for p in snapshot["priors"]]}
    start = warm_start(old, "t", "pl", "p64", batch_size=16)
    assert start["load"] is None and start["window"] == max(1, prior["best_window"])


def test_a_load_this_task_never_saw_is_priced_with_the_pooled_costs_of_that_load_at_the_tasks_alpha():
    from specserve.policies.priors import warm_start

    flat = {"draft_ms_per_token": 0.05, "verify_ms": [20.0, 0.1], "windows": [1, 4]}
    snapshot = {"version": 1, "priors": [
        {"target": "t", "draft": "pl", "bucket": "p256", "alpha": 0.9, "best_window": 2, "best_window_by_load": {"b8+": 1}},
        {"target": "t", "draft": "pl", "bucket": "all", "alpha": 0.4, "best_window": 2, "best_window_by_load": {"b1": 3},
         "costs_by_load": {"b1": flat}}]}
    start = warm_start(snapshot, "t", "pl", "p256", batch_size=1)
    # The task's α (0.9, not the pool's 0.4) on the idle replica's flat verify cost, extended past
    # the largest window measured because two windows gave the slope.
    assert (start["load"], start["window"]) == ("b1", 8)
    one_window = {**flat, "windows": [4]}
    snapshot["priors"][1]["costs_by_load"]["b1"] = one_window
    assert warm_start(snapshot, "t", "pl", "p256", batch_size=1)["window"] == 4   # no slope: no further than measured
