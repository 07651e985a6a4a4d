"""One request's features for the draft router (§5 of "A Drop-in Solution for On-the-Fly
Adaptation of Speculative Decoding in Large Language Models": length, perplexity, TF-IDF; plus
how much the prompt repeats itself, which is what prompt lookup feeds on, and whether a grammar
constrains the output: a draft that writes free text well may be rejected under a JSON schema,
where the target's rows are masked and the grammar drafts the forced tokens itself).

``PromptFeatures.vector()`` is the input of the per-draft linear acceptance models: a bias, then
each feature scaled to about [0, 1] (ridge regression and LinUCB's widths assume comparable
scales), then the topic dimensions (each in [-1, 1]).
"""

from __future__ import annotations

import math
from collections.abc import Sequence
from dataclasses import asdict, dataclass

from specserve.router.topics import TopicBasis

# A prompt whose perplexity the prefill did not measure (its prefix was cached) gets the log-
# perplexity of a typical prompt, and the indicator says it was missing.
TYPICAL_LOG_PERPLEXITY = 2.0


def repeat_rate(ids: Sequence[int], n: int = 3) -> float:
    """The fraction of positions i ≥ n where prompt lookup would have been right: the n-gram
    before i occurred earlier in the prompt, and the token after its latest earlier occurrence
    is ids[i]. Counting only that the n-gram recurred overstates it for boilerplate (chat
    templates, indentation) whose continuation differs; counting the right continuation measures
    exactly the copying a prompt-lookup draft lives on."""
    if len(ids) <= n:
        return 0.0
    latest: dict[tuple[int, ...], int] = {}   # n-gram -> the position after its latest occurrence
    hits = 0
    for i in range(n, len(ids)):
        gram = tuple(ids[i - n:i])
        after = latest.get(gram)
        if after is not None and ids[after] == ids[i]:
            hits += 1
        latest[gram] = i
    return hits / (len(ids) - n)


def perplexity_from_nll(nll_sum: float, count: int) -> float | None:
    """exp(mean negative log-likelihood): Eq. 9 of the on-the-fly adaptation paper, in nats
    instead of bits (the same number)."""
    return math.exp(nll_sum / count) if count > 0 else None


@dataclass(frozen=True)
class PromptFeatures:
    prompt_tokens: int
    perplexity: float | None
    repeat_rate: float
    topics: tuple[float, ...]
    constrained: bool = False

    @staticmethod
    def names(dims: int) -> list[str]:
        return ["bias", "log_length", "log_perplexity", "perplexity_missing", "repeat_rate", "constrained",
                *(f"topic_{i}" for i in range(dims))]

    def vector(self, dims: int | None = None) -> tuple[float, ...]:
        dims = len(self.topics) if dims is None else dims
        log_ppl = TYPICAL_LOG_PERPLEXITY if self.perplexity is None else math.log(max(1.0, self.perplexity))
        topics = (tuple(self.topics) + (0.0,) * dims)[:dims]
        return (1.0, math.log(max(1, self.prompt_tokens)) / 8.0, min(2.0, log_ppl / 5.0),
                float(self.perplexity is None), self.repeat_rate, float(self.constrained), *topics)

    def to_dict(self) -> dict:
        out = asdict(self)
        out["topics"] = [round(t, 4) for t in self.topics]
        out["perplexity"] = None if self.perplexity is None else round(self.perplexity, 3)
        out["repeat_rate"] = round(self.repeat_rate, 4)
        return out


def prompt_features(ids: Sequence[int], basis: TopicBasis | None, nll_sum: float = 0.0, nll_count: int = 0,
                    dims: int = 8, constrained: bool = False) -> PromptFeatures:
    topics = basis.project(ids) if basis is not None else (0.0,) * dims
    return PromptFeatures(len(ids), perplexity_from_nll(nll_sum, nll_count), repeat_rate(ids), tuple(topics),
                          constrained)
