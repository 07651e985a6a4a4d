"""The target side of a step: score a proposal in one forward pass and keep what it accepts."""

from __future__ import annotations

import torch

from specserve.replicas.kv_session import KVSession
from specserve.replicas.rejection_sampler import verify
from specserve.replicas.sampling import SamplingParams
from specserve.replicas.step import Proposal, StepResult


class Target:
    def __init__(self, model):
        self.session = KVSession(model)

    def verify(
        self,
        context: list[int],
        proposal: Proposal,
        params: SamplingParams,
        generator: torch.Generator | None,
    ) -> StepResult:
        """One forward over [uncached context tail] + proposal; ``context[-1]`` is the root.

        The cache afterwards holds ``context`` + the accepted tokens (not the bonus token, which
        becomes the next step's root).
        """
        missing = self.session.sync(context[:-1]) + context[-1:]
        base = len(context)  # cache positions 0..base-1 hold the context once the forward is done
        rows = len(proposal) + 1
        if proposal.is_chain:
            logits = self.session.extend(missing + proposal.tokens, logits_rows=rows)
        else:
            # The uncached tail is a chain of tree nodes ending in the root; proposal nodes hang
            # below the root (parent -1 -> the root's index).
            tail = len(missing)
            parents = list(range(-1, tail - 1)) + [
                tail - 1 if p < 0 else tail + p for p in proposal.parents
            ]
            logits = self.session.extend_tree(missing + proposal.tokens, parents)[tail - 1 :]
        path, bonus = verify(logits, proposal, params, generator)
        accepted = [proposal.tokens[i] for i in path]
        if proposal.is_chain:
            self.session.crop(base + len(path))
        else:
            keep = list(range(base)) + [base + i for i in path]
            self.session.keep(keep, context + accepted)
        depths = proposal.depths()
        return StepResult(
            proposed=len(proposal),
            accepted=len(path),
            accepted_path=path,
            emitted_tokens=accepted + [bonus],
            max_depth=max(depths, default=0),
        )
