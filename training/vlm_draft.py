"""A draft matched to the reference VLM: the zoo's standalone draft LM, distilled further on the
VLM's own answers to synthetic pictures while reading each picture's image tokens as the VLM's
projector embeds them.

    specserve zoo vlm-draft [--pictures N] [--steps N]   # answers, then training (both resume), export
    specserve zoo vlm-draft --video                      # the video model's: pictures and clips

Why: ``smollm2-draft-2l`` was distilled on the target's text answers. A VLM's answers come from the
same language model steered by image tokens the draft never read in training, and it predicts them
poorly in every drafting view (mean accepted length 1.0-1.2 on the reference VLM's answers). This
draft learns from the VLM itself, as TABED's drafts and Sparrow's are trained on their target's
outputs:

- **Answers** (``answer_corpus``): for ``pictures`` held-out pictures (seeds from ``DRAFT_SEED``,
  every category in turn), the VLM's greedy answer (the tokens its served answers are made of),
  its final-norm hidden states at the positions that predict them (the teacher: times the output
  rows of the head's tokens, its distribution over the head), and the picture's projected image
  rows (what the ``multimodal`` view feeds the draft). Chunks of ``CHUNK`` pictures, resumable.
- **Student**: ``smollm2-draft-2l``'s two layers; its head widened to every token the VLM's
  answers use (the target's output rows, frozen, like its embeddings: neither is stored).
- **Loss**: forward KL to the teacher over the head at each answer position (``distill.distill_loss``),
  the prompt and its image rows read as context. Every ``VALIDATION_EVERY``-th picture is held out;
  the weights exported are those with the lowest held-out KL.

Served, the draft reads a picture's rows in the ``multimodal`` and ``pooled`` views and the
placeholder in ``text-only`` (``ensemble.py``); it was trained on the first only.

A ``DraftRecipe`` names the teacher, the draft it starts from and the questions: ``DRAFT`` is the
reference VLM's; ``VIDEO`` the video model's (``smollm2-vlm-video``, whose language model is adapted),
starting from ``DRAFT``'s export and taught its answers to clips (each frame a picture, as a LLaVA
model reads a clip) beside the picture questions.
"""

from __future__ import annotations

import json
import os
from dataclasses import dataclass
from pathlib import Path

import torch

from specserve.data.synthetic_clips import CLIP_CATEGORIES, MAX_FRAMES, MIN_FRAMES
from specserve.data.synthetic_images import CATEGORIES
from specserve.replicas.drafts.pruned_head import PrunedHeadConfig, PrunedHeadLlamaForCausalLM
from specserve.replicas.model_store import REFERENCE_TARGET, bf16_is_fast, load_causal_lm, model_cache_dir, zoo_dir
from specserve.replicas.vlm import REFERENCE_VIDEO_VLM, REFERENCE_VLM
from specserve.training.distill import (DistillConfig, TrainLog, distill_loss, export_best, seeded_batches,
                                       teacher_log_probs)
from specserve.training.distill import train as train_loop
from specserve.training.vlm_train import CLIPS, _cpu_name


@dataclass(frozen=True)
class DraftRecipe:
    name: str                      # the zoo draft it exports
    teacher: str                   # the VLM whose answers it learns
    base: str                      # the zoo draft it starts from
    categories: tuple[str, ...]    # the questions, in turn by seed (a category listed twice: twice as often)


DRAFT = DraftRecipe("smollm2-vlm-draft", REFERENCE_VLM, "smollm2-draft-2l", CATEGORIES)
# The video model's questions as its own stage asked them.
VIDEO = DraftRecipe("smollm2-vlm-video-draft", REFERENCE_VIDEO_VLM, "smollm2-vlm-draft", CLIPS.categories)
# Pictures the draft learns from: far from the VLM's test (10^9 up) and training (0 up) seeds.
DRAFT_SEED = 500_000_000
CHUNK = 64
VALIDATION_EVERY = 20
# Greedy tokens an answer may take: a description runs longest, a clip's sequence grows with its frames.
MAX_NEW_TOKENS = {"caption": 24, "describe": 64, "sequence": 32}
SHORT_ANSWER = 12


def default_work(recipe: DraftRecipe = DRAFT) -> Path:
    return model_cache_dir().parent / "zoo" / recipe.name


def _category(seed: int, categories: tuple[str, ...] = CATEGORIES) -> str:
    return categories[seed % len(categories)]


@torch.no_grad()
def _chunk(vlm, tokenizer, seeds: list[int], categories: tuple[str, ...] = CATEGORIES) -> list[dict]:
    """The rows of one chunk of pictures and clips: ``{seed, category, prompt, answer, final, rows}``
    (``rows``: the image rows of the picture, or of the clip's frames in order)."""
    from specserve.training.vlm_train import prompt_ids, shown
    from specserve.replicas.model.image_tokens import Grid, PictureUnit
    from specserve.replicas.pictures import image_store
    from specserve.replicas.vlm import image_processor, tokens_per_image

    model, config = vlm.model, vlm.model.config
    processor = image_processor(config)
    store, grid = image_store(model, processor), Grid.of(tokens_per_image(config))
    eos = set(model.generation_config.eos_token_id if isinstance(model.generation_config.eos_token_id, list)
              else [model.generation_config.eos_token_id])
    out = []
    shows = [(s, *shown(s, _category(s, categories))) for s in seeds]
    # One group per question and picture count: its prompts are one length, no padding.
    for group in sorted({(ex.category, len(pictures)) for _, ex, pictures in shows},
                        key=lambda g: (categories.index(g[0]), g[1])):
        category, count = group
        examples = [(s, ex, pictures) for s, ex, pictures in shows if (ex.category, len(pictures)) == group]
        prompt = prompt_ids(tokenizer, config, examples[0][1].question, count)
        ids = torch.tensor([prompt] * len(examples))
        pixels = processor([p for _, _, pictures in examples for p in pictures],
                           return_tensors="pt")["pixel_values"].to(model.dtype)
        generated = model.generate(input_ids=ids, pixel_values=pixels, attention_mask=torch.ones_like(ids),
                                   max_new_tokens=MAX_NEW_TOKENS.get(category, SHORT_ANSWER), do_sample=False,
                                   pad_token_id=tokenizer.pad_token_id)[:, len(prompt):].tolist()
        answers = [row[:next((i + 1 for i, t in enumerate(row) if t in eos), len(row))] for row in generated]
        width = len(prompt) + max(map(len, answers))
        full = torch.full((len(examples), width), tokenizer.pad_token_id, dtype=torch.long)
        for i, answer in enumerate(answers):
            full[i, :len(prompt) + len(answer)] = torch.tensor(prompt + answer)
        # Right padding under a causal mask leaves every real position as it is.
        final = model.model(input_ids=full, pixel_values=pixels).last_hidden_state
        rows = store.encode([PictureUnit(p, grid) for p in pixels])   # per picture: a served request's image rows
        for i, ((seed, _, _), answer) in enumerate(zip(examples, answers)):
            at = len(prompt) - 1   # the positions that predict the answer's tokens
            out.append({"seed": seed, "category": category, "prompt": prompt, "answer": answer,
                        "final": final[i, at:at + len(answer)].to(torch.bfloat16).clone(),
                        "rows": torch.cat(list(rows[i * count:(i + 1) * count])).to(torch.bfloat16).clone()})
    return out


def answer_corpus(pictures: int, work: Path | None = None, progress: bool = True,
                  recipe: DraftRecipe = DRAFT) -> list[dict]:
    """The teacher's answers to ``pictures`` questions of the recipe's (a picture's or a clip's),
    built chunk by chunk into ``work``, resumable."""
    from tqdm import tqdm

    from specserve.replicas.vlm import load_vlm

    folder = Path(work or default_work(recipe)) / "answers"
    folder.mkdir(parents=True, exist_ok=True)
    meta = folder / "meta.json"
    asked = {"pictures": pictures, "teacher": recipe.teacher, "categories": list(recipe.categories)}
    if meta.exists():
        held = json.loads(meta.read_text())
        held = {"teacher": REFERENCE_VLM, "categories": list(CATEGORIES), **held}   # folders written before recipes
        if any(held[k] != v for k, v in asked.items()):
            raise ValueError(f"{folder} holds {held['teacher']}'s answers to {held['pictures']} questions "
                             f"({', '.join(dict.fromkeys(held['categories']))}), not {recipe.teacher}'s to {pictures} "
                             f"({', '.join(dict.fromkeys(recipe.categories))}): give another work folder")
    meta.write_text(json.dumps({**asked, "first_seed": DRAFT_SEED, "chunk": CHUNK}))
    chunks = range(0, pictures, CHUNK)
    vlm = None
    for n, start in enumerate(tqdm(chunks, desc="vlm answers", unit="chunk", disable=not progress)):
        path = folder / f"chunk-{n:05d}.pt"
        if path.exists():
            continue
        if vlm is None:
            vlm = load_vlm(recipe.teacher, dtype="bfloat16" if bf16_is_fast(torch.device("cpu")) else "float32",
                           device="cpu")
        seeds = list(range(DRAFT_SEED + start, DRAFT_SEED + min(start + CHUNK, pictures)))
        torch.save(_chunk(vlm, vlm.tokenizer.tokenizer, seeds, recipe.categories), path.with_suffix(".partial"))
        path.with_suffix(".partial").replace(path)
    return [row for n in range(len(chunks)) for row in torch.load(folder / f"chunk-{n:05d}.pt", weights_only=False)]


def head_tokens(corpus: list[dict], base: str = DRAFT.base) -> list[int]:
    """The zoo draft ``base``'s head tokens and every token of the VLM's answers."""
    from transformers import AutoConfig

    from specserve.replicas.model_store import resolve_model_path

    base = AutoConfig.from_pretrained(resolve_model_path(base), local_files_only=True)
    return sorted(set(base.head_token_ids) | {t for row in corpus for t in row["answer"]})


def build_student(head: list[int], base: str = DRAFT.base) -> PrunedHeadLlamaForCausalLM:
    """The zoo draft ``base``'s layers under the target's output rows for ``head``."""
    base = load_causal_lm(base, dtype="float32", device="cpu").model
    target = load_causal_lm(REFERENCE_TARGET, dtype="float32", device="cpu").model
    config = PrunedHeadConfig.from_dict({**base.config.to_dict(), "head_token_ids": head})
    student = PrunedHeadLlamaForCausalLM(config)
    state = {k: v for k, v in base.state_dict().items() if k != "lm_head.weight"}
    state["lm_head.weight"] = target.get_output_embeddings().weight.detach()[torch.tensor(head)].clone()
    student.load_state_dict(state)
    student.model.embed_tokens.weight.requires_grad_(False)
    student.lm_head.weight.requires_grad_(False)
    return student.float()


def collate(rows: list[dict], placeholder: int) -> dict:
    """A batch: the prompt and answer ids (right-padded; image tokens as ``placeholder``), where the
    picture's rows go, the rows, and the teacher's states at the scored positions, in order."""
    width = max(len(r["prompt"]) + len(r["answer"]) for r in rows)
    ids = torch.zeros((len(rows), width), dtype=torch.long)
    scored = torch.zeros((len(rows), width), dtype=torch.bool)
    for i, r in enumerate(rows):
        seq = r["prompt"] + r["answer"]
        ids[i, :len(seq)] = torch.tensor(seq)
        scored[i, len(r["prompt"]) - 1:len(seq) - 1] = True
    return {"ids": ids, "image": ids == placeholder, "scored": scored,
            "rows": torch.cat([r["rows"] for r in rows]), "final": torch.cat([r["final"] for r in rows])}


def embed_batch(student, batch: dict) -> torch.Tensor:
    """The student's input: its (the target's) embeddings, the image tokens as the picture's rows."""
    embeds = student.model.embed_tokens(batch["ids"].masked_fill(batch["image"], 0))
    embeds[batch["image"]] = batch["rows"].to(embeds.dtype)
    return embeds


def draft_loss(student, head_weight: torch.Tensor, autocast_bf16: bool):
    def loss(batch: dict) -> torch.Tensor:
        with torch.autocast("cpu", dtype=torch.bfloat16, enabled=autocast_bf16):
            hidden = student.model(inputs_embeds=embed_batch(student, batch)).last_hidden_state
            logits = student.head_logits(hidden[batch["scored"]])
        teacher = teacher_log_probs(batch["final"], head_weight)
        return distill_loss(logits, teacher, torch.ones(len(teacher)))

    return loss


@torch.no_grad()
def metrics(student, head_weight: torch.Tensor, rows: list[dict], placeholder: int, autocast_bf16: bool,
            batch: int = 32) -> dict:
    """Held-out KL and first-token greedy acceptance (the student's argmax over its head is the
    VLM's next token, teacher-forced), overall and per category."""
    head = student.head_token_ids(torch.device("cpu"))
    sums: dict[str, list[float]] = {}
    for at in range(0, len(rows), batch):
        chunk = rows[at:at + batch]
        b = collate(chunk, placeholder)
        with torch.autocast("cpu", dtype=torch.bfloat16, enabled=autocast_bf16):
            hidden = student.model(inputs_embeds=embed_batch(student, b)).last_hidden_state
            logits = student.head_logits(hidden[b["scored"]]).float()
        teacher = teacher_log_probs(b["final"], head_weight)
        kl = (teacher.exp() * (teacher - torch.log_softmax(logits, -1))).sum(-1)
        hit = head[logits.argmax(-1)] == torch.tensor([t for r in chunk for t in r["answer"]])
        at_row = 0
        for r in chunk:
            n = len(r["answer"])
            for key in (r["category"], "all"):
                s = sums.setdefault(key, [0.0, 0.0, 0])
                s[0] += float(kl[at_row:at_row + n].sum())
                s[1] += float(hit[at_row:at_row + n].sum())
                s[2] += n
            at_row += n
    return {k: {"kl": round(s[0] / s[2], 4), "top1": round(s[1] / s[2], 4), "positions": s[2]} for k, s in sums.items()}


def train(pictures: int = 3072, steps: int = 1200, batch: int = 16, lr: float = 5e-4, work: Path | None = None,
          validate_every: int = 200, progress: bool = True, recipe: DraftRecipe = DRAFT) -> Path:
    """The answers (built if missing), then training (resumes its checkpoint); returns ``work``."""
    work = Path(work or default_work(recipe))
    corpus = answer_corpus(pictures, work, progress, recipe)
    placeholder = _placeholder(recipe.teacher)
    held_out, rows = split(corpus)
    (work / "recipe.json").write_text(json.dumps({"pictures": pictures, "batch": batch, "name": recipe.name,
                                                  "teacher": recipe.teacher, "base": recipe.base,
                                                  "machine": f"{os.cpu_count()} cores of {_cpu_name()}"}))
    head_file = work / "head_token_ids.json"
    if not head_file.exists():   # a resumed run keeps its head
        head_file.write_text(json.dumps(head_tokens(corpus, recipe.base)))
    student = build_student(json.loads(head_file.read_text()), recipe.base)
    head_weight = student.lm_head.weight.detach().clone()
    autocast = bf16_is_fast(torch.device("cpu"))
    config = DistillConfig(steps=steps, lr=lr, warmup_steps=min(50, steps // 10 + 1), autocast_bf16=autocast,
                           validate_every=validate_every, checkpoint_every=validate_every)
    log = TrainLog(work, steps, f"zoo train {recipe.name}", progress)
    before = work / "base_validation.json"
    if not before.exists():   # the base draft's layers under the same head: what training starts from
        before.write_text(json.dumps(metrics(student, head_weight, held_out, placeholder, autocast)))

    def validate() -> float:
        scores = metrics(student, head_weight, held_out, placeholder, autocast)
        log.write({"step": log.bar.n, "validation": scores})
        log.bar.write(f"step {log.bar.n}: held-out KL {scores['all']['kl']:.3f}, first-token acceptance "
                      f"{scores['all']['top1']:.3f}")
        return scores["all"]["kl"]

    loss = draft_loss(student, head_weight, autocast)
    batches = seeded_batches(len(rows), batch, lambda idx: collate([rows[i] for i in idx], placeholder))
    train_loop(student, loss, batches, config, work / "checkpoint.pt", on_step=log.on_step, validate=validate)
    log.close()
    return work


def split(corpus: list[dict]) -> tuple[list[dict], list[dict]]:
    """(held out, trained on): every ``VALIDATION_EVERY``-th picture held out."""
    return ([r for i, r in enumerate(corpus) if i % VALIDATION_EVERY == 0],
            [r for i, r in enumerate(corpus) if i % VALIDATION_EVERY != 0])


def _placeholder(vlm: str = REFERENCE_VLM) -> int:
    from transformers import AutoConfig

    from specserve.replicas.model_store import resolve_model_path
    from specserve.replicas.vlm import image_token_id

    return image_token_id(AutoConfig.from_pretrained(resolve_model_path(vlm), local_files_only=True))


def export(work: Path | None = None, out: Path | None = None, recipe: DraftRecipe = DRAFT) -> Path:
    """The weights with the lowest held-out KL as a zoo draft (half precision; neither embeddings
    nor head stored), its ``training.json`` and model card."""
    work = Path(work or default_work(recipe))
    checkpoint = work / "checkpoint.pt"
    if not checkpoint.exists():
        raise FileNotFoundError(f"no checkpoint in {work}: run `specserve zoo vlm-draft"
                                f"{'' if recipe == DRAFT else ' --video'}` first")
    student = build_student(json.loads((work / "head_token_ids.json").read_text()), recipe.base)
    out = Path(out or zoo_dir() / recipe.name)
    chosen, log, trained = export_best(student, work, out)
    validations = [r for r in log if "validation" in r]
    at_export = next((r["validation"] for r in validations if r["step"] == chosen["step"]), None)
    chunks = sorted((work / "answers").glob("chunk-*.pt"))
    pictures = sum(len(torch.load(c, weights_only=False)) for c in chunks)
    training = {
        "recipe": recipe.name, "kind": "standalone", "base": recipe.base, "teacher": recipe.teacher,
        **({} if recipe.categories == CATEGORIES else {"categories": list(recipe.categories)}),
        "pictures": pictures, "first_seed": DRAFT_SEED, "held_out_every": VALIDATION_EVERY,
        "steps": trained["step"], "config": trained["config"], "exported_step": chosen["step"],
        "train_seconds": max((r["elapsed_s"] for r in log), default=0),
        "validation_before": json.loads((work / "base_validation.json").read_text()),
        "validation": at_export, "head_tokens": len(student.config.head_token_ids),
        **{k: v for k, v in json.loads((work / "recipe.json").read_text()).items() if k in ("batch", "machine")},
    }
    (out / "training.json").write_text(json.dumps(training, indent=2) + "\n")
    write_card(out, training)
    return out


def write_card(out: Path, training: dict) -> Path:
    weights_mb = sum(f.stat().st_size for f in out.glob("*.safetensors")) / 2**20
    before, after = training["validation_before"], training["validation"] or {}
    name, base, teacher = training["recipe"], training["base"], training["teacher"]
    categories = tuple(training.get("categories", CATEGORIES))
    clips = [c for c in dict.fromkeys(categories) if c in CLIP_CATEGORIES]
    if clips:
        about = (f"A draft for the reference video model `{teacher}`: `{base}` distilled further on that model's own "
                 f"answers to pictures and clips (each frame a picture), reading their 64 image tokens a frame as "
                 f"its projector embeds them (the `multimodal` drafting view). Trained and exported by `specserve "
                 f"zoo vlm-draft --video` (`training/vlm_draft.py`).")
        pictures = [c for c in dict.fromkeys(categories) if c not in CLIP_CATEGORIES]
        data = (f"{training['pictures']} synthetic questions (seeds from {training['first_seed']:,}, in turn: the "
                f"{len(pictures)} picture categories once and the clips ({', '.join(clips)}, "
                f"{MIN_FRAMES}-{MAX_FRAMES} frames) {categories.count(clips[0])} times each), the model's greedy answer to each (bfloat16; ≤ 64 "
                f"tokens) and its final hidden states there (the teacher); every {training['held_out_every']}th "
                f"question held out.")
    else:
        about = (f"A draft for the reference VLM `{teacher}`: `{base}` (2 Llama layers, hidden 576) distilled further "
                 f"on the VLM's own answers, reading each picture's 64 image tokens as the VLM's projector embeds them "
                 f"(the `multimodal` drafting view). Trained and exported by `specserve zoo vlm-draft` "
                 f"(`training/vlm_draft.py`).")
        data = (f"{training['pictures']} synthetic pictures (seeds from {training['first_seed']:,}, the eight "
                f"question categories in turn), the VLM's greedy answer to each (bfloat16; ≤ 64 tokens) and its final "
                f"hidden states there (the teacher); every {training['held_out_every']}th picture held out.")
    lines = [
        f"# {name}", "", about, "",
        f"- **Head**: {training['head_tokens']} tokens, `{base}`'s and every token of the VLM's answers; its "
        f"rows and the token embeddings are the target's (frozen, not stored: `embeddings_from: {REFERENCE_TARGET}`).",
        f"- **Weights**: {weights_mb:.1f} MB, float16 safetensors.",
        f"- **Data**: {data}",
        f"- **Training**: {training['steps']} steps of {training['batch']} answers, AdamW lr "
        f"{training['config']['lr']}, forward KL to the VLM over the head at each answer position, bfloat16 "
        f"autocast; {training['train_seconds'] / 60:.0f} min on {training['machine']}; exported: "
        f"step {training['exported_step']}, the lowest held-out KL.", "",
        "## Held out", "",
        "KL to the VLM per answer position and the first drafted token's greedy acceptance (the draft's argmax is "
        "the VLM's next token, teacher-forced), before (the base draft's layers under this head) and after:", "",
        "| category | KL before | KL after | acceptance before | acceptance after | positions |",
        "| --- | --- | --- | --- | --- | --- |",
    ]
    for key in (*dict.fromkeys(categories), "all"):
        if key in before and key in after:
            b, a = before[key], after[key]
            lines.append(f"| {key} | {b['kl']:.3f} | {a['kl']:.3f} | {b['top1']:.3f} | {a['top1']:.3f} | {a['positions']} |")
    lines += ["", "Served acceptance and tokens/s per drafting view: `specserve bench multimodal --draft "
              f"{name}{'' if teacher == REFERENCE_VLM else f' --target {teacher}'}` (docs/benchmarks.md)."]
    card = out / "README.md"
    card.write_text("\n".join(lines) + "\n")
    return card
