"""The command line: bad arguments fail fast with a clear message; a real run prints the JSON
object the issue specifies."""

import json
import subprocess
import sys

import pytest


def specserve(*args: str, timeout: float = 300) -> subprocess.CompletedProcess:
    return subprocess.run(
        [sys.executable, "-m", "specserve.cli.main", *args],
        capture_output=True, text=True, timeout=timeout,
    )


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
        (["bench", "serve", "--concurrency", "0"], "--concurrency needs integers >= 1"),
        (["bench", "serve", "--categories", "code,poetry"], "--categories: choose from"),
        (["bench", "serve", "--router-warmup", "-1"], "--router-warmup must be >= 0"),
        (["bench", "router", "--switches", "-1"], "--switches must be >= 0"),
    ],
)
def test_bad_arguments_exit_non_zero_with_a_clear_error(args, message):
    result = specserve(*args, timeout=60)
    assert result.returncode != 0
    assert message in result.stderr, result.stderr


def test_help_on_every_command():
    for args in (["--help"], ["generate", "--help"], ["models", "--help"], ["models", "fetch", "--help"],
                 ["models", "list", "--help"], ["bench", "--help"], ["bench", "engine", "--help"],
                 ["bench", "serve", "--help"], ["up", "--help"], ["status", "--help"], ["down", "--help"],
                 ["zoo", "--help"], ["zoo", "list", "--help"], ["zoo", "train", "--help"]):
        result = specserve(*args, timeout=60)
        assert result.returncode == 0 and "Usage" in result.stdout, (args, result.stderr)


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
