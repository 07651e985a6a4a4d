"""The serving benchmark's pure parts: which rows a run has and what they are called, what each
row sends (a peer gets plain OpenAI requests), and how request records become a row."""

import math

import pytest

from specserve.cluster.config import AppConfig
from specserve.data.prompts import load_prompts
from specserve.bench.serve import (
    STRUCTURED_SCHEMAS,
    RequestRecord,
    RowConfig,
    ServeBenchConfig,
    configs_for,
    format_table,
    local_stack_config,
    mixed_prompts,
    parse_drafts,
    parse_peers,
    parses,
    plot,
    request_body,
    resolve_drafts,
    response_format,
    row,
    summarise,
    salt_for,
)

URL = "http://127.0.0.1:8000"


def test_peers_parse_to_names_and_base_urls():
    # An OpenAI client's base_url ends in /v1; the benchmark adds /v1/... itself, so both spellings work.
    assert parse_peers(["vllm=http://127.0.0.1:8100/v1/", "sglang = https://h:30000"]) == [
        ("vllm", "http://127.0.0.1:8100"), ("sglang", "https://h:30000")]
    assert parse_peers([]) == []


@pytest.mark.parametrize("specs, message", [
    (["http://127.0.0.1:8100"], "NAME=URL"),            # no name
    (["=http://127.0.0.1:8100"], "NAME=URL"),
    (["v llm=http://x"], "NAME=URL"),                    # a space would break the table's columns
    (["vllm=127.0.0.1:8100"], "must start with http://"),
    (["a=http://x", "a=http://y"], "given twice"),
])
def test_bad_peers_say_what_to_write(specs, message):
    with pytest.raises(ValueError, match=message):
        parse_peers(specs)


def test_drafts_default_to_every_served_draft_and_unknown_ones_are_named():
    served = ["prompt-lookup", "smollm2-hsr", "smollm2-draft-2l"]
    assert parse_drafts(None) is None
    assert resolve_drafts(None, served) == served
    assert resolve_drafts(parse_drafts(" smollm2-hsr,prompt-lookup,smollm2-hsr "), served) == ["smollm2-hsr", "prompt-lookup"]
    with pytest.raises(ValueError, match="does not serve nope; it serves prompt-lookup, smollm2-hsr"):
        resolve_drafts(["nope"], served)
    for text in ("", "none", "prompt-lookup,none"):   # target-only is always a row of its own
        with pytest.raises(ValueError, match="--drafts takes draft names"):
            parse_drafts(text)


def test_rows_are_named_by_kind_and_draft_or_peer():
    configs = configs_for(URL, "smollm2", ["prompt-lookup", "smollm2-hsr"], 4, "prompt-lookup",
                          [("vllm", "http://127.0.0.1:8100", "served-smollm2")])
    assert [c.name for c in configs] == [
        "serve-target-only", "serve-default", "serve-spec[prompt-lookup]", "serve-spec[smollm2-hsr]",
        "in-process-spec[prompt-lookup]", "peer[vllm]"]
    by = {c.name: c for c in configs}
    assert by["peer[vllm]"].model == "served-smollm2" and by["peer[vllm]"].url == "http://127.0.0.1:8100"
    assert by["serve-spec[smollm2-hsr]"].window == 4 and by["serve-default"].window is None
    assert "in-process-spec" not in " ".join(c.name for c in configs_for(URL, "m", [], 4, None, []))


def test_adaptive_rows_name_their_draft_only():
    configs = configs_for(URL, "m", ["prompt-lookup"], 4, "prompt-lookup", [], adaptive=True)
    by = {c.name: c for c in configs}
    assert request_body(by["serve-spec[prompt-lookup]"], "hi", 8)["spec"] == {"draft": "prompt-lookup"}
    assert by["in-process-spec[prompt-lookup]"].window == 4   # the engine needs a window
    assert request_body(by["serve-target-only"], "hi", 8)["spec"] == {"draft": "none", "window": 0}


def test_a_structured_run_measures_the_grammar_draft_and_asks_every_row_for_the_same_json():
    import llguidance

    configs = configs_for(URL, "m", ["prompt-lookup"], 4, None, [("vllm", "http://127.0.0.1:8100", "v")], structured=True)
    by = {c.name: c for c in configs}
    assert list(by)[:4] == ["serve-target-only", "serve-grammar-draft", "serve-default", "serve-default[no-grammar-draft]"]
    fmt = response_format("code")
    bodies = {name: request_body(c, "hi", 8, response_format=fmt) for name, c in by.items()}
    assert bodies["serve-target-only"]["spec"] == {"draft": "none", "window": 0, "grammar_draft": False}
    assert bodies["serve-grammar-draft"]["spec"] == {"draft": "none", "window": 0, "grammar_draft": True}
    assert bodies["serve-default[no-grammar-draft]"]["spec"] == {"grammar_draft": False}
    assert "spec" not in bodies["peer[vllm]"] and all(b["response_format"] == fmt for b in bodies.values())
    for category in STRUCTURED_SCHEMAS:   # every schema compiles where the server compiles it
        assert llguidance.LLMatcher.grammar_from_json_schema(STRUCTURED_SCHEMAS[category])
    assert parses('{"a": 1}') and not parses('{"a": ') and not parses("[1]")
    with pytest.raises(ValueError, match="in-process"):
        ServeBenchConfig(structured=True)


def test_mixed_prompts_take_the_categories_in_turn_and_the_warmup_others():
    measured = mixed_prompts(["code", "edit"], 5)
    assert [c for c, _ in measured] == ["code", "edit", "code", "edit", "code"]
    warmup = mixed_prompts(["code", "edit"], 4, offset=3)
    assert [c for c, _ in warmup] == ["code", "edit", "code", "edit"]
    assert not {p for _, p in measured} & {p for _, p in warmup}
    assert [p for _, p in mixed_prompts(["chat"], 3)] == load_prompts("chat", 3)


def test_only_specserve_rows_send_spec_and_every_row_asks_the_same_otherwise():
    pinned = RowConfig("serve-spec[prompt-lookup]", "serve", URL, "smollm2", "prompt-lookup", 4)
    default = RowConfig("serve-default", "serve", URL, "smollm2")
    # Even a peer config that carries a draft (it never should) sends no spec: the backend decides.
    peer = RowConfig("peer[vllm]", "peer", "http://127.0.0.1:8100", "other-id", "prompt-lookup", 4)
    bodies = {c.name: request_body(c, "Name two planets.", 16) for c in (pinned, default, peer)}
    assert bodies["serve-spec[prompt-lookup]"]["spec"] == {"draft": "prompt-lookup", "window": 4}
    assert "spec" not in bodies["serve-default"] and "spec" not in bodies["peer[vllm]"]
    assert bodies["peer[vllm]"]["model"] == "other-id"
    for body in bodies.values():
        assert body["temperature"] == 0 and body["max_tokens"] == 16 and body["stream"] is True
        assert body["stream_options"] == {"include_usage": True}
        assert body["messages"] == [{"role": "user", "content": "Name two planets."}]


def test_summarise_literal_records():
    served = RequestRecord("serve-spec[prompt-lookup]", 1, math.inf, 0, ok=True, latency_s=2.0, ttft_s=0.5,
                           chunk_gaps_s=[0.25, 0.5, 0.75], output_tokens=7, steps=4, draft_s=0.2, verify_s=1.2)
    failed = RequestRecord("serve-spec[prompt-lookup]", 1, math.inf, 1, error="HTTP 500: b'boom'")
    out = summarise([served, failed], duration_s=3.5)
    assert (out["completed"], out["failed"], out["errors"]) == (1, 1, ["HTTP 500: b'boom'"])
    # 7 tokens over the run's 3.5 s; 1 completed request over 3.5 s.
    assert out["output_tokens_per_s"] == 2.0 and out["request_throughput"] == round(1 / 3.5, 3)
    # TPOT: the 6 tokens after the first took 2.0 - 0.5 s -> 250 ms each.
    assert out["tpot_ms"] == {"mean": 250.0, "median": 250.0, "p99": 250.0}
    # ITL: the three gaps; p99 of three values is the largest (rank ceil(0.99 * 3) = 3).
    assert out["itl_ms"] == {"mean": 500.0, "median": 500.0, "p99": 750.0}
    # Per step: 2000 ms / 4 steps; draft 200 ms / 4; verify 1200 ms / 4; τ = 7 tokens / 4 steps.
    assert (out["ms_per_step"], out["draft_ms_per_step"], out["verify_ms_per_step"]) == (500.0, 50.0, 300.0)
    assert out["mean_accepted_len"] == 1.75
    assert out["drafts"] == {}   # no spec read: no draft known


def test_a_row_counts_the_drafts_its_requests_ended_on():
    records = [RequestRecord("serve-default", 4, math.inf, i, ok=True, latency_s=1.0, output_tokens=4, steps=2, draft=d)
               for i, d in enumerate(["prompt-lookup", "smollm2-hsr", "prompt-lookup"])]
    records.append(RequestRecord("serve-default", 4, math.inf, 3, error="HTTP 500"))   # failed: not counted
    assert summarise(records, 1.0)["drafts"] == {"prompt-lookup": 2, "smollm2-hsr": 1}


def test_summarise_a_peer_leaves_what_it_cannot_know_null():
    # A peer reports no steps: per-step figures and τ are unknown, not zero (which would read as free).
    peer = RequestRecord("peer[vllm]", 4, 2.0, 0, ok=True, latency_s=1.0, ttft_s=0.1, output_tokens=10)
    out = summarise([peer], duration_s=1.0)
    assert out["output_tokens_per_s"] == 10.0 and out["tpot_ms"]["median"] == 100.0
    assert out["ms_per_step"] is out["mean_accepted_len"] is out["draft_ms_per_step"] is None
    assert out["ttft_ms"]["median"] == 100.0 and out["itl_ms"]["median"] is None   # one chunk: no gap


def test_nothing_completed_is_a_row_of_failures_not_an_exception():
    out = summarise([RequestRecord("peer[vllm]", 1, math.inf, 0, error="ConnectError: refused")], duration_s=0.0)
    assert (out["completed"], out["failed"], out["output_tokens_per_s"], out["ttft_ms"]["median"]) == (0, 1, 0.0, None)


def _rows() -> list[dict]:
    peer = RowConfig("peer[vllm]", "peer", "http://127.0.0.1:8100", "smollm2")
    spec = RowConfig("serve-spec[prompt-lookup]", "serve", URL, "smollm2", "prompt-lookup", 4)
    rows = []
    for config, steps in ((peer, 0), (spec, 5)):
        for concurrency, rate in ((1, math.inf), (4, 2.0), (4, math.inf)):
            record = RequestRecord(config.name, concurrency, rate, 0, ok=True, latency_s=1.0, ttft_s=0.2,
                                   output_tokens=9, steps=steps)
            rows.append(row(config, concurrency, rate, summarise([record], 1.0)))
    return rows


def test_rows_carry_their_whole_config_and_the_table_shows_unknowns_as_dashes():
    rows = _rows()
    assert rows[0]["setup"] == {"backend": "peer", "url": "http://127.0.0.1:8100", "model": "smollm2",
                                "draft": None, "window": None, "grammar_draft": None}
    assert rows[1]["rate"] == 2.0 and rows[0]["rate"] == "inf"   # JSON has no infinity
    table = format_table(rows).splitlines()
    assert table[2].startswith("peer[vllm] ") and table[2].split()[-4:] == ["-", "-", "-", "-"]
    assert table[5].startswith("serve-spec[prompt-lookup]") and table[5].split()[-1] == "1.80"


def test_the_plot_has_a_legend_entry_for_every_row_and_rate(tmp_path):
    meta = {"model": "smollm2", "dtype": "bfloat16", "prompts": 1, "max_tokens": 9, "window": 4,
            "machine": {"cpu_count": 2, "load_avg_1m": 0.5}, "placement": {"prompt-lookup": {"where": "inside"}}}
    labels = plot(_rows(), meta, tmp_path / "bench.png")
    assert labels == ["peer[vllm]", "serve-spec[prompt-lookup]", "rate 2.0 req/s", "rate inf req/s"]
    assert (tmp_path / "bench.png").stat().st_size > 0


def test_the_local_stack_is_the_shipped_default_unless_told_to_serve_only_some_drafts():
    from specserve.cluster.serve_config import local_serve_config

    shipped = local_serve_config()["applications"][0]
    everything = local_stack_config("bfloat16", None)["applications"][0]
    assert everything["args"] == {**shipped["args"], "dtype": "bfloat16", "stream_interval": 1}
    assert everything["deployments"] == shipped["deployments"]
    # Naming drafts picks rows, not the app: serve-default still measures the shipped default.
    assert local_stack_config("bfloat16", ["prompt-lookup"])["applications"][0]["args"]["drafts"] == shipped["args"]["drafts"]

    only = local_stack_config("auto", ["smollm2-eagle3"], only_drafts=True)["applications"][0]
    assert only["args"]["drafts"] == [{"name": "smollm2-eagle3", "model": "smollm2-eagle3"}]
    assert only["args"]["default_draft"] == "smollm2-eagle3"   # the default must be a served draft
    # Placed by measurement (inside, on one kind of hardware): no deployment of its own to configure.
    assert sorted(d["name"] for d in only["deployments"]) == ["ingress", "target"]
    for app in (everything, only):   # what the application builder will be given must be valid
        AppConfig(**app["args"])
    with pytest.raises(ValueError, match="not nope"):
        local_stack_config("auto", ["nope"])


def test_the_local_stacks_stream_interval_reaches_the_application_and_bad_counts_are_refused():
    args = local_stack_config("auto", ["prompt-lookup"], stream_interval=8)["applications"][0]["args"]
    assert AppConfig(**args).ingress_config().stream_interval == 8
    for repeats, interval in ((0, 1), (1, 0)):   # refused when the options are made, before anything starts
        with pytest.raises(ValueError, match="--repeats and --stream-interval must be >= 1"):
            ServeBenchConfig(repeats=repeats, stream_interval=interval)


def test_the_options_check_the_categories_and_the_window_when_made():
    assert ServeBenchConfig().categories == ("code", "chat", "summarise", "edit")   # the mixed set
    # Blanks and repeats dropped, as --categories "code, ,code,edit" gives them.
    assert ServeBenchConfig(categories=("code", " ", "code", "edit")).categories == ("code", "edit")
    with pytest.raises(ValueError, match="--window must be >= 1"):
        ServeBenchConfig(window=0)


def test_no_prefix_reuse_salts_each_row_and_round_and_sends_the_same_prompt():
    salts = {salt_for("serve-target-only", 16, math.inf, 0), salt_for("serve-target-only", 16, math.inf, 1),
             salt_for("peer[vllm]", 16, math.inf, 0)}
    assert len(salts) == 3 and salt_for("peer[vllm]", 16, math.inf, 0) in salts   # deterministic
    peer = RowConfig("peer[vllm]", "peer", URL, "m")
    salted = request_body(peer, "Name two planets.", 16, cache_salt="abc")
    assert salted["cache_salt"] == "abc" and salted["messages"] == request_body(peer, "Name two planets.", 16)["messages"]
    assert "cache_salt" not in request_body(peer, "Name two planets.", 16)
