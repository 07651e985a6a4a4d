"""Drafting with a hidden-state-reuse head: its own small KV cache plus the target's states.

Per session the draft holds the context tokens, the target's hidden states ``h`` for a prefix of
them (``features``, one row per position), and its layer's keys and values for the positions it
has fed with *true* target states: position ``p`` is fed ``FC(e_p ⊕ h_{p-1})``, so it can be fed
once ``h_{p-1}`` has arrived. Drafting beyond the root feeds the head's own outputs instead; those
keys are thrown away after the proposal, and the next call re-feeds the accepted positions with
the target's states, which verification has produced by then (as EAGLE does).

The target's states arrive with each call (``features`` from ``features_start``), one row per
position: the head's layers side by side ([n, n_layers·H]) for a head that fuses several
(EAGLE-3), fused here once as they arrive. Any replica can serve a call: a draft that holds fewer
rows than the call assumes raises ``MissingFeatures`` with the count it has, and the caller
re-sends from there. On a request's first step the target has not run yet, so there are no states
and the proposal is empty: the first token comes from the target's prefill, as in EAGLE.

``windowed`` (Sparrow's text-anchored window attention, VATA, Eq. 2): on a VLM request the head's
cache keeps the text positions only — the anchors, whose target states already carry what the
target read of the pictures (HSR, Eq. 1) — and the image tokens are never fed to it, so a drafted
token's cost stays flat however many pictures (frames) the prompt holds. Where this deviates from
Sparrow: its window also keeps the most recent positions whatever they are; here the newest
positions of a chat prompt are text anyway (the question and the turn markers after the
pictures), so text anchors alone are the window. Text requests are unchanged.
"""

from __future__ import annotations

import bisect

import torch

from specserve.replicas.drafts.base import DraftInputs, draft_chain
from specserve.replicas.drafts.device_growth import DeviceGrowth
from specserve.replicas.drafts.head_graphs import Fed, HeadGraphs
from specserve.replicas.drafts.tree_growth import TreeGrowth
from specserve.replicas.model.kv_session import common_prefix_len
from specserve.replicas.sampling import SamplingParams
from specserve.replicas.step import Proposal, TreeShape
from specserve.replicas.model.tree_attention import node_depths


class MissingFeatures(Exception):
    """The call's hidden states start after what this draft holds: send them from ``have``."""

    def __init__(self, have: int):
        super().__init__(f"this draft holds target states for {have} positions; send them from there")
        self.have = have


class HSRSession:
    """One sequence's state: tokens, the target's states for a prefix, the head's exact KV."""

    def __init__(self, head, windowed: bool = False):
        self.head = head
        self.windowed = windowed
        self.placeholder: int | None = None   # a VLM request's image token, as drafts read it
        self.tokens: list[int] = []
        # [N, H]: target states of positions 0..N-1, fused when the head reads several layers
        self.features: torch.Tensor | None = None
        self.keys: torch.Tensor | None = None        # [1, heads, C, d]: the cached positions, fed exactly
        self.values: torch.Tensor | None = None
        self.fed = 0                                 # M: positions 1..M are fed (or skipped: ``windowed``)
        self.cached: list[int] = []                  # the positions in the cache, ascending (C of them)
        self.bucket: Fed | None = None               # where the last feed ran, when in the head's graphs

    @property
    def cache_len(self) -> int:
        return 0 if self.keys is None else self.keys.shape[2]

    @property
    def known(self) -> int:
        return 0 if self.features is None else self.features.shape[0]

    def reset(self) -> None:
        self.tokens, self.features, self.keys, self.values = [], None, None, None
        self.fed, self.cached, self.bucket = 0, [], None

    def _crop(self, tokens: int, features: int) -> None:
        self.tokens = self.tokens[:tokens]
        if self.features is not None:
            self.features = self.features[:features]
        self._forget_after(max(0, min(self.fed, tokens - 1, features)))   # position p needs token p and state p-1

    def _forget_after(self, position: int) -> None:
        """Keep the cache's entries of positions up to ``position`` (which becomes ``fed``)."""
        self.fed = position
        keep = bisect.bisect_right(self.cached, position)
        self.cached = self.cached[:keep]
        if self.keys is not None:
            self.keys, self.values = (self.keys[:, :, :keep], self.values[:, :, :keep]) if keep > 0 else (None, None)

    def sync(self, context: list[int], features: torch.Tensor | None, features_start: int) -> None:
        """Take ``context`` and the target states ``features`` of positions ``features_start..``."""
        common = common_prefix_len(self.tokens, context)
        self._crop(common, min(self.known, common))
        self.tokens = list(context)
        if features is None or len(features) == 0:
            return
        if features_start > self.known:
            raise MissingFeatures(self.known)
        # A copy: in-process, ``features`` is a view of the target's buffer, which moves on.
        rows = features[self.known - features_start:].to(self.head.device, self.head.dtype, copy=True)
        rows = rows[: max(0, len(context) - 1 - self.known)]   # no state exists yet for the root
        with torch.inference_mode():   # [n, n_layers·H] -> [n, H], once per row (EAGLE-3's fusion)
            rows = self.head.fused(rows)
        self.features = rows if self.features is None else torch.cat([self.features, rows])

    @torch.inference_mode()
    def root_hidden(self, graphs: HeadGraphs | None = None, room: int = 0) -> torch.Tensor | None:
        """Feed every position the cache lacks up to the root; the root's output [1, 1, H], or
        None while the target's states do not reach the root (the first step). ``graphs``: feed
        through a bucket of the head's graphs with ``room`` positions to spare for the proposal,
        left in ``bucket`` (None when the feed ran the module path)."""
        self.bucket = None
        root = len(self.tokens) - 1
        if root < 1 or self.known < root:
            return None
        if self.fed >= root:   # all fed, but the root's output was not kept: re-feed the root
            self._forget_after(root - 1)
        fresh = range(self.fed + 1, root + 1)
        if self.windowed and self.placeholder is not None:   # VATA: text anchors only (the root is text)
            fresh = [p for p in fresh if self.tokens[p] != self.placeholder or p == root]
        fresh = list(fresh)
        device = self.head.device
        tokens = [self.tokens[p] for p in fresh]
        states = self.features[torch.tensor(fresh, device=self.features.device) - 1]
        # Causal over the cache's order (ascending positions, gaps where pictures were skipped);
        # rotary angles come from the true positions.
        if graphs is not None:
            self.bucket = graphs.feed(self.keys, self.values, tokens, states, fresh, room)
        if self.bucket is not None:
            out, k, v = self.bucket.out, self.bucket.keys, self.bucket.values
        else:
            out, k, v = self.head.step(self.head.inputs(torch.tensor([tokens], device=device), states[None]),
                                       torch.tensor(fresh, device=device), self.keys, self.values)
        self.keys = k if self.keys is None else torch.cat([self.keys, k], dim=2)
        self.values = v if self.values is None else torch.cat([self.values, v], dim=2)
        self.cached.extend(fresh)
        self.fed = root
        return out[:, -1:]


class HSRDraft:
    # The target's states; a VLM request's placeholder (``windowed`` skips those positions).
    inputs = DraftInputs(features=True, image_positions=True)

    def __init__(self, name: str, head, windowed: bool = False):
        self.name = name
        self.head = head
        self.windowed = windowed
        self.session = HSRSession(head, windowed)
        # A chain's drafted tokens as graph replays where the head's device runs graphs (CUDA).
        self.graphs: HeadGraphs | None = HeadGraphs.for_head(head)

    def propose(self, context: list[int], window: int, params: SamplingParams, generator: torch.Generator | None,
                features: torch.Tensor | None = None, features_start: int = 0,
                image_placeholder: int | None = None) -> Proposal:
        self.session.placeholder = image_placeholder
        self.session.sync(context, features, features_start)
        if window <= 0:
            return Proposal.empty()
        with torch.inference_mode():
            hidden = self.session.root_hidden(self.graphs, room=window - 1)
            if hidden is None:
                return Proposal.empty()
            keys, values = self.session.keys, self.session.values
            position = len(context) - 1
            device = self.head.device
            steps = (None if self.graphs is None or window < 2
                     else self.graphs.chain(keys, values, window - 1, fed=self.session.bucket))

            def next_logits(tok: int | torch.Tensor) -> torch.Tensor:
                # Eq. 4: past the root, the head's own output stands in for the target's state.
                nonlocal hidden, keys, values, position
                position += 1
                if steps is not None:   # one replay of the head's step (head_graphs), fed on the device
                    hidden, logits = steps.step(tok, hidden, position)
                    return logits
                z = self.head.inputs(torch.tensor([[tok]], device=device), hidden)
                hidden, k, v = self.head.step(z, torch.tensor([position], device=device), keys, values)
                keys, values = torch.cat([keys, k], dim=2), torch.cat([values, v], dim=2)
                return self.head.head_logits(hidden)[0, -1]

            # Through the graphs the chain is read once, at its end (``ChainBuilder.choose_unread``).
            return draft_chain(self.head.head_logits(hidden)[0, -1], window, params, generator, next_logits, self.head,
                               unread=steps is not None)

    def propose_tree(self, context: list[int], shape: TreeShape, features: torch.Tensor | None = None,
                     features_start: int = 0, image_placeholder: int | None = None) -> Proposal:
        """An EAGLE-2-style tree (``TreeGrowth``). A node is fed its parent's output and sees the
        exact cache plus its own ancestors; where the head runs graphs, an EAGLE-2 tree is one
        replay and a SAGE tree's level one (``head_graphs``)."""
        self.session.placeholder = image_placeholder
        self.session.sync(context, features, features_start)
        with torch.inference_mode():
            root = self.session.root_hidden(self.graphs, room=2 * shape.budget)
            if root is None:
                return Proposal.empty()
            device = self.head.device
            exact = self.session.cache_len
            keys, values = self.session.keys, self.session.values
            levels = (None if self.graphs is None
                      else self.graphs.tree(keys, values, shape.budget, root[0, 0], fed=self.session.bucket))
            if levels is not None and DeviceGrowth.grows(shape):   # grown on the device, read once
                return levels.grow(shape, len(context) - 1)
            frontier_logits = self.head.full_logits(root[0])   # [1, V]
            growth = TreeGrowth(shape)
            outputs: list[torch.Tensor] = []      # [H] per fed node, in node order (module path)
            for level in range(shape.depth):
                if not growth.growing:   # budget spent, or every candidate pruned (SAGE's θ)
                    break
                first = growth.grow(frontier_logits)
                if not growth.more_levels(level):
                    break
                tokens, parents = growth.tokens[first:], growth.parents[first:]
                depths = node_depths(growth.parents)[first:]
                positions = [len(context) - 1 + d for d in depths]
                sees = growth.sees(first)     # [F, first + F]: ancestors and itself
                if levels is not None:
                    frontier_logits = levels.step(tokens, parents, positions, first, sees)
                    continue
                # Keys so far: the exact cache, then every fed tree node in node order.
                allowed = torch.cat([torch.ones(len(tokens), exact, dtype=torch.bool), sees], dim=1).to(device)
                prev = torch.stack([root[0, 0] if p < 0 else outputs[p] for p in parents])
                z = self.head.inputs(torch.tensor([tokens], device=device), prev[None])
                out, k, v = self.head.step(z, torch.tensor(positions, device=device), keys, values, allowed)
                keys, values = torch.cat([keys, k], dim=2), torch.cat([values, v], dim=2)
                outputs.extend(out[0])
                frontier_logits = self.head.full_logits(out[0])
        return growth.proposal()
