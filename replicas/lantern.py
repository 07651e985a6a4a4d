"""LANTERN's relaxed acceptance for image tokens (*LANTERN: Accelerating Visual Autoregressive
Models with Relaxed Speculative Decoding*; the ADT-Tree paper's "ADT-Tree + LANTERN" rows).
Lossy: a request asks for it (``spec.acceptance``), its response says so, and text never uses it.

Codes that lie close in the VQ codebook decode to nearly the same pixels, yet a visual AR model
spreads its probability over them, so the exact rule rejects drafts a picture would not miss.
LANTERN weighs a drafted code x against the target's mass on x and on its latent neighbours:

    B_k(x)   the k codes nearest x in the codebook (Euclidean over its unit-length codes)
    A(x)     the longest prefix of B_k(x) whose probability under p totals at most δ
    p̃(x)     p(x) + p(A(x))

Moving A(x)'s mass onto x moves p by at most δ in total variation, LANTERN's bound.
``rejection_sampler`` runs its rules with this mass (``LatentRelaxation``):

* greedy: follow the first child x that is the argmax once its probability is p̃(x); the bonus
  token is the target's argmax (p is the softmax of the guided logits, as LANTERN's greedy test);
* point masses (trees, top-k drafts): accept x with probability p̃(x); on rejection x and A(x)
  leave p, which is renormalised for the next child; the bonus comes from what is left;
* a sampled chain: accept x with probability min(1, p̃(x) / q(x)); on rejection the bonus comes
  from norm(max(0, p − q)).

Relaxing p alone, with q as drafted, follows the ADT-Tree paper's released implementation;
LANTERN++'s static-tree variant (δ > 1, relative to p(x)) is not served.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch


# The ADT-Tree paper's LANTERN setting (its Figure 7): δ = 0.4, k = 1000 of Anole's 8,192 codes.
DEFAULT_DELTA = 0.4
CODEBOOK_SHARE = 8          # the default k: an eighth of the codebook, as 1000 of 8,192
MAX_K = 1024                # LANTERN's own k is 1000


@dataclass(frozen=True)
class Lantern:
    """A request's relaxation: the total probability ``delta`` moved onto a drafted code from
    its ``k`` nearest codes."""

    delta: float = DEFAULT_DELTA
    k: int = 64

    def __post_init__(self) -> None:
        if not 0.0 < self.delta < 1.0:
            raise ValueError(f"LANTERN's delta must be in (0, 1), got {self.delta}")
        if not 1 <= self.k <= MAX_K:
            raise ValueError(f"LANTERN's k must be in 1..{MAX_K}, got {self.k}")

    def summary(self) -> dict:
        return {"rule": "lantern", "delta": self.delta, "k": self.k}


def default_k(codebook_size: int) -> int:
    return max(1, min(MAX_K, codebook_size // CODEBOOK_SHARE))


class NoCodebook(ValueError):
    """A relaxed request reached a target that serves no image generator's codebook."""


@torch.no_grad()
def latent_neighbours(codes: torch.Tensor, k: int = MAX_K, chunk: int = 1024) -> torch.Tensor:
    """[K, min(k, K − 1)] int32 ids: each code's nearest other codes, nearest first. codes: [K, D].
    Rows a chunk at a time: a full distance matrix of a large codebook would not fit."""
    codes = codes.float()
    width = min(k, len(codes) - 1)
    out = torch.empty(len(codes), width, dtype=torch.int32, device=codes.device)
    for start in range(0, len(codes), chunk):
        distance = torch.cdist(codes[start:start + chunk], codes)
        rows = torch.arange(len(distance), device=codes.device)
        distance[rows, rows + start] = float("inf")
        out[start:start + chunk] = distance.topk(width, dim=-1, largest=False).indices.to(torch.int32)
    return out


class LatentRelaxation:
    """LANTERN's ``rejection_sampler.Relaxation`` for one request: ``mass(p, x)`` is ``(p̃(x), A(x))``.
    neighbours: [K, ≥ k] (``latent_neighbours``), K the codebook's size; a token outside the
    codebook has no neighbours."""

    def __init__(self, neighbours: torch.Tensor, lantern: Lantern):
        self.near = neighbours[:, :lantern.k]
        self.delta = lantern.delta

    def mass(self, p: torch.Tensor, x: int) -> tuple[float, torch.Tensor]:
        if not 0 <= x < len(self.near):
            return float(p[x]), self.near[:0, 0].long()
        near = self.near[x].long()
        cumulative = p[near].cumsum(0)
        kept = int(torch.searchsorted(cumulative, torch.tensor([self.delta], dtype=cumulative.dtype,
                                                                device=cumulative.device), right=True).item())
        return float(p[x]) + (float(cumulative[kept - 1]) if kept else 0.0), near[:kept]
