"""Growing a draft token tree level by level, EAGLE-2 style, for any draft that scores nodes.

Every frontier node offers its top-k tokens, and the level keeps the k candidates with the
highest cumulative draft log-probability (so the tree reaches its depth instead of spending the
budget on one wide level), until the node budget is spent. Nodes are deterministic choices
(q = one-hot), which keeps tree sampling lossless.
"""

from __future__ import annotations

import math

import torch

from specserve.replicas.step import Proposal, TreeShape


class TreeGrowth:
    def __init__(self, shape: TreeShape):
        self.shape = shape
        self.tokens: list[int] = []
        self.parents: list[int] = []
        self.score: list[float] = []       # cumulative log q per node
        self.frontier: list[int] = [-1]    # -1: the root

    @property
    def room(self) -> int:
        return self.shape.budget - len(self.tokens)

    def grow(self, frontier_logits: torch.Tensor) -> int:
        """Add a level from the frontier's logits [F, V]; returns the index of its first node
        (the level's nodes, ``first..len(tokens)-1``, become the frontier)."""
        k = self.shape.top_k
        top = torch.log_softmax(frontier_logits.float(), -1).topk(k, dim=-1)
        base = torch.tensor([0.0 if f < 0 else self.score[f] for f in self.frontier])
        cand = (base[:, None] + top.values).flatten()
        first = len(self.tokens)
        for flat in cand.argsort(descending=True)[: min(self.room, k)].tolist():
            row, col = divmod(flat, k)
            self.tokens.append(int(top.indices[row, col]))
            self.parents.append(self.frontier[row])
            self.score.append(float(cand[flat]))
        self.frontier = list(range(first, len(self.tokens)))
        return first

    def more_levels(self, level: int) -> bool:
        """Whether the tree grows past ``level`` (0-based): the caller must score the frontier."""
        return level + 1 < self.shape.depth and self.room > 0

    def proposal(self) -> Proposal:
        # q(node | parent) = exp(score(node) - score(parent)): the draft's confidence per node.
        probs = [math.exp(s - (0.0 if p < 0 else self.score[p])) for s, p in zip(self.score, self.parents)]
        return Proposal(self.tokens, self.parents, token_probs=probs)
