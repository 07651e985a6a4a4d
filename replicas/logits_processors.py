"""A request's logits processors on the rows the target scored in one step.

The processors turn the target's logits into the distribution p' that plain decoding with them
samples; verification then accepts and rejects against p' (docs/design.md §10), so speculative
output stays exactly what plain decoding with the same processors gives. Those that read the
tokens so far (penalties, ``min_tokens``) see, for each row, the prefix that row would have: row
0 follows the root (the prompt and the output so far), row ``i + 1`` follows proposal node ``i``
(that prefix, then the node's ancestors and the node itself).

Penalties touch only the tokens some row's prefix holds: those columns are gathered, penalised
and scattered back, so a step costs O(rows × tokens seen), not O(rows × vocabulary). Written
here rather than taken from transformers' processors because those score one prefix per row of
a batch of equal-length histories, where a chain's rows each extend the last by one token; the
tests check these rows against transformers' ``RepetitionPenaltyLogitsProcessor`` and against a
plain decoder.
"""

from __future__ import annotations

import torch

from specserve.replicas.model.transfer import sent
from specserve.replicas.sampling import NonFiniteScores, SamplingParams
from specserve.replicas.step import Proposal


NO_TOKEN_LEFT = ("the request's logits processors leave no token to choose "
                 "(allowed_token_ids, min_tokens and the stop tokens exclude every one)")


def choosable(rows: torch.Tensor) -> torch.Tensor:
    """Whether every row of processed logits keeps some token: a 0-d bool tensor, unread."""
    return (rows.amax(-1) > float("-inf")).all()


def row_prefixes(proposal: Proposal) -> list[list[int]]:
    """For each scored row, the proposal tokens between the root and the token that row predicts:
    ``[]`` for row 0, the path to node ``i`` (inclusive) for row ``i + 1``."""
    paths: list[list[int]] = [[]]
    for node, parent in enumerate(proposal.parents):
        paths.append(paths[parent + 1] + [proposal.tokens[node]])
    return paths


class RowProcessors:
    """One request's processors (``SamplingParams.processed``), kept for its whole life: the
    per-request constants (the bias row, the allowed mask, the prompt's tokens) are built once,
    on the device of the first rows they see."""

    def __init__(self, params: SamplingParams, prompt_len: int, stop_ids: frozenset[int]):
        self.params = params
        self.prompt_len = prompt_len
        self.stop_ids = sorted(stop_ids)
        self._bias: torch.Tensor | None = None       # [V] float32
        self._blocked: torch.Tensor | None = None    # [V] bool: outside allowed_token_ids
        self._built = False

    def _constants(self, vocab: int, device: torch.device) -> None:
        if self._built:
            return
        self._built = True
        # Made on the host and sent without waiting for the device (``transfer.sent``).
        p = self.params
        if p.logit_bias:
            bias = torch.zeros(vocab, dtype=torch.float32)
            ids = torch.tensor([t for t, _ in p.logit_bias], dtype=torch.long)
            bias.index_put_((ids,), torch.tensor([b for _, b in p.logit_bias], dtype=torch.float32), accumulate=True)
            self._bias = sent(bias, device)
        if p.allowed_token_ids is not None:
            blocked = torch.ones(vocab, dtype=torch.bool)
            blocked[torch.tensor(p.allowed_token_ids, dtype=torch.long)] = False
            self._blocked = sent(blocked, device)

    def apply(self, rows: torch.Tensor, context: list[int], proposal: Proposal, check: bool = True) -> torch.Tensor:
        """rows: [len(proposal) + 1, V] -> float32 rows of p' logits. ``context`` ends with the
        root. ``NonFiniteScores`` when the processors leave a row no token at all; with ``check``
        off the caller reads ``choosable`` itself (several requests' at once)."""
        p = self.params
        rows = rows.float().clone()
        vocab = rows.shape[-1]
        self._constants(vocab, rows.device)
        if self._blocked is not None:
            rows.masked_fill_(self._blocked, float("-inf"))
        if self._bias is not None:
            rows += self._bias
        prefixes = row_prefixes(proposal) if (p.min_tokens or p.penalized) else None
        if p.min_tokens and self.stop_ids:
            emitted = len(context) - self.prompt_len
            held = [r for r, path in enumerate(prefixes) if emitted + len(path) < p.min_tokens]
            if held:
                rows[sent(held, rows.device, torch.long)[:, None],
                     sent(self.stop_ids, rows.device, torch.long)[None, :]] = float("-inf")
        if p.penalized:
            self._penalize(rows, context, prefixes)
        if check and not bool(choosable(rows)):
            raise NonFiniteScores(NO_TOKEN_LEFT)
        return rows

    def _penalize(self, rows: torch.Tensor, context: list[int], prefixes: list[list[int]]) -> None:
        """vLLM's penalties in place: the repetition penalty divides positive logits (multiplies
        negative ones) of every token in the prompt or the output; then the frequency penalty
        times each token's count in the output, and the presence penalty once per output token,
        are subtracted."""
        p = self.params
        output = context[self.prompt_len:]
        drafted = [t for path in prefixes for t in path]
        prompt = context[:self.prompt_len] if p.repetition_penalty != 1.0 else []
        # The counts are made on the host and sent once: indices sent one by one would each be a
        # copy to the device.
        columns = torch.tensor(sorted(set(output) | set(drafted) | set(prompt)), dtype=torch.long)
        if not len(columns):
            return
        n = len(prefixes)
        counts = torch.zeros(n, len(columns), dtype=torch.float32)
        if output:
            counts += torch.bincount(torch.searchsorted(columns, torch.tensor(output, dtype=torch.long)),
                                     minlength=len(columns)).float()
        if drafted:
            row_of = torch.tensor([r for r, path in enumerate(prefixes) for _ in path])
            at = torch.searchsorted(columns, torch.tensor(drafted, dtype=torch.long))
            counts.index_put_((row_of, at), torch.ones(len(drafted)), accumulate=True)
        index = sent(columns, rows.device)
        picked = rows[:, index]   # [n, C]
        if p.repetition_penalty != 1.0:
            seen = counts > 0
            if prompt:
                seen[:, torch.searchsorted(columns, torch.tensor(prompt, dtype=torch.long))] = True
            seen = sent(seen, rows.device)
            scaled = torch.where(picked > 0, picked / p.repetition_penalty, picked * p.repetition_penalty)
            picked = torch.where(seen, scaled, picked)
        counts = sent(counts, rows.device)
        picked = picked - p.frequency_penalty * counts - p.presence_penalty * (counts > 0).float()
        rows[:, index] = picked
