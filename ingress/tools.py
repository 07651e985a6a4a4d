"""Tool calling: a request's ``tools`` and its conversation's calls and results in the prompt, the
model's calls parsed out of its output, and ``required`` or named calls enforced by a grammar.

The format is Hermes's (``hermes``, the one tool parser here; ``tool_parser`` in the application's
config): a call is a JSON object ``{"name": ..., "arguments": {...}}`` between ``<tool_call>`` and
``</tool_call>`` lines, a result comes back between ``<tool_response>`` tags. A chat template that
teaches tools itself (its source reads ``tools``, as Qwen2.5's and Hermes's do) gets them, and the
conversation's calls, in transformers' shapes; one that does not (SmolLM2's) gets them written into
its system message here, in the same format, so that the parser reads what the prompt taught.

``tool_choice``: ``none`` shows the model no tools and parses nothing; ``auto`` shows them and
parses whatever calls the output makes; ``required`` and a named function constrain the output
with a grammar (llguidance's Lark with each function's schema as JSON) to one or more calls
(``parallel_tool_calls: false``, or the named function: exactly one), so it always parses into
calls with valid arguments.
"""

from __future__ import annotations

import json
import re
import uuid

import llguidance

from specserve.ingress.openai_api import ChatCompletionRequest, ChatMessage, OpenAIError, Tool
from specserve.replicas.grammar import check_grammar

TOOL_PARSERS = ("hermes",)
OPEN, CLOSE = "<tool_call>", "</tool_call>"
_CALL = re.compile(re.escape(OPEN) + r"(.*?)" + re.escape(CLOSE), re.DOTALL)


def template_teaches_tools(tokenizer) -> bool:
    """Whether the tokenizer's chat template renders ``tools`` itself."""
    template = getattr(tokenizer, "chat_template", None) or ""
    return "tools" in template


def _arguments(text: str):
    """A call's arguments as a template reads them: the object, or the text when it is no JSON."""
    try:
        return json.loads(text)
    except ValueError:
        return text


def _call_text(name: str, arguments) -> str:
    return f"{OPEN}\n{json.dumps({'name': name, 'arguments': arguments}, ensure_ascii=False)}\n{CLOSE}"


def _preamble(tools: list[Tool]) -> str:
    signatures = "\n".join(json.dumps(t.model_dump(exclude_none=True), ensure_ascii=False) for t in tools)
    return ("# Tools\n\nYou may call functions to answer. Their signatures, one JSON object per line:\n"
            f"<tools>\n{signatures}\n</tools>\n\nTo call one, write its name and arguments as JSON between tags, "
            f"one call per block:\n{OPEN}\n{{\"name\": <function name>, \"arguments\": <arguments object>}}\n{CLOSE}")


def template_messages(req: ChatCompletionRequest, teaches: bool, content=ChatMessage.text) -> tuple[list[dict], list[dict] | None]:
    """The conversation as the chat template reads it (``content(message)``: a message's content
    for it), and the tools to hand the template (None: none, or written into the messages here)."""
    shown = req.tools if req.tool_mode != "none" else None
    if teaches:
        messages = []
        for m in req.messages:
            message = {"role": m.role, "content": content(m)}
            if m.tool_calls:
                message["tool_calls"] = [{"type": "function", "id": c.id, "function": {
                    "name": c.function.name, "arguments": _arguments(c.function.arguments)}} for c in m.tool_calls]
            if m.tool_call_id:
                message["tool_call_id"] = m.tool_call_id
            messages.append(message)
        return messages, [t.model_dump(exclude_none=True) for t in shown] if shown else None
    messages: list[dict] = []
    previous = None
    for m in req.messages:
        if m.role == "tool":   # results come back as the user's turn, consecutive ones together
            result = f"<tool_response>\n{m.text()}\n</tool_response>"
            if previous == "tool":
                messages[-1]["content"] += "\n" + result
            else:
                messages.append({"role": "user", "content": result})
        else:
            text = content(m)
            if m.tool_calls:
                calls = "\n".join(_call_text(c.function.name, _arguments(c.function.arguments)) for c in m.tool_calls)
                text = f"{text}\n{calls}" if text else calls
            messages.append({"role": m.role, "content": text})
        previous = m.role
    if shown:
        preamble = _preamble(shown)
        if messages[0]["role"] in ("system", "developer") and isinstance(messages[0]["content"], str):
            messages[0]["content"] = f"{messages[0]['content']}\n\n{preamble}"
        else:
            messages.insert(0, {"role": "system", "content": preamble})
    return messages, None


def closed(schema):
    """``schema`` with every object that lists its properties closed to others (no
    ``additionalProperties`` of its own: false), as xgrammar's strict mode reads schemas, and so
    vLLM's tool calls: a small model would otherwise add keys until it runs out of tokens."""
    if not isinstance(schema, dict):
        return schema
    out = dict(schema)
    for key in ("properties", "patternProperties", "$defs", "definitions", "dependentSchemas"):
        if isinstance(out.get(key), dict):
            out[key] = {name: closed(sub) for name, sub in out[key].items()}
    for key in ("items", "additionalProperties", "not", "if", "then", "else", "contains"):
        if isinstance(out.get(key), dict):
            out[key] = closed(out[key])
    for key in ("anyOf", "oneOf", "allOf", "prefixItems"):
        if isinstance(out.get(key), list):
            out[key] = [closed(sub) for sub in out[key]]
    if "properties" in out and "additionalProperties" not in out and "patternProperties" not in out:
        out["additionalProperties"] = False
    return out


def tool_grammar(req: ChatCompletionRequest) -> str | None:
    """The grammar of a ``required`` (one call or more) or named (exactly that one) tool choice;
    None otherwise. A function whose schema does not compile is a 400 naming ``tools``."""
    mode = req.tool_mode
    if mode not in ("required", "named"):
        return None
    tools = req.tools if mode == "required" else [t for t in req.tools if t.function.name == req.tool_choice.function.name]
    rules = []
    for i, tool in enumerate(tools):
        # One line of JSON, as the prompt teaches (llguidance's separators, no free whitespace).
        schema = {"type": "object", "properties": {"name": {"const": tool.function.name},
                                                   "arguments": closed(tool.function.parameters)},
                  "required": ["name", "arguments"], "additionalProperties": False,
                  "x-guidance": {"whitespace_flexible": False}}
        rules.append(f"call_{i}: %json {json.dumps(schema)}")
    several = mode == "required" and req.parallel_tool_calls is not False
    lark = "\n".join([f"start: call{'+' if several else ''}",
                      f"call: {json.dumps(OPEN + chr(10))} body {json.dumps(chr(10) + CLOSE + chr(10))}",
                      "body: " + " | ".join(f"call_{i}" for i in range(len(tools))), *rules])
    try:
        grammar = llguidance.LLMatcher.grammar_from_lark(lark)
    except Exception as err:  # noqa: BLE001 - a schema llguidance refuses is the client's to fix
        raise OpenAIError(f"tools: a function's parameters are not a usable JSON schema: {err}", param="tools") from None
    why = check_grammar(grammar)
    if why is not None:
        raise OpenAIError(f"tools: a function's parameters are not a usable JSON schema: {why.strip()[:500]}",
                          param="tools")
    return grammar


def _parsed(body: str) -> dict | None:
    """The OpenAI tool call a block's JSON makes; None when it is not ``{"name": str, "arguments": ...}``."""
    try:
        call = json.loads(body)
    except ValueError:
        return None
    if not isinstance(call, dict) or not isinstance(call.get("name"), str):
        return None
    arguments = call.get("arguments", call.get("parameters", {}))
    return {"id": f"call_{uuid.uuid4().hex[:24]}", "type": "function", "function": {
        "name": call["name"], "arguments": arguments if isinstance(arguments, str) else json.dumps(arguments, ensure_ascii=False)}}


def parse_tool_calls(text: str) -> tuple[str | None, list[dict]]:
    """(content, tool calls) of a whole output: the blocks that parse become calls, the rest of
    the text (a block that does not parse included) the content; None when nothing is left."""
    calls, kept, at = [], [], 0
    for match in _CALL.finditer(text):
        call = _parsed(match.group(1))
        if call is None:
            continue
        kept.append(text[at:match.start()])
        at = match.end()
        calls.append(call)
    kept.append(text[at:])
    content = "".join(kept).strip() if calls else text
    return (content or None), calls


def tool_answer(text: str, finish_reason: str) -> tuple[str | None, list[dict], str]:
    """A whole answer's content, its tool calls and its finish reason (``tool_calls`` where the
    model stopped after making calls, as OpenAI reports it)."""
    content, calls = parse_tool_calls(text)
    return content, calls, "tool_calls" if calls and finish_reason == "stop" else finish_reason


class ToolCallStream:
    """``parse_tool_calls`` over a stream of text pieces: content as it comes, less what may be
    the start of a call block (held until it is known), and each call once its block closes."""

    def __init__(self):
        self.buffer, self.inside, self.calls, self.blank = "", False, 0, ""

    def _content(self, text: str) -> str:
        # Whitespace between blocks is held: sent with the next text, dropped after a call.
        if not text.strip():
            self.blank += text
            return ""
        text, self.blank = self.blank + text, ""
        return text

    def push(self, text: str) -> tuple[str, list[dict]]:
        self.buffer += text
        content, calls = "", []
        while True:
            if self.inside:
                end = self.buffer.find(CLOSE)
                if end < 0:
                    return content, calls
                call = _parsed(self.buffer[:end])
                if call is None:
                    content += self._content(OPEN + self.buffer[:end + len(CLOSE)])
                else:
                    calls.append(call)
                    self.calls += 1
                    self.blank = ""
                self.buffer, self.inside = self.buffer[end + len(CLOSE):], False
                continue
            start = self.buffer.find(OPEN)
            if start >= 0:
                content += self._content(self.buffer[:start])
                self.buffer, self.inside = self.buffer[start + len(OPEN):], True
                continue
            held = next((k for k in range(min(len(OPEN) - 1, len(self.buffer)), 0, -1)
                         if OPEN.startswith(self.buffer[-k:])), 0)
            content += self._content(self.buffer[:len(self.buffer) - held])
            self.buffer = self.buffer[len(self.buffer) - held:]
            return content, calls

    def piece(self, text: str, finish_reason: str | None) -> tuple[str, list[dict], str | None]:
        """One streamed piece's content, the calls it closes and its finish reason (as ``tool_answer``)."""
        content, calls = self.push(text)
        if finish_reason is not None:
            content += self.finish()
            finish_reason = "tool_calls" if finish_reason == "stop" and self.calls else finish_reason
        return content, calls, finish_reason

    def finish(self) -> str:
        """What is left as content at the end (an unclosed block's text included)."""
        rest = (OPEN if self.inside else "") + self.buffer
        self.buffer, self.inside = "", False
        if not rest.strip():
            return "" if self.calls else self.blank + rest
        return self.blank + rest
