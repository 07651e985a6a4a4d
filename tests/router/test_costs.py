"""The router's measured step costs and the objective of "A Drop-in Solution for On-the-Fly
Adaptation of Speculative Decoding in Large Language Models" (Eq. 1) at the best window."""

import pytest

from specserve.replicas.step import PLAIN, RequestStep, Speculation, StepRecord
from specserve.router.costs import StepCosts


def record(forward_tokens, verify_ms, steps=(), draft_ms_by=()):
    requests = tuple(RequestStep(f"r{i}", draft, Speculation(depth) if depth else PLAIN, depth, 0, depth, None)
                     for i, (draft, depth) in enumerate(steps))
    return StepRecord(len(requests) or 1, forward_tokens, 0, max((ms for _, ms in draft_ms_by), default=0.0),
                      verify_ms, 0.0, requests, tuple(draft_ms_by))


def test_draft_cost_is_per_drafted_position_of_each_draft():
    costs = StepCosts()
    assert costs.draft_ms("lm") is None   # unknown
    costs.seed("lm", 3.0)
    assert costs.draft_ms("lm") == 3.0
    # Two drafts proposed concurrently in one step: each is priced by its own time.
    costs.observe(record(12, 30.0, [("lm", 4), ("lm", 2), ("lookup", 3)], [("lm", 8.0), ("lookup", 0.3)]))
    assert costs.draft_ms("lm") == pytest.approx(2.0)       # 8 ms over the deepest proposal, 4 positions
    assert costs.draft_ms("lookup") == pytest.approx(0.1)


def test_verify_cost_is_fitted_and_plain_decoding_priced():
    costs = StepCosts()
    assert costs.verify_model() == (1.0, 0.0)
    for tokens in (1, 3, 5, 9):
        costs.observe(record(tokens, 20.0 + 2.0 * tokens))
    c0, c1 = costs.verify_model()
    assert (c0, c1) == (pytest.approx(20.0), pytest.approx(2.0))
    assert costs.plain(1) == pytest.approx(1e3 / 22.0)
    assert costs.plain(4) == pytest.approx(1e3 / 28.0)


def test_best_window_grows_with_acceptance_and_shrinks_with_cost():
    costs = StepCosts(window_max=8)
    for tokens in (1, 5, 9):
        costs.observe(record(tokens, 20.0 + 1.0 * tokens))
    costs.seed("cheap", 0.1)
    costs.seed("dear", 6.0)
    low, high = costs.best(0.2, "cheap", 1), costs.best(0.9, "cheap", 1)
    assert low[1] < high[1] and low[0] < high[0]
    assert costs.best(0.9, "dear", 1)[1] < high[1]
    # Near-useless drafting loses to plain decoding; good drafting wins.
    assert costs.best(0.05, "dear", 1)[0] < costs.plain(1) < costs.best(0.9, "cheap", 1)[0]


def test_an_unpriced_draft_is_no_candidate_and_the_probe_seeds_the_verify_line():
    costs = StepCosts()
    costs.seed_verify([(1, 22.0), (3, 24.0), (5, 26.0), (7, 28.0)])   # what the start-up probe measured
    assert costs.verify_model() == (pytest.approx(21.0), pytest.approx(1.0))
    # A draft nobody measured is worth nothing, whatever its acceptance: "none" beats it.
    assert costs.best(0.95, "unmeasured", 1) == (0.0, 0) and costs.plain(1) > 0
    costs.seed("unmeasured", 2.0)
    assert costs.best(0.95, "unmeasured", 1)[0] > costs.plain(1)


def test_exploration_prices_an_unmeasured_draft_at_the_dearest_known_cost():
    costs = StepCosts()
    costs.seed_verify([(1, 21.0), (5, 25.0)])
    assert costs.stand_in_ms() is None   # no draft priced: nothing to bound a guess by
    costs.seed("cheap", 0.1)
    costs.observe(record(9, 29.0, [("dear", 4)], [("dear", 12.0)]))   # measured: 3 ms per position
    assert costs.stand_in_ms() == pytest.approx(3.0)
    # Unmeasured, priced as the dearest draft; without the stand-in, still no candidate.
    assert costs.best(0.8, "unmeasured", 1, unknown_ms=costs.stand_in_ms()) == costs.best(0.8, "dear", 1)
    assert costs.best(0.8, "unmeasured", 1) == (0.0, 0)
    # A measured draft keeps its own cost whatever the stand-in.
    assert costs.best(0.8, "cheap", 1, unknown_ms=50.0) == costs.best(0.8, "cheap", 1)


def test_the_loaded_probe_prices_a_burst_before_any_loaded_step():
    """Seeded with the start-up probe's loaded points, the first requests of a burst are priced at
    their load, not at the batch-1 line (under which drafting looked worth it)."""
    costs = StepCosts()
    costs.seed_verify([(1, 20.0), (5, 22.0)])                    # alone: 0.5 ms per token fed
    costs.seed_verify([(12, 64.0), (60, 160.0)], batch_size=12)  # 12 at once: 2 ms per token fed
    assert costs.verify_model(16) == (pytest.approx(40.0), pytest.approx(2.0))
    assert costs.verify_model(1) == (pytest.approx(19.5), pytest.approx(0.5))
    costs.seed("lookup", 0.1)
    assert costs.best(0.3, "lookup", 1)[0] > costs.plain(1)
    assert costs.best(0.3, "lookup", 12)[0] < costs.plain(12)


def test_a_loaded_step_is_priced_by_the_line_of_its_own_load():
    costs = StepCosts()
    costs.seed_verify([(1, 20.0), (5, 22.0)])          # alone: 0.5 ms per token fed
    for tokens in (16, 32, 48, 64):                    # 16 at once: 2 ms per token fed
        costs.observe(record(tokens, 40.0 + 2.0 * tokens, [("lookup", 0)] * 16))
    assert costs.verify_model(1) == (pytest.approx(19.5), pytest.approx(0.5))
    assert costs.verify_model(16) == (pytest.approx(40.0), pytest.approx(2.0))
    costs.seed("lookup", 0.1)
    # At α = 0.3 drafting pays alone and does not at 16 at once.
    assert costs.best(0.3, "lookup", 1)[0] > costs.plain(1)
    assert costs.best(0.3, "lookup", 16)[0] < costs.plain(16)
