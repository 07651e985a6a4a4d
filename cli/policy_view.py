"""``specserve policy``: the cluster priors a deployment's new requests start from, as a table."""

from __future__ import annotations

import time

import requests

from specserve.ingress.auth import client_headers


def get_json(server: str, path: str, params: dict | None = None, timeout_s: float = 30.0) -> dict:
    """``GET path`` of a running deployment; the OpenAI error body's message when it refuses."""
    response = requests.get(f"{server.rstrip('/')}{path}", params=params, headers=client_headers(), timeout=timeout_s)
    if response.status_code != 200:
        try:
            message = response.json()["error"]["message"]
        except (ValueError, KeyError, TypeError):
            message = response.text[:200]
        raise RuntimeError(f"{server}{path} answered {response.status_code}: {message}")
    return response.json()


def fetch_policy(server: str, timeout_s: float = 30.0) -> dict:
    """``GET /v1/policy`` of a running deployment; a clear error when it has no policy service."""
    return get_json(server, "/v1/policy", timeout_s=timeout_s)


def format_policy(body: dict, now: float | None = None) -> str:
    now = time.time() if now is None else now
    snapshot, service = body.get("snapshot"), body.get("service") or {}
    learning = body.get("cluster_learning", "on")
    if learning != "on":   # an application without a Redis: nothing is shared, so no snapshot comes
        return f"cluster learning {learning}"
    lines = []
    if service.get("redis_error"):
        lines.append(f"policy service: Redis unreachable ({service['redis_error']}); replicas keep their last snapshot")
    if not snapshot:
        lines.append("no snapshot yet: the policy service publishes every "
                     f"{service.get('interval_s', '?')} s once replicas have reported steps")
        return "\n".join(lines)
    age = now - snapshot.get("published_at", now)
    lines.append(f"snapshot version {snapshot['version']}, published {age:.0f} s ago; half-life "
                 f"{snapshot.get('half_life_s', 0) / 60:.0f} min, priors need {snapshot.get('min_steps')} drafting steps")
    priors = snapshot.get("priors", [])
    if not priors:
        lines.append("no priors yet: too few drafting steps observed")
        return "\n".join(lines)
    header = f"{'target':24s} {'draft':28s} {'bucket':7s} {'steps':>8s} {'alpha':>6s} {'tau':>6s} {'best γ':>6s} {'c':>7s} {'off':>5s}"
    lines += [header, "-" * len(header)]
    for p in priors:
        ratio = "-" if p.get("latency_ratio") is None else f"{p['latency_ratio']:.3f}"
        lines.append(f"{p['target'][:24]:24s} {p['draft'][:28]:28s} {p['bucket']:7s} {p['steps']:8.0f} "
                     f"{p['alpha']:6.3f} {p['mean_accepted_len']:6.2f} {p['best_window']:6d} {ratio:>7s} "
                     f"{p['plain_share']:5.0%}")
    lines.append("alpha: accepted / (accepted + steps that broke early); tau: tokens per drafting step; "
                 "c: draft ms per token / verify ms; "
                 "off: steps with nothing drafted (policy off, or no proposal)")
    return "\n".join(lines)
