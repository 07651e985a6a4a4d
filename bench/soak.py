"""Soak benchmark: a bounded, self-stopping load at a fixed rate, and what it does to the stack over time.

Requests arrive as a Poisson process at ``rate`` per second for ``minutes`` (open loop: a slow
server does not slow the arrivals, as real clients do not wait for each other), then the run
waits for the ones in flight (at most ``drain_s``; a request still running then counts as
failed). Each request is a streamed OpenAI chat completion on a prompt of the mix (code, chat,
summarise, edit) with one of the ``spec`` settings a production mix sends: none at all (the
router and the deployment's policy), ``"auto"``, ``"none"`` (plain) and a pinned draft, greedy or
sampled (temperature 1, a seed): so the soak runs the router, speculation and plain paths.

Reported per time window (``window_s``): requests started, failed, latency and TTFT percentiles
(p50, p95, p99) and output tokens/s; every failure with its error; and each Serve replica's
resident memory (RSS) sampled every ``sample_s`` (the replicas of a local cluster: Ray's state API
gives their pids), with its growth after warm-up: the mean RSS over the last window against the
mean over the first window after the warm-up (20% of the run, at most a minute). The aims are in
the JSON: zero failed requests, and memory growth under 5% after warm-up.
"""

from __future__ import annotations

import asyncio
import json
import math
import random
import statistics
import time
from dataclasses import asdict, dataclass
from pathlib import Path

import httpx

from specserve.bench.engine import machine_info
from specserve.bench.serve import StreamError, chat_chunks, served_model
from specserve.cluster.config import PROMPT_LOOKUP
from specserve.data.prompts import CATEGORIES, load_prompts
from specserve.ingress.auth import client_headers

# What each request asks of speculation: (label, spec or None for no field at all).
SPEC_MIX = (("default", None), ("auto", {"draft": "auto"}), ("none", {"draft": "none"}),
            (PROMPT_LOOKUP, {"draft": PROMPT_LOOKUP}))
SAMPLED_SHARE = 0.3
MEMORY_GROWTH_AIM = 0.05


@dataclass
class SoakRecord:
    index: int
    start_s: float           # since the run began
    category: str
    spec: str
    sampled: bool
    ok: bool = False
    error: str = ""
    latency_s: float = 0.0
    ttft_s: float = 0.0
    output_tokens: int = 0


def percentile(values: list[float], q: float) -> float | None:
    """Nearest-rank percentile (``q`` in 0..100); None for no values."""
    if not values:
        return None
    ordered = sorted(values)
    return ordered[max(0, math.ceil(q / 100 * len(ordered)) - 1)]


def windows(records: list[SoakRecord], window_s: float, duration_s: float) -> list[dict]:
    """One row per ``window_s`` of the run, by the requests that started in it."""
    rows = []
    for w in range(max(1, math.ceil(duration_s / window_s))):
        lo, hi = w * window_s, (w + 1) * window_s
        group = [r for r in records if lo <= r.start_s < hi]
        ok = [r for r in group if r.ok]
        row = {"start_s": lo, "requests": len(group), "failed": len(group) - len(ok),
               "output_tokens_per_s": round(sum(r.output_tokens for r in ok) / window_s, 2)}
        for name, values in (("latency", [r.latency_s for r in ok]), ("ttft", [r.ttft_s for r in ok])):
            for q in (50, 95, 99):
                value = percentile(values, q)
                row[f"{name}_p{q}_s"] = None if value is None else round(value, 3)
        rows.append(row)
    return rows


def warmup_s(duration_s: float) -> float:
    return min(60.0, 0.2 * duration_s)


def memory_growth(samples: list[tuple[float, dict[str, int]]], warmup: float, window_s: float) -> dict[str, dict]:
    """Per replica: mean RSS (MB) over the first ``window_s`` after ``warmup`` and over the last
    ``window_s`` it was seen, and the growth between them. A replica seen only before the
    warm-up ended (or that started late) is compared over what it has."""
    by_replica: dict[str, list[tuple[float, int]]] = {}
    for t, rss in samples:
        for name, value in rss.items():
            by_replica.setdefault(name, []).append((t, value))
    out = {}
    for name, series in by_replica.items():
        start = max(warmup, series[0][0])
        first = [v for t, v in series if start <= t < start + window_s] or [series[-1][1]]
        end = series[-1][0]
        last = [v for t, v in series if t > end - window_s]
        base, final = statistics.fmean(first), statistics.fmean(last)
        out[name] = {"after_warmup_mb": round(base / 2**20, 1), "last_mb": round(final / 2**20, 1),
                     "growth": round(final / base - 1.0, 4), "samples": len(series),
                     "seen_s": [round(series[0][0], 1), round(end, 1)]}
    return out


def aims(records: list[SoakRecord], growth: dict[str, dict]) -> dict:
    failed = sum(1 for r in records if not r.ok)
    worst = max((g["growth"] for g in growth.values()), default=None)
    return {"zero_failed": failed == 0, "failed": failed,
            "memory_growth_below_5pct": None if worst is None else worst < MEMORY_GROWTH_AIM,
            "worst_memory_growth": worst}


# ---- the load -------------------------------------------------------------------------------------


def body_for(model: str, prompt: str, spec: dict | None, sampled: bool, seed: int, max_tokens: int) -> dict:
    body = {"model": model, "messages": [{"role": "user", "content": prompt}], "max_tokens": max_tokens,
            "temperature": 1.0 if sampled else 0.0, "stream": True, "stream_options": {"include_usage": True}}
    if sampled:
        body["seed"] = seed
    if spec is not None:
        body["spec"] = spec
    return body


async def one_request(client: httpx.AsyncClient, url: str, body: dict, record: SoakRecord) -> None:
    start = time.perf_counter()
    try:
        async for chunk in chat_chunks(client, url, body):
            if not record.ttft_s and chunk.get("choices") and chunk["choices"][0]["delta"].get("content"):
                record.ttft_s = time.perf_counter() - start
            if chunk.get("usage"):
                record.output_tokens = chunk["usage"]["completion_tokens"]
        record.latency_s = time.perf_counter() - start
        record.ok = record.output_tokens > 0
        if not record.ok:
            record.error = "the stream ended without tokens or usage"
    except StreamError as err:
        record.error = str(err)
    except (httpx.HTTPError, ValueError) as err:
        record.error = f"{type(err).__name__}: {err}"


def replica_rss() -> dict[str, int] | None:
    """RSS of every live Serve replica of this machine's Ray cluster, by replica name (e.g.
    ``target#ab12cd``); None when no Ray cluster can be asked."""
    import psutil
    import ray
    from ray.util.state import list_actors

    if not ray.is_initialized():
        return None
    out = {}
    for actor in list_actors(filters=[("state", "=", "ALIVE")], limit=1000):
        name = actor.name or ""
        if not name.startswith("SERVE_REPLICA::") or not actor.pid:
            continue
        try:
            out[name.split("::", 1)[1].split("#", 1)[1]] = psutil.Process(actor.pid).memory_info().rss
        except (psutil.NoSuchProcess, psutil.AccessDenied):
            continue
    return out


async def soak(url: str, model: str, prompts: list[tuple[str, str]], minutes: float, rate: float, max_tokens: int,
               sample_s: float, drain_s: float, seed: int = 0, bar=None) -> tuple[list[SoakRecord], list, float]:
    """(records, memory samples [(t, {replica: rss})], duration_s)."""
    rng = random.Random(seed)
    duration = 60.0 * minutes
    records: list[SoakRecord] = []
    samples: list[tuple[float, dict[str, int]]] = []
    limits = httpx.Limits(max_connections=None, max_keepalive_connections=64)
    async with httpx.AsyncClient(timeout=httpx.Timeout(drain_s + duration), limits=limits, headers=client_headers()) as client:
        t0 = time.perf_counter()
        stop = asyncio.Event()

        async def sampler() -> None:
            while not stop.is_set():
                rss = await asyncio.to_thread(replica_rss)
                if rss is None:
                    return
                samples.append((time.perf_counter() - t0, rss))
                try:
                    await asyncio.wait_for(stop.wait(), sample_s)
                except asyncio.TimeoutError:
                    pass

        memory = asyncio.create_task(sampler())
        tasks = []
        next_at = rng.expovariate(rate)
        while next_at < duration:
            await asyncio.sleep(max(0.0, next_at - (time.perf_counter() - t0)))
            category, prompt = prompts[len(records) % len(prompts)]
            label, spec = SPEC_MIX[rng.randrange(len(SPEC_MIX))]
            sampled = rng.random() < SAMPLED_SHARE
            record = SoakRecord(len(records), time.perf_counter() - t0, category, label, sampled)
            records.append(record)
            tasks.append(asyncio.create_task(one_request(
                client, url, body_for(model, prompt, spec, sampled, rng.randrange(2**31), max_tokens), record)))
            if bar is not None:
                bar.n = min(duration, round(time.perf_counter() - t0, 1))
                bar.set_postfix_str(f"{len(records)} sent, {sum(1 for r in records if r.error)} failed")
                bar.refresh()
            next_at += rng.expovariate(rate)
        _, pending = await asyncio.wait(tasks, timeout=drain_s) if tasks else (set(), set())
        for task in pending:
            task.cancel()
        for record in records:
            if not record.ok and not record.error:
                record.error = f"still running {drain_s:.0f} s after the load stopped"
        stop.set()
        await memory
        return records, samples, max(duration, time.perf_counter() - t0)


# ---- the command ---------------------------------------------------------------------------------


@dataclass(frozen=True, kw_only=True)
class SoakBenchConfig:
    """What one run sends and where it writes (``specserve bench soak``'s options, with its
    defaults). Checked when made, before any stack starts."""

    json_path: Path = Path("bench-soak.json")   # windows, failures, memory samples and every request
    plot_path: Path = Path("bench-soak.png")    # latency percentiles and replica memory over time
    server: str | None = None       # a running deployment's URL; None: the local stack, up and down
    minutes: float = 10.0           # how long requests keep arriving: at 1/s ~600, each prompt about 4 times
    rate: float = 1.0               # requests per second, Poisson, open loop
    max_tokens: int = 64            # new tokens per request
    window_s: float = 30.0          # seconds per reporting window (and the span the memory means are over)
    sample_s: float = 5.0           # seconds between replica memory samples: six per window
    drain_s: float = 300.0          # how long to wait for the requests in flight after the load stops
    dtype: str = "auto"             # of the local stack only

    def __post_init__(self) -> None:
        if self.minutes <= 0 or self.rate <= 0 or self.max_tokens < 1 or self.window_s <= 0 or self.sample_s <= 0:
            raise ValueError(f"--minutes, --rate, --window-s and --sample-s must be > 0 and --max-tokens >= 1, got "
                             f"{self.minutes}, {self.rate}, {self.window_s}, {self.sample_s}, {self.max_tokens}")


def run_soak_bench(config: SoakBenchConfig) -> dict:
    """Send the load, wait for it, take the stack down if it brought it up; write JSON and plot,
    print a table; return the report."""
    from tqdm import tqdm

    from specserve.cluster import local
    from specserve.bench.serve import local_stack_config

    minutes, rate, window_s = config.minutes, config.rate, config.window_s

    # Enough distinct prompts that each is sent about four times over the run, the categories interleaved.
    per_category = min(40, max(4, math.ceil(rate * 60 * minutes / len(CATEGORIES) / 4)))
    by_category = {c: load_prompts(c, per_category) for c in CATEGORIES}
    prompts = [(c, by_category[c][i]) for i in range(per_category) for c in CATEGORIES]
    started = config.server is None
    if started:
        print("bringing the local stack up (specserve up)...", flush=True)
        server = local.up(local_stack_config(config.dtype, None)).http_url
    else:
        server = config.server.rstrip("/").removesuffix("/v1")
        try:
            local.connect()   # a local Ray cluster (the server's own, when it runs here): replica memory
        except Exception:  # noqa: BLE001 - no cluster here: the soak runs, memory is unavailable
            pass
    try:
        model = served_model(server, client_headers())["id"]
        with tqdm(total=60.0 * minutes, desc="soak", unit="s", bar_format="{l_bar}{bar}| {n:.0f}/{total:.0f} s {postfix}") as bar:
            records, samples, duration = asyncio.run(soak(server, model, prompts, minutes, rate, config.max_tokens,
                                                          config.sample_s, config.drain_s, bar=bar))
    finally:
        if started:
            local.down()
    warm = warmup_s(60.0 * minutes)
    growth = memory_growth(samples, warm, window_s)
    report = {
        "machine": machine_info(),
        "config": {"server": None if started else server, "minutes": minutes, "rate": rate,
                   "max_tokens": config.max_tokens, "window_s": window_s, "sample_s": config.sample_s,
                   "drain_s": config.drain_s, "warmup_s": warm,
                   "spec_mix": [label for label, _ in SPEC_MIX], "sampled_share": SAMPLED_SHARE},
        "duration_s": round(duration, 1),
        "totals": {"requests": len(records), "ok": sum(r.ok for r in records),
                   "output_tokens": sum(r.output_tokens for r in records if r.ok),
                   "latency_p50_s": percentile([r.latency_s for r in records if r.ok], 50),
                   "latency_p99_s": percentile([r.latency_s for r in records if r.ok], 99)},
        "windows": windows(records, window_s, 60.0 * minutes),
        "failures": [{"index": r.index, "start_s": round(r.start_s, 2), "spec": r.spec, "error": r.error}
                     for r in records if not r.ok],
        "memory": {"available": bool(samples), "growth": growth,
                   "samples": [{"t_s": round(t, 1), "rss_mb": {k: round(v / 2**20, 1) for k, v in rss.items()}}
                               for t, rss in samples]},
        "aims": aims(records, growth),
        "requests": [asdict(r) for r in records],
    }
    json_path, plot_path = config.json_path, config.plot_path
    json_path.write_text(json.dumps(report, indent=1))
    plot(report, plot_path)
    print(format_table(report))
    print(f"\nwrote {json_path} and {plot_path}")
    return report


def format_table(report: dict) -> str:
    lines = [f"{'window':>8} {'reqs':>5} {'fail':>5} {'p50 s':>7} {'p95 s':>7} {'p99 s':>7} {'ttft p95':>9} {'tok/s':>7}"]
    for w in report["windows"]:
        cells = [w[k] for k in ("latency_p50_s", "latency_p95_s", "latency_p99_s", "ttft_p95_s")]
        lines.append(f"{w['start_s']:>7.0f}s {w['requests']:>5} {w['failed']:>5} "
                     + " ".join(f"{c:>7.2f}" if c is not None else f"{'-':>7}" for c in cells[:3])
                     + (f" {cells[3]:>9.2f}" if cells[3] is not None else f" {'-':>9}") + f" {w['output_tokens_per_s']:>7.1f}")
    for name, g in sorted(report["memory"]["growth"].items()):
        lines.append(f"memory {name}: {g['after_warmup_mb']} MB after warm-up -> {g['last_mb']} MB ({100 * g['growth']:+.2f}%)")
    if not report["memory"]["available"]:
        lines.append("memory: unavailable (no local Ray cluster to ask for the replicas' pids)")
    a = report["aims"]
    lines.append(f"aims: zero failed {a['zero_failed']} ({a['failed']} failed); memory growth < 5% "
                 f"{a['memory_growth_below_5pct']} (worst {a['worst_memory_growth']})")
    return "\n".join(lines)


def plot(report: dict, path: Path) -> None:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    fig, (lat, mem) = plt.subplots(2, 1, figsize=(9, 7), sharex=True)
    rows = report["windows"]
    mids = [r["start_s"] + report["config"]["window_s"] / 2 for r in rows]
    for q, style in ((50, "-"), (95, "--"), (99, ":")):
        lat.plot(mids, [r[f"latency_p{q}_s"] for r in rows], style, marker="o", label=f"latency p{q}")
    lat.plot(mids, [r["ttft_p95_s"] for r in rows], "-.", marker=".", label="TTFT p95")
    fails = report["failures"]
    if fails:
        top = max([r["latency_p99_s"] or 0 for r in rows] + [1.0])
        lat.scatter([f["start_s"] for f in fails], [top] * len(fails), marker="x", color="red", label="failed request")
    lat.set_ylabel("seconds")
    lat.legend(fontsize=8)
    m = report["machine"]
    lat.set_title(f"soak: {report['config']['rate']} req/s for {report['config']['minutes']} min, "
                  f"{report['totals']['requests']} requests, {len(fails)} failed ({m.get('cpu_model', '')})", fontsize=9)
    series: dict[str, list[tuple[float, float]]] = {}
    for s in report["memory"]["samples"]:
        for name, mb in s["rss_mb"].items():
            series.setdefault(name, []).append((s["t_s"], mb))
    for name, points in sorted(series.items()):
        mem.plot([t for t, _ in points], [mb for _, mb in points], label=name)
    mem.axvline(report["config"]["warmup_s"], color="grey", linestyle=":", label="end of warm-up")
    mem.set_ylabel("replica RSS (MB)")
    mem.set_xlabel("seconds since the start")
    if series:
        mem.legend(fontsize=7, ncol=2)
    fig.tight_layout()
    fig.savefig(path, dpi=110)
    plt.close(fig)
