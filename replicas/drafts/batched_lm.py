"""A draft LM that proposes the chains of all of a step's sessions together: one forward per
drafted position for every session, instead of one per session (``DraftLM``).

Sessions hold slots of a ``BatchKV`` over the draft model, like requests on the target. A slot
keeps the session's committed tokens between steps (drafted tokens are cropped after each
proposal), so a step feeds each session only what its cache lacks. A new session takes the lowest
free slot, else the least recently used one, and a session moves down into a free slot below its
own (the two caches swapped: the free slot's prefix cache is kept, in the slot left behind): a
forward of padded rows runs the whole range of its slots, so a call's slots are kept dense from 0
(two sessions at either end of the cache would cost a forward of every slot). A session whose slot
went to another is rebuilt from its tokens, so eviction costs recompute, never correctness.
"""

from __future__ import annotations

import torch

from specserve.replicas.model.batch_kv import BatchKV, Feed
from specserve.replicas.drafts.base import ChainBuilder, read_together
from specserve.replicas.step import Proposal, ProposeRequest


class BatchedDraftLM:
    def __init__(self, name: str, model, slots: int = 32):
        self.name = name
        self.kv = BatchKV(model, slots)
        self.owner: list[str | None] = [None] * slots
        self._used = [0] * slots   # a step counter per slot: the least recently used goes first
        self._tick = 0

    @property
    def max_sessions(self) -> int:
        """Sessions one ``propose_chains`` call may hold."""
        return self.kv.slots

    def release(self, session_id: str) -> None:
        """The session ended; its slot stays a prefix cache until another takes it."""
        for slot, owner in enumerate(self.owner):
            if owner == session_id:
                self.owner[slot] = None

    def _slot(self, session_id: str, taken: set[int]) -> int:
        if session_id in self.owner:
            slot = self.owner.index(session_id)
            hole = next((s for s in range(slot) if self.owner[s] is None and s not in taken), None)
            if hole is not None:   # down into a free slot below: the slots of sessions that stay keep dense
                self.kv.swap(slot, hole)   # the free slot's prefix cache moves up, not lost
                self.owner[slot], self.owner[hole] = None, session_id
                slot = hole
        else:   # the lowest free slot, else the least recently used: a call's slots stay a tight range
            open_slots = [s for s in range(self.kv.slots) if s not in taken]
            slot = next((s for s in open_slots if self.owner[s] is None), None)
            if slot is None:
                slot = min(open_slots, key=lambda s: self._used[s])
            self.owner[slot] = session_id
        self._used[slot] = self._tick
        return slot

    @torch.inference_mode()
    def propose_chains(self, asks: list[ProposeRequest], generators: list[torch.Generator | None]) -> list[Proposal]:
        """A chain of ``ask.window`` tokens for each ask; at most ``slots`` asks per call."""
        if len(asks) > self.kv.slots:
            raise ValueError(f"{len(asks)} sessions in one call, this draft holds {self.kv.slots}")
        self._tick += 1
        taken: set[int] = set()
        slots = []
        for ask in asks:
            slots.append(self._slot(ask.session_id, taken))
            taken.add(slots[-1])
        feeds = []
        for slot, ask in zip(slots, asks):
            self.kv.claim(slot, ask.cache_salt)   # a slot's prefix cache serves its own tenant only
            missing = self.kv.sync(slot, ask.context)
            if not missing:   # all cached, but the root's logits were not kept: feed the root again
                self.kv.crop(slot, len(ask.context) - 1)
                missing = ask.context[-1:]
            feeds.append(Feed(slot, missing))
        chains = [ChainBuilder(ask.params, gen) for ask, gen in zip(asks, generators)]
        logits = self.kv.forward(feeds)
        for depth in range(max(ask.window for ask in asks)):
            choosing = [i for i, (ask, chain) in enumerate(zip(asks, chains)) if depth < ask.window and not chain.failed]
            for i in choosing:
                chains[i].choose_unread(logits[i][-1])
            read_together(chains)   # one read a position for every session, not one a session
            feeds = [Feed(slots[i], [chains[i].tokens[-1]]) for i in choosing
                     if depth + 1 < asks[i].window and not chains[i].failed]
            if not feeds:
                break
            by_slot = dict(zip((f.slot for f in feeds), self.kv.forward(feeds)))
            logits = [by_slot.get(slot, rows) for slot, rows in zip(slots, logits)]
        for slot, ask in zip(slots, asks):
            self.kv.crop(slot, len(ask.context))   # drafted tokens are not part of the sequence
        # A session whose q was not a distribution proposes nothing this step, alone.
        return [Proposal.empty() if chain.failed else chain.proposal() for chain in chains]
