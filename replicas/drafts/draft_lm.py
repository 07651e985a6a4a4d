"""A small causal LM that shares the target's tokenizer, drafting with its own KV cache."""

from __future__ import annotations

import torch

from specserve.replicas.kv_session import KVSession
from specserve.replicas.sampling import SamplingParams, logits_to_probs, sample
from specserve.replicas.step import Proposal, TreeShape


class DraftLM:
    def __init__(self, name: str, model):
        self.name = name
        self.session = KVSession(model)

    def _root_logits(self, context: list[int]) -> torch.Tensor:
        """Logits after the last context token, feeding only what the cache lacks. returns [V]"""
        missing = self.session.sync(context)
        if not missing:   # all cached, but the root's logits were not kept: recompute that one
            self.session.crop(len(context) - 1)
            missing = context[-1:]
        return self.session.extend(missing, logits_rows=1)[-1]

    def propose(
        self,
        context: list[int],
        window: int,
        params: SamplingParams,
        generator: torch.Generator | None,
    ) -> Proposal:
        if window <= 0:
            return Proposal.empty()
        logits = self._root_logits(context)
        tokens: list[int] = []
        probs: list[torch.Tensor] = []
        for i in range(window):
            if params.greedy:
                tok = int(logits.argmax())
            else:
                q = logits_to_probs(logits, params)
                tok = sample(q, generator)
                probs.append(q)
            tokens.append(tok)
            if i + 1 < window:
                logits = self.session.extend([tok], logits_rows=1)[-1]
        # Greedy proposals are deterministic (q = one-hot), so they carry no draft_probs.
        return Proposal.chain(tokens, torch.stack(probs) if probs else None)

    def propose_tree(self, context: list[int], shape: TreeShape) -> Proposal:
        """EAGLE-2-style expansion, level by level: every frontier node offers its top-k tokens
        and the level keeps the k candidates with the highest cumulative draft log-probability
        (so the tree can reach its depth instead of spending the budget on one wide level),
        until the node budget is spent. Nodes are deterministic choices (q = one-hot), which
        keeps tree sampling lossless."""
        frontier_logits = self._root_logits(context)[None]            # [F, V]
        frontier: list[int] = [-1]
        tokens: list[int] = []
        parents: list[int] = []
        score: list[float] = []                                       # cumulative log q
        for level in range(shape.depth):
            room = shape.budget - len(tokens)
            if room <= 0:
                break
            top = torch.log_softmax(frontier_logits.float(), -1).topk(shape.top_k, dim=-1)
            base = torch.tensor([0.0 if f < 0 else score[f] for f in frontier])
            cand = (base[:, None] + top.values).flatten()
            order = cand.argsort(descending=True)[: min(room, shape.top_k)].tolist()
            first_new = len(tokens)
            for flat in order:
                row, col = divmod(flat, shape.top_k)
                tokens.append(int(top.indices[row, col]))
                parents.append(frontier[row])
                score.append(float(cand[flat]))
            frontier = list(range(first_new, len(tokens)))
            if level + 1 < shape.depth and len(tokens) < shape.budget:
                frontier_logits = self.session.extend_tree(tokens, parents, first_fed=first_new)
        self.session.crop(len(context))   # tree nodes are not part of the committed sequence
        return Proposal(tokens, parents)
