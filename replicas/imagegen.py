"""A visual autoregressive image generator: a Llama over a VQ tokenizer's image tokens, class
conditional, with classifier-free guidance (docs/design.md §5).

A picture is the class's token, then its ``grid x grid`` image tokens in raster order. Guidance
runs two rows per picture, the conditional one (the class's token first) and the unconditional one
(``ImagegenLayout.unconditional`` first), fed the same image tokens; the distribution an image
token is drawn from is LlamaGen's combination of their logits (``guided_logits``), restricted to
the codebook's ids. ``generate`` is the plain decoder every speculative path must equal: greedy
token for token, sampled in distribution.
"""

from __future__ import annotations

import json
from dataclasses import dataclass
from pathlib import Path

import torch

from specserve.data.scenes import CLASSES


@dataclass(frozen=True)
class ImagegenLayout:
    """Where image tokens, class tokens and the unconditional token sit in the vocabulary: ids
    ``0..K-1`` are the codebook's, ``K..K+C-1`` the C class labels, ``K+C`` the unconditional
    token."""

    codebook_size: int
    classes: int = CLASSES

    @property
    def unconditional(self) -> int:
        return self.codebook_size + self.classes

    @property
    def vocab_size(self) -> int:
        return self.codebook_size + self.classes + 1

    def class_token(self, label: int) -> int:
        if not 0 <= label < self.classes:
            raise ValueError(f"class label {label}: one of 0..{self.classes - 1}")
        return self.codebook_size + label


def guided_logits(conditional: torch.Tensor, unconditional: torch.Tensor | None, scale: float,
                  codebook_size: int) -> torch.Tensor:
    """LlamaGen's guidance, ``u + scale * (c - u)`` in float32 (scale 1, or no unconditional row:
    ``c``), with every id outside the codebook at -inf: only image tokens are drawn."""
    if unconditional is not None and scale != 1.0:
        u = unconditional.float()
        logits = u + scale * (conditional.float() - u)
    else:
        logits = conditional.float().clone()
    logits[..., codebook_size:] = float("-inf")
    return logits


@torch.inference_mode()
def generate(model, layout: ImagegenLayout, labels: list[int], tokens: int, cfg_scale: float = 1.0,
             temperature: float = 0.0, top_k: int = 0, seed: int = 0) -> torch.Tensor:
    """Image tokens [len(labels), tokens], one picture per label, decoded one token per forward
    with a KV cache (conditional rows, then unconditional ones when ``cfg_scale`` != 1): greedy at
    temperature 0, else drawn from the guided distribution (``top_k`` > 0 keeps the k likeliest)
    with a generator seeded by ``seed``."""
    from transformers import DynamicCache

    device = model.device
    guided = cfg_scale != 1.0
    first = [layout.class_token(label) for label in labels] + ([layout.unconditional] * len(labels) if guided else [])
    ids = torch.tensor(first, device=device)[:, None]
    cache = DynamicCache(config=model.config)
    generator = torch.Generator(device=device).manual_seed(seed)
    out = []
    n = len(labels)
    for _ in range(tokens):
        logits = model(input_ids=ids, past_key_values=cache, use_cache=True).logits[:, -1]
        scores = guided_logits(logits[:n], logits[n:] if guided else None, cfg_scale, layout.codebook_size)
        if temperature <= 0:
            picked = scores.argmax(-1)
        else:
            scores = scores / temperature
            if top_k > 0:
                kth = torch.topk(scores, min(top_k, layout.codebook_size), dim=-1).values[..., -1:]
                scores = scores.masked_fill(scores < kth, float("-inf"))
            picked = torch.multinomial(torch.softmax(scores, -1), 1, generator=generator)[:, 0]
        out.append(picked)
        ids = torch.cat([picked, picked])[:, None] if guided else picked[:, None]
    return torch.stack(out, dim=1)


# The generator folder's own settings, beside its Hugging Face config and weights.
GENERATOR_FILE = "imagegen.json"


@dataclass(frozen=True)
class GeneratorSettings:
    """What serving needs beyond the Llama: the vocabulary's layout, the picture's grid, where the
    VQ tokenizer is (relative to the generator's folder), and the default guidance and top-k."""

    codebook_size: int
    classes: int
    grid: int
    tokenizer: str
    cfg_scale: float
    top_k: int

    @property
    def layout(self) -> ImagegenLayout:
        return ImagegenLayout(self.codebook_size, self.classes)

    @property
    def tokens(self) -> int:
        return self.grid * self.grid


def generator_folder(name_or_path) -> Path | None:
    """The folder of a generator given by path or by name (the model cache, the package's
    targets), or None when it names no generator."""
    from specserve.replicas.model_store import resolve_model_path

    try:
        folder = resolve_model_path(str(name_or_path))
    except FileNotFoundError:
        return None
    return folder if (folder / GENERATOR_FILE).is_file() else None


def is_generator_folder(name_or_path) -> bool:
    return generator_folder(name_or_path) is not None


def generator_settings(name_or_path) -> tuple[Path, GeneratorSettings]:
    """A generator's folder and settings (no weights loaded)."""
    folder = generator_folder(name_or_path)
    if folder is None:
        raise FileNotFoundError(f"{str(name_or_path)!r} is no image generator's folder (it holds no {GENERATOR_FILE})")
    return folder, GeneratorSettings(**json.loads((folder / GENERATOR_FILE).read_text()))


def load_tokenizer(folder: Path, settings: GeneratorSettings, device: str | torch.device = "cpu"):
    """The generator's VQ tokenizer (``settings.tokenizer`` is relative to its folder)."""
    from specserve.replicas.vq_tokenizer import VQTokenizer

    return VQTokenizer.load((folder / settings.tokenizer).resolve(), device=device)


def load_generator(name_or_path, device: str | torch.device = "cpu", dtype: torch.dtype = torch.float32):
    """(the Llama, its ``GeneratorSettings``, the VQ tokenizer) of a generator folder
    (``training/imagegen_train.export``), by path or name."""
    from transformers import LlamaForCausalLM

    folder, settings = generator_settings(name_or_path)
    model = LlamaForCausalLM.from_pretrained(folder, dtype=dtype).to(device).eval()
    return model, settings, load_tokenizer(folder, settings, device)


@torch.inference_mode()
def to_pictures(tokenizer, ids: torch.Tensor, grid: int):
    """PIL pictures of image token rows [B, grid * grid], through the VQ tokenizer's decoder."""
    from specserve.replicas.vq_tokenizer import to_images

    device = next(tokenizer.parameters()).device
    return to_images(tokenizer.decode(ids.view(-1, grid, grid).to(device)))
