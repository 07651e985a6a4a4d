"""The policy benchmark: which rows a run has and what they are called, the per-request oracle,
the warm-start hook on literal snapshots, and one tiny real run on the reference target whose JSON
and plot are checked for their schema and invariants (not their timings)."""

import json
import re

import pytest

from specserve.bench.policies import (
    COLD, COLD_TREE, ORACLE, START_TREE, START_WINDOW, STATIC_TREE, TARGET_ONLY, TREE_POLICIES_EXPECTED, WARM,
    WARM_LENGTH, WARM_TREE, WARM_TREE_LENGTH, WINDOW_POLICIES_EXPECTED, PoliciesBenchConfig, Sample, oracle_samples, plan_rows, read_snapshot,
    registered_policies, run_policies_bench, start_window,
)

TARGET = "smollm2-135m-instruct"
# Every name a JSON row's policy may take (the expected policies, the static windows and extra static trees).
ROW_NAME = re.compile(r"^(static-[1-8]|oracle-static|online|fsm|cache-fsm|q-learning|q-learning-per-request|hf-heuristic"
                      r"|static-tree|static-tree-d\d+k\d+n\d+|sage|adt-tree|eagle2-depth|warm|cold|cold-tree|warm-tree|warm-by-length|warm-tree-by-length"
                      r"|load-aware|target-only)$")


def names(rows):
    return [r.name for r in rows]


# --- which rows -----------------------------------------------------------------------------


def test_a_full_plan_has_every_expected_name_in_its_section():
    rows, notes = plan_rows(None, ("online", "fsm"), ("sage",), trees_ok=True, snapshot_given=True,
                            start_policy="load-aware")
    assert all(ROW_NAME.match(n) for n in names(rows)), names(rows)
    by_section = {}
    for r in rows:
        by_section.setdefault(r.section, []).append(r.name)
    assert by_section["window"] == [f"static-{w}" for w in range(1, 9)] + ["online", "fsm"]
    assert by_section["tree"] == ["static-tree-d2k2n4", STATIC_TREE, "static-tree-d6k2n12", "sage"]
    assert by_section["start"] == [f"static-{w}" for w in range(1, 9)] + [COLD, WARM, WARM_LENGTH, COLD_TREE, WARM_TREE,
                                                                        WARM_TREE_LENGTH]
    assert next(r for r in rows if r.name == WARM_TREE).tree == START_TREE
    # The by-length rows differ from theirs only in looking the prior up without the topic.
    for topic, length in ((WARM, WARM_LENGTH), (WARM_TREE, WARM_TREE_LENGTH)):
        a, b = (next(r for r in rows if r.name == n) for n in (topic, length))
        assert a.by_topic and not b.by_topic and (a.policy, a.window, a.tree) == (b.policy, b.window, b.tree)
    assert by_section["load"] == ["load-aware", TARGET_ONLY]
    # Adaptive rows start where a request that names nothing starts, and are never pinned (the
    # engine's requests carry no pin), so the policies adapt them.
    online = next(r for r in rows if r.name == "online")
    assert online.window == START_WINDOW and online.policy == "online"
    assert next(r for r in rows if r.name == "sage").tree == START_TREE
    # What is not registered is said, not failed: fsm and sage are, the others are not.
    for missing in ("cache-fsm", "q-learning", "hf-heuristic", "adt-tree", "eagle2-depth"):
        assert any(repr(missing) in n for n in notes), notes
    assert not any("'sage'" in n or "'fsm'" in n for n in notes)


def test_selection_pulls_in_what_a_row_is_measured_against():
    rows, _ = plan_rows(["oracle-static"], (), (), True, False, "load-aware")
    # The oracle is the best of windows 1..8 per request, so all eight run.
    assert names(rows) == [f"static-{w}" for w in range(1, 9)]
    rows, notes = plan_rows(["cold", "warm", "load-aware"], (), (), True, False, "load-aware")
    assert [r.name for r in rows if r.section == "start"] == [f"static-{w}" for w in range(1, 9)] + [COLD]
    assert any("no --snapshot" in n for n in notes)          # warm needs a snapshot
    assert [r.name for r in rows if r.section == "load"] == ["load-aware", TARGET_ONLY]
    rows, _ = plan_rows(["sage"], (), ("sage",), True, False, "load-aware")
    assert names(rows) == [STATIC_TREE, "sage"]


def test_unknown_names_fail_and_unregistered_known_names_are_notes():
    with pytest.raises(ValueError, match="unknown policy row.*nope.*choose from"):
        plan_rows(["online", "nope"], ("online",), (), True, False, "load-aware")
    rows, notes = plan_rows(["eagle2-depth"], (), (), True, False, "load-aware")
    assert rows == [] and any("'eagle2-depth' is not registered" in n for n in notes)


def test_a_draft_without_trees_gets_no_tree_rows_and_a_note():
    rows, notes = plan_rows(None, (), ("sage",), trees_ok=False, snapshot_given=False, start_policy="load-aware")
    assert not any(r.section == "tree" for r in rows)
    assert any("no tree rows" in n for n in notes)


def test_the_registry_is_read_at_run_time():
    from specserve.policies import registry

    window, tree, known = registered_policies()
    assert set(window) <= known and set(tree) <= known
    # Whatever the registry holds of the expected window policies becomes a row.
    assert {n for n in WINDOW_POLICIES_EXPECTED if n in registry.POLICIES} <= set(window)
    assert "load-aware" not in window and "static" not in window


# --- the oracle ---------------------------------------------------------------------------


def sample(policy, request, tokens, seconds, section="window"):
    return Sample(policy, section, "code", request, 32, 1, tokens, seconds, steps=tokens // 2, emitted=tokens)


def test_the_oracle_takes_each_requests_fastest_static_window():
    samples = [sample(f"static-{w}", 0, 32, 1.0 + abs(w - 3) / 10) for w in range(1, 9)]    # request 0: γ=3 fastest
    samples += [sample(f"static-{w}", 1, 30, 1.0 + abs(w - 6) / 10) for w in range(1, 9)]   # request 1: γ=6
    samples += [sample(f"static-{w}", 2, 30, 1.0) for w in range(1, 8)]                     # request 2: no γ=8
    oracle = {s.request: s for s in oracle_samples(samples)}
    assert oracle[0].chosen == "static-3" and oracle[0].seconds == 1.0
    assert oracle[1].chosen == "static-6" and oracle[1].tokens == 30
    assert 2 not in oracle    # an oracle over part of the windows would be no oracle
    # Equal speed: the smaller window (cheaper to draft).
    ties = oracle_samples([sample(f"static-{w}", 0, 32, 1.0) for w in range(1, 9)])
    assert ties[0].chosen == "static-1"


# --- warm start: the hook -----------------------------------------------------------------


def snapshot(*priors):
    return {"format": 1, "version": 7, "priors": [dict(target=TARGET, draft="prompt-lookup", alpha=0.7, **p) for p in priors]}


def test_cold_starts_at_the_default_window_and_warm_at_the_priors_best():
    prompt = list(range(50))    # 50 tokens: bucket p64
    assert start_window(prompt, "prompt-lookup", TARGET) == (START_WINDOW, None)
    snap = snapshot({"bucket": "all", "best_window": 2}, {"bucket": "p64", "best_window": 6})
    window, prior = start_window(prompt, "prompt-lookup", TARGET, snap)
    assert window == 6 and prior["bucket"] == "p64"                       # the request's own bucket first
    assert start_window(list(range(100)), "prompt-lookup", TARGET, snap)[0] == 2   # p256: the pooled prior
    # A prior of γ = 0 starts at 1, as the target replica does: the policy must see the draft to learn.
    assert start_window(prompt, "prompt-lookup", TARGET, snapshot({"bucket": "all", "best_window": 0}))[0] == 1
    # Another target's or draft's prior is not this request's.
    assert start_window(prompt, "smollm2-hsr", TARGET, snap) == (START_WINDOW, None)
    assert start_window(prompt, "prompt-lookup", "other-model", snap) == (START_WINDOW, None)


def test_a_snapshot_is_read_from_the_policy_endpoints_body_or_as_itself():
    snap = snapshot({"bucket": "all", "best_window": 3})
    assert read_snapshot({"object": "policy_snapshot", "snapshot": snap, "service": {}}) is snap
    assert read_snapshot(snap) is snap
    with pytest.raises(ValueError, match="snapshot format 2"):
        read_snapshot({**snap, "format": 2})
    with pytest.raises(ValueError, match="'priors' list"):
        read_snapshot([snap])


# --- the command line ---------------------------------------------------------------------


@pytest.mark.parametrize("args, message", [
    (["--policies", "static-4,nope"], "unknown policy row(s) nope"),
    (["--prompts", "0"], "--prompts must be >= 1"),
    (["--categories", "poetry"], "--categories: choose from code"),
    (["--concurrency", "1,x"], "--concurrency takes comma-separated integers"),
    (["--draft", "none"], "--draft none cannot speculate"),
    (["--start-policy", "nope"], "start policy 'nope' is not registered"),
    (["--load-mode", "bursts"], "--load-mode: choose from steady, waves"),
    (["--load-rounds", "0"], "--load-rounds must be >= 1"),
])
def test_bad_arguments_fail_before_the_model_loads(args, message, tmp_path):
    # In this interpreter (typer's runner): the checks without an interpreter start per case.
    from typer.testing import CliRunner

    from specserve.cli.main import app

    result = CliRunner().invoke(app, ["bench", "policies", *args,
                                      "--json", str(tmp_path / "b.json"), "--plot", str(tmp_path / "b.png")])
    assert result.exit_code != 0
    assert message in result.stderr, result.stderr
    assert not (tmp_path / "b.json").exists()


# --- one tiny real run --------------------------------------------------------------------


@pytest.fixture(scope="module")
def engine():
    from specserve.replicas.engine import SpecEngine

    return SpecEngine.load(dtype="float32")


@pytest.mark.reference
@pytest.mark.slow
def test_a_tiny_run_writes_every_expected_row(engine, tmp_path):
    json_path, plot_path = tmp_path / "policies.json", tmp_path / "policies.png"
    window_policies, _, _ = registered_policies()
    chosen = ["oracle-static", *window_policies[:2], STATIC_TREE, *TREE_POLICIES_EXPECTED[1:2], COLD, WARM, "load-aware"]
    config = PoliciesBenchConfig(
        json_path=json_path, plot_path=plot_path, prompts_per_category=1, max_tokens=6, categories=("code",),
        policies=tuple(chosen), concurrency=(1, 2), load_requests=2,
        snapshot=snapshot({"bucket": "all", "best_window": 2}), dtype="float32",
    )
    report = run_policies_bench(config, engine=engine, progress=False)
    assert json.loads(json_path.read_text()) == report
    assert plot_path.stat().st_size > 10_000

    rows = report["rows"]
    for r in rows:
        assert {"policy", "category", "concurrency", "tokens_per_s", "mean_accepted_len"} <= set(r)
        assert ROW_NAME.match(r["policy"]), r["policy"]
        assert r["tokens_per_s"] > 0 and r["tokens"] > 0
        assert r["category"] in ("code", "all")
        assert r["mean_accepted_len"] >= 1.0     # every step emits at least the bonus token
    got = {(r["section"], r["policy"]) for r in rows}
    expected = {("window", f"static-{w}") for w in range(1, 9)} | {("window", ORACLE), ("tree", STATIC_TREE)}
    expected |= {("window", n) for n in window_policies[:2]} | {("start", COLD), ("start", WARM), ("start", ORACLE)}
    expected |= {("load", "load-aware"), ("load", TARGET_ONLY)}
    assert expected <= got, expected - got
    assert {(r["policy"], r["concurrency"]) for r in rows if r["section"] == "load"} == {
        (p, c) for p in ("load-aware", TARGET_ONLY) for c in (1, 2)}
    # Steady load (the default): a sample per row, concurrency and round, every request in each.
    steady = [s for s in report["requests"] if s["section"] == "load"]
    assert sorted((s["policy"], s["concurrency"], s["request"]) for s in steady) == sorted(
        (p, c, k) for p in ("load-aware", TARGET_ONLY) for c in (1, 2) for k in range(2))
    assert all(s["tokens"] == 2 * 6 for s in steady if s["policy"] == TARGET_ONLY)   # two requests of 6 tokens
    assert all(r["mean_accepted_len"] == 1.0 for r in rows if r["policy"] == TARGET_ONLY)
    # sage: a row when registered, else a note saying it is absent.
    assert ("tree", "sage") in got or any("'sage' is not registered" in n for n in report["notes"])
    assert any("1 of 1 requests found a prior" in n for n in report["notes"])

    # The oracle, per request and section, is at least as fast as every static window on it.
    requests = report["requests"]
    for oracle in (s for s in requests if s["policy"] == ORACLE):
        statics = [s for s in requests if s["section"] == oracle["section"] and s["request"] == oracle["request"]
                   and s["policy"].startswith("static-") and not s["policy"].startswith(STATIC_TREE)]
        assert len(statics) == 8
        assert all(oracle["tokens"] / oracle["seconds"] >= s["tokens"] / s["seconds"] for s in statics)
    assert {s["section"] for s in requests if s["policy"] == ORACLE} == {"window", "start"}
    # Cold starts at the default window, warm at the snapshot's best (2).
    assert {s["start_window"] for s in requests if s["policy"] == COLD} == {START_WINDOW}
    assert {(s["start_window"], s["prior"]) for s in requests if s["policy"] == WARM} == {(2, True)}
    assert set(report["aims"]) >= {"online_vs_oracle", "warm_share_of_cold_to_oracle_gap_closed",
                                   "load_aware_vs_target_only_lowest"}
    assert report["meta"]["machine"]["cpu_model"]


@pytest.mark.reference
def test_load_rows_in_waves(engine, tmp_path):
    config = PoliciesBenchConfig(
        json_path=tmp_path / "p.json", plot_path=tmp_path / "p.png", prompts_per_category=1, max_tokens=4,
        categories=("chat",), policies=("load-aware",), concurrency=(2,), load_requests=3, dtype="float32",
        load_mode="waves",
    )
    report = run_policies_bench(config, engine=engine, progress=False)
    waves = [s for s in report["requests"] if s["section"] == "load"]
    # Waves of two: requests 0-1, then 2, each wave once per row.
    assert sorted((s["policy"], s["request"], s["tokens"]) for s in waves) == sorted(
        (p, first, n) for p in ("load-aware", TARGET_ONLY) for first, n in ((0, 8), (2, 4)))
    assert report["meta"]["load_mode"] == "waves" and report["meta"]["load_rounds"] is None


@pytest.mark.reference
@pytest.mark.slow
def test_warm_rows_can_start_from_a_snapshot_learned_in_process(engine, tmp_path):
    config = PoliciesBenchConfig(
        json_path=tmp_path / "p.json", plot_path=tmp_path / "p.png", prompts_per_category=1, max_tokens=6,
        categories=("edit",), policies=("warm", "warm-tree"), concurrency=(1,), load_requests=1, dtype="float32",
        learn_snapshot_requests=2,
    )
    report = run_policies_bench(config, engine=engine, progress=False)
    learned = report["learned_snapshot"]
    assert learned["priors"] and {p["draft"] for p in learned["priors"]} == {"prompt-lookup"}
    assert any("learned in-process from 2 other prompts" in n for n in report["notes"])
    for row in (WARM, WARM_TREE):
        warm = [s for s in report["requests"] if s["policy"] == row]
        assert warm and all(s["prior"] for s in warm)
    # The tree learners' rule (adt-tree) left its carried state in the priors; cold-tree ran beside.
    pooled = next(p for p in learned["priors"] if p["bucket"] == "all")
    # 2 prompts, one at a time and then together (their counts decayed a little by age, as every prior's)
    assert pooled["learned"]["adt_requests"] == pytest.approx(4, rel=0.02)
    assert {s["policy"] for s in report["requests"]} >= {COLD_TREE, WARM_TREE}
    assert report["meta"]["tree_start_policy"] == "adt-tree"
    assert report["meta"]["snapshot_learned_from"] == 2
    # Learned with the online rule by default (it asks for windows 1-8, so each one gets priced).
    assert report["meta"]["snapshot_learned_with"] == "online"
    with pytest.raises(ValueError, match="--learn-policy 'bogus' is not registered"):
        run_policies_bench(PoliciesBenchConfig(json_path=tmp_path / "q.json", plot_path=tmp_path / "q.png",
                                               learn_snapshot_requests=2, learn_policy="bogus"),
                           engine=engine, progress=False)
    with pytest.raises(ValueError, match="replaces --snapshot"):   # refused when the options are made
        PoliciesBenchConfig(learn_snapshot_requests=2, snapshot=snapshot({"bucket": "all", "best_window": 2}))
