"""Train the reference image generator: a Llama over the VQ tokenizer's image tokens, class-conditional.

    specserve zoo imagegen [--steps N] [--max-seconds S]   # resumable: run it again to go on

LlamaGen's class-conditional setting, scaled down: a sequence is the class's token, then the
picture's grid of image tokens in raster order (``data/scenes.py`` scenes through the trained
tokenizer, ``replicas/vq_tokenizer.py``), and the loss is next-token cross-entropy on the image
tokens. For classifier-free guidance the class token is replaced by the unconditional token in
10% of the rows (the ADT-Tree paper's and LlamaGen's dropout), so one model gives both the
conditional and the unconditional distribution.

Vocabulary: ``replicas/imagegen.py``'s ``ImagegenLayout``. The model is a ``LlamaForCausalLM``, so
the serving engine's forward, KV cache and drafts take it as they take a text target.

Deviation: LlamaGen's class-conditional models use 2-D rotary positions; this one the plain 1-D
rotary positions of a Llama, so that the engine's forward serves it unchanged.

The scenes' token grids are computed once per run folder (``tokens-NNNNN.npy``, ``TOKEN_CHUNK``
scenes each, with their labels) and reused; seeds count up from 0, so a longer run adds chunks.
"""

from __future__ import annotations

import json
import math
import os
from dataclasses import asdict, dataclass
from pathlib import Path

import numpy as np
import torch

from specserve.data.scenes import BACKGROUNDS, SMOOTH_BACKGROUNDS, class_label, label_prompt, scene
from specserve.data.synthetic_images import COLOURS, SHAPES
from specserve.replicas.imagegen import GENERATOR_FILE, GeneratorSettings, ImagegenLayout, generate, to_pictures
from specserve.replicas.model_store import model_cache_dir
from specserve.replicas.vq_tokenizer import VQTokenizer, to_pixels
from specserve.training.resumable import next_token_loss, train_loop

TOKEN_CHUNK = 1024
CFG_DROPOUT = 0.1


@dataclass(frozen=True)
class ImagegenRecipe:
    steps: int = 6000
    batch: int = 32
    lr: float = 6e-4
    warmup_steps: int = 200
    weight_decay: float = 0.05
    scenes: int = 65536            # distinct scenes tokenized; a step draws rows among them
    hidden: int = 256
    layers: int = 6
    heads: int = 4
    eval_every: int = 500
    save_every: int = 100


RECIPE = ImagegenRecipe()


def default_work() -> Path:
    return model_cache_dir().parent / "train" / "scenes-imagegen"


def model_config(layout: ImagegenLayout, grid: int, recipe: ImagegenRecipe):
    from transformers import LlamaConfig

    return LlamaConfig(vocab_size=layout.vocab_size, hidden_size=recipe.hidden, intermediate_size=recipe.hidden * 8 // 3,
                       num_hidden_layers=recipe.layers, num_attention_heads=recipe.heads,
                       num_key_value_heads=recipe.heads, max_position_embeddings=1 + grid * grid + 16,
                       rms_norm_eps=1e-5, tie_word_embeddings=False, bos_token_id=None, eos_token_id=None,
                       pad_token_id=None)


@torch.no_grad()
def token_grids(tokenizer: VQTokenizer, work: Path, scenes: int, progress: bool = True) -> tuple[np.ndarray, np.ndarray]:
    """(ids [scenes, grid * grid] int16, labels [scenes] int16) of scenes 0..``scenes``-1, cached in
    ``work`` per chunk."""
    from tqdm import tqdm

    ids, labels = [], []
    chunks = -(-scenes // TOKEN_CHUNK)
    for c in tqdm(range(chunks), desc="tokenizing scenes", disable=not progress):
        path = work / f"tokens-{c:05d}.npz"
        if not path.exists():
            drawn = [scene(seed) for seed in range(c * TOKEN_CHUNK, (c + 1) * TOKEN_CHUNK)]
            grids = torch.cat([tokenizer.encode(to_pixels([s.image for s in drawn[i:i + 64]]))
                               for i in range(0, len(drawn), 64)])
            tmp = path.with_suffix(".tmp.npz")
            np.savez(tmp, ids=grids.flatten(1).numpy().astype(np.int16),
                     labels=np.array([s.label for s in drawn], dtype=np.int16))
            tmp.rename(path)
        with np.load(path) as data:
            ids.append(data["ids"])
            labels.append(data["labels"])
    return np.concatenate(ids)[:scenes], np.concatenate(labels)[:scenes]


def sequences(ids: np.ndarray, labels: np.ndarray, layout: ImagegenLayout, rng: np.random.Generator) -> torch.Tensor:
    """Rows [class or unconditional token, image tokens...], the class dropped with CFG_DROPOUT."""
    cond = labels.astype(np.int64) + layout.codebook_size
    cond[rng.random(len(cond)) < CFG_DROPOUT] = layout.unconditional
    return torch.from_numpy(np.concatenate([cond[:, None], ids.astype(np.int64)], axis=1))


def image_loss(model, rows: torch.Tensor) -> torch.Tensor:
    """Cross-entropy of each image token given the class token and the tokens before it."""
    return next_token_loss(model, rows)


def train(tokenizer_folder: Path, steps: int | None = None, batch: int | None = None, work: Path | None = None,
          recipe: ImagegenRecipe = RECIPE, progress: bool = True, max_seconds: float | None = None,
          device: str | None = None) -> Path:
    """Train (resuming from ``work``'s checkpoint); returns ``work``. Held out: the last 1/64 of
    the tokenized scenes, scored every ``eval_every`` steps."""
    from transformers import LlamaForCausalLM

    recipe = ImagegenRecipe(**{**asdict(recipe), **({"steps": steps} if steps else {}),
                               **({"batch": batch} if batch else {})})
    device = torch.device(device or "cpu")
    work = Path(work or default_work())
    work.mkdir(parents=True, exist_ok=True)
    tokenizer = VQTokenizer.load(tokenizer_folder)
    layout = ImagegenLayout(tokenizer.config.codebook_size)
    ids, labels = token_grids(tokenizer, work, recipe.scenes, progress)
    held = max(1, len(ids) // 64)
    train_ids, train_labels = ids[:-held], labels[:-held]
    model = LlamaForCausalLM(model_config(layout, tokenizer.config.grid, recipe)).to(device)
    optimizer = torch.optim.AdamW(model.parameters(), lr=recipe.lr, betas=(0.9, 0.95), weight_decay=recipe.weight_decay)

    def rows(step: int) -> torch.Tensor:
        rng = np.random.default_rng(step)   # the rows of a step are its own, resumed or not
        pick = rng.integers(0, len(train_ids), recipe.batch)
        return sequences(train_ids[pick], train_labels[pick], layout, rng).to(device)

    def evaluate() -> tuple[dict, str]:
        held_rows = sequences(ids[-held:], labels[-held:], layout, np.random.default_rng(0)).to(device)
        loss = sum(image_loss(model, held_rows[i:i + 64]).item() * len(held_rows[i:i + 64])
                   for i in range(0, len(held_rows), 64)) / len(held_rows)
        return {"held_out_loss": loss}, f"held-out {loss:.3f}"

    train_loop(model, optimizer, work / "checkpoint.pt", steps=recipe.steps, lr=recipe.lr,
               warmup_steps=recipe.warmup_steps, eval_every=recipe.eval_every, save_every=recipe.save_every,
               rows=rows, evaluate=evaluate, saved={"recipe": asdict(recipe), "layout": asdict(layout)},
               desc="imagegen", progress=progress, max_seconds=max_seconds)
    return work


# The served defaults written into the export (``GeneratorSettings``): LlamaGen's class-conditional
# setting scaled to this codebook (guidance a few times over, top-k an eighth of the codes).
EXPORT_CFG_SCALE = 3.0
EXPORT_TOP_K = 64
# Gallery classes: each shape and colour once, half on smooth backgrounds and half on busy ones.
GALLERY_CLASSES = 8


def export(tokenizer_folder: Path, work: Path | None = None, out: Path | None = None,
           cfg_scale: float = EXPORT_CFG_SCALE, top_k: int = EXPORT_TOP_K) -> Path:
    """The checkpoint's generator as a folder ``load_generator`` reads: the Llama in bfloat16
    (``save_pretrained``), ``imagegen.json`` pointing at the tokenizer, a gallery of sampled
    pictures and a model card with the held-out loss."""
    from transformers import LlamaForCausalLM

    work = Path(work or default_work())
    out = Path(out or work / "export")
    state = torch.load(work / "checkpoint.pt", map_location="cpu")
    recipe, layout = ImagegenRecipe(**state["recipe"]), ImagegenLayout(**state["layout"])
    tokenizer = VQTokenizer.load(tokenizer_folder)
    grid = tokenizer.config.grid
    model = LlamaForCausalLM(model_config(layout, grid, recipe))
    model.load_state_dict(state["weights"])
    model.eval().to(torch.bfloat16).save_pretrained(out)
    settings = GeneratorSettings(layout.codebook_size, layout.classes, grid,
                                 os.path.relpath(Path(tokenizer_folder).resolve(), out.resolve()), cfg_scale, top_k)
    (out / GENERATOR_FILE).write_text(json.dumps(asdict(settings), indent=1) + "\n")
    busy = [b for b in BACKGROUNDS if b not in SMOOTH_BACKGROUNDS]
    labels = [class_label(SHAPES[i % len(SHAPES)], list(COLOURS)[i % len(COLOURS)],
                          (SMOOTH_BACKGROUNDS if i % 2 == 0 else busy)[(i // 2) % 2]) for i in range(GALLERY_CLASSES)]
    gallery(model.float(), settings, tokenizer, labels).save(out / "gallery.png")
    log = state["log"]
    held = [e for e in log if "held_out_loss" in e]
    # A resumed run's clock starts again: the training time is each segment's last reading, summed.
    minutes = sum(e["seconds"] for e, after in zip(log, log[1:] + [None])
                  if after is None or after["seconds"] < e["seconds"]) / 60
    (out / "README.md").write_text(
        f"# scenes-imagegen\n\nThe reference visual autoregressive image generator: a class-conditional Llama "
        f"({recipe.layers} layers of {recipe.hidden}, {sum(p.numel() for p in model.parameters()) / 1e6:.1f}M "
        f"parameters) over the `{Path(tokenizer_folder).name}` tokenizer's {grid}x{grid} grid of "
        f"{layout.codebook_size} codes, trained by `training/imagegen_train.py` for {state['step']} steps of "
        f"{recipe.batch} scenes (`data/scenes.py`, {layout.classes} classes: shape x colour x background), "
        f"the class token dropped for the unconditional one in {CFG_DROPOUT:.0%} of rows (classifier-free "
        f"guidance), {minutes:.0f} minutes of training.\n\n"
        f"- held-out loss (image tokens, nats): "
        + ", ".join(f"{e['held_out_loss']:.3f} at step {e['step']}" for e in held)
        + f" (uniform: {math.log(layout.codebook_size):.2f})\n"
        f"- served defaults: guidance scale {cfg_scale}, top-k {top_k}\n\n"
        f"![sampled pictures, two per class (guidance {cfg_scale}, temperature 1, top-k {top_k}): "
        + "; ".join(label_prompt(label) for label in labels) + "](gallery.png)\n")
    return out


def gallery(model, settings, tokenizer, labels: list[int], per_class: int = 2, seed: int = 0):
    """Sampled pictures, ``per_class`` columns per class, decoded by the tokenizer."""
    from PIL import Image

    rows = [label for label in labels for _ in range(per_class)]
    ids = generate(model, settings.layout, rows, settings.tokens, cfg_scale=settings.cfg_scale, temperature=1.0,
                   top_k=settings.top_k, seed=seed)
    pictures = to_pictures(tokenizer, ids, settings.grid)
    size = pictures[0].width
    sheet = Image.new("RGB", (size * len(labels), size * per_class), (255, 255, 255))
    for i, picture in enumerate(pictures):
        sheet.paste(picture, ((i // per_class) * size, (i % per_class) * size))
    return sheet
