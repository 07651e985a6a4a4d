"""The ``logprobs`` objects of OpenAI's responses, from the target's per-token log-probabilities.

Chat: ``{"content": [{"token", "logprob", "bytes", "top_logprobs": [{"token", "logprob", "bytes"}]}]}``.
Completions (the legacy shape lm-evaluation-harness reads): ``{"tokens", "token_logprobs",
"top_logprobs": [{token: logprob}], "text_offset"}``, the prompt's tokens first when echoed (the
first of them has no log-probability: null). A token is written as its own decoded text.
"""

from __future__ import annotations

import functools

from specserve.replicas.step import TokenLogprob


class LogprobFields:
    def __init__(self, tokenizer):
        self.tokenizer = tokenizer

    @functools.lru_cache(maxsize=65536)
    def token(self, token_id: int) -> str:
        return self.tokenizer.decode([token_id])

    def chat(self, token_ids: list[int], logprobs: list[TokenLogprob]) -> dict:
        def entry(token_id: int, logprob: float) -> dict:
            text = self.token(token_id)
            return {"token": text, "logprob": logprob, "bytes": list(text.encode("utf-8"))}

        return {"content": [{**entry(t, lp.logprob), "top_logprobs": [entry(i, v) for i, v in lp.top]}
                            for t, lp in zip(token_ids, logprobs)]}

    def completion(self, token_ids: list[int], logprobs: list[TokenLogprob | None], offset: int = 0) -> dict:
        """``offset``: characters of the choice's text before these tokens (text_offset counts
        from the choice's start)."""
        tokens = [self.token(t) for t in token_ids]
        offsets = []
        for text in tokens:
            offsets.append(offset)
            offset += len(text)
        return {
            "tokens": tokens,
            "token_logprobs": [None if lp is None else lp.logprob for lp in logprobs],
            "top_logprobs": [None if lp is None else {self.token(i): v for i, v in lp.top} for lp in logprobs],
            "text_offset": offsets,
        }
