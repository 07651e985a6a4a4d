"""The soak benchmark: its windows, percentiles, memory growth and aims on literal data, and a short
real run against a live local stack."""

from __future__ import annotations

import json
import os
import subprocess
import sys

import pytest

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


@pytest.mark.reference
@pytest.mark.slow
@pytest.mark.e2e
def test_a_short_soak_on_the_local_stack(tmp_path):
    """``specserve bench soak`` end to end: brings the local stack up, sends the mix for 20 s, takes
    it down; every request succeeds, every window has percentiles, and the replicas' memory was
    sampled (the target's among them)."""
    out, plot = tmp_path / "soak.json", tmp_path / "soak.png"
    env = {**os.environ, "SPECSERVE_HOME": str(tmp_path / "home"), "RAY_AUTH_MODE": "token"}
    result = subprocess.run(
        [sys.executable, "-m", "specserve.cli.main", "bench", "soak", "--minutes", "0.34", "--rate", "0.6",
         "--max-tokens", "12", "--window-s", "10", "--sample-s", "2", "--dtype", "float32",
         "--json", str(out), "--plot", str(plot)],
        capture_output=True, text=True, timeout=900, env=env)
    assert result.returncode == 0, result.stdout[-2000:] + result.stderr[-3000:]
    report = json.loads(out.read_text())
    assert report["totals"]["requests"] >= 4 and report["aims"]["zero_failed"], report["failures"]
    assert {r["spec"] for r in report["requests"]} >= {"default", "none"} or len(report["requests"]) < 6
    assert len(report["windows"]) == 3 and report["windows"][0]["latency_p50_s"] is not None
    assert report["memory"]["available"]
    targets = [name for name in report["memory"]["growth"] if name.startswith("target#")]
    assert targets and all(report["memory"]["growth"][t]["after_warmup_mb"] > 100 for t in targets)
    assert plot.stat().st_size > 10_000 and "aims:" in result.stdout
