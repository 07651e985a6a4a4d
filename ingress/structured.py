"""A request's output constraint (OpenAI's ``response_format``, vLLM's ``structured_outputs`` and
its older ``guided_*`` fields) as llguidance's grammar text, checked before any replica sees it.

The target replica follows the grammar (``replicas/grammar.py``): it masks the target's rows and
checks drafted tokens against it. A constraint that does not compile is a 400 naming its field.
"""

from __future__ import annotations

import json

import llguidance
from llguidance.gbnf_to_lark import any_to_lark

from specserve.ingress.openai_api import ChatCompletionRequest, CompletionRequest, OpenAIError
from specserve.replicas.grammar import check_grammar

ANY_JSON_OBJECT = {"type": "object"}


def _constraints(req: CompletionRequest | ChatCompletionRequest) -> list[tuple[str, str, object]]:
    """(field, kind, value) of every constraint the request gives."""
    found: list[tuple[str, str, object]] = []
    rf = req.response_format
    if rf is not None and rf.type == "json_object":
        found.append(("response_format", "json", ANY_JSON_OBJECT))
    elif rf is not None and rf.type == "json_schema":
        found.append(("response_format", "json", rf.json_schema.schema_))
    so = req.structured_outputs
    if so is not None:
        for name, kind in (("json_", "json"), ("regex", "regex"), ("choice", "choice"), ("grammar", "grammar")):
            if getattr(so, name):
                found.append(("structured_outputs", kind, getattr(so, name)))
        if so.json_object:
            found.append(("structured_outputs", "json", ANY_JSON_OBJECT))
    for name, kind in (("guided_json", "json"), ("guided_regex", "regex"), ("guided_choice", "choice"),
                       ("guided_grammar", "grammar")):
        if getattr(req, name):
            found.append((name, kind, getattr(req, name)))
    return found


def request_grammar(req: CompletionRequest | ChatCompletionRequest) -> str | None:
    """The grammar text the request's output must follow; None: free text."""
    found = _constraints(req)
    if not found:
        return None
    if len(found) > 1:
        raise OpenAIError(f"give one output constraint, not {len(found)} ({', '.join(f for f, _, _ in found)})",
                          param=found[1][0])
    field, kind, value = found[0]
    try:
        if kind == "json":
            grammar = llguidance.LLMatcher.grammar_from_json_schema(value if isinstance(value, dict) else json.loads(value))
        elif kind == "regex":
            grammar = llguidance.LLMatcher.grammar_from_regex(value)
        elif kind == "choice":
            grammar = llguidance.LLMatcher.grammar_from_lark("start: " + " | ".join(json.dumps(c) for c in value))
        else:
            grammar = llguidance.LLMatcher.grammar_from_lark(any_to_lark(value))
    except Exception as err:  # noqa: BLE001 - whatever the compilers refuse is the client's to fix
        raise OpenAIError(f"{field}: the {kind} constraint is not usable: {err}", param=field) from None
    why = check_grammar(grammar)
    if why is not None:
        raise OpenAIError(f"{field}: the {kind} constraint is not usable: {why.strip()[:500]}", param=field)
    return grammar
