"""``specserve routes``'s table from a literal GET /v1/routing/recent body."""

from specserve.cli.routes_view import format_routes


def test_table_shows_each_decision_and_its_outcome():
    body = {"object": "list", "source": "cluster", "data": [{
        "request_id": "abcdef0123456789", "at": 100.0, "choice": "prompt-lookup", "reason": "explore",
        "predicted_alpha": {"prompt-lookup": 0.61, "smollm2-hsr": 0.4}, "final_draft": "smollm2-hsr",
        "observed": {"draft": "smollm2-hsr", "alpha": 0.55}, "switches": [{"from": "prompt-lookup", "to": "smollm2-hsr"}],
        "realised": {"mean_accepted_len": 2.5, "tokens": 128},
        "features_named": {"prompt_tokens": 321, "perplexity": 7.25, "repeat_rate": 0.31, "topics": []}}]}
    text = format_routes(body, now=112.0)
    assert "whole cluster" in text
    row = text.splitlines()[-1]
    for cell in ("12s", "abcdef0123", "prompt-lookup", "explore", "smollm2-hsr", "0.610", "0.550", "2.50", "128", "321", "7.2",
                 "0.310"):
        assert cell in row, (cell, row)
    assert "no routing decisions yet" in format_routes({"data": [], "source": "replica"})
