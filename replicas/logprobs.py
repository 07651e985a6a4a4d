"""Log-probabilities a request asks for (the API's ``logprobs``, ``top_logprobs`` and ``echo``),
read off rows the target computed anyway: a verify's rows for the emitted tokens, a prefill's for
the prompt's. They are the raw model's (log-softmax of the logits, before the request's
processors and temperature), as vLLM's default ``logprobs_mode`` gives them."""

from __future__ import annotations

import torch

from specserve.replicas.step import TokenLogprob

MAX_TOP_LOGPROBS = 20   # OpenAI's bound on top_logprobs


def token_logprobs(rows: torch.Tensor, tokens: list[int], top: int) -> list[TokenLogprob]:
    """rows: [len(tokens), V] logits, row i the one that predicted ``tokens[i]``; ``top``
    alternatives per token (0: the token's own only)."""
    if not tokens:
        return []
    logp = torch.log_softmax(rows.float(), -1)
    chosen = logp[torch.arange(len(tokens), device=logp.device),
                  torch.tensor(tokens, dtype=torch.long, device=logp.device)].tolist()
    if not top:
        return [TokenLogprob(lp) for lp in chosen]
    values, ids = logp.topk(min(top, logp.shape[-1]), -1)
    return [TokenLogprob(lp, tuple(zip(i, v))) for lp, i, v in zip(chosen, ids.tolist(), values.tolist())]


def joined(first: list | None, later: list | None) -> list | None:
    """Two consecutive pieces' log-probabilities as one list (None when neither piece has any)."""
    return None if first is None and later is None else (first or []) + (later or [])

