"""``specserve generate``: text (or a picture) from the reference models in this process, or the same request
sent to a deployment (``--server``)."""

from __future__ import annotations

import json
from pathlib import Path
from typing import Optional

import typer

from specserve.cli.common import fail, set_threads


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
