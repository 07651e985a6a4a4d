"""End to end on a real local Ray cluster: `specserve up` with the reference target, prompt lookup
(placed by measurement: inside the target replica, and a second one forced separate), a
real-weights draft LM (the target's first two layers) and the zoo's hidden-state-reuse head as
separate deployments (and the head inside the target replica), a real redis-server, then HTTP
through the unmodified `openai` client and gRPC through the generated stubs.

Greedy output through the served path must equal the in-process target-only greedy output token
for token (float32), whatever the draft, window or tree.
"""

from __future__ import annotations

import concurrent.futures
import json
import os
import shutil
import subprocess
import sys
import time
from pathlib import Path

import grpc
import httpx
import pytest

from conftest import first_layers_draft, local_stack, wait_until
from specserve.cluster import local
from specserve.cluster.serve_config import app_serve_config, local_serve_config
from specserve.replicas.sampling import SamplingParams
from specserve.ingress import specserve_pb2 as pb
from specserve.ingress import specserve_pb2_grpc
from specserve.replicas.engine import SpecEngine
from specserve.replicas.engine import run_batch, speculative_generate
from specserve.replicas.request import SpecRequest
from specserve.replicas.target import Target

pytestmark = [pytest.mark.reference, pytest.mark.slow]

MODEL = "smollm2-135m-instruct"
DRAFT_LM = "first-2-layers"
HSR = "smollm2-hsr"   # from the package's zoo: reads the target's hidden states
LOOKUP_SEPARATE = "lookup-separate"   # prompt lookup as a deployment of its own
PROMPTS = [
    "Summarise in one sentence: The quick brown fox jumps over the lazy dog. The dog did not react.",
    "Write a Python function that returns the n-th Fibonacci number.",
    "Repeat after me: the rain in Spain stays mainly in the plain.",
]
NEW_TOKENS = 24
HAS_PROMETHEUS = shutil.which("prometheus") is not None


def _test_config(draft_path: str) -> dict:
    args = {**local_serve_config()["applications"][0]["args"], "dtype": "float32", "drafts": [
        {"name": "prompt-lookup"},   # model-free, auto: inside the target replica
        {"name": "suffix", "method": "suffix", "seed_outputs": "answers"},   # fed by every replica's outputs
        {"name": DRAFT_LM, "model": draft_path, "placement": "separate"},
        {"name": LOOKUP_SEPARATE, "placement": "separate"},
        {"name": HSR, "model": HSR, "placement": "separate"}, {"name": "hsr-in-target", "model": HSR, "placement": "inside"}]}
    # An entry for exactly each deployment this app builds (Serve refuses one it does not), each
    # model asking for the CPUs of its torch threads.
    config = app_serve_config(args)
    deployments = {d["name"]: d for d in config["applications"][0]["deployments"]}
    # The ingress scales out fast under a burst, so the autoscaling test sees it within seconds.
    deployments["ingress"]["autoscaling_config"].update(
        target_ongoing_requests=1, upscale_delay_s=0.5, metrics_interval_s=0.5, look_back_period_s=2,
        downscale_delay_s=600)
    return config


@pytest.fixture(scope="module")
def engine():
    return SpecEngine.load(dtype="float32")


@pytest.fixture(scope="module")
def served(engine, tmp_path_factory):
    """The whole stack, once for the module; `down` stops exactly what `up` started."""
    home = tmp_path_factory.mktemp("specserve-home")
    draft_path = first_layers_draft(engine, home / DRAFT_LM)
    # With Prometheus where it is installed (./setup.sh installs it where it can).
    with local_stack(_test_config(str(draft_path)), home, prometheus=HAS_PROMETHEUS) as state:
        yield state


@pytest.fixture(scope="module")
def client(served):
    from openai import OpenAI

    return OpenAI(base_url=served.http_url + "/v1", api_key="unused", max_retries=0, timeout=300)


@pytest.fixture(scope="module")
def stub(served):
    with grpc.insecure_channel(served.grpc_address) as channel:
        yield specserve_pb2_grpc.SpecServeStub(channel)


@pytest.fixture(scope="module")
def expected(engine):
    """In-process target-only greedy output for each prompt, chat-rendered."""
    target = Target(engine.loaded.model)
    return [speculative_generate(target, None, engine.encode(p), NEW_TOKENS, SamplingParams(),
                                 eos_token_ids=engine.loaded.eos_token_ids).token_ids for p in PROMPTS]


def chat(client, prompt: str, spec: dict | None = None, **kwargs):
    return client.chat.completions.create(
        model=MODEL, messages=[{"role": "user", "content": prompt}], max_tokens=NEW_TOKENS, temperature=0,
        extra_body={"spec": spec or {}, "return_token_ids": True}, **kwargs)


def test_models_lists_the_target_and_where_each_draft_runs(client):
    assert [m.id for m in client.models.list().data] == [MODEL]
    placement = client.models.list().data[0].model_extra["placement"]
    assert {d: p["where"] for d, p in placement.items()} == {
        "prompt-lookup": "inside", "suffix": "inside", DRAFT_LM: "separate", LOOKUP_SEPARATE: "separate", HSR: "separate",
        "hsr-in-target": "inside"}
    assert placement["prompt-lookup"]["reason"].startswith("model-free") and placement[HSR]["reason"] == "configured"


def test_separate_drafts_are_priced_from_their_own_probe_and_a_measured_call(client, expected):
    """A draft deployment times its own drafted position when it starts and reports it; each
    target replica adds the handle call it measures and prices the draft with both before any
    request drafts with it: the separate model drafts are routing candidates under load. Prompt
    lookup behind a handle has no probe (nothing to time but the call): it stays unpriced, so
    prediction never sends a request to it; only exploration may, priced as the dearest draft."""
    with concurrent.futures.ThreadPoolExecutor(8) as pool:
        outs = list(pool.map(lambda i: chat(client, PROMPTS[i % len(PROMPTS)]), range(8)))
    for i, out in enumerate(outs):
        assert out.choices[0].model_extra["token_ids"] == expected[i % len(PROMPTS)]
        router = out.model_extra["spec"]["router"]
        assert router["tokens_per_s"][LOOKUP_SEPARATE] == 0, router
        assert router["choice"] != LOOKUP_SEPARATE or router["reason"] == "explore", router
        assert router["tokens_per_s"][DRAFT_LM] > 0 and router["tokens_per_s"][HSR] > 0, router["tokens_per_s"]
        assert router["tokens_per_s"]["none"] > 0 and router["tokens_per_s"]["prompt-lookup"] > 0


@pytest.mark.parametrize("spec", [
    {"draft": "none"},
    {"draft": "prompt-lookup", "window": 4},
    {"draft": DRAFT_LM, "window": 3},
    {"draft": DRAFT_LM, "tree": {"depth": 3, "top_k": 2, "budget": 6}},
    {"draft": "prompt-lookup", "tree": {"depth": 4, "top_k": 2, "budget": 8}},
    {"draft": LOOKUP_SEPARATE, "window": 4},
    # The target's hidden states cross the hop to the HSR deployment, or stay in the replica.
    {"draft": HSR, "window": 3},
    # Drafts from the earlier requests' outputs (shared through Redis) and the seed answers.
    {"draft": "suffix", "window": 4},
    {"draft": "hsr-in-target", "tree": {"depth": 4, "top_k": 2, "budget": 8}},
], ids=lambda s: "-".join(str(v) for v in s.values()))
def test_served_greedy_equals_in_process_target_only(client, expected, spec):
    """Every output equals the target's own. A draft deployment that answers later than the step
    can wait leaves that step plain (``StepLoop``), so on a loaded machine a pass may accept
    nothing: the prompts go round again, up to three times, until some step accepted a token."""
    summaries = []
    for _ in range(3):
        for prompt, want in zip(PROMPTS, expected):
            out = chat(client, prompt, spec)
            choice = out.choices[0]
            assert choice.model_extra["token_ids"] == want, f"{spec} on {prompt!r}"
            assert out.usage.completion_tokens == len(want)
            assert out.model_extra["spec"]["draft"] == spec["draft"]
            summaries.append(out.model_extra["spec"])
        if spec["draft"] == "none" or any(s["mean_accepted_len"] > 1.0 for s in summaries):
            return
    raise AssertionError(f"{spec}: no step ever accepted a draft token, so the test proved nothing: {summaries}")


def test_auto_requests_are_routed_and_the_decision_is_visible_everywhere(served, client, stub, expected):
    """No spec.draft: the target replica's router picks the draft after the prefill. The output is
    still the target's own; spec.router (HTTP and gRPC) says what was chosen and why;
    GET /v1/routing/recent and `specserve routes` list the decisions with features and outcomes;
    the router's metrics reach the Prometheus endpoint; and the JSON decision line comes back
    through the Ray dashboard's log API, token authentication on."""
    from specserve.cluster.local import auth_token

    drafts = {"none", "prompt-lookup", "suffix", DRAFT_LM, LOOKUP_SEPARATE, HSR, "hsr-in-target"}
    routed = []
    for prompt, want in zip(PROMPTS, expected):
        out = chat(client, prompt)
        assert out.choices[0].model_extra["token_ids"] == want, f"routed output differs on {prompt!r}"
        router = out.model_extra["spec"]["router"]
        assert router["choice"] in drafts and router["reason"] in ("predicted", "explore", "no-gain")
        assert set(router["predicted_alpha"]) == drafts - {"none"}
        routed.append(router)
    reply = stub.Complete(pb.CompletionRequest(model=MODEL, prompt=PROMPTS[2], max_tokens=8), timeout=120)
    assert reply.spec.router.choice in drafts and reply.spec.router.reason

    def recent():
        body = httpx.get(served.http_url + "/v1/routing/recent", params={"limit": 50}, timeout=30).json()
        return body, [r for r in body["data"] if r["reason"] != "pinned"]

    # outcomes reach Redis within a flush (2 s)
    body, data = wait_until(recent, lambda seen: len(seen[1]) >= len(PROMPTS) + 1, timeout=60, interval=1)
    assert body["source"] == "cluster" and len(data) >= len(PROMPTS) + 1, body
    assert {"features_named", "realised", "observations", "choice", "final_draft"} <= set(data[-1])
    # The same window as the decisions read above: the module's pinned requests share the stream.
    shown = subprocess.run([sys.executable, "-m", "specserve.cli.main", "routes", "--server", served.http_url,
                            "--limit", "50"], capture_output=True, text=True, timeout=120)
    assert shown.returncode == 0 and "whole cluster" in shown.stdout and data[-1]["request_id"][:10] in shown.stdout, shown

    names = ("ray_specserve_router_decisions", "ray_specserve_router_predicted_alpha_bucket",
             "ray_specserve_router_realised_alpha_bucket", "ray_specserve_router_mean_accepted_len_bucket")
    text = wait_until(lambda: httpx.get(served.metrics_url, timeout=30).text, lambda t: all(n in t for n in names),
                      timeout=90, interval=2)
    assert all(n in text for n in names), [n for n in names if n not in text]

    headers = {"Authorization": f"Bearer {auth_token()}"}
    nodes = httpx.get(served.dashboard_url + "/api/v0/nodes", headers=headers, timeout=30).json()
    node = nodes["data"]["result"]["result"][0]["node_id"]
    files = httpx.get(served.dashboard_url + "/api/v0/logs", headers=headers, timeout=30,
                      params={"node_id": node, "glob": "serve/replica_specserve_target_*.log"}).json()
    names = [f for group in files["data"]["result"].values() for f in group if f.endswith(".log")]
    assert names, files
    lines = []
    for name in names:
        log = httpx.get(served.dashboard_url + "/api/v0/logs/file", headers=headers, timeout=30,
                        params={"node_id": node, "filename": name, "lines": 5000}).text
        lines += [line for line in log.splitlines() if "specserve.routing " in line]
    decisions = [json.loads(line.split("specserve.routing ", 1)[1]) for line in lines]
    ours = [d for d in decisions if d["event"] == "decision" and d["request_id"] in {r["request_id"] for r in data}]
    assert ours and {"features", "scores", "choice", "reason"} <= set(ours[0]), lines[-3:]
    assert any(d["event"] == "outcome" for d in decisions)
    without_token = httpx.get(served.dashboard_url + "/api/v0/logs", timeout=30,
                              params={"node_id": node, "glob": "*replica*"})
    assert without_token.status_code in (401, 403), "the dashboard's log API must ask for the token"


def test_streaming_chat_equals_non_streaming(client):
    # A pinned window: the adaptive policies price steps by measured time, so their step counts
    # may differ between two runs of one prompt; the text may not.
    pinned = {"draft": "prompt-lookup", "window": 4}
    whole = chat(client, PROMPTS[0], pinned)
    pieces, finish, usage, spec = [], None, None, None
    for chunk in chat(client, PROMPTS[0], pinned, stream=True,
                      stream_options={"include_usage": True}):
        if chunk.choices:
            pieces.append(chunk.choices[0].delta.content or "")
            finish = chunk.choices[0].finish_reason or finish
            spec = (chunk.model_extra or {}).get("spec") or spec
        if chunk.usage:
            usage = chunk.usage
    assert "".join(pieces) == whole.choices[0].message.content
    assert finish == whole.choices[0].finish_reason
    assert usage.completion_tokens == whole.usage.completion_tokens
    assert spec["steps"] == whole.model_extra["spec"]["steps"]


def test_sse_stream_ends_with_done(served):
    body = {"model": MODEL, "prompt": "Count: one, two,", "max_tokens": 8, "temperature": 0, "stream": True}
    with httpx.stream("POST", served.http_url + "/v1/completions", json=body, timeout=300) as response:
        assert response.status_code == 200
        assert response.headers["content-type"].startswith("text/event-stream")
        lines = [line for line in response.iter_lines() if line]
    assert lines[-1] == "data: [DONE]"
    chunks = [json.loads(line.removeprefix("data: ")) for line in lines[:-1]]
    assert all(c["object"] == "text_completion" for c in chunks)
    assert chunks[-1]["choices"][0]["finish_reason"] in ("stop", "length")


def test_completions_endpoint(client, engine):
    prompt = "def add(a, b):\n    return"
    out = client.completions.create(model=MODEL, prompt=prompt, max_tokens=12, temperature=0,
                                    extra_body={"return_token_ids": True})
    want = speculative_generate(Target(engine.loaded.model), None, engine.encode(prompt, chat=False), 12,
                                SamplingParams(), eos_token_ids=engine.loaded.eos_token_ids).token_ids
    assert out.choices[0].model_extra["token_ids"] == want
    streamed = "".join(c.choices[0].text for c in client.completions.create(
        model=MODEL, prompt=prompt, max_tokens=12, temperature=0, stream=True))
    assert streamed == out.choices[0].text


CONTROLS = {"frequency_penalty": 0.8, "presence_penalty": 0.3, "logit_bias": {"28": 4.0, "30": -50.0},
            "repetition_penalty": 1.3, "min_p": 0.05, "min_tokens": 20, "stop_token_ids": [30], "ignore_eos": True}


def test_sampling_controls_over_http_and_grpc_are_plain_decodings_with_them(client, stub, engine):
    """vLLM's sampling controls change the target's distribution; verification accepts drafts
    against the changed one, so speculative output equals target-only decoding with them."""
    params = SamplingParams(frequency_penalty=0.8, presence_penalty=0.3, logit_bias=((28, 4.0), (30, -50.0)),
                            repetition_penalty=1.3, min_p=0.05, min_tokens=20, stop_token_ids=(30,), ignore_eos=True)
    want = speculative_generate(Target(engine.loaded.model), None, engine.encode(PROMPTS[0]), NEW_TOKENS, params,
                                eos_token_ids=engine.loaded.eos_token_ids).token_ids
    assert want != expected_plain(engine, PROMPTS[0])   # the controls changed the output
    for spec in ({"draft": "prompt-lookup", "window": 4}, {"draft": DRAFT_LM, "window": 3}, {"draft": "auto"}):
        extra = {k: v for k, v in CONTROLS.items() if k not in ("frequency_penalty", "presence_penalty", "logit_bias")}
        out = client.chat.completions.create(
            model=MODEL, messages=[{"role": "user", "content": PROMPTS[0]}], max_tokens=NEW_TOKENS, temperature=0,
            frequency_penalty=0.8, presence_penalty=0.3, logit_bias={"28": 4, "30": -50},
            extra_body={"spec": spec, "return_token_ids": True, **extra})
        assert out.choices[0].model_extra["token_ids"] == want, spec
    got = stub.Complete(grpc_request(PROMPTS[0], spec=pb.SpecOptions(draft="prompt-lookup", window=4),
                                     frequency_penalty=0.8, presence_penalty=0.3, logit_bias={28: 4.0, 30: -50.0},
                                     repetition_penalty=1.3, min_p=0.05, min_tokens=20, stop_token_ids=[30],
                                     ignore_eos=True), timeout=300)
    assert list(got.token_ids) == want


def expected_plain(engine, prompt: str) -> list[int]:
    return speculative_generate(Target(engine.loaded.model), None, engine.encode(prompt), NEW_TOKENS, SamplingParams(),
                                eos_token_ids=engine.loaded.eos_token_ids).token_ids


def test_logprobs_are_the_targets_whatever_drafted_streamed_or_not(client, stub, engine):
    prompt_ids = engine.encode(PROMPTS[1])
    want = run_batch(Target(engine.loaded.model), {}, [SpecRequest(prompt_ids, NEW_TOKENS, logprobs=2)],
                     engine.loaded.eos_token_ids)[0]
    out = chat(client, PROMPTS[1], {"draft": "prompt-lookup", "window": 4}, logprobs=True, top_logprobs=2)
    assert out.choices[0].model_extra["token_ids"] == want.token_ids
    content = out.choices[0].logprobs.content
    assert [c.logprob for c in content] == pytest.approx([lp.logprob for lp in want.logprobs], abs=2e-3)
    assert [len(c.top_logprobs) for c in content] == [2] * len(want.token_ids)
    assert "".join(c.token for c in content) == out.choices[0].message.content
    streamed = [c for chunk in chat(client, PROMPTS[1], {"draft": "prompt-lookup", "window": 4}, stream=True,
                                    logprobs=True, top_logprobs=2)
                if chunk.choices and chunk.choices[0].logprobs for c in chunk.choices[0].logprobs.content]
    assert [c.logprob for c in streamed] == pytest.approx([c.logprob for c in content], abs=2e-3)
    grpc_out = stub.Complete(grpc_request(PROMPTS[1], spec=pb.SpecOptions(draft="prompt-lookup", window=4), logprobs=2),
                             timeout=300)
    assert [lp.logprob for lp in grpc_out.logprobs] == pytest.approx([lp.logprob for lp in want.logprobs], abs=2e-3)


def test_completions_echo_the_prompt_with_its_logprobs(client, engine):
    prompt = "The capital of France is"
    ids = engine.encode(prompt, chat=False)
    want = run_batch(Target(engine.loaded.model), {}, [SpecRequest(ids, 3, logprobs=1, prompt_logprobs=1)],
                     engine.loaded.eos_token_ids)[0]
    for _ in range(2):   # the second time the prompt's KV is cached on a replica: the logprobs stay
        out = client.completions.create(model=MODEL, prompt=prompt, max_tokens=3, temperature=0, echo=True, logprobs=1)
        logprobs = out.choices[0].logprobs
        assert out.choices[0].text.startswith(prompt)
        assert logprobs.token_logprobs[0] is None and len(logprobs.tokens) == len(ids) + 3
        assert logprobs.token_logprobs[1:] == pytest.approx(
            [lp.logprob for lp in want.prompt_logprobs[1:]] + [lp.logprob for lp in want.logprobs], abs=2e-3)
        assert logprobs.text_offset[len(ids)] == len(prompt)


PERSON = {"type": "object", "properties": {"name": {"type": "string"}, "age": {"type": "integer"},
          "city": {"type": "string", "enum": ["Paris", "Rome", "Oslo"]}},
          "required": ["name", "age", "city"], "additionalProperties": False}


def test_structured_output_follows_the_schema_and_equals_plain_decoding_under_it(client, stub, engine):
    """JSON-schema output through the openai client (response_format) and gRPC: it parses, it
    validates, and whatever drafted, it is the target's own greedy decoding under the grammar."""
    import jsonschema
    import llguidance

    from specserve.replicas.grammar import grammar_tokenizer

    prompt = "Describe a person as JSON with their name, age and city."
    loaded = engine.loaded
    grammar = llguidance.LLMatcher.grammar_from_json_schema(PERSON)
    tokenizer = lambda: grammar_tokenizer(loaded.tokenizer, loaded.model.config.vocab_size,  # noqa: E731
                                          tuple(sorted(loaded.eos_token_ids)))
    want = run_batch(Target(loaded.model), {}, [SpecRequest(engine.encode(prompt), 64, grammar=grammar)],
                     loaded.eos_token_ids, grammar_tokenizer=tokenizer)[0].token_ids
    schema_format = {"type": "json_schema", "json_schema": {"name": "person", "schema": PERSON, "strict": True}}
    for spec in ({"draft": "prompt-lookup", "window": 4}, {"draft": DRAFT_LM, "window": 3}, {"draft": "auto"}):
        out = client.chat.completions.create(
            model=MODEL, messages=[{"role": "user", "content": prompt}], max_tokens=64, temperature=0,
            response_format=schema_format, extra_body={"spec": spec, "return_token_ids": True})
        assert out.choices[0].model_extra["token_ids"] == want, spec
        jsonschema.validate(json.loads(out.choices[0].message.content), PERSON)
    got = stub.Complete(grpc_request(prompt, max_tokens=64, spec=pb.SpecOptions(draft="prompt-lookup", window=4),
                                     structured_output=pb.StructuredOutput(json_schema=json.dumps(PERSON))), timeout=300)
    assert list(got.token_ids) == want
    choice = client.completions.create(model=MODEL, prompt="The sky is", max_tokens=8, temperature=0,
                                       extra_body={"structured_outputs": {"choice": [" blue", " green"]}})
    assert choice.choices[0].text in (" blue", " green")


WEATHER = {"type": "object", "properties": {"city": {"type": "string", "maxLength": 24},
                                           "unit": {"type": "string", "enum": ["celsius", "fahrenheit"]}},
           "required": ["city", "unit"], "additionalProperties": False}
WEATHER_TOOL = {"type": "function", "function": {"name": "get_weather", "description": "The weather in a city now.",
                                                  "parameters": WEATHER}}


def test_tool_calls_parse_with_valid_arguments_streamed_or_not_and_through_langchain(served, client):
    """Required and named tool choices (held to the schema by a grammar) come back as
    ``tool_calls`` with arguments that validate, streamed as ``delta.tool_calls`` too; the call's
    result goes back as a ``tool`` message; LangChain's ``bind_tools`` and
    ``with_structured_output`` (both methods) work unmodified."""
    import jsonschema
    from langchain_openai import ChatOpenAI
    from pydantic import BaseModel, Field

    ask = [{"role": "user", "content": "What is the weather in Paris?"}]
    named = {"type": "function", "function": {"name": "get_weather"}}
    for tool_choice in ("required", named):   # required: one call (a small model would go on calling)
        out = client.chat.completions.create(model=MODEL, messages=ask, tools=[WEATHER_TOOL], tool_choice=tool_choice,
                                             parallel_tool_calls=False, max_tokens=64, temperature=0)
        message = out.choices[0].message
        assert out.choices[0].finish_reason == "tool_calls" and message.tool_calls, out
        assert message.tool_calls[0].function.name == "get_weather"
        jsonschema.validate(json.loads(message.tool_calls[0].function.arguments), WEATHER)
    streamed = [call for chunk in client.chat.completions.create(
        model=MODEL, messages=ask, tools=[WEATHER_TOOL], tool_choice=named, max_tokens=64, temperature=0, stream=True)
        for choice in chunk.choices for call in choice.delta.tool_calls or ()]
    assert [c.function.name for c in streamed] == ["get_weather"]
    assert streamed[0].function.arguments == message.tool_calls[0].function.arguments   # as the whole answer's
    call = message.tool_calls[0]
    follow = client.chat.completions.create(model=MODEL, max_tokens=16, temperature=0, tools=[WEATHER_TOOL], messages=[
        *ask, {"role": "assistant", "content": None, "tool_calls": [call.model_dump()]},
        {"role": "tool", "tool_call_id": call.id, "content": "18 degrees and sunny"}])
    assert follow.choices[0].finish_reason in ("stop", "length", "tool_calls")

    class GetWeather(BaseModel):
        """The weather in a city now."""
        city: str = Field(max_length=24)

    class Person(BaseModel):
        name: str = Field(max_length=24)
        age: int

    llm = ChatOpenAI(model=MODEL, base_url=f"{served.http_url}/v1", api_key="unused", temperature=0, max_tokens=64,
                     max_retries=0)
    reply = llm.bind_tools([GetWeather], tool_choice="GetWeather").invoke("What is the weather in Paris?")
    assert [c["name"] for c in reply.tool_calls] == ["GetWeather"] and isinstance(reply.tool_calls[0]["args"]["city"], str)
    for method in ("json_schema", "function_calling"):
        person = llm.with_structured_output(Person, method=method).invoke("Describe a person.")
        assert isinstance(person, Person), method


CHOICE_TASK = """task: specserve_choice
dataset_path: json
dataset_kwargs:
  data_files:
    test: {data}
test_split: test
output_type: multiple_choice
doc_to_text: "{{{{question}}}}"
doc_to_choice: "{{{{choices}}}}"
doc_to_target: "{{{{answer}}}}"
metric_list:
  - metric: acc
"""
GENERATE_TASK = """task: specserve_generate
dataset_path: json
dataset_kwargs:
  data_files:
    test: {data}
test_split: test
output_type: generate_until
doc_to_text: "{{{{question}}}}"
doc_to_target: "{{{{answer}}}}"
generation_kwargs:
  until: ["\\n\\n"]
  max_gen_toks: 16
  do_sample: false
metric_list:
  - metric: exact_match
"""
CHOICES = [
    {"question": "The capital of France is", "choices": [" Paris", " Rome", " Berlin"], "answer": 0},
    {"question": "Two plus two equals", "choices": [" five", " four", " three"], "answer": 1},
    {"question": "Water freezes at zero degrees", "choices": [" Celsius", " Fahrenheit"], "answer": 0},
    {"question": "The opposite of hot is", "choices": [" warm", " cold", " loud"], "answer": 1},
]
QUESTIONS = [
    {"question": "Name a primary colour.", "answer": "Red"},
    {"question": "What is the largest planet in the solar system?", "answer": "Jupiter"},
    {"question": "Write the word 'yes' in capitals.", "answer": "YES"},
]


def test_lm_evaluation_harness_over_http_scores_as_it_does_in_process(served, tmp_path):
    """lm-evaluation-harness, unmodified: a loglikelihood task through ``local-completions`` (echo
    and prompt logprobs) and a generate-until task through ``local-chat-completions`` give the
    per-sample numbers and outputs its own in-process run of the same weights (its ``hf``
    backend, float32) gives."""
    from lm_eval import simple_evaluate
    from lm_eval.tasks import TaskManager

    from specserve.replicas.model_store import resolve_model_path

    weights = resolve_model_path(MODEL)
    for name, task, rows in (("choice", CHOICE_TASK, CHOICES), ("generate", GENERATE_TASK, QUESTIONS)):
        data = tmp_path / f"{name}.jsonl"
        data.write_text("".join(json.dumps(r) + "\n" for r in rows))
        (tmp_path / f"{name}.yaml").write_text(task.format(data=data))
    tasks = TaskManager(include_path=str(tmp_path))

    def evaluate(task: str, model: str, model_args: str, chat: bool = False) -> dict:
        return simple_evaluate(model=model, model_args=model_args, tasks=[task], task_manager=tasks, log_samples=True,
                               apply_chat_template=chat, batch_size=1)

    served_args = f"model={MODEL},tokenizer={weights},num_concurrent=2,max_retries=1"
    local_args = f"pretrained={weights},dtype=float32,device=cpu"
    choice = evaluate("specserve_choice", "local-completions",
                      f"{served_args},base_url={served.http_url}/v1/completions,tokenized_requests=True")
    choice_local = evaluate("specserve_choice", "hf", local_args)
    assert choice["results"]["specserve_choice"]["acc,none"] == choice_local["results"]["specserve_choice"]["acc,none"]
    got = [r for sample in choice["samples"]["specserve_choice"] for r in sample["resps"]]
    want = [r for sample in choice_local["samples"]["specserve_choice"] for r in sample["resps"]]
    assert len(got) == len(want) == sum(len(c["choices"]) for c in CHOICES)
    for (served_ll, served_greedy), (local_ll, local_greedy) in ((g[0], w[0]) for g, w in zip(got, want)):
        assert served_ll == pytest.approx(local_ll, abs=2e-3) and served_greedy == local_greedy

    generated = evaluate("specserve_generate", "local-chat-completions",
                         f"{served_args},base_url={served.http_url}/v1/chat/completions", chat=True)
    generated_local = evaluate("specserve_generate", "hf", local_args, chat=True)
    texts = [s["filtered_resps"] for s in generated["samples"]["specserve_generate"]]
    assert texts == [s["filtered_resps"] for s in generated_local["samples"]["specserve_generate"]]
    assert all(t[0].strip() for t in texts)


def test_stop_string_ends_the_text(client):
    full = chat(client, PROMPTS[2]).choices[0].message.content
    cut = full.split()[2]
    out = chat(client, PROMPTS[2], stop=[cut])
    assert out.choices[0].message.content == full[: full.index(cut)]
    assert out.choices[0].finish_reason == "stop"


def test_seeded_sampling_is_repeatable_and_choice_i_draws_from_seed_plus_i(client):
    # Prompt lookup draws no random numbers: a draft model apart from the target draws its chains
    # ahead while the target verifies, and whether one comes in time (and so how many draws the
    # request's draft stream has made) varies from run to run.
    def sample(seed, **fields):
        return client.chat.completions.create(
            model=MODEL, messages=[{"role": "user", "content": PROMPTS[1]}], max_tokens=16, temperature=0.8,
            top_p=0.95, seed=seed, extra_body={"spec": {"draft": "prompt-lookup", "window": 3}, "return_token_ids": True},
            **fields)

    alone = [sample(seed).choices[0].message.content for seed in (7, 8, 9)]
    assert sample(7).choices[0].message.content == alone[0]
    three = sample(7, n=3)
    assert [(c.index, c.message.content) for c in three.choices] == list(enumerate(alone))
    assert three.usage.completion_tokens == sum(len(c.model_extra["token_ids"]) for c in three.choices)
    streamed = {0: "", 1: ""}
    for chunk in sample(7, n=2, stream=True):
        for choice in chunk.choices:
            streamed[choice.index] += choice.delta.content or ""
    assert streamed == {0: alone[0], 1: alone[1]}
    best = client.completions.create(model=MODEL, prompt=PROMPTS[1], max_tokens=8, temperature=1.0, seed=3,
                                     n=2, best_of=3, logprobs=0)
    ranked = [sum(c.logprobs.token_logprobs) for c in best.choices]
    assert len(ranked) == 2 and ranked[0] >= ranked[1]


def grpc_request(prompt: str, **fields) -> pb.CompletionRequest:
    fields = {"max_tokens": NEW_TOKENS, "temperature": 0, **fields}
    return pb.CompletionRequest(model=MODEL, messages=[pb.ChatMessage(role="user", content=prompt)], **fields)


def test_grpc_unary_and_streaming_equal_the_target(stub, expected):
    spec = pb.SpecOptions(draft="prompt-lookup", window=4)
    out = stub.Complete(grpc_request(PROMPTS[0], spec=spec), timeout=300)
    assert list(out.token_ids) == expected[0]
    assert out.usage.completion_tokens == len(expected[0]) and out.spec.draft == "prompt-lookup"
    chunks = list(stub.CompleteStream(grpc_request(PROMPTS[0], spec=spec), timeout=300))
    assert [t for c in chunks for t in c.token_ids] == expected[0]
    assert "".join(c.text for c in chunks) == out.text
    assert chunks[-1].finish_reason == out.finish_reason and chunks[-1].spec.steps == out.spec.steps


BAD_HTTP = [
    ("/v1/chat/completions", {"model": MODEL, "messages": []}, "messages"),
    ("/v1/chat/completions", {"model": MODEL, "messages": [{"role": "user", "content": "  "}]}, "messages"),
    ("/v1/completions", {"model": MODEL, "prompt": ""}, "prompt"),
    ("/v1/completions", {"model": MODEL, "prompt": "hi", "max_tokens": -1}, "max_tokens"),
    ("/v1/completions", {"model": MODEL, "prompt": "hi", "max_tokens": 10**9}, "max_tokens"),
    ("/v1/completions", {"model": MODEL, "prompt": "hi", "max_tokens": "many"}, "max_tokens"),
    ("/v1/completions", {"model": MODEL, "prompt": "hi", "temperature": "hot"}, "temperature"),
    ("/v1/completions", {"model": MODEL, "prompt": "hi", "spec": {"draft": "nope"}}, "spec.draft"),
    ("/v1/completions", {"model": MODEL, "prompt": "hi", "spec": {"window": -2}}, "spec.window"),
    ("/v1/completions", {"model": MODEL, "prompt": [10**9]}, "prompt"),
    ("/v1/completions", {"model": MODEL, "prompt": "word " * 9000}, "prompt"),
    ("/v1/completions", {"model": MODEL}, "prompt"),
]


def test_bad_http_input_is_a_400_with_openais_body_and_the_replicas_live_on(served, client):
    before = local.app_status()["deployments"]
    for path, body, param in BAD_HTTP:
        response = httpx.post(served.http_url + path, json=body, timeout=60)
        assert response.status_code == 400, (body, response.text)
        error = response.json()["error"]
        assert set(error) == {"message", "type", "param", "code"} and error["type"] == "invalid_request_error"
        assert error["param"] == param, (body, error)
    response = httpx.post(served.http_url + "/v1/completions", content=b"{not json", timeout=60,
                          headers={"content-type": "application/json"})
    assert response.status_code == 400 and "not valid JSON" in response.json()["error"]["message"]
    response = httpx.post(served.http_url + "/v1/completions", json={"model": "gpt-9", "prompt": "hi"}, timeout=60)
    assert response.status_code == 404 and response.json()["error"]["code"] == "model_not_found"
    # The openai client raises its own typed error for them.
    from openai import BadRequestError

    with pytest.raises(BadRequestError, match="unknown draft"):
        chat(client, "hi", {"draft": "nope"})
    assert chat(client, PROMPTS[0]).choices[0].message.content, "the next good request must still be served"
    after = local.app_status()["deployments"]
    assert {n: d["replica_states"] for n, d in after.items()} == {n: d["replica_states"] for n, d in before.items()}


@pytest.mark.parametrize("request_, code", [
    (pb.CompletionRequest(model=MODEL), grpc.StatusCode.INVALID_ARGUMENT),
    (pb.CompletionRequest(model=MODEL, prompt="hi", max_tokens=-3), grpc.StatusCode.INVALID_ARGUMENT),
    (pb.CompletionRequest(model=MODEL, prompt="hi", spec=pb.SpecOptions(draft="nope")), grpc.StatusCode.INVALID_ARGUMENT),
    (pb.CompletionRequest(model=MODEL, prompt="hi", max_tokens=10**9), grpc.StatusCode.INVALID_ARGUMENT),
    (pb.CompletionRequest(model="gpt-9", prompt="hi"), grpc.StatusCode.NOT_FOUND),
])
def test_bad_grpc_input(stub, request_, code):
    for call in (stub.Complete, lambda r, timeout: list(stub.CompleteStream(r, timeout=timeout))):
        with pytest.raises(grpc.RpcError) as err:
            call(request_, timeout=60)
        assert err.value.code() == code, err.value.details()
        assert err.value.details()


def test_a_passed_deadline_or_a_client_that_hangs_up_costs_nothing_else(served, stub, client, expected):
    long_request = grpc_request(PROMPTS[1], max_tokens=200)
    with pytest.raises(grpc.RpcError) as err:
        stub.Complete(long_request, timeout=0.5)
    assert err.value.code() == grpc.StatusCode.DEADLINE_EXCEEDED
    body = {"model": MODEL, "prompt": PROMPTS[1], "max_tokens": 200, "temperature": 0, "stream": True}
    with httpx.stream("POST", served.http_url + "/v1/completions", json=body, timeout=300) as response:
        next(response.iter_lines())          # the stream has started; now hang up
    out = stub.Complete(grpc_request(PROMPTS[0], spec=pb.SpecOptions(draft="prompt-lookup")), timeout=300)
    assert list(out.token_ids) == expected[0]


def test_cli_status_and_generate_on_the_server(served, expected):
    env = {**os.environ, "SPECSERVE_HOME": os.environ["SPECSERVE_HOME"]}
    result = subprocess.run([sys.executable, "-m", "specserve.cli.main", "status", "--json"],
                            capture_output=True, text=True, timeout=120, env=env)
    assert result.returncode == 0, result.stderr
    report = json.loads(result.stdout)
    deployments = report["application"]["deployments"]
    assert {"ingress", "target", f"draft-{LOOKUP_SEPARATE}", f"draft-{DRAFT_LM}"} <= set(deployments)
    assert "draft-prompt-lookup" not in deployments   # placed inside the target
    assert report["placement"]["prompt-lookup"]["where"] == "inside"
    assert report["placement"][DRAFT_LM] == {"where": "separate", "reason": "configured"}
    # Serving: healthy, or scaling (the ingress here scales at one ongoing request, and the request
    # the previous test abandoned may still be finishing).
    serving = ("HEALTHY", "UPSCALING", "DOWNSCALING")
    assert all(d["status"] in serving and d["replicas"] >= 1 for d in deployments.values()), deployments
    assert report["redis"]["up"] and report["redis"]["pid"]
    assert report["http"].endswith("/v1") and report["grpc"] and report["dashboard"]
    for server in (served.http_url, f"grpc://{served.grpc_address}"):
        result = subprocess.run(
            [sys.executable, "-m", "specserve.cli.main", "generate", PROMPTS[0], "--json", "--server", server,
             "--max-tokens", str(NEW_TOKENS), "--draft", "prompt-lookup", "--window", "4"],
            capture_output=True, text=True, timeout=300, env=env)
        assert result.returncode == 0, result.stderr
        assert json.loads(result.stdout)["token_ids"] == expected[0], server


def test_a_draft_replica_that_dies_mid_request_costs_speed_not_the_request(served, client, expected):
    import ray

    def kill_draft_replicas():
        for actor in ray.util.list_named_actors(all_namespaces=True):
            if f"#draft-{DRAFT_LM}#" in actor["name"]:
                ray.kill(ray.get_actor(actor["name"], namespace=actor["namespace"]), no_restart=False)

    stream = chat(client, PROMPTS[1], {"draft": DRAFT_LM, "window": 2}, stream=True)
    first = next(iter(stream))
    kill_draft_replicas()
    text = (first.choices[0].delta.content or "") + "".join(c.choices[0].delta.content or "" for c in stream if c.choices)
    assert text == chat(client, PROMPTS[1], {"draft": "none"}).choices[0].message.content
    local.wait_healthy(served.app_name, timeout_s=300)


def test_a_burst_scales_the_ingress_out(served, client):
    def one(i):
        return chat(client, PROMPTS[i % len(PROMPTS)], {"draft": "prompt-lookup"}).usage.completion_tokens

    with concurrent.futures.ThreadPoolExecutor(8) as pool:
        burst = [pool.submit(one, i) for i in range(8)]
        replicas = wait_until(lambda: local.app_status()["deployments"]["ingress"]["replica_states"].get("RUNNING", 0),
                              lambda n: n >= 2, timeout=120, interval=0.5)
        assert all(f.result() > 0 for f in burst), "every request of the burst must be served"
    assert replicas == 2, "8 concurrent requests at target_ongoing_requests=1 should scale the ingress to 2"


def _redis_counts(url: str, field: str) -> int:
    from specserve.policies.redis_stats import RedisStats

    return sum(c[field] for c in RedisStats(url, "specserve").read().values())


def test_a_short_soak_against_the_running_stack(served, tmp_path):
    """``specserve bench soak --server`` end to end: the mix for 20 s at the stack's HTTP port; every
    request succeeds, every window has percentiles, and the replicas' memory was sampled through the
    local Ray cluster (the targets' among them)."""
    out, plot = tmp_path / "soak.json", tmp_path / "soak.png"
    result = subprocess.run(
        [sys.executable, "-m", "specserve.cli.main", "bench", "soak", "--server", served.http_url, "--minutes", "0.34",
         "--rate", "0.6", "--max-tokens", "12", "--window-s", "10", "--sample-s", "2",
         "--json", str(out), "--plot", str(plot)],
        capture_output=True, text=True, timeout=600)
    assert result.returncode == 0, result.stdout[-2000:] + result.stderr[-3000:]
    report = json.loads(out.read_text())
    assert report["config"]["server"] and report["totals"]["requests"] >= 4 and report["aims"]["zero_failed"], \
        report["failures"]
    assert {r["spec"] for r in report["requests"]} >= {"default", "none"} or len(report["requests"]) < 6
    assert len(report["windows"]) == 3 and report["windows"][0]["latency_p50_s"] is not None
    assert report["memory"]["available"]
    targets = [name for name in report["memory"]["growth"] if name.startswith("target#")]
    assert targets and all(report["memory"]["growth"][t]["after_warmup_mb"] > 100 for t in targets)
    assert plot.stat().st_size > 10_000 and "aims:" in result.stdout


def test_the_policy_service_publishes_priors_and_new_requests_start_from_them(served, client):
    """Replicas' counters reach Redis, the policy service turns them into a snapshot that
    GET /v1/policy shows, and a new request's `spec.prior` names the snapshot it started from."""
    for _ in range(10):   # the static policy drafts every step it can: enough steps for a prior
        chat(client, PROMPTS[2], {"draft": "prompt-lookup", "policy": "static"})
    def snapshot():
        body = httpx.get(served.http_url + "/v1/policy", timeout=30).json()
        return body, [p for p in (body["snapshot"] or {}).get("priors", []) if p["draft"] == "prompt-lookup"]

    body, priors = wait_until(snapshot, lambda seen: bool(seen[1]), timeout=90, interval=1)
    assert priors, f"no prompt-lookup prior within 90 s: {body}"
    shown = subprocess.run([sys.executable, "-m", "specserve.cli.main", "policy", "--server", served.http_url],
                           capture_output=True, text=True, timeout=120)
    assert shown.returncode == 0 and "snapshot version" in shown.stdout and "prompt-lookup" in shown.stdout, shown
    assert {"alpha", "best_window", "mean_accepted_len", "latency_ratio", "acceptance_by_position"} <= set(priors[0])
    assert 0.0 <= priors[0]["alpha"] <= 1.0 and body["service"]["redis_error"] is None
    deadline, prior = time.monotonic() + 60, None
    while prior is None and time.monotonic() < deadline:
        prior = chat(client, PROMPTS[2], {"draft": "prompt-lookup"}).model_extra["spec"].get("prior")
    assert prior is not None and prior["version"] >= 1 and prior["window"] >= 1
    # A pinned window is the client's: no prior.
    assert "prior" not in chat(client, PROMPTS[2], {"draft": "prompt-lookup", "window": 3}).model_extra["spec"]


def test_redis_killed_while_requests_stream_loses_nothing_and_the_counts_arrive_after_restart(served, client, tmp_path):
    import signal

    from specserve.cluster.redis_server import RedisServer, ping

    time.sleep(5)   # earlier tests' counts flushed (every 2 s), so that Redis holds only what follows
    os.kill(served.redis_pid, signal.SIGKILL)
    assert not wait_until(lambda: ping(served.redis_url), lambda up: not up, timeout=10)

    def one(i):
        return chat(client, PROMPTS[i % len(PROMPTS)], {"draft": "prompt-lookup"}).usage.completion_tokens

    with concurrent.futures.ThreadPoolExecutor(4) as pool:
        assert all(n > 0 for n in pool.map(one, range(8))), "every request is served while Redis is down"
    assert httpx.get(served.http_url + "/health", timeout=30).status_code == 200
    # Health checks (every 10 s) do not ask Redis: every deployment stays healthy while it is down.
    time.sleep(12)
    statuses = {name: d["status"] for name, d in local.app_status()["deployments"].items()}
    assert set(statuses.values()) == {"HEALTHY"}, statuses
    assert httpx.get(served.http_url + "/v1/policy", timeout=30).status_code == 200   # the last snapshot
    from urllib.parse import unquote, urlsplit

    url = urlsplit(served.redis_url)
    # Empty (it kept nothing on disk), on the same port with the same password: the replicas' URL.
    restarted = RedisServer.start(tmp_path, port=url.port, password=unquote(url.password))
    try:
        # The 8 requests counted during the outage arrive, once each (exactly-once flushes).
        wait_until(lambda: _redis_counts(served.redis_url, "requests"), lambda n: n >= 8, timeout=60, interval=1)
        time.sleep(5)   # a few more flush rounds: nothing may be counted twice
        assert _redis_counts(served.redis_url, "requests") == 8
    finally:
        restarted.stop()


def test_speculation_metrics_reach_the_prometheus_endpoint(served, client):
    """vLLM-named spec-decode counters on Ray's metrics endpoint (the Ray dashboard reads it)."""
    chat(client, PROMPTS[2], {"draft": "prompt-lookup", "policy": "static"})
    names = ("ray_specserve_spec_decode_num_drafts", "ray_specserve_spec_decode_num_draft_tokens",
             "ray_specserve_spec_decode_num_accepted_tokens", "ray_specserve_spec_decode_num_accepted_tokens_per_pos",
             "ray_specserve_spec_decode_window_bucket")
    text = wait_until(lambda: httpx.get(served.metrics_url, timeout=30).text, lambda t: all(n in t for n in names),
                      timeout=90, interval=2)
    missing = [n for n in names if n not in text]
    assert not missing, f"not on {served.metrics_url}: {missing}"
    drafts = [line for line in text.splitlines()   # Prometheus may add _total to a counter's name
              if line.startswith(("ray_specserve_spec_decode_num_drafts{", "ray_specserve_spec_decode_num_drafts_total{"))]
    assert any('draft="prompt-lookup"' in line and float(line.rsplit(" ", 1)[1]) > 0 for line in drafts), \
        [line for line in text.splitlines() if "spec_decode_num_drafts" in line]


def dashboard_queries() -> dict[str, str]:
    """Each query of the Grafana dashboard in deploy/, as Grafana sends it: every target, and a
    rate interval of a minute. Keyed by panel title and legend."""
    dashboard = json.loads((Path(__file__).resolve().parents[2] / "deploy" / "grafana" / "specserve-routing.json").read_text())
    return {f"{panel['title']} [{t.get('legendFormat', t['refId'])}]":
            t["expr"].replace("$target", ".+").replace("$__rate_interval", "1m")
            for panel in dashboard["panels"] for t in panel["targets"]}


RARE_EVENT = " or on() vector(0)"   # a panel of events that may not have happened yet shows 0


def test_every_panel_of_the_grafana_dashboard_has_data_in_prometheus(served, client):
    """`specserve up --prometheus` scrapes the cluster through Ray's service discovery; after
    routed traffic each query of the dashboard returns series of specserve's metrics, as its
    panels would in Grafana (a rare-event panel, such as mid-flight switches, its 0 until one
    happens)."""
    from specserve.cluster.prometheus_server import PrometheusServer

    if not HAS_PROMETHEUS:
        pytest.skip("no prometheus on PATH (Debian: apt-get install prometheus; ./setup.sh does as root)")
    assert served.prometheus_url and local.status()["prometheus"] == served.prometheus_url
    prometheus = PrometheusServer(served.prometheus_url, served.prometheus_pid)
    queries = dashboard_queries()
    assert len(queries) >= 10

    def empty() -> list[str]:
        for i in range(2):   # routed traffic in the window each rate looks at
            chat(client, PROMPTS[i], {"draft": "auto"})
        return [name for name, query in queries.items() if not prometheus.query(query)]

    missing = wait_until(empty, lambda left: not left, timeout=180, interval=5)
    assert not missing, f"no data for: {missing}"
    rare = [name for name, query in queries.items() if query.endswith(RARE_EVENT)]
    # Only these two may answer with the fallback; every other query answered with real series.
    assert len(rare) == 2 and len(queries) - len(rare) >= 10


def test_the_serving_benchmark_measures_every_row_against_a_running_deployment(served, tmp_path):
    """``specserve bench serve --server URL``: the served rows and the in-process row on the same
    prompts, in turn at concurrency 1 and together at 2, each row's figures and the served path's
    overhead against the in-process engine written as JSON and a plot."""
    import math

    from specserve.bench.serve import ServeBenchConfig, run_serve_bench

    config = ServeBenchConfig(json_path=tmp_path / "serve.json", plot_path=tmp_path / "serve.png",
                              server=served.http_url, drafts=("prompt-lookup",), num_prompts=2, max_tokens=6,
                              concurrency=(1, 2), rates=(math.inf,), repeats=1, no_prefix_reuse=True,
                              categories=("code", "chat"), dtype="float32")
    result = run_serve_bench(config)
    assert json.loads(config.json_path.read_text()) == result and config.plot_path.stat().st_size > 0
    rows = {(r["config"], r["concurrency"]) for r in result["runs"]}
    served_rows = {"serve-target-only", "serve-default", "serve-spec[prompt-lookup]"}
    assert rows == {(name, 1) for name in served_rows | {"in-process-spec[prompt-lookup]"}} | {(name, 2) for name in served_rows}
    assert all(r["completed"] == 2 and r["failed"] == 0 for r in result["runs"]), result["runs"]
    assert result["meta"]["prompt_categories"] == ["code", "chat"] and result["meta"]["no_prefix_reuse"]
    assert set(result["overhead"]) == {"serve-spec[prompt-lookup]"}
