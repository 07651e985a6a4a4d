"""The suffix benchmark's bookkeeping: the second round split by the replica that answered the
first, decode rates over the requests' own time, the local stack given a suffix draft."""

import json

from specserve.bench.serve import RequestRecord
from specserve.bench.suffix import by_replica, decode_rate, format_table, local_config, plot


def record(i, replica, tokens=33, latency=1.0, ttft=0.2, ok=True):
    return RequestRecord("r", 1, 0.0, i, ok=ok, latency_s=latency, ttft_s=ttft, output_tokens=tokens, steps=8,
                         replica=replica)


def test_the_second_round_is_split_by_the_replica_that_answered_first():
    first = [record(0, "a"), record(1, "b"), record(2, "a", ok=False)]
    again = [record(0, "a"), record(1, "a"), record(2, "a"), record(3, "b")]
    split = by_replica(first, again)
    assert [r.prompt_index for r in split["same_replica"]] == [0]
    assert [r.prompt_index for r in split["other_replica"]] == [1]   # prompt 2 failed first, 3 never asked


def test_decode_rate_counts_tokens_after_the_first_over_the_time_after_it():
    assert decode_rate([record(0, "a", tokens=33, latency=1.0, ttft=0.2)] * 2) == 40.0
    assert decode_rate([record(0, "a", ok=False)]) is None


def test_the_local_stack_serves_a_suffix_draft_seeded_with_the_shipped_answers():
    drafts = local_config("bfloat16")["applications"][0]["args"]["drafts"]
    suffix = [d for d in drafts if d.get("method") == "suffix"]
    assert len(suffix) == 1 and suffix[0]["seed_outputs"] == "answers"


def test_table_and_plot_are_written(tmp_path):
    part = {"decode_tokens_per_s": 50.0, "mean_accepted_len": 2.0, "requests": 1}
    result = {"meta": {"restate": "system", "concurrency": 1, "machine": {"cpu_model": "cpu"}, "dtype": "bfloat16",
                       "date": "2026-11-27"},
              "rows": [{"row": "suffix", "first": dict(part), "again": {**part, "same_replica": part, "other_replica": part}}]}
    assert "suffix" in format_table(result)
    plot(json.loads(json.dumps(result)), tmp_path / "p.png")
    assert (tmp_path / "p.png").stat().st_size > 0
