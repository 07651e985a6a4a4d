"""Sampling parameters and the logits -> probabilities warp shared by target and draft.

Losslessness needs the *same* warp on ``p`` and ``q`` before the rejection test (docs/design.md §4):
the target distribution we must reproduce is the warped one, not the raw softmax.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch


@dataclass(frozen=True)
class SamplingParams:
    """``temperature == 0`` means greedy; ``top_k == 0`` and ``top_p == 1`` disable those filters."""

    temperature: float = 0.0
    top_p: float = 1.0
    top_k: int = 0
    seed: int | None = None

    def __post_init__(self) -> None:
        if not (self.temperature >= 0.0):
            raise ValueError(f"temperature must be >= 0, got {self.temperature}")
        if not (0.0 < self.top_p <= 1.0):
            raise ValueError(f"top_p must be in (0, 1], got {self.top_p}")
        if self.top_k < 0:
            raise ValueError(f"top_k must be >= 0 (0 disables it), got {self.top_k}")

    @property
    def greedy(self) -> bool:
        return self.temperature == 0.0

    def generator(self, device: torch.device | str = "cpu") -> torch.Generator:
        gen = torch.Generator(device=device)
        if self.seed is None:
            gen.seed()
        else:
            gen.manual_seed(self.seed)
        return gen


def logits_to_probs(logits: torch.Tensor, params: SamplingParams) -> torch.Tensor:
    """Warped next-token probabilities, float32. logits: [..., V] -> probs: [..., V].

    Greedy becomes a one-hot on the argmax, so the rejection rule ``min(1, p/q)`` reduces to
    exact-match verification and one code path serves both modes.
    """
    logits = logits.float()
    if params.greedy:
        return torch.nn.functional.one_hot(logits.argmax(-1), logits.shape[-1]).float()
    logits = logits / params.temperature
    if params.top_k and params.top_k < logits.shape[-1]:
        kth = torch.topk(logits, params.top_k, dim=-1).values[..., -1:]
        logits = logits.masked_fill(logits < kth, float("-inf"))
    if params.top_p < 1.0:
        sorted_logits, order = torch.sort(logits, dim=-1, descending=True)
        sorted_probs = sorted_logits.softmax(-1)
        # Drop a token when the mass strictly before it already reaches top_p; the first token
        # always survives.
        drop_sorted = sorted_probs.cumsum(-1) - sorted_probs >= params.top_p
        drop = drop_sorted.scatter(-1, order, drop_sorted)
        logits = logits.masked_fill(drop, float("-inf"))
    return logits.softmax(-1)


def uniform(generator: torch.Generator | None) -> float:
    """One draw from U[0, 1), made on the generator's own device (a CUDA generator cannot fill a CPU
    tensor, and a CPU one cannot fill a CUDA tensor)."""
    return torch.rand((), generator=generator, device=None if generator is None else generator.device).item()


def sample(probs: torch.Tensor, generator: torch.Generator | None) -> int:
    """One token id from a 1-D probability vector."""
    return int(torch.multinomial(probs, 1, generator=generator).item())
