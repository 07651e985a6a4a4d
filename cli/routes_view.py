"""``specserve routes``: the draft router's latest decisions, with features and outcomes, as a table."""

from __future__ import annotations

import time

from specserve.cli.policy_view import get_json


def fetch_routes(server: str, limit: int = 20, timeout_s: float = 30.0) -> dict:
    """``GET /v1/routing/recent`` of a running deployment."""
    return get_json(server, "/v1/routing/recent", {"limit": limit}, timeout_s)


def format_routes(body: dict, now: float | None = None) -> str:
    now = time.time() if now is None else now
    routes = body.get("data") or []
    where = "the whole cluster (Redis)" if body.get("source") == "cluster" else "one target replica"
    if not routes:
        return f"no routing decisions yet, from {where}: send requests without spec.draft (or with \"auto\")"
    header = (f"{'age':>6s} {'request':10s} {'choice':22s} {'reason':9s} {'final':22s} {'pred α':>6s} "
              f"{'real α':>6s} {'tau':>5s} {'tokens':>6s} {'len':>5s} {'ppl':>6s} {'repeat':>6s}")
    lines = [f"the last {len(routes)} decisions, from {where}", header, "-" * len(header)]
    for r in routes:
        features = r.get("features_named") or {}
        realised = r.get("realised") or {}
        predicted = (r.get("predicted_alpha") or {}).get(r["choice"])
        observed = r.get("observed") or {}
        lines.append(
            f"{now - r.get('at', now):5.0f}s {r.get('request_id', '')[:10]:10s} {r['choice'][:22]:22s} {r['reason'][:9]:9s} "
            f"{r.get('final_draft', '')[:22]:22s} {_num(predicted):>6s} {_num(observed.get('alpha')):>6s} "
            f"{_num(realised.get('mean_accepted_len'), 2):>5s} {realised.get('tokens', 0):6d} "
            f"{features.get('prompt_tokens', ''):>5} {_num(features.get('perplexity'), 1):>6s} {_num(features.get('repeat_rate')):>6s}")
    return "\n".join(lines)


def _num(value, digits: int = 3) -> str:
    return "-" if value is None else f"{value:.{digits}f}"
