"""``specserve zoo``: training, exporting and evaluating the zoo's drafts and the reference models."""

from __future__ import annotations

import json
import os
from pathlib import Path
from typing import Optional

import typer

from specserve.cli.common import fail, set_threads

zoo_app = typer.Typer(help="The draft zoo: drafts distilled from the reference target.", no_args_is_help=True)


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
                               "frames beside every picture question, the language model adapted too (360 steps of 8 rows, half of them clips)."),
) -> None:
    """Train the reference VLM's vision tower and projector on synthetic pictures (the language
    model is the reference target, frozen; --clips adapts it too, a video model of its own);
    resumes from its checkpoint when run again."""
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
    pictures: int = typer.Option(3072, help="Questions the VLM answers (in chunks of 64; resumable)."),
    steps: int = typer.Option(1200, help="Training steps."),
    batch: int = typer.Option(16, help="Answers per step."),
    lr: float = typer.Option(5e-4, help="Peak learning rate (warm-up, then cosine)."),
    work: Optional[Path] = typer.Option(None, help="Answers, checkpoints and log folder."),
    export: bool = typer.Option(True, help="Write the best weights into the zoo (smollm2-vlm-draft, with --video "
                                "smollm2-vlm-video-draft) with a card."),
    video: bool = typer.Option(False, "--video", help="The video model's draft: smollm2-vlm-video's answers to pictures "
                               "and clips (half of them), from smollm2-vlm-draft."),
    threads: Optional[int] = typer.Option(None, help="torch threads."),
) -> None:
    """Distil the reference VLM's matching draft: the zoo's draft LM trained further on the VLM's
    own answers to synthetic pictures, reading their image tokens (--video: the video model's, to
    pictures and clips); resumes when run again."""
    from specserve.training import vlm_draft

    set_threads(threads)
    if min(pictures, steps, batch) < 1 or lr <= 0:
        fail("--pictures, --steps and --batch must be >= 1, --lr > 0")
    recipe = vlm_draft.VIDEO if video else vlm_draft.DRAFT
    try:
        work = vlm_draft.train(pictures=pictures, steps=steps, batch=batch, lr=lr, work=work, recipe=recipe)
        typer.echo(f"answers, checkpoints and log in {work}")
        if export:
            typer.echo(f"draft written to {vlm_draft.export(work=work, recipe=recipe)}")
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
    video: bool = typer.Option(False, "--video", help="The video model's heads (smollm2-vlm-video-sparrow, "
                               "--no-ivsb smollm2-vlm-video-hsr): its answers to pictures and clips, `zoo vlm-draft "
                               "--video`'s, from the picture heads."),
    threads: Optional[int] = typer.Option(None, help="torch threads."),
) -> None:
    """Train Sparrow's draft head for the reference VLM: the zoo's hidden-state-reuse head on the
    VLM's own answers, with multi-token prediction and (by default) IVSB; resumes when run again."""
    from specserve.training import sparrow_head

    set_threads(threads)
    if min(pictures, steps, batch) < 1 or lr <= 0:
        fail("--pictures, --steps and --batch must be >= 1, --lr > 0")
    recipe = sparrow_head.VIDEO if video else sparrow_head.PICTURES
    try:
        work = sparrow_head.train(ivsb=ivsb, pictures=pictures, steps=steps, batch=batch, lr=lr, work=work,
                                  recipe=recipe)
        typer.echo(f"checkpoints and log in {work}")
        if export:
            typer.echo(f"draft written to {sparrow_head.export(ivsb=ivsb, work=work, recipe=recipe)}")
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
