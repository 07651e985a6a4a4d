"""Train the reference image generator's VQ tokenizer on synthetic scenes (``data/scenes.py``).

    specserve zoo imagegen-vq [--steps N] [--max-seconds S]   # resumable: run it again to go on

Each step draws ``batch`` new scenes (seeds count up, so a run and its resumption see each scene
once) and minimises the pixels' mean squared error plus the quantizer's codebook and commitment
terms (``replicas/vq_tokenizer.py``). Every ``restart_every`` steps, the codes no cell chose since
the last restart take the places of encoder outputs from the current batch (the cells the
codebook fits worst), so the whole codebook stays in use; LlamaGen has no such step (its codebook
is trained on far more varied pictures).

Evaluation, on held-out scenes (``TEST_SEED`` up): reconstruction error (MSE in [-1, 1] and PSNR)
overall and on smooth and busy backgrounds apart, and how many codes the held-out grids use.
"""

from __future__ import annotations

import json
import math
import time
from dataclasses import asdict, dataclass
from pathlib import Path

import torch
import torch.nn.functional as F
from PIL import Image

from specserve.data.scenes import SMOOTH_BACKGROUNDS, TEST_SEED, scene
from specserve.replicas.model_store import model_cache_dir
from specserve.replicas.vq_tokenizer import VQConfig, VQTokenizer, to_images, to_pixels
from specserve.training.schedule import warmup_cosine


@dataclass(frozen=True)
class VQRecipe:
    steps: int = 8000
    batch: int = 16
    lr: float = 3e-4
    warmup_steps: int = 200
    restart_every: int = 200       # steps between dead-code restarts (0: never)
    eval_every: int = 1000
    eval_scenes: int = 64
    save_every: int = 250


RECIPE = VQRecipe()


def default_work() -> Path:
    return model_cache_dir().parent / "train" / "scenes-vq"


def batch_of(first_seed: int, size: int) -> torch.Tensor:
    return to_pixels([scene(seed).image for seed in range(first_seed, first_seed + size)])


@torch.no_grad()
def restart_dead_codes(model: VQTokenizer, used: torch.Tensor, z: torch.Tensor) -> int:
    """Codes with ``used`` == 0 take the (normalised) encoder outputs ``z`` [B, D, H, W] the
    codebook fits worst; returns how many were restarted."""
    dead = (used == 0).nonzero().flatten()
    if not len(dead):
        return 0
    flat = F.normalize(z.permute(0, 2, 3, 1).reshape(-1, z.shape[1]), dim=-1)
    fit = (flat @ model.codes().T).max(dim=-1).values   # cosine to the nearest code
    worst = fit.argsort()[: len(dead)]
    model.codebook.weight[dead[: len(worst)]] = flat[worst]
    return min(len(dead), len(worst))


@torch.no_grad()
def evaluate(model: VQTokenizer, scenes: int) -> dict:
    """Reconstruction on held-out scenes: MSE and PSNR overall, smooth and busy backgrounds apart,
    and the codes the held-out grids use."""
    model.eval()
    held = [scene(TEST_SEED + i) for i in range(scenes)]
    pixels = to_pixels([s.image for s in held])
    recon, ids, _ = model(pixels)
    per_scene = ((recon.clamp(-1, 1) - pixels) ** 2).mean(dim=(1, 2, 3))
    smooth = torch.tensor([s.background in SMOOTH_BACKGROUNDS for s in held])

    def psnr(mse: float) -> float:
        return 10 * math.log10(4.0 / mse) if mse > 0 else float("inf")   # peak-to-peak 2 in [-1, 1]

    out = {"mse": per_scene.mean().item(), "codes_used": int(ids.unique().numel())}
    out["psnr"] = psnr(out["mse"])
    for name, mask in (("smooth", smooth), ("busy", ~smooth)):
        if mask.any():
            out[f"mse_{name}"] = per_scene[mask].mean().item()
    model.train()
    return out


def train(steps: int | None = None, batch: int | None = None, work: Path | None = None,
          recipe: VQRecipe = RECIPE, config: VQConfig = VQConfig(), progress: bool = True,
          max_seconds: float | None = None, device: str | None = None) -> Path:
    """Train (resuming from ``work``'s checkpoint), evaluating every ``eval_every`` steps; returns
    ``work``. ``max_seconds``: stop (saved) once a step ends past this long; run again to go on."""
    from tqdm import tqdm

    recipe = VQRecipe(**{**asdict(recipe), **({"steps": steps} if steps else {}), **({"batch": batch} if batch else {})})
    device = torch.device(device or "cpu")
    work = Path(work or default_work())
    work.mkdir(parents=True, exist_ok=True)
    checkpoint = work / "checkpoint.pt"
    start, log = 0, []
    if checkpoint.exists():
        state = torch.load(checkpoint, map_location=device)
        config = VQConfig(**state["config"])
    model = VQTokenizer(config).to(device)
    optimizer = torch.optim.AdamW(model.parameters(), lr=recipe.lr, betas=(0.9, 0.95), weight_decay=0.0)
    used = torch.zeros(config.codebook_size, dtype=torch.long, device=device)
    if checkpoint.exists():
        model.load_state_dict(state["weights"])
        optimizer.load_state_dict(state["optimizer"])
        start, log, used = state["step"], state["log"], state["used"].to(device)
    model.train()
    bar = tqdm(range(start, recipe.steps), initial=start, total=recipe.steps, desc="vq", disable=not progress)
    began = time.perf_counter()
    for step in bar:
        pixels = batch_of(step * recipe.batch, recipe.batch).to(device)
        for group in optimizer.param_groups:
            group["lr"] = warmup_cosine(recipe.lr, step, recipe.warmup_steps, recipe.steps)
        z = model.encoder(pixels)
        quantized, ids, quantizer_loss = model.quantize(z)
        pixel_loss = F.mse_loss(model.decoder(quantized), pixels)
        loss = pixel_loss + quantizer_loss
        loss.backward()
        optimizer.step()
        optimizer.zero_grad(set_to_none=True)
        used += torch.bincount(ids.flatten(), minlength=config.codebook_size)
        entry = {"step": step + 1, "loss": loss.item(), "pixel_mse": pixel_loss.item(),
                 "seconds": time.perf_counter() - began}
        if recipe.restart_every and (step + 1) % recipe.restart_every == 0:
            entry["restarted"] = restart_dead_codes(model, used, z.detach())
            used.zero_()
        done = step + 1 == recipe.steps or (max_seconds is not None and entry["seconds"] > max_seconds)
        if (step + 1) % recipe.eval_every == 0 or done:
            entry["eval"] = evaluate(model, recipe.eval_scenes)
            bar.write(f"step {step + 1}: " + ", ".join(f"{k} {v:.4g}" for k, v in entry["eval"].items()))
        log.append(entry)
        bar.set_postfix(mse=f"{pixel_loss.item():.4f}")
        if (step + 1) % recipe.save_every == 0 or (step + 1) % recipe.eval_every == 0 or done:
            torch.save({"weights": model.state_dict(), "optimizer": optimizer.state_dict(), "step": step + 1,
                        "log": log, "used": used.cpu(), "recipe": asdict(recipe), "config": asdict(config)},
                       checkpoint)
        if done:
            break
    (work / "log.json").write_text(json.dumps(log))
    return work


def export(work: Path | None = None, out: Path | None = None, eval_scenes: int = 256) -> Path:
    """The checkpoint's tokenizer as a folder (``VQTokenizer.save``), with a model card of its
    held-out reconstruction error."""
    work = Path(work or default_work())
    state = torch.load(work / "checkpoint.pt", map_location="cpu")
    config = VQConfig(**state["config"])
    model = VQTokenizer(config)
    model.load_state_dict(state["weights"])
    out = model.save(out or work / "export")
    scores = evaluate(model, eval_scenes)
    gallery(model).save(out / "reconstructions.png")
    (out / "README.md").write_text(
        f"# scenes-vq\n\nThe reference image generator's VQ tokenizer (`replicas/vq_tokenizer.py`, LlamaGen's "
        f"recipe scaled down), trained by `training/vq_train.py` for {state['step']} steps of "
        f"{state['recipe']['batch']} synthetic scenes (`data/scenes.py`).\n\n"
        f"- {config.image_size}x{config.image_size} pixels to a {config.grid}x{config.grid} grid of "
        f"{config.codebook_size} codes of {config.code_dim} dimensions\n"
        f"- held-out reconstruction ({eval_scenes} scenes): MSE {scores['mse']:.4f} in [-1, 1], PSNR "
        f"{scores['psnr']:.1f} dB; smooth backgrounds {scores.get('mse_smooth', float('nan')):.4f}, busy "
        f"{scores.get('mse_busy', float('nan')):.4f}; {scores['codes_used']} codes used\n\n"
        f"![held-out scenes (top) and their reconstructions from {config.grid}x{config.grid} tokens (bottom)]"
        f"(reconstructions.png)\n")
    return out


@torch.no_grad()
def gallery(model: VQTokenizer, scenes: int = 8) -> Image.Image:
    """Held-out scenes in the top row, their reconstructions from the token grid below."""
    model.eval()
    originals = [scene(TEST_SEED + i).image for i in range(scenes)]
    rebuilt = to_images(model.decode(model.encode(to_pixels(originals))))
    size = model.config.image_size
    sheet = Image.new("RGB", (size * scenes, size * 2), (255, 255, 255))
    for i, (a, b) in enumerate(zip(originals, rebuilt)):
        sheet.paste(a, (i * size, 0))
        sheet.paste(b, (i * size, size))
    return sheet
