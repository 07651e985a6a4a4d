"""Train the reference VLM: a vision tower and projector from scratch, under the frozen reference target.

    specserve zoo vlm [--steps N] [--device cuda]    # resumable: run it again to go on; exports at the end
    specserve zoo vlm --fine-tune                    # a later stage from the shipped weights
    specserve zoo vlm --clips                        # the video model: clips too, the language model adapted

LLaVA's first stage, made to learn vision from nothing: each step draws a batch of synthetic
pictures with their questions (``data/synthetic_images.py``; seeds count up, so a run and its
resumption see each picture once), and the loss is the cross-entropy of the language model on the
answer tokens (and the ``<|im_end|>`` that ends them) given the prompt with the picture's 64
image tokens. Only the vision tower (SigLIP, 4 layers of 256) and the projector learn; the
language model and its output rows stay the target's, so its text behaviour is unchanged. The
video stage (``--clips``) adapts the language model as well (``training/lora.py``): its export is
a target of its own.

A later stage (``--fine-tune``, ``FINE_TUNE``) starts from the shipped weights at a lower learning
rate. The second taught the two questions whose answers are text about the whole picture,
``caption`` and ``describe``; the third asks all eight, the skills the second wore down (reading a
word, counting dots, reading digits) twice as often.

The loss is the mean over rows of each row's mean over its answer tokens, so a 45-token
description weighs as much as a one-word answer. (The second stage averaged over all answer
tokens of a batch: its descriptions outweighed the short answers some 20 to 1, and reading,
counting and digits fell.)

Where this deviates from LLaVA: LLaVA starts from a pretrained CLIP tower and trains the
projector alone on captions; no pretrained tower reaches these machines, so the tower learns with
the projector, on question/answer pairs only (there is no caption stage).

Accuracy is exact-match per category on held-out seeds (``TEST_SEED`` up), greedy, after
``normalise_answer``.
"""

from __future__ import annotations

import json
import time
from dataclasses import asdict, dataclass
from pathlib import Path

import torch
from torch.utils.data import DataLoader, IterableDataset, get_worker_info

from specserve.data.synthetic_clips import CLIP_CATEGORIES, clip_example
from specserve.data.synthetic_images import CATEGORIES, TEST_SEED, example, normalise_answer
from specserve.replicas.model_store import REFERENCE_TARGET, load_causal_lm, model_cache_dir, targets_dir
from specserve.replicas.vlm import (CHAT_TEMPLATE, REFERENCE_VLM, TEXT_LORA, build_processor, build_vlm, expand_image_tokens,
                                    image_processor, reference_vlm_config, text_weights)
from specserve.training.schedule import warmup_cosine


@dataclass(frozen=True)
class VLMRecipe:
    steps: int = 3000
    batch: int = 128
    lr: float = 5e-4
    warmup_steps: int = 200
    weight_decay: float = 0.01
    eval_every: int = 500
    eval_per_category: int = 50
    categories: tuple[str, ...] = CATEGORIES   # row i asks categories[i % len]: repeats weigh a question up
    # "row-mean": each row's answer tokens averaged, then the rows; "token-mean": every answer token
    # of the batch averaged (how the first two stages trained).
    loss: str = "row-mean"
    # Low-rank adapters on the language model (``training/lora.py``): 0 keeps it frozen, the
    # reference target; a stage that adapts it makes a target of its own.
    lora_rank: int = 0
    lora_alpha: float = 16.0
    lora_lr: float = 5e-4


RECIPE = VLMRecipe()
FINE_TUNE = VLMRecipe(steps=400, batch=16, lr=1.5e-4, warmup_steps=20, eval_every=100, eval_per_category=16,
                      categories=(*CATEGORIES, "word", "dots", "digits"))
# The video stage: clips (``data/synthetic_clips.py``, 2-8 frames a row) beside every picture
# question, so that the picture skills are kept while the clips are learned. The language model
# learns too (low-rank adapters): comparing frames needs it (docs/benchmarks.md §8.12). With
# batches of 8 drawn in one process (``workers`` 0) the steps alternate between the 8 picture
# questions and clips, so a batch of pictures is not padded to its longest clip.
CLIPS = VLMRecipe(steps=360, batch=8, lr=1.5e-4, warmup_steps=20, eval_every=90, eval_per_category=16,
                  categories=(*CATEGORIES, *CLIP_CATEGORIES * 4), lora_rank=8)
# Greedy tokens an answer may take when scored: a description runs to ~45.
ANSWER_TOKENS = {"caption": 20, "describe": 64, "sequence": 24}
# What learns (and what a checkpoint and an export hold): the tower and the projector, and the
# language model's adapters where a stage has them.
LEARNED = ("model.vision_tower.", "model.multi_modal_projector.")
TEXT_BODY = "model.language_model."


def prompt_ids(tokenizer, config, question: str, pictures: int = 1) -> list[int]:
    """The chat prompt of ``pictures`` pictures (a clip's frames) and a question, the placeholders
    expanded to the image tokens."""
    messages = [{"role": "user", "content": [*({"type": "image"} for _ in range(pictures)),
                                             {"type": "text", "text": question}]}]
    text = tokenizer.apply_chat_template(messages, chat_template=CHAT_TEMPLATE, tokenize=False,
                                         add_generation_prompt=True)
    return expand_image_tokens(tokenizer(text, add_special_tokens=False)["input_ids"], config)


def shown(seed: int, category: str) -> tuple:
    """The example of ``seed`` in ``category`` (a picture's, or a clip's) and the pictures it shows."""
    if category in CLIP_CATEGORIES:
        clip = clip_example(seed, category)
        return clip, list(clip.frames)
    ex = example(seed, category)
    return ex, [ex.image]


class PictureStream(IterableDataset):
    """Training rows ``(input_ids, labels, pixel_values)`` from seed ``start`` up; DataLoader workers
    take every n-th seed, so the stream is the same however many there are."""

    def __init__(self, tokenizer, config, start: int, categories: tuple[str, ...] = CATEGORIES):
        self.tokenizer, self.config, self.start, self.categories = tokenizer, config, start, tuple(categories)
        self.processor = image_processor(config)
        self.end_ids = tokenizer("<|im_end|>", add_special_tokens=False)["input_ids"]

    def row(self, seed: int) -> tuple[list[int], list[int], torch.Tensor]:
        """A row's ids, labels and its pictures' pixels [pictures, 3, h, w] (a clip: its frames)."""
        ex, pictures = shown(seed, self.categories[seed % len(self.categories)])
        prompt = prompt_ids(self.tokenizer, self.config, ex.question, len(pictures))
        answer = self.tokenizer(ex.answer, add_special_tokens=False)["input_ids"] + self.end_ids
        pixels = self.processor(pictures, return_tensors="pt")["pixel_values"]
        return prompt + answer, [-100] * len(prompt) + answer, pixels

    def __iter__(self):
        info = get_worker_info()
        seed, step = self.start + (info.id if info else 0), info.num_workers if info else 1
        while True:
            yield self.row(seed)
            seed += step


def collate(rows, pad_id: int) -> dict[str, torch.Tensor]:
    width = max(len(ids) for ids, _, _ in rows)
    ids = torch.full((len(rows), width), pad_id, dtype=torch.long)
    labels = torch.full((len(rows), width), -100, dtype=torch.long)
    mask = torch.zeros((len(rows), width), dtype=torch.long)
    for i, (row_ids, row_labels, _) in enumerate(rows):
        ids[i, :len(row_ids)] = torch.tensor(row_ids)
        labels[i, :len(row_labels)] = torch.tensor(row_labels)
        mask[i, :len(row_ids)] = 1
    # LLaVA fills the image tokens of the batch, row after row, from the pictures in this order.
    return {"input_ids": ids, "labels": labels, "attention_mask": mask,
            "pixel_values": torch.cat([p for _, _, p in rows])}


@torch.no_grad()
def evaluate(model, tokenizer, per_category: int, first_seed: int = TEST_SEED, batch: int = 50,
             categories: tuple[str, ...] = CATEGORIES) -> dict[str, float]:
    """Exact-match accuracy per category (and ``mix``) on held-out pictures or clips, greedy."""
    config, processor = model.config, image_processor(model.config)
    device = next(model.parameters()).device
    accuracy = {}
    for category in categories:
        c = (CATEGORIES + CLIP_CATEGORIES).index(category)
        examples = [shown(first_seed + c * 100_000 + i, category) for i in range(per_category)]
        right = 0
        # A batch holds prompts of one length: clips of one frame count (no padding to get wrong).
        by_length: dict[int, list] = {}
        for e, pictures in examples:
            by_length.setdefault(len(pictures), []).append((e, pictures))
        chunks = [group[at:at + batch] for group in by_length.values() for at in range(0, len(group), batch)]
        for pairs in chunks:
            chunk, pictures = [e for e, _ in pairs], [p for _, p in pairs]
            ids = torch.tensor([prompt_ids(tokenizer, config, e.question, len(p)) for e, p in pairs], device=device)
            pixels = processor([p for ps in pictures for p in ps], return_tensors="pt")["pixel_values"].to(device, model.dtype)
            out = model.generate(input_ids=ids, pixel_values=pixels, attention_mask=torch.ones_like(ids),
                                 max_new_tokens=ANSWER_TOKENS.get(category, 8), do_sample=False, pad_token_id=tokenizer.pad_token_id)
            for e, row in zip(chunk, out[:, ids.shape[1]:]):
                said = tokenizer.decode(row, skip_special_tokens=True)
                right += normalise_answer(said) == normalise_answer(e.answer)
        accuracy[category] = right / len(examples)
    accuracy["mix"] = sum(accuracy.values()) / len(categories)
    return accuracy


def answer_loss(logits: torch.Tensor, labels: torch.Tensor, per_row: bool = True) -> torch.Tensor:
    """Cross-entropy of the answer tokens (labels -100 elsewhere), averaged within each row and
    then over rows (``per_row``), or over every answer token of the batch."""
    logits, labels = logits[:, :-1].float(), labels[:, 1:]
    scored = labels != -100
    per_token = torch.nn.functional.cross_entropy(logits.transpose(1, 2), labels.clamp(min=0), reduction="none")
    if not per_row:
        return (per_token * scored).sum() / scored.sum().clamp(min=1)
    per_row_loss = (per_token * scored).sum(1) / scored.sum(1).clamp(min=1)
    return per_row_loss.mean()


def trainable(model) -> dict[str, torch.Tensor]:
    return {k: v for k, v in model.state_dict().items()
            if k.startswith(LEARNED) or ".lora." in k}


def default_work() -> Path:
    return model_cache_dir().parent / "train" / REFERENCE_VLM


def train(steps: int | None = None, batch: int | None = None, device: str | None = None, work: Path | None = None,
          workers: int = 0, recipe: VLMRecipe = RECIPE, progress: bool = True, max_seconds: float | None = None,
          start_from: Path | None = None) -> Path:
    """Train (resuming from ``work``'s checkpoint), evaluating every ``eval_every`` steps; returns ``work``.
    ``start_from``: an exported VLM folder whose weights a fresh ``work`` starts from (its training
    log kept as the earlier stages).
    ``max_seconds``: stop (evaluated and saved) once a step ends past this many seconds; run again
    to go on. ``workers``: DataLoader processes drawing the pictures.

    The language model runs in bfloat16; the vision tower, the projector and the language model's
    adapters (``recipe.lora_rank``) learn in float32 under bfloat16 autocast."""
    from tqdm import tqdm

    recipe = VLMRecipe(**{**asdict(recipe), **({"steps": steps} if steps else {}), **({"batch": batch} if batch else {})})
    if recipe.loss not in ("row-mean", "token-mean"):
        raise ValueError(f"loss must be row-mean or token-mean; got {recipe.loss!r}")
    device = torch.device(device or "cpu")
    work = Path(work or default_work())
    work.mkdir(parents=True, exist_ok=True)
    checkpoint = work / "checkpoint.pt"
    state = torch.load(checkpoint, map_location=device) if checkpoint.exists() else None
    if state is not None and state.get("recipe", {}).get("lora_rank", 0) != recipe.lora_rank:
        raise ValueError(f"{checkpoint} was trained with LoRA rank {state.get('recipe', {}).get('lora_rank', 0)}, "
                         f"this stage has {recipe.lora_rank}: give it a work folder of its own")
    if state is None and start_from is not None and json.loads((Path(start_from) / "config.json").read_text()).get("text_lora"):
        raise ValueError(f"{start_from} adapts its language model: a stage starts from a VLM whose "
                         "language model is the reference target's")
    text = load_causal_lm(REFERENCE_TARGET, dtype="bfloat16", device=device)
    tokenizer = text.tokenizer
    config = reference_vlm_config(text.model.config)
    model = build_vlm(text, config)
    del text
    for p in text_weights(model):
        p.requires_grad_(False)
    learned = [p for n, p in model.named_parameters() if n.startswith(LEARNED)]
    for p in learned:
        p.data = p.data.float()
        p.requires_grad_(True)
    groups, peaks = [{"params": learned}], [recipe.lr]   # the peaks are the recipe's, not a checkpoint's
    if recipe.lora_rank:
        from specserve.training.lora import add_lora

        adapters = add_lora(model.model.language_model, recipe.lora_rank, recipe.lora_alpha)
        groups.append({"params": adapters})
        peaks.append(recipe.lora_lr)
        learned = learned + adapters
    optimizer = torch.optim.AdamW(groups, lr=recipe.lr, weight_decay=recipe.weight_decay)
    start, log, earlier = 0, [], []
    if state is None and start_from is not None:
        from safetensors.torch import load_file

        model.load_state_dict(load_file(Path(start_from) / "model.safetensors"), strict=False)
        earlier = stages(json.loads((Path(start_from) / "training_log.json").read_text()))
    if state is not None:
        model.load_state_dict(state["weights"], strict=False)
        if "optimizer" in state:   # a weights-only checkpoint restarts Adam's moments
            optimizer.load_state_dict(state["optimizer"])
        start, log, earlier = state["step"], state["log"], state.get("earlier", [])
    loader = DataLoader(PictureStream(tokenizer, config, start * recipe.batch, recipe.categories), batch_size=recipe.batch,
                        num_workers=workers, collate_fn=lambda rows: collate(rows, tokenizer.pad_token_id),
                        persistent_workers=workers > 0, prefetch_factor=4 if workers else None)
    batches = iter(loader)
    model.train()
    bar = tqdm(range(start, recipe.steps), initial=start, total=recipe.steps, desc="vlm", disable=not progress)
    began = time.perf_counter()
    for step in bar:
        rows = {k: v.to(device, non_blocking=True) for k, v in next(batches).items()}
        for group, peak in zip(optimizer.param_groups, peaks):
            group["lr"] = warmup_cosine(peak, step, recipe.warmup_steps, recipe.steps)
        with torch.autocast(device.type, dtype=torch.bfloat16):
            labels = rows.pop("labels")
            loss = answer_loss(model(**rows).logits, labels, per_row=recipe.loss == "row-mean")
        loss.backward()
        norm = torch.nn.utils.clip_grad_norm_(learned, 1.0)
        if torch.isfinite(norm):   # a step whose bfloat16 forward overflowed is skipped, not learned
            optimizer.step()
        optimizer.zero_grad(set_to_none=True)
        entry = {"step": step + 1, "loss": loss.detach().item(), "seconds": time.perf_counter() - began}
        done = step + 1 == recipe.steps or (max_seconds is not None and entry["seconds"] > max_seconds)
        if (step + 1) % recipe.eval_every == 0 or done:
            model.eval()
            with torch.autocast(device.type, dtype=torch.bfloat16):
                asked = tuple(c for c in (*CATEGORIES, *CLIP_CATEGORIES) if c in recipe.categories)
                entry["accuracy"] = evaluate(model, tokenizer, recipe.eval_per_category, categories=asked)
            model.train()
            bar.write(f"step {step + 1}: loss {entry['loss']:.3f}, accuracy "
                      + ", ".join(f"{k} {v:.2f}" for k, v in entry["accuracy"].items()))
        log.append(entry)
        bar.set_postfix(loss=f"{entry['loss']:.3f}")
        if (step + 1) % recipe.eval_every == 0 or done:
            torch.save({"weights": trainable(model), "optimizer": optimizer.state_dict(), "step": step + 1,
                        "log": log, "recipe": asdict(recipe), "earlier": earlier, "device": device.type}, checkpoint)
        if done:
            break
    (work / "log.json").write_text(json.dumps(log))
    return work


def export(work: Path | None = None, out: Path | None = None) -> Path:
    """The checkpoint's vision tower and projector (bfloat16), the language model's adapters where
    the stage had them (``TEXT_LORA``, named in the config's ``text_lora``), the config naming the
    target (``text_from``), the processor and the training log, into the package's targets folder."""
    from safetensors.torch import save_file

    work = Path(work or default_work())
    state = torch.load(work / "checkpoint.pt", map_location="cpu")
    text = load_causal_lm(REFERENCE_TARGET, dtype="float32", device="cpu")
    config = reference_vlm_config(text.model.config)
    config.text_from = REFERENCE_TARGET
    config.architectures = ["LlavaForConditionalGeneration"]
    out = Path(out or targets_dir() / REFERENCE_VLM)
    out.mkdir(parents=True, exist_ok=True)
    weights = {k: v for k, v in state["weights"].items() if ".lora." not in k}
    from specserve.training.lora import lora_tensors

    adapters = lora_tensors(state["weights"], TEXT_BODY)
    recipe = state["recipe"]
    if adapters:
        config.text_lora = {"rank": recipe["lora_rank"], "alpha": recipe["lora_alpha"]}
        save_file({k: v.to(torch.bfloat16).contiguous() for k, v in adapters.items()}, out / TEXT_LORA,
                  metadata={"format": "pt"})
    else:
        (out / TEXT_LORA).unlink(missing_ok=True)
    config.save_pretrained(out)
    save_file({k: v.to(torch.bfloat16).contiguous() for k, v in weights.items()}, out / "model.safetensors",
              metadata={"format": "pt"})
    build_processor(text.tokenizer, config).save_pretrained(out)
    stage = {"recipe": state["recipe"], "steps": state["step"], "accuracy": [e for e in state["log"] if "accuracy" in e],
             "device": state.get("device", "cpu")}
    (out / "training_log.json").write_text(json.dumps({"stages": [*state.get("earlier", []), stage]}))
    return out


def stages(log: dict) -> list[dict]:
    """A training log's stages (a log of one stage, as first written, is that stage)."""
    return log["stages"] if "stages" in log else [{**log, "device": "cuda"}]


def write_card(out: Path, per_category: int = 50, dtype: str = "bfloat16") -> Path:
    """Score the exported VLM on ``per_category`` held-out pictures per category (greedy, on this
    machine) and write its model card (README.md) beside the weights."""
    from specserve.replicas.vlm import load_vlm

    out = Path(out)
    vlm = load_vlm(str(out), dtype=dtype, device="cpu")
    log = stages(json.loads((out / "training_log.json").read_text()))
    clips = any(c in CLIP_CATEGORIES for stage in log for c in stage["recipe"].get("categories", ()))
    asked = CATEGORIES + CLIP_CATEGORIES if clips else CATEGORIES
    began = time.perf_counter()
    accuracy = evaluate(vlm.model, vlm.tokenizer.tokenizer, per_category, categories=asked)
    seconds = time.perf_counter() - began
    tables = "\n\n".join(_stage_text(i, stage) for i, stage in enumerate(log))
    lora = json.loads((out / "config.json").read_text()).get("text_lora")
    language = (f"""the reference target's language model ({REFERENCE_TARGET}: its weights load from the target
at start) with low-rank adapters (LoRA rank {lora['rank']}, alpha {lora['alpha']:g}, on every attention and MLP
projection; {(out / TEXT_LORA).stat().st_size / 1e6:.1f} MB, folded into the weights at load), reading""" if lora else
                f"""the reference target ({REFERENCE_TARGET}, frozen: its weights
load from the target at start) reading""")
    stored = "they are stored here, the adapters beside them" if lora else "only they are stored"
    card = f"""# {out.name}

The reference vision-language model: {language} 64 image tokens per 96x96 picture from a SigLIP vision
tower (4 layers, 256 wide, 12 px patches) through LLaVA's two-layer projector (a standard
transformers `LlavaForConditionalGeneration`). The tower and projector were trained from scratch
here; {stored} (bfloat16, {(out / 'model.safetensors').stat().st_size / 1e6:.1f} MB).
The image placeholder is the target's unused special token `<empty_output>`.

- **Data**: synthetic pictures drawn with Pillow, one fresh picture per row
  (`specserve.data.synthetic_images`): {', '.join(CATEGORIES)}{"; and clips of 2-8 frames shown as consecutive pictures (`specserve.data.synthetic_clips`): " + ', '.join(CLIP_CATEGORIES) if clips else ""}; a question per category, one right answer;
  cross-entropy on the answer tokens, bfloat16 autocast.
- **Accuracy** (exact match after normalising, greedy, held-out pictures from seed 10^9), by training stage:

{tables}

  Exported weights in {dtype} on this machine ({_cpu_name()}, {per_category} pictures a
  category, {seconds:.0f} s): """ + ", ".join(f"{c} {accuracy[c]:.2f}" for c in (*asked, "mix")) + """.
"""
    path = out / "README.md"
    path.write_text(card)
    return path


def _stage_text(index: int, stage: dict) -> str:
    recipe, evals = stage["recipe"], stage["accuracy"]
    minutes = evals[-1]["seconds"] / 60 if evals else 0.0
    stopped = "; stopped at its time limit" if stage["steps"] < recipe["steps"] else ""
    clips = any(c in CLIP_CATEGORIES for c in recipe.get("categories", ()))
    command = ("specserve zoo vlm --device cuda --workers 15" if index == 0
               else "specserve zoo vlm --clips" if clips else "specserve zoo vlm --fine-tune")
    where = "one GPU" if stage["device"] == "cuda" else "this project's 2-core CPU"
    categories = list(recipe.get("categories", CATEGORIES[:6]))
    asked = sorted(set(categories), key=list(CATEGORIES + CLIP_CATEGORIES).index)
    weighed = [c for c in asked if categories.count(c) > min(categories.count(a) for a in asked)]
    loss = ("each row's answer tokens averaged, then the rows" if recipe.get("loss") == "row-mean"
            else "averaged over the batch's answer tokens")
    names = [c for c in CATEGORIES + CLIP_CATEGORIES if evals and c in evals[-1]["accuracy"]]
    header = "| step | minutes | loss | " + " | ".join(names) + " | mix |"
    rule = "| --- " * (len(names) + 4) + "|"
    rows = [f"| {e['step']} | {e['seconds'] / 60:.1f} | {e['loss']:.3f} | "
            + " | ".join(f"{e['accuracy'][c]:.2f}" for c in (*names, "mix")) + " |" for e in evals]
    return f"""  Stage {index + 1}: `{command}`: {stage['steps']} steps of {recipe['batch']} pictures
  ({stage['steps'] * recipe['batch']:,} pictures, {minutes:.1f} min on {where}) asking {', '.join(asked)}{
    f" ({', '.join(weighed)} more often)" if weighed else ""};
  AdamW lr {recipe['lr']}{f" (the adapters' {recipe['lora_lr']})" if recipe.get('lora_rank') else ""} (warm-up {recipe['warmup_steps']} steps, cosine over {recipe['steps']:,}{stopped}); loss {loss}.

{header}
{rule}
{chr(10).join(rows)}"""


def _cpu_name() -> str:
    import platform

    try:
        with open("/proc/cpuinfo") as info:
            return next(line.split(":", 1)[1].strip() for line in info if line.startswith("model name"))
    except (OSError, StopIteration):
        return platform.machine()
