"""``bench decode``: bad settings fail before a model loads, and a small CPU run on the tiny shape
writes every row: the measured ones with positive tokens/s, the CUDA-only ones skipped with a
reason, the replay marked as one."""

import json

import pytest

from specserve.bench.decode import GAMMA, ROWS, DecodeBenchConfig, run_decode_bench


@pytest.mark.parametrize("settings", [{"shapes": ("70b",)}, {"shapes": ()}, {"batches": (0,)}, {"tokens": 0},
                                      {"replay_tau": GAMMA + 2}, {"budget_s": 0}, {"rows": ("warp",)}, {"rows": ()}])
def test_bad_settings_fail_when_made(settings):
    with pytest.raises(ValueError):
        DecodeBenchConfig(**settings)


def test_a_tiny_cpu_run_writes_every_row(tmp_path):
    config = DecodeBenchConfig(json_path=tmp_path / "decode.json", plot_path=tmp_path / "decode.png",
                               shapes=("tiny",), batches=(1, 2), tokens=4, prompt_len=8, device="cpu")
    report = run_decode_bench(config)
    rows = {(r["batch"], r["row"]): r for r in report["rows"]}
    assert set(rows) == {(batch, row) for batch in (1, 2) for row in ROWS}
    for batch in (1, 2):
        for name in ("specserve-eager", "hf-eager", "replay"):
            row = rows[(batch, name)]
            assert row["status"] == "ok", row
            assert row["tokens_per_s"] > 0 and row["ms_per_step"] > 0
        # Exactly batch x tokens: no EOS ends a row early.
        assert rows[(batch, "hf-eager")]["tokens"] == rows[(batch, "specserve-eager")]["tokens"] == batch * 4
        # Fused elementwise kernels are CUDA's: the CPU keeps its C kernels.
        assert rows[(batch, "specserve-eager")]["fused_elementwise"] is False
        for name in ("specserve-graphs", "specserve-graphs-unfused", "specserve-compiled",
                     "hf-static-compiled"):   # CUDA only, unless forced
            assert rows[(batch, name)]["status"] == "skipped" and rows[(batch, name)]["reason"]
        replay = rows[(batch, "replay")]
        assert replay["replay"] is True and "not a measurement" in replay["note"]
        assert replay["draft_cost"] == "not included" and replay["tau_assumed"] == config.replay_tau
        assert replay["target_only_row"] == "specserve-eager" and replay["speedup_vs_target_only"] > 0
    # A decode step at batch 1 reads every weight once: the limit is a real fraction.
    assert 0 < rows[(1, "specserve-eager")]["fraction_of_bandwidth_limit"]
    assert "bandwidth_limit_ms" not in rows[(2, "specserve-eager")]
    saved = json.loads(config.json_path.read_text())
    assert saved["meta"]["device"] == "cpu" and saved["meta"]["copy_bandwidth_bytes_per_s"] > 0
    assert saved["shapes"]["tiny"]["weights_bytes"] > 0 and config.plot_path.stat().st_size > 0


def test_rows_not_started_within_the_budget_are_skipped_and_say_so(tmp_path):
    # A budget already spent when the first row would start: every row is recorded, none runs.
    config = DecodeBenchConfig(json_path=tmp_path / "decode.json", plot_path=tmp_path / "decode.png",
                               shapes=("tiny",), batches=(1,), tokens=2, prompt_len=4, device="cpu", budget_s=1e-9)
    rows = run_decode_bench(config)["rows"]
    assert [r["row"] for r in rows] == list(ROWS)
    assert all(r["status"] == "skipped" and "--budget-s" in r["reason"] for r in rows)


def test_a_profile_says_where_a_one_token_forwards_time_goes(tmp_path):
    config = DecodeBenchConfig(json_path=tmp_path / "decode.json", plot_path=tmp_path / "decode.png",
                               shapes=("tiny",), batches=(1,), tokens=2, prompt_len=8, device="cpu", budget_s=1e-9,
                               profile=True)
    profile = run_decode_bench(config)["shapes"]["tiny"]["profile"]
    assert profile["forwards"] == 5 and profile["busy_ms_per_forward"] > 0 and profile["calls_per_forward"] > 0
    assert 0 < profile["products_ms_per_forward"] <= profile["busy_ms_per_forward"]
    shares = [k["ms_per_forward"] for k in profile["top"]]
    assert shares == sorted(shares, reverse=True) and any(k["name"] == "aten::mm" for k in profile["top"])


def test_chosen_rows_run_in_the_benchs_order(tmp_path):
    config = DecodeBenchConfig(json_path=tmp_path / "decode.json", plot_path=tmp_path / "decode.png",
                               shapes=("tiny",), batches=(1,), tokens=2, prompt_len=4, device="cpu",
                               rows=("hf-eager", "specserve-eager"))
    rows = run_decode_bench(config)["rows"]
    assert [r["row"] for r in rows] == ["specserve-eager", "hf-eager"]
    assert all(r["status"] == "ok" for r in rows)


def test_the_host_grown_chat_row_grows_eagles_default_tree_on_the_host():
    """Its threshold prunes nothing, even of candidates the size of float32's smallest
    log-probabilities, yet keeps the tree off the device: the row differs from the default
    tree's in where its levels are chosen only."""
    import torch

    from specserve.bench.decode import HEAD_TREES, HOST_GROWN
    from specserve.replicas.drafts.device_growth import DeviceGrowth
    from specserve.replicas.drafts.tree_growth import TreeGrowth

    assert not DeviceGrowth.grows(HOST_GROWN) and DeviceGrowth.grows(HEAD_TREES[0])
    generator = torch.Generator().manual_seed(0)
    host, default = TreeGrowth(HOST_GROWN), TreeGrowth(HEAD_TREES[0])
    logits = torch.randn(1, 500, generator=generator) * 40   # peaked rows: log-probabilities far below -100
    for level in range(HOST_GROWN.depth):
        assert host.grow(logits) == default.grow(logits)
        if not default.more_levels(level):
            break
        logits = torch.randn(len(default.frontier), 500, generator=generator) * 40
    assert (host.tokens, host.parents) == (default.tokens, default.parents) and len(host.tokens) == 60


@pytest.mark.reference
@pytest.mark.slow
def test_chat_rows_run_at_every_batch_and_count_outputs_equal_to_target_onlys(tmp_path, monkeypatch):
    """At batch 2 two chat prompts decode at once in one batch; each speculation row's greedy
    outputs equal target-only's at the same batch (float32 on the CPU), and its speedup is over
    target-only at that batch. Fewer rows than the bench's, for time: a chain, a tree and a
    model-free draft."""
    from specserve.bench import decode

    rows = (decode.CHAT_ROWS[0], *(r for r in decode.CHAT_ROWS if r.name in
                                   (f"{decode.EAGLE3}-tree-d6k4n24", f"{decode.EAGLE3}-4", "prompt-lookup-4")))
    assert len(rows) == 4
    monkeypatch.setattr(decode, "CHAT_ROWS", rows)
    monkeypatch.setattr(decode, "CHAT_PROMPTS", 2)
    config = DecodeBenchConfig(json_path=tmp_path / "decode.json", plot_path=tmp_path / "decode.png",
                               shapes=("reference",), batches=(1, 2), tokens=3, prompt_len=4, device="cpu",
                               rows=("specserve-eager",))
    measured = {(r["batch"], r["row"]): r for r in run_decode_bench(config)["rows"]}
    for batch in (1, 2):
        base = measured[(batch, "chat-target-only")]
        assert base["status"] == "ok", base
        assert base["prompts"] == 2 and 0 < base["tokens"] <= 2 * 3
        assert "outputs_equal_to_target_only" not in base and "outputs" not in base
        for row in rows[1:]:
            r = measured[(batch, f"chat-{row.name}")]
            assert r["status"] == "ok", r
            assert r["outputs_equal_to_target_only"] == 2, r
            assert r["tokens"] == base["tokens"] and r["mean_accepted_len"] >= 1
            assert r["target_only_row"] == "chat-target-only" and r["speedup_vs_target_only"] > 0

    def steps(row: dict) -> float:
        return row["seconds"] / row["ms_per_step"] * 1e3

    # A batch's steps are its longest request's: two prompts at once take about half the steps.
    assert steps(measured[(2, "chat-target-only")]) == pytest.approx(steps(measured[(1, "chat-target-only")]) / 2, rel=0.1)
