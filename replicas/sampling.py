"""Sampling parameters and the logits -> probabilities warp shared by target and draft.

Losslessness needs the *same* warp on ``p`` and ``q`` before the rejection test (docs/design.md §4):
the target distribution we must reproduce is the warped one, not the raw softmax.
"""

from __future__ import annotations

import math
from dataclasses import dataclass

import torch


@dataclass(frozen=True)
class SamplingParams:
    """How a request turns the target's logits into the tokens it emits, with vLLM's names and
    semantics. ``temperature == 0`` means greedy; ``top_k == 0``, ``top_p == 1`` and
    ``min_p == 0`` disable those filters.

    The processors (``logits_processors.RowProcessors``) act on the logits first, in vLLM's order:
    ``allowed_token_ids``, ``logit_bias``, ``min_tokens`` (the stop tokens masked until that many
    are out), then the repetition penalty (prompt and output tokens), the frequency and presence
    penalties (output tokens). The warp (``logits_to_probs``) then divides by the temperature and
    applies ``min_p``, ``top_k`` and ``top_p``. ``stop_token_ids`` end the output as the EOS does;
    ``ignore_eos`` lets it run past the EOS."""

    temperature: float = 0.0
    top_p: float = 1.0
    top_k: int = 0
    seed: int | None = None
    min_p: float = 0.0
    presence_penalty: float = 0.0
    frequency_penalty: float = 0.0
    repetition_penalty: float = 1.0
    logit_bias: tuple[tuple[int, float], ...] = ()   # (token id, bias added to its logit)
    allowed_token_ids: tuple[int, ...] | None = None
    min_tokens: int = 0
    stop_token_ids: tuple[int, ...] = ()
    ignore_eos: bool = False

    def __post_init__(self) -> None:
        if not (self.temperature >= 0.0):
            raise ValueError(f"temperature must be >= 0, got {self.temperature}")
        if not (0.0 < self.top_p <= 1.0):
            raise ValueError(f"top_p must be in (0, 1], got {self.top_p}")
        if self.top_k < 0:
            raise ValueError(f"top_k must be >= 0 (0 disables it), got {self.top_k}")
        if not (0.0 <= self.min_p <= 1.0):
            raise ValueError(f"min_p must be in [0, 1], got {self.min_p}")
        for name in ("presence_penalty", "frequency_penalty"):
            if not math.isfinite(getattr(self, name)):
                raise ValueError(f"{name} must be finite, got {getattr(self, name)}")
        if not (0.0 < self.repetition_penalty < math.inf):
            raise ValueError(f"repetition_penalty must be > 0, got {self.repetition_penalty}")
        if any(not math.isfinite(b) for _, b in self.logit_bias):
            raise ValueError("logit_bias values must be finite")
        if self.allowed_token_ids is not None and not self.allowed_token_ids:
            raise ValueError("allowed_token_ids must name at least one token")
        if self.min_tokens < 0:
            raise ValueError(f"min_tokens must be >= 0, got {self.min_tokens}")

    @property
    def processed(self) -> bool:
        """Whether any processor acts on this request's logits before the warp."""
        return bool(self.presence_penalty or self.frequency_penalty or self.repetition_penalty != 1.0
                    or self.logit_bias or self.allowed_token_ids is not None or self.min_tokens)

    @property
    def penalized(self) -> bool:
        return bool(self.presence_penalty or self.frequency_penalty or self.repetition_penalty != 1.0)

    def stop_ids(self, eos_token_ids: frozenset[int]) -> frozenset[int]:
        """The tokens that end this request's output (and that ``min_tokens`` holds back)."""
        return (frozenset() if self.ignore_eos else frozenset(eos_token_ids)) | frozenset(self.stop_token_ids)

    @property
    def greedy(self) -> bool:
        return self.temperature == 0.0

    def generator(self, device: torch.device | str = "cpu") -> torch.Generator:
        gen = torch.Generator(device=device)
        if self.seed is None:
            gen.seed()
        else:
            gen.manual_seed(self.seed)
        return gen


class NonFiniteScores(ValueError):
    """A request's scores are not a distribution (NaN or infinite logits, probabilities that do
    not sum to a positive number): that request cannot be sampled, the others of its step can."""


LOGITS_NOT_FINITE = "the target's logits are not finite"
NOT_A_DISTRIBUTION = "the probabilities to sample from are not finite, or sum to 0"


# The smallest temperature the warp divides by: float32's smallest normal number, so that a
# temperature the API admits (down to a subnormal float64) is never 0 once in float32.
MIN_TEMPERATURE = torch.finfo(torch.float32).tiny


def logits_to_probs(logits: torch.Tensor, params: SamplingParams, check: bool = True) -> torch.Tensor:
    """Warped next-token probabilities, float32. logits: [..., V] -> probs: [..., V].

    Greedy becomes a one-hot on the argmax, so the rejection rule ``min(1, p/q)`` reduces to
    exact-match verification and one code path serves both modes.

    The logits are shifted by their row's maximum before dividing by the temperature (softmax is
    shift-invariant, so p is unchanged): ``(l − max) / T <= 0`` can only underflow to −inf, never
    overflow, for every temperature down to the smallest float — a tiny T samples the limit
    distribution (uniform over the tied maxima), not NaN. A row with a non-finite maximum
    (NaN or +inf logits) is ``NonFiniteScores``; with ``check`` off it warps to NaN instead, for a
    caller that draws from the result (``sample`` refuses it), sparing a read from the device.
    """
    logits = logits.float()
    if params.greedy:
        return torch.nn.functional.one_hot(logits.argmax(-1), logits.shape[-1]).float()
    top = logits.amax(-1, keepdim=True)
    if check and not bool(torch.isfinite(top).all()):
        raise NonFiniteScores(LOGITS_NOT_FINITE)
    logits = (logits - top) / max(params.temperature, MIN_TEMPERATURE)
    if params.min_p > 0.0:
        # p(x) < min_p · max p  ⇔  (l(x) − max l) / T < log(min_p): one comparison in the shifted
        # space the warp already has, where a softmax and a sort would read the row twice more.
        logits = logits.masked_fill(logits < math.log(params.min_p), float("-inf"))
    if params.top_k and params.top_k < logits.shape[-1]:
        kth = torch.topk(logits, params.top_k, dim=-1).values[..., -1:]
        logits = logits.masked_fill(logits < kth, float("-inf"))
    if params.top_p < 1.0:
        sorted_logits, order = torch.sort(logits, dim=-1, descending=True)
        sorted_probs = sorted_logits.softmax(-1)
        # Drop a token when the mass strictly before it already reaches top_p; the first token
        # always survives.
        drop_sorted = sorted_probs.cumsum(-1) - sorted_probs >= params.top_p
        drop_sorted[..., 0] = False   # even when top_p rounds to 0 in float32
        drop = drop_sorted.scatter(-1, order, drop_sorted)
        logits = logits.masked_fill(drop, float("-inf"))
    return logits.softmax(-1)


def uniform(generator: torch.Generator | None) -> float:
    """One draw from U[0, 1), made on the generator's own device (a CUDA generator cannot fill a CPU
    tensor, and a CPU one cannot fill a CUDA tensor)."""
    return torch.rand((), generator=generator, device=None if generator is None else generator.device).item()


def sample(probs: torch.Tensor, generator: torch.Generator | None) -> int:
    """One token id from a 1-D probability vector (``draws``, read); ``NonFiniteScores`` when it
    is not one. The check and the token come back in one read from the device."""
    token = int(draws(probs[None], generator)[0])
    if token < 0:
        raise NonFiniteScores(NOT_A_DISTRIBUTION)
    return token


def draws(probs: torch.Tensor, generator: torch.Generator | None, u: torch.Tensor | None = None) -> torch.Tensor:
    """A token id per row of ``probs`` [R, V], -1 for a row that is not a probability vector
    (non-finite, negative, or of no mass); [R] on the rows' device, unread. ``u`` [R, 1]: each
    row's uniform draw, made beforehand (else drawn here from ``generator``, one per row).

    Drawn by inverting the cumulative sum in float64 (the first token whose cumulative mass
    exceeds u · total): a token of no mass is never drawn, and each token's chance is its mass to
    float64's rounding. torch's ``multinomial`` draws one exponential per token of the vocabulary
    even for a single sample, many times this on the CPU (docs/benchmarks.md §10.7), and on CUDA
    a NaN inside it is a device-side assert, which ends every request of the process."""
    cumulative = probs.cumsum(-1, dtype=torch.float64)
    total = cumulative[:, -1:].contiguous()
    valid = torch.isfinite(total[:, 0]) & (total[:, 0] > 0) & (probs.amin(-1) >= 0)   # a NaN fails each test
    if u is None:
        u = torch.rand(len(probs), 1, dtype=torch.float64, generator=generator, device=probs.device)
    u = u * total
    # u may round up to the total itself: the last token with mass is the largest draw.
    last = torch.searchsorted(cumulative, total)
    token = torch.minimum(torch.searchsorted(cumulative, u, right=True), last)[:, 0]
    return torch.where(valid, token, -1)
