"""Serving benchmark: specserve under load, beside the in-process engine and any OpenAI-compatible
peer (``vllm serve``), in one run.

By default it brings up the shipped default (``deploy/serve.yaml``: every draft placed by
measurement) and measures it on a mixed set, code, chat, summarise and edit prompts in turn
(``--categories``). Rows (configurations), all on the same prompts, greedy, the same
``max_tokens``, streamed, so that every row's TTFT and ITL are measured the same way:

- ``serve-target-only``: the deployment with ``spec.draft = "none"``, plain (batched) decoding;
- ``serve-default``: a request with no ``spec`` at all, i.e. what any OpenAI client gets: the
  deployment's default draft, its policy (goodput by default) choosing each step's window;
- ``serve-spec[<draft>]``: one row per draft the deployment serves (or ``--drafts``), with that
  draft and a pinned window γ (``--adaptive``: the draft only, the deployment's policy choosing
  each step's window, as for ``serve-default``);
- ``in-process-spec[<draft>]``: the in-process engine with one draft and γ, one stream (it is the
  floor of what the served path can cost, so it runs at concurrency 1 only), with as many torch
  threads as a served target replica when the benchmark brings the local stack up;
- ``peer[<name>]``: the same OpenAI chat requests to a foreign server (``--peer NAME=URL``),
  model id from its ``/v1/models``, no specserve field; steps and τ are unknown there (null).

Load: requests arrive as a Poisson process at each ``rate`` (requests/s; ``inf`` sends them all
at once) and at most ``concurrency`` are in flight. Metrics follow vLLM's serving benchmark:
TTFT (time to first token), TPOT (time per output token after the first), ITL (time between
streamed chunks; a speculative step streams several tokens at once), output tokens/s, failed
requests; plus ``ms_per_step`` (request latency / steps) and ``mean_accepted_len`` τ.

Structured output (``--structured``): every request asks for its category's JSON schema
(``response_format``, peers too, ``STRUCTURED_SCHEMAS``), and the row ``parsed_json`` counts the
answers that parse. ``serve-target-only`` then decodes plainly under the grammar,
``serve-grammar-draft`` proposes only what the grammar forces, and
``serve-default[no-grammar-draft]`` is the default without it: what the grammar as a draft buys.

Measuring the draft router (``serve-default`` when the deployment routes): ``--router-warmup N``
first sends N other prompts per category with no ``spec``, so the replicas' routers learn from
their own choices before the measured requests, as ``bench router``'s warm-up does; and then
``serve-default`` runs first on each prompt, because a router also learns from requests that pin a
draft, and after the pinned rows it would have seen this very prompt's α with each draft. In the
loaded runs it has (from the concurrency-1 pass): there the router row is an upper bound. (The
handles' warm-up, 8 tokens of the first prompt with every row, shows it that prompt too.)
``drafts`` per row counts the draft each request ended on; ``meta.placement`` says where each
draft ran and the figures that placed it (``GET /v1/models``), and the plot's title names it.

At concurrency 1 the rows take turns prompt by prompt, so a noisy neighbour slows them alike;
``step_overhead_vs_in_process`` = a served row's ms/step over the in-process row's on the same
prompts, minus one (the price of the distributed path per step).
"""

from __future__ import annotations

import asyncio
import hashlib
import json
import math
import random
import re
import statistics
import time
import uuid
from collections import Counter
from dataclasses import asdict, dataclass, field, replace
from pathlib import Path

import httpx

from specserve.bench.engine import machine_info
from specserve.bench.turns import in_turn
from specserve.cluster.config import PROMPT_LOOKUP, SUFFIX
from specserve.data.prompts import CATEGORIES, check_categories, load_prompts
from specserve.ingress.auth import client_headers

NO_DRAFT = "none"


@dataclass(frozen=True)
class RowConfig:
    """One configuration: a JSON row's ``config`` and ``setup``."""

    name: str
    backend: str               # "serve" (specserve), "peer" (any OpenAI server) or "in-process"
    url: str | None = None     # the server's base URL (no /v1); None in-process
    model: str | None = None   # the model id the server lists first in /v1/models
    draft: str | None = None   # spec.draft to send; None: the request names none
    window: int | None = None  # spec.window to send; None: the deployment's policy decides
    grammar_draft: bool | None = None   # spec.grammar_draft to send (structured runs); None: the deployment's


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
    steps: int = 0          # 0: unknown (a peer does not say)
    mean_accepted_len: float = 0.0
    draft: str = ""         # the draft the request ended on (the router's, after any switch)
    draft_s: float = 0.0    # inside the step loop: waiting for proposals ...
    verify_s: float = 0.0   # ... and verifying them (the rest of a request's time is transport)
    replica: str = ""       # the target replica that answered (specserve's spec.replica)
    text: str = ""          # the streamed content (a structured run checks that it parses)


def row_name(kind: str, label: str) -> str:
    """``serve-spec[prompt-lookup]``: the kind of row first, so that a sorted table groups them."""
    return f"{kind}[{label}]"


# --- arguments -----------------------------------------------------------------------------


def parse_peers(specs: list[str]) -> list[tuple[str, str]]:
    """``NAME=URL`` pairs. The URL may end in ``/v1`` (an OpenAI client's base_url) or not."""
    peers: list[tuple[str, str]] = []
    for spec in specs:
        name, sep, url = spec.partition("=")
        name, url = name.strip(), url.strip().rstrip("/")
        if not sep or not re.fullmatch(r"[A-Za-z0-9][A-Za-z0-9._-]*", name):
            raise ValueError(f"--peer takes NAME=URL with a name of letters, digits, '.', '_' or '-', got {spec!r} "
                             f"(e.g. --peer vllm=http://127.0.0.1:8100)")
        if not url.startswith(("http://", "https://")):
            raise ValueError(f"--peer {name}: the URL must start with http:// or https://, got {url!r}")
        if name in (p for p, _ in peers):
            raise ValueError(f"--peer {name} is given twice: each peer needs its own name")
        peers.append((name, url.removesuffix("/v1")))
    return peers


def parse_drafts(text: str | None) -> list[str] | None:
    """``a,b,c`` -> names; None (no --drafts): every draft the deployment serves."""
    if text is None:
        return None
    names = [d.strip() for d in text.split(",") if d.strip()]
    if not names or NO_DRAFT in names:
        raise ValueError(f"--drafts takes draft names (serve-target-only is always measured), got {text!r}")
    return list(dict.fromkeys(names))   # a name given twice is one row


def resolve_drafts(requested: list[str] | None, served: list[str]) -> list[str]:
    if requested is None:
        return list(served)
    unknown = [d for d in requested if d not in served]
    if unknown:
        raise ValueError(f"--drafts: the deployment does not serve {', '.join(unknown)}; it serves "
                         f"{', '.join(served) or 'no draft'}")
    return requested


def configs_for(url: str, model: str, drafts: list[str], window: int, in_process: str | None,
                peers: list[tuple[str, str, str]], adaptive: bool = False, structured: bool = False) -> list[RowConfig]:
    """The rows of one run; ``peers`` are (name, url, model). ``adaptive``: the serve-spec rows
    name their draft only (the deployment's policy picks the windows). ``structured``: the
    target-only row decodes plainly under the grammar, and two rows more measure the grammar as a
    draft, alone and by its absence from the default."""
    spec_window = None if adaptive else window
    return [
        RowConfig("serve-target-only", "serve", url, model, NO_DRAFT, 0, grammar_draft=False if structured else None),
        *([RowConfig("serve-grammar-draft", "serve", url, model, NO_DRAFT, 0, grammar_draft=True)] if structured else []),
        RowConfig("serve-default", "serve", url, model),
        *([RowConfig(row_name("serve-default", "no-grammar-draft"), "serve", url, model, grammar_draft=False)]
          if structured else []),
        *(RowConfig(row_name("serve-spec", d), "serve", url, model, d, spec_window) for d in drafts),
        *([RowConfig(row_name("in-process-spec", in_process), "in-process", draft=in_process, window=window)]
          if in_process else []),
        *(RowConfig(row_name("peer", name), "peer", peer_url, peer_model) for name, peer_url, peer_model in peers),
    ]


# A structured run's response_format per prompt category: each category's answer as a JSON
# object a client would parse (strict: the fields and nothing else).
STRUCTURED_SCHEMAS = {
    "code": {"type": "object", "properties": {
        "language": {"type": "string", "enum": ["python", "javascript", "c", "go", "rust", "other"]},
        "code": {"type": "string"}, "explanation": {"type": "string"}},
        "required": ["language", "code", "explanation"], "additionalProperties": False},
    "chat": {"type": "object", "properties": {
        "answer": {"type": "string"}, "confidence": {"type": "string", "enum": ["low", "medium", "high"]},
        "follow_up_questions": {"type": "array", "items": {"type": "string"}, "maxItems": 3}},
        "required": ["answer", "confidence", "follow_up_questions"], "additionalProperties": False},
    "summarise": {"type": "object", "properties": {
        "title": {"type": "string"}, "summary": {"type": "string"},
        "key_points": {"type": "array", "items": {"type": "string"}, "maxItems": 5}},
        "required": ["title", "summary", "key_points"], "additionalProperties": False},
    "edit": {"type": "object", "properties": {
        "edited_text": {"type": "string"}, "changes": {"type": "array", "items": {"type": "string"}, "maxItems": 5}},
        "required": ["edited_text", "changes"], "additionalProperties": False},
}


def response_format(category: str) -> dict:
    return {"type": "json_schema", "json_schema": {"name": f"{category}_answer", "schema": STRUCTURED_SCHEMAS[category],
                                                   "strict": True}}


def parses(text: str) -> bool:
    try:
        return isinstance(json.loads(text), dict)
    except ValueError:
        return False


def mixed_prompts(categories: list[str], n: int, offset: int = 0) -> list[tuple[str, str]]:
    """``n`` (category, prompt) pairs, the categories in turn; ``offset`` prompts of each category
    skipped (the router's warm-up takes its prompts after the measured ones)."""
    per = -(-n // len(categories))
    lists = {c: load_prompts(c, per, offset) for c in categories}
    return [(c, lists[c][i]) for i in range(per) for c in categories][:n]


def local_stack_config(dtype: str, drafts: list[str] | None, stream_interval: int = 1,
                       only_drafts: bool = False) -> dict:
    """The shipped default application (deploy/serve.yaml) with ``dtype`` and ``stream_interval``.
    ``only_drafts``: restricted to ``drafts`` (every draft model loaded costs start-up time and
    memory that a run measuring only prompt lookup need not pay), which changes what
    ``serve-default`` measures: not the shipped default any more."""
    from specserve.cluster.serve_config import TARGET_REPLICAS, app_serve_config, local_serve_config

    args = local_serve_config()["applications"][0]["args"]
    args["dtype"] = dtype
    args["stream_interval"] = stream_interval
    available = list(args["drafts"])
    if drafts is not None:
        names = [d["name"] for d in available]
        unknown = [d for d in drafts if d not in names]
        if unknown:
            raise ValueError(f"--drafts: the local stack serves {', '.join(names)}, not {', '.join(unknown)} "
                             f"(give --server URL to measure another deployment)")
        if only_drafts:
            available = [d for d in available if d["name"] in drafts]
    args["drafts"] = available
    kept = [d["name"] for d in available]
    if args.get("default_draft") not in kept:
        args["default_draft"] = kept[0]
    # One entry per deployment the restricted app has (Serve refuses the others), sized as the default.
    return app_serve_config(args, target_replicas=TARGET_REPLICAS)


def served_model(url: str, headers: dict | None = None) -> dict:
    """The first model a server lists (an OpenAI server lists the one it serves first).
    ``headers``: specserve's API key for its own servers (a peer never gets it)."""
    try:
        response = httpx.get(f"{url}/v1/models", headers=headers or {}, timeout=60)
        response.raise_for_status()
        return response.json()["data"][0]
    except (httpx.HTTPError, ValueError, KeyError, IndexError) as err:
        raise RuntimeError(f"{url}/v1/models did not list a model ({type(err).__name__}: {err}); "
                           f"is an OpenAI-compatible server running there?") from err


# --- one request ---------------------------------------------------------------------------


def salt_for(*labels) -> str:
    """A ``cache_salt`` of its own for one row's round (of one run): its requests reuse no KV another
    row, round or run left (specserve's and vLLM's prefix caches both key on it), while the prompts, and so
    the work, stay the same for every row."""
    return hashlib.sha1(repr(labels).encode()).hexdigest()[:16]


def request_body(config: RowConfig, prompt: str, max_tokens: int, cache_salt: str | None = None,
                 system: str | None = None, response_format: dict | None = None) -> dict:
    """The OpenAI chat request every row sends: greedy, streamed, usage in the last chunk. Only
    specserve rows carry ``spec``: a peer gets nothing it does not know (vLLM rejects no extra
    field, but another server may, and the request must be the same a plain client sends), but
    for ``cache_salt`` when the run asks for it (``--no-prefix-reuse``: vLLM's field too)."""
    messages = [{"role": "user", "content": prompt}]
    if system is not None:
        messages.insert(0, {"role": "system", "content": system})
    body = {"model": config.model, "messages": messages, "max_tokens": max_tokens,
            "temperature": 0, "stream": True, "stream_options": {"include_usage": True}}
    if cache_salt is not None:
        body["cache_salt"] = cache_salt
    if response_format is not None:
        body["response_format"] = response_format
    spec = {key: value for key, value in (("draft", config.draft), ("window", config.window),
                                          ("grammar_draft", config.grammar_draft)) if value is not None}
    if config.backend == "serve" and spec:
        body["spec"] = spec
    return body


class StreamError(Exception):
    """A streamed completion the server refused (not 200) or ended with an in-band error."""


async def chat_chunks(client: httpx.AsyncClient, url: str, body: dict):
    """The JSON chunks of one streamed chat completion (SSE ``data:`` lines up to ``[DONE]``)."""
    async with client.stream("POST", f"{url}/v1/chat/completions", json=body) as response:
        if response.status_code != 200:
            raise StreamError(f"HTTP {response.status_code}: {(await response.aread())[:200]!r}")
        async for line in response.aiter_lines():
            if not line.startswith("data: ") or line == "data: [DONE]":
                continue
            chunk = json.loads(line[6:])
            if "error" in chunk:
                raise StreamError(f"in-band {chunk['error'].get('code')}: {chunk['error'].get('message')}")
            yield chunk


async def http_request(client: httpx.AsyncClient, config: RowConfig, prompt: str, max_tokens: int,
                       record: RequestRecord, cache_salt: str | None = None, system: str | None = None,
                       response_format: dict | None = None) -> None:
    body = request_body(config, prompt, max_tokens, cache_salt, system, response_format)
    start = last = time.perf_counter()
    record.start_s = start
    try:
        async for chunk in chat_chunks(client, config.url, body):
            now = time.perf_counter()
            if chunk.get("choices") and chunk["choices"][0]["delta"].get("content"):
                record.text += chunk["choices"][0]["delta"]["content"]
                if not record.ttft_s:
                    record.ttft_s = now - start
                else:
                    record.chunk_gaps_s.append(now - last)
                last = now
            # A peer's steps stay unknown even if it speaks specserve's extension: its rows
            # must read the same whatever server stands behind them.
            spec = chunk.get("spec") if config.backend == "serve" else None
            if spec:
                record.draft = spec.get("draft", "")
                record.steps = spec["steps"]
                record.mean_accepted_len = spec["mean_accepted_len"]
                record.draft_s = spec["draft_ms_per_step"] * spec["steps"] / 1e3
                record.verify_s = spec["verify_ms_per_step"] * spec["steps"] / 1e3
                record.replica = spec.get("replica", "")
            if chunk.get("usage"):
                record.output_tokens = chunk["usage"]["completion_tokens"]
        record.latency_s = time.perf_counter() - start
        record.ok = record.output_tokens > 0
        if not record.ok:
            record.error = "no usage in the stream: the server ignored stream_options.include_usage or sent no tokens"
    except StreamError as err:
        record.error = str(err)
    except httpx.HTTPError as err:
        record.error = f"{type(err).__name__}: {err}"


def in_process_request(engine, prompt_ids: list[int], config: RowConfig, max_tokens: int,
                       record: RequestRecord) -> None:
    from specserve.replicas.engine import GenerateRequest

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


async def load_run(prompts: list[str], config: RowConfig, concurrency: int, rate: float, max_tokens: int,
                   seed: int = 0, cache_salt: str | None = None, system: str | None = None,
                   formats: list[dict] | None = None) -> tuple[list[RequestRecord], float]:
    """All prompts to the row's server, Poisson arrivals at ``rate``, at most ``concurrency`` in flight.
    The seed is the same for every row, so every row sees the same arrival times. ``formats``: each
    prompt's ``response_format`` (a structured run)."""
    rng = random.Random(seed)
    gate = asyncio.Semaphore(concurrency)
    records = [RequestRecord(config.name, concurrency, rate, i) for i in range(len(prompts))]
    limits = httpx.Limits(max_connections=concurrency + 4)
    # A peer gets no key of ours: SPECSERVE_API_KEY is specserve's.
    headers = client_headers() if config.backend == "serve" else {}
    async with httpx.AsyncClient(timeout=httpx.Timeout(900.0), limits=limits, headers=headers) as client:

        async def one(i: int) -> None:
            async with gate:
                await http_request(client, config, prompts[i], max_tokens, records[i], cache_salt, system,
                                   formats[i] if formats else None)

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
    # Per-step figures only where every completed request reported its steps: a peer reports none,
    # and a partial count would make ms/step look too long.
    steps = sum(r.steps for r in ok) if ok and all(r.steps for r in ok) else 0
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
        "drafts": dict(Counter(r.draft for r in ok if r.draft)),
        "parsed_json": sum(parses(r.text) for r in ok),   # meaningful in a structured run only
    }


def step_overhead(records: list[RequestRecord], served: str, in_process: str) -> dict:
    """A served row vs the in-process row at concurrency 1, paired by prompt."""
    by = {(r.config, r.prompt_index): r for r in records if r.ok and r.concurrency == 1}
    pairs = [(by[(served, i)], by[(in_process, i)]) for (c, i) in by
             if c == served and (in_process, i) in by and by[(served, i)].steps]
    if not pairs:
        return {}
    served_s = sum(s.latency_s for s, _ in pairs) / sum(s.steps for s, _ in pairs)
    inproc_s = sum(p.latency_s for _, p in pairs) / sum(p.steps for _, p in pairs)
    return {"served_ms_per_step": round(1e3 * served_s, 2), "in_process_ms_per_step": round(1e3 * inproc_s, 2),
            "step_overhead_vs_in_process": round(served_s / inproc_s - 1, 4), "prompts": len(pairs),
            "prompts_with_equal_steps": sum(s.steps == p.steps for s, p in pairs)}


def row(config: RowConfig, concurrency: int, rate: float, summary: dict) -> dict:
    """One result row: what was measured (the row's whole config) and how it did."""
    return {"config": config.name, "concurrency": concurrency, "rate": _rate(rate),
            "setup": {k: v for k, v in asdict(config).items() if k != "name"}, **summary}


# --- the run -------------------------------------------------------------------------------


@dataclass(frozen=True, kw_only=True)
class ServeBenchConfig:
    """What one run measures and where it writes (``specserve bench serve``'s options, with its
    defaults). Checked when made, before any stack starts, so that a mistake costs no waiting; the
    drafts (named by the deployment) and the in-process draft (the zoo) are checked by the run."""

    json_path: Path = Path("bench-serve.json")   # every row's figures, the overhead and the machine
    plot_path: Path = Path("bench-serve.png")    # output tokens/s and TPOT against concurrency
    server: str | None = None          # a running deployment's URL; None: the local stack, up and down
    drafts: tuple[str, ...] | None = None   # a serve-spec row each; None: every draft the deployment serves
    peers: tuple[tuple[str, str], ...] = ()   # (name, base URL) of OpenAI-compatible servers, from parse_peers
    in_process: str | None = PROMPT_LOOKUP   # the in-process-spec row's draft (the served path's floor); None: no row
    num_prompts: int = 12              # in all, the categories in turn (concurrency 16 binds only with more)
    max_tokens: int = 64               # new tokens per request
    concurrency: tuple[int, ...] = (1, 4, 8, 16)   # requests in flight at most; at 1 rows take turns per prompt
    rates: tuple[float, ...] = (2.0, math.inf)   # Poisson arrivals/s: 2 keeps ~4 in flight; inf: all at once
    window: int = 4                    # the pinned γ of the serve-spec and in-process rows
    adaptive: bool = False             # serve-spec rows name their draft only: the deployment's policy picks γ
    categories: tuple[str, ...] = CATEGORIES   # the prompts', in turn (checked; blanks and repeats dropped)
    router_warmup: int = 0             # other prompts per category sent with no spec first, for the routers to learn
    dtype: str = "auto"                # of the in-process engine and of the local stack
    repeats: int = 2                   # rounds of the loaded runs, the rows taking turns: one run alone is noisy
    stream_interval: int = 1           # tokens per streamed piece of the local stack (peers: start them the same)
    no_prefix_reuse: bool = False      # a cache_salt per row, round and concurrency: no prefix cache another filled
    only_drafts: bool = False          # the local stack serves only ``drafts`` (not the shipped default any more)
    structured: bool = False           # every request asks for JSON of its category's schema (response_format)

    def __post_init__(self) -> None:
        if self.num_prompts < 1 or self.max_tokens < 1 or self.repeats < 1 or self.stream_interval < 1:
            raise ValueError(f"--prompts, --max-tokens, --repeats and --stream-interval must be >= 1, "
                             f"got {self.num_prompts}, {self.max_tokens}, {self.repeats}, {self.stream_interval}")
        if not self.concurrency or min(self.concurrency) < 1:
            raise ValueError(f"--concurrency needs integers >= 1, got {list(self.concurrency)}")
        if not self.rates or min(self.rates) <= 0:
            raise ValueError(f"--rates needs numbers > 0 (or inf), got {list(self.rates)}")
        if self.router_warmup < 0:
            raise ValueError(f"--router-warmup must be >= 0, got {self.router_warmup}")
        # Frozen: the checked names replace the given ones through object.__setattr__.
        object.__setattr__(self, "categories", tuple(check_categories(self.categories)))
        if self.window < 1:
            raise ValueError(f"--window must be >= 1 (serve-target-only is the plain row), got {self.window}")
        if self.structured and self.in_process is not None:
            raise ValueError("--structured runs no in-process row (the in-process engine follows no grammar): "
                             "give --in-process none")


@dataclass
class _Prompts:
    """A run's prompts: ``labelled`` (category, text) in turn, the texts sent (asked for JSON when
    structured, with each one's ``formats``), and the router's warm-up prompts (others)."""

    labelled: list[tuple[str, str]]
    texts: list[str]
    formats: list[dict] | None
    warmup: list[str]

    @classmethod
    def of(cls, config: ServeBenchConfig) -> "_Prompts":
        categories = list(config.categories)
        labelled = mixed_prompts(categories, config.num_prompts)
        texts, formats = [p for _, p in labelled], None
        if config.structured:   # the same prompts, asked for their category's JSON
            texts = [f"{p}\n\nReply with a JSON object." for p in texts]
            formats = [response_format(c) for c, _ in labelled]
        warmup = [p for _, p in mixed_prompts(categories, config.router_warmup * len(categories),
                                              -(-config.num_prompts // len(categories)))]
        return cls(labelled, texts, formats, warmup)


class _Rows:
    """The rows of one run against a deployment, measured on the same prompts: each request's
    record and each row's summary as they come."""

    def __init__(self, config: ServeBenchConfig, prompts: _Prompts, configs: list[RowConfig], engine=None,
                 prompt_ids: list[list[int]] | None = None):
        self.config, self.prompts, self.configs = config, prompts, configs
        self.engine, self.prompt_ids = engine, prompt_ids
        # In every salt: a peer's prefix cache outlives a run, and the next run must not hit it.
        self.run_id = uuid.uuid4().hex[:8]
        self.records: list[RequestRecord] = []
        self.runs: list[dict] = []
        self.routed_warmup: dict = {}
        # What the router knows of a prompt must come from other prompts: it goes first.
        self.first = "serve-default" if prompts.warmup else None

    def one(self, row_config: RowConfig, i: int, tokens: int) -> RequestRecord:
        """Prompt ``i`` alone through one row."""
        if row_config.backend == "in-process":
            rec = RequestRecord(row_config.name, 1, math.inf, i)
            in_process_request(self.engine, self.prompt_ids[i], row_config, tokens, rec)
            return rec
        salt = salt_for(self.run_id, row_config.name, 1, i) if self.config.no_prefix_reuse else None
        formats = self.prompts.formats
        rec = asyncio.run(load_run([self.prompts.texts[i]], row_config, 1, math.inf, tokens, cache_salt=salt,
                                   formats=[formats[i]] if formats else None))[0][0]
        rec.prompt_index = i
        return rec

    def warm_up(self) -> None:
        """The first calls through Serve's handles and the first forwards are slow; the routers
        learn from the warm-up prompts first."""
        for row_config in self.configs:
            self.one(row_config, 0, 8)
        warmup = self.prompts.warmup
        if warmup:
            default = next(c for c in self.configs if c.name == "serve-default")
            print(f"router warm-up: {len(warmup)} requests with no spec, 2 at a time", flush=True)
            recs, _ = asyncio.run(load_run(warmup, replace(default, name="router-warmup"), 2, math.inf,
                                           self.config.max_tokens))
            self.routed_warmup = {"requests": len(recs), "failed": sum(not r.ok for r in recs),
                                  "drafts": dict(Counter(r.draft for r in recs if r.ok))}

    def _order(self, rows: list[RowConfig], turn: int) -> list[RowConfig]:
        order = in_turn(rows, turn)
        order.sort(key=lambda c: c.name != self.first)   # stable: the others keep their turn
        return order

    def alone(self) -> None:
        """Concurrency 1: every request runs alone (so the arrival rate changes nothing), and the
        rows take turns prompt by prompt (the first one rotating)."""
        from tqdm import tqdm

        turn: dict[str, list[RequestRecord]] = {c.name: [] for c in self.configs}
        busy_s = {c.name: 0.0 for c in self.configs}
        for i in tqdm(range(len(self.prompts.texts)), desc="concurrency 1", unit="prompt"):
            for row_config in self._order(self.configs, i):
                t0 = time.perf_counter()
                turn[row_config.name].append(self.one(row_config, i, self.config.max_tokens))
                busy_s[row_config.name] += time.perf_counter() - t0
        for row_config in self.configs:
            self.records += turn[row_config.name]
            self.runs.append(row(row_config, 1, math.inf, summarise(turn[row_config.name], busy_s[row_config.name])))

    def loaded(self, concurrency: int, rate: float) -> None:
        """Every prompt at once up to ``concurrency`` in flight, arriving at ``rate``: the served
        rows in turn, ``repeats`` rounds."""
        config, texts = self.config, self.prompts.texts
        rows = [c for c in self.configs if c.backend != "in-process"]
        got: dict[str, list[tuple[list[RequestRecord], float]]] = {c.name: [] for c in rows}
        for r in range(config.repeats):
            for row_config in self._order(rows, r):
                print(f"{row_config.name}: concurrency {concurrency}, rate {rate} req/s, {len(texts)} requests"
                      + (f" (round {r + 1} of {config.repeats})" if config.repeats > 1 else ""), flush=True)
                salt = salt_for(self.run_id, row_config.name, concurrency, rate, r) if config.no_prefix_reuse else None
                recs, duration = asyncio.run(load_run(texts, row_config, concurrency, rate, config.max_tokens,
                                                      cache_salt=salt, formats=self.prompts.formats))
                self.records += recs
                got[row_config.name].append((recs, duration))
        for row_config in rows:
            rounds = got[row_config.name]
            summary = summarise([rec for recs, _ in rounds for rec in recs], sum(d for _, d in rounds))
            if config.repeats > 1:
                summary["output_tokens_per_s_rounds"] = [summarise(recs, d)["output_tokens_per_s"] for recs, d in rounds]
            self.runs.append(row(row_config, concurrency, rate, summary))

    def overhead(self) -> dict:
        """The served path's extra ms per step against the in-process row, for the served rows
        with its draft and window."""
        inproc = next((c for c in self.configs if c.backend == "in-process"), None)
        if inproc is None:
            return {}
        return {c.name: step_overhead(self.records, c.name, inproc.name) for c in self.configs
                if c.backend == "serve" and c.window == inproc.window and c.draft == inproc.draft}


def _check_in_process(draft: str | None) -> None:
    if draft is None:
        return
    from specserve.replicas.model_store import zoo_drafts

    runnable = [PROMPT_LOOKUP, SUFFIX, *zoo_drafts()]
    if draft not in runnable:
        raise ValueError(f"--in-process runs one of {', '.join(runnable)} (or none), got {draft!r}")


def _in_process_engine(config: ServeBenchConfig, texts: list[str]):
    """The in-process row's engine and the prompts as its ids."""
    from specserve.replicas.engine import SpecEngine
    from specserve.training.answers import ANSWERS_DIR

    draft = config.in_process
    engine = SpecEngine.load(dtype=config.dtype, draft_models=[] if draft in (PROMPT_LOOKUP, SUFFIX) else [draft],
                             suffix_seed=ANSWERS_DIR if draft == SUFFIX else None)
    return engine, [engine.encode(p) for p in texts]


def run_serve_bench(config: ServeBenchConfig) -> dict:
    """Every row on the same prompts, at every concurrency and rate; write JSON and plot, print a
    table; return the JSON. ``repeats``: one run each of a few seconds on a shared machine differs
    by more than the rows do, so the loaded runs go round ``repeats`` times, the rows taking turns
    in each.
    ``no_prefix_reuse``: every row, round and concurrency sends its requests with a ``cache_salt``
    of its own (``salt_for``), so that no row is served from a prefix cache another row or round
    filled: the engines' throughput, not their caches (peers must know vLLM's ``cache_salt``).
    Without it the same prompts repeat, as a chat service's system prompts and follow-ups do, and
    prefix caches count. ``adaptive`` and ``router_warmup``: see the module's docstring."""
    _check_in_process(config.in_process)
    prompts = _Prompts.of(config)
    # Ask the peers first: a peer that is not running should cost no stack start-up.
    peer_rows = [(name, url, served_model(url)["id"]) for name, url in config.peers]

    from specserve.cluster import local
    import torch

    drafts = None if config.drafts is None else list(config.drafts)
    started = config.server is None
    if started:
        serve_config = local_stack_config(config.dtype, drafts, config.stream_interval, config.only_drafts)
        print("bringing the local stack up (specserve up)...", flush=True)
        server = local.up(serve_config).http_url
    else:
        server = config.server.rstrip("/").removesuffix("/v1")
    try:
        listed = served_model(server, client_headers())
        model = listed["id"]
        chosen = resolve_drafts(drafts, listed.get("drafts", []))
        configs = configs_for(server, model, chosen, config.window, config.in_process, peer_rows, config.adaptive,
                              config.structured)
        engine, prompt_ids, in_process_threads = None, None, None
        if config.in_process is not None:
            engine, prompt_ids = _in_process_engine(config, prompts.texts)
            if started:
                # The same torch threads as a served target replica, so that the per-step
                # comparison prices the serving path, not a second thread (it runs on this thread).
                in_process_threads = serve_config["applications"][0]["args"]["torch_threads"]
                torch.set_num_threads(in_process_threads)
        machine = machine_info()
        rows = _Rows(config, prompts, configs, engine, prompt_ids)
        rows.warm_up()
        if 1 in config.concurrency:
            rows.alone()
        for concurrency in [c for c in config.concurrency if c > 1]:
            for rate in config.rates:
                rows.loaded(concurrency, rate)
    finally:
        if started:
            local.down()

    result = {
        "meta": {"server": server, "model": model, "dtype": config.dtype, "prompts": config.num_prompts,
                 "categories": list(config.categories), "prompt_categories": [c for c, _ in prompts.labelled],
                 "adaptive": config.adaptive, "router_warmup": rows.routed_warmup, "max_tokens": config.max_tokens,
                 "window": config.window, "repeats": config.repeats,
                 "stream_interval": config.stream_interval, "no_prefix_reuse": config.no_prefix_reuse,
                 "structured": config.structured,
                 "drafts": chosen, "placement": listed.get("placement", {}), "in_process": config.in_process,
                 "in_process_threads": in_process_threads or torch.get_num_threads(),
                 "peers": {name: {"url": url, "model": m} for name, url, m in peer_rows},
                 "concurrencies": list(config.concurrency), "rates": [_rate(r) for r in config.rates],
                 "machine": machine, "load_avg_1m_after": machine_info()["load_avg_1m"]},
        "overhead": rows.overhead(),
        "runs": rows.runs,
    }
    _report(result, config)
    return result


def _report(result: dict, config: ServeBenchConfig) -> None:
    """Write the JSON and the plot, print the table and the served path's overhead."""
    json_path, plot_path = config.json_path, config.plot_path
    json_path.parent.mkdir(parents=True, exist_ok=True)
    json_path.write_text(json.dumps(result, indent=2) + "\n")
    lines = [f"{name}: {100 * o['step_overhead_vs_in_process']:+.1f}% per step vs in-process "
             f"({o['served_ms_per_step']} vs {o['in_process_ms_per_step']} ms/step, {o['prompts']} prompts)"
             for name, o in result["overhead"].items() if o]
    plot(result["runs"], result["meta"], plot_path)
    print(format_table(result["runs"]))
    if lines:
        print("\nconcurrency 1, served path against the in-process engine:\n  " + "\n  ".join(lines))
    print(f"\nwrote {json_path} and {plot_path}")


def _rate(rate: float) -> float | str:
    """JSON has no infinity: an unbounded rate is written "inf"."""
    return rate if math.isfinite(rate) else "inf"


def format_table(runs: list[dict]) -> str:
    width = max([len("config"), *(len(r["config"]) for r in runs)])
    header = (f"{'config':{width}s} {'conc':>4s} {'rate':>5s} {'ok':>4s} {'fail':>4s} {'out tok/s':>9s} "
              f"{'TTFT p50':>9s} {'TPOT p50':>9s} {'ITL p50':>8s} {'ms/step':>8s} {'draft':>6s} {'verify':>6s} {'τ':>5s}")
    lines = [header, "-" * len(header)]

    def num(value, spec: str) -> str:   # unknown (a peer's steps, no completed request): "-"
        return format(value, spec) if value is not None else "-"

    for r in runs:
        lines.append(f"{r['config']:{width}s} {r['concurrency']:4d} {str(r['rate']):>5s} {r['completed']:4d} "
                     f"{r['failed']:4d} {r['output_tokens_per_s']:9.2f} {num(r['ttft_ms']['median'], '.1f'):>9s} "
                     f"{num(r['tpot_ms']['median'], '.1f'):>9s} {num(r['itl_ms']['median'], '.1f'):>8s} "
                     f"{num(r['ms_per_step'], '.1f'):>8s} {num(r['draft_ms_per_step'], '.1f'):>6s} "
                     f"{num(r['verify_ms_per_step'], '.1f'):>6s} {num(r['mean_accepted_len'], '.2f'):>5s}")
    return "\n".join(lines)


def plot(runs: list[dict], meta: dict, path: Path) -> list[str]:
    """Output tokens/s and median TPOT against concurrency: a colour per row, a line style per
    arrival rate. Returns the legend's labels (every row, then every rate)."""
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt
    from matplotlib.lines import Line2D

    names = list(dict.fromkeys(r["config"] for r in runs))
    rates = list(dict.fromkeys(r["rate"] for r in runs if r["concurrency"] > 1)) or ["inf"]
    colours = {name: plt.get_cmap("tab10" if len(names) <= 10 else "tab20")(i) for i, name in enumerate(names)}
    styles = {rate: ("-", "--", ":", "-.")[i % 4] for i, rate in enumerate(rates)}

    fig, (ax_tps, ax_tpot) = plt.subplots(1, 2, figsize=(12, 4.8))
    for name in names:
        alone = [r for r in runs if r["config"] == name and r["concurrency"] == 1]
        for rate in rates:
            # A request at concurrency 1 runs alone whatever the rate: that point starts every rate's line.
            points = sorted(alone + [r for r in runs if r["config"] == name and r["concurrency"] > 1
                                     and r["rate"] == rate], key=lambda r: r["concurrency"])
            if not points:
                continue
            xs = [r["concurrency"] for r in points]
            for ax, ys in ((ax_tps, [r["output_tokens_per_s"] for r in points]),
                           (ax_tpot, [r["tpot_ms"]["median"] for r in points])):
                ax.plot(xs, [y if y is not None else math.nan for y in ys], color=colours[name],
                        linestyle=styles[rate], marker="s" if name.startswith("in-process") else "o", markersize=4)
    levels = sorted({r["concurrency"] for r in runs})
    for ax, ylabel in ((ax_tps, "output tokens / s"), (ax_tpot, "median TPOT (ms)")):
        ax.set_xscale("log", base=2)
        ax.set_xticks(levels, [str(c) for c in levels])
        ax.minorticks_off()
        ax.set_xlabel("concurrency")
        ax.set_ylabel(ylabel)
        ax.grid(alpha=0.3)
    handles = [Line2D([], [], color=colours[n], marker="s" if n.startswith("in-process") else "o", label=n) for n in names]
    handles += [Line2D([], [], color="grey", linestyle=styles[r], label=f"rate {r} req/s") for r in rates]
    legend = fig.legend(handles=handles, loc="center left", bbox_to_anchor=(0.78, 0.5), fontsize=7, frameon=False)
    machine = meta["machine"]
    placed = ", ".join(f"{d} {p['where']}" for d, p in (meta.get("placement") or {}).items())
    fig.suptitle(f"{meta['model']} {meta['dtype']}, greedy, {meta['prompts']} prompts ({'/'.join(meta.get('categories', []))}), "
                 f"{meta['max_tokens']} tokens, serve-spec γ={meta['window']}"
                 f"{', no prefix reuse' if meta.get('no_prefix_reuse') else ''}; "
                 f"{machine.get('cpu_model', 'CPU')}, {machine['cpu_count']} CPUs, load {machine['load_avg_1m']}"
                 + (f"\ndrafts placed: {placed}" if placed else ""), fontsize=9)
    fig.tight_layout(rect=(0, 0, 0.78, 1))   # the right margin holds the legend
    path.parent.mkdir(parents=True, exist_ok=True)
    fig.savefig(path, dpi=120)
    plt.close(fig)
    return [t.get_text() for t in legend.get_texts()]
