"""The in-process engine: a target, its drafts by name, and text in / text out.

It runs the same scheduler and step loop as a served target replica (``replicas/step_loop.py``),
with the drafts in-process and model work in the caller's thread: ``specserve generate`` and
``bench engine`` measure the code that serves.
"""

from __future__ import annotations

import asyncio
import time
import uuid
from collections.abc import Callable, Sequence
from dataclasses import dataclass, replace
from pathlib import Path

from specserve.data.answers import answer_outputs
from specserve.replicas.draft_server import DraftServer
from specserve.replicas.drafts.base import Draft, draft_model, needs_features, vocabulary_error
from specserve.replicas.drafts.factory import draft_from_model
from specserve.replicas.drafts.hsr_head import feature_layers
from specserve.replicas.drafts.prompt_lookup import PromptLookupDraft
from specserve.replicas.drafts.suffix import SuffixDraft
from specserve.replicas.model_store import REFERENCE_TARGET, LoadedModel, load_causal_lm, quantized_name
from specserve.replicas.model_worker import InlineWorker, ModelWorker
from specserve.replicas.sampling import SamplingParams
from specserve.replicas.request import AUTO_DRAFT, NO_DRAFT, DraftRouter, RequestState, SpecRequest, StaticPolicy
from specserve.replicas.scheduler import Scheduler
from specserve.replicas.step import SpecStats, TokenLogprob, TreeShape
from specserve.replicas.step_loop import StepLoop
from specserve.replicas.target import Target
from specserve.replicas.model.image_tokens import placeholder_for
from specserve.replicas.pictures import image_prompt_ids, target_image_store
from specserve.replicas.vlm import is_vlm_folder, language_model, load_vlm, target_text
from specserve.replicas.prompt_ids import encode_chat, encode_text


@dataclass
class GenerateRequest:
    prompt: str
    max_tokens: int = 128
    draft: str = "prompt-lookup"
    window: int = 4
    tree: TreeShape | None = None
    params: SamplingParams = SamplingParams()
    chat: bool = True   # render the prompt with the model's chat template
    prior_alpha: float | None = None   # the cluster's α for the draft (a warm start: policies/priors.py)
    prior_learned: dict | None = None  # the cluster's carried rule state ({"version", "sums"}: policies/carry.py)
    images: tuple = ()   # PIL images shown before the prompt (a VLM target)
    topic: int | None = None   # the prompt's task topic (``SpecRequest.topic``)


@dataclass
class Generation:
    token_ids: list[int]
    finish_reason: str   # "stop" (an EOS token) or "length" (max_tokens), as in the OpenAI API
    stats: SpecStats
    routing: dict | None = None   # the draft router's decision (``spec.router``), when one decided
    logprobs: list[TokenLogprob] | None = None   # per token, when the request asked
    prompt_logprobs: list[TokenLogprob | None] | None = None   # per prompt token, when the request asked


def in_process_server(name: str, draft: Draft, ensemble: dict | None = None, tokenizer=None,
                      images=None, apart: bool = False) -> DraftServer:
    """``draft`` served in-process: a draft of its own (and KV cache) per session, all on the
    draft's one model; a model-free draft (prompt lookup) serves every session as it is.
    ``ensemble``: a draft LM's chains as a TABED ensemble of its views (``DraftServer``);
    ``images``: a VLM target's ``ImageStore``, which its picture views read. ``apart``: the
    draft's model work runs on a one-thread model worker of its own, beside the target's
    forward (the step loop drafts ahead with it), instead of in the caller's thread."""
    model = draft_model(draft)
    windowed = getattr(draft, "windowed", False)
    make = (lambda: draft) if model is None else (lambda: draft_from_model(name, model, windowed))
    worker = ModelWorker(f"draft-{name}", threads=1) if apart else InlineWorker()
    return DraftServer(name, worker=worker, make_draft=make, ensemble=ensemble, tokenizer=tokenizer,
                       images=images)


def run_batch(target: Target, drafts: dict[str, DraftServer], requests: list[SpecRequest],
              eos_token_ids: frozenset[int] | set[int] = frozenset(), policy=None,
              on_tokens: Callable[[int, list[int]], None] | None = None, prefill_chunk: int = 512,
              router: DraftRouter | None = None, max_running: int | None = None,
              grammar_tokenizer: Callable[[], object] | None = None, grammar_draft: bool = True) -> list[Generation]:
    """Every request through one scheduler (batched as the target's slots allow, or at most
    ``max_running`` at once: the next waiting request enters as one finishes), in-process.
    ``on_tokens(i, tokens)`` sees request i's tokens as each step verifies them. ``router``
    chooses the draft of ``AUTO_DRAFT`` requests (and learns from every request).
    ``grammar_tokenizer``, ``grammar_draft``: for requests with a grammar (``Scheduler``)."""
    scheduler = Scheduler(target, policy or StaticPolicy(), eos_token_ids, prefill_chunk=prefill_chunk,
                          max_running=max_running, router=router, grammar_tokenizer=grammar_tokenizer,
                          grammar_draft=grammar_draft)
    loop = StepLoop(scheduler, drafts, InlineWorker())
    states = []
    for i, request in enumerate(requests):
        emit = None if on_tokens is None else (lambda item, i=i: on_tokens(i, item.token_ids))
        states.append(loop.add(request, emit))
    asyncio.run(loop.run_until_idle())
    return [generation(s) for s in states]


def generation(state: RequestState) -> Generation:
    """What a finished request hands back."""
    return Generation(state.out, state.finish_reason or "length", state.stats, state.routing, state.logprobs,
                      state.prompt_logprobs)


def run_side_by_side(targets: list[Target], drafts: dict[str, DraftServer],
                     runs: list[tuple[list[SpecRequest], object]], eos_token_ids: frozenset[int] | set[int] = frozenset(),
                     max_running: int | None = None,
                     on_tokens: Callable[[int, int, list[int]], None] | None = None) -> list[tuple[list[Generation], float]]:
    """Several runs of requests (each with its policy, its own scheduler and target) in one
    thread, their steps taking turns: each run's seconds are the sum of its own steps. A noisy
    neighbour on a shared machine slows whatever step is running, so two runs compared this way
    see the same machine to within a step instead of within a run, whose rounds of the same code
    differ more (docs/benchmarks.md §4.2). ``on_tokens(run, i, tokens)`` sees request i of a run's tokens
    as each of its steps verifies them."""
    if len(targets) != len(runs):
        raise ValueError(f"one target per run: {len(targets)} targets for {len(runs)} runs")
    loops = [StepLoop(Scheduler(target, policy or StaticPolicy(), eos_token_ids, max_running=max_running),
                      drafts, InlineWorker()) for target, (_, policy) in zip(targets, runs)]

    def emit(run: int, i: int):
        return None if on_tokens is None else (lambda item: on_tokens(run, i, item.token_ids))

    states = [[loop.add(request, emit(run, i)) for i, request in enumerate(requests)]
              for run, (loop, (requests, _)) in enumerate(zip(loops, runs))]
    seconds = [0.0] * len(loops)

    async def take_turns() -> None:
        turn = 0
        while any(loop.scheduler.has_work for loop in loops):
            # The first to step changes every step, so no run always follows the same other one.
            for i in [*range(turn % len(loops), len(loops)), *range(turn % len(loops))]:
                if loops[i].scheduler.has_work:
                    start = time.perf_counter()
                    await loops[i].step()
                    seconds[i] += time.perf_counter() - start
            turn += 1

    asyncio.run(take_turns())
    return [([generation(s) for s in mine], sec) for mine, sec in zip(states, seconds)]


def speculative_generate(
    target: Target,
    draft: Draft | None,
    prompt_ids: list[int],
    max_tokens: int,
    params: SamplingParams,
    window: int = 0,
    tree: TreeShape | None = None,
    eos_token_ids: frozenset[int] | set[int] = frozenset(),
    on_tokens: Callable[[list[int]], None] | None = None,
) -> Generation:
    """One request with one draft object. ``draft=None``, or ``window=0`` without a tree, is
    plain decoding through the same path. A VLM target's prompt holds its pictures' image tokens
    (``ImageStore.register``)."""
    name = NO_DRAFT if draft is None or (window <= 0 and tree is None) else draft.name
    drafts = {} if draft is None else {draft.name: in_process_server(draft.name, draft)}
    request = SpecRequest(list(prompt_ids), max_tokens, params, name, window, tree, uuid.uuid4().hex,
                          image_placeholder=placeholder_for(target.images, prompt_ids))
    return run_batch(target, drafts, [request], eos_token_ids,
                     on_tokens=None if on_tokens is None else (lambda _, tokens: on_tokens(tokens)))[0]


class SpecEngine:
    def __init__(self, target: LoadedModel, drafts: dict[str, Draft], slots: int = 16,
                 router: DraftRouter | None = None, ensembles: dict[str, dict] | None = None):
        """``router``: the draft router of ``spec.draft`` "auto" requests (``router/draft_router.py``);
        a benchmark may swap it between runs. ``ensembles``: the drafts (draft LMs) whose chains
        are TABED ensembles, with their settings (``EnsembleDraftLM``'s keywords)."""
        self.loaded = target
        self.router = router
        text = target_text(target.tokenizer, target.model.config)
        self.tokenizer, self.processor = text.tokenizer, text.processor
        self.images = None
        self.text_model = target.model
        if self.processor is not None:   # the target runs the language model; pictures go through the store
            self.text_model = language_model(target.model)
            self.images = target_image_store(target.model, self.processor)
        self.target = Target(self.text_model, slots, images=self.images)
        for name, draft in drafts.items():
            model = draft_model(draft)
            error = vocabulary_error(name, None if model is None else model.config.vocab_size, self.target.vocab)
            if error is not None:
                raise ValueError(error)
            if needs_features(draft) and model is not None:   # kept from the first forward on
                self.target.tap_features(feature_layers(model.config))
        self.drafts = drafts
        self.ensembles = dict(ensembles or {})
        self.servers = self._servers()
        self.max_context = getattr(self.text_model.config, "max_position_embeddings", None)

    @classmethod
    def load(
        cls,
        target: str = REFERENCE_TARGET,
        draft_models: list[str] = (),
        dtype: str = "auto",
        device: str | None = None,
        slots: int = 16,
        suffix_seed: str | Path | None = None,
        ensembles: dict[str, dict] | None = None,
    ) -> "SpecEngine":
        """``suffix_seed``: also a suffix draft, its index seeded with the answers in this folder
        (``data/answers.py``). In-process it remembers no output of its own: every request finds
        the index as it started (a benchmark's rows must not warm each other). ``ensembles``:
        drafts by name, each ``{"model": a draft LM, **EnsembleDraftLM's keywords}``: TABED
        ensembles of that model's views. A draft model named ``<model>-int8`` is ``<model>``
        with its weights rounded to int8 rows (``model_store.quantized_name``)."""
        loaded = (load_vlm(target, dtype=dtype, device=device) if is_vlm_folder(target)
                  else load_causal_lm(target, dtype=dtype, device=device))
        drafts: dict[str, Draft] = {PromptLookupDraft.name: PromptLookupDraft()}
        if suffix_seed is not None:
            drafts[SuffixDraft.name] = SuffixDraft(seed=answer_outputs(suffix_seed))
        models: dict[str, LoadedModel] = {}   # each draft LM loaded once, however many drafts use it

        def model(name: str) -> LoadedModel:
            if name not in models:
                path, quantization = quantized_name(name)
                loaded = load_causal_lm(path, dtype=dtype, device=device, quantization=quantization)
                models[name] = replace(loaded, name=Path(name).name)
            return models[name]

        for name in draft_models:
            lm = model(name)
            drafts[lm.name] = draft_from_model(lm.name, lm.model)
        settings = {}
        for name, ensemble in (ensembles or {}).items():
            settings[name] = {k: v for k, v in ensemble.items() if k != "model"}
            drafts[name] = draft_from_model(name, model(ensemble["model"]).model)
        return cls(loaded, drafts, slots, ensembles=settings)

    def _servers(self) -> dict[str, DraftServer]:
        return {name: in_process_server(name, draft, self.ensembles.get(name), self.tokenizer, self.images)
                for name, draft in self.drafts.items()}

    def reset_caches(self, captions: bool = True) -> None:
        """Forget every KV cache. Slots otherwise keep their longest common prefix with the next
        request (a free prefix cache); benchmarks start each generation cold. ``captions``: the
        pictures' captions too (a caption view's next request has its pictures captioned again).
        What drafts learned across requests (a TABED ensemble's prior) is kept, as a replica keeps it."""
        self.target.kv.reset()
        if self.images is not None and captions:
            self.images.captions.clear()
        previous, self.servers = self.servers, self._servers()
        for name, server in self.servers.items():
            if name in previous:
                server.keep_learning_of(previous[name])

    @property
    def draft_names(self) -> list[str]:
        return [NO_DRAFT, *self.drafts]

    def encode(self, prompt: str, chat: bool = True, images=()) -> list[int]:
        """Prompt ids; with ``images`` (a VLM target, chat), the pictures first, each as its image
        tokens (``image_tokens``)."""
        if not prompt or not prompt.strip():
            raise ValueError("the prompt is empty: give some text to continue")
        if images:
            if self.images is None:
                raise ValueError(f"{self.loaded.name} reads text only: images need a vision-language target")
            if not chat:
                raise ValueError("images go in a chat prompt (chat=True)")
            content = [{"type": "image"} for _ in images] + [{"type": "text", "text": prompt}]
            return self.encode_messages([{"role": "user", "content": content}], images)
        if chat:
            return encode_chat(self.tokenizer, [{"role": "user", "content": prompt}])
        return encode_text(self.tokenizer, prompt)

    def encode_messages(self, messages: list[dict], images=(), clips=(),
                        fps: float | Sequence[float | None] | None = None) -> list[int]:
        """A conversation's prompt ids (a VLM target): the messages as the processor's chat template
        writes them, each ``{"type": "image"}`` part one of ``images``, in order, as its image tokens,
        and each ``{"type": "video"}`` part one of ``clips`` (a list of frames) as its temporal
        patches, where the VLM reads clips as video (``ImageStore.clip``; else give the frames as
        pictures). ``fps``: the clips' frame rate, one for all or one per clip (None: the default)."""
        if self.images is None:
            raise ValueError(f"{self.loaded.name} reads text only: images need a vision-language target")
        text = self.processor.apply_chat_template(messages, tokenize=False, add_generation_prompt=True)
        ids = self.tokenizer(text, add_special_tokens=False)["input_ids"]
        ids = image_prompt_ids(ids, list(images), self.images.register, self.images.placeholder)
        if not clips:
            return ids
        if self.images.clip is None:
            raise ValueError(f"{self.loaded.name} reads a clip as its frames: give them as pictures")
        rates = [fps] * len(clips) if fps is None or isinstance(fps, (int, float)) else [float(f) for f in fps]
        if len(rates) != len(clips):
            raise ValueError(f"fps gives {len(rates)} rates for {len(clips)} clips: give one, or one per clip")
        return image_prompt_ids(ids, list(zip(clips, rates)), lambda clip: self.images.register_clip(*clip),
                                self.images.video_placeholder, "video")

    def _spec_request(self, prompt_ids: list[int], request: GenerateRequest) -> SpecRequest:
        if request.draft == AUTO_DRAFT and self.router is None:
            raise ValueError("draft 'auto' needs a draft router: give SpecEngine one (specserve.router.draft_router)")
        if request.draft not in (NO_DRAFT, AUTO_DRAFT) and request.draft not in self.drafts:
            raise ValueError(f"unknown draft {request.draft!r}; available: {', '.join(self.draft_names)}")
        if self.max_context and len(prompt_ids) + request.max_tokens > self.max_context:
            raise ValueError(
                f"prompt ({len(prompt_ids)} tokens) + max_tokens ({request.max_tokens}) exceeds "
                f"the target's context of {self.max_context} tokens: shorten the prompt or lower max_tokens"
            )
        speculating = request.window > 0 or request.tree is not None
        placeholder = placeholder_for(self.images, prompt_ids)
        return SpecRequest(prompt_ids, request.max_tokens, request.params,
                           request.draft if speculating else NO_DRAFT, request.window, request.tree, uuid.uuid4().hex,
                           prior_alpha=request.prior_alpha, prior_learned=request.prior_learned,
                           image_placeholder=placeholder, topic=request.topic)

    def generate_ids(self, prompt_ids: list[int], request: GenerateRequest,
                     on_tokens: Callable[[list[int]], None] | None = None) -> Generation:
        return self.generate_batch_ids([prompt_ids], [request],
                                       None if on_tokens is None else (lambda _, t: on_tokens(t)))[0]

    def generate_batch_ids(self, prompt_ids: list[list[int]], requests: list[GenerateRequest],
                           on_tokens: Callable[[int, list[int]], None] | None = None, policy=None,
                           max_running: int | None = None) -> list[Generation]:
        """Several requests at once, batched in every step as a served replica batches them
        (``max_running``: at most that many in the batch, the others wait their turn)."""
        spec_requests = [self._spec_request(ids, r) for ids, r in zip(prompt_ids, requests)]
        return run_batch(self.target, self.servers, spec_requests, self.loaded.eos_token_ids, policy, on_tokens,
                         router=self.router, max_running=max_running)

    def generate_side_by_side(self, prompt_ids: list[list[int]], runs: list[tuple[list[GenerateRequest], object]],
                              max_running: int | None = None) -> list[tuple[list[Generation], float]]:
        """The same prompts once per run (its requests and policy), each run on a fresh target of
        its own over the shared model (``max_running`` slots, else the engine's), their steps
        taking turns (``run_side_by_side``): per run, its generations and the seconds of its own
        steps."""
        slots = min(max_running or self.target.slots, self.target.slots)
        targets = [Target(self.text_model, slots, images=self.images) for _ in runs]
        spec_runs = [([self._spec_request(ids, r) for ids, r in zip(prompt_ids, requests)], policy)
                     for requests, policy in runs]
        return run_side_by_side(targets, self.servers, spec_runs, self.loaded.eos_token_ids, max_running)

    def generate(self, request: GenerateRequest) -> dict:
        """The ``--json`` object: ``{text, token_ids, finish_reason, usage, spec}``."""
        prompt_ids = self.encode(request.prompt, request.chat, request.images)
        gen = self.generate_ids(prompt_ids, request)
        return {
            "text": self.tokenizer.decode(gen.token_ids, skip_special_tokens=True),
            "token_ids": gen.token_ids,
            "finish_reason": gen.finish_reason,
            "usage": {"prompt_tokens": len(prompt_ids), "completion_tokens": len(gen.token_ids)},
            "spec": {**gen.stats.summary(), **({"router": gen.routing} if gen.routing else {})},
        }
