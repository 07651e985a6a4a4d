"""Distil the image generator's draft from its own token streams.

    specserve zoo imagegen-draft [--pictures N] [--steps N]   # resumable

The ADT-Tree paper drafts LlamaGen with EAGLE-2 heads trained on the generator's outputs. Here the
draft is a small Llama of its own (one layer, the generator's vocabulary), so that the engine's
draft LM path serves it as it serves text drafts: it reads the conditional row's tokens (class
token, then the picture so far) and proposes chains and trees, which the target verifies against
the guided distribution. It learns from pictures the generator itself samples with its served
settings (guidance, temperature 1, top-k), by next-token cross-entropy: the sampled tokens are
draws from exactly the distribution the draft must predict, so no teacher forward is needed per
step (a deviation from EAGLE's feature-level distillation, which needs the target's states).

Streams are generated once per work folder (``streams-NNNNN.npz``, ``STREAM_CHUNK`` pictures each,
classes in turn) and reused; held out: the last 1/16 of them. Validation is greedy acceptance
teacher-forced: how often the draft's argmax is the guided distribution's, on the held-out
streams, by grid row (where acceptance varies).
"""

from __future__ import annotations

import json
from dataclasses import asdict, dataclass
from pathlib import Path

import numpy as np
import torch

from specserve.replicas.imagegen import generate, guided_logits, load_generator
from specserve.replicas.model_store import model_cache_dir
from specserve.training.resumable import train_loop

STREAM_CHUNK = 256


@dataclass(frozen=True)
class DraftRecipe:
    pictures: int = 2048
    steps: int = 1200
    batch: int = 16
    lr: float = 1e-3
    warmup_steps: int = 100
    weight_decay: float = 0.05
    hidden: int = 256
    layers: int = 1
    heads: int = 4
    eval_every: int = 200
    save_every: int = 100


RECIPE = DraftRecipe()


def default_work() -> Path:
    return model_cache_dir().parent / "train" / "scenes-imagegen-draft"


@torch.no_grad()
def streams(generator_folder: Path, work: Path, pictures: int, progress: bool = True) -> tuple[np.ndarray, np.ndarray]:
    """(ids [pictures, grid * grid] int16, labels [pictures] int16): pictures the generator samples
    with its served guidance and top-k at temperature 1 (each chunk its own seed), cached per chunk."""
    from tqdm import tqdm

    model, settings, _ = load_generator(generator_folder)
    work.mkdir(parents=True, exist_ok=True)
    ids, labels = [], []
    chunks = -(-pictures // STREAM_CHUNK)
    for c in tqdm(range(chunks), desc="sampling pictures", disable=not progress):
        path = work / f"streams-{c:05d}.npz"
        if not path.exists():
            chunk = [(c * STREAM_CHUNK + i) % settings.classes for i in range(STREAM_CHUNK)]
            drawn = torch.cat([generate(model, settings.layout, chunk[i:i + 64], settings.tokens,
                                        cfg_scale=settings.cfg_scale, temperature=1.0, top_k=settings.top_k,
                                        seed=c * 1000 + i) for i in range(0, STREAM_CHUNK, 64)])
            tmp = path.with_suffix(".tmp.npz")
            np.savez(tmp, ids=drawn.numpy().astype(np.int16), labels=np.array(chunk, dtype=np.int16))
            tmp.rename(path)
        with np.load(path) as data:
            ids.append(data["ids"])
            labels.append(data["labels"])
    return np.concatenate(ids)[:pictures], np.concatenate(labels)[:pictures]


def draft_config(settings, recipe: DraftRecipe):
    from transformers import LlamaConfig

    return LlamaConfig(vocab_size=settings.layout.vocab_size, hidden_size=recipe.hidden,
                       intermediate_size=recipe.hidden * 8 // 3, num_hidden_layers=recipe.layers,
                       num_attention_heads=recipe.heads, num_key_value_heads=recipe.heads,
                       max_position_embeddings=1 + settings.tokens + 16, rms_norm_eps=1e-5,
                       tie_word_embeddings=False, bos_token_id=None, eos_token_id=None, pad_token_id=None)


def rows_of(ids: np.ndarray, labels: np.ndarray, settings) -> torch.Tensor:
    """[class token, image tokens...] per picture: the conditional row the draft reads."""
    first = labels.astype(np.int64) + settings.codebook_size
    return torch.from_numpy(np.concatenate([first[:, None], ids.astype(np.int64)], axis=1))


@torch.no_grad()
def guided_argmax(generator, rows: torch.Tensor, settings) -> torch.Tensor:
    """[B, grid * grid]: the guided distribution's argmax at every image position of ``rows``
    (conditional rows; their unconditional twins start with the unconditional token)."""
    out = []
    for i in range(0, len(rows), 64):
        cond = rows[i:i + 64, :-1]
        uncond = cond.clone()
        uncond[:, 0] = settings.layout.unconditional
        logits = generator(input_ids=torch.cat([cond, uncond])).logits
        out.append(guided_logits(logits[:len(cond)], logits[len(cond):], settings.cfg_scale,
                                 settings.codebook_size).argmax(-1))
    return torch.cat(out)


@torch.no_grad()
def agreement_by_row(model, rows: torch.Tensor, targets: torch.Tensor, grid: int) -> list[float]:
    """How often the draft's argmax is ``targets`` (the guided argmax), per grid row."""
    hits = torch.zeros(grid)
    for i in range(0, len(rows), 64):
        predicted = model(input_ids=rows[i:i + 64, :-1]).logits.argmax(-1).cpu()   # [B, grid * grid]
        hits += (predicted == targets[i:i + 64]).float().view(len(predicted), grid, grid).mean(dim=2).sum(dim=0)
    return (hits / len(rows)).tolist()


def train(generator_folder: Path, work: Path | None = None, recipe: DraftRecipe = RECIPE, steps: int | None = None,
          pictures: int | None = None, progress: bool = True, max_seconds: float | None = None,
          device: str | None = None) -> Path:
    """Sample the streams (once), then train the draft (resuming from ``work``'s checkpoint)."""
    from transformers import LlamaForCausalLM

    recipe = DraftRecipe(**{**asdict(recipe), **({"steps": steps} if steps else {}),
                            **({"pictures": pictures} if pictures else {})})
    device = torch.device(device or "cpu")
    work = Path(work or default_work())
    work.mkdir(parents=True, exist_ok=True)
    generator, settings, _ = load_generator(generator_folder)
    ids, labels = streams(generator_folder, work, recipe.pictures, progress)
    held = max(1, len(ids) // 16)
    train_rows, held_rows = rows_of(ids[:-held], labels[:-held], settings), rows_of(ids[-held:], labels[-held:], settings)
    targets = guided_argmax(generator, held_rows, settings)
    del generator
    model = LlamaForCausalLM(draft_config(settings, recipe)).to(device)
    optimizer = torch.optim.AdamW(model.parameters(), lr=recipe.lr, betas=(0.9, 0.95), weight_decay=recipe.weight_decay)

    def rows(step: int) -> torch.Tensor:
        return train_rows[np.random.default_rng(step).integers(0, len(train_rows), recipe.batch)].to(device)

    def evaluate() -> tuple[dict, str]:
        agreement = agreement_by_row(model, held_rows.to(device), targets, settings.grid)
        return {"agreement_by_row": agreement}, f"held-out greedy acceptance {np.mean(agreement):.3f}"

    train_loop(model, optimizer, work / "checkpoint.pt", steps=recipe.steps, lr=recipe.lr,
               warmup_steps=recipe.warmup_steps, eval_every=recipe.eval_every, save_every=recipe.save_every,
               rows=rows, evaluate=evaluate, saved={"recipe": asdict(recipe)}, desc="imagegen draft",
               progress=progress, max_seconds=max_seconds)
    return work


def export(generator_folder: Path, work: Path | None = None, out: Path | None = None) -> Path:
    """The draft as a Hugging Face folder (float32: it is small) with a model card."""
    from transformers import LlamaForCausalLM

    work = Path(work or default_work())
    out = Path(out or work / "export")
    state = torch.load(work / "checkpoint.pt", map_location="cpu")
    recipe = DraftRecipe(**state["recipe"])
    _, settings, _ = load_generator(generator_folder)
    model = LlamaForCausalLM(draft_config(settings, recipe))
    model.load_state_dict(state["weights"])
    model.eval().save_pretrained(out)
    # The zoo lists a draft under the model it was distilled from (``model_store.zoo_drafts``).
    (out / "training.json").write_text(json.dumps({
        "recipe": "scenes-imagegen-draft", "kind": "standalone", "teacher": Path(generator_folder).name,
        "steps": state["step"], "config": state["recipe"]}, indent=2) + "\n")
    last = next((e for e in reversed(state["log"]) if "agreement_by_row" in e), None)
    rows = "" if last is None else ", ".join(f"{a:.2f}" for a in last["agreement_by_row"])
    (out / "README.md").write_text(
        f"# scenes-imagegen-draft\n\nThe reference image generator's draft (`training/imagegen_draft.py`): a "
        f"{recipe.layers}-layer Llama of {recipe.hidden} over the generator's vocabulary, trained for "
        f"{state['step']} steps of {recipe.batch} on {recipe.pictures} pictures the generator sampled itself "
        f"(guidance {settings.cfg_scale}, temperature 1, top-k {settings.top_k}).\n\n"
        f"- held-out greedy acceptance, teacher-forced (the draft's argmax is the guided distribution's), by "
        f"grid row (top to bottom): {rows}\n")
    return out
