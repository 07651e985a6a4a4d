"""Request bodies are checked at the edge: what OpenAI defines but specserve cannot honour is
refused with the field named, neutral values are accepted, unknown fields are refused."""

import json

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
    ({"n": 0}, "n"),
    ({"n": 17}, "n"),
    ({"temperature": -1}, "temperature"),
    ({"temperature": "hot"}, "temperature"),
    ({"top_p": 0}, "top_p"),
    ({"max_tokens": 0}, "max_tokens"),
    ({"max_tokens": -5}, "max_tokens"),
    ({"stop": ["a", "b", "c", "d", "e"]}, "stop"),
    ({"stop": [""]}, "stop"),
    ({"logit_bias": {"x42": 5}}, "logit_bias"),
    ({"logit_bias": {"42": 101}}, "logit_bias"),
    ({"logit_bias": {"9" * 5000: 1}}, "logit_bias"),
    ({"presence_penalty": 2.5}, "presence_penalty"),
    ({"frequency_penalty": -3}, "frequency_penalty"),
    ({"repetition_penalty": 0}, "repetition_penalty"),
    ({"min_p": 1.5}, "min_p"),
    ({"min_tokens": -1}, "min_tokens"),
    ({"allowed_token_ids": []}, "allowed_token_ids"),
    ({"stop_token_ids": list(range(2000))}, "stop_token_ids"),
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


def test_choices_n_and_best_of():
    assert chat(n=3).generated_choices == 3
    ok = CompletionRequest.model_validate({"model": MODEL, "prompt": "hi", "n": 2, "best_of": 4})
    assert (ok.n, ok.generated_choices) == (2, 4)
    for body, words in [({"n": 3, "best_of": 2}, "at least n"), ({"best_of": 2, "stream": True}, "cannot be streamed"),
                        ({"best_of": 17}, "less than or equal")]:
        with pytest.raises(ValidationError, match=words):
            CompletionRequest.model_validate({"model": MODEL, "prompt": "hi", **body})
    streamed = CompletionRequest.model_validate({"model": MODEL, "prompt": "hi", "n": 2, "best_of": 2, "stream": True})
    assert streamed.generated_choices == 2   # best_of = n ranks nothing: it streams


def test_vllms_sampling_controls_are_taken():
    req = chat(presence_penalty=0.5, frequency_penalty=-1, repetition_penalty=1.2, logit_bias={"42": -100},
               min_p=0.05, min_tokens=3, stop_token_ids=[7], ignore_eos=True, allowed_token_ids=[1, 2, 42])
    assert (req.presence_penalty, req.repetition_penalty, req.logit_bias, req.min_tokens) == (0.5, 1.2, {"42": -100}, 3)


def test_a_non_finite_penalty_from_json_is_refused():
    # Python's json (FastAPI's parser) reads NaN and Infinity.
    for field in ("presence_penalty", "repetition_penalty", "min_p"):
        with pytest.raises(ValidationError):
            chat(**json.loads(f'{{"{field}": NaN}}'))
        with pytest.raises(ValidationError):
            chat(**json.loads(f'{{"{field}": Infinity}}'))


def test_prompt_shapes():
    assert CompletionRequest.model_validate({"model": MODEL, "prompt": ["one"]}).prompt == "one"
    assert CompletionRequest.model_validate({"model": MODEL, "prompt": [1, 2, 3]}).prompt == [1, 2, 3]
    assert CompletionRequest.model_validate({"model": MODEL, "prompt": [[1, 2, 3]]}).prompt == [1, 2, 3]
    with pytest.raises(ValidationError, match="one prompt per request"):
        CompletionRequest.model_validate({"model": MODEL, "prompt": [[1], [2]]})
    with pytest.raises(ValidationError, match="one prompt per request"):
        CompletionRequest.model_validate({"model": MODEL, "prompt": ["one", "two"]})


def test_chat_content_parts_are_joined():
    req = ChatCompletionRequest.model_validate({"model": MODEL, "messages": [
        {"role": "user", "content": [{"type": "text", "text": "a"}, {"type": "text", "text": "b"}]}]})
    assert req.messages[0].text() == "ab"


def test_error_body_is_openais():
    body = OpenAIError("bad", param="max_tokens", code="x").body()
    assert body == {"error": {"message": "bad", "type": "invalid_request_error", "param": "max_tokens", "code": "x"}}


# ---- text that is not Unicode -----------------------------------------------------------------
# JSON's "\ud800" escapes decode (json.loads, as FastAPI reads a body) to lone surrogates, which
# UTF-8 cannot encode: every string field refuses them with the field named, so that neither a
# tokenizer nor the error body itself fails on them later.

LONE = "a\\ud800b"   # as the JSON body spells it


def _parse(model, body: str):
    return model.model_validate(json.loads(body))


@pytest.mark.parametrize("model, body, param", [
    (ChatCompletionRequest, f'{{"model": "{LONE}", "messages": [{{"role": "user", "content": "hi"}}]}}', "model"),
    (ChatCompletionRequest, f'{{"model": "m", "messages": [{{"role": "user", "content": "{LONE}"}}]}}', "messages"),
    (ChatCompletionRequest, f'{{"model": "m", "messages": [{{"role": "user", "content": '
                            f'[{{"type": "text", "text": "{LONE}"}}]}}]}}', "messages"),
    (ChatCompletionRequest, f'{{"model": "m", "messages": [{{"role": "user", "content": [{{"type": "image_url", '
                            f'"image_url": {{"url": "data:{LONE}"}}}}]}}]}}', "messages"),
    (ChatCompletionRequest, f'{{"model": "m", "messages": [{{"role": "{LONE}", "content": "hi"}}]}}', "messages"),
    (ChatCompletionRequest, f'{{"model": "m", "messages": [{{"role": "user", "content": "hi", "name": "{LONE}"}}]}}', "messages"),
    (ChatCompletionRequest, f'{{"model": "m", "messages": [{{"role": "user", "content": "hi"}}], "stop": "{LONE}"}}', "stop"),
    (ChatCompletionRequest, f'{{"model": "m", "messages": [{{"role": "user", "content": "hi"}}], "stop": ["x", "{LONE}"]}}', "stop"),
    (ChatCompletionRequest, f'{{"model": "m", "messages": [{{"role": "user", "content": "hi"}}], "cache_salt": "{LONE}"}}', "cache_salt"),
    (ChatCompletionRequest, f'{{"model": "m", "messages": [{{"role": "user", "content": "hi"}}], "user": "{LONE}"}}', "user"),
    (ChatCompletionRequest, f'{{"model": "m", "messages": [{{"role": "user", "content": "hi"}}], "spec": {{"draft": "{LONE}"}}}}', "spec"),
    (ChatCompletionRequest, f'{{"model": "m", "messages": [{{"role": "user", "content": "hi"}}], "spec": {{"policy": "{LONE}"}}}}', "spec"),
    (CompletionRequest, f'{{"model": "m", "prompt": "{LONE}"}}', "prompt"),
    (CompletionRequest, f'{{"model": "m", "prompt": ["{LONE}"]}}', "prompt"),
])
def test_a_lone_surrogate_in_any_string_field_is_refused_by_name(model, body, param):
    with pytest.raises(ValidationError) as err:
        _parse(model, body)
    first = err.value.errors()[0]
    assert first["loc"][0] == param and first["type"] == "invalid_unicode", err.value.errors()
    # The message is what the 400 carries: it must itself encode, and say what to send instead.
    assert "not valid Unicode" in first["msg"] and "lone surrogate at character" in first["msg"]
    first["msg"].encode("utf-8")


def test_a_lone_surrogate_in_a_field_name_is_refused_without_echoing_it():
    # An unknown field is refused by name; a name that cannot be encoded must not reach that error.
    for body in (f'{{"model": "m", "messages": [{{"role": "user", "content": "hi"}}], "{LONE}": 1}}',
                 f'{{"model": "m", "messages": [{{"role": "user", "content": "hi", "{LONE}": 1}}]}}'):
        with pytest.raises(ValidationError) as err:
            _parse(ChatCompletionRequest, body)
        first = err.value.errors()[0]
        assert first["type"] == "invalid_unicode" and "field name" in first["msg"]
        str(first["loc"]).encode("utf-8")


def test_paired_surrogates_and_other_unicode_are_text():
    # "\ud83d\ude00" is one character (U+1F600) once JSON pairs the escapes.
    req = _parse(ChatCompletionRequest, '{"model": "m", "messages": [{"role": "user", "content": "\\ud83d\\ude00 é 中"}]}')
    assert req.messages[0].content == "\U0001F600 é 中"


def test_control_characters_are_content_but_not_names():
    # OpenAI takes control characters in text; names are matched and logged, so they refuse them.
    req = chat(messages=[{"role": "user", "content": "tab\there\x00\x1b[31m"}], stop=["\n\n"])
    assert req.messages[0].content == "tab\there\x00\x1b[31m" and req.stop == ["\n\n"]
    for fields, param in (({"model": "m\x00"}, "model"), ({"spec": {"draft": "x\n"}}, "spec"),
                          ({"spec": {"policy": "\x7fstatic"}}, "spec")):
        with pytest.raises(ValidationError) as err:
            chat(**fields)
        assert err.value.errors()[0]["loc"][0] == param and err.value.errors()[0]["type"] == "control_character"


@pytest.mark.parametrize("part, param, says", [
    ({"type": "video_url", "video_url": {"frames": ["data:,"], "fps": 0}}, "messages.0.content.0.video_url.fps",
     "greater than 0"),
    ({"type": "video", "url": "x"}, "messages.0.content.0", "'text', 'image_url' or 'video_url'"),
    ({"type": "image_url"}, "messages.0.content.0.image_url", "Field required"),
    ({"type": "image_url", "image_url": {"url": "data:,"}, "detail": "low"}, "messages.0.content.0.detail",
     "Extra inputs"),
], ids=["bad-fps", "unknown-type", "missing-field", "extra-field"])
def test_a_bad_content_part_is_a_400_that_names_its_field(part, param, says):
    """A content part is one of a union: pydantic errs in each type it tried (also "not a
    string"); the 400's message and param name the part's own field."""
    from specserve.ingress.prepare import validation_message

    with pytest.raises(ValidationError) as err:
        ChatCompletionRequest.model_validate({"model": "m", "messages": [
            {"role": "user", "content": [part, {"type": "text", "text": "hi"}]}]})
    message, got = validation_message(err.value.errors())
    assert got == param and message.startswith(param) and says in message, message


def test_a_bad_named_tool_choice_is_a_400_at_its_field():
    from specserve.ingress.prepare import validation_message

    with pytest.raises(ValidationError) as err:
        ChatCompletionRequest.model_validate({"model": "m", "messages": [{"role": "user", "content": "hi"}],
                                              "tool_choice": {"type": "function", "function": {}}})
    assert validation_message(err.value.errors())[1] == "tool_choice.function.name"
