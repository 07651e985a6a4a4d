"""Request bodies are checked at the edge: what OpenAI defines but specserve cannot honour is
refused with the field named, neutral values are accepted, unknown fields are refused."""

import pytest
from pydantic import ValidationError

from specserve.ingress.openai_api import ChatCompletionRequest, CompletionRequest, OpenAIError

MODEL = "m"


def chat(**fields):
    return ChatCompletionRequest.model_validate({"model": MODEL, "messages": [{"role": "user", "content": "hi"}], **fields})


def test_openai_defaults():
    req = CompletionRequest.model_validate({"model": MODEL, "prompt": "hi"})
    # OpenAI's own defaults: 16 tokens for completions, temperature 1.
    assert (req.max_tokens, req.temperature, req.top_p, req.stop, req.stream) == (16, 1.0, 1.0, [], False)
    assert chat().token_limit is None      # chat: as much as the context has room for


@pytest.mark.parametrize("fields, param", [
    ({"n": 2}, "n"),
    ({"temperature": -1}, "temperature"),
    ({"temperature": "hot"}, "temperature"),
    ({"top_p": 0}, "top_p"),
    ({"max_tokens": 0}, "max_tokens"),
    ({"max_tokens": -5}, "max_tokens"),
    ({"stop": ["a", "b", "c", "d", "e"]}, "stop"),
    ({"stop": [""]}, "stop"),
    ({"logit_bias": {"42": 5}}, "logit_bias"),
    ({"presence_penalty": 0.5}, "presence_penalty"),
    ({"spec": {"window": 99}}, "spec"),
    ({"spec": {"tree": {"depth": 3, "top_k": 2}}}, "spec"),
    ({"spec": {"draft": "x", "unknown": 1}}, "spec"),
    ({"no_such_field": 1}, "no_such_field"),
    ({"cache_salt": ""}, "cache_salt"),
    ({"cache_salt": "x" * 257}, "cache_salt"),
])
def test_bad_fields_are_refused_by_name(fields, param):
    with pytest.raises(ValidationError) as err:
        chat(**fields)
    assert err.value.errors()[0]["loc"][0] == param


def test_chat_needs_messages_with_known_roles():
    with pytest.raises(ValidationError):
        ChatCompletionRequest.model_validate({"model": MODEL, "messages": []})
    with pytest.raises(ValidationError):
        ChatCompletionRequest.model_validate({"model": MODEL, "messages": [{"role": "robot", "content": "x"}]})


def test_neutral_values_of_unsupported_features_are_accepted():
    req = chat(n=1, presence_penalty=0, frequency_penalty=0.0, logit_bias={}, logprobs=False)
    assert req.n == 1


def test_prompt_shapes():
    assert CompletionRequest.model_validate({"model": MODEL, "prompt": ["one"]}).prompt == "one"
    assert CompletionRequest.model_validate({"model": MODEL, "prompt": [1, 2, 3]}).prompt == [1, 2, 3]
    with pytest.raises(ValidationError, match="one prompt per request"):
        CompletionRequest.model_validate({"model": MODEL, "prompt": ["one", "two"]})


def test_chat_content_parts_are_joined():
    req = ChatCompletionRequest.model_validate({"model": MODEL, "messages": [
        {"role": "user", "content": [{"type": "text", "text": "a"}, {"type": "text", "text": "b"}]}]})
    assert req.messages[0].text() == "ab"


def test_error_body_is_openais():
    body = OpenAIError("bad", param="max_tokens", code="x").body()
    assert body == {"error": {"message": "bad", "type": "invalid_request_error", "param": "max_tokens", "code": "x"}}
