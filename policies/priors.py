"""Cluster priors from the counters of every replica, and the snapshot replicas start requests from.

Per (target, draft, task bucket), from counters summed over time windows with exponential decay
(weight 0.5^(age / half_life), so the priors follow drift without forgetting at once):

    α                Σ accepted / (Σ accepted + Σ 1[n < γ]), capped at α_max (Eq. 2 of "A Drop-in
                     Solution for On-the-Fly Adaptation of Speculative Decoding in Large Language
                     Models")
    accepted length  emitted tokens per drafting step (τ)
    by position      P(draft token i accepted | offered), vLLM's per-position acceptance
    a                draft ms per draft token; b(γ) verify ms of a step at window γ (least
                     squares over the windows seen; flat when only one was seen)
    latency ratio    a / b(0), the cost of a draft token relative to a target forward (the paper's §5)
    best window      argmax over γ of G(γ) = E(γ) / (γ·a + b(γ)), E(γ) = (1 − α^(γ+1)) / (1 − α)
                     (the paper's Eq. 1 with the cluster's measured costs), pooled and per load
                     bucket of the batch size (``best_window_by_load``: a and b(γ) measured under
                     that load only; warm starts pick the one of the load they start under).
                     b(γ) is the mean verify ms measured at γ where γ was used (shrunk towards the
                     line by ``LINE_STEPS`` pseudo-steps), the line elsewhere; past the largest
                     window measured only when the line rises (``window_for``)
    best tree        among the tree shapes (depth, top-k) requests asked for, the one whose steps
                     emitted the most tokens per ms of draft + verify time, measured (no model of
                     tree acceptance is assumed); only shapes with ``min_steps`` steps compete,
                     and a narrower bucket keeps the wider bucket's best unless it measured that
                     shape too; pooled and per load bucket (``best_tree_by_load``), as windows
    learned          the decayed sums of the rules' carried counts (``carry.py``), which requests
                     of this draft and bucket start their rule's state from

A bucket's prior is published only after ``min_steps`` drafting steps. A topic bucket
(``p256-t2``) is pooled into its length bucket (``p256``) and every bucket into an ``all`` bucket
per (target, draft): a request starts from the most specific of these that has a prior.
"""

from __future__ import annotations

import time
from collections import Counter, defaultdict

from specserve.policies.carry import LEARNED
from specserve.policies.goodput import expected_emitted
from specserve.policies.stats import LOAD_BUCKETS, StatsKey, load_bucket, without_topic

ALL_BUCKETS = "all"
SNAPSHOT_FORMAT = 1
# Pseudo-steps of the fitted line in a window's measured verify cost: a window used a few times
# is priced mostly by the line, one used often by what it cost.
LINE_STEPS = 4.0


def _decayed(counts: dict[StatsKey, Counter], now: float, half_life_s: float) -> dict[tuple[str, str, str], dict[str, float]]:
    sums: dict[tuple[str, str, str], dict[str, float]] = defaultdict(lambda: defaultdict(float))
    for key, c in counts.items():
        weight = 0.5 ** (max(0.0, now - key.window_start) / half_life_s)
        for bucket in dict.fromkeys((key.bucket, without_topic(key.bucket), ALL_BUCKETS)):
            into = sums[(key.target, key.draft, bucket)]
            for field, n in c.items():
                into[field] += weight * n
    return sums


def _verify_fit(c: dict[str, float], load: str | None = None) -> tuple[float, float] | None:
    """(b0, b1) of verify ms ≈ b0 + b1·γ, weighted by steps per window; b1 = 0 with one window.
    ``load``: from that load bucket's counters only (``stats.load_bucket``); None: every step."""
    points = []
    for gamma, steps in _steps_by_window(c, load).items():
        us = c.get(f"verify_us_w{gamma}" if load is None else f"load_{load}_verify_us_w{gamma}", 0.0)
        points.append((gamma, us / steps / 1e3, steps))
    if not points:
        return None
    total = sum(w for _, _, w in points)
    mean_g = sum(g * w for g, _, w in points) / total
    mean_v = sum(v * w for _, v, w in points) / total
    var = sum(w * (g - mean_g) ** 2 for g, _, w in points)
    slope = 0.0 if var == 0 else max(0.0, sum(w * (g - mean_g) * (v - mean_v) for g, v, w in points) / var)
    return mean_v - slope * mean_g, slope


def _steps_by_window(c: dict[str, float], load: str | None = None) -> dict[int, float]:
    """Drafting steps per window γ: all of them, or those of one load bucket."""
    prefix = "window_" if load is None else f"load_{load}_steps_w"
    return {int(f.removeprefix(prefix)): n for f, n in c.items() if f.startswith(prefix) and n > 0}


def _windows_seen(c: dict[str, float]) -> list[int]:
    return list(_steps_by_window(c))


def best_window(alpha: float, draft_ms_per_token: float, b0: float, b1: float, window_max: int,
                measured: dict[int, float] | None = None) -> int:
    """argmax of G(γ) over 0..``window_max``; b(γ) from ``measured`` where given, else the line."""
    measured = measured or {}

    def goodput(gamma: int) -> float:
        verify_ms = measured.get(gamma, b0 + b1 * gamma)
        return expected_emitted(alpha, gamma) / (gamma * draft_ms_per_token + max(1e-6, verify_ms))
    return max(range(window_max + 1), key=lambda g: (goodput(g), -g))


def _verify_by_window(c: dict[str, float], fit: tuple[float, float], load: str | None = None) -> dict[str, float]:
    """Verify ms per window used (JSON keys), each window's mean shrunk towards the line by
    ``LINE_STEPS``: on a CPU b(γ) can be flat over small windows and step up at one size (the
    matrix products' tiles), which a line through every window would smear over all of them."""
    out = {}
    for gamma, steps in sorted(_steps_by_window(c, load).items()):
        us = c.get(f"verify_us_w{gamma}" if load is None else f"load_{load}_verify_us_w{gamma}", 0.0)
        line = fit[0] + fit[1] * gamma
        out[str(gamma)] = round((us / 1e3 + LINE_STEPS * line) / (steps + LINE_STEPS), 4)
    return out


def costs_by_load(c: dict[str, float], pooled_a: float, min_steps: int) -> dict[str, dict]:
    """The cost side measured under each load bucket with ``min_steps`` drafting steps: draft ms
    per token, the verify fit, the windows it was measured over and each one's verify cost."""
    out = {}
    for load in LOAD_BUCKETS:
        steps = _steps_by_window(c, load)
        fit = _verify_fit(c, load)
        if fit is None or sum(steps.values()) < min_steps:
            continue
        tokens = c.get(f"load_{load}_draft_tokens", 0.0)
        a = c.get(f"load_{load}_draft_us", 0.0) / 1e3 / tokens if tokens else pooled_a
        out[load] = {"draft_ms_per_token": round(a, 4), "verify_ms": [round(fit[0], 4), round(fit[1], 4)],
                     "windows": sorted(steps), "verify_ms_by_window": _verify_by_window(c, fit, load)}
    return out


def window_for(alpha: float, costs: dict, window_max: int) -> int:
    """The best window at α for one load's measured costs: each measured window at what it cost,
    the line elsewhere. Beyond the largest window measured only when the line rises (two windows or
    more, slope > 0: extending it is a model). A flat line says nothing about longer windows,
    where the verify cost may step up (the matrix products' tiles), and with one window seen b(γ)
    is flat by construction: extended, either would recommend windows longer than the costs
    allow."""
    windows = costs["windows"]
    rises = len(windows) >= 2 and costs["verify_ms"][1] > 0
    limit = window_max if rises else min(window_max, max(windows))
    measured = {int(g): ms for g, ms in (costs.get("verify_ms_by_window") or {}).items()}
    return best_window(alpha, costs["draft_ms_per_token"], *costs["verify_ms"], limit, measured)


def prior_of(target: str, draft: str, bucket: str, c: dict[str, float], alpha_max: float, window_max: int,
             min_steps: int = 20) -> dict | None:
    drafts = c.get("drafts", 0.0)
    fit = _verify_fit(c)
    if drafts <= 0 or fit is None:
        return None
    accepted, rejections = c.get("accepted_tokens", 0.0), c.get("rejections", 0.0)
    alpha = min(alpha_max, accepted / (accepted + rejections)) if accepted + rejections > 0 else 0.0
    offered = Counter()
    for field, n in c.items():
        if field.startswith("window_"):
            gamma = int(field.removeprefix("window_"))
            for i in range(gamma):
                offered[i] += n
    by_position = [round(c.get(f"accepted_pos_{i}", 0.0) / offered[i], 4) for i in sorted(offered) if offered[i] > 0]
    draft_tokens = c.get("draft_tokens", 0.0)
    a = c.get("draft_us", 0.0) / 1e3 / draft_tokens if draft_tokens else 0.0
    b0, b1 = fit
    return {
        "target": target, "draft": draft, "bucket": bucket,
        "steps": round(drafts, 2),
        "requests": round(c.get("requests", 0.0), 2),
        "alpha": round(alpha, 4),
        "mean_accepted_len": round(c.get("emitted", 0.0) / drafts, 4),
        "acceptance_by_position": by_position,
        "draft_ms_per_token": round(a, 4),
        "verify_ms": [round(b0, 4), round(b1, 4)],
        "latency_ratio": round(a / b0, 4) if b0 > 0 else None,
        "best_window": window_for(alpha, {"draft_ms_per_token": a, "verify_ms": [b0, b1], "windows": _windows_seen(c),
                                          "verify_ms_by_window": _verify_by_window(c, fit)}, window_max),
        "costs_by_load": (by_load := costs_by_load(c, a, min_steps)),
        "best_window_by_load": {load: window_for(alpha, costs, window_max) for load, costs in by_load.items()},
        "plain_share": round(c.get("plain_steps", 0.0) / (c.get("plain_steps", 0.0) + drafts), 4),
        "best_tree": best_tree(c, min_steps),
        "best_tree_by_load": {load: tree for load in LOAD_BUCKETS
                              if (tree := best_tree(c, min_steps, f"load_{load}_")) is not None},
        "learned": {field: round(n, 4) for field, n in sorted(c.items()) if LEARNED.fullmatch(field) and n > 0},
    }


def best_tree(c: dict[str, float], min_steps: int, prefix: str = "") -> dict | None:
    """Among the tree shapes with ``min_steps`` steps (``prefix``: of one load bucket's counters),
    the one whose steps emitted the most tokens per ms of draft + verify time; None: none."""
    trees = {}
    for field, steps in c.items():
        if field.startswith(f"{prefix}tree_") and field.endswith("_steps") and steps >= min_steps:
            shape = field.removesuffix("_steps")
            us = c.get(f"{shape}_us", 0.0)
            trees[shape] = c.get(f"{shape}_emitted", 0.0) / (us / 1e3) if us > 0 else 0.0
    if not trees:
        return None
    depth, top_k = max(trees, key=trees.get).removeprefix(f"{prefix}tree_").split("x")
    return {"depth": int(depth), "top_k": int(top_k), "tokens_per_ms": round(max(trees.values()), 4)}


def compute_snapshot(counts: dict[StatsKey, Counter], now: float | None = None, half_life_s: float = 3600.0,
                     min_steps: int = 20, alpha_max: float = 0.95, window_max: int = 8) -> dict:
    """The snapshot document (without version: ``RedisStats.publish_snapshot`` stamps it)."""
    now = time.time() if now is None else now
    priors = []
    sums = _decayed(counts, now, half_life_s)
    for (target, draft, bucket), c in sorted(sums.items()):
        if c.get("drafts", 0.0) < min_steps:
            continue
        prior = prior_of(target, draft, bucket, c, alpha_max, window_max, min_steps)
        if prior is not None:
            priors.append(prior)
    _wider_trees_where_unmeasured(priors, sums, min_steps)
    return {"format": SNAPSHOT_FORMAT, "computed_at": now, "half_life_s": half_life_s, "min_steps": min_steps,
            "priors": priors}


def _wider_trees_where_unmeasured(priors: list[dict], sums: dict, min_steps: int) -> None:
    """A bucket's best tree has beaten only the shapes its own requests used: where the best shape
    of the bucket that pools it (a topic's length bucket, a length bucket's ``all``) has fewer than
    ``min_steps`` steps in it, per load and pooled, it takes that shape instead. Widest first, so
    that a length bucket's choice is settled before its topics read it."""
    by_bucket = {(p["target"], p["draft"], p["bucket"]): p for p in priors}
    for prior in sorted(priors, key=lambda p: len(_wider(p["bucket"]))):
        key = (prior["target"], prior["draft"])
        wider = next((by_bucket[(*key, b)] for b in _wider(prior["bucket"]) if (*key, b) in by_bucket), None)
        if wider is None:
            continue
        c = sums[(*key, prior["bucket"])]
        for load in (None, *LOAD_BUCKETS):
            best = wider["best_tree"] if load is None else wider["best_tree_by_load"].get(load)
            prefix = "" if load is None else f"load_{load}_"
            if best is None or c.get(f"{prefix}tree_{best['depth']}x{best['top_k']}_steps", 0.0) >= min_steps:
                continue
            if load is None:
                prior["best_tree"] = dict(best)
            else:
                prior["best_tree_by_load"][load] = dict(best)


def warm_start(snapshot: dict | None, target: str, draft: str, bucket: str, batch_size: int = 1) -> dict | None:
    """Where a request that did not pin its window or tree starts, from the cluster's prior for
    its draft and task bucket (``stats.request_bucket``: prompt length, topic, constrained or not):
    ``{"version", "bucket", "load", "alpha", "window", "tree", "learned"}``, or None (cold).
    ``tree``: the (depth, top-k) that paid best under the request's load, else over every load
    (a bucket that measured no shape carries its wider bucket's: ``compute_snapshot``); None: no
    tree measured; ``learned``: the rules' carried sums (``carry.py``).
    The target replica and ``bench policies`` both start requests through here.

    The window is the best one under the load the request starts in (``batch_size``, its
    replica's running requests with it; ``_load_window`` says where its costs come from). Priors learned
    under load recommend small windows that would cost an idle replica's request speed.

    The window is at least 1: a prior of γ = 0 still starts drafting, because the per-step policy
    decides whether to switch speculation off and must see the draft to learn; its α counts as
    pseudo-steps in that policy's estimate (``window.estimate_alpha``).
    """
    prior = find_prior(snapshot, target, draft, bucket)
    if prior is None:
        return None
    load, window = _load_window(snapshot, prior, load_bucket(batch_size))
    tree = _tree(prior, load_bucket(batch_size))
    return {"version": snapshot.get("version"), "bucket": prior["bucket"], "load": load, "alpha": prior["alpha"],
            "window": max(1, int(window)), "tree": None if tree is None else (tree["depth"], tree["top_k"]),
            "learned": prior.get("learned") or {}}


def _tree(prior: dict, load: str) -> dict | None:
    """The prior's best tree under ``load``, else its best over every load; None: none measured."""
    return (prior.get("best_tree_by_load") or {}).get(load) or prior.get("best_tree")


def _load_window(snapshot: dict, prior: dict, wanted: str, window_max: int = 8) -> tuple[str | None, int]:
    """(the load bucket whose costs priced the window, the window) for a request of ``prior``'s
    task starting under load ``wanted``: that load measured for this task; else the costs measured
    under that load for the draft's pooled bucket, priced at this task's α (acceptance depends on
    the task, costs on the load); else the nearest load measured for this task (the lighter on a
    tie); else the pooled window."""
    by_load = prior.get("best_window_by_load") or {}
    if wanted in by_load:
        return wanted, by_load[wanted]
    pooled = find_prior(snapshot, prior["target"], prior["draft"], ALL_BUCKETS) or {}
    costs = (pooled.get("costs_by_load") or {}).get(wanted)
    if costs is not None:
        return wanted, window_for(prior["alpha"], costs, window_max)
    if by_load:
        index = LOAD_BUCKETS.index(wanted)
        load = min(by_load, key=lambda b: (abs(LOAD_BUCKETS.index(b) - index), LOAD_BUCKETS.index(b)))
        return load, by_load[load]
    return None, prior["best_window"]


def _wider(bucket: str) -> list[str]:
    """The buckets that pool ``bucket``, narrowest first: its length bucket (a topic's), ``all``."""
    return [b for b in dict.fromkeys((without_topic(bucket), ALL_BUCKETS)) if b != bucket]


def find_prior(snapshot: dict | None, target: str, draft: str, bucket: str) -> dict | None:
    """The prior for a request: its bucket's, else its length bucket's (a topic bucket not
    measured yet), else the draft's pooled ``all``; None when absent."""
    if not snapshot:
        return None
    mine = {p["bucket"]: p for p in snapshot.get("priors", ()) if p["target"] == target and p["draft"] == draft}
    return next((mine[b] for b in (bucket, *_wider(bucket)) if b in mine), None)
