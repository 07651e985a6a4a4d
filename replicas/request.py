"""The types that cross a target replica's scheduler: the request as it arrives, its state between
steps, what the replica streams back for it (``StreamItem``), and the two seams the scheduler asks
each step (``Policy``: each request's speculation; ``DraftRouter``: the draft of an ``AUTO_DRAFT``
request).

Window and tree rules (``specserve.policies``), the learned draft router (``specserve.router``),
the ingress and the in-process engine import these, not the scheduler: they need the request's
shape, not the target, the KV layout or the C kernels.
"""

from __future__ import annotations

import hashlib
from collections.abc import Callable
from dataclasses import dataclass, field, replace
from typing import Protocol

import torch

from specserve.replicas.grammar import GrammarState
from specserve.replicas.lantern import Lantern
from specserve.replicas.logits_processors import RowProcessors
from specserve.replicas.logprobs import MAX_TOP_LOGPROBS, joined
from specserve.replicas.sampling import SamplingParams
from specserve.replicas.step import PLAIN, Speculation, SpecStats, StepRecord, StepResult, TokenLogprob, TreeShape

NO_DRAFT = "none"
# Guidance scales a request may ask (LlamaGen's class-conditional models are served at 1.5-7.5).
MAX_GUIDANCE_SCALE = 50.0
# The draft is chosen by the replica's draft router (``router/``) when the request's prefill is
# done: the features it reads include the target's perplexity on the prompt.
AUTO_DRAFT = "auto"


@dataclass(frozen=True)
class Guidance:
    """Classifier-free guidance (an image generator's, ``replicas/imagegen.py``): beside the
    request's own (conditional) row, an unconditional row whose prompt is ``prompt_ids`` is fed
    the same tokens in the same forward, and every token is drawn from LlamaGen's combination
    ``u + scale * (c - u)`` of the two rows' logits, over the ids below ``vocab`` only."""

    prompt_ids: tuple[int, ...]
    scale: float
    vocab: int

    def __post_init__(self) -> None:
        if not self.prompt_ids:
            raise ValueError("guidance needs an unconditional prompt of at least one token")
        if not 0.0 < self.scale <= MAX_GUIDANCE_SCALE:
            raise ValueError(f"the guidance scale must be in (0, {MAX_GUIDANCE_SCALE}], got {self.scale}")
        if self.vocab < 1:
            raise ValueError(f"guidance's vocab must be >= 1, got {self.vocab}")

    def context(self, context: list[int], prompt_len: int) -> list[int]:
        """The unconditional row's tokens for a request whose context is ``context`` and whose
        prompt is its first ``prompt_len``: this prompt, then the same output."""
        return list(self.prompt_ids) + context[prompt_len:]


@dataclass(frozen=True)
class SpecRequest:
    """One generation as it reaches a target replica (tokenized and checked by the ingress or the
    in-process engine): the only request type that crosses that boundary."""

    prompt_ids: list[int]
    max_tokens: int
    params: SamplingParams = SamplingParams()
    draft: str = NO_DRAFT
    window: int = 0
    tree: TreeShape | None = None
    request_id: str = ""
    # The client named the window or tree itself: policies leave it as asked (a user measuring a
    # window gets that window); otherwise the deployment's policy adapts it.
    pinned: bool = False
    # The policy that adapts this request (a name from ``specserve.policies.registry``); None: the
    # deployment's.
    policy: str | None = None
    # The cluster's acceptance rate for this request's draft and task bucket (the policy service's
    # snapshot), which adaptive policies start from instead of cold; None: no prior.
    prior_alpha: float | None = None
    # The cluster's carried rule state for this draft and task bucket: ``{"version": the snapshot's,
    # "sums": counts}`` (``policies/carry.py``), which carrying rules start from; None: none.
    prior_learned: dict | None = field(default=None, compare=False)
    # A served request's tokens go to the ingress in items of at least this many (the first and
    # the last excepted): every item is a message through Ray, which under load costs more than it
    # seems (vLLM's ``--stream-interval``, in tokens). 1: every step's tokens as they come.
    stream_interval: int = 1
    # Prefix-cache isolation (the API's ``cache_salt``): KV is reused only between requests with
    # the same salt (None is a salt too: the default tenant).
    cache_salt: str | None = None
    # A VLM request: its image tokens are virtual ids (``image_tokens``), and drafts see this
    # token (the VLM's image placeholder) in their place. None: a text request.
    image_placeholder: int | None = None
    # The prompt's pictures as the ingress prepared them (``image_tokens.PictureUnit``s, a tile
    # each where the processor splits pictures): the replica adds them to its ImageStore, whose
    # ids (from the units) the prompt already holds.
    images: tuple = field(default=(), compare=False)   # units: equal requests are equal by their ids
    # Written by the replica for itself (a picture's caption, ``captions.py``): the router neither
    # routes it nor learns from it.
    internal: bool = False
    # The emitted tokens' log-probabilities with this many alternatives each (``logprobs.py``);
    # None: none. ``prompt_logprobs``: the same for the prompt's tokens (the API's ``echo``).
    logprobs: int | None = None
    prompt_logprobs: int | None = None
    # The grammar the output follows (structured output): llguidance's grammar text
    # (``ingress/structured.py``); None: free text.
    grammar: str | None = None
    # The tokens the grammar forces are the step's draft (``Scheduler``); None: the replica's setting.
    grammar_draft: bool | None = None
    # A continuation (``ingress/resumable.py``): the prompt's last this-many tokens are the
    # request's own output from before it resumed here; processors count them as output.
    resumed_tokens: int = 0
    # Classifier-free guidance: an unconditional row beside this one (two KV slots); None: none.
    guidance: Guidance | None = None
    # An image generator's request: its picture's tokens per row (tree rules read a token's grid
    # neighbours, ``policies/adt_tree.py``); 0: text.
    grid: int = 0
    # LANTERN's relaxed acceptance of its image tokens (``lantern.py``): lossy, asked for by the
    # request and named in its summary; None: the exact rules.
    lantern: Lantern | None = None
    # The prompt's task topic (``router/topics.TopicBasis.topic``), part of the task bucket its
    # statistics are counted and warm-started under; None: the replica has no topics.
    topic: int | None = None

    def __post_init__(self) -> None:
        if not self.prompt_ids:
            raise ValueError("the prompt is empty: give at least one token")
        if self.max_tokens < 1:
            raise ValueError(f"max_tokens must be >= 1, got {self.max_tokens}")
        if self.window < 0:
            raise ValueError(f"window must be >= 0, got {self.window}")
        if self.grid < 0:
            raise ValueError(f"grid must be >= 0, got {self.grid}")
        if self.lantern is not None and self.grid == 0:
            raise ValueError("relaxed acceptance is for an image generator's tokens (a request with a grid)")
        if self.topic is not None and self.topic < 0:
            raise ValueError(f"topic must be >= 0, got {self.topic}")
        if self.stream_interval < 1:
            raise ValueError(f"stream_interval must be >= 1, got {self.stream_interval}")
        if not 0 <= self.resumed_tokens < len(self.prompt_ids):
            raise ValueError(f"resumed_tokens must be in [0, {len(self.prompt_ids)}), got {self.resumed_tokens}")
        for name in ("logprobs", "prompt_logprobs"):
            if getattr(self, name) is not None and not 0 <= getattr(self, name) <= MAX_TOP_LOGPROBS:
                raise ValueError(f"{name} must be in [0, {MAX_TOP_LOGPROBS}], got {getattr(self, name)}")

    @property
    def speculation(self) -> Speculation:
        """What the request asked for (the static policy's answer)."""
        return PLAIN if self.draft == NO_DRAFT else Speculation(self.window, self.tree)


@dataclass(frozen=True)
class StepError:
    """Why a replica gave up a request before its end. Either the whole step failed (the model
    raised): the ingress resumes the request on a replica from the tokens already streamed; or the
    request alone failed for a reason tied to its own inputs (``request_fault``: its row of the
    forward was not finite): resuming it elsewhere would fail the same way, so the ingress answers
    it with an error instead, and the rest of the step went on."""

    message: str   # what failed, for the ingress's log: "RuntimeError: ..."
    request_fault: bool = False


@dataclass(frozen=True)
class StreamItem:
    """What a target replica streams to the ingress for one request: the tokens verified since the
    last item. The last item says why the request ended (``finish_reason``) and, from a served
    replica, what speculation did (``spec``, the response's ``spec`` object), or that it failed
    (``error``, with no tokens: tokens verified before the failure but not yet sent, merged into a
    pending item or held back for ``stream_interval``, are dropped, and the ingress resumes from
    what it received)."""

    token_ids: list[int]
    finish_reason: str | None = None   # "stop", "length" or "abort"; None: more items follow
    spec: dict | None = None           # the replica's summary, on the last item (``TargetDeployment``)
    cached_tokens: int = 0             # prompt tokens the KV slot already held, on the last item (usage)
    error: StepError | None = None
    logprobs: list[TokenLogprob] | None = None   # per token of ``token_ids``, when the request asked
    # The prompt's tokens' (the first has none), on the first item, when the request asked.
    prompt_logprobs: list[TokenLogprob | None] | None = None

    @property
    def last(self) -> bool:
        """Nothing follows this item: the request finished or failed."""
        return self.finish_reason is not None or self.error is not None

    def then(self, later: "StreamItem") -> "StreamItem":
        """This item and ``later`` (which follows it) as one: ``later``'s ending, both items' tokens."""
        return replace(later, token_ids=self.token_ids + later.token_ids, logprobs=joined(self.logprobs, later.logprobs),
                       prompt_logprobs=self.prompt_logprobs if self.prompt_logprobs is not None else later.prompt_logprobs)


def draft_seed(seed: int | None) -> int | None:
    """The draft's own seed, derived from the request's and never equal to the target's stream:
    with a shared stream the draft's draws and the target's acceptance tests would read the same
    numbers, and the output would no longer follow the target's distribution."""
    if seed is None:
        return None
    return int.from_bytes(hashlib.blake2b(f"draft:{seed}".encode(), digest_size=8).digest(), "little") >> 1


class RequestState:
    """One request between steps."""

    def __init__(self, request: SpecRequest, eos_token_ids: frozenset[int], device: torch.device,
                 emit: Callable[[StreamItem], None] | None = None):
        self.request = request
        self.id = request.request_id
        self.context = list(request.prompt_ids)
        self.out: list[int] = []
        self.finish_reason: str | None = None
        params = request.params
        # The tokens that end the output: the model's EOS (unless ignore_eos) and stop_token_ids.
        self.stop_ids = params.stop_ids(eos_token_ids)
        self.processors = (RowProcessors(params, len(request.prompt_ids) - request.resumed_tokens, self.stop_ids)
                           if params.processed else None)
        # The prompt's log-probabilities as the prefill's chunks give them, sent on the first item.
        self.prompt_logprobs: list[TokenLogprob | None] | None = [None] if request.prompt_logprobs is not None else None
        self.prompt_logprobs_sent = False
        self.logprobs: list[TokenLogprob] | None = [] if request.logprobs is not None else None
        self.grammar: GrammarState | None = None   # set by the scheduler for a request with a grammar
        self.stats = SpecStats(draft=request.draft, acceptance=request.lantern and request.lantern.summary())
        self.slot: int | None = None
        self.guide_slot: int | None = None   # the unconditional row's KV slot (``request.guidance``)
        self.prefilled = False
        self.cached_tokens: int | None = None   # context tokens found in the slot's cache at admission
        self.speculating = not request.speculation.plain
        self.generator = None if params.greedy else params.generator(device)
        self.draft_seed = draft_seed(params.seed)
        self.features_sent = 0     # target states already sent to a remote draft for this request
        self.carried_sent = False  # its draft has the cluster's carried sums (``ProposeRequest.carried``)
        self.emit = emit
        # The target's negative log-likelihood of the prompt's last tokens, from the prefill
        # (``PERPLEXITY_ROWS`` per chunk): the draft router's perplexity feature.
        self.prompt_nll = 0.0
        self.prompt_scored = 0
        self.routed = False                # the scheduler has settled its draft (after the prefill)
        self.routing: dict | None = None   # the draft router's decision (``spec.router``)
        # The α the router chose the current draft on (its prediction for this prompt, with the
        # exploration bonus when that decided): the load-aware policy's prior for this request.
        self.expected_alpha: float | None = None

    @property
    def done(self) -> bool:
        return self.finish_reason is not None

    @property
    def rows(self) -> int:
        """KV slots the request holds: two under guidance (its unconditional row's too)."""
        return 1 if self.request.guidance is None else 2

    @property
    def guide_context(self) -> list[int]:
        """The unconditional row's tokens (``Guidance.context``); a request without guidance has none."""
        # A continuation's prompt ends with its own earlier output (``resumed_tokens``): output too.
        request = self.request
        return request.guidance.context(self.context, len(request.prompt_ids) - request.resumed_tokens)

    @property
    def room(self) -> int:
        """Draft tokens the next step may propose: the bonus token always comes on top."""
        return self.request.max_tokens - len(self.out) - 1

    def cap(self, spec: Speculation) -> Speculation:
        """``spec`` within what this request can still use."""
        room = self.room
        if not self.speculating or room <= 0 or spec.plain:
            return PLAIN
        if spec.tree is not None:
            # replace, not a new TreeShape: the shape's other fields (SAGE's width decay, threshold) stay.
            return Speculation(0, replace(spec.tree, depth=min(spec.tree.depth, room)))
        return Speculation(min(spec.window, room), None)

    def advance(self, result: StepResult) -> list[int]:
        """Record a verified step; returns the tokens it adds (cut at a stop token / max_tokens)."""
        self.stats.record(result)
        new: list[int] = []
        for token in result.emitted_tokens:
            new.append(token)
            self.out.append(token)
            self.context.append(token)
            if token in self.stop_ids:
                self.finish_reason = "stop"
            elif len(self.out) == self.request.max_tokens:
                self.finish_reason = "length"
            if self.done:
                break
        return new

    def finish(self, reason: str) -> None:
        """End the request between steps (a client gone, a deadline passed)."""
        if not self.done:
            self.finish_reason = reason
            self.send(StreamItem([], reason))

    def fail(self, error: StepError) -> None:
        """End the request because its step failed; the stream says so instead of finishing."""
        if not self.done:
            self.finish_reason = "error"
            self.send(StreamItem([], error=error))

    def send(self, item: StreamItem) -> None:
        if self.emit is not None:
            self.emit(item)


class DraftRouter(Protocol):
    """Chooses the draft of each ``AUTO_DRAFT`` request (``specserve.router``): once the prefill is
    done (``route``), then again every step (``revisit``: a draft name to switch to, or None to
    keep it); ``finish`` sees the request end. Every answer is a configured draft or NO_DRAFT."""

    def route(self, state: RequestState, batch_size: int) -> str: ...

    def revisit(self, state: RequestState, batch_size: int) -> str | None: ...

    def finish(self, state: RequestState) -> None: ...

    def observe(self, record: StepRecord) -> None: ...


class Policy(Protocol):
    """Chooses each request's speculation for the next step (``specserve.policies``)."""

    def choose(self, state: RequestState, batch_size: int) -> Speculation: ...

    def observe(self, record: StepRecord) -> None: ...


class StaticPolicy:
    """Every step uses the window or tree the request asked for: the scheduler's policy when none
    adapts speculation (``specserve generate``, ``bench engine``)."""

    def choose(self, state: RequestState, batch_size: int) -> Speculation:
        return state.request.speculation

    def observe(self, record: StepRecord) -> None:
        pass
