"""The local stack's commands: ``up``, ``status``, ``down``, and the views of a running deployment
(``policy``: the policy snapshot; ``routes``: the router's latest decisions)."""

from __future__ import annotations

import json
from pathlib import Path
from typing import Optional

import typer

from specserve.cli.common import fail


def up(
    config: Optional[Path] = typer.Option(None, "--config", help="A Serve config file (default: the reference models, as deploy/serve.yaml).", exists=True, dir_okay=False),
    redis_url: Optional[str] = typer.Option(None, "--redis-url", help="Use this Redis instead of starting one (redis://HOST:PORT/DB)."),
    http_port: int = typer.Option(8000, help="HTTP (OpenAI API) port."),
    grpc_port: int = typer.Option(9000, help="gRPC port."),
    timeout: float = typer.Option(900.0, help="Seconds to wait for every deployment to be healthy."),
    prometheus: bool = typer.Option(False, "--prometheus", help="Also start a Prometheus server (Debian's `prometheus` on PATH) that scrapes the cluster's metrics; Ray's dashboard reads from it."),
) -> None:
    """Start (or join) a local Ray cluster and a Redis server, deploy specserve, wait until healthy."""
    from specserve.cluster import local
    from specserve.cluster.redis_server import redact
    from specserve.cluster.serve_config import load_serve_config

    try:
        serve_config = load_serve_config(config) if config else None
    except Exception as err:  # noqa: BLE001 - yaml and pydantic errors alike: say which file and why
        fail(f"{config} is not a valid Serve config: {err}")
    seen: dict[str, str] = {}

    def progress(status: dict) -> None:
        line = ", ".join(f"{name} {d['status'].lower()} ({d['replicas']})" for name, d in status["deployments"].items())
        line = f"{status['status'].lower()}: {line or 'starting'}"
        if seen.get("line") != line:
            seen["line"] = line
            typer.secho(f"  {line}", err=True, dim=True)

    typer.secho("starting Ray, Redis and the application (the first start loads the models)...", err=True)
    try:
        state = local.up(serve_config, redis_url=redis_url, http_port=http_port, grpc_port=grpc_port,
                         timeout_s=timeout, on_progress=progress, prometheus=prometheus)
    except (RuntimeError, TimeoutError, ConnectionError, FileNotFoundError) as err:
        fail(f"{err}\n(`specserve down` stops whatever was started)")
    typer.echo(f"specserve is up\n  HTTP       {state.http_url}/v1   (OpenAI API)\n  gRPC       {state.grpc_address}"
               f"\n  dashboard  {state.dashboard_url}\n  metrics    {state.metrics_url or '(cluster started elsewhere)'}"
               f"\n  redis      {redact(state.redis_url)}"
               + (f"\n  prometheus {state.prometheus_url}" if state.prometheus_url else ""))


def status(as_json: bool = typer.Option(False, "--json", help="Print JSON.")) -> None:
    """Deployments with their status and replica counts, where each draft runs, the target's KV
    capacity, and every address."""
    from specserve.cluster import local

    try:
        report = local.status()
    except (RuntimeError, ConnectionError) as err:
        fail(str(err))
    if as_json:
        typer.echo(json.dumps(report))
        return
    application = report["application"]
    typer.echo(f"application: {application['status']} {application['message']}".rstrip())
    for name, d in application["deployments"].items():
        typer.echo(f"  {name:24s} {d['status']:10s} replicas={d['replicas']}")
    for name, placed in (report.get("placement") or {}).items():
        figures = placed.get("figures") or {}
        measured = (f": {figures['inside_ms_per_step']} ms/step inside vs {figures['separate_ms_per_step']} separate"
                    if figures else "")
        typer.echo(f"  draft {name:18s} {placed['where']:8s} ({placed['reason']}{measured})")
    for name, kv in (report.get("kv") or {}).items():
        capacity = (f"{kv['kv_slots']} slots x {kv['kv_max_len']} positions = {kv['kv_capacity_tokens']} tokens "
                    f"({kv['kv_sized_by']})" if kv else "unknown (no replica answered)")
        typer.echo(f"  kv  {name}: {capacity}")
        if kv and kv.get("cuda_graphs") is not None:   # graphs are CUDA's alone
            fused = "fused" if kv.get("fused_elementwise") else "eager"
            typer.echo(f"  step {name}: CUDA graphs ({kv['cuda_graphs']['held']} held, "
                       f"{kv['cuda_graphs']['replays']} steps replayed), elementwise kernels {fused}")
    for key in ("http", "grpc", "dashboard", "metrics"):
        typer.echo(f"{key:10s} {report[key]}")
    if report.get("prometheus"):
        typer.echo(f"{'prometheus':10s} {report['prometheus']}")
    redis = report["redis"]
    typer.echo(f"{'redis':10s} {redis['url']} ({'up' if redis['up'] else 'DOWN'}"
               f"{', pid ' + str(redis['pid']) if redis['pid'] else ', not started by specserve'})")
    learning = report["cluster_learning"] or "unknown (the ingress did not answer GET /v1/policy)"
    typer.echo(f"cluster learning: {learning}")


def local_server(server: str | None) -> str:
    """``server``, else the HTTP address of the stack `specserve up` started here."""
    if server is not None:
        return server
    from specserve.cluster.local import LocalState

    state = LocalState.load()
    if state is None or not state.http_url:
        fail("specserve is not up here: run `specserve up`, or give --server http://HOST:PORT")
    return state.http_url


def policy(
    server: Optional[str] = typer.Option(None, help="A running deployment (http://HOST:PORT); default: the local stack."),
    as_json: bool = typer.Option(False, "--json", help="Print GET /v1/policy's JSON."),
) -> None:
    """The cluster priors new requests start from: the policy service's latest snapshot."""
    from specserve.cli.policy_view import fetch_policy, format_policy

    try:
        body = fetch_policy(local_server(server))
    except (RuntimeError, OSError) as err:
        fail(str(err))
    typer.echo(json.dumps(body, indent=2) if as_json else format_policy(body))


def routes(
    server: Optional[str] = typer.Option(None, help="A running deployment (http://HOST:PORT); default: the local stack."),
    limit: int = typer.Option(20, min=1, max=1000, help="How many of the latest decisions."),
    as_json: bool = typer.Option(False, "--json", help="Print GET /v1/routing/recent's JSON."),
) -> None:
    """The draft router's latest decisions: features, scores, choice, reason and the realised outcome."""
    from specserve.cli.routes_view import fetch_routes, format_routes

    try:
        body = fetch_routes(local_server(server), limit)
    except (RuntimeError, OSError) as err:
        fail(str(err))
    typer.echo(json.dumps(body, indent=2) if as_json else format_routes(body))


def down() -> None:
    """Stop what `specserve up` started (Ray only if it started it, Redis only if it started it)."""
    from specserve.cluster import local

    stopped = local.down()
    typer.echo("stopped: " + ", ".join(stopped) if stopped else "nothing to stop: specserve was not up here")
