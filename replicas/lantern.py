"""LANTERN's relaxed acceptance for image tokens (*LANTERN: Accelerating Visual Autoregressive
Models with Relaxed Speculative Decoding*; the ADT-Tree paper's "ADT-Tree + LANTERN" rows).
Lossy: a request asks for it (``spec.acceptance``), its response says so, and text never uses it.

Codes that lie close in the VQ codebook decode to nearly the same pixels, yet a visual AR model
spreads its probability over them, so the exact rule rejects drafts a picture would not miss.
LANTERN weighs a drafted code x against the target's mass on x and on its latent neighbours:

    B_k(x)   the k codes nearest x in the codebook (Euclidean over its unit-length codes)
    A(x)     the longest prefix of B_k(x) whose probability under p totals at most δ
    p̃(x)     p(x) + p(A(x))

Moving A(x)'s mass onto x moves p by at most δ in total variation, LANTERN's bound. The rules,
relaxed from ``rejection_sampler``'s:

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

from specserve.replicas.rejection_sampler import child_lists
from specserve.replicas.sampling import NonFiniteScores, SamplingParams, logits_to_probs, sample, uniform
from specserve.replicas.step import Proposal

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


def _relaxed(p: torch.Tensor, x: int, near: torch.Tensor, delta: float) -> tuple[float, torch.Tensor]:
    """(p̃(x), A(x)): near is x's neighbours, nearest first ([k]; empty for a token outside the
    codebook)."""
    if len(near) == 0:
        return float(p[x]), near
    near = near.long()
    mass = p[near].cumsum(0)
    kept = int(torch.searchsorted(mass, torch.tensor([delta], dtype=mass.dtype, device=mass.device),
                                  right=True).item())
    taken = near[:kept]
    return float(p[x]) + (float(mass[kept - 1]) if kept else 0.0), taken


def verify_relaxed(
    target_logits: torch.Tensor,
    proposal: Proposal,
    params: SamplingParams,
    generator: torch.Generator | None,
    neighbours: torch.Tensor,
    lantern: Lantern,
) -> tuple[list[int], int]:
    """``rejection_sampler.verify`` under LANTERN's relaxation: ``(accepted_path, bonus_token)``.
    neighbours: [K, ≥ k] (``latent_neighbours``), K the codebook's size (ids below K are codes)."""
    near = neighbours[:, :lantern.k]

    def of(x: int) -> torch.Tensor:
        return near[x] if 0 <= x < len(near) else near[:0, 0]

    if not bool(torch.isfinite(target_logits.float().amax(-1)).all()):
        raise NonFiniteScores("the target's logits are not finite")
    if params.greedy:
        return _greedy(target_logits, proposal, of, lantern.delta)
    if proposal.draft_probs is not None:
        return _sampled_chain(target_logits, proposal, params, generator, of, lantern.delta)
    return _point_masses(target_logits, proposal, params, generator, of, lantern.delta)


def _greedy(target_logits, proposal, of, delta) -> tuple[list[int], int]:
    children = child_lists(proposal)
    path: list[int] = []
    row = 0
    while True:
        p = target_logits[row].float().softmax(-1)
        top, first = (float(v) for v in p.max(-1))
        first = int(first)
        nxt = None
        for child in children[row]:   # x wins where it is the argmax, or its p̃(x) reaches the argmax's p
            x = proposal.tokens[child]
            if x == first or _relaxed(p, x, of(x), delta)[0] >= top:
                nxt = child
                break
        if nxt is None:
            return path, first
        path.append(nxt)
        row = nxt + 1


def _point_masses(target_logits, proposal, params, generator, of, delta) -> tuple[list[int], int]:
    children = child_lists(proposal)
    path: list[int] = []
    row = 0
    while True:
        p = logits_to_probs(target_logits[row], params)
        for child in children[row]:
            x = proposal.tokens[child]
            relaxed, taken = _relaxed(p, x, of(x), delta)
            if uniform(generator) < relaxed:
                path.append(child)
                row = child + 1
                break
            left = p.clone()
            left[x] = 0.0
            left[taken] = 0.0
            if float(left.sum()) > 0.0:   # nothing left only when x and A(x) held all of p
                p = left / left.sum()
        else:
            return path, sample(p, generator)


def _sampled_chain(target_logits, proposal, params, generator, of, delta) -> tuple[list[int], int]:
    q = proposal.draft_probs
    p = logits_to_probs(target_logits, params)          # [γ + 1, V]
    for i, x in enumerate(proposal.tokens):
        relaxed, _ = _relaxed(p[i], x, of(x), delta)
        if uniform(generator) * q[i, x].item() < relaxed:
            continue
        residual = torch.clamp(p[i] - q[i], min=0.0)
        total = residual.sum()
        return list(range(i)), sample(residual / total if total > 0 else p[i], generator)
    return list(range(len(proposal))), sample(p[len(proposal)], generator)
