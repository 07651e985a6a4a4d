"""Growing a draft token tree level by level, EAGLE-2 style, for any draft that scores nodes.

Every frontier node offers its top-k tokens, and the level keeps the k candidates with the
highest cumulative draft log-probability (so the tree reaches its depth instead of spending the
budget on one wide level), until the node budget is spent. Nodes are deterministic choices
(q = one-hot), which keeps tree sampling lossless.

A ``TreeShape`` with SAGE's fields ("SAGE: Accelerating Vision-Language Models via Entropy-Guided
Adaptive Speculative Decoding", §3.2, "Hierarchical Width Decay" and "Dynamic Tree Construction")
grows differently: a node at level ``l >= 2`` offers
``W_l = top_k · (1/l) · (0.5 + P_parent)`` tokens (Eq. 12), the level keeps all of them (only the
budget bounds it), and a node whose path probability is not above ``θ_l = threshold · l / depth``
is dropped. The paper expands recursively; here a level is one forward, so the tree grows
breadth first and, when the budget runs out inside a level, that level's most probable
candidates are the ones kept. A fractional ``W_l`` is rounded to the nearest count, at least 1:
the paper does not say, and truncation would stop a confident tree (W = W_min = 2) at level 3,
against its "deeper-narrower" intent.

The tree also records the root's top probabilities (``ROOT_TOP_PROBS`` of them), from which SAGE
computes the draft's entropy (Eq. 7-9) for the next step.
"""

from __future__ import annotations

import math

import torch

from specserve.replicas.step import Proposal, TreeShape

# Root probabilities a tree proposal reports: enough for SAGE's top-k entropy (k = 10 in the paper).
ROOT_TOP_PROBS = 16


def decayed_width(top_k: int, level: int, parent_prob: float) -> int:
    """SAGE's children of one node at ``level`` (Eq. 12): all ``top_k`` at level 1, then
    ``top_k · (1/level) · (0.5 + parent_prob)`` rounded to the nearest count, at least 1."""
    if level <= 1:
        return top_k
    return max(1, min(top_k, math.floor(top_k / level * (0.5 + parent_prob) + 0.5)))


class TreeGrowth:
    """One tree, grown a level per ``grow`` call from the draft's logits for the frontier.

    Example, EAGLE-2 rule, ``TreeShape(depth=3, top_k=2, budget=5)``, 4 tokens; each frontier
    row is written as its softmax, each candidate as parent:token (path probability = exp of
    its cumulative score)::

        level 1  root -> [.6, .3, .05, .05]
                 candidates root:0 (.6), root:1 (.3)           keep both: n0 = 0, n1 = 1
        level 2  n0 -> [.05, .05, .5, .4]   n1 -> [.9, .05, .03, .02]
                 candidates n0:2 (.30), n1:0 (.27), n0:3 (.24), n1:1 (.015)
                 keep the k = 2 best: n2 = 2 under n0, n3 = 0 under n1; n0:3 is dropped
                 although n0 is the likelier parent
        level 3  n2 -> [.7, .2, .05, .05]   n3 -> [.05, .9, .03, .02]
                 candidates n3:1 (.243), n2:0 (.21), n2:1 (.06), n3:0 (.0135)
                 the budget has room for one: n4 = 1 under n3

        proposal: tokens [0, 1, 2, 0, 1], parents [-1, -1, 0, 1, 3]
    """

    def __init__(self, shape: TreeShape):
        self.shape = shape
        self.tokens: list[int] = []
        self.parents: list[int] = []
        self.score: list[float] = []       # cumulative log q per node
        self.frontier: list[int] = [-1]    # -1: the root
        self.level = 0                     # levels grown so far
        self.root_probs: list[float] | None = None
        self._lineage = torch.zeros(0, 0, dtype=torch.bool)   # [i, j]: node j is node i or its ancestor
        self._lineage_rows = 0                                 # nodes whose row is filled

    @property
    def room(self) -> int:
        return self.shape.budget - len(self.tokens)

    def grow(self, frontier_logits: torch.Tensor) -> int:
        """Add a level from the frontier's logits [F, V]; returns the index of its first node
        (the level's nodes, ``first..len(tokens)-1``, become the frontier; it is empty when every
        candidate was pruned)."""
        shape = self.shape
        self.level += 1
        logp = torch.log_softmax(frontier_logits.float(), -1)               # [F, V]
        if self.level == 1:
            self.root_probs = logp[0].topk(min(ROOT_TOP_PROBS, logp.shape[-1])).values.exp().tolist()
        parent_scores = [0.0 if f < 0 else self.score[f] for f in self.frontier]
        if shape.width_decay:
            widths = [decayed_width(shape.top_k, self.level, math.exp(s)) for s in parent_scores]
        else:
            widths = [shape.top_k] * len(self.frontier)
        k = max(widths)
        # The level's choice runs on the host: two [F, k] copies per level instead of a device sync
        # per node.
        top = logp.topk(k, dim=-1)
        values, indices = top.values.cpu(), top.indices.cpu()                 # [F, k]
        cand = (torch.tensor(parent_scores)[:, None] + values).flatten()      # [F * k]
        allowed = (torch.arange(k)[None, :] < torch.tensor(widths)[:, None]).flatten()   # [F * k]
        if shape.threshold > 0:   # θ_l on the path probability, in log space
            allowed &= cand > math.log(shape.threshold * self.level / shape.depth)
        # EAGLE-2 keeps the level's k best; SAGE keeps every node its width and θ allow.
        limit = self.room if shape.width_decay else min(self.room, k)
        ranked = cand.argsort(descending=True)
        order = ranked[allowed[ranked]][:limit]
        first = len(self.tokens)
        self.tokens += indices.flatten()[order].tolist()
        self.parents += [self.frontier[flat // k] for flat in order.tolist()]
        self.score += cand[order].tolist()
        self.frontier = list(range(first, len(self.tokens)))
        return first

    def sees(self, first: int) -> torch.Tensor:
        """[N - first, N] bool on the host (N nodes so far): row r marks node ``first + r`` and its
        ancestors, the tree nodes that node attends to when fed. Filled a level at a time, a few
        tensor operations each, whatever the level's width."""
        n = len(self.tokens)
        if self._lineage.shape[0] < n:
            size, old = max(n, 2 * self._lineage.shape[0]), self._lineage.shape[0]
            grown = torch.zeros(size, size, dtype=torch.bool)
            grown[:old, :old] = self._lineage
            self._lineage = grown
        while self._lineage_rows < n:   # the rows whose parents' rows are filled, at once
            start = self._lineage_rows
            parents = torch.tensor(self.parents[start:n])
            inside = (parents >= start).nonzero()
            end = n if len(inside) == 0 else start + int(inside[0])
            rows, parents = torch.arange(start, end), parents[:end - start]
            below = parents >= 0
            self._lineage[rows[below]] = self._lineage[parents[below]]
            self._lineage[rows, rows] = True
            self._lineage_rows = end
        return self._lineage[first:n, :n]

    @property
    def growing(self) -> bool:
        """Whether another level may be added: budget left and a frontier to expand."""
        return self.room > 0 and bool(self.frontier)

    def more_levels(self, level: int) -> bool:
        """Whether the tree grows past ``level`` (0-based): the caller must score the frontier."""
        return level + 1 < self.shape.depth and self.growing

    def proposal(self) -> Proposal:
        # q(node | parent) = exp(score(node) - score(parent)): the draft's confidence per node.
        probs = [math.exp(s - (0.0 if p < 0 else self.score[p])) for s, p in zip(self.score, self.parents)]
        return Proposal(self.tokens, self.parents, token_probs=probs, root_probs=self.root_probs)
