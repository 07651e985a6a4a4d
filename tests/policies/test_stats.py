"""The replica-local statistics collector: integer counts per (target, draft, bucket, window)."""

import pytest

from collections import Counter
from dataclasses import replace

from specserve.policies.stats import (StatsCollector, StatsKey, counts_from_record, load_bucket, request_bucket, without_topic,
                                      task_bucket)
from specserve.replicas.request import SpecRequest
from specserve.replicas.sampling import SamplingParams
from specserve.replicas.step import PLAIN, RequestStep, Speculation, StepRecord


def step(request_id, draft="pl", proposed=4, accepted=2, max_depth=4):
    return RequestStep(request_id, draft, Speculation(max_depth) if max_depth else PLAIN, proposed, accepted,
                       max_depth, None)


def record(*steps, draft_ms=2.0, verify_ms=10.0):
    return StepRecord(len(steps), sum(1 + s.proposed for s in steps), 0, draft_ms, verify_ms, 0.0, tuple(steps))


class Clock:
    def __init__(self, t=1000.0):
        self.t = t

    def __call__(self):
        return self.t


def test_counts_of_one_step_follow_eq2_and_vllm_names():
    counts = counts_from_record(record(step("a", accepted=2), step("b", accepted=4), step("c", proposed=0, accepted=0, max_depth=0)))
    assert counts["a"] == Counter(drafts=1, draft_tokens=4, accepted_tokens=2, accepted_pos_0=1, accepted_pos_1=1,
                                  rejections=1, emitted=3, window_4=1, verify_us_w4=10000, draft_us=2000, verify_us=10000,
                                  # the cost side again under this step's load (3 requests: bucket b4)
                                  load_b4_steps_w4=1, load_b4_verify_us_w4=10000, load_b4_draft_us=2000,
                                  load_b4_draft_tokens=4)
    assert counts["b"]["rejections"] == 0 and counts["b"]["accepted_pos_3"] == 1 and counts["b"]["emitted"] == 5
    # A request with a draft whose step went plain: speculation switched off, nothing drafted.
    assert counts["c"] == Counter(plain_steps=1)


def test_collector_sums_per_key_and_drain_empties_it():
    clock = Clock(1000.0)
    c = StatsCollector("t", window_s=60, clock=clock)
    c.start("a", "pl", task_bucket(10))
    c.start("b", "pl", task_bucket(300))
    c.observe(record(step("a", accepted=1), step("b", accepted=3)))
    c.observe(record(step("a", accepted=4)))
    c.observe(record(step("ghost", accepted=4)))   # unknown request: not counted
    drained = c.drain()
    short, long = StatsKey("t", "pl", "p64", 960), StatsKey("t", "pl", "p1024", 960)
    assert set(drained) == {short, long}
    assert drained[short]["requests"] == 1 and drained[short]["drafts"] == 2 and drained[short]["accepted_tokens"] == 5
    assert drained[long]["accepted_tokens"] == 3
    assert c.drain() == {} and c.pending == 0


def test_buffer_is_bounded_in_windows_and_keeps_every_count():
    clock = Clock(0.0)
    c = StatsCollector("t", window_s=10, max_windows=3, clock=clock)
    c.start("a", "pl", task_bucket(10))
    for i in range(10):              # ten windows of one step each
        clock.t = 10.0 * i
        c.observe(record(step("a", accepted=1)))
    drained = c.drain()
    assert len({k.window_start for k in drained}) == 3
    assert sum(v["drafts"] for v in drained.values()) == 10 and sum(v["requests"] for v in drained.values()) == 1


def test_task_buckets():
    assert [task_bucket(n) for n in (1, 64, 65, 256, 1024, 5000)] == ["p64", "p64", "p256", "p256", "p1024", "p1024+"]
    # A grammar-constrained request's acceptance is its own: so are its priors.
    assert task_bucket(100, constrained=True) == "p256-grammar"
    constrained = SpecRequest([1] * 100, 8, SamplingParams(), "pl", 4, grammar='start: "a"')
    assert request_bucket(constrained) == "p256-grammar" and request_bucket(replace(constrained, grammar=None)) == "p256"
    # With the router's topics, a bucket is a task's: length, topic, grammar.
    assert task_bucket(100, topic=2) == "p256-t2" and task_bucket(2000, True, 0) == "p1024+-t0-grammar"
    assert request_bucket(replace(constrained, topic=3)) == "p256-t3-grammar"
    assert [without_topic(b) for b in ("p256-t2", "p1024+-t0-grammar", "p64", "all")] == ["p256", "p1024+-grammar",
                                                                                         "p64", "all"]
    with pytest.raises(ValueError, match="topic"):
        replace(constrained, topic=-1)


def test_a_tree_step_counts_its_shape():
    from specserve.replicas.step import TreeShape

    tree_step = RequestStep("a", "pl", Speculation(0, TreeShape(3, 2, 6)), 6, 2, 3, None)
    counts = counts_from_record(record(tree_step, draft_ms=1.0, verify_ms=9.0))["a"]
    assert counts["tree_3x2_steps"] == 1 and counts["tree_3x2_emitted"] == 3 and counts["tree_3x2_us"] == 10_000
    assert counts["window_3"] == 1   # the longest path offered


def test_load_buckets():
    assert [load_bucket(b) for b in (1, 2, 4, 5, 8, 9, 64)] == ["b1", "b4", "b4", "b8", "b8", "b8+", "b8+"]
