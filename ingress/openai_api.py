"""The OpenAI-compatible request bodies, and the error every bad request turns into.

Requests are checked here, at the edge, so that nothing a client sends can reach a replica in a
shape it cannot serve. Fields OpenAI defines but specserve cannot honour (``suffix``) are refused
with the field named; unknown fields are refused, as OpenAI does. ``spec`` is specserve's extension.
Every string must be text UTF-8 can carry (no lone surrogates, which JSON escapes can spell);
names (model, draft, policy) must also be free of control characters, which content may hold.
"""

from __future__ import annotations

from typing import Annotated, Literal

from pydantic import (AfterValidator, BaseModel, BeforeValidator, ConfigDict, Discriminator, Field, Tag,
                      field_validator, model_validator)
from pydantic_core import PydanticCustomError

from specserve.replicas.lantern import MAX_K as LANTERN_MAX_K
from specserve.replicas.logprobs import MAX_TOP_LOGPROBS
from specserve.replicas.request import AUTO_DRAFT, NO_DRAFT   # spec.draft: "auto", the router decides; "none", no speculation

__all__ = ["AUTO_DRAFT", "NO_DRAFT", "MAX_WINDOW", "MAX_TREE_DEPTH", "MAX_TREE_BUDGET", "MAX_STOP_CHARS", "Text", "Name"]

# Request limits: beyond these a step costs more than any draft can save, and an unbounded
# window or tree is a cheap way to make a replica allocate without end.
MAX_WINDOW = 16
MAX_TREE_DEPTH = 16
MAX_TREE_BUDGET = 64
# A stop string is matched against the decoded text's tail on every streamed piece.
MAX_STOP_CHARS = 256
# Token lists a request may name (stop_token_ids, logit_bias) and the allowed set, whose
# processors build a vocabulary-sized row once per request.
MAX_TOKEN_LIST = 1024
MAX_ALLOWED_TOKENS = 262144
# Choices of one request (``n``, ``best_of``): each holds a KV slot and a draft session of a
# replica, so more than a replica's batch would queue behind each other.
MAX_CHOICES = 16
# OpenAI's limits on tools: how many a request may offer, and a function name's shape.
MAX_TOOLS = 128
# Frames a clip sent as a list of pictures may hold (the ingress samples at most the server's
# max_video_frames of them before decoding any): bounds what a request's JSON makes it parse.
MAX_CLIP_FRAME_URLS = 1024
TOOL_NAME = r"^[a-zA-Z0-9_-]{1,64}$"


def _check_unicode(value, keys_only: bool = False):
    """``value`` unchanged if every string in it (or only every key of its objects) encodes as UTF-8."""
    # JSON's \ud800-\udfff escapes decode to lone surrogates, which no tokenizer, log line or
    # response body can encode: refuse them before a union's branches each report their own
    # failure, so that the 400 names the field.
    pending = [("", value, not keys_only, "text")]
    while pending:
        where, item, check, what = pending.pop()
        if isinstance(item, str) and check:
            try:
                item.encode("utf-8")
            except UnicodeEncodeError as err:
                raise PydanticCustomError(
                    "invalid_unicode", "the {what}{where} is not valid Unicode: a lone surrogate at character {at}; "
                    "send UTF-8 (a \\ud800-\\udbff escape must be followed by a \\udc00-\\udfff one)",
                    {"what": what, "where": f" at {where.lstrip('.')}" if where else "", "at": err.start}) from None
        elif isinstance(item, dict):
            for key, field in item.items():
                pending.append((f"{where}.{key}" if isinstance(key, str) and key.isascii() else where, field, check, what))
                pending.append((where, key, True, "field name"))
        elif isinstance(item, list):
            pending.extend((f"{where}[{i}]", field, check, what) for i, field in enumerate(item))
    return value


def _no_controls(value: str) -> str:
    # Names are matched, logged and used as metric labels; content keeps its control characters
    # (OpenAI takes them, and a tokenizer reads them as any other character).
    bad = next((i for i, c in enumerate(value) if ord(c) < 0x20 or 0x7f <= ord(c) < 0xa0), None)
    if bad is not None:
        raise PydanticCustomError("control_character", "a name must not hold control characters "
                                  "(U+{code} at character {at})", {"code": f"{ord(value[bad]):04X}", "at": bad})
    return value


# Every string field of a request checks its text with ``Unicode`` (as ``Text``, or around a union
# of shapes); identifiers (model, draft and policy names) are ``Name``s.
Unicode = BeforeValidator(_check_unicode)
Text = Annotated[str, Unicode]
Name = Annotated[str, Unicode, AfterValidator(_no_controls)]


class OpenAIError(Exception):
    """An error answered with OpenAI's body: ``{"error": {"message", "type", "param", "code"}}``."""

    def __init__(self, message: str, status: int = 400, param: str | None = None,
                 code: str | None = None, type: str = "invalid_request_error", retry_after: int | None = None):
        super().__init__(message)
        self.message, self.status, self.param, self.code, self.type = message, status, param, code, type
        self.retry_after = retry_after   # seconds, for a retriable error (503): the Retry-After header

    def body(self) -> dict:
        return {"error": {"message": self.message, "type": self.type, "param": self.param, "code": self.code}}

    def headers(self) -> dict[str, str]:
        return {"Retry-After": str(self.retry_after)} if self.retry_after is not None else {}


class TreeOptions(BaseModel):
    model_config = ConfigDict(extra="forbid")
    depth: int = Field(ge=1, le=MAX_TREE_DEPTH, description="Levels of the draft tree.")
    top_k: int = Field(ge=1, le=8, description="Children per node.")
    budget: int = Field(ge=1, le=MAX_TREE_BUDGET, description="Nodes in all.")


class LanternOptions(BaseModel):
    """LANTERN's relaxation of an image token's acceptance (``replicas/lantern.py``)."""

    model_config = ConfigDict(extra="forbid")
    delta: float | None = Field(None, gt=0.0, lt=1.0, description="Probability moved onto a drafted code from its "
                                "nearest codes (default 0.4).")
    k: int | None = Field(None, ge=1, le=LANTERN_MAX_K, description="Nearest codes considered (default: an eighth "
                          "of the codebook).")


class SpecOptions(BaseModel):
    """How to speculate for this request (specserve's extension of the OpenAI body)."""

    model_config = ConfigDict(extra="forbid")
    draft: Name | None = Field(None, description="A draft name, 'auto' (the router's choice) or 'none' (plain decoding).")
    window: int | None = Field(None, ge=0, le=MAX_WINDOW, description="Window γ: draft tokens per step.")
    tree: TreeOptions | None = Field(None, description="Draft a token tree instead of a chain.")
    policy: Name | None = Field(None, description="How this request's window or tree adapts per step, instead of "
                               "the deployment's policy: a name from GET /v1/models' `policies`.")
    grammar_draft: bool | None = Field(None, description="Structured output: the tokens the grammar forces are the "
                                       "step's draft (default: the deployment's grammar_draft).")
    acceptance: Literal["exact", "lantern"] | None = Field(
        None, description="'exact' (lossless, the default) or 'lantern': LANTERN's relaxed acceptance of image "
        "tokens, lossy, for image generation only; the response's spec names it.")
    lantern: LanternOptions | None = None


class StreamOptions(BaseModel):
    model_config = ConfigDict(extra="forbid")
    include_usage: bool = False


class JsonSchemaFormat(BaseModel):
    model_config = ConfigDict(extra="forbid", populate_by_name=True)
    name: Name = Field(max_length=64)
    description: Text | None = None
    schema_: Annotated[dict, Unicode] = Field(alias="schema", description="The JSON schema the output follows.")
    strict: bool | None = None


class ResponseFormat(BaseModel):
    """OpenAI's ``response_format``: free text, any JSON object, or JSON following a schema."""

    model_config = ConfigDict(extra="forbid")
    type: Literal["text", "json_object", "json_schema"]
    json_schema: JsonSchemaFormat | None = None

    @model_validator(mode="after")
    def _schema_given(self):
        if (self.type == "json_schema") != (self.json_schema is not None):
            raise ValueError("json_schema is given with type json_schema, and only then")
        return self


class StructuredOutputs(BaseModel):
    """vLLM's ``structured_outputs``: exactly one of these constrains the output."""

    model_config = ConfigDict(extra="forbid")
    json_: Annotated[dict | str | None, Unicode] = Field(None, alias="json", description="A JSON schema.")
    regex: Text | None = None
    choice: list[Text] | None = Field(None, min_length=1)
    grammar: Text | None = Field(None, description="A Lark or GBNF (EBNF) grammar.")
    json_object: bool | None = None

    @model_validator(mode="after")
    def _one_constraint(self):
        given = [name for name in ("json_", "regex", "choice", "grammar", "json_object") if getattr(self, name)]
        if len(given) != 1:
            raise ValueError(f"give exactly one of json, regex, choice, grammar, json_object (got {len(given)})")
        return self


class _Common(BaseModel):
    """Sampling and speculation fields shared by both endpoints."""

    model_config = ConfigDict(extra="forbid")
    model: Name
    temperature: float = Field(1.0, ge=0.0, le=2.0, description="0 = greedy.")
    top_p: float = Field(1.0, gt=0.0, le=1.0)
    top_k: int = Field(0, ge=-1, description="Top-k filter; 0 or -1 = off (vLLM's extension).")
    seed: int | None = Field(None, ge=-(2**63), lt=2**63, description="Seeds the sampling (a 64-bit integer).")
    stop: Annotated[str | list[str] | None, Unicode] = Field(None, validate_default=True, description=f"Up to 4 strings of at most {MAX_STOP_CHARS} characters that end the text (not included).")
    stream: bool = False
    stream_options: StreamOptions | None = None
    n: int = Field(1, ge=1, le=MAX_CHOICES, description=(
        "Choices to generate: they share the prompt's prefill; a seeded request's choice i draws from seed + i."))
    presence_penalty: float = Field(0.0, ge=-2.0, le=2.0, description="Subtracted once from every token the output holds.")
    frequency_penalty: float = Field(0.0, ge=-2.0, le=2.0, description="Subtracted per occurrence in the output.")
    repetition_penalty: float = Field(1.0, gt=0.0, allow_inf_nan=False, description=(
        "Divides the positive logits (multiplies the negative ones) of every token in the prompt or the output "
        "(vLLM's extension); 1 = off."))
    logit_bias: dict[Text, float] | None = Field(None, max_length=MAX_TOKEN_LIST, description=(
        "Token id (as a string) -> a bias in [-100, 100] added to its logit."))
    min_p: float = Field(0.0, ge=0.0, le=1.0, description="Drop tokens less likely than min_p times the likeliest "
                         "(vLLM's extension).")
    min_tokens: int = Field(0, ge=0, description="Tokens before a stop token or the EOS may end the output (vLLM's extension).")
    stop_token_ids: list[int] | None = Field(None, max_length=MAX_TOKEN_LIST, description=(
        "Token ids that end the output, as the EOS does (vLLM's extension)."))
    ignore_eos: bool = Field(False, description="Run past the EOS until max_tokens or a stop (vLLM's extension).")
    allowed_token_ids: list[int] | None = Field(None, min_length=1, max_length=MAX_ALLOWED_TOKENS, description=(
        "Sample only among these token ids (vLLM's extension)."))
    user: Text | None = None
    spec: SpecOptions | None = None
    response_format: ResponseFormat | None = None
    structured_outputs: StructuredOutputs | None = None
    # vLLM's older names for structured_outputs' fields.
    guided_json: Annotated[dict | str | None, Unicode] = None
    guided_regex: Text | None = None
    guided_choice: list[Text] | None = Field(None, min_length=1)
    guided_grammar: Text | None = None
    return_token_ids: bool = Field(False, description="Add the generated token ids to the choice (vLLM's extension).")
    cache_salt: Text | None = Field(None, min_length=1, max_length=256, description=(
        "Prefix-cache isolation (vLLM's extension): a request reuses the target's cached KV only "
        "of requests with the same salt (draft model replicas' idle caches do not look at it yet)."))

    @model_validator(mode="before")
    @classmethod
    def _field_names_are_unicode(cls, body):
        # An unknown field is refused by its name, which the error then carries back.
        return _check_unicode(body, keys_only=True)

    @field_validator("stop")
    @classmethod
    def _stop_list(cls, value):
        stops = [value] if isinstance(value, str) else list(value or [])
        if len(stops) > 4:
            raise ValueError(f"at most 4 stop strings, got {len(stops)}")
        if any(not s for s in stops):
            raise ValueError("stop strings must not be empty")
        if any(len(s) > MAX_STOP_CHARS for s in stops):
            raise ValueError(f"a stop string has at most {MAX_STOP_CHARS} characters")
        return stops

    @field_validator("logit_bias")
    @classmethod
    def _logit_bias(cls, value):
        for key, bias in (value or {}).items():
            if not (key.isascii() and key.isdigit() and len(key) <= 10):
                raise ValueError(f"logit_bias keys are token ids written as strings, got {key[:20]!r}")
            if not -100.0 <= bias <= 100.0:
                raise ValueError(f"a logit_bias value is in [-100, 100], got {bias} for token {key}")
        return value


class CompletionRequest(_Common):
    prompt: Annotated[str | list[str] | list[int] | list[list[int]], Unicode] = Field(
        description="Text, token ids, or a one-element list of either (the shape batching clients send).")
    max_tokens: int | None = Field(16, ge=1, description="New tokens at most (OpenAI's default: 16).")
    echo: bool = Field(False, description="The prompt's text before the completion's (and, with logprobs, its tokens' "
                       "log-probabilities).")
    logprobs: int | None = Field(None, ge=0, le=MAX_TOP_LOGPROBS, description=(
        "Each token's log-probability with this many likeliest alternatives."))
    suffix: None = None
    best_of: int | None = Field(None, ge=1, le=MAX_CHOICES, description=(
        "Generate this many choices and return the n whose tokens' summed log-probability is highest."))

    @model_validator(mode="after")
    def _best_of_n(self):
        if self.best_of is not None and self.best_of < self.n:
            raise ValueError(f"best_of ({self.best_of}) must be at least n ({self.n})")
        if self.best_of is not None and self.best_of > self.n and self.stream:
            raise ValueError("best_of cannot be streamed: the best choices are known only at the end")
        return self

    @property
    def generated_choices(self) -> int:
        return self.best_of or self.n

    @field_validator("prompt")
    @classmethod
    def _one_prompt(cls, value):
        if isinstance(value, list) and value and isinstance(value[0], (str, list)):
            if len(value) != 1:
                raise ValueError(f"one prompt per request, got {len(value)}")
            return value[0]
        return value


class TextPart(BaseModel):
    model_config = ConfigDict(extra="forbid")
    type: Literal["text"]
    text: Text


class ImageURL(BaseModel):
    model_config = ConfigDict(extra="forbid")
    url: Text = Field(min_length=1, description="data:image/<type>;base64,<data>, or http(s) where the server fetches")
    detail: Literal["auto", "low", "high"] = "auto"   # taken and ignored: the VLM sees its own resolution


class ImagePart(BaseModel):
    model_config = ConfigDict(extra="forbid")
    type: Literal["image_url"]
    image_url: ImageURL


class VideoURL(BaseModel):
    """A clip: one animated picture (``url``), or its frames as pictures (``frames``), in order."""

    model_config = ConfigDict(extra="forbid")
    url: Text | None = Field(None, min_length=1, description="data: URL of an animated GIF, WebP or PNG (or "
                                                             "http(s) where the server fetches)")
    frames: list[Annotated[str, Unicode, Field(min_length=1)]] | None = Field(
        None, min_length=1, max_length=MAX_CLIP_FRAME_URLS, description="The clip's frames, each a picture's data URL "
                                                                        "(or http(s) where the server fetches).")
    fps: float | None = Field(None, gt=0, le=1000, description="The clip's frames a second as sent (default: an "
                                                               "animation's own; frames 2 a second). Qwen2.5-VL "
                                                               "places a clip in time by it.")

    @model_validator(mode="after")
    def _one_source(self):
        if (self.url is None) == (self.frames is None):
            raise ValueError("a video_url has either url (an animated GIF, WebP or PNG) or frames (a list of "
                             "pictures), not both and not neither")
        return self

    def urls(self) -> list[str]:
        return [self.url] if self.url is not None else list(self.frames)


class VideoPart(BaseModel):
    """vLLM's ``video_url`` content part. Container formats (MP4, WebM) are not decoded here: a
    clip comes as an animated picture or as a list of frames."""

    model_config = ConfigDict(extra="forbid")
    type: Literal["video_url"]
    video_url: VideoURL


_PART_TYPES = {"text": "TextPart", "image_url": "ImagePart", "video_url": "VideoPart"}


def _part_type(part) -> str | None:
    return _PART_TYPES.get(part.get("type") if isinstance(part, dict) else getattr(part, "type", None))


# A content part, picked by its type: a bad part's errors are its own type's alone (tagged by its
# class's name, which an error's place leaves out: ``prepare.validation_message``).
ContentPart = Annotated[
    Annotated[TextPart, Tag("TextPart")] | Annotated[ImagePart, Tag("ImagePart")] | Annotated[VideoPart, Tag("VideoPart")],
    Discriminator(_part_type, custom_error_type="invalid_part",
                  custom_error_message="a content part's type is 'text', 'image_url' or 'video_url'")]


class FunctionCall(BaseModel):
    model_config = ConfigDict(extra="forbid")
    name: Text
    arguments: Text = Field(description="The call's arguments, a JSON object as text.")


class ToolCall(BaseModel):
    """A call an assistant message made (sent back in the conversation that follows it)."""

    model_config = ConfigDict(extra="forbid")
    id: Text
    type: Literal["function"] = "function"
    function: FunctionCall


class ChatMessage(BaseModel):
    model_config = ConfigDict(extra="forbid")
    role: Annotated[Literal["system", "developer", "user", "assistant", "tool"], Unicode]
    content: Annotated[str | list[ContentPart] | None, Unicode] = None
    name: Text | None = None
    tool_calls: list[ToolCall] | None = Field(None, max_length=MAX_TOOLS)
    tool_call_id: Text | None = None

    @model_validator(mode="after")
    def _content_or_calls(self):
        if self.content is None and not (self.role == "assistant" and self.tool_calls):
            raise ValueError(f"a {self.role} message needs content (only an assistant's that makes tool_calls may omit it)")
        if self.tool_calls and self.role != "assistant":
            raise ValueError("only an assistant message makes tool_calls")
        if self.role == "tool" and not self.tool_call_id:
            raise ValueError("a tool message needs the tool_call_id it answers")
        return self

    def text(self) -> str:
        if self.content is None:
            return ""
        return self.content if isinstance(self.content, str) else "".join(
            p.text for p in self.content if isinstance(p, TextPart))

    def image_urls(self) -> list[str]:
        return [] if not isinstance(self.content, list) else [
            p.image_url.url for p in self.content if isinstance(p, ImagePart)]

    def media(self) -> list[ImagePart | VideoPart]:
        """The message's pictures and clips, in order."""
        return [] if not isinstance(self.content, list) else [
            p for p in self.content if isinstance(p, (ImagePart, VideoPart))]

    def template_content(self, frames=lambda part: len(part.video_url.urls())) -> str | list[dict]:
        """What a chat template reads: the text, or with pictures the parts in order; a clip is its
        frames as consecutive pictures (``frames(part)`` of them: those the ingress sampled), or
        one video part where ``frames(part)`` is None (a class that reads clips as video)."""
        if not self.media():
            return self.text()
        out: list[dict] = []
        for p in self.content:
            if isinstance(p, VideoPart):
                count = frames(p)
                out += [{"type": "video"}] if count is None else [{"type": "image"}] * count
            else:
                out.append({"type": "image"} if isinstance(p, ImagePart) else {"type": "text", "text": p.text})
        return out


class FunctionSpec(BaseModel):
    model_config = ConfigDict(extra="forbid")
    name: Annotated[str, Unicode, Field(pattern=TOOL_NAME)]
    description: Text | None = None
    parameters: Annotated[dict, Unicode] = Field(default_factory=lambda: {"type": "object", "properties": {}},
                                                 description="The arguments' JSON schema.")
    strict: bool | None = None


class Tool(BaseModel):
    model_config = ConfigDict(extra="forbid")
    type: Literal["function"]
    function: FunctionSpec


class NamedFunction(BaseModel):
    model_config = ConfigDict(extra="forbid")
    name: Text


class NamedToolChoice(BaseModel):
    model_config = ConfigDict(extra="forbid")
    type: Literal["function"]
    function: NamedFunction


class ChatCompletionRequest(_Common):
    messages: list[ChatMessage] = Field(min_length=1)
    tools: list[Tool] | None = Field(None, max_length=MAX_TOOLS, description="Functions the model may call.")
    tool_choice: Literal["none", "auto", "required"] | NamedToolChoice | None = Field(None, description=(
        "none: no call; auto (the default with tools): the model decides; required: at least one call; "
        "a named function: that one. Required and named calls follow the functions' schemas."))
    parallel_tool_calls: bool | None = None
    max_tokens: int | None = Field(None, ge=1, description="New tokens at most; default: what the context has room for.")
    max_completion_tokens: int | None = Field(None, ge=1, description="OpenAI's newer name for max_tokens.")
    logprobs: bool = Field(False, description="Each output token's log-probability.")
    top_logprobs: int | None = Field(None, ge=0, le=MAX_TOP_LOGPROBS, description=(
        "With logprobs: this many likeliest alternatives per token."))

    @model_validator(mode="after")
    def _top_logprobs_need_logprobs(self):
        if self.top_logprobs and not self.logprobs:
            raise ValueError("top_logprobs needs logprobs: true")
        return self

    @model_validator(mode="after")
    def _tool_choice_names_a_tool(self):
        names = [t.function.name for t in self.tools or ()]
        if len(set(names)) != len(names):
            raise ValueError("tools: two functions have one name")
        if self.tool_choice is not None and self.tool_choice != "none" and not names:
            raise ValueError("tool_choice needs tools")
        if isinstance(self.tool_choice, NamedToolChoice) and self.tool_choice.function.name not in names:
            raise ValueError(f"tool_choice names {self.tool_choice.function.name!r}, which is not among the tools")
        return self

    @property
    def tool_mode(self) -> str:
        """none, auto, required or named: what the request's tools allow."""
        if not self.tools or self.tool_choice == "none":
            return "none"
        if isinstance(self.tool_choice, NamedToolChoice):
            return "named"
        return self.tool_choice or "auto"

    @property
    def token_limit(self) -> int | None:
        return self.max_completion_tokens or self.max_tokens

    @property
    def generated_choices(self) -> int:
        return self.n
