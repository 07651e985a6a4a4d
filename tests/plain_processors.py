"""vLLM's logits processors written plainly, one prefix at a time: the reference the batched rows
(``replicas/logits_processors.py``) and speculative decoding with them are checked against."""

from __future__ import annotations

import torch

from specserve.replicas.sampling import SamplingParams, logits_to_probs


def plain_logits(logits: torch.Tensor, prompt: list[int], output: list[int], params: SamplingParams,
                 stop_ids: frozenset[int]) -> torch.Tensor:
    """[V] logits after the request's processors, for the token after ``prompt + output``."""
    out = logits.float().clone()
    if params.allowed_token_ids is not None:
        keep = torch.full_like(out, float("-inf"))
        for t in params.allowed_token_ids:
            keep[t] = 0.0
        out += keep
    for t, bias in params.logit_bias:
        out[t] += bias
    if len(output) < params.min_tokens:
        for t in stop_ids:
            out[t] = float("-inf")
    r = params.repetition_penalty
    for t in set(prompt) | set(output):
        out[t] = out[t] / r if out[t] > 0 else out[t] * r
    for t in set(output):
        out[t] -= params.frequency_penalty * output.count(t) + params.presence_penalty
    return out


def plain_decode(model, prompt: list[int], max_tokens: int, params: SamplingParams,
                 eos_token_ids: frozenset[int] = frozenset()) -> list[int]:
    """Greedy decoding with processors, the whole prefix through the model for every token."""
    stop_ids = params.stop_ids(eos_token_ids)
    output: list[int] = []
    with torch.inference_mode():
        while len(output) < max_tokens:
            logits = model(torch.tensor([prompt + output], device=model.device)).logits[0, -1]
            token = int(plain_logits(logits, prompt, output, params, stop_ids).argmax())
            output.append(token)
            if token in stop_ids:
                break
    return output


def plain_probs(logits: torch.Tensor, prompt: list[int], output: list[int], params: SamplingParams,
                stop_ids: frozenset[int] = frozenset()) -> torch.Tensor:
    """[V]: the distribution a sampled request draws its next token from."""
    return logits_to_probs(plain_logits(logits, prompt, output, params, stop_ids), params)
