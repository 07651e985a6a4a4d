"""`specserve policy`'s table, from a snapshot the policy service computes from real counters."""

from specserve.cli.policy_view import format_policy
from specserve.policies.priors import compute_snapshot
from specserve.policies.stats import StatsKey
from counters import counts


def test_the_table_shows_each_prior_and_its_age():
    snapshot = {**compute_snapshot({StatsKey("smollm2", "prompt-lookup", "p64", 0): counts(300, 100)}, now=0.0),
                "version": 3, "published_at": 100.0}
    text = format_policy({"snapshot": snapshot, "service": {"redis_error": None, "interval_s": 10}}, now=160.0)
    assert "snapshot version 3, published 60 s ago" in text
    rows = [line for line in text.splitlines() if line.startswith("smollm2")]
    assert len(rows) == 2 and all("prompt-lookup" in r and "0.750" in r for r in rows)   # α = 300 / 400


def test_no_snapshot_and_a_redis_outage_are_said_plainly():
    text = format_policy({"snapshot": None, "service": {"redis_error": "ConnectionError: refused", "interval_s": 10}})
    assert "Redis unreachable (ConnectionError: refused)" in text and "no snapshot yet" in text


def test_the_cli_says_what_to_do_when_nothing_is_up(tmp_path):
    from typer.testing import CliRunner

    from specserve.cli.main import app

    result = CliRunner().invoke(app, ["policy"], env={"SPECSERVE_HOME": str(tmp_path)})
    assert result.exit_code == 2 and "specserve up" in result.stderr and "--server" in result.stderr


def test_an_application_without_redis_is_said_to_learn_alone():
    text = format_policy({"object": "policy_snapshot", "cluster_learning": "off: no redis_url configured; each "
                          "replica learns alone", "snapshot": None, "service": None})
    assert text.startswith("cluster learning off: no redis_url configured")
