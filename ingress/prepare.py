"""A request checked and turned into what a target replica serves: ``Prepared``.

Everything a client sends is checked here (model name, pictures, prompt, context length, draft,
policy) before any replica sees it; a failed check is an ``OpenAIError`` (400, 404 for an unknown
model) that says what to fix. The model name is checked first: a request for another model costs
nothing more, not even its pictures' decoding.

The work a request's size sets (decoding and hashing pictures, chat templating and tokenizing a
body of up to ``max_body_bytes``) runs in a worker thread: on the event loop it would stall every
stream of the ingress replica for as long as it takes (seconds for the largest body). A request
that fetches picture URLs runs on the fetch pool instead (``image_fetch.fetch_pool``), its one
fetch deadline starting when it arrives: a slow picture server then holds only those few threads.
"""

from __future__ import annotations

import asyncio
import functools
import time
import uuid
from dataclasses import dataclass

from specserve.ingress.config import IngressConfig
from specserve.ingress.image_fetch import fetch_pool
from specserve.ingress.images import decode_media, fetches, media_urls
from specserve.ingress.openai_api import (AUTO_DRAFT, NO_DRAFT, ChatCompletionRequest, ChatMessage, CompletionRequest,
                                          OpenAIError, VideoPart)
from specserve.ingress.structured import request_grammar
from specserve.ingress.tools import template_messages, template_teaches_tools, tool_grammar
from specserve.policies.registry import POLICIES, TREE_POLICY_NAMES
from specserve.replicas.model.image_tokens import picture_ids
from specserve.replicas.pictures import clip_preparer, image_prompt_ids, picture_preparer
from specserve.replicas.prompt_ids import encode_chat, encode_text
from specserve.replicas.request import SpecRequest
from specserve.replicas.sampling import SamplingParams
from specserve.replicas.step import TreeShape
from specserve.replicas.vlm import TargetText, image_token_id


@dataclass
class Prepared:
    """A checked request, ready for a target replica."""

    id: str
    spec_request: SpecRequest
    stop: list[str]
    echo: str | None = None   # the prompt's text, for a completion that echoes it
    tool_calls: bool = False  # the output's tool calls are parsed out of it (``tools.py``)


def check_model(asked: str | None, served: str) -> None:
    """A request naming another model than this deployment's is a 404 (None: the body names none)."""
    if asked is not None and asked != served:
        raise OpenAIError(f"The model `{asked}` does not exist; this server serves `{served}`.",
                          status=404, param="model", code="model_not_found")


def speculation(spec, config: IngressConfig, default_draft: str) -> tuple[str, int, TreeShape | None, str | None]:
    """(draft, window, tree, policy) of a request's ``spec`` (None: none given), its names checked:
    an unknown draft or policy is a 400 naming the field. A request under a tree policy that names
    neither a window nor a tree gets ``default_tree`` (unpinned: the policy adapts it)."""
    draft = spec.draft if spec and spec.draft else default_draft
    known = [AUTO_DRAFT, NO_DRAFT, *config.draft_names]
    if draft not in known:
        raise OpenAIError(f"unknown draft {draft!r}; available: {', '.join(known)}", param="spec.draft",
                          code="draft_not_found")
    policy = spec.policy if spec else None
    if policy is not None and policy not in POLICIES:
        raise OpenAIError(f"unknown policy {policy!r}; available: {', '.join(POLICIES)}",
                          param="spec.policy", code="policy_not_found")
    window = spec.window if spec and spec.window is not None else config.default_window
    tree = TreeShape(spec.tree.depth, spec.tree.top_k, spec.tree.budget) if spec and spec.tree else None
    if tree is None and not (spec and spec.window is not None) and (policy or config.policy) in TREE_POLICY_NAMES:
        tree = config.default_tree
    return draft, window, tree, policy


def validation_message(errors: list[dict]) -> tuple[str, str | None]:
    """(message, param) of pydantic's errors for a body, the way OpenAI words a bad field: the
    deepest error, the most specific (a union tried as each of its types errs in every one: a bad
    content part is also "not a string"), its place without pydantic's labels of those types."""
    first = max(errors, key=lambda e: len(e.get("loc", ())))
    loc = [str(part) for part in first.get("loc", ()) if part != "body" and not _type_label(part)]
    param = ".".join(loc) or None
    if first.get("type") == "json_invalid":
        return f"the body is not valid JSON ({first.get('ctx', {}).get('error', first['msg'])}): send a JSON object", None
    if param is None and first.get("type") in ("model_attributes_type", "dict_type", "missing"):
        return "the body must be a JSON object (Content-Type: application/json) with the request's fields", None
    return (f"{param}: {first['msg']}" if param else first["msg"]), param


def _type_label(part) -> bool:
    """Whether a place in pydantic's error location names a type of a union it tried (``str``,
    ``int``, ``list[...]``, a model's class: ``NamedToolChoice``, ``VideoPart``), not a field
    (the API's fields are lower case)."""
    return isinstance(part, str) and (part in ("str", "int", "float", "bool") or "[" in part or part[:1].isupper())


class Preparer:
    def __init__(self, text: TargetText, config: IngressConfig):
        self.tokenizer, self.processor, self.config = text.tokenizer, text.processor, config
        self.model_id = config.model_id
        # A VLM's pictures are prepared here, as its processor does, and named by their pixels
        # (``image_tokens``): the prefix-affinity router and the replicas' caches key on them.
        self.image_placeholder = self.prepare_clip = self.video_placeholder = None
        if self.processor is not None:
            self.prepare_picture = picture_preparer(self.processor, text.config)
            self.image_placeholder = image_token_id(text.config)
            # A class that reads a clip as temporal patches (Qwen2-VL's, Qwen2.5-VL's) sees it as one
            # video part.
            self.prepare_clip = clip_preparer(text.config, self.processor.image_processor)
            self.video_placeholder = getattr(text.config, "video_token_id", None)
        self.max_context = getattr(text.text_config, "max_position_embeddings", None)
        if config.max_model_len is not None:
            self.max_context = min(self.max_context or config.max_model_len, config.max_model_len)
        self.vocab_size = getattr(text.text_config, "vocab_size", None)

    async def prepare(self, req: CompletionRequest | ChatCompletionRequest) -> Prepared:
        check_model(req.model, self.model_id)
        media = [p for m in req.messages for p in m.media()] if isinstance(req, ChatCompletionRequest) else []
        if media and self.processor is None:
            raise OpenAIError(f"`{self.model_id}` reads text only: drop the image_url and video_url parts, or serve a "
                              "vision-language target", param="messages", code="images_not_supported")
        if fetches(media_urls(media), self.config.images):
            # The deadline starts now, so that a wait for a fetch thread counts against it: a
            # request that cannot start fetching in time fails as a timed-out fetch does.
            deadline = time.monotonic() + self.config.images.fetch_timeout_s
            return await asyncio.get_running_loop().run_in_executor(fetch_pool, self._prepare, req, media, deadline)
        return await asyncio.to_thread(self._prepare, req, media)

    def _prepare(self, req: CompletionRequest | ChatCompletionRequest, media: list,
                 deadline: float | None = None) -> Prepared:
        """The checks and the work a request's size sets (in a worker thread); its picture fetches
        end by ``deadline``. A clip's sampled frames are pictures of the prompt, one after another,
        or, for a class that reads clips as temporal patches (Qwen2-VL's, Qwen2.5-VL's), one video
        part at the clip's frame rate."""
        decoded = decode_media(media, self.config.images, deadline=deadline) if media else []
        frames, pictures, clips = {}, [], []
        for part, shown in zip(media, decoded):
            if isinstance(part, VideoPart) and self.prepare_clip is not None:
                try:
                    clips.append(self.prepare_clip(shown, shown.fps))
                except ValueError as err:
                    raise OpenAIError(f"a video's frames: {err}", param="messages") from err
                frames[id(part)] = None
            else:
                pictures += [self.prepare_picture(p) for p in shown]
                frames[id(part)] = len(shown)
        prompt_ids = self._prompt_ids(req, pictures, lambda part: frames[id(part)], clips)
        units = tuple(unit for shown in (*pictures, *clips) for unit in shown.units)
        is_chat = isinstance(req, ChatCompletionRequest)
        max_tokens = req.token_limit if is_chat else req.max_tokens
        if self.max_context:
            room = self.max_context - len(prompt_ids)
            if room < 1 or (max_tokens is not None and max_tokens > room):
                raise OpenAIError(
                    f"This model's maximum context length is {self.max_context} tokens. However, you requested "
                    f"{len(prompt_ids) + (max_tokens or 1)} tokens ({len(prompt_ids)} in the prompt, "
                    f"{max_tokens or 1} for the completion). Shorten the prompt or lower max_tokens.",
                    param="max_tokens" if room >= 1 else ("messages" if is_chat else "prompt"),
                    code="context_length_exceeded",
                )
            max_tokens = max_tokens or room
        spec = req.spec
        # "auto" goes to the target replica as it is: its draft router chooses after the prefill
        # (or, with the router off, the configured default draft).
        draft, window, tree, policy = speculation(spec, self.config, AUTO_DRAFT)
        if spec is not None and (spec.acceptance == "lantern" or spec.lantern is not None):
            raise OpenAIError("relaxed acceptance (lantern) is for image tokens: text is accepted exactly, so its "
                              "output is the target's own", param="spec.acceptance")
        params = self._sampling(req, max_tokens or 16)
        grammar = request_grammar(req)
        tool_calls = is_chat and req.tool_mode != "none"
        if tool_calls and self.config.tool_parser is None:
            raise OpenAIError("this deployment parses no tool calls (its tool_parser is off): drop tools or "
                              "set tool_choice to none", param="tools", code="tools_not_supported")
        if is_chat and req.tool_mode in ("required", "named"):
            if grammar is not None:
                raise OpenAIError("a required or named tool_choice constrains the output already: drop the "
                                  "output constraint or the tool_choice", param="tool_choice")
            grammar = tool_grammar(req)
        if is_chat:
            logprobs, echo = (req.top_logprobs or 0) if req.logprobs else None, False
        else:
            logprobs, echo = req.logprobs, req.echo
        request_id = uuid.uuid4().hex
        return Prepared(
            id=request_id,
            spec_request=SpecRequest(prompt_ids, max_tokens or 16, params, draft, window, tree, request_id=request_id,
                                     pinned=bool(spec and (spec.window is not None or spec.tree is not None)),
                                     policy=policy, stream_interval=self.config.stream_interval,
                                     cache_salt=req.cache_salt, images=units,
                                     image_placeholder=self.image_placeholder if units else None,
                                     logprobs=logprobs, prompt_logprobs=logprobs if echo else None,
                                     grammar=grammar, grammar_draft=spec.grammar_draft if spec else None),
            stop=req.stop,
            tool_calls=tool_calls,
            echo=(req.prompt if isinstance(req.prompt, str) else self.tokenizer.decode(prompt_ids)) if echo else None,
        )

    def _token_ids(self, ids, param: str) -> tuple[int, ...]:
        vocab = self.vocab_size or len(self.tokenizer)
        bad = [t for t in ids if not 0 <= t < vocab]
        if bad:
            raise OpenAIError(f"{param}: token ids must be in [0, {vocab}), got {bad[:5]}", param=param)
        return tuple(ids)

    def _sampling(self, req: CompletionRequest | ChatCompletionRequest, max_tokens: int) -> SamplingParams:
        """The request's sampling fields, token ids checked against the target's vocabulary."""
        if req.min_tokens > max_tokens:
            raise OpenAIError(f"min_tokens ({req.min_tokens}) must not exceed max_tokens ({max_tokens})",
                              param="min_tokens")
        bias = sorted((req.logit_bias or {}).items())
        ids = self._token_ids([int(key) for key, _ in bias], "logit_bias")
        return SamplingParams(
            temperature=req.temperature, top_p=req.top_p, top_k=max(req.top_k, 0), seed=req.seed, min_p=req.min_p,
            presence_penalty=req.presence_penalty, frequency_penalty=req.frequency_penalty,
            repetition_penalty=req.repetition_penalty, logit_bias=tuple(zip(ids, (b for _, b in bias))),
            allowed_token_ids=(None if req.allowed_token_ids is None
                               else self._token_ids(sorted(set(req.allowed_token_ids)), "allowed_token_ids")),
            min_tokens=req.min_tokens, stop_token_ids=self._token_ids(req.stop_token_ids or (), "stop_token_ids"),
            ignore_eos=req.ignore_eos)

    @functools.cached_property
    def teaches_tools(self) -> bool:
        return template_teaches_tools(self.processor or self.tokenizer)

    @functools.cached_property
    def max_token_bytes(self) -> int:
        """The most UTF-8 bytes one token of the vocabulary decodes to (special tokens included)."""
        pieces = self.tokenizer.batch_decode([[i] for i in range(len(self.tokenizer))], skip_special_tokens=False)
        return max(len(piece.encode("utf-8", "replace")) for piece in pieces)

    def _check_text_size(self, text_bytes: int, param: str) -> None:
        """Refuse text that must tokenize to more than the context before tokenizing it: a token
        decodes to at most ``max_token_bytes``, so ``text_bytes / max_token_bytes`` tokens at least
        (halved again, for tokenizers whose normalizer drops characters). Tokenizing a body of
        megabytes takes seconds of a worker thread and, freeing its result, of the event loop."""
        if not self.max_context or text_bytes <= self.max_context:   # too few bytes to know
            return
        at_least = text_bytes // (2 * self.max_token_bytes)
        if at_least > self.max_context:
            raise OpenAIError(
                f"This model's maximum context length is {self.max_context} tokens. However, your prompt's "
                f"{text_bytes} bytes make at least {at_least} tokens. Shorten the prompt.",
                param=param, code="context_length_exceeded")

    def _prompt_ids(self, req: CompletionRequest | ChatCompletionRequest, pictures: list, frames,
                    clips: list = ()) -> list[int]:
        """``frames(part)``: how many pictures a clip part became (its sampled frames), None where
        it is one video part; ``clips``: those parts' prepared temporal patches, in order."""
        if isinstance(req, ChatCompletionRequest):
            self._check_text_size(sum(len(m.text().encode("utf-8")) for m in req.messages), "messages")
        elif isinstance(req.prompt, str):
            self._check_text_size(len(req.prompt.encode("utf-8")), "prompt")
        if isinstance(req, ChatCompletionRequest):
            if not pictures and not clips and not any(m.text().strip() for m in req.messages):
                raise OpenAIError("messages: every message is empty; give some text", param="messages")
            if not pictures and not clips:
                return encode_chat(self.tokenizer, *template_messages(req, self.teaches_tools))
            messages, tools = template_messages(req, self.teaches_tools,
                                                content=lambda m: m.template_content(frames))
            text = self.processor.apply_chat_template(messages, tools=tools, tokenize=False, add_generation_prompt=True)
            ids = self.tokenizer(text, add_special_tokens=False)["input_ids"]
            try:
                ids = image_prompt_ids(ids, pictures, lambda p: p.ids(picture_ids), self.image_placeholder)
                if self.prepare_clip is None:
                    return ids
                return image_prompt_ids(ids, list(clips), lambda c: c.ids(picture_ids), self.video_placeholder, "video")
            except ValueError as err:
                raise OpenAIError(str(err), param="messages") from err
        if isinstance(req.prompt, str):
            if not req.prompt.strip():
                raise OpenAIError("prompt: the prompt is empty; give some text", param="prompt")
            return encode_text(self.tokenizer, req.prompt)
        if not req.prompt:
            raise OpenAIError("prompt: the list of token ids is empty", param="prompt")
        bad = [t for t in req.prompt if not 0 <= t < (self.vocab_size or 2**31)]
        if bad:
            raise OpenAIError(f"prompt: token ids must be in [0, {self.vocab_size}), got {bad[:5]}", param="prompt")
        return list(req.prompt)
