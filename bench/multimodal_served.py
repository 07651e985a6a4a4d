"""``specserve bench multimodal --served``: TABED's scenario rows over HTTP, against a deployment
whose target replicas serve one draft per row, the ensemble's weights learned from the traffic.

Each row is a draft of the deployment named after it (``served_config``): ``multimodal``,
``text-only``, ``pooled`` (one view of ``--draft``), ``ensemble`` (the views mixed by test-time
weights, TABED Alg. 1) and ``ensemble-static`` (the equal mix), every one inside the target replica
(where the pictures are); ``target-only`` asks for ``draft: none``. The ``caption`` view is not
served here: a replica keeps a picture's caption whatever the request's salt, so which row paid for
it would depend on the order and the replica. ``--served`` brings that application up on a local
Ray cluster with Redis (``--replicas`` target replicas) and takes it down after; ``--server URL``
measures a running deployment that serves those drafts.

With ``--pictures 0`` it serves Sparrow's rows instead (``frames_served_config``): clips of each
``--frames`` count as ``video_url`` parts, answered by ``--head`` drafting with full and with
windowed attention, ``--ivsb-head`` (windowed) and ``--draft``'s multimodal view (a draft LM reading
every frame), each inside the target replica, and target-only; the decoding speedup takes each
request's prefill (``spec.prefill_ms``) from its time at the client.

The conversations are the in-process benchmark's (``multimodal.scenario_work``; the first turns'
answers the served VLM's own), pictures sent as PNG data URLs, one request at a time, every row in
turn per conversation, each request with a ``cache_salt`` of its own (cold: no row reuses another's
prefill). What the ensemble learns stays with the deployment, as in production: a request's first
block drafts with its replica's prior, which pools what the finished requests of that draft on
every replica left in Redis (docs/design.md §5). A row's tokens/s is its completion tokens over its
requests' wall time at the client (HTTP and the ingress included); its mean accepted length, the
completion tokens over the steps the replica reports.
"""

from __future__ import annotations

import base64
import io
import json
import random
import time
import uuid
from collections import Counter
from pathlib import Path

import httpx

from specserve.bench.multimodal import (MultimodalBenchConfig, aims, format_table, frame_aims, frame_prompt, frame_row,
                                        plot, row_ensembles, rows_of, scenario_work, table)

REQUEST_TIMEOUT_S = 600.0


def served_config(config: MultimodalBenchConfig, replicas: int = 2) -> dict:
    """The application the rows ask: ``config.target`` with one draft per row (a view or a mix of
    ``config.draft``, inside the target replica), ``replicas`` target replicas from the start and no
    more (the rows compare drafts, not autoscaling)."""
    check_served(config)
    drafts = [{"name": row, "model": spec["model"], "placement": "inside",
               "ensemble": {"views": spec["views"], **({"weights": spec["weights"]} if "weights" in spec else {})}}
              for row, spec in row_ensembles(config.draft, config.views).items()]
    return _fixed_replicas({"target": config.target, "dtype": config.dtype, "drafts": drafts,
                            "default_draft": drafts[0]["name"]}, replicas)


# Sparrow's served rows and the draft each asks (``frames_served_config``).
FRAME_DRAFTS = {"target-only": "none", "full": "full", "windowed": "windowed", "windowed+ivsb": "windowed-ivsb",
                "draft-lm": "draft-lm"}


def frames_served_config(config: MultimodalBenchConfig, replicas: int = 2) -> dict:
    """The application Sparrow's served rows ask: ``config.target`` with ``--head`` drafting with
    full and with windowed attention, ``--ivsb-head`` windowed and ``--draft``'s multimodal view,
    every one inside the target replica, ``replicas`` replicas from the start and no more."""
    drafts = [{"name": "full", "model": config.head}, {"name": "windowed", "model": config.head, "windowed": True},
              *([{"name": "windowed-ivsb", "model": config.ivsb_head, "windowed": True}] if config.ivsb_head else []),
              {"name": "draft-lm", "model": config.draft, "placement": "inside", "ensemble": {"views": ["multimodal"]}}]
    return _fixed_replicas({"target": config.target, "dtype": config.dtype, "drafts": drafts,
                            "default_draft": "windowed", "max_video_frames": max(config.frames)}, replicas)


def _fixed_replicas(app: dict, replicas: int) -> dict:
    from specserve.cluster.config import TARGET_DEPLOYMENT
    from specserve.cluster.serve_config import app_serve_config

    if replicas < 1:
        raise ValueError(f"--replicas must be at least 1; got {replicas}")
    serve = app_serve_config(app, target_replicas=replicas)
    for entry in serve["applications"][0]["deployments"]:
        if entry["name"] == TARGET_DEPLOYMENT:
            entry["autoscaling_config"].update(min_replicas=replicas, max_replicas=replicas)
    return serve


def sparrow_rows(config: MultimodalBenchConfig) -> bool:
    """Whether the served rows are Sparrow's (``--pictures 0``, clips of ``--frames``), not TABED's scenarios."""
    return config.pictures == 0


def check_served(config: MultimodalBenchConfig) -> None:
    if sparrow_rows(config):   # MultimodalBenchConfig asks --frames of --pictures 0
        return
    if not config.scenarios:
        raise ValueError("the served rows run --scenarios (TABED's conversations), --pictures of each at least 1; "
                         "or, with --pictures 0, Sparrow's rows on clips of --frames")
    if "caption" in config.views:
        raise ValueError("the served rows compare the multimodal, text-only and pooled views: a replica keeps a "
                         "picture's caption across requests, so the caption view's cost would depend on the order")


def data_url(picture) -> str:
    buffer = io.BytesIO()
    picture.save(buffer, format="PNG")
    return "data:image/png;base64," + base64.b64encode(buffer.getvalue()).decode()


def openai_messages(messages: list[dict], pictures: tuple) -> list[dict]:
    """``messages`` with each ``{"type": "image"}`` part the next of ``pictures`` as an OpenAI
    ``image_url`` part (a PNG data URL), and each ``{"type": "video", "frames": n}`` part the next
    ``n`` as a clip (vLLM's ``video_url`` part, its frames PNG data URLs)."""
    left = iter(pictures)

    def part_of(part: dict) -> dict:
        if part["type"] == "image":
            return {"type": "image_url", "image_url": {"url": data_url(next(left))}}
        if part["type"] == "video":
            return {"type": "video_url", "video_url": {"frames": [data_url(next(left)) for _ in range(part["frames"])]}}
        return part

    out = []
    for message in messages:
        content = message["content"]
        out.append({**message, "content": [part_of(p) for p in content] if isinstance(content, list) else content})
    return out


class Client:
    """Chat requests to ``url``, each with a ``cache_salt`` of its own."""

    def __init__(self, url: str, headers: dict, model: str, config: MultimodalBenchConfig):
        self.url, self.model, self.config = url, model, config
        self.http = httpx.Client(headers=headers, timeout=REQUEST_TIMEOUT_S)

    def ask(self, messages: list[dict], pictures: tuple, row: str, draft: str | None = None) -> tuple[dict, float]:
        """(the response, its seconds at the client) of the conversation drafted by ``draft``
        (default: the draft named after ``row``; target-only: none)."""
        draft = draft or ("none" if row == "target-only" else row)
        body = {"model": self.model, "messages": openai_messages(messages, pictures),
                "max_tokens": self.config.max_tokens, "temperature": 0, "return_token_ids": True,
                "cache_salt": uuid.uuid4().hex,
                "spec": {"draft": "none"} if draft == "none" else {"draft": draft, "window": self.config.window}}
        began = time.perf_counter()
        try:
            response = self.http.post(f"{self.url}/v1/chat/completions", json=body)
        except httpx.HTTPError as err:
            raise RuntimeError(f"{row}: {type(err).__name__} from {self.url}: {err}") from err
        seconds = time.perf_counter() - began
        if response.status_code != 200:
            raise RuntimeError(f"{row}: HTTP {response.status_code}: {response.text[:500]}")
        return response.json(), seconds

    def answer(self, messages: list[dict], pictures: tuple) -> str:
        return self.ask(messages, pictures, "target-only")[0]["choices"][0]["message"]["content"]

    def close(self) -> None:
        self.http.close()


def check_drafts(url: str, headers: dict, drafts: list[str], frames: int = 0) -> str:
    """The served model's id, once it serves every one of ``drafts`` and reads clips of ``frames``
    frames whole (not sampled down to fewer)."""
    from specserve.bench.serve import served_model

    model = served_model(url, headers)
    missing = [d for d in drafts if d not in model.get("drafts", [])]
    if missing:
        raise ValueError(f"{url} serves no draft named {', '.join(missing)}: the served rows ask a deployment "
                         f"built by specserve.bench.multimodal_served.served_config or frames_served_config "
                         f"(--served brings one up)")
    most = model.get("max_video_frames")
    if frames and (most is None or frames > most):
        raise ValueError(f"{url} reads {most or 'no'} frames of a clip at most: --frames {frames} would be measured "
                         f"on fewer (its max_video_frames)")
    return model["id"]


def run_served_multimodal_bench(config: MultimodalBenchConfig, server: str | None = None, replicas: int = 2,
                                progress: bool = True) -> dict:
    from specserve.bench.engine import machine_info
    from specserve.cluster import local
    from specserve.ingress.auth import client_headers

    check_served(config)
    sparrow = sparrow_rows(config)
    if sparrow:   # the IVSB row only with an IVSB head
        rows_run = tuple(r for r in FRAME_DRAFTS if config.ivsb_head or r != "windowed+ivsb")
        drafts = {row: FRAME_DRAFTS[row] for row in rows_run if row != "target-only"}
    else:
        rows_run = rows_of(config.views)
        drafts = {row: row for row in rows_run if row != "target-only"}
    started = server is None
    if started:
        serve = (frames_served_config if sparrow else served_config)(config, replicas)
        if local.LocalState.load() is not None:
            raise RuntimeError("a local stack is up (`specserve status`): measure it with --server URL if it serves "
                               "the rows' drafts, or take it down first")
    headers = client_headers()
    try:
        if started:   # down below stops whatever up started, should up fail half way
            server = local.up(serve).http_url
        url = server.rstrip("/").removesuffix("/v1")
        most = max(config.frames) if sparrow else 0
        client = Client(url, headers, check_drafts(url, headers, list(drafts.values()), most), config)
        try:
            totals, answered_by, differs = (_measure_frames(client, config, drafts, progress) if sparrow
                                            else _measure(client, config, rows_run, progress))
        finally:
            client.close()
    finally:
        if started:
            local.down()
    rows = [] if sparrow else table(totals, rows_run, list(config.scenarios))
    frames = frame_table(totals, rows_run, config.frames) if sparrow else []
    result = {"config": {k: (str(v) if isinstance(v, Path) else v) for k, v in config.__dict__.items()},
              "served": {"server": None if started else url, "replicas": replicas if started else None,
                         "requests_per_replica": dict(answered_by),
                         # One stalled request moves a row's tokens/s: each row's slowest, per scenario or frames.
                         "slowest_request_s": {f"{row} {g}": round(cell["slowest_s"], 3)
                                               for (row, g), cell in totals.items()},
                         "answers_unlike_target_only": {row: differs[row] for row in rows_run if row != "target-only"},
                         # Requests a failed step ended and the ingress resumed: a healthy run has none.
                         "resumed": {row: sum(c["resumed"] for (r, _), c in totals.items() if r == row)
                                     for row in rows_run}},
              "machine": machine_info(), "date": time.strftime("%Y-%m-%d"), "rows": rows,
              "aims": {} if sparrow else aims(rows), "frames": frames, "frame_aims": frame_aims(frames)}
    config.json_path.write_text(json.dumps(result, indent=2))
    plot(result, config.plot_path)
    print(format_table(result))
    unlike = {row: n for row, n in result["served"]["answers_unlike_target_only"].items() if n}
    if unlike:   # greedy speculation is lossless up to the near-ties of a reduced precision
        print(f"answers unlike target-only's (greedy; near-ties in {config.dtype} aside, a lossless draft has none): "
              + ", ".join(f"{row} {n}" for row, n in unlike.items()))
    return result


def _new_cell() -> dict:
    return {"tokens": 0, "seconds": 0.0, "prefill": 0.0, "steps": 0, "drafted": 0, "draft_s": 0.0,
            "accepted_steps": 0.0, "slowest_s": 0.0, "resumed": 0}


def _tally(cell: dict, reply: dict, seconds: float) -> list[int]:
    """Adds one response timed ``seconds`` at the client to ``cell``; its token ids."""
    spec, tokens = reply.get("spec") or {}, reply["usage"]["completion_tokens"]
    steps = spec.get("steps") or tokens
    cell["seconds"] += seconds
    cell["slowest_s"] = max(cell["slowest_s"], seconds)
    cell["prefill"] += (spec.get("prefill_ms") or 0.0) / 1e3
    cell["tokens"] += tokens
    cell["steps"] += steps
    cell["drafted"] += sum(spec.get("windows") or ())
    cell["draft_s"] += (spec.get("draft_ms_per_step") or 0.0) * steps / 1e3
    cell["accepted_steps"] += (spec.get("acceptance_rate") or 0.0) * steps   # α, weighted by steps
    cell["resumed"] += bool(spec.get("resumed"))
    return reply["choices"][0]["token_ids"]


def _ask_every_row(client: Client, messages: list[dict], pictures: tuple, rows: list[tuple[str, str | None, dict]],
                   answered_by: Counter, differs: Counter, bar) -> None:
    """Asks the conversation of each ``(row, draft, cell)`` in turn, tallied into its cell; an
    answer unlike the first row's (target-only's) counts against its row."""
    plain = None
    for row, draft, cell in rows:
        reply, seconds = client.ask(messages, pictures, row, draft)
        ids = _tally(cell, reply, seconds)
        answered_by[(reply.get("spec") or {}).get("replica", "?")] += 1
        if plain is None:
            plain = ids
        elif ids != plain:
            differs[row] += 1
        bar.update()


def _measure(client: Client, config: MultimodalBenchConfig, rows_run: tuple[str, ...], progress: bool
             ) -> tuple[dict, Counter, Counter]:
    """(``{(row, scenario): cell}``, requests per replica, answers unlike target-only's per row)
    over ``config.repeats`` rounds of the scenarios' conversations."""
    from tqdm import tqdm

    work = scenario_work(config, client.answer)
    random.Random(0).shuffle(work)   # scenarios interleaved, as a replica's traffic is
    totals = {(row, g): _new_cell() for row in rows_run for g in config.scenarios}
    answered_by, differs = Counter(), Counter()
    bar = tqdm(total=len(work) * len(rows_run) * config.repeats, desc="bench multimodal (served)", disable=not progress)
    for _ in range(config.repeats):
        for scenario, messages, pictures in work:
            asked = [(row, None, totals[(row, scenario)]) for row in reversed(rows_run)]   # target-only first
            _ask_every_row(client, messages, pictures, asked, answered_by, differs, bar)
    bar.close()
    return totals, answered_by, differs


def _clip_messages(config: MultimodalBenchConfig, frames: int, n: int) -> tuple[list[dict], tuple]:
    """Prompt ``n`` of Sparrow's rows at ``frames`` frames: (the messages, the frames shown)."""
    question, shown = frame_prompt(config.frame_category, frames, n)
    return [{"role": "user", "content": [{"type": "video", "frames": len(shown)},
                                         {"type": "text", "text": question}]}], shown


def _measure_frames(client: Client, config: MultimodalBenchConfig, drafts: dict[str, str], progress: bool
                    ) -> tuple[dict, Counter, Counter]:
    """(``{(row, frames): cell}``, requests per replica, answers unlike target-only's per row) over
    ``config.frame_prompts`` clips of each frame count, every row in turn on each (target-only
    first), ``config.repeats`` times, after one untimed request per row (each draft's first call
    pays its warm-up)."""
    from tqdm import tqdm

    rows = ("target-only", *drafts)
    warm, shown = _clip_messages(config, min(config.frames), config.frame_prompts)
    for row in rows:
        client.ask(warm, shown, row, drafts.get(row, "none"))
    totals = {(row, f): _new_cell() for row in rows for f in config.frames}
    answered_by, differs = Counter(), Counter()
    bar = tqdm(total=len(config.frames) * config.frame_prompts * len(rows) * config.repeats,
               desc="bench multimodal frames (served)", disable=not progress)
    for _ in range(config.repeats):
        for frames in config.frames:
            for n in range(config.frame_prompts):
                messages, shown = _clip_messages(config, frames, n)
                _ask_every_row(client, messages, shown,
                               [(row, drafts.get(row, "none"), totals[(row, frames)]) for row in rows],
                               answered_by, differs, bar)
    bar.close()
    return totals, answered_by, differs


def frame_table(totals: dict, rows: tuple[str, ...], frames: tuple[int, ...]) -> list[dict]:
    """Sparrow's rows as the in-process bench writes them (``multimodal.frame_row``), from what the
    client timed and each response's ``spec``: decode time is a request's time at the client less
    its ``prefill_ms``, α the responses' own weighted by their steps."""
    return [frame_row(row, f, totals[(row, f)], totals[("target-only", f)],
                      totals[(row, f)]["accepted_steps"] / max(1, totals[(row, f)]["steps"]))
            for f in frames for row in rows]
