"""The image tokenizer of a visual autoregressive target: pictures to a grid of codebook ids and back.

LlamaGen's VQ recipe ("Autoregressive Model Beats Diffusion: Llama for Scalable Image Generation",
after VQGAN), scaled down to pictures a 2-core CPU can learn (``data/scenes.py``):

    encoder     conv, then per level a stride-2 conv and a residual block (64x64 -> 16x16)
    quantizer   z (code_dim per cell) and the codebook both L2-normalised; each cell takes the
                nearest code (cosine), gradients pass straight through; loss
                ||sg(z) - e||² + β ||z - sg(e)||², β = 0.25 (LlamaGen's codebook and commitment terms)
    decoder     the encoder mirrored, nearest-neighbour upsampling then a conv per level

Deviations: no perceptual or adversarial loss (no pretrained VGG or discriminator here; the
pictures are flat shapes and textures, where pixel loss suffices), and codes no cell used for a
while are restarted at an encoder output of the current batch (``training/vq_train.py``): a small
codebook trained from scratch otherwise keeps a few codes and lets the rest die.

Pixels are in [-1, 1]. A folder holds ``config.json`` and ``model.safetensors``.
"""

from __future__ import annotations

import json
from dataclasses import asdict, dataclass
from pathlib import Path

import numpy as np
import torch
import torch.nn as nn
import torch.nn.functional as F
from PIL import Image
from safetensors.torch import load_file, save_file

CONFIG = "config.json"
WEIGHTS = "model.safetensors"


@dataclass(frozen=True)
class VQConfig:
    image_size: int = 64
    channels: int = 16            # at full resolution; doubled at each level down
    levels: int = 2               # stride-2 steps: a grid of image_size / 2**levels cells a side
    codebook_size: int = 512
    code_dim: int = 8
    commitment: float = 0.25      # β

    @property
    def grid(self) -> int:
        return self.image_size >> self.levels


class _Residual(nn.Module):
    def __init__(self, channels: int):
        super().__init__()
        self.body = nn.Sequential(nn.GroupNorm(8, channels), nn.SiLU(), nn.Conv2d(channels, channels, 3, padding=1),
                                  nn.GroupNorm(8, channels), nn.SiLU(), nn.Conv2d(channels, channels, 3, padding=1))

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return x + self.body(x)


# Residual blocks run below full resolution only: at full resolution they would cost most of a
# step's arithmetic for pictures of flat shapes.


def _encoder(c: VQConfig) -> nn.Sequential:
    layers: list[nn.Module] = [nn.Conv2d(3, c.channels, 3, padding=1)]
    width = c.channels
    for _ in range(c.levels):
        layers += [nn.Conv2d(width, 2 * width, 4, stride=2, padding=1), _Residual(2 * width)]
        width *= 2
    layers += [nn.GroupNorm(8, width), nn.SiLU(), nn.Conv2d(width, c.code_dim, 1)]
    return nn.Sequential(*layers)


def _decoder(c: VQConfig) -> nn.Sequential:
    width = c.channels << c.levels
    layers: list[nn.Module] = [nn.Conv2d(c.code_dim, width, 3, padding=1)]
    for _ in range(c.levels):
        layers += [_Residual(width), nn.Upsample(scale_factor=2, mode="nearest"),
                   nn.Conv2d(width, width // 2, 3, padding=1)]
        width //= 2
    layers += [nn.GroupNorm(8, width), nn.SiLU(), nn.Conv2d(width, 3, 3, padding=1)]
    return nn.Sequential(*layers)


class VQTokenizer(nn.Module):
    def __init__(self, config: VQConfig = VQConfig()):
        super().__init__()
        self.config = config
        self.encoder = _encoder(config)
        self.decoder = _decoder(config)
        self.codebook = nn.Embedding(config.codebook_size, config.code_dim)
        nn.init.normal_(self.codebook.weight)

    # ---- the quantizer -----------------------------------------------------------------------

    def codes(self) -> torch.Tensor:
        """The codebook, each code of unit length."""
        return F.normalize(self.codebook.weight, dim=-1)

    def quantize(self, z: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
        """(codes straight-through [B, D, H, W], ids [B, H, W], codebook + commitment loss) of the
        encoder's output ``z`` [B, D, H, W]."""
        flat = F.normalize(z.permute(0, 2, 3, 1).reshape(-1, z.shape[1]), dim=-1)
        codes = self.codes()
        ids = (flat @ codes.T).argmax(dim=-1)    # nearest by cosine: both sides unit length
        chosen = codes[ids]
        loss = F.mse_loss(chosen, flat.detach()) + self.config.commitment * F.mse_loss(flat, chosen.detach())
        straight = flat + (chosen - flat).detach()
        b, _, h, w = z.shape
        return straight.reshape(b, h, w, -1).permute(0, 3, 1, 2), ids.reshape(b, h, w), loss

    # ---- pictures <-> ids --------------------------------------------------------------------

    def forward(self, pixels: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
        """(reconstruction, ids, quantizer loss) of ``pixels`` [B, 3, S, S] in [-1, 1]."""
        quantized, ids, loss = self.quantize(self.encoder(pixels))
        return self.decoder(quantized), ids, loss

    @torch.no_grad()
    def encode(self, pixels: torch.Tensor) -> torch.Tensor:
        """Codebook ids [B, grid, grid] of ``pixels`` [B, 3, S, S] in [-1, 1]."""
        return self.quantize(self.encoder(pixels))[1]

    @torch.no_grad()
    def decode(self, ids: torch.Tensor) -> torch.Tensor:
        """Pixels [B, 3, S, S] in [-1, 1] of codebook ids [B, grid, grid]."""
        if ids.min() < 0 or ids.max() >= self.config.codebook_size:
            raise ValueError(f"image token ids must be in 0..{self.config.codebook_size - 1}")
        return self.decoder(self.codes()[ids].permute(0, 3, 1, 2)).clamp(-1.0, 1.0)

    # ---- folders -----------------------------------------------------------------------------

    def save(self, folder: str | Path) -> Path:
        folder = Path(folder)
        folder.mkdir(parents=True, exist_ok=True)
        (folder / CONFIG).write_text(json.dumps({"model_type": "specserve_vq", **asdict(self.config)}, indent=2) + "\n")
        save_file({k: v.detach().contiguous() for k, v in self.state_dict().items()}, folder / WEIGHTS)
        return folder

    @classmethod
    def load(cls, folder: str | Path, device: str | torch.device = "cpu") -> "VQTokenizer":
        folder = Path(folder)
        fields = json.loads((folder / CONFIG).read_text())
        if fields.pop("model_type", None) != "specserve_vq":
            raise ValueError(f"{folder}: not a specserve VQ tokenizer (model_type specserve_vq)")
        model = cls(VQConfig(**fields))
        model.load_state_dict(load_file(folder / WEIGHTS, device=str(device)))
        return model.to(device).eval()


def to_pixels(images: list[Image.Image]) -> torch.Tensor:
    """RGB pictures as a batch [B, 3, S, S] in [-1, 1]."""
    array = np.stack([np.asarray(image.convert("RGB"), dtype=np.float32) for image in images])
    return torch.from_numpy(array).permute(0, 3, 1, 2) / 127.5 - 1.0


def to_images(pixels: torch.Tensor) -> list[Image.Image]:
    """A batch [B, 3, S, S] in [-1, 1] as RGB pictures."""
    array = ((pixels.clamp(-1, 1) + 1.0) * 127.5).round().to(torch.uint8).permute(0, 2, 3, 1).cpu().numpy()
    return [Image.fromarray(a) for a in array]
