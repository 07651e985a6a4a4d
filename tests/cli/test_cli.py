"""The command line: bad arguments fail fast with a clear message; each benchmark's flags are its
options object's fields, with the same defaults; a real run prints one JSON object per prompt."""

import json
import subprocess
import sys

import pytest


def specserve(*args: str, timeout: float = 300) -> subprocess.CompletedProcess:
    """The installed command line, in an interpreter of its own (what a user runs)."""
    return subprocess.run(
        [sys.executable, "-m", "specserve.cli.main", *args],
        capture_output=True, text=True, timeout=timeout,
    )


def in_process(*args: str):
    """The same command line run in this interpreter (typer's runner): the argument checks without
    an interpreter start (~5 s each on 2 cores) per case. Exit code, stdout and stderr as above."""
    from typer.testing import CliRunner

    from specserve.cli.main import app

    return CliRunner().invoke(app, list(args))


@pytest.mark.parametrize(
    "args, message",
    [
        (["generate", "hello", "--window", "-1"], "--window must be >= 0"),
        (["generate", "hello", "--draft", "no-such-draft"], "unknown draft 'no-such-draft'"),
        (["generate", ""], "prompt is empty"),
        (["generate", "   "], "prompt is empty"),
        (["generate"], "give either a PROMPT or --prompts-file"),
        (["generate", "hello", "--tree", "3,2"], "DEPTH,TOPK,BUDGET"),
        (["generate", "hello", "--tree", "0,2,4"], "depth, top_k and budget >= 1"),
        (["generate", "hello", "--max-tokens", "0"], "--max-tokens must be >= 1"),
        (["generate", "hello", "--temperature", "-0.5"], "temperature must be >= 0"),
        (["generate", "hello", "--top-p", "0"], "top_p must be in (0, 1]"),
        (["generate", "hello", "--server", "ftp://x"], "--server must start with http://, https:// or grpc://"),
        (["zoo", "train", "nope"], "unknown draft recipe 'nope'"),
        (["zoo", "probe", "smollm2-eagle3", "--categories", "poetry"], "--categories must name some of"),
        (["zoo", "train", "smollm2-eagle3", "--batch", "0"], "--batch must be >= 1"),
        (["zoo", "imagegen-vq", "--steps", "0"], "--steps and --batch must be >= 1"),
        (["zoo", "imagegen", "--batch", "0"], "--steps and --batch must be >= 1"),
        (["bench", "serve", "--concurrency", "0"], "--concurrency needs integers >= 1"),
        (["bench", "serve", "--categories", "code,poetry"], "--categories: choose from"),
        (["bench", "serve", "--router-warmup", "-1"], "--router-warmup must be >= 0"),
        (["bench", "router", "--switches", "-1"], "--switches must be >= 0"),
    ],
)
def test_bad_arguments_exit_non_zero_with_a_clear_error(args, message):
    result = in_process(*args)
    assert result.exit_code != 0
    assert message in result.stderr, result.stderr


def test_help_on_every_command():
    for args in (["--help"], ["generate", "--help"], ["models", "--help"], ["models", "fetch", "--help"],
                 ["models", "list", "--help"], ["bench", "--help"], ["bench", "engine", "--help"],
                 ["bench", "serve", "--help"], ["up", "--help"], ["status", "--help"], ["down", "--help"],
                 ["zoo", "--help"], ["zoo", "list", "--help"], ["zoo", "train", "--help"]):
        result = in_process(*args)
        assert result.exit_code == 0 and "Usage" in result.stdout, (args, result.stderr)
    # ... and once as the installed command, in an interpreter of its own.
    result = specserve("--help", timeout=60)
    assert result.returncode == 0 and "Usage" in result.stdout, result.stderr


def policy_answer(status: int, body: dict | None):
    """What ``GET /v1/policy`` answers (``body`` None: nothing listens)."""
    import httpx

    def get(url, **_):
        if body is None:
            raise httpx.ConnectError("connection refused")
        return httpx.Response(status, json=body, request=httpx.Request("GET", url))

    return get


@pytest.mark.parametrize("status, body, line", [
    (200, "off", "cluster learning: off: no redis_url configured; each replica learns alone"),
    (200, {"cluster_learning": "on", "snapshot": {"version": 1}}, "cluster learning: on"),
    (503, {"error": {"code": "policy_service_unavailable", "message": "retry shortly"}},
     "cluster learning: on, but the policy service is not answering"),
    (0, None, "cluster learning: unknown (the ingress did not answer GET /v1/policy)"),
], ids=["off", "on", "service-down", "no-ingress"])
def test_status_says_whether_the_replicas_learn_together(monkeypatch, status, body, line):
    import httpx

    from specserve.cluster import local
    from specserve.ingress.http_api import CLUSTER_LEARNING_OFF

    if body == "off":   # the ingress's own words, from its module (imported here: it is slow to import)
        body = {"object": "policy_snapshot", "cluster_learning": CLUSTER_LEARNING_OFF, "snapshot": None, "service": None}
    monkeypatch.setattr(local.LocalState, "load", staticmethod(lambda: local.LocalState(http_url="http://ingress")))
    monkeypatch.setattr(local, "connect", lambda: None)
    monkeypatch.setattr(local, "app_status", lambda _: {"status": "RUNNING", "message": "", "deployments": {}})
    monkeypatch.setattr(local, "ping", lambda _: False)
    monkeypatch.setattr(local, "draft_placement", lambda _: None)
    monkeypatch.setattr(httpx, "get", policy_answer(status, body))
    result = in_process("status")
    assert result.exit_code == 0, result.stderr
    assert line in result.stdout.splitlines()[-1], result.stdout


@pytest.mark.parametrize("kv, line", [
    ({"kv_slots": 12, "kv_max_len": 2048, "kv_capacity_tokens": 24576, "kv_sized_by": "device memory"},
     "  kv  target: 12 slots x 2048 positions = 24576 tokens (device memory)"),
    (None, "  kv  target: unknown (no replica answered)"),
    ({"kv_slots": 12, "kv_max_len": 2048, "kv_capacity_tokens": 24576, "kv_sized_by": "device memory",
      "cuda_graphs": {"held": 40, "replays": 7, "eager": 0}, "fused_elementwise": True},
     "  step target: CUDA graphs (40 held, 7 steps replayed), elementwise kernels fused"),
], ids=["answered", "no-answer", "cuda"])
def test_status_prints_the_targets_kv_capacity(monkeypatch, kv, line):
    from specserve.cluster import local

    running = {"target": {"status": "HEALTHY", "replicas": 1}, "ingress": {"status": "HEALTHY", "replicas": 1}}
    monkeypatch.setattr(local.LocalState, "load", staticmethod(lambda: local.LocalState(http_url="http://ingress")))
    monkeypatch.setattr(local, "connect", lambda: None)
    monkeypatch.setattr(local, "app_status", lambda _: {"status": "RUNNING", "message": "", "deployments": running})
    monkeypatch.setattr(local, "ping", lambda _: False)
    monkeypatch.setattr(local, "draft_placement", lambda _: None)
    monkeypatch.setattr(local, "cluster_learning", lambda _: None)
    asked = []
    monkeypatch.setattr(local, "target_kv", lambda app, name: asked.append(name) or kv)
    result = in_process("status")
    assert result.exit_code == 0, result.stderr
    assert asked == ["target"]   # the target deployment only, once
    assert line in result.stdout.splitlines(), result.stdout


# A flag whose name is not its field's.
FIELD_OF_FLAG = {"prompts": "num_prompts", "peer": "peers", "learn_snapshot": "learn_snapshot_requests"}
# Flags that set the process, not the benchmark (torch threads, before the run).
NOT_OPTIONS = {"threads"}


def as_held(flag_default, field_default):
    """A flag's default as the options object holds it: "1,4,16" -> (1, 4, 16), [] -> ()."""
    if isinstance(field_default, tuple) and isinstance(flag_default, str):
        return tuple(type(field_default[0])(x) for x in flag_default.split(","))
    if isinstance(field_default, tuple) and isinstance(flag_default, list):
        return tuple(flag_default)
    return flag_default


@pytest.mark.parametrize("command, config_class", [
    ("engine", "specserve.bench.engine.EngineBenchConfig"),
    ("policies", "specserve.bench.policies.PoliciesBenchConfig"),
    ("router", "specserve.bench.router.RouterBenchConfig"),
    ("serve", "specserve.bench.serve.ServeBenchConfig"),
    ("soak", "specserve.bench.soak.SoakBenchConfig"),
])
def test_a_bench_commands_flags_are_its_options_with_the_same_defaults(command, config_class):
    """The command builds the options object from its flags, and both write the defaults down (the
    command line must not import torch to show its help): every field has a flag, and a default
    written twice is the same twice."""
    import dataclasses
    import importlib

    import typer.main

    from specserve.cli.main import app

    module, _, name = config_class.rpartition(".")
    defaults = {f.name: f.default for f in dataclasses.fields(getattr(importlib.import_module(module), name))}
    flags = typer.main.get_command(app).commands["bench"].commands[command].params
    by_field = {FIELD_OF_FLAG.get(p.name, p.name): p.default for p in flags if p.name not in NOT_OPTIONS}
    assert set(by_field) == set(defaults)
    for field, flag_default in by_field.items():
        if field == "categories" and flag_default is None:
            continue   # not given: the command passes the options' own default
        assert as_held(flag_default, defaults[field]) == defaults[field], (command, field)


@pytest.mark.reference
@pytest.mark.slow
def test_prompts_file_json_lines(tmp_path):
    prompts = tmp_path / "prompts.jsonl"
    prompts.write_text('{"prompt": "Say hello."}\n{"prompt": "Count to three."}\n')
    result = specserve("generate", "--prompts-file", str(prompts), "--json", "--max-tokens", "12",
                       "--dtype", "float32", "--window", "3")
    assert result.returncode == 0, result.stderr
    rows = [json.loads(line) for line in result.stdout.splitlines()]
    assert len(rows) == 2
    for row in rows:
        assert isinstance(row["text"], str) and row["text"]
        assert 1 <= len(row["token_ids"]) <= 12
        assert set(row["spec"]) >= {"draft", "steps", "mean_accepted_len", "acceptance_rate"}
        assert row["spec"]["draft"] == "prompt-lookup"
        assert row["spec"]["mean_accepted_len"] >= 1.0


@pytest.mark.reference
def test_models_list_shows_the_reference_target():
    result = specserve("models", "list", "--json", timeout=60)
    assert result.returncode == 0
    assert "smollm2-135m-instruct" in [row["name"] for row in json.loads(result.stdout)]


def test_generate_writes_a_picture_of_the_prompts_scene(tmp_path):
    from PIL import Image

    from tiny_models import tiny_generator_folder

    generator = tiny_generator_folder(tmp_path / "models")
    out = tmp_path / "picture.png"
    # The tiny generator knows 6 classes: a red square on a plain background is class 6 * 5 > 5.
    bad = in_process("generate", "a red square on a plain background", "--image-out", str(out), "--target", str(generator))
    assert bad.exit_code != 0 and "class label" in bad.output
    result = in_process("generate", "a red circle on a striped background", "--image-out", str(out),
                        "--target", str(generator), "--temperature", "0", "--window", "0")
    assert result.exit_code == 0, result.output
    with Image.open(out) as picture:
        assert picture.format == "PNG" and picture.size == (64, 64)
    missing = in_process("generate", "a red circle", "--image-out", str(out), "--target", str(generator))
    assert missing.exit_code != 0 and "must name one background" in missing.output
