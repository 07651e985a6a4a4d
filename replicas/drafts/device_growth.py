"""EAGLE-2's tree growth (``tree_growth.TreeGrowth`` without SAGE's fields) on the draft's device.

Why: a tree drafted through graphs (``head_graphs``) would otherwise stop at every level. The
level's choice ran on the host, so the device idled while the host read the level's top-k, picked
its nodes and built the next level's inputs, and the host idled while the device drafted. Under
EAGLE-2's rule a level keeps exactly ``min(room, top_k)`` nodes, so every level's size follows
from the shape alone: a level's choice is a few tensor operations on the device (each frontier
node's top-k, then the level's best by cumulative log-probability), the next level's inputs are
written from them where they are, and the host reads the tree once, at the end.

The nodes, their order and their scores are ``TreeGrowth``'s: the same float32 sums, ranked the
same way (only exactly equal scores may come out in another order). SAGE's width decay and
threshold make a level's size depend on the draft's probabilities; those trees grow on the host.
"""

from __future__ import annotations

import math

import torch

from specserve.replicas.drafts.tree_growth import ROOT_TOP_PROBS
from specserve.replicas.step import Proposal, TreeShape


def level_sizes(shape: TreeShape) -> list[int]:
    """Nodes per level under EAGLE-2's rule; every level but the last is fed to the draft."""
    sizes, room = [], shape.budget
    for _ in range(shape.depth):
        size = min(room, shape.top_k)
        if size == 0:
            break
        sizes.append(size)
        room -= size
    return sizes


class DeviceGrowth:
    """One tree, grown a level per ``grow`` call, in tensors on ``device``."""

    def __init__(self, shape: TreeShape, device: torch.device):
        if not self.grows(shape):
            raise ValueError(f"{shape}: SAGE's width decay and threshold grow a tree on the host (TreeGrowth)")
        self.shape = shape
        self.sizes = level_sizes(shape)
        self.firsts = [sum(self.sizes[:level]) for level in range(len(self.sizes))]
        self.level = 0   # levels grown so far
        nodes = shape.budget
        self.tokens = torch.zeros(nodes, dtype=torch.long, device=device)
        self.parents = torch.full((nodes,), -1, dtype=torch.long, device=device)
        self.score = torch.zeros(nodes, dtype=torch.float32, device=device)   # cumulative log q per node
        # [i, j]: node j is node i or one of its ancestors. Twice the budget: a fed level padded to
        # a power of two has its padding rows after its nodes, each seeing itself only. Two more
        # columns, the same in every row: ``never`` false, ``always`` true, so that a row's mask
        # over other keys too is one gather from ``marks`` (``head_graphs``).
        self.never, self.always = 2 * nodes, 2 * nodes + 1
        self.marks = torch.zeros(2 * nodes, 2 * nodes + 2, dtype=torch.bool, device=device)
        self.marks[:, :2 * nodes] = torch.eye(2 * nodes, dtype=torch.bool, device=device)
        self.marks[:, self.always] = True
        self.lineage = self.marks[:, :2 * nodes]
        self.root_probs: torch.Tensor | None = None

    @staticmethod
    def grows(shape: TreeShape) -> bool:
        """Whether the tree's levels have sizes known in advance (EAGLE-2's rule)."""
        return not shape.width_decay and shape.threshold <= 0

    @property
    def more_levels(self) -> bool:
        """Whether another level follows the last grown: the caller must feed it and score its rows."""
        return self.level < len(self.sizes)

    def grow(self, frontier_logits: torch.Tensor) -> tuple[int, int]:
        """Add the next level from the frontier's logits [F, V] (the root's row, then the last
        level's nodes); returns the level's first node and its size."""
        level, k = self.level, self.shape.top_k
        first, size = self.firsts[level], self.sizes[level]
        logp = torch.log_softmax(frontier_logits, -1, dtype=torch.float32)   # [F, V], cast inside
        if level == 0:
            self.root_probs = logp[0].topk(min(ROOT_TOP_PROBS, logp.shape[-1])).values.exp()
            parent_scores = logp.new_zeros(1)
        else:
            parent_scores = self.score[self.firsts[level - 1]:first]
        top = logp.topk(k, dim=-1)
        kept = (parent_scores[:, None] + top.values).flatten().topk(size)    # the level's best, best first
        self.tokens[first:first + size] = top.indices.flatten()[kept.indices]
        self.score[first:first + size] = kept.values
        if level > 0:
            parents = self.firsts[level - 1] + kept.indices // k
            self.parents[first:first + size] = parents
            self.marks[first:first + size] = self.marks[parents]
            self.lineage[first:first + size, first:first + size].fill_diagonal_(True)
        self.level += 1
        return first, size

    def restart(self) -> None:
        """Grow the next tree in the same tensors: every level's rows are written again, and the
        lineage of a node depends on its parent's row only."""
        self.level = 0

    def packed(self) -> torch.Tensor:
        """The tree grown so far as one float64 tensor (tokens, parents, scores, root
        probabilities), made on the device, so that reading it waits for the device once."""
        nodes = sum(self.sizes[:self.level])
        parts = [self.tokens[:nodes], self.parents[:nodes], self.score[:nodes]]
        if self.root_probs is not None:
            parts.append(self.root_probs)
        return torch.cat([part.double() for part in parts])

    def proposal(self, packed: torch.Tensor | None = None) -> Proposal:
        """The tree read to the host at once, from ``packed`` (``packed()``'s tensor) or now."""
        values = (self.packed() if packed is None else packed).tolist()
        nodes = sum(self.sizes[:self.level])
        tokens = [int(t) for t in values[:nodes]]
        parents = [int(p) for p in values[nodes:2 * nodes]]
        score = values[2 * nodes:3 * nodes]
        # q(node | parent) = exp(score(node) - score(parent)), as TreeGrowth reports it.
        probs = [math.exp(s - (0.0 if p < 0 else score[p])) for s, p in zip(score, parents)]
        root_probs = values[3 * nodes:] if self.root_probs is not None else None
        return Proposal(tokens, parents, token_probs=probs, root_probs=root_probs)
