"""The target side of a step: score every request's proposal in one forward and keep what it accepts.

A ``Target`` holds the model, the KV caches of up to ``slots`` requests (``BatchKV``) and, for
hidden-state-reuse drafts, the tapped hidden states of each slot's cached positions (per decoder
layer: an EAGLE-3 head reads several, side by side).
``verify`` takes one ``VerifyItem`` per request (its slot, context, proposal, sampling) and runs
them through a single forward; acceptance is then decided per request by the rejection sampler,
unchanged, so batching changes nothing a request sees but its latency.

Proposals are untrusted input (a draft replica may be buggy or from another model): one that is
malformed is dropped before it reaches the model and the step becomes a plain one for that
request (``StepResult.proposal_error`` says why); it costs speculation, never the request, and on
CUDA an out-of-range id never becomes a device-side assert.
"""

from __future__ import annotations

from contextlib import contextmanager
from dataclasses import dataclass, replace
from typing import NamedTuple

import torch

from specserve.replicas.model.batch_kv import BatchKV, Feed
from specserve.replicas.drafts.hsr_head import decoder_layer
from specserve.replicas.grammar import GrammarError, GrammarState
from specserve.replicas.imagegen import guided_logits
from specserve.replicas.model.image_tokens import is_virtual
from specserve.replicas.model.kv_session import common_prefix_len
from specserve.replicas.lantern import Lantern, LatentRelaxation, NoCodebook
from specserve.replicas.logits_processors import NO_TOKEN_LEFT, RowProcessors, choosable
from specserve.replicas.logprobs import packed_logprobs, read_logprobs, token_logprobs
from specserve.replicas.model.mrope import MRope
from specserve.replicas.model.transfer import sent
from specserve.replicas.rejection_sampler import (DepthDraws, draws_every_row, greedy_choices,
                                                  sampled_chain_verdicts, sampled_choices, verify)
from specserve.replicas.sampling import NonFiniteScores, SamplingParams
from specserve.replicas.step import Proposal, StepResult, TokenLogprob


class FeatureTap:
    """The outputs of the decoder layers it watches in the model's last forward: the hidden states
    hidden-state-reuse drafts read (``replicas/drafts/hsr_head.py``), one layer for a Sparrow-style
    head, several for an EAGLE-3 one. One per model, shared by every ``Target`` over it (each keeps
    the layers its drafts asked for); forwards run one at a time (one model thread per replica),
    so ``last`` is safe."""

    def __init__(self, layers: torch.nn.ModuleList):
        self._layers = layers
        self._watched: dict[torch.nn.Module, int] = {}   # decoder layer module -> its index
        self.last: dict[int, torch.Tensor] = {}           # decoder layer index -> its output

    def watch(self, layer: int) -> None:
        """Keep decoder layer ``layer``'s output from the next forward on. A forward of our own
        (llama_forward) fills ``last`` itself; a Hugging Face forward through the hook."""
        module = self._layers[layer]
        if module not in self._watched:
            self._watched[module] = layer
            module.register_forward_hook(
                lambda m, args, out: self.keep(layer, out[0] if isinstance(out, tuple) else out))

    @property
    def watched_layers(self) -> frozenset[int]:
        return frozenset(self._watched.values())

    def layer_of(self, module: torch.nn.Module) -> int | None:
        """The index of ``module`` if it is a watched decoder layer."""
        return self._watched.get(module)

    def keep(self, layer: int, output: torch.Tensor) -> None:
        self.last[layer] = output

    @contextmanager
    def paused(self):
        """Watch no layer inside the block (a target-only measurement through a step that keeps no
        states: ``cuda_graphs``' compiled mode), then the same layers again; outputs kept before
        are forgotten."""
        watched = dict(self._watched)
        self._watched.clear()
        self.last.clear()
        try:
            yield
        finally:
            self._watched.update(watched)
            self.last.clear()


def feature_tap(model) -> FeatureTap | None:
    """The model's tap on its decoder layers (watching none until asked); None for a model
    without a list of at least two decoder layers."""
    tap = getattr(model, "_specserve_feature_tap", None)
    layers = getattr(getattr(model, "model", None), "layers", None)
    if tap is None and layers is not None and len(layers) >= 2:
        tap = FeatureTap(layers)
        model._specserve_feature_tap = tap
    return tap


def vocab_size(model) -> int:
    """The number of rows of the model's output layer: the ids its logits cover."""
    head = model.get_output_embeddings()
    return int(head.weight.shape[0]) if head is not None else int(model.config.vocab_size)


def proposal_error(proposal: Proposal, vocab: int, device: torch.device) -> str | None:
    """Why ``proposal`` cannot be verified, or None (``proposal_errors`` for one)."""
    return proposal_errors([proposal], vocab, device)[0]


def proposal_errors(proposals: list[Proposal], vocab: int, device: torch.device) -> list[str | None]:
    """Why each proposal cannot be verified, or None. Checked before any tensor work; the
    ``draft_probs`` of every proposal that has them are checked in one read from the device."""
    errors = [_shape_error(proposal, vocab, device) for proposal in proposals]
    checked = [i for i, (proposal, error) in enumerate(zip(proposals, errors))
               if error is None and proposal.draft_probs is not None and proposal.tokens]
    if not checked:
        return errors
    # The rejection test divides by q(x) and takes max(0, p − q) as a distribution: q must be
    # one, and give each proposed token the mass it was drawn with (q(x) > 0).
    flags = []
    for i in checked:
        q, tokens = proposals[i].draft_probs, proposals[i].tokens
        low, high = torch.aminmax(q)   # one pass; a NaN propagates and fails both tests
        sums = ((q.sum(-1, dtype=torch.float32) - 1).abs() < 1e-3).all()
        picked = (torch.stack([q[j, x] for j, x in enumerate(tokens)]) > 0).all()   # views: no index list sent
        flags.append(torch.stack([low.float(), high.float(), sums.float(), picked.float()]).to(device))
    for i, (low, high, sums, picked) in zip(checked, torch.stack(flags).tolist()):
        if not (low >= 0.0 and high <= 1.0):
            errors[i] = "draft_probs must be finite and within [0, 1]"
        elif not sums:
            errors[i] = "draft_probs rows must each sum to 1"
        elif not picked:
            errors[i] = "draft_probs give a proposed token no probability (q(x) = 0)"
    return errors


def _shape_error(proposal: Proposal, vocab: int, device: torch.device) -> str | None:
    """What makes ``proposal`` malformed before its values are read: its tokens, parents and the
    shape and device of its ``draft_probs``."""
    n = len(proposal.tokens)
    if len(proposal.parents) != n:
        return f"{n} tokens but {len(proposal.parents)} parents"
    for i, (tok, parent) in enumerate(zip(proposal.tokens, proposal.parents)):
        if not isinstance(tok, int) or not 0 <= tok < vocab:
            return f"token {tok!r} at node {i} is outside the target's vocabulary [0, {vocab})"
        if not isinstance(parent, int) or not -1 <= parent < i:
            return f"node {i} has parent {parent!r}: parents must be -1 or an earlier node"
    q = proposal.draft_probs
    if q is not None:
        if not proposal.is_chain:
            return "draft_probs are only defined for a chain"
        if tuple(q.shape) != (n, vocab):
            return f"draft_probs have shape {tuple(q.shape)}, expected ({n}, {vocab})"
        if q.device.type != device.type:
            return f"draft_probs are on {q.device}, the target on {device}"
    return None


@dataclass(frozen=True)
class GuideRow:
    """A guided request's unconditional row (``request.Guidance``): its KV slot and tokens (the
    root last, as ``VerifyItem.context``), the guidance scale, and the ids tokens are drawn from."""

    slot: int
    context: list[int]
    scale: float
    vocab: int


@dataclass
class VerifyItem:
    """One request's part of a step. ``context[-1]`` is the root (the last emitted token)."""

    slot: int
    context: list[int]
    proposal: Proposal
    params: SamplingParams
    generator: torch.Generator | None = None
    processors: RowProcessors | None = None   # the request's logits processors, if it has any
    logprobs: int | None = None   # the emitted tokens' log-probabilities with this many alternatives; None: none
    grammar: GrammarState | None = None   # the grammar the request's output follows (structured output)
    guide: GuideRow | None = None   # classifier-free guidance: the unconditional row verified beside it
    lantern: Lantern | None = None   # LANTERN's relaxed acceptance of image tokens (lossy, asked for)


class _Features:
    """Row p: the tapped hidden state at cache position p of one slot; rows < known are valid.
    Grows by doubling, so a step appends without copying the whole history."""

    def __init__(self):
        self.rows: torch.Tensor | None = None   # [allocated positions, H]
        self.known = 0

    def put(self, first: int, rows: torch.Tensor) -> None:   # rows: [n, H]
        """Rows for positions ``first..``; everything after ``first`` is replaced."""
        if first > self.known:   # a gap: earlier states are unknown, so none can be trusted
            self.known = 0
            return
        end = first + len(rows)
        if self.rows is None or end > len(self.rows):
            grown = torch.empty(max(2 * end, 256), rows.shape[-1], dtype=rows.dtype, device=rows.device)
            if self.rows is not None:
                grown[: self.known] = self.rows[: self.known]
            self.rows = grown
        self.rows[first:end] = rows
        self.known = end


class Prefilled(NamedTuple):
    """What one prefill chunk did: tokens fed, tokens still missing, and the summed negative
    log-likelihood of the ``scored`` prompt tokens it predicted."""

    fed: int
    left: int
    nll: float = 0.0
    scored: int = 0
    logprobs: tuple[TokenLogprob, ...] | list[TokenLogprob] = ()   # the fed tokens' next prompt tokens', when asked


# The hidden state a target keeps from the start: Sparrow's ``h^h`` (``hsr_head``'s default).
DEFAULT_FEATURE_LAYERS = (-2,)


class Target:
    def __init__(self, model, slots: int = 1, max_len: int | None = None,
                 feature_layers: tuple[int, ...] = DEFAULT_FEATURE_LAYERS, images=None,
                 neighbours: torch.Tensor | None = None):
        """``feature_layers``: hidden states (indices into transformers' ``hidden_states``) kept
        for hidden-state-reuse drafts from the first forward; ``tap_features`` adds more.
        ``images``: a VLM's ``image_tokens.ImageStore`` (``model`` is then its language model),
        which prompts' image tokens are registered with and embedded from. ``neighbours``: an image
        generator's nearest-code table (``lantern.latent_neighbours`` of its VQ codebook), which
        LANTERN's relaxed acceptance reads."""
        self.model = model
        self.neighbours = None if neighbours is None else neighbours.to(model.device)
        self.kv = BatchKV(model, slots, max_len=max_len)
        self.images = self.kv.images = images
        if images is not None:   # Qwen2-VL: positions from the pictures' grids (mrope.py)
            self.kv.mrope = MRope.of(model)
        self.vocab = vocab_size(model)
        self._tap = feature_tap(model)
        # Per slot, per tapped decoder layer: its rows. Layers apart, so that one added later
        # (a draft that arrived later) costs no other layer its rows.
        self._features: list[dict[int, _Features]] = [{} for _ in range(slots)]
        if self._tap is not None:
            self.tap_features(feature_layers)

    @property
    def slots(self) -> int:
        return self.kv.slots

    def _decoder_layer(self, index: int) -> int:
        return decoder_layer(index, len(self.model.model.layers))

    def tap_features(self, layers) -> bool:
        """Keep the hidden states ``layers`` (indices into transformers' ``hidden_states``, as a
        draft's config names them) of every position fed from now on. False for a model without
        a tap (not a decoder-layer list). Raises ``ValueError`` for an index that is no decoder
        layer's output. A layer added while requests run has no rows for what they fed before:
        their drafts that read it propose nothing until a new request fills the slot."""
        if self._tap is None:
            return False
        for index in layers:
            layer = self._decoder_layer(index)
            self._tap.watch(layer)
            for stores in self._features:
                stores.setdefault(layer, _Features())
        return True

    def features(self, context: list[int], start: int = 0, slot: int = 0,
                 layers=DEFAULT_FEATURE_LAYERS) -> torch.Tensor | None:
        """The hidden states ``layers`` this target holds for ``context`` in ``slot``, side by side
        ([end - start, len(layers)·H]; a view for one layer), from ``start``: rows up to the root
        at most, and only where the slot holds these very tokens (a reused slot may hold another
        request's). None without a tap or with a layer not tapped (``tap_features``)."""
        stores = [self._features[slot].get(self._decoder_layer(i)) if self._tap is not None else None for i in layers]
        if any(store is None or store.rows is None for store in stores):
            return None
        end = min(min(store.known for store in stores), common_prefix_len(self.kv.tokens[slot], context),
                  len(context) - 1)
        rows = [store.rows[start:max(start, end)] for store in stores]   # [end - start, H] each
        return rows[0] if len(rows) == 1 else torch.cat(rows, dim=-1)

    def _keep_features(self, feeds: list[Feed], firsts: list[int], keep: list[list[int]] | None = None) -> None:
        """After a forward: each feed's tapped rows (``keep[i]``: which of its tokens) at ``firsts[i]``."""
        if self._tap is None:
            return
        outs = [(layer, out) for layer in self._features[0] if (out := self._tap.last.get(layer)) is not None]
        if not outs:   # none watched since the last forward
            return
        for i, feed in enumerate(feeds):
            kept = None if keep is None else keep[i]
            # Kept rows rise from 0 (the uncached tail, then the accepted path): a chain's are a
            # prefix, a slice; a tree's are gathered with an index made once for every layer.
            if kept is not None:
                kept = slice(len(kept)) if not kept or kept[-1] == len(kept) - 1 else sent(kept, outs[0][1].device, torch.long)
            for layer, out in outs:
                fed = self.kv.fed_rows(out, i)   # [n, H], padding dropped
                self._features[feed.slot][layer].put(firsts[i], fed if kept is None else fed[kept])

    def swap(self, a: int, b: int) -> None:
        """Slots ``a`` and ``b`` exchange caches and hidden states (the scheduler keeps busy slots
        dense, and the cache a request displaces stays as a prefix cache)."""
        self.kv.swap(a, b)
        self._features[a], self._features[b] = self._features[b], self._features[a]

    def copy_prefix(self, src: int, dst: int, length: int) -> None:
        """``dst`` holds ``src``'s cache of its first ``length`` positions, hidden states included."""
        if src == dst:
            return
        self.kv.copy_prefix(src, dst, length)
        for layer, store in self._features[src].items():
            copy = _Features()
            known = min(store.known, len(self.kv.tokens[dst]))
            if store.rows is not None and known:
                copy.put(0, store.rows[:known].clone())
            self._features[dst][layer] = copy

    def prefill(self, slot: int, tokens: list[int], chunk: int, next_token: int | None = None,
                score_rows: int = 0, logprobs: int | None = None) -> Prefilled:
        """Feed at most ``chunk`` of the tokens ``slot`` lacks of ``tokens`` (a prompt without its
        last token, which the first step feeds as its root, ``next_token``).

        ``score_rows``: the chunk's last rows whose next token the prompt knows are scored (their
        negative log-likelihood summed): the router's prompt perplexity, from the forward that
        runs anyway. "A Drop-in Solution for On-the-Fly Adaptation of Speculative Decoding in
        Large Language Models" (Eq. 9) averages over the whole prompt; we score only the last
        rows of each chunk, because the output layer over every prompt position would add ~20%
        to the prefill (a 49k-token vocabulary against a 135M-parameter model).

        ``logprobs``: the log-probability of every prompt token the chunk predicts, with this many
        alternatives (the API's ``echo``); then every row's logits come back."""
        missing = self.kv.sync(slot, tokens)
        if not missing:
            return Prefilled(0, 0)
        first = len(tokens) - len(missing)
        fed = missing[:chunk]
        known_next = (tokens + ([] if next_token is None else [next_token]))[first + 1:first + len(fed) + 1]
        rows = min(score_rows, len(known_next))
        # Feed row j predicts known_next[j]; a chunk that ends the prompt without ``next_token``
        # has no target for its last row, so that row's logits come back too and are dropped.
        every = logprobs is not None
        feed = Feed(slot, fed, len(fed) if every else (rows + len(fed) - len(known_next) if rows else 1))
        logits = self.kv.forward([feed])[0]   # [feed.logits_rows, V]
        self._keep_features([feed], [first])
        nll = 0.0
        if rows:
            scored = logits[len(known_next) - rows:len(known_next)] if every else logits[:rows]
            # A picture's image token (a virtual id) is no word of the vocabulary: the rows that
            # predict one are not scored.
            ids = known_next[-rows:]
            words = [j for j, t in enumerate(ids) if not is_virtual(t)]
            if len(words) < rows:
                scored, rows = scored[words], len(words)
            wanted = torch.tensor([ids[j] for j in words], device=logits.device)   # [rows]
            nll = float(-torch.log_softmax(scored.float(), -1).gather(-1, wanted[:, None]).sum()) if rows else 0.0
        prompt = token_logprobs(logits[:len(known_next)], known_next, logprobs) if every else []
        return Prefilled(len(fed), len(missing) - len(fed), nll, rows, prompt)

    def _feed(self, slot: int, context: list[int], proposal: Proposal) -> tuple[Feed, int]:
        """The feed of ``slot``'s uncached context tail + ``proposal`` (logits for the root and
        every node) and the first position it feeds."""
        missing = self.kv.sync(slot, context[:-1]) + context[-1:]
        first = len(context) - len(missing)
        if proposal.is_chain:
            return Feed(slot, missing + proposal.tokens, len(proposal) + 1), first
        # The uncached tail is a chain ending in the root; proposal nodes hang below the root
        # (parent -1 -> the root's index).
        tail = len(missing)
        parents = list(range(-1, tail - 1)) + [tail - 1 if p < 0 else tail + p for p in proposal.parents]
        return Feed(slot, missing + proposal.tokens, len(proposal) + 1, parents, committed=tail), first

    def _keep_path(self, slot: int, context: list[int], proposal: Proposal, path: list[int]) -> None:
        """``slot`` holds ``context`` + the accepted nodes ``path`` of ``proposal``."""
        base = len(context)
        if proposal.is_chain:
            self.kv.crop(slot, base + len(path))
        else:
            self.kv.keep(slot, list(range(base)) + [base + i for i in path], context + [proposal.tokens[i] for i in path])

    def verify(self, items: list[VerifyItem]) -> list[StepResult]:
        """One forward over every item's [uncached context tail] + proposal (and, for a guided
        item, its unconditional row's, whose logits combine with the item's: ``guided_logits``).

        Each slot afterwards holds its context + the accepted tokens (not the bonus token, which
        becomes the next step's root), and ``features()`` the hidden states of those positions.
        """
        feeds: list[Feed] = []
        firsts: list[int] = []
        errors: list[str | None] = []
        failures: list[str | None] = []
        for item, error in zip(items, proposal_errors([item.proposal for item in items], self.vocab, self.model.device)):
            if error is not None:
                item.proposal = Proposal.empty()
            errors.append(error)
            failure = None
            if item.grammar is not None:
                try:   # drafted tokens the grammar forbids are never verified
                    item.proposal = item.grammar.admit(item.proposal)
                except GrammarError as err:
                    item.proposal, failure = Proposal.empty(), f"{type(err).__name__}: {err}"
            failures.append(failure)
            feed, first = self._feed(item.slot, item.context, item.proposal)
            feeds.append(feed)
            firsts.append(first)
        # Unconditional rows after the items' own, so that feed i is item i's (``fed_rows``).
        guided = [i for i, item in enumerate(items) if item.guide is not None]
        guide_feeds = [self._feed(items[i].guide.slot, items[i].guide.context, items[i].proposal)[0] for i in guided]
        logits = self.kv.forward(feeds + guide_feeds)   # per feed: [n + 1, V]
        unconditional = dict(zip(guided, logits[len(feeds):]))
        raws, ruled = self._ruled_rows(items, logits, unconditional, failures)
        choices, verdicts, seeded = self._decisions(items, ruled, failures)
        results: list[StepResult] = []
        kept: list[list[int]] = []
        logprobs: dict[int, torch.Tensor] = {}   # request -> its emitted tokens' log-probabilities, unread
        for index, (item, feed, rows, raw, error, failure) in enumerate(zip(items, feeds, ruled, raws, errors, failures)):
            proposal = item.proposal
            path, bonus = [], None
            try:
                if failure is None:
                    if index in verdicts:
                        if isinstance(verdict := verdicts[index], NonFiniteScores):
                            raise verdict
                        path, bonus = verdict
                    elif item.lantern is None:
                        path, bonus = verify(rows, proposal, item.params, item.generator, choice=choices.get(index))
                        if index in seeded:
                            seeded[index].rewind(len(path) + 1)   # the rows walked: the path's and the bonus's
                    elif self.neighbours is None:
                        raise NoCodebook("relaxed acceptance needs an image generator's codebook; this target has none")
                    else:
                        path, bonus = verify(rows, proposal, item.params, item.generator,
                                             LatentRelaxation(self.neighbours, item.lantern))
                    if item.grammar is not None:
                        item.grammar.advance([proposal.tokens[i] for i in path] + [bonus])
            except (NonFiniteScores, GrammarError, NoCodebook) as err:   # this request's own rows: it fails alone, the step goes on
                path, bonus, failure = [], None, f"{type(err).__name__}: {err}"
            accepted = [proposal.tokens[i] for i in path]
            tail = len(feed.tokens) - len(proposal)
            kept.append(list(range(tail)) + [tail + i for i in path])
            self._keep_path(item.slot, item.context, proposal, path)
            if item.guide is not None:
                self._keep_path(item.guide.slot, item.guide.context, proposal, path)
            emitted = accepted + ([] if bonus is None else [bonus])
            if item.logprobs is not None and failure is None:
                # Emitted token j was predicted by row 0 (the root's) or by the row of the path's
                # node before it: stacked views, not an index list (which a GPU would be sent first).
                logprobs[index] = packed_logprobs(torch.stack([raw[0]] + [raw[i + 1] for i in path]), emitted,
                                                  item.logprobs)
            results.append(StepResult(
                proposed=len(proposal),
                accepted=len(path),
                accepted_path=path,
                emitted_tokens=emitted,
                max_depth=max(proposal.depths(), default=0),
                proposal_error=error,
                error=failure,
            ))
        for index, read in zip(logprobs, read_logprobs(list(logprobs.values()))):   # every request's in one read
            results[index] = replace(results[index], logprobs=read)
        self._keep_features(feeds, firsts, kept)
        return results

    def _ruled_rows(self, items: list[VerifyItem], logits: list[torch.Tensor], unconditional: dict[int, torch.Tensor],
                    failures: list[str | None]) -> tuple[list[torch.Tensor], list[torch.Tensor]]:
        """Each request's rows [n + 1, V] (row 0 follows the root, row i + 1 node i: the sampler's
        layout) as its log-probabilities read them (guided), and as its own rules see them (masked
        by its grammar, processed); a request whose rules fail has its failure set in ``failures``."""
        raws: list[torch.Tensor] = []
        ruled: list[torch.Tensor] = []
        processed: dict[int, torch.Tensor] = {}   # request -> whether its processors left every row a token
        for index, (item, rows) in enumerate(zip(items, logits)):
            if item.guide is not None:
                rows = guided_logits(rows, unconditional[index], item.guide.scale, item.guide.vocab)
            raws.append(rows)
            try:
                if failures[index] is None and item.grammar is not None:
                    rows = item.grammar.mask(rows)
                if failures[index] is None and item.processors is not None:
                    rows = item.processors.apply(rows, item.context, item.proposal, check=False)
                    processed[index] = choosable(rows)
            except GrammarError as err:   # this request's own rows: it fails alone
                failures[index] = f"{type(err).__name__}: {err}"
            ruled.append(rows)
        if processed:   # every processed request's check in one read
            for index, ok in zip(processed, torch.stack(list(processed.values())).tolist()):
                if not ok:
                    failures[index] = f"{NonFiniteScores.__name__}: {NO_TOKEN_LEFT}"
        return raws, ruled

    def _decisions(self, items: list[VerifyItem], ruled: list[torch.Tensor], failures: list[str | None]
                   ) -> tuple[dict[int, list[int]], dict[int, tuple[list[int], int] | NonFiniteScores],
                              dict[int, DepthDraws]]:
        """What the step's requests read from the device together, by request: the rows' tokens
        their walks follow (``verify``'s ``choice``), sampled chains' verdicts, and the seeded
        requests' draws made beforehand, to rewind after their walks."""
        # The exact greedy rule reads only the rows' argmaxes: every such request's at once.
        greedy = [i for i, (item, failure) in enumerate(zip(items, failures))
                  if failure is None and item.params.greedy and item.lantern is None]
        choices = dict(zip(greedy, greedy_choices([ruled[i] for i in greedy])))
        # Every row of a request walked by point masses drawn at once where that pays
        # (``draws_every_row``), all such requests' draws read together: an unseeded request's
        # rows each their own u, a seeded request's by depth in target-only decoding's order
        # (``DepthDraws``, rewound after its walk).
        drawn = [i for i, (item, failure) in enumerate(zip(items, failures))
                 if failure is None and not item.params.greedy and item.lantern is None
                 and item.proposal.draft_probs is None and draws_every_row(ruled[i])]
        seeded = {i: DepthDraws(items[i].generator, items[i].proposal, ruled[i].device)
                  for i in drawn if items[i].params.seed is not None}
        choices.update(zip(drawn, sampled_choices([ruled[i] for i in drawn], [items[i].params for i in drawn],
                                                  [items[i].generator for i in drawn],
                                                  [seeded.get(i) for i in drawn])))
        # Sampled chains: every request's tests read at once, then every bonus token.
        chains = [i for i, (item, failure) in enumerate(zip(items, failures))
                  if failure is None and not item.params.greedy and item.lantern is None
                  and item.proposal.draft_probs is not None]
        verdicts = dict(zip(chains, sampled_chain_verdicts(
            [ruled[i] for i in chains], [items[i].proposal for i in chains], [items[i].params for i in chains],
            [items[i].generator for i in chains])))
        return choices, verdicts, seeded

    def verify_one(self, context: list[int], proposal: Proposal, params: SamplingParams,
                   generator: torch.Generator | None = None, slot: int = 0) -> StepResult:
        """``verify`` for a single request (tests, evaluation scripts)."""
        return self.verify([VerifyItem(slot, context, proposal, params, generator)])[0]
