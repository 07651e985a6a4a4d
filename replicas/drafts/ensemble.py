"""TABED ("Test-Time Adaptive Batched Ensemble Drafting"), on text: several drafting views of
one draft LM, run as rows of one batched forward, their next-token distributions mixed with
weights chosen at each drafting block from how every candidate mix fared on the tokens the
target verified so far.

Views (each a slot of one ``BatchKV`` per session, fed together):

- ``full``: the whole context;
- ``last-turn``: the context from the last user turn's opening tokens on (earlier turns and the
  system prompt dropped); the whole context when it has no such marker.

and of a VLM request's pictures (TABED's own setting; on a text request each is the whole context):

- ``multimodal``: the image tokens as the target's vision tower and projector embed them (the
  draft shares the target's ``ImageStore``: a draft LM with the target's hidden size reads them);
- ``text-only``: the image tokens as the VLM's placeholder token, the picture dropped;
- ``pooled``: each picture's image tokens averaged to a few (``image_tokens.pooled_view``);
- ``caption``: each picture as "image: " and a caption the VLM wrote of it (``captions.py``;
  the ``text-only`` reading until the caption is written).

One view alone is a draft too (a view the router can choose per request), its weight 1.

Mixing (the paper's Alg. 1): ``q = Σ_v w_v q_v``; greedy drafts its argmax, sampling draws from
it, and that ``q`` is what the rejection test uses (``Proposal.draft_probs``), so the output is
the target's exactly. Every drafted token is fed to every view the block runs.

Which views a block runs (a deviation: the paper batches every view every block, which on a GPU
costs about one view; here each view is a row whose cost adds up): those the block's mix weighs,
and every view on a scoring block, one in ``SCORE_EVERY`` of a session's blocks, or every block
while the mix weighs them all. Only scoring blocks are scored (the views' probabilities are
needed for every candidate). A session's first scoring block is its block ``phase`` (0 to
``SCORE_EVERY`` − 1, from its id), so that a short request, whose cost is mostly the views'
prefills of its prompt, pays the views its mix leaves out only as often as a long one does. A
view left out falls behind and catches up, as a prefill of the tokens it missed, the next block
that runs it. Among mixes the scores leave tied, the one that weighs fewer views is chosen
(``COST_TIE_BREAK``), so that a request whose verified tokens do not tell the views apart drafts
with one of them.

Weights: at each block, ``w* = argmin_j Σ_{t'} D(p_{t'}, q^j_{t'})`` over the candidates
``w_j`` (the simplex grid with step 1/``grid``, for two views the paper's
``[1 − j/n, j/n]``, n = 10), summed over the last ``history`` verified positions (all of the
request's by default, the paper's choice); before any, the prior (below). ``D``:

- ``kl`` / ``tvd`` against the target's distribution at t', taken as one-hot on the token it
  verified: exact under greedy decoding (the target's distribution there is that one-hot; KL =
  −log q(y), TVD = 1 − q(y)); under sampling it stands in for the target's p, which stays on the
  target — the deviation from the paper, which reads p;
- ``matches`` (the default): minus the hard matches, the candidate mix's argmax equal to the
  verified token. With only the verified token as the label, KL and TVD reward whichever view put
  more mass on it and, when the views are close, settle on one of them; matches keep the mix,
  which accepts more on held-out later turns (figures: docs/benchmarks.md §6.0d).

Only positions the draft predicted from a correct prefix score: those up to and including a
block's first rejected token. ``static`` weights keep the equal mix (the paper's MT). An ask that
drafts ahead of a verify (``ProposeRequest.ahead``) neither scores nor is scored: its context's
tail is the draft's own guess, which would teach the mix already in use.

The prior (a deviation: the paper starts every request from the same weights): every candidate's
scores over the last ``PRIOR_POSITIONS`` positions verified for any of the replica's requests,
pooled with the cluster's: the hit rates that every replica's finished requests of the request's
draft and task bucket left through Redis (``ensemble_carry``; ``matches`` only), which the request
brings with its first ask. The cluster's weigh as ``PRIOR_POSITIONS`` positions at most, so that
neither the replica's recent positions nor the cluster's breadth drowns the other; on a replica
that has verified nothing yet they are the prior alone. A request's first block drafts with the
prior's best mix instead of the equal one, and afterwards the prior orders the candidates the
request's own positions leave tied (a thousandth of a hard match). Answers of a few tokens have
one or two blocks: with the equal mix there, the view the others outvote is diluted exactly where
the request has nothing of its own to go on.

Per drafted position a session keeps, per view, the probabilities of the union of the views' top
``TOP`` tokens and the rest's mass (a token outside them gets its view's residual mass spread
evenly): enough to score every candidate once its token is known. Trees fall back to the full
view alone (``DraftServer`` drafts them with one ``DraftLM`` per session).
"""

from __future__ import annotations

import itertools
import math
import zlib
from collections import deque
from dataclasses import dataclass

import torch

from specserve.replicas.model.batch_kv import Feed
from specserve.replicas.captions import caption_view
from specserve.replicas.drafts.batched_lm import BatchedDraftLM
from specserve.replicas.drafts.ensemble_carry import MAX_CANDIDATES, hit_rates, prefix, session_counts
from specserve.replicas.model.image_tokens import draft_view, pooled_view
from specserve.replicas.model.transfer import sent
from specserve.replicas.sampling import draws, logits_to_probs
from specserve.replicas.step import Proposal, ProposeRequest

VIEWS = ("full", "last-turn", "multimodal", "text-only", "pooled", "caption")
TEXT_VIEWS = ("full", "last-turn")             # the default: a conversation's views
# Views that read the target's ImageStore (its pictures' rows, or their captions).
IMAGE_VIEWS = ("multimodal", "pooled", "caption")
DISTANCES = ("kl", "tvd", "matches")
# Tokens per view whose probabilities a drafted position keeps for scoring the candidates later.
TOP = 32
# Verified positions a session keeps at most (``history`` None: all of them up to this).
MAX_HISTORY = 1024
# Sessions whose weights are kept; far more than a replica serves at once.
MAX_SESSIONS = 4096
# The replica's prior: every candidate's scores over the last PRIOR_POSITIONS positions verified
# for any of its requests; it picks a request's first block, and breaks its ties after. The
# cluster's hit rates weigh as at most as many positions beside it.
PRIOR_POSITIONS = 512
# The prior's weight beside a request's own scores: below one hard match, so it only orders
# candidates the request's own positions leave tied.
PRIOR_TIE_BREAK = 1e-3
# Per view a mix weighs: below the prior's part, so it only orders mixes tied on both.
COST_TIE_BREAK = 1e-7
# A session's blocks that run every view and are scored, where its mix leaves some out: one in this many.
SCORE_EVERY = 4


def user_turn_marker(tokenizer) -> list[int]:
    """The tokens that open a user turn in ``tokenizer``'s chat template: those between a system
    message and a user message in a rendering of both, from the template's turn opener (its first
    token) on. Empty when the tokenizer has no chat template."""
    if not getattr(tokenizer, "chat_template", None):
        return []
    system, user = "\u2063S\u2063", "\u2063U\u2063"
    text = tokenizer.apply_chat_template([{"role": "system", "content": system}, {"role": "user", "content": user}],
                                         tokenize=False)
    between = text[text.index(system) + len(system):text.index(user)]
    ids = tokenizer.encode(between, add_special_tokens=False)
    opener = tokenizer.encode(text, add_special_tokens=False)[:1]
    if opener and opener[0] in ids:
        last = len(ids) - 1 - ids[::-1].index(opener[0])
        return ids[last:]
    return ids


def last_turn_start(context: list[int], marker: list[int], since: int = 0) -> int | None:
    """Where the last occurrence of ``marker`` in ``context`` begins, searching from ``since``
    on; None when there is none."""
    n = len(marker)
    for i in range(len(context) - n, max(since, 0) - 1, -1):
        if n and context[i:i + n] == marker:
            return i
    return None


def weight_grid(views: int, steps: int) -> torch.Tensor:
    """Every weight vector on the simplex with coordinates in multiples of 1/``steps``, the
    equal mix (or the nearest) first, then by distance from it: [J, views]."""
    points = [c for c in itertools.product(range(steps + 1), repeat=views) if sum(c) == steps]
    grid = torch.tensor(points, dtype=torch.float32) / steps
    order = sorted(range(len(points)), key=lambda j: (float((grid[j] - 1 / views).abs().sum()), points[j]))
    return grid[order]


@dataclass
class _Drafted:
    """One drafted position, kept until the target has verified it."""

    tokens: torch.Tensor     # [U] the union of the views' top tokens
    probs: torch.Tensor      # [U, m] each view's probability of them
    residual: torch.Tensor   # [m] each view's mass outside them, per token outside
    token: int               # what the mix drafted there


class _Scores:
    """Every candidate's scores over the last ``history`` verified positions, and their sum."""

    def __init__(self, candidates: int, history: int):
        self.history = history
        self.scores: deque[torch.Tensor] = deque()
        self.total = torch.zeros(candidates)   # the scores' sum, per candidate

    def add(self, score: torch.Tensor) -> None:
        self.scores.append(score)
        self.total += score
        if len(self.scores) > self.history:
            self.total -= self.scores.popleft()


class _Ending:
    """A context of ``length`` tokens known by its last ones (``tail``), indexed as the whole."""

    def __init__(self, length: int, tail: list[int]):
        self.length, self.tail, self.start = length, tail, length - len(tail)

    def __len__(self) -> int:
        return self.length

    def __getitem__(self, i: int) -> int:
        if not self.start <= i < self.length:
            raise IndexError(f"position {i} is not among the last {len(self.tail)} of {self.length}")
        return self.tail[i - self.start]


class _Session(_Scores):
    def __init__(self, candidates: int, history: int, phase: int = 0):
        super().__init__(candidates, history)
        self.phase = phase           # its first scoring block where its mix leaves views out
        self.turn_start = 0          # last-turn view: where the last user turn starts
        self.searched = 0            # the context length searched for it so far
        self.pending: tuple[int, int, list[_Drafted]] | None = None   # (block start, root token, positions)
        self.blocks = 0                       # blocks drafted after a verify (not ahead of one)
        self.scored = 0                       # positions scored over the whole request, not only ``history``
        self.hits = torch.zeros(candidates)   # of those, each candidate's hard matches: what it leaves (matches)
        # The cluster's prior: each candidate's mean score [J] and the positions it weighs as.
        self.cluster: tuple[torch.Tensor, float] | None = None


class EnsembleDraftLM(BatchedDraftLM):
    def __init__(self, name: str, model, views: tuple[str, ...] = TEXT_VIEWS, turn_marker: list[int] = (),
                 weights: str = "adaptive", distance: str = "matches", history: int | None = None, grid: int = 10,
                 slots: int = 32):
        """``slots`` sessions, each holding a KV slot per view."""
        unknown = sorted(set(views) - set(VIEWS))
        if unknown or not views or len(set(views)) != len(views):
            raise ValueError(f"an ensemble needs distinct views of {', '.join(VIEWS)}; got {list(views)}")
        if distance not in DISTANCES:
            raise ValueError(f"distance must be one of {', '.join(DISTANCES)}; got {distance!r}")
        if weights not in ("adaptive", "static"):
            raise ValueError(f"weights must be adaptive or static; got {weights!r}")
        super().__init__(name, model, slots * len(views))
        self.views = tuple(views)
        self.marker = list(turn_marker)
        self.adaptive = weights == "adaptive"
        self.distance = distance
        self.history = min(history or MAX_HISTORY, MAX_HISTORY)
        self.candidates = weight_grid(len(views), grid)   # [J, m], the equal mix first
        self.prior = _Scores(len(self.candidates), PRIOR_POSITIONS)
        # The names of what a finished request leaves to the cluster (``ensemble_carry``), for an
        # adaptive ``matches`` mix of two views or more over a bounded grid; None: it leaves nothing.
        carries = self.adaptive and distance == "matches" and len(views) > 1 and len(self.candidates) <= MAX_CANDIDATES
        self.carried_prefix = prefix([VIEWS.index(v) for v in self.views], grid) if carries else None
        self.sessions: dict[str, _Session] = {}
        # [J]: the views each mix runs, in float64: beside a float32 sum of a few hits, 1e-7 rounds away.
        self._cost = COST_TIE_BREAK * (self.candidates > 0).sum(1).double()

    @property
    def max_sessions(self) -> int:
        return self.kv.slots // len(self.views)

    def _session(self, session_id: str) -> _Session:
        session = self.sessions.get(session_id)
        if session is None:
            # Bounded: a target that died never releases its sessions; the oldest go first.
            while len(self.sessions) >= MAX_SESSIONS:
                self.sessions.pop(next(iter(self.sessions)))
            session = self.sessions[session_id] = _Session(len(self.candidates), self.history,
                                                           zlib.crc32(session_id.encode()) % SCORE_EVERY)
        return session

    def release(self, session_id: str, ending: tuple[int, list[int]] | None = None) -> dict[str, int]:
        """Frees the session; returns what its request leaves to the cluster (``ensemble_carry``;
        {}: nothing, as when it scored no position). ``ending``, the request's final context as its
        length and last tokens (``ensemble_carry.valid_ending``), scores the last block, which no
        later ask verified, where it reaches back to the block's root."""
        for view in self.views:
            super().release(f"{session_id}/{view}")
        session = self.sessions.pop(session_id, None)
        if session is not None and ending is not None and session.pending is not None:
            length, tail = ending
            if session.pending[0] - 1 >= length - len(tail):
                with torch.inference_mode():   # the scores are inference tensors, as when an ask learns
                    self._learn(session, _Ending(length, tail))
        if session is None or self.carried_prefix is None:
            return {}
        return session_counts(self.carried_prefix, session.scored, [round(n) for n in session.hits.tolist()])

    def weights_for(self, session_id: str) -> torch.Tensor:
        """w*: the candidate with the least summed distance over the session's verified positions,
        ties broken by the prior (the replica's and the cluster's pooled); before the session has
        any, the prior's best (the equal mix when there is no prior, and on ties)."""
        if not self.adaptive:
            return self.candidates[0]
        session = self.sessions.get(session_id)
        own = session.total if session is not None and session.scores else None
        total, weight = self.prior.total, float(len(self.prior.scores))
        if session is not None and session.cluster is not None:
            mean, positions = session.cluster
            total, weight = total + positions * mean, weight + positions
        if weight <= 0:
            return self.candidates[0 if own is None else int(torch.argmin(own.double() + self._cost))]
        prior = PRIOR_TIE_BREAK * total.double() / weight
        return self.candidates[int(torch.argmin((prior if own is None else own.double() + prior) + self._cost))]

    def cluster_prior(self, sums) -> tuple[torch.Tensor, float] | None:
        """The cluster's carried sums (``ProposeRequest.carried``) as a prior: each candidate's mean
        score [J] (a hit scores −1, as in ``_score``) and the positions it weighs as, at most
        ``PRIOR_POSITIONS``; None when this ensemble carries nothing or the sums hold no usable set
        of its candidates (``ensemble_carry.hit_rates``)."""
        if self.carried_prefix is None:
            return None
        rates = hit_rates(sums, self.carried_prefix, len(self.candidates))
        if rates is None:
            return None
        return -torch.tensor(rates[0]), min(rates[1], float(PRIOR_POSITIONS))

    @property
    def reads_images(self) -> bool:
        return any(view in IMAGE_VIEWS for view in self.views)

    @property
    def reads_captions(self) -> bool:
        return "caption" in self.views

    def _view_context(self, session: _Session, view: str, context: list[int], placeholder: int | None) -> list[int]:
        if placeholder is not None:   # a VLM request
            if view == "multimodal":
                return context
            if view == "pooled":
                images = self.kv.images
                return pooled_view(context, images.pooled)
            if view == "caption":
                return caption_view(context, self.kv.images.captions, placeholder)
            context = draft_view(context, placeholder)
        if view in ("full", "multimodal", "text-only", "pooled", "caption"):
            return context
        if len(context) < session.searched:   # not a continuation: search it whole
            session.turn_start = session.searched = 0
        found = last_turn_start(context, self.marker, session.searched - len(self.marker) + 1)
        if found is not None:
            session.turn_start = found
        session.searched = len(context)
        return context[session.turn_start:]

    def _learn(self, session: _Session, context: list[int]) -> None:
        """Score every candidate on the last block's positions the target has verified since."""
        if session.pending is None:
            return
        start, root, drafted = session.pending
        session.pending = None
        if len(context) <= start or context[start - 1] != root:
            return   # not this session's continuation
        for i, position in enumerate(drafted):
            if start + i >= len(context):
                break
            verified = context[start + i]
            score = self._score(position, verified)
            session.add(score)
            session.scored += 1
            session.hits -= score   # a hard match scores −1 (``matches``); read only when it carries
            self.prior.add(score)
            if position.token != verified:
                break   # later positions were drafted after a wrong token

    def _score(self, position: _Drafted, verified: int) -> torch.Tensor:
        """Each candidate's distance at one verified position: [J]."""
        where = (position.tokens == verified).nonzero()
        q_y = position.probs[int(where[0])] if len(where) else position.residual   # [m]
        mix_y = self.candidates @ q_y                                               # [J]
        if self.distance == "kl":
            return -torch.log(mix_y.clamp(min=1e-12))
        if self.distance == "tvd":
            return 1.0 - mix_y
        best = position.tokens[(position.probs @ self.candidates.T).argmax(0)]    # [J]
        return -(best == verified).float()

    def _head_ids(self, device: torch.device) -> torch.Tensor | None:
        """The draft's head tokens when its output layer covers only some (``pruned_head``): the
        views are mixed, drafted from and kept over those K, not the whole vocabulary (a mix over
        49k ids a drafted position, per view, was a visible share of a CPU step)."""
        model = self.kv.model
        return model.head_token_ids(device) if hasattr(model, "head_token_ids") else None

    @staticmethod
    def _keep(probs: torch.Tensor, token: int, head: torch.Tensor | None = None) -> _Drafted:
        """probs [m, K] over ``head``'s tokens (all of them: None) -> what scoring needs of them."""
        top = torch.topk(probs, min(TOP, probs.shape[-1]), dim=-1).indices.flatten().unique()
        kept = probs[:, top].T.contiguous()                                         # [U, m]
        outside = max(1, probs.shape[-1] - len(top))
        ids = top if head is None else head[top]
        return _Drafted(ids.cpu(), kept.cpu(), ((1.0 - kept.sum(0)).clamp(min=0) / outside).cpu(), token)

    @torch.inference_mode()
    def propose_chains(self, asks: list[ProposeRequest], generators: list[torch.Generator | None]) -> list[Proposal]:
        """A chain of ``ask.window`` tokens for each ask, every view of every ask in one forward
        per drafted position; at most ``slots`` asks per call."""
        if len(asks) > self.max_sessions:
            raise ValueError(f"{len(asks)} sessions in one call, this ensemble holds {self.max_sessions}")
        self._tick += 1
        taken: set[int] = set()
        slots: list[list[int]] = []
        feeds = []
        lengths: list[list[int]] = []
        weights: list[torch.Tensor] = []   # per ask, over the views it runs
        scoring: list[bool] = []
        for ask in asks:
            session = self._session(ask.session_id)
            if ask.carried is not None and session.cluster is None:
                session.cluster = self.cluster_prior(ask.carried)
            if not ask.ahead:   # an ask ahead of a verify: its context's tail is guessed, not verified
                self._learn(session, ask.context)
            w = self.weights_for(ask.session_id)
            due = session.blocks >= session.phase and (session.blocks - session.phase) % SCORE_EVERY == 0
            scores = self.adaptive and not ask.ahead and (bool((w > 0).all()) or due)
            session.blocks += not ask.ahead
            runs = [k for k in range(len(self.views)) if scores or w[k] > 0]
            weights.append(w[runs])
            scoring.append(scores)
            row = []
            lengths.append([])
            for view in (self.views[k] for k in runs):
                slot = self._slot(f"{ask.session_id}/{view}", taken)
                taken.add(slot)
                row.append(slot)
                tokens = self._view_context(session, view, ask.context, ask.image_placeholder)
                lengths[-1].append(len(tokens))
                self.kv.claim(slot, ask.cache_salt)   # a slot's prefix cache serves its own tenant only
                missing = self.kv.sync(slot, tokens)
                if not missing:   # all cached, but the root's logits were not kept: feed the root again
                    self.kv.crop(slot, len(tokens) - 1)
                    missing = tokens[-1:]
                feeds.append(Feed(slot, missing))
            slots.append(row)
        by_slot = dict(zip((f.slot for f in feeds), (rows[-1] for rows in self.kv.forward(feeds))))
        first = next(iter(by_slot.values()))
        vocab, device = first.shape[-1], first.device
        head = self._head_ids(device)
        weights = [sent(w, device) for w in weights]   # sent once, not at every position
        drafted: list[list[int]] = [[] for _ in asks]
        chosen_q: list[list[torch.Tensor]] = [[] for _ in asks]
        token_probs: list[list[float]] = [[] for _ in asks]
        kept: list[list[_Drafted]] = [[] for _ in asks]
        failed = [False] * len(asks)   # a q that was not a distribution: that ask proposes nothing
        for depth in range(max(ask.window for ask in asks)):
            # Every ask's token chosen on the device, then the depth read once for them all.
            choosing, chosen = [], []
            for i, (ask, row) in enumerate(zip(asks, slots)):
                if depth >= ask.window or failed[i]:
                    continue
                logits = torch.stack([by_slot[s] for s in row])                      # [m, V]
                if head is not None:   # a pruned head's tokens: the others' probability is 0 in every view
                    logits = logits.index_select(-1, head)                            # [m, K]
                logits = logits.float()
                views_q = (torch.softmax(logits, -1) if ask.params.greedy
                           else logits_to_probs(logits, ask.params, check=False))    # non-finite: NaN, drawn as -1
                q = weights[i] @ views_q                                             # [K]
                at = q.argmax().view(1) if ask.params.greedy else draws(q[None], generators[i])
                place = at.clamp(min=0)
                tok = place if head is None else head.index_select(0, place)
                chosen.append(torch.cat([torch.where(at < 0, -1, tok).double(), q.index_select(0, place).double()]))
                choosing.append((i, q, views_q))
            if not choosing:
                break
            feeds = []
            for (i, q, views_q), (tok, prob) in zip(choosing, torch.stack(chosen).tolist()):
                if tok < 0:
                    failed[i] = True
                    continue
                tok = int(tok)
                if not asks[i].params.greedy:
                    chosen_q[i].append(q if head is None else q.new_zeros(vocab).index_copy_(0, head, q))
                drafted[i].append(tok)
                token_probs[i].append(prob)
                if scoring[i]:   # a scoring block keeps every view's probabilities (static weights never look back)
                    kept[i].append(self._keep(views_q, tok, head))
                if depth + 1 < asks[i].window:
                    feeds.extend(Feed(s, [tok]) for s in slots[i])
            if not feeds:
                break
            by_slot.update(zip((f.slot for f in feeds), (rows[-1] for rows in self.kv.forward(feeds))))
        for ask, row, length, positions in zip(asks, slots, lengths, kept):
            for slot, n in zip(row, length):   # drafted tokens are not part of the sequence
                self.kv.crop(slot, n)
            if self.adaptive and not ask.ahead:
                pending = (len(ask.context), ask.context[-1], positions) if positions else None
                self.sessions[ask.session_id].pending = pending
        return [Proposal.empty() if bad else Proposal.chain(tokens, torch.stack(q) if q else None, probs)
                for tokens, q, probs, bad in zip(drafted, chosen_q, token_probs, failed)]
