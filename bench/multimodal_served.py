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

from specserve.bench.multimodal import (MultimodalBenchConfig, aims, format_table, plot, row_ensembles, rows_of,
                                        scenario_work, table)

REQUEST_TIMEOUT_S = 600.0


def served_config(config: MultimodalBenchConfig, replicas: int = 2) -> dict:
    """The application the rows ask: ``config.target`` with one draft per row (a view or a mix of
    ``config.draft``, inside the target replica), ``replicas`` target replicas from the start and no
    more (the rows compare drafts, not autoscaling)."""
    from specserve.cluster.config import TARGET_DEPLOYMENT
    from specserve.cluster.serve_config import app_serve_config

    if replicas < 1:
        raise ValueError(f"--replicas must be at least 1; got {replicas}")
    check_served(config)
    drafts = [{"name": row, "model": spec["model"], "placement": "inside",
               "ensemble": {"views": spec["views"], **({"weights": spec["weights"]} if "weights" in spec else {})}}
              for row, spec in row_ensembles(config.draft, config.views).items()]
    serve = app_serve_config({"target": config.target, "dtype": config.dtype, "drafts": drafts,
                              "default_draft": drafts[0]["name"]}, target_replicas=replicas)
    for entry in serve["applications"][0]["deployments"]:
        if entry["name"] == TARGET_DEPLOYMENT:
            entry["autoscaling_config"].update(min_replicas=replicas, max_replicas=replicas)
    return serve


def check_served(config: MultimodalBenchConfig) -> None:
    if not config.scenarios or config.pictures < 1:
        raise ValueError("the served rows run --scenarios (TABED's conversations), --pictures of each at least 1")
    if "caption" in config.views:
        raise ValueError("the served rows compare the multimodal, text-only and pooled views: a replica keeps a "
                         "picture's caption across requests, so the caption view's cost would depend on the order")


def data_url(picture) -> str:
    buffer = io.BytesIO()
    picture.save(buffer, format="PNG")
    return "data:image/png;base64," + base64.b64encode(buffer.getvalue()).decode()


def openai_messages(messages: list[dict], pictures: tuple) -> list[dict]:
    """``messages`` with each ``{"type": "image"}`` part the next of ``pictures`` as an OpenAI
    ``image_url`` part (a PNG data URL)."""
    left = iter(pictures)
    out = []
    for message in messages:
        content = message["content"]
        if isinstance(content, list):
            content = [{"type": "image_url", "image_url": {"url": data_url(next(left))}} if part["type"] == "image"
                       else part for part in content]
        out.append({**message, "content": content})
    return out


class Client:
    """Chat requests to ``url``, each with a ``cache_salt`` of its own."""

    def __init__(self, url: str, headers: dict, model: str, config: MultimodalBenchConfig):
        self.url, self.model, self.config = url, model, config
        self.http = httpx.Client(headers=headers, timeout=REQUEST_TIMEOUT_S)

    def ask(self, messages: list[dict], pictures: tuple, row: str) -> tuple[dict, float]:
        """(the response, its seconds at the client) of the conversation drafted by ``row``'s draft."""
        target_only = row == "target-only"
        body = {"model": self.model, "messages": openai_messages(messages, pictures),
                "max_tokens": self.config.max_tokens, "temperature": 0, "return_token_ids": True,
                "cache_salt": uuid.uuid4().hex,
                "spec": {"draft": "none"} if target_only else {"draft": row, "window": self.config.window}}
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


def check_drafts(url: str, headers: dict, rows: tuple[str, ...]) -> str:
    """The served model's id, once it serves a draft named after every drafting row."""
    from specserve.bench.serve import served_model

    model = served_model(url, headers)
    missing = [r for r in rows if r != "target-only" and r not in model.get("drafts", [])]
    if missing:
        raise ValueError(f"{url} serves no draft named {', '.join(missing)}: the served rows ask a deployment "
                         f"built by specserve.bench.multimodal_served.served_config (--served brings one up)")
    return model["id"]


def run_served_multimodal_bench(config: MultimodalBenchConfig, server: str | None = None, replicas: int = 2,
                                progress: bool = True) -> dict:
    from specserve.bench.engine import machine_info
    from specserve.cluster import local
    from specserve.ingress.auth import client_headers

    check_served(config)
    rows_run = rows_of(config.views)
    started = server is None
    if started:
        serve = served_config(config, replicas)
        if local.LocalState.load() is not None:
            raise RuntimeError("a local stack is up (`specserve status`): measure it with --server URL if it serves "
                               "the rows' drafts, or take it down first")
    headers = client_headers()
    try:
        if started:   # down below stops whatever up started, should up fail half way
            server = local.up(serve).http_url
        url = server.rstrip("/").removesuffix("/v1")
        client = Client(url, headers, check_drafts(url, headers, rows_run), config)
        try:
            totals, answered_by, differs = _measure(client, config, rows_run, progress)
        finally:
            client.close()
    finally:
        if started:
            local.down()
    rows = table(totals, rows_run, list(config.scenarios))
    result = {"config": {k: (str(v) if isinstance(v, Path) else v) for k, v in config.__dict__.items()},
              "served": {"server": None if started else url, "replicas": replicas if started else None,
                         "requests_per_replica": dict(answered_by),
                         # One stalled request moves a row's tokens/s: each row's slowest, per scenario.
                         "slowest_request_s": {f"{row} {g}": round(cell["slowest_s"], 3)
                                               for (row, g), cell in totals.items()},
                         "answers_unlike_target_only": {row: differs[row] for row in rows_run if row != "target-only"}},
              "machine": machine_info(), "date": time.strftime("%Y-%m-%d"), "rows": rows, "aims": aims(rows),
              "frames": [], "frame_aims": {}}
    config.json_path.write_text(json.dumps(result, indent=2))
    plot(result, config.plot_path)
    print(format_table(result))
    unlike = {row: n for row, n in result["served"]["answers_unlike_target_only"].items() if n}
    if unlike:   # greedy speculation is lossless up to the near-ties of a reduced precision
        print(f"answers unlike target-only's (greedy; near-ties in {config.dtype} aside, a lossless draft has none): "
              + ", ".join(f"{row} {n}" for row, n in unlike.items()))
    return result


def _measure(client: Client, config: MultimodalBenchConfig, rows_run: tuple[str, ...], progress: bool
             ) -> tuple[dict, Counter, Counter]:
    """(``{(row, scenario): {tokens, seconds, steps}}``, requests per replica, answers unlike
    target-only's per row) over ``config.repeats`` rounds of the scenarios' conversations."""
    from tqdm import tqdm

    work = scenario_work(config, client.answer)
    random.Random(0).shuffle(work)   # scenarios interleaved, as a replica's traffic is
    totals = {(row, g): {"tokens": 0, "seconds": 0.0, "steps": 0, "slowest_s": 0.0}
              for row in rows_run for g in config.scenarios}
    answered_by, differs = Counter(), Counter()
    bar = tqdm(total=len(work) * len(rows_run) * config.repeats, desc="bench multimodal (served)", disable=not progress)
    for _ in range(config.repeats):
        for scenario, messages, pictures in work:
            plain = None
            for row in reversed(rows_run):   # target-only first: the others' answers are checked against it
                reply, seconds = client.ask(messages, pictures, row)
                choice, spec = reply["choices"][0], reply.get("spec") or {}
                cell = totals[(row, scenario)]
                cell["seconds"] += seconds
                cell["slowest_s"] = max(cell["slowest_s"], seconds)
                cell["tokens"] += reply["usage"]["completion_tokens"]
                cell["steps"] += spec.get("steps") or reply["usage"]["completion_tokens"]
                answered_by[spec.get("replica", "?")] += 1
                if plain is None:
                    plain = choice["token_ids"]
                elif choice["token_ids"] != plain:
                    differs[row] += 1
                bar.update()
    bar.close()
    return totals, answered_by, differs
