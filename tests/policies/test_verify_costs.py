"""The replica's verify cost table: medians per (batch size, forward tokens) over every step."""

from specserve.policies.verify_costs import VerifyCosts
from specserve.replicas.step import StepRecord


def step(batch_size: int, tokens: int, ms: float) -> StepRecord:
    return StepRecord(batch_size, tokens, 0, 0.0, ms, 0.0, ())


def test_the_table_holds_the_median_of_each_size_measured_often_enough():
    costs = VerifyCosts(samples=5, min_samples=3)
    for ms in (20.0, 21.0, 29.0):          # one slow step: the median ignores it
        costs.observe(step(1, 1, ms))
    for ms in (22.0, 22.0):                # two samples: not yet in the table
        costs.observe(step(1, 5, ms))
    assert costs.table(1) == ((1, 21.0),)
    costs.observe(step(1, 5, 30.0))
    assert costs.table(1) == ((1, 21.0), (5, 22.0))       # the table follows the next step


def test_batch_sizes_have_tables_of_their_own_and_old_steps_leave():
    costs = VerifyCosts(samples=3, min_samples=1)
    costs.observe(step(1, 2, 20.0))
    costs.observe(step(4, 8, 35.0))
    assert costs.table(1) == ((2, 20.0),) and costs.table(4) == ((8, 35.0),)
    for ms in (25.0, 26.0, 27.0):          # three newer steps push the first out of the window of 3
        costs.observe(step(1, 2, ms))
    assert costs.table(1) == ((2, 26.0),)
    costs.observe(step(0, 0, 99.0))        # a step that verified nothing (prefill only) is no measurement
    assert costs.table(0) == ()


def test_contexts_of_different_buckets_have_tables_of_their_own():
    from specserve.policies.verify_costs import context_bucket

    assert [context_bucket(c) for c in (0, 128, 129, 300, 1000, 1025)] == [128, 128, 256, 512, 1024, 2048]
    costs = VerifyCosts(min_samples=1)
    costs.observe(step(1, 6, 19.5), context_tokens=200)     # short prompt: 6 tokens nearly free
    costs.observe(step(1, 6, 26.0), context_tokens=1000)    # long prompt: the attention adds up
    assert costs.table(1, 180) == ((6, 19.5),) and costs.table(1, 900) == ((6, 26.0),)
    # A batch's bucket is its mean context: two requests of 600 and 400 read 500 each on average.
    costs.observe(step(2, 12, 40.0), context_tokens=1000)
    assert costs.table(2, 1000) == ((12, 40.0),) and costs.table(2, 2000) == ()
