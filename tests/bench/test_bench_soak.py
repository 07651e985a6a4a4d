"""The soak benchmark: its windows, percentiles, memory growth and aims on literal data (a short
real run against a live stack is in ``tests/e2e/test_serve_app.py``)."""

from __future__ import annotations

from specserve.bench.soak import SoakRecord, aims, memory_growth, percentile, warmup_s, windows


def test_nearest_rank_percentiles():
    values = [float(v) for v in range(1, 101)]
    assert percentile(values, 50) == 50.0 and percentile(values, 95) == 95.0 and percentile(values, 99) == 99.0
    assert percentile([3.0], 99) == 3.0 and percentile([], 50) is None


def test_windows_group_requests_by_start_and_count_failures():
    records = [SoakRecord(0, 1.0, "code", "none", False, ok=True, latency_s=2.0, ttft_s=0.1, output_tokens=30),
               SoakRecord(1, 5.0, "chat", "auto", True, ok=True, latency_s=4.0, ttft_s=0.3, output_tokens=10),
               SoakRecord(2, 12.0, "edit", "default", False, ok=False, error="HTTP 503"),
               SoakRecord(3, 14.0, "code", "none", False, ok=True, latency_s=1.0, ttft_s=0.2, output_tokens=20)]
    rows = windows(records, 10.0, 20.0)
    assert [r["requests"] for r in rows] == [2, 2] and [r["failed"] for r in rows] == [0, 1]
    assert rows[0]["latency_p50_s"] == 2.0 and rows[0]["latency_p99_s"] == 4.0 and rows[0]["ttft_p95_s"] == 0.3
    assert rows[0]["output_tokens_per_s"] == 4.0 and rows[1]["latency_p50_s"] == 1.0
    empty = windows([], 10.0, 30.0)
    assert len(empty) == 3 and empty[0]["latency_p50_s"] is None


def test_memory_growth_compares_the_last_window_with_the_first_after_warm_up():
    mb = 2**20
    samples = [(t, {"target#a": (500 + (40 if t < 10 else 0) + t // 10) * mb, "ingress#b": 100 * mb})
               for t in range(0, 60, 5)]
    growth = memory_growth(samples, warmup=10.0, window_s=10.0)
    # target: 501 MB over [10, 20), 505 MB over (45, 55]: +0.8%; the warm-up's 540 MB is left out.
    assert growth["target#a"]["after_warmup_mb"] == 501.0 and growth["target#a"]["last_mb"] == 505.0
    assert abs(growth["target#a"]["growth"] - (505 / 501 - 1)) < 1e-4
    assert growth["ingress#b"]["growth"] == 0.0
    result = aims([SoakRecord(0, 0.0, "code", "none", False, ok=True)], growth)
    assert result["zero_failed"] and result["memory_growth_below_5pct"] and result["failed"] == 0
    leaking = memory_growth([(t, {"target#a": (100 + t) * mb}) for t in range(0, 60, 5)], 10.0, 10.0)
    assert not aims([], leaking)["memory_growth_below_5pct"]
    assert aims([SoakRecord(0, 0.0, "code", "none", False, error="x")], {})["memory_growth_below_5pct"] is None


def test_warm_up_is_a_fifth_of_the_run_at_most_a_minute():
    assert warmup_s(100.0) == 20.0 and warmup_s(600.0) == 60.0
