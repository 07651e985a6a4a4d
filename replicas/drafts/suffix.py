"""SuffixDecoding's draft: the request's own suffix index and the cluster's, whichever expects more.

Per request, a trie of its prompt and output so far (``SuffixIndex.extend``, token by token as
steps accept them). Across requests, suffix arrays (``suffix_array``) of earlier outputs: those
this replica and every other produced (``remember``; the target replica feeds it, and the policy
layer's exchange brings the other replicas' through Redis), kept per ``cache_salt`` so that a
request drafts only from its own tenant's outputs, plus an optional seed corpus read by every
tenant (the target's own answers to public prompts). Each step both are matched against the
context and the speculation with the higher score (expected accepted tokens, ``suffix_index``)
is proposed: the request's own wins where the output copies its prompt, the cluster's where
requests repeat what earlier ones produced (agents, templated answers, edits of the same code).
No model, so it drafts greedily (q one-hot): sampled requests stay exact through rejection
sampling like prompt lookup's.

The cluster's outputs of a salt live in two arrays: ``base`` and ``recent``. A new batch of
outputs rebuilds ``recent`` (small, so cheap); once it outgrows a quarter of ``base``, both merge
into a new ``base``, the oldest outputs dropped to stay within ``remembered_tokens``. Building is
pure (``build``) so that a replica runs it off its event loop (``pending`` → ``build`` in a
thread → ``install``); ``refresh`` does all three in place. Deviation from the paper: its global
tree is updated per output and evicts per request; here outputs join in batches, which is what
sharing them across replicas does anyway.

Memory: a request's trie costs kilobytes a context token (Python objects), so only the
latest ``requests`` tries are kept (more than a replica runs at once); the cluster's arrays cost
12 bytes a token, ``remembered_tokens`` per tenant for at most ``salts`` tenants, and the seed.

Like every draft it is correct from the tokens alone (``base``): a request's trie is found by
its context (``_own``), rebuilt if this replica has none, and extended with what was accepted.
"""

from __future__ import annotations

from collections import OrderedDict
from collections.abc import Iterable, Sequence
from dataclasses import dataclass, field

import numpy as np
import torch

from specserve.replicas.drafts.base import DraftInputs
from specserve.replicas.drafts.suffix_array import SuffixArray, SuffixArrays
from specserve.replicas.drafts.suffix_index import Speculation, SuffixIndex
from specserve.replicas.sampling import SamplingParams
from specserve.replicas.step import Proposal, TreeShape

KEY_TOKENS = 32   # a request's index is looked up by its first tokens, then checked in full
# ``recent`` merges into ``base`` once it holds more than this, or a quarter of ``base``.
RECENT_TOKENS = 4096


@dataclass
class _Outputs:
    """One salt's remembered outputs: two arrays, and the outputs waiting for the next build."""

    base: SuffixArray | None = None
    recent: SuffixArray | None = None
    pending: list[np.ndarray] = field(default_factory=list)
    index: SuffixArrays | None = None   # seed + base + recent, read by speculation

    @property
    def tokens(self) -> int:
        return sum(a.tokens for a in (self.base, self.recent) if a is not None)


@dataclass(frozen=True)
class Build:
    """One salt's rebuild: the outputs of its new ``recent`` and, when merging, of its new ``base``."""

    salt: str | None
    recent: list[np.ndarray]
    base: list[np.ndarray] | None = None


# Children a node of a chain ask's proposal may have: with the same node count as the chain, a
# best-first tree's expected accepted tokens (the sum of its path probabilities) is never lower.
CHAIN_TOP_K = 3


class SuffixDraft:
    name = "suffix"
    inputs = DraftInputs(cache_salt=True)   # it drafts from other requests' outputs, per tenant

    def __init__(self, depth: int = 24, max_spec_factor: float = 1.0, min_token_prob: float = 0.1,
                 remembered_tokens: int = 1 << 18, requests: int = 32, salts: int = 64,
                 seed: Iterable[Sequence[int]] | SuffixArray | None = None, recent_tokens: int = RECENT_TOKENS,
                 chain_top_k: int = CHAIN_TOP_K):
        self.depth = depth
        self.chain_top_k = chain_top_k
        self.max_spec_factor = max_spec_factor
        self.min_token_prob = min_token_prob
        self.remembered_tokens = remembered_tokens
        self.requests = requests
        self.salts = salts
        self.recent_tokens = recent_tokens
        if seed is not None and not isinstance(seed, SuffixArray):
            seed = SuffixArray(seed, depth)
        self.seed: SuffixArray | None = seed
        self._seed_only = SuffixArrays([seed] if seed is not None else [])
        self._outputs: OrderedDict[str | None, _Outputs] = OrderedDict()
        self._own_indexes: OrderedDict[tuple[int, ...], list[SuffixIndex]] = OrderedDict()

    # ---- the cluster's outputs ----------------------------------------------------------------

    def remember(self, output: Sequence[int], cache_salt: str | None = None) -> None:
        """Queue a finished output for every later request of the same salt (joins at the next
        build)."""
        if len(output):
            self._salt(cache_salt).pending.append(np.asarray(output, dtype=np.int32))

    def _salt(self, cache_salt: str | None) -> _Outputs:
        outputs = self._outputs.get(cache_salt)
        if outputs is None:
            outputs = self._outputs[cache_salt] = _Outputs()
            while len(self._outputs) > self.salts:   # the least recently used tenant's outputs go
                self._outputs.popitem(last=False)
        self._outputs.move_to_end(cache_salt)
        return outputs

    def pending(self) -> list[Build]:
        """The builds the queued outputs call for (their queues emptied)."""
        builds = []
        for salt, outputs in self._outputs.items():
            if not outputs.pending:
                continue
            recent = (outputs.recent.token_arrays() if outputs.recent is not None else []) + outputs.pending
            outputs.pending = []
            size = sum(len(o) for o in recent)
            base_size = outputs.base.tokens if outputs.base is not None else 0
            if size > max(self.recent_tokens, base_size // 4):
                everything = (outputs.base.token_arrays() if outputs.base is not None else []) + recent
                builds.append(Build(salt, [], _newest(everything, self.remembered_tokens)))
            else:
                builds.append(Build(salt, recent))
        return builds

    def build(self, builds: list[Build]) -> list[tuple[Build, SuffixArray | None, SuffixArray | None]]:
        """The arrays of ``builds`` (pure: safe off the thread that drafts)."""
        return [(b, SuffixArray(b.recent, self.depth) if b.recent else None,
                 None if b.base is None else SuffixArray(b.base, self.depth)) for b in builds]

    def install(self, built: list[tuple[Build, SuffixArray | None, SuffixArray | None]]) -> None:
        for b, recent, base in built:
            outputs = self._outputs.get(b.salt)
            if outputs is None:
                continue   # the tenant was evicted meanwhile
            if b.base is not None:
                outputs.base = base
            outputs.recent = recent
            arrays = [a for a in (self.seed, outputs.base, outputs.recent) if a is not None]
            outputs.index = SuffixArrays(arrays)

    def refresh(self) -> None:
        """Build what is queued, here and now."""
        self.install(self.build(self.pending()))

    @property
    def remembered(self) -> int:
        """Output tokens the cluster's arrays hold, over every salt."""
        return sum(o.tokens for o in self._outputs.values())

    def _cluster(self, cache_salt: str | None) -> SuffixArrays:
        outputs = self._outputs.get(cache_salt)
        return outputs.index if outputs is not None and outputs.index is not None else self._seed_only

    # ---- the request's own --------------------------------------------------------------------

    def _own(self, context: list[int]) -> SuffixIndex:
        """The index of this context: the request's, extended with what it accepted since. An
        index is filed under its context's first ``KEY_TOKENS`` tokens (all of them while it was
        shorter), so a context looks under each of its prefixes up to that length."""
        best, key = None, None
        for n in range(min(len(context), KEY_TOKENS), 0, -1):
            for index in self._own_indexes.get(tuple(context[:n]), ()):
                have = len(index.context)
                if have <= len(context) and index.context == context[:have] and (best is None or have > len(best.context)):
                    best, key = index, tuple(context[:n])
            if best is not None:
                break
        if best is None:
            best, key = SuffixIndex(self.depth), tuple(context[:KEY_TOKENS])
            candidates = self._own_indexes.setdefault(key, [])
            candidates.append(best)
            if len(candidates) > 4:   # several requests sharing an opening: keep the latest few
                candidates.pop(0)
        best.extend(context[len(best.context):])
        self._own_indexes.move_to_end(key)
        while len(self._own_indexes) > self.requests:
            self._own_indexes.popitem(last=False)
        return best

    # ---- drafting -----------------------------------------------------------------------------

    def speculate(self, context: list[int], max_tokens: int, max_depth: int, top_k: int,
                  cache_salt: str | None = None) -> Speculation:
        """The better of the request's and the cluster's speculations (by expected accepted tokens;
        the request's on a tie)."""
        options = [index.speculate(context, max_tokens, self.max_spec_factor, self.min_token_prob, top_k, max_depth)
                   for index in (self._own(context), self._cluster(cache_salt))]
        return max(options, key=lambda s: s.score)

    def propose(self, context: list[int], window: int, params: SamplingParams,
                generator: torch.Generator | None, cache_salt: str | None = None) -> Proposal:
        """A chain ask's ``window`` nodes, spent best-first: a chain where one continuation leads,
        branches where several are frequent (``chain_top_k`` children a node at most)."""
        spec = self.speculate(context, window, window, self.chain_top_k, cache_salt)
        return Proposal(spec.tokens, spec.parents, None, _given_parent(spec))

    def propose_tree(self, context: list[int], shape: TreeShape, cache_salt: str | None = None) -> Proposal:
        spec = self.speculate(context, shape.budget, shape.depth, shape.top_k, cache_salt)
        return Proposal(spec.tokens, spec.parents, None, _given_parent(spec))


def _newest(outputs: list[np.ndarray], tokens: int) -> list[np.ndarray]:
    """The latest outputs that fit in ``tokens`` (at least the last one)."""
    kept, size = [], 0
    for output in reversed(outputs):
        if kept and size + len(output) > tokens:
            break
        kept.append(output)
        size += len(output)
    return kept[::-1]


def _given_parent(spec: Speculation) -> list[float]:
    """Each drafted token's probability given its parent, as the index estimates it."""
    return [score / (spec.scores[parent] if parent >= 0 else 1.0) for score, parent in zip(spec.scores, spec.parents)]
