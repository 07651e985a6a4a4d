"""One speculation step: the vocabulary and the typed records that cross part boundaries.

Vocabulary (docs/design.md §3), used in every name, metric and JSON field of specserve:

- **target** ``M_p`` is the model whose output we must reproduce; a **draft** ``M_q`` guesses it.
- **proposal**: the draft tokens of one step, a chain of ``γ`` tokens or a token tree.
- **step**: one propose + verify round. **window** ``γ``: draft tokens proposed in a chain
  step; ``γ = 0`` is a plain decoding step.
- **accepted tokens** ``n`` (0..γ): draft tokens the target agreed with.
- **bonus token**: the one token the target adds after the accepted prefix (its own choice at
  the first rejected position, or after the last draft token), so a step emits ``n + 1`` tokens.
- **mean accepted length** ``τ`` = emitted tokens per step = mean(n + 1), vLLM's convention.
- **acceptance rate** ``α``: per-token probability that a draft token is accepted, estimated as
  ``Σ n / (Σ n + Σ 1[n < γ])`` (Eq. 2 of "A Drop-in Solution for On-the-Fly Adaptation of
  Speculative Decoding in Large Language Models"): a step that accepted everything tells us
  nothing about where the chain would have broken.
- **tree**: depth ``d``, width (top-k) ``k``, node budget ``N``.
"""

from __future__ import annotations

from dataclasses import dataclass, field

import torch

from specserve.replicas.sampling import SamplingParams  # noqa: F401  (ProposeRequest's field type)
from specserve.replicas.model.tree_attention import node_depths


@dataclass(frozen=True)
class TreeShape:
    """How a draft should expand a token tree: at most ``depth`` levels, ``top_k`` children per
    node, ``budget`` nodes in all (the root, the last emitted token, is not counted).

    The last two fields are SAGE's ("SAGE: Accelerating Vision-Language Models via Entropy-Guided
    Adaptive Speculative Decoding", §3.2, ``policies/sage_tree.py``), applied while the
    draft grows the tree (``drafts/tree_growth.py``); their defaults keep the EAGLE-2-style tree:

    - ``width_decay``: a node at level ``l >= 2`` gets ``top_k · (1/l) · (0.5 + P_parent)``
      children (Eq. 12, ``P_parent`` its parent's path probability), and a level is not cut to
      ``top_k`` nodes; only the budget bounds it.
    - ``threshold``: a node is kept only if its path probability exceeds
      ``threshold · l / depth`` (SAGE's θ_l, 0.1 in the paper); 0 keeps every node.

    Drafts without a distribution (prompt lookup) ignore both.
    """

    depth: int
    top_k: int
    budget: int
    width_decay: bool = False
    threshold: float = 0.0

    def __post_init__(self) -> None:
        if self.depth < 1 or self.top_k < 1 or self.budget < 1:
            raise ValueError(
                f"tree shape needs depth, top_k and budget >= 1, got "
                f"depth={self.depth}, top_k={self.top_k}, budget={self.budget}"
            )
        if not 0.0 <= self.threshold < 1.0:
            raise ValueError(f"tree threshold must be in [0, 1) (a path probability scale), got {self.threshold}")

    @classmethod
    def parse(cls, text: str) -> "TreeShape":
        """``"DEPTH,TOPK,BUDGET"`` as typed on the command line, e.g. ``"4,2,12"``."""
        parts = text.split(",")
        if len(parts) != 3 or not all(p.strip().lstrip("-").isdigit() for p in parts):
            raise ValueError(f"tree must be DEPTH,TOPK,BUDGET (three integers), got {text!r}")
        return cls(*(int(p) for p in parts))


@dataclass
class Proposal:
    """The draft tokens of one step, as a tree; a chain is the tree whose every node has one child.

    ``tokens[i]`` hangs below ``parents[i]`` (``-1`` = the root, i.e. the last emitted token).
    Parents always come before their children. ``draft_probs`` is set only for a chain whose
    tokens were *sampled* from the draft distribution ``q`` (shape ``[γ, V]``); when it is None
    every token is a deterministic choice of the draft (greedy, top-k, prompt lookup), which the
    rejection sampler treats as ``q`` = one-hot.
    """

    tokens: list[int]
    parents: list[int]
    draft_probs: torch.Tensor | None = None
    # q(x) of each node given its parent, as the draft saw it (policies read the draft's
    # confidence); None for drafts without a distribution (prompt lookup).
    token_probs: list[float] | None = None
    # The draft's highest next-token probabilities at the root, highest first (a tree's level-1
    # distribution, ``tree_growth.ROOT_TOP_PROBS`` of them): SAGE's entropy (its Eq. 7-9)
    # is computed from them. None for chains and for drafts without a distribution.
    root_probs: list[float] | None = None
    # A greedy chain's runner-up at each position: the draft's best token other than the one it
    # chose. Drafting ahead (``StepLoop``) guesses from it what the target emits where it rejects.
    alternatives: list[int] | None = None

    @classmethod
    def chain(cls, tokens: list[int], draft_probs: torch.Tensor | None = None,
              token_probs: list[float] | None = None, alternatives: list[int] | None = None) -> "Proposal":
        return cls(list(tokens), list(range(-1, len(tokens) - 1)), draft_probs, token_probs,
                   alternatives=None if alternatives is None else list(alternatives))

    @classmethod
    def empty(cls) -> "Proposal":
        return cls([], [])

    def __len__(self) -> int:
        return len(self.tokens)

    def chain_from(self, skip: int, window: int) -> "Proposal":
        """A chain's tokens after its first ``skip``, at most ``window`` of them, with their draft
        rows: what a chain drafted from ``skip`` tokens further back proposes once those are emitted."""
        if not self.is_chain:
            raise ValueError("only a chain is cut into a shorter chain")
        end = skip + max(0, window)

        def part(values):
            return None if values is None else values[skip:end]

        return Proposal.chain(self.tokens[skip:end], part(self.draft_probs), part(self.token_probs), part(self.alternatives))

    @property
    def is_chain(self) -> bool:
        return all(p == i - 1 for i, p in enumerate(self.parents))

    def depths(self) -> list[int]:
        """Depth of each node; the root's children have depth 1."""
        return node_depths(self.parents)


@dataclass(frozen=True)
class Speculation:
    """What a policy asks of one request's next step: a chain of ``window`` tokens, a ``tree``,
    or neither (``window == 0`` and no tree: a plain decoding step)."""

    window: int = 0
    tree: TreeShape | None = None

    @property
    def plain(self) -> bool:
        return self.tree is None and self.window <= 0


PLAIN = Speculation()


@dataclass(frozen=True)
class ProposeRequest:
    """One request's ask of a draft for one step; a draft call carries a list of them.

    ``seed`` seeds the draft's own random stream when it samples (derived from the request's
    seed, never equal to the target's stream). A hidden-state-reuse draft also gets the target's
    hidden states of context positions ``features_start..``: the ones it has not been sent yet,
    [n, n_layers·H] (the layers its config names, side by side).
    ``cache_salt`` is the request's tenant: a draft that learns from other requests' outputs
    drafts only from those of the same salt. ``image_placeholder``: a VLM request's context holds
    image tokens (``image_tokens``); a draft that cannot read them reads this token in their place.
    ``carried``: the cluster's sums of what the draft's finished sessions left (a TABED ensemble's
    hits, ``drafts/ensemble_carry.py``), sent with a request's first ask of its draft only; a draft
    that keeps none ignores them. ``ahead``: the ask drafts ahead of a verify (``step_loop``), so
    the context's tail holds drafted tokens the target has not verified: a draft that learns from
    verified tokens (a TABED ensemble's weights) learns nothing from it.
    """

    session_id: str
    context: list[int]
    window: int
    tree: TreeShape | None
    params: "SamplingParams"
    seed: int | None = None
    features: torch.Tensor | None = None
    features_start: int = 0
    cache_salt: str | None = None
    image_placeholder: int | None = None
    carried: dict[str, float] | None = None
    ahead: bool = False


@dataclass(frozen=True)
class TokenLogprob:
    """The target's log-probability of one emitted token and its ``top`` alternatives ((token id,
    log-probability), likeliest first), from the raw logits of the row that predicted it."""

    logprob: float
    top: tuple[tuple[int, float], ...] = ()


@dataclass(frozen=True)
class StepResult:
    """What one step did. ``accepted_path`` indexes ``Proposal.tokens`` (root to leaf)."""

    proposed: int            # γ for a chain, node count for a tree
    accepted: int            # n
    accepted_path: list[int]
    emitted_tokens: list[int]  # the n accepted draft tokens followed by the bonus token
    max_depth: int           # the longest path the proposal offered (γ for a chain)
    proposal_error: str | None = None   # why the draft's proposal was dropped (the step went plain)
    error: str | None = None            # why this request could not be verified (it fails alone; nothing emitted)
    logprobs: list[TokenLogprob] | None = None   # per emitted token, when the request asked for them


@dataclass(frozen=True)
class RequestStep:
    """One request's part of a step: what policies and statistics learn from."""

    request_id: str
    draft: str
    asked: Speculation          # what the policy asked for this step
    proposed: int               # tokens (nodes) the draft proposed: γ for a full chain
    accepted: int               # n
    max_depth: int              # the longest path offered
    draft_token_probs: tuple[float, ...] | None   # the draft's q(x) per proposed token, if it has one
    draft_root_probs: tuple[float, ...] | None = None   # Proposal.root_probs (trees), for SAGE's entropy


@dataclass(frozen=True)
class StepRecord:
    """One scheduler step: every request verified in it, and where the time went."""

    batch_size: int             # requests verified in the step's one target forward
    forward_tokens: int         # tokens that forward fed (each request's root + proposal)
    prefill_tokens: int         # prompt tokens prefilled in the step (their own forward)
    draft_ms: float
    verify_ms: float
    prefill_ms: float
    requests: tuple[RequestStep, ...]
    # Each draft's own proposal time in the step, (draft, ms) by name: the drafts propose
    # concurrently, so ``draft_ms`` is the slowest's; the router prices each draft by its own.
    draft_ms_by: tuple[tuple[str, float], ...] = ()


@dataclass
class SpecStats:
    """Running totals of one generation; ``summary()`` is the ``spec`` object of the JSON output."""

    draft: str
    steps: int = 0
    emitted: int = 0
    accepted: int = 0
    # Σ 1[n < max_depth]: steps where the chain broke, the denominator term of α's estimate (Eq. 2
    # of the on-the-fly adaptation paper).
    rejections: int = 0
    windows: list[int] = field(default_factory=list)
    trees: list[list[int]] = field(default_factory=list)   # [depth, top_k, budget] asked, per tree step
    # Wall time spent waiting for proposals and in verification: where a step's time goes.
    draft_s: float = 0.0
    verify_s: float = 0.0
    prefill_s: float = 0.0     # its prompt's prefill chunks (the decode phase is the rest)
    proposal_errors: int = 0   # proposals dropped as malformed (those steps went plain)
    # Tokens the grammar forced (structured output): proposed in place of the draft's, accepted
    # where the target agreed; not the draft's, so not in ``accepted``.
    forced: int = 0
    forced_accepted: int = 0
    # A relaxed (lossy) acceptance rule the request asked for (``lantern.Lantern.summary``);
    # None: the exact rules.
    acceptance: dict | None = None

    def record(self, result: StepResult) -> None:
        self.steps += 1
        self.emitted += len(result.emitted_tokens)
        self.accepted += result.accepted
        self.rejections += int(result.max_depth > 0 and result.accepted < result.max_depth)
        self.windows.append(result.max_depth)

    @property
    def mean_accepted_len(self) -> float:
        return self.emitted / self.steps if self.steps else 0.0

    @property
    def acceptance_rate(self) -> float:
        denominator = self.accepted + self.rejections
        return self.accepted / denominator if denominator else 0.0

    def summary(self) -> dict:
        return {
            "draft": self.draft,
            "steps": self.steps,
            "mean_accepted_len": round(self.mean_accepted_len, 4),
            "acceptance_rate": round(self.acceptance_rate, 4),
            "windows": list(self.windows),
            "draft_ms_per_step": round(1e3 * self.draft_s / self.steps, 3) if self.steps else 0.0,
            "verify_ms_per_step": round(1e3 * self.verify_s / self.steps, 3) if self.steps else 0.0,
            "prefill_ms": round(1e3 * self.prefill_s, 3),
            **({"proposal_errors": self.proposal_errors} if self.proposal_errors else {}),
            **({"forced": self.forced, "forced_accepted": self.forced_accepted} if self.forced else {}),
            **({"trees": [list(t) for t in self.trees]} if self.trees else {}),
            **({"acceptance": dict(self.acceptance)} if self.acceptance else {}),
        }
