"""Output constraints in every shape clients send them become one grammar, or a 400 naming the field."""

import llguidance
import pytest

from specserve.ingress.openai_api import ChatCompletionRequest, CompletionRequest, OpenAIError
from specserve.ingress.structured import request_grammar

SCHEMA = {"type": "object", "properties": {"a": {"type": "integer"}}, "required": ["a"]}


def chat(**fields):
    return ChatCompletionRequest.model_validate({"model": "m", "messages": [{"role": "user", "content": "hi"}], **fields})


def accepts(grammar: str, text: str) -> bool:
    matcher = llguidance.LLMatcher(llguidance.LLTokenizer("byte"), grammar)
    return matcher.consume_tokens(list(text.encode())) and matcher.is_accepting()


@pytest.mark.parametrize("fields, good, bad", [
    ({"response_format": {"type": "json_object"}}, '{"x": [1, true]}', "[1]"),
    ({"response_format": {"type": "json_schema", "json_schema": {"name": "a", "schema": SCHEMA, "strict": True}}},
     '{"a": 5}', '{"a": "five"}'),
    ({"structured_outputs": {"json": SCHEMA}}, '{"a": 5}', '{"b": 5}'),
    ({"structured_outputs": {"regex": "[0-9]{3}"}}, "123", "12a"),
    ({"structured_outputs": {"choice": ["yes", 'he said "no"']}}, 'he said "no"', "maybe"),
    ({"structured_outputs": {"grammar": 'root ::= "a" "b"*'}}, "abbb", "ba"),
    ({"structured_outputs": {"grammar": 'start: "x" | "y"'}}, "y", "z"),
    ({"guided_json": '{"type": "object", "properties": {"a": {"type": "integer"}}, "required": ["a"]}'}, '{"a": 1}', "{}"),
    ({"guided_regex": "a+"}, "aaa", "b"),
    ({"guided_choice": ["up", "down"]}, "down", "left"),
])
def test_every_shape_becomes_a_grammar_that_admits_what_it_should(fields, good, bad):
    grammar = request_grammar(chat(**fields))
    assert accepts(grammar, good) and not accepts(grammar, bad)
    assert request_grammar(CompletionRequest.model_validate({"model": "m", "prompt": "x", **fields})) == grammar


def test_free_text_has_no_grammar():
    assert request_grammar(chat()) is None and request_grammar(chat(response_format={"type": "text"})) is None


@pytest.mark.parametrize("fields, param", [
    ({"structured_outputs": {"regex": "(a|b"}}, "structured_outputs"),
    ({"guided_json": "{not json"}, "guided_json"),
    ({"guided_json": {"type": "object", "properties": {"a": {"type": "nope"}}}}, "guided_json"),
    ({"structured_outputs": {"grammar": "start: undefined_rule"}}, "structured_outputs"),
    ({"guided_regex": "a", "guided_choice": ["b"]}, "guided_choice"),
])
def test_a_constraint_that_cannot_be_used_is_refused_by_field(fields, param):
    with pytest.raises(OpenAIError) as raised:
        request_grammar(chat(**fields))
    assert raised.value.param == param and raised.value.status == 400


def test_shapes_that_do_not_parse_are_refused_by_pydantic():
    from pydantic import ValidationError

    for fields in ({"response_format": {"type": "json_schema"}}, {"response_format": {"type": "xml"}},
                   {"structured_outputs": {"regex": "a", "choice": ["b"]}}, {"structured_outputs": {}}):
        with pytest.raises(ValidationError):
            chat(**fields)
