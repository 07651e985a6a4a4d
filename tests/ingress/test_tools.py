"""Tool calling at the edge: tools and the conversation's calls and results written for the chat
template, calls parsed out of whole and streamed outputs alike, required and named calls held to
the functions' schemas by a grammar."""

import json

import llguidance
import pytest
from hypothesis import given, settings
from hypothesis import strategies as st
from pydantic import ValidationError

from specserve.ingress.openai_api import ChatCompletionRequest, OpenAIError
from specserve.ingress.tools import OPEN, ToolCallStream, closed, parse_tool_calls, template_messages, tool_grammar

WEATHER = {"type": "function", "function": {"name": "get_weather", "description": "Weather in a city.", "parameters": {
    "type": "object", "properties": {"city": {"type": "string"}, "days": {"type": "integer"}}, "required": ["city"]}}}
TIME = {"type": "function", "function": {"name": "get_time", "parameters": {
    "type": "object", "properties": {"zone": {"type": "string", "enum": ["UTC", "CET"]}}, "required": ["zone"]}}}


def chat(messages=None, **fields) -> ChatCompletionRequest:
    return ChatCompletionRequest.model_validate(
        {"model": "m", "messages": messages or [{"role": "user", "content": "Weather in Oslo?"}], **fields})


def block(name: str, arguments: dict, compact: bool = False) -> str:
    call = json.dumps({"name": name, "arguments": arguments}, separators=(",", ":") if compact else None)
    return f"{OPEN}\n{call}\n</tool_call>"


def test_calls_are_parsed_out_and_the_rest_is_content():
    text = f"Let me check.\n{block('get_weather', {'city': 'Oslo'})}\n{block('get_time', {'zone': 'CET'})}\n"
    content, calls = parse_tool_calls(text)
    assert content == "Let me check."
    assert [(c["type"], c["function"]["name"], json.loads(c["function"]["arguments"])) for c in calls] == [
        ("function", "get_weather", {"city": "Oslo"}), ("function", "get_time", {"zone": "CET"})]
    assert len({c["id"] for c in calls}) == 2 and all(c["id"].startswith("call_") for c in calls)
    assert parse_tool_calls("no calls here") == ("no calls here", [])
    broken = f"{OPEN}\nnot json\n</tool_call>"
    assert parse_tool_calls(broken) == (broken, [])   # a block that does not parse stays text
    assert parse_tool_calls(block("get_time", {"zone": "UTC"}))[0] is None


TEXTS = [f"Sure. {block('get_weather', {'city': 'Oslo <3'})}\n\n{block('get_time', {'zone': 'UTC'})}",
         f"{block('get_weather', {'city': 'x'})}", "a < b and <tool but no call", f"text {OPEN} never closed",
         f"{OPEN}\nnot json\n</tool_call> then text", "plain answer\n"]


@pytest.mark.parametrize("text", TEXTS)
@given(cuts=st.lists(st.integers(0, 200), max_size=12))
@settings(max_examples=40, deadline=None)
def test_a_streamed_output_parses_as_the_whole_does_however_it_is_cut(text, cuts):
    pieces, at = [], 0
    for cut in sorted(set(min(c, len(text)) for c in cuts)) + [len(text)]:
        pieces.append(text[at:cut])
        at = cut
    stream, content, calls = ToolCallStream(), "", []
    for piece in pieces:
        more, made = stream.push(piece)
        content, calls = content + more, calls + made
    content += stream.finish()
    whole_content, whole_calls = parse_tool_calls(text)
    assert (content.strip() or None) == (whole_content.strip() if whole_content else None)
    assert [c["function"] for c in calls] == [c["function"] for c in whole_calls]
    if not whole_calls:
        assert content == text   # nothing is lost or reordered when nothing is a call


def test_without_template_support_tools_calls_and_results_are_written_into_the_messages():
    messages = [{"role": "system", "content": "Be brief."}, {"role": "user", "content": "Weather in Oslo?"},
                {"role": "assistant", "content": None, "tool_calls": [
                    {"id": "call_1", "type": "function", "function": {"name": "get_weather", "arguments": '{"city": "Oslo"}'}},
                    {"id": "call_2", "type": "function", "function": {"name": "get_time", "arguments": '{"zone": "CET"}'}}]},
                {"role": "tool", "tool_call_id": "call_1", "content": "12 C, rain"},
                {"role": "tool", "tool_call_id": "call_2", "content": "14:00"}]
    written, tools = template_messages(chat(messages, tools=[WEATHER, TIME]), teaches=False)
    assert tools is None and [m["role"] for m in written] == ["system", "user", "assistant", "user"]
    system = written[0]["content"]
    assert system.startswith("Be brief.") and '"name": "get_weather"' in system and "<tools>" in system
    assert written[2]["content"] == block("get_weather", {"city": "Oslo"}) + "\n" + block("get_time", {"zone": "CET"})
    assert written[3]["content"] == "<tool_response>\n12 C, rain\n</tool_response>\n<tool_response>\n14:00\n</tool_response>"
    none, _ = template_messages(chat(messages, tools=[WEATHER], tool_choice="none"), teaches=False)
    assert none[0]["content"] == "Be brief."   # tool_choice none: the model is shown no tools


def test_a_template_that_teaches_tools_gets_them_in_transformers_shapes():
    messages = [{"role": "user", "content": "Weather?"}, {"role": "assistant", "tool_calls": [
        {"id": "call_1", "type": "function", "function": {"name": "get_weather", "arguments": '{"city": "Oslo"}'}}]},
        {"role": "tool", "tool_call_id": "call_1", "content": "rain"}]
    written, tools = template_messages(chat(messages, tools=[WEATHER]), teaches=True)
    assert tools == [WEATHER]
    assert written[1]["tool_calls"][0]["function"] == {"name": "get_weather", "arguments": {"city": "Oslo"}}
    assert written[2] == {"role": "tool", "content": "rain", "tool_call_id": "call_1"}


def accepts(grammar: str, text: str) -> bool:
    matcher = llguidance.LLMatcher(llguidance.LLTokenizer("byte"), grammar)
    return matcher.consume_tokens(list(text.encode())) and matcher.is_accepting()


def test_required_and_named_calls_follow_the_schemas_on_one_line():
    required = tool_grammar(chat(tools=[WEATHER, TIME], tool_choice="required"))
    oslo = block("get_weather", {"city": "Oslo", "days": 2}, compact=True) + "\n"
    utc = block("get_time", {"zone": "UTC"}, compact=True) + "\n"
    assert accepts(required, oslo) and accepts(required, oslo + utc)
    assert not accepts(required, block("get_weather", {"city": "Oslo", "days": 2}) + "\n")   # free whitespace
    assert not accepts(required, "It rains.") and not accepts(required, block("get_time", {"zone": "PST"}, True) + "\n")
    assert not accepts(required, block("get_weather", {"days": 2}, compact=True) + "\n")   # city is required
    single = tool_grammar(chat(tools=[WEATHER, TIME], tool_choice="required", parallel_tool_calls=False))
    assert accepts(single, oslo) and not accepts(single, oslo + utc)
    named = tool_grammar(chat(tools=[WEATHER, TIME], tool_choice={"type": "function", "function": {"name": "get_time"}}))
    assert accepts(named, utc) and not accepts(named, oslo) and not accepts(named, utc + utc)
    assert tool_grammar(chat(tools=[WEATHER])) is None and tool_grammar(chat(tools=[WEATHER], tool_choice="none")) is None


def test_a_functions_objects_are_closed_to_keys_they_do_not_list_as_xgrammars_strict_mode_reads_them():
    schema = {"type": "object", "properties": {"properties": {"type": "object", "properties": {"a": {"type": "integer"}}},
                                               "open": {"type": "object", "additionalProperties": True,
                                                        "properties": {"b": {"type": "string"}}}},
              "$defs": {"d": {"type": "object", "properties": {"c": {"const": {"properties": 1}}}}}}
    out = closed(schema)
    assert out["additionalProperties"] is False and out["properties"]["properties"]["additionalProperties"] is False
    assert out["properties"]["open"]["additionalProperties"] is True    # said by the schema: kept
    assert out["$defs"]["d"]["additionalProperties"] is False and out["$defs"]["d"]["properties"]["c"] == {"const": {"properties": 1}}
    assert "additionalProperties" not in out["properties"]["properties"]["properties"]   # a property named so is no schema
    grammar = tool_grammar(chat(tools=[{"type": "function", "function": {"name": "f", "parameters": schema}}],
                                tool_choice="required"))
    assert not accepts(grammar, block("f", {"extra": 1}, compact=True) + "\n")


def test_bad_tool_fields_are_refused_by_name():
    for fields in ({"tool_choice": "required"}, {"tools": [WEATHER], "tool_choice": {"type": "function", "function": {"name": "x"}}},
                   {"tools": [WEATHER, WEATHER]}, {"tools": [{"type": "function", "function": {"name": "has space"}}]}):
        with pytest.raises(ValidationError):
            chat(**fields)
    for messages in ([{"role": "tool", "content": "r"}], [{"role": "user"}], [{"role": "user", "content": "x", "tool_calls": [
            {"id": "c", "type": "function", "function": {"name": "f", "arguments": "{}"}}]}]):
        with pytest.raises(ValidationError):
            chat(messages)
    bad_schema = {"type": "function", "function": {"name": "f", "parameters": {"type": "nope"}}}
    with pytest.raises(OpenAIError) as raised:
        tool_grammar(chat(tools=[bad_schema], tool_choice="required"))
    assert raised.value.param == "tools"


class Chars:
    """A tokenizer whose token i is the character chr(i)."""

    def decode(self, ids, skip_special_tokens=True):
        return "".join(map(chr, ids))


def test_grpc_tools_are_the_http_apis_and_calls_come_back_parsed():
    import asyncio

    from specserve.ingress import specserve_pb2 as pb
    from specserve.ingress.auth import ApiKeys
    from specserve.ingress.config import IngressConfig
    from specserve.ingress.grpc_api import GrpcFace, from_pb
    from specserve.ingress.prepare import Prepared
    from specserve.ingress.resumable import TargetStreams
    from specserve.replicas.request import SpecRequest, StreamItem
    from scripted_target import GrpcContext, Replicas

    weather = WEATHER["function"]
    request = pb.CompletionRequest(
        messages=[pb.ChatMessage(role="user", content="Weather?"),
                  pb.ChatMessage(role="assistant", tool_calls=[pb.ToolCall(id="c1", name="get_weather", arguments='{"city": "Oslo"}')]),
                  pb.ChatMessage(role="tool", tool_call_id="c1", content="rain")],
        tools=[pb.ToolFunction(name=weather["name"], description=weather["description"],
                               parameters_json=json.dumps(weather["parameters"]))], tool_choice="get_weather")
    asked = from_pb(request, "m")
    assert asked == chat([{"role": "user", "content": "Weather?"},
                          {"role": "assistant", "content": None, "tool_calls": [
                              {"id": "c1", "type": "function", "function": {"name": "get_weather", "arguments": '{"city": "Oslo"}'}}]},
                          {"role": "tool", "tool_call_id": "c1", "content": "rain"}], tools=[WEATHER],
                         tool_choice={"type": "function", "function": {"name": "get_weather"}})
    with pytest.raises(OpenAIError):
        from_pb(pb.CompletionRequest(messages=[pb.ChatMessage(role="user", content="x")],
                                     tools=[pb.ToolFunction(name="f", parameters_json="{nope")]), "m")

    class Prepare:
        async def prepare(self, _):
            return Prepared("abc", SpecRequest([1], 64, request_id="abc"), stop=[], tool_calls=True)

    output = "ok " + block("get_weather", {"city": "Oslo"})
    half = len(output) // 2

    def face(*streams):
        config = IngressConfig("t", "m", [], "none", 0)
        return GrpcFace("m", ApiKeys(), Prepare(), TargetStreams(Replicas(*streams), Chars(), config))

    whole = StreamItem([ord(c) for c in output], "stop", {})
    response = asyncio.run(face([whole]).complete(request, GrpcContext()))
    assert (response.text, response.finish_reason) == ("ok", "tool_calls")
    assert [(c.name, json.loads(c.arguments)) for c in response.tool_calls] == [("get_weather", {"city": "Oslo"})]

    async def chunks():
        pieces = [StreamItem([ord(c) for c in output[:half]]), StreamItem([ord(c) for c in output[half:]], "stop", {})]
        return [c async for c in face(pieces).complete_stream(request, GrpcContext())]

    got = asyncio.run(chunks())
    assert "".join(c.text for c in got).strip() == "ok" and got[-1].finish_reason == "tool_calls"
    assert [c.name for chunk in got for c in chunk.tool_calls] == ["get_weather"]
