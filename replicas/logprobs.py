"""Log-probabilities a request asks for (the API's ``logprobs``, ``top_logprobs`` and ``echo``),
read off rows the target computed anyway: a verify's rows for the emitted tokens, a prefill's for
the prompt's. They are the raw model's (log-softmax of the logits, before the request's
processors and temperature), as vLLM's default ``logprobs_mode`` gives them."""

from __future__ import annotations

import torch

from specserve.replicas.model.transfer import sent
from specserve.replicas.step import TokenLogprob

MAX_TOP_LOGPROBS = 20   # OpenAI's bound on top_logprobs


def token_logprobs(rows: torch.Tensor, tokens: list[int], top: int) -> list[TokenLogprob]:
    """rows: [len(tokens), V] logits, row i the one that predicted ``tokens[i]``; ``top``
    alternatives per token (0: the token's own only)."""
    return read_logprobs([packed_logprobs(rows, tokens, top)])[0]


def packed_logprobs(rows: torch.Tensor, tokens: list[int], top: int) -> torch.Tensor:
    """``token_logprobs``' values, unread: [len(tokens), 1 + 2k] float64 on the rows' device, each
    token's log-probability, then its k alternatives' log-probabilities and ids (exact in float64)."""
    k = min(top, rows.shape[-1])
    if not tokens:
        return torch.empty(0, 1 + 2 * k, dtype=torch.float64, device=rows.device)
    logp = torch.log_softmax(rows.float(), -1)
    parts = [logp.gather(-1, sent(tokens, logp.device, torch.long)[:, None])]
    if k:
        values, ids = logp.topk(k, -1)
        parts += [values, ids]
    return torch.cat([part.double() for part in parts], -1)


def read_logprobs(packed: list[torch.Tensor]) -> list[list[TokenLogprob]]:
    """Several requests' ``packed_logprobs`` read from the device at once."""
    if not packed:
        return []
    flat = torch.cat([p.flatten() for p in packed]).tolist()
    out, at = [], 0
    for p in packed:
        width = p.shape[1]
        k = (width - 1) // 2
        rows = [flat[at + i * width:at + (i + 1) * width] for i in range(p.shape[0])]
        at += p.numel()
        out.append([TokenLogprob(row[0], tuple(zip(map(int, row[1 + k:]), row[1:1 + k]))) if k else TokenLogprob(row[0])
                    for row in rows])
    return out


def joined(first: list | None, later: list | None) -> list | None:
    """Two consecutive pieces' log-probabilities as one list (None when neither piece has any)."""
    return None if first is None and later is None else (first or []) + (later or [])
