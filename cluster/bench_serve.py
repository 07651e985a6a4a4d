"""Serving benchmark: the served path under load, beside the in-process engine, in one run.

Configurations, all on the same ShareGPT chat prompts, greedy, chat-rendered:

- ``serve-target-only``: the deployed application with ``spec.draft = "none"``, plain decoding;
- ``serve-spec``: the same deployment with a fixed draft and window (default prompt lookup, γ = 4),
  the draft in its own deployment (one handle call per step);
- ``serve-spec-colocated``: the same draft inside the target replica (no call), when the server
  has a draft named ``<draft>-colocated`` (the local stack the benchmark brings up does);
- ``serve-spec-colocated-policy``: the same, but the request names only the draft, so the
  deployment's policy (goodput by default) decides each step's window; the rows above pin it;
- ``in-process-spec``: the in-process engine with that draft and window, one stream (it is the
  floor of what the served path can cost, so it runs at concurrency 1 only).

Load: requests arrive as a Poisson process at each ``rate`` (requests/s; ``inf`` sends them all
at once) and at most ``concurrency`` are in flight. Metrics follow vLLM's serving benchmark:
TTFT (time to first token), TPOT (time per output token after the first), ITL (time between
streamed chunks; a speculative step streams several tokens at once), output tokens/s, failed
requests; plus ``ms_per_step`` (request latency / steps) and ``mean_accepted_len``.

At concurrency 1 the three configurations take turns prompt by prompt, so a noisy neighbour
slows them alike; ``step_overhead_vs_in_process`` = serve-spec's ms/step over in-process-spec's
on the same prompts, minus one (the price of the distributed path per step).
"""

from __future__ import annotations

import asyncio
import json
import math
import random
import statistics
import time
from dataclasses import dataclass, field
from pathlib import Path

import httpx

from specserve.cluster.bench_engine import machine_info
from specserve.cluster.config import PROMPT_LOOKUP, draft_deployment
from specserve.cluster.prompts import load_prompts

BENCH_CATEGORY = "chat"   # ShareGPT first turns: the serving-benchmark standard


@dataclass(frozen=True)
class ServeBenchConfig:
    name: str
    backend: str     # "serve" or "in-process"
    draft: str
    window: int
    pinned: bool = True   # send the window; False: the deployment's policy and default window decide


@dataclass
class RequestRecord:
    config: str
    concurrency: int
    rate: float
    prompt_index: int
    ok: bool = False
    error: str = ""
    start_s: float = 0.0
    latency_s: float = 0.0
    ttft_s: float = 0.0
    chunk_gaps_s: list[float] = field(default_factory=list)
    output_tokens: int = 0
    steps: int = 0
    mean_accepted_len: float = 0.0
    draft_s: float = 0.0    # inside the step loop: waiting for proposals ...
    verify_s: float = 0.0   # ... and verifying them (the rest of a request's time is transport)


def colocated_name(draft: str) -> str:
    return f"{draft}-colocated"


def configs_for(draft: str, window: int, served_drafts: list[str]) -> list[ServeBenchConfig]:
    configs = [
        ServeBenchConfig("serve-target-only", "serve", "none", 0),
        ServeBenchConfig("serve-spec", "serve", draft, window),
        ServeBenchConfig("in-process-spec", "in-process", draft, window),
    ]
    if colocated_name(draft) in served_drafts:   # the same draft inside the target replica: no hop
        configs.insert(2, ServeBenchConfig("serve-spec-colocated", "serve", colocated_name(draft), window))
        configs.insert(3, ServeBenchConfig("serve-spec-colocated-policy", "serve", colocated_name(draft), window,
                                           pinned=False))
    return configs


# --- one request ---------------------------------------------------------------------------


async def http_request(client: httpx.AsyncClient, base_url: str, model: str, prompt: str, config: ServeBenchConfig,
                       max_tokens: int, record: RequestRecord) -> None:
    body = {"model": model, "messages": [{"role": "user", "content": prompt}], "max_tokens": max_tokens,
            "temperature": 0, "stream": True, "stream_options": {"include_usage": True},
            "spec": {"draft": config.draft, **({"window": config.window} if config.pinned else {})}}
    start = last = time.perf_counter()
    record.start_s = start
    try:
        async with client.stream("POST", f"{base_url}/v1/chat/completions", json=body) as response:
            if response.status_code != 200:
                record.error = f"HTTP {response.status_code}: {(await response.aread())[:200]!r}"
                return
            async for line in response.aiter_lines():
                if not line.startswith("data: ") or line == "data: [DONE]":
                    continue
                chunk = json.loads(line[6:])
                if "error" in chunk:
                    record.error = chunk["error"]["message"]
                    return
                now = time.perf_counter()
                if chunk.get("choices") and chunk["choices"][0]["delta"].get("content"):
                    if not record.ttft_s:
                        record.ttft_s = now - start
                    else:
                        record.chunk_gaps_s.append(now - last)
                    last = now
                spec = chunk.get("spec")
                if spec:
                    record.steps = spec["steps"]
                    record.mean_accepted_len = spec["mean_accepted_len"]
                    record.draft_s = spec["draft_ms_per_step"] * spec["steps"] / 1e3
                    record.verify_s = spec["verify_ms_per_step"] * spec["steps"] / 1e3
                if chunk.get("usage"):
                    record.output_tokens = chunk["usage"]["completion_tokens"]
        record.latency_s = time.perf_counter() - start
        record.ok = record.output_tokens > 0
    except httpx.HTTPError as err:
        record.error = f"{type(err).__name__}: {err}"


def in_process_request(engine, prompt_ids: list[int], config: ServeBenchConfig, max_tokens: int,
                       record: RequestRecord) -> None:
    from specserve.router.engine import GenerateRequest

    start = last = time.perf_counter()
    record.start_s = start

    def on_tokens(_: list[int]) -> None:
        nonlocal last
        now = time.perf_counter()
        if not record.ttft_s:
            record.ttft_s = now - start
        else:
            record.chunk_gaps_s.append(now - last)
        last = now

    engine.reset_caches()   # the served path starts each request from a cold cache too
    gen = engine.generate_ids(prompt_ids, GenerateRequest("", max_tokens, config.draft, config.window), on_tokens)
    record.latency_s = time.perf_counter() - start
    record.output_tokens = len(gen.token_ids)
    record.steps = gen.stats.steps
    record.mean_accepted_len = gen.stats.mean_accepted_len
    record.draft_s, record.verify_s = gen.stats.draft_s, gen.stats.verify_s
    record.ok = True


# --- load ----------------------------------------------------------------------------------


async def load_run(base_url: str, model: str, prompts: list[str], config: ServeBenchConfig, concurrency: int,
                   rate: float, max_tokens: int, seed: int = 0) -> tuple[list[RequestRecord], float]:
    """All prompts through the server, Poisson arrivals at ``rate``, at most ``concurrency`` in flight."""
    rng = random.Random(seed)
    gate = asyncio.Semaphore(concurrency)
    records = [RequestRecord(config.name, concurrency, rate, i) for i in range(len(prompts))]
    limits = httpx.Limits(max_connections=concurrency + 4)
    async with httpx.AsyncClient(timeout=httpx.Timeout(900.0), limits=limits) as client:

        async def one(i: int) -> None:
            async with gate:
                await http_request(client, base_url, model, prompts[i], config, max_tokens, records[i])

        start = time.perf_counter()
        tasks = []
        for i in range(len(prompts)):
            tasks.append(asyncio.create_task(one(i)))
            if math.isfinite(rate):
                await asyncio.sleep(rng.expovariate(rate))
        await asyncio.gather(*tasks)
        return records, time.perf_counter() - start


def summarise(records: list[RequestRecord], duration_s: float) -> dict:
    ok = [r for r in records if r.ok]

    def stats_ms(values: list[float]) -> dict:
        if not values:
            return {"mean": None, "median": None, "p99": None}
        ordered = sorted(values)
        return {"mean": round(1e3 * statistics.fmean(ordered), 2), "median": round(1e3 * statistics.median(ordered), 2),
                "p99": round(1e3 * ordered[min(len(ordered) - 1, math.ceil(0.99 * len(ordered)) - 1)], 2)}

    tokens = sum(r.output_tokens for r in ok)
    tpot = [(r.latency_s - r.ttft_s) / (r.output_tokens - 1) for r in ok if r.output_tokens > 1]
    steps = sum(r.steps for r in ok)
    return {
        "completed": len(ok),
        "failed": len(records) - len(ok),
        "errors": sorted({r.error for r in records if r.error})[:3],
        "duration_s": round(duration_s, 2),
        "request_throughput": round(len(ok) / duration_s, 3) if duration_s else 0.0,
        "output_tokens": tokens,
        "output_tokens_per_s": round(tokens / duration_s, 2) if duration_s else 0.0,
        "ttft_ms": stats_ms([r.ttft_s for r in ok]),
        "tpot_ms": stats_ms(tpot),
        "itl_ms": stats_ms([g for r in ok for g in r.chunk_gaps_s]),
        "ms_per_step": round(1e3 * sum(r.latency_s for r in ok) / steps, 2) if steps else None,
        "draft_ms_per_step": round(1e3 * sum(r.draft_s for r in ok) / steps, 2) if steps else None,
        "verify_ms_per_step": round(1e3 * sum(r.verify_s for r in ok) / steps, 2) if steps else None,
        "mean_accepted_len": round(tokens / steps, 3) if steps else None,
    }


def step_overhead(records: list[RequestRecord], served: str) -> dict:
    """A served configuration vs in-process-spec at concurrency 1, paired by prompt."""
    by = {(r.config, r.prompt_index): r for r in records if r.ok and r.concurrency == 1}
    pairs = [(by[(served, i)], by[("in-process-spec", i)]) for (c, i) in by
             if c == served and ("in-process-spec", i) in by]
    if not pairs:
        return {}
    served_s = sum(s.latency_s for s, _ in pairs) / sum(s.steps for s, _ in pairs)
    inproc_s = sum(p.latency_s for _, p in pairs) / sum(p.steps for _, p in pairs)
    return {"served_ms_per_step": round(1e3 * served_s, 2), "in_process_ms_per_step": round(1e3 * inproc_s, 2),
            "step_overhead_vs_in_process": round(served_s / inproc_s - 1, 4), "prompts": len(pairs),
            "prompts_with_equal_steps": sum(s.steps == p.steps for s, p in pairs)}


# --- the run -------------------------------------------------------------------------------


def run_serve_bench(json_path: Path, plot_path: Path, server: str | None, prompts_n: int, max_tokens: int,
                    concurrencies: list[int], rates: list[float], draft: str, window: int, dtype: str) -> dict:
    if prompts_n < 1 or max_tokens < 1:
        raise ValueError(f"--prompts and --max-tokens must be >= 1, got {prompts_n}, {max_tokens}")
    if not concurrencies or min(concurrencies) < 1:
        raise ValueError(f"--concurrency needs integers >= 1, got {concurrencies}")
    if not rates or min(rates) <= 0:
        raise ValueError(f"--rates needs numbers > 0 (or inf), got {rates}")
    prompts = load_prompts(BENCH_CATEGORY, prompts_n)

    from specserve.cluster import local
    from specserve.cluster.serve_config import local_serve_config
    from specserve.router.engine import SpecEngine

    started = server is None
    if started:
        serve_config = local_serve_config()
        args = serve_config["applications"][0]["args"]
        args["dtype"] = dtype
        if draft == PROMPT_LOOKUP:
            args["drafts"] = [{"name": PROMPT_LOOKUP}, {"name": colocated_name(PROMPT_LOOKUP), "colocated": True}]
            # Serve refuses options for deployments the application no longer has.
            kept = {"ingress", "target", draft_deployment(PROMPT_LOOKUP)}
            app = serve_config["applications"][0]
            app["deployments"] = [d for d in app.get("deployments", []) if d["name"] in kept]
        print("bringing the local stack up (specserve up)...", flush=True)
        server = local.up(serve_config).http_url
    try:
        listed = httpx.get(f"{server}/v1/models", timeout=60).json()["data"][0]
        model = listed["id"]
        configs = configs_for(draft, window, listed.get("drafts", []))
        engine = SpecEngine.load(dtype=dtype)
        prompt_ids = [engine.encode(p) for p in prompts]
        machine = machine_info()
        records: list[RequestRecord] = []
        runs: list[dict] = []

        # Warm-up: the first calls through Serve's handles and the first forwards are slow.
        for config in configs:
            if config.backend == "serve":
                asyncio.run(load_run(server, model, prompts[:1], config, 1, math.inf, 8))
            else:
                in_process_request(engine, prompt_ids[0], config, 8, RequestRecord("warmup", 1, math.inf, 0))

        # Concurrency 1: every request runs alone (so the arrival rate changes nothing), and the
        # configurations take turns prompt by prompt.
        if 1 in concurrencies:
            from tqdm import tqdm

            turn: dict[str, list[RequestRecord]] = {c.name: [] for c in configs}
            busy_s = {c.name: 0.0 for c in configs}
            for i in tqdm(range(len(prompts)), desc="concurrency 1", unit="prompt"):
                for k in range(len(configs)):
                    config = configs[(i + k) % len(configs)]
                    t0 = time.perf_counter()
                    if config.backend == "serve":
                        rec = asyncio.run(load_run(server, model, [prompts[i]], config, 1, math.inf, max_tokens))[0][0]
                        rec.prompt_index = i
                    else:
                        rec = RequestRecord(config.name, 1, math.inf, i)
                        in_process_request(engine, prompt_ids[i], config, max_tokens, rec)
                    busy_s[config.name] += time.perf_counter() - t0
                    turn[config.name].append(rec)
            for config in configs:
                records += turn[config.name]
                runs.append({"config": config.name, "concurrency": 1, "rate": "inf",
                             **summarise(turn[config.name], busy_s[config.name])})

        for concurrency in [c for c in concurrencies if c > 1]:
            for rate in rates:
                for config in configs:
                    if config.backend != "serve":
                        continue
                    print(f"{config.name}: concurrency {concurrency}, rate {rate} req/s, {len(prompts)} requests",
                          flush=True)
                    recs, duration = asyncio.run(load_run(server, model, prompts, config, concurrency, rate, max_tokens))
                    records += recs
                    runs.append({"config": config.name, "concurrency": concurrency, "rate": _rate(rate),
                                 **summarise(recs, duration)})
    finally:
        if started:
            local.down()

    result = {
        "meta": {"server": server, "model": model, "dtype": dtype, "prompts": prompts_n, "category": BENCH_CATEGORY,
                 "max_tokens": max_tokens, "draft": draft, "window": window, "concurrencies": concurrencies,
                 "rates": [_rate(r) for r in rates], "machine": machine, "load_avg_1m_after": machine_info()["load_avg_1m"]},
        "overhead": {c.name: step_overhead(records, c.name) for c in configs
                     if c.backend == "serve" and c.draft != "none"},
        "runs": runs,
    }
    json_path.parent.mkdir(parents=True, exist_ok=True)
    json_path.write_text(json.dumps(result, indent=2) + "\n")
    lines = [f"{name}: {100 * o['step_overhead_vs_in_process']:+.1f}% per step vs in-process "
             f"({o['served_ms_per_step']} vs {o['in_process_ms_per_step']} ms/step, {o['prompts']} prompts)"
             for name, o in result["overhead"].items() if o]
    plot(runs, {**result["meta"], "overhead_text": "".join("\n" + line for line in lines)}, plot_path)
    print(format_table(runs))
    if lines:
        print("\nconcurrency 1, served path against the in-process engine:\n  " + "\n  ".join(lines))
    print(f"\nwrote {json_path} and {plot_path}")
    return result


def _rate(rate: float) -> float | str:
    """JSON has no infinity: an unbounded rate is written "inf"."""
    return rate if math.isfinite(rate) else "inf"


def format_table(runs: list[dict]) -> str:
    header = (f"{'config':21s} {'conc':>4s} {'rate':>5s} {'ok':>4s} {'fail':>4s} {'out tok/s':>9s} "
              f"{'TTFT p50':>9s} {'TPOT p50':>9s} {'ITL p50':>8s} {'ms/step':>8s} {'draft':>6s} {'verify':>6s} {'τ':>5s}")
    lines = [header, "-" * len(header)]
    for r in runs:
        def ms(key):
            value = r[key]["median"]
            return f"{value:.1f}" if value is not None else "-"
        tau = f"{r['mean_accepted_len']:.2f}" if r["mean_accepted_len"] else "-"
        step = f"{r['ms_per_step']:.1f}" if r["ms_per_step"] else "-"
        lines.append(f"{r['config']:21s} {r['concurrency']:4d} {str(r['rate']):>5s} {r['completed']:4d} {r['failed']:4d} "
                     f"{r['output_tokens_per_s']:9.2f} {ms('ttft_ms'):>9s} {ms('tpot_ms'):>9s} {ms('itl_ms'):>8s} "
                     f"{step:>8s} {r['draft_ms_per_step'] or 0:6.1f} {r['verify_ms_per_step'] or 0:6.1f} {tau:>5s}")
    return "\n".join(lines)


def plot(runs: list[dict], meta: dict, path: Path) -> None:
    """Output tokens/s and median TPOT against concurrency, a line per configuration and rate."""
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    fig, (ax_tps, ax_tpot) = plt.subplots(1, 2, figsize=(11, 4.4))
    series: dict[str, list[dict]] = {}
    for r in runs:
        label = r["config"] if r["concurrency"] == 1 and r["config"].startswith("in-process") else f"{r['config']} @ {r['rate']} req/s"
        series.setdefault(label, []).append(r)
    for label, rows in series.items():
        rows = sorted(rows, key=lambda r: r["concurrency"])
        xs = [r["concurrency"] for r in rows]
        marker = "s" if label.startswith("in-process") else "o"
        ax_tps.plot(xs, [r["output_tokens_per_s"] for r in rows], marker=marker, label=label)
        ax_tpot.plot(xs, [r["tpot_ms"]["median"] or 0 for r in rows], marker=marker, label=label)
    levels = sorted({r["concurrency"] for r in runs})
    for ax, ylabel in ((ax_tps, "output tokens / s"), (ax_tpot, "median TPOT (ms)")):
        ax.set_xscale("log", base=2)
        ax.set_xticks(levels, [str(c) for c in levels])
        ax.minorticks_off()
        ax.set_xlabel("concurrency")
        ax.set_ylabel(ylabel)
        ax.grid(alpha=0.3)
    ax_tps.legend(fontsize=7)
    machine = meta["machine"]
    overhead = meta.get("overhead_text", "")
    fig.suptitle(f"{meta['model']} {meta['dtype']}, greedy, {meta['prompts']} ShareGPT prompts, {meta['max_tokens']} tokens, "
                 f"draft {meta['draft']} γ={meta['window']}; {machine['cpu_count']} CPUs, load {machine['load_avg_1m']} {overhead}",
                 fontsize=9)
    fig.tight_layout()
    path.parent.mkdir(parents=True, exist_ok=True)
    fig.savefig(path, dpi=120)
    plt.close(fig)
