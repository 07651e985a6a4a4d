"""``specserve bench suffix``: what the cluster's suffix index buys on a workload that repeats
itself, over HTTP, cold against warm, and on the replica that answered first against another.

The workload: every prompt is asked, then asked again (``again``) the way a service sees it come
back: restated (``--restate system``: the same question under a system prompt, another client's
wording, so the answer is alike but not the same and the prompt's prefix differs) or exactly
(``--restate exact``: a regenerate, an agent re-running a step). Rows, each on the same prompts:
target-only, prompt lookup, the suffix draft and the deployment's default (``auto``), every row
with a ``cache_salt`` of its own, so that its first round finds no output of another row in the
index (the index is per salt, like the prefix cache) and its second round finds its own first.

The second round is split by the replica that answered it (``spec.replica``): the one that
answered the same prompt in the first round, or another one, which knows the answer only from
the outputs the replicas share through Redis. A restated prompt has another prefix, so the prefix
affinity router does not pin it to the first replica and both cases occur (the shipped default
runs two target replicas).
"""

from __future__ import annotations

import asyncio
import json
import math
import time
import uuid
from dataclasses import dataclass
from pathlib import Path

from specserve.bench.engine import machine_info
from specserve.bench.serve import (NO_DRAFT, RequestRecord, RowConfig, load_run, local_stack_config, mixed_prompts,
                                   salt_for, served_model, summarise)
from specserve.cluster.config import PROMPT_LOOKUP, SUFFIX
from specserve.cluster.serve_config import SUFFIX_DRAFT
from specserve.ingress.auth import client_headers

RESTATEMENTS = ("system", "exact")
SYSTEM = "You are a helpful assistant. Answer the user's request."


@dataclass(frozen=True, kw_only=True)
class SuffixBenchConfig:
    json_path: Path = Path("bench-suffix.json")
    plot_path: Path = Path("bench-suffix.png")
    server: str | None = None
    num_prompts: int = 16
    max_tokens: int = 128
    categories: tuple[str, ...] = ("chat", "code")
    concurrency: int = 1
    restate: str = "system"
    suffix: str = SUFFIX
    dtype: str = "auto"
    settle_s: float = 3.0   # between the rounds: the outputs reach Redis and every replica's index

    def __post_init__(self) -> None:
        if self.restate not in RESTATEMENTS:
            raise ValueError(f"--restate is one of {', '.join(RESTATEMENTS)}, got {self.restate!r}")
        if self.num_prompts < 1 or self.max_tokens < 1 or self.concurrency < 1:
            raise ValueError("--prompts, --max-tokens and --concurrency must be at least 1")


def local_config(dtype: str) -> dict:
    """The shipped default application, with a suffix draft added if it has none."""
    config = local_stack_config(dtype, None)
    args = config["applications"][0]["args"]
    if not any(d.get("method") == SUFFIX for d in args["drafts"]):
        args["drafts"].append(dict(SUFFIX_DRAFT))
    return config


def by_replica(first: list[RequestRecord], again: list[RequestRecord]) -> dict[str, list[RequestRecord]]:
    """The second round's records, by whether the replica that answered the first round's same
    prompt answered them too."""
    where = {r.prompt_index: r.replica for r in first if r.ok}
    split = {"same_replica": [], "other_replica": []}
    for r in again:
        if r.ok and r.prompt_index in where and r.replica:
            split["same_replica" if r.replica == where[r.prompt_index] else "other_replica"].append(r)
    return split


def decode_rate(records: list[RequestRecord]) -> float | None:
    """Output tokens per second of the requests' own time (first token to last, summed): what one
    stream sees, independent of the waits between requests."""
    ok = [r for r in records if r.ok and r.output_tokens > 1]
    busy = sum(r.latency_s - r.ttft_s for r in ok)
    return round(sum(r.output_tokens - 1 for r in ok) / busy, 2) if busy > 0 else None


def run_suffix_bench(config: SuffixBenchConfig) -> dict:
    from specserve.cluster import local

    labelled = mixed_prompts(list(config.categories), config.num_prompts)
    prompts = [p for _, p in labelled]
    started = config.server is None
    if started:
        print("bringing the local stack up (specserve up)...", flush=True)
        server = local.up(local_config(config.dtype)).http_url
    else:
        server = config.server.rstrip("/").removesuffix("/v1")
    try:
        listed = served_model(server, client_headers())
        if config.suffix not in listed.get("drafts", []):
            raise ValueError(f"{server} serves no draft {config.suffix!r} (drafts: {', '.join(listed.get('drafts', []))})")
        model = listed["id"]
        rows = [RowConfig("target-only", "serve", server, model, NO_DRAFT, 0),
                RowConfig(PROMPT_LOOKUP, "serve", server, model, PROMPT_LOOKUP),
                RowConfig(config.suffix, "serve", server, model, config.suffix),
                RowConfig("default", "serve", server, model)]
        run_id = uuid.uuid4().hex[:8]
        system = SYSTEM if config.restate == "system" else None
        # Warm-up on a salt of its own: the first calls through Serve and the first forwards are slow.
        for row in rows:
            asyncio.run(load_run(prompts[:1], row, 1, math.inf, 8, cache_salt=salt_for(run_id, "warm-up")))
        rounds: dict[str, dict[str, tuple[list[RequestRecord], float]]] = {"first": {}, "again": {}}
        for name, sys_prompt in (("first", None), ("again", system)):
            for row in rows:
                print(f"{row.name}: {name} round, {len(prompts)} prompts, {config.concurrency} at a time", flush=True)
                rounds[name][row.name] = asyncio.run(load_run(
                    prompts, row, config.concurrency, math.inf, config.max_tokens,
                    cache_salt=salt_for(run_id, row.name), system=sys_prompt))
            if name == "first":
                time.sleep(config.settle_s)
        machine = machine_info()
    finally:
        if started:
            local.down()

    results = []
    for row in rows:
        first, first_s = rounds["first"][row.name]
        again, again_s = rounds["again"][row.name]
        entry = {"row": row.name, "draft": row.draft or "auto",
                 "first": {**summarise(first, first_s), "decode_tokens_per_s": decode_rate(first)},
                 "again": {**summarise(again, again_s), "decode_tokens_per_s": decode_rate(again)}}
        for where, records in by_replica(first, again).items():
            entry["again"][where] = {"requests": len(records), "decode_tokens_per_s": decode_rate(records),
                                     "mean_accepted_len": round(sum(r.output_tokens for r in records)
                                                                / max(1, sum(r.steps for r in records)), 3)}
        results.append(entry)
    result = {"meta": {"server": server, "model": model, "dtype": config.dtype, "prompts": config.num_prompts,
                       "categories": list(config.categories), "max_tokens": config.max_tokens,
                       "concurrency": config.concurrency, "restate": config.restate,
                       "placement": listed.get("placement", {}), "machine": machine,
                       "date": time.strftime("%Y-%m-%d")},
              "rows": results}
    config.json_path.parent.mkdir(parents=True, exist_ok=True)
    config.json_path.write_text(json.dumps(result, indent=2) + "\n")
    plot(result, config.plot_path)
    print(format_table(result))
    print(f"\nwrote {config.json_path} and {config.plot_path}")
    return result


def format_table(result: dict) -> str:
    lines = [f"{'row':14s} {'first tok/s':>11s} {'τ':>5s} {'again tok/s':>11s} {'τ':>5s} "
             f"{'same replica':>14s} {'other replica':>15s}"]
    for r in result["rows"]:
        first, again = r["first"], r["again"]

        def cell(part: dict) -> str:
            rate = part.get("decode_tokens_per_s")
            return f"{rate or 0:6.1f} ({part.get('requests', 0)})"

        lines.append(f"{r['row']:14s} {first['decode_tokens_per_s'] or 0:11.1f} {first['mean_accepted_len'] or 0:5.2f} "
                     f"{again['decode_tokens_per_s'] or 0:11.1f} {again['mean_accepted_len'] or 0:5.2f} "
                     f"{cell(again.get('same_replica', {})):>14s} {cell(again.get('other_replica', {})):>15s}")
    return "\n".join(lines)


def plot(result: dict, path: Path) -> None:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    rows = result["rows"]
    series = [("first round", lambda r: r["first"]["decode_tokens_per_s"]),
              ("again, same replica", lambda r: r["again"].get("same_replica", {}).get("decode_tokens_per_s")),
              ("again, other replica", lambda r: r["again"].get("other_replica", {}).get("decode_tokens_per_s"))]
    fig, ax = plt.subplots(figsize=(8, 4))
    width = 0.8 / len(series)
    for k, (label, value) in enumerate(series):
        ax.bar([i + k * width for i in range(len(rows))], [value(r) or 0 for r in rows], width, label=label)
    ax.set_xticks([i + width for i in range(len(rows))], [r["row"] for r in rows])
    ax.set_ylabel("decode tokens/s per stream")
    meta = result["meta"]
    ax.set_title(f"suffix index, prompts asked again ({meta['restate']}), {meta['concurrency']} at a time\n"
                 f"{meta['machine'].get('cpu_model', '')}, {meta['dtype']}, {meta['date']}", fontsize=9)
    ax.legend(fontsize=8)
    fig.tight_layout()
    path.parent.mkdir(parents=True, exist_ok=True)
    fig.savefig(path, dpi=120)
    plt.close(fig)
