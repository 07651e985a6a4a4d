"""The goodput policy turns speculation off exactly when the measured costs say plain decoding
emits more tokens per second for the batch."""

import pytest

from specserve.policies.goodput import GoodputPolicy, expected_emitted
from specserve.replicas.request import StaticPolicy
from specserve.replicas.step import PLAIN, RequestStep, Speculation, StepRecord


def record(forward_tokens: int, verify_ms: float, steps=()) -> StepRecord:
    return StepRecord(len(steps) or 1, forward_tokens, 0, 0.0, verify_ms, 0.0, tuple(steps))


def outcome(accepted: int, depth: int = 4) -> RequestStep:
    return RequestStep("r", "d", Speculation(depth), depth, accepted, depth, None)


def test_expected_emitted():
    # α = 0: only the bonus token; α = 1: all γ drafts plus the bonus; α = 0.5, γ = 2: 1 + .5 + .25.
    assert expected_emitted(0.0, 4) == 1.0
    assert expected_emitted(1.0, 4) == 5.0
    assert abs(expected_emitted(0.5, 2) - 1.75) < 1e-12


def test_speculation_pays_alone_and_not_in_a_large_batch_at_low_acceptance():
    policy = GoodputPolicy(StaticPolicy(), explore_share=0.0, min_steps=1, margin=0.0)
    # Verify costs 10 ms + 1 ms per token fed (literal, two sizes so the fit is exact).
    for tokens in (5, 60) * 4:
        policy.observe(record(tokens, 10 + tokens))
    assert policy.cost_model() == (10.0, 1.0)
    # α̂ = Σn / (Σn + Σ1[n < γ]) = 3 / (3 + 7) = 0.3: one step accepted 3 of γ = 4, six none.
    policy.observe(record(5, 15, [outcome(3)] + [outcome(0)] * 6))
    assert abs(policy.alpha("d") - 0.3) < 1e-12
    # Batch 1: E(4) = 1.43 tokens in 15 ms beats 1 token in 11 ms ...
    assert policy.pays("d", 4, batch_size=1)
    # ... but a shorter window pays more: net(γ) = E(γ) - 1 - γ/11 is 0.209 at γ = 1, 0.208 at 2,
    # 0.061 at 4 (each draft token costs 1 ms, worth 1/11 token of plain decoding).
    assert policy.window_for("d", 4, batch_size=1) == 1
    # Batch 12: a plain step emits 12 tokens in 22 ms; one request's extra 0.3 tokens for 1 ms
    # more (0.545 tokens' worth) do not pay, at any window.
    assert not policy.pays("d", 4, batch_size=12)
    assert policy.window_for("d", 4, batch_size=12) == 0
    # The margin prices the extra time higher: at 250% even batch 1's best window stops paying.
    policy.margin = 2.5
    assert not policy.pays("d", 4, batch_size=1)


def test_a_good_draft_keeps_a_longer_window_and_shrinks_it_with_load():
    policy = GoodputPolicy(StaticPolicy(), explore_share=0.0, min_steps=1, margin=0.0)
    for tokens in (5, 60) * 4:
        policy.observe(record(tokens, 10 + 0.5 * tokens))   # 10 ms + 0.5 ms a token
    policy.observe(record(5, 15, [outcome(4)] * 8 + [outcome(3)] * 2))   # α̂ = 38 / 40 -> 0.95
    windows = [policy.window_for("d", 8, batch_size=b) for b in (1, 4, 16, 64)]
    assert windows[0] == 8 and windows == sorted(windows, reverse=True) and windows[-1] < 8
    # The chosen window is what the request's next step asks for; a pinned one is left alone.
    import torch
    from specserve.replicas.sampling import SamplingParams
    from specserve.replicas.request import RequestState, SpecRequest

    free, pinned = (RequestState(SpecRequest([1, 2], 8, SamplingParams(), "d", 8, pinned=p), frozenset(),
                                 torch.device("cpu")) for p in (False, True))
    assert policy.choose(free, batch_size=64) == Speculation(windows[-1])
    assert policy.choose(pinned, batch_size=64) == Speculation(8)


def test_it_speculates_until_it_has_measured_then_explores_within_its_share():
    import random

    import torch
    from specserve.replicas.sampling import SamplingParams
    from specserve.replicas.request import RequestState, SpecRequest

    policy = GoodputPolicy(StaticPolicy(), explore_share=0.05, rng=random.Random(7))
    assert policy.pays("d", 4, batch_size=16)      # nothing measured yet
    for tokens in (16, 80):
        policy.observe(record(tokens, 10 + tokens, [outcome(0)] * 8))   # α̂ = 0; 10 ms + 1 ms a token
    assert not policy.pays("d", 4, batch_size=4)
    states = [RequestState(SpecRequest([1, 2], 1000, SamplingParams(), "d", 4, request_id=f"r{i}"), frozenset(),
                           torch.device("cpu")) for i in range(4)]
    # Batch 4: a plain step costs 14 ms, so each request earns 0.05 * 14 / 4 = 0.175 ms a step, and
    # its γ = 4 costs 4 ms (4 tokens at 1 ms): one exploring step in ~23 of its own.
    explored: dict[str, list[int]] = {s.id: [] for s in states}
    steps = 230
    for step in range(steps):
        for state in states:
            spec = policy.choose(state, batch_size=4)
            assert spec.plain or spec == Speculation(4)   # explores at the asked window, or not at all
            if not spec.plain:
                explored[state.id].append(step)
        policy.observe(record(4, 14, [RequestStep(s.id, "d", PLAIN, 0, 0, 0, None) for s in states]))
    # The history now holds only steps of 4 tokens, which fit no line: the last line stands.
    assert policy.cost_model(4) == (10.0, 1.0)
    counts = [len(v) for v in explored.values()]
    # The whole spend is the share of the verify time (plus each request's random first credit).
    assert sum(counts) * 4.0 <= 0.05 * 14 * steps + 4 * 4.0
    assert all(9 <= c <= 11 for c in counts), counts
    # Spread over the requests: they do not all explore in the same steps.
    assert len({s for v in explored.values() for s in v}) > max(counts)
    # A request that leaves takes its credit with it.
    policy.observe(record(4, 14, [RequestStep("r0", "d", PLAIN, 0, 0, 0, None)]))
    assert set(policy._credit) == {"r0"}


def test_a_request_that_pinned_its_window_keeps_it():
    from specserve.replicas.request import RequestState, SpecRequest
    from specserve.replicas.sampling import SamplingParams
    import torch

    policy = GoodputPolicy(StaticPolicy(), explore_share=0.0)
    for tokens in (5, 60) * 4:
        policy.observe(record(tokens, 10 + tokens, [outcome(0)] * 4))   # α̂ = 0: never pays
    free, pinned = (RequestState(SpecRequest([1, 2], 8, SamplingParams(), "d", 4, pinned=p), frozenset(),
                                 torch.device("cpu")) for p in (False, True))
    assert policy.choose(free, batch_size=12).plain
    assert policy.choose(pinned, batch_size=12) == Speculation(4)


def test_the_drafts_own_time_counts():
    # Same costs and α̂ = 0.3 as above, where batch 1 speculation paid (1.43 tokens in 15 ms);
    # a draft that takes 10 ms a step makes it 1.43 tokens in 25 ms, against 1 token in 11 ms.
    policy = GoodputPolicy(StaticPolicy(), explore_share=0.0, min_steps=1)
    for tokens in (5, 60) * 4:
        policy.observe(record(tokens, 10 + tokens))
    for accepted in (3, 0, 0, 0, 0, 0, 0):
        policy.observe(StepRecord(1, 5, 0, 10.0, 15.0, 0.0, (outcome(accepted),)))
    assert abs(policy.alpha("d") - 0.3) < 1e-12 and policy.draft_ms_per_position("d") == 2.5   # 10 ms, 4 positions
    # The shortest window pays least for the draft (2.5 ms) and still does not pay: 1.3 tokens in 13.5 ms.
    assert not policy.pays("d", 4, batch_size=1)


def test_a_model_draft_prices_each_drafted_position():
    """Batch 1, verify 20 ms + 0.2 ms a token, a draft taking 8 ms for 4 positions (2 ms each),
    α̂ = 0.5. net(γ) = E(γ) − 1 − (0.2·γ + 2·γ) / 20.2 is 0.39, 0.53, 0.55, 0.50 for γ = 1..4: the
    fourth token's draft forward costs more than it brings. (Priced per call, 8 ms whatever the
    window, γ = 4 looked best.)"""
    policy = GoodputPolicy(StaticPolicy(), explore_share=0.0, min_steps=1, margin=0.0)
    for tokens in (1, 5) * 4:
        policy.observe(record(tokens, 20 + 0.2 * tokens))
    for _ in range(8):   # n = 1 of γ = 4 every step: α̂ = Σn / (Σn + Σ1[n < γ]) = 1/2
        policy.observe(StepRecord(1, 5, 0, 8.0, 21.0, 0.0, (outcome(1),), draft_ms_by=(("d", 8.0),)))
    assert policy.alpha("d") == 0.5 and policy.draft_ms_per_position("d") == 2.0
    assert policy.window_for("d", 4, batch_size=1) == 3
    assert policy.window_for("d", 2, batch_size=1) == 2


def test_each_request_is_priced_at_its_own_acceptance():
    """Batch 1, verify 20 ms + 0.2 ms a token, the draft 4 ms a position, no margin. Over the
    replica the draft accepts α̂ = 64 / (64 + 16) = 0.8, which pays for every request; but one
    request accepted all of its 16 steps and another none: (0 + 4·0.8) / (16 + 4) = 0.16 for it,
    and net(1) = 0.16 − 4.2/20.2 < 0. A request the router chose the draft for at α = 0.9
    drafts even where the replica saw the draft fail (α̂ 0)."""
    from specserve.replicas.sampling import SamplingParams
    from specserve.replicas.request import RequestState, SpecRequest
    import torch

    def request(rid: str, expected: float | None = None) -> RequestState:
        s = RequestState(SpecRequest([1, 2], 64, SamplingParams(), "d", 4, request_id=rid), frozenset(),
                         torch.device("cpu"))
        s.expected_alpha = expected
        return s

    def step(rid: str, accepted: int) -> RequestStep:
        return RequestStep(rid, "d", Speculation(4), 4, accepted, 4, None)

    policy = GoodputPolicy(StaticPolicy(), explore_share=0.0, margin=0.0)
    for tokens in (1, 5) * 4:
        policy.observe(record(tokens, 20 + 0.2 * tokens))
    for _ in range(16):
        policy.observe(StepRecord(2, 10, 0, 16.0, 22.0, 0.0, (step("good", 4), step("bad", 0)), draft_ms_by=(("d", 32.0),)))
    assert policy.alpha("d") == 0.8 and policy.draft_ms_per_position("d") == 4.0
    good, bad = request("good"), request("bad")
    assert policy.request_alpha(bad) == pytest.approx(0.16)
    assert policy.choose(good, batch_size=1) == Speculation(4)
    assert policy.choose(bad, batch_size=1).plain

    failing = GoodputPolicy(StaticPolicy(), explore_share=0.0, margin=0.0)
    for tokens in (1, 5) * 4:
        failing.observe(record(tokens, 20 + 0.2 * tokens))
    for _ in range(16):
        failing.observe(StepRecord(1, 5, 0, 16.0, 21.0, 0.0, (step("elsewhere", 0),), draft_ms_by=(("d", 16.0),)))
    assert failing.alpha("d") == 0.0
    assert failing.choose(request("new"), batch_size=1).plain
    assert failing.choose(request("routed", expected=0.9), batch_size=1).window >= 1


def test_a_request_is_priced_at_its_tasks_prior_before_the_replicas_mix_of_tasks():
    """The replica saw the draft fail (α̂ 0, 16 steps of another task): a request that came with
    its task's cluster α (0.9, its warm start's) drafts, priced at that prior beside its own
    steps; one without a prior is priced at the replica's α̂ and decodes plainly; the router's
    prediction, when there is one, comes first."""
    from specserve.replicas.sampling import SamplingParams
    from specserve.replicas.request import RequestState, SpecRequest
    import torch

    def request(rid: str, prior: float | None = None, expected: float | None = None) -> RequestState:
        s = RequestState(SpecRequest([1, 2], 64, SamplingParams(), "d", 4, request_id=rid, prior_alpha=prior),
                         frozenset(), torch.device("cpu"))
        s.expected_alpha = expected
        return s

    policy = GoodputPolicy(StaticPolicy(), explore_share=0.0, margin=0.0)
    for tokens in (1, 5) * 4:
        policy.observe(record(tokens, 20 + 0.2 * tokens))
    for _ in range(16):
        policy.observe(StepRecord(1, 5, 0, 16.0, 21.0, 0.0, (RequestStep("other", "d", Speculation(4), 4, 0, 4, None),),
                                  draft_ms_by=(("d", 16.0),)))
    assert policy.alpha("d") == 0.0 and policy.choose(request("cold"), batch_size=1).plain
    assert policy.request_alpha(request("warm", prior=0.9)) == pytest.approx(0.9)
    assert policy.choose(request("warm", prior=0.9), batch_size=1).window >= 1
    assert policy.request_alpha(request("routed", prior=0.9, expected=0.3)) == pytest.approx(0.3)


def test_a_request_alone_with_a_draft_model_pays_its_whole_call():
    """Batch 8, verify 10 ms + 0.1 ms a token, α̂ = 0.95, the draft's call 10 ms. Shared by all
    eight requests (1.25 ms each), γ = 4 pays; one request drafting alone makes the whole step
    wait 10 ms for its 3.5 extra tokens, which plain decoding would have beaten (7.7 tokens)."""

    def policy_seeing(users: int) -> GoodputPolicy:
        policy = GoodputPolicy(StaticPolicy(), explore_share=0.0, min_steps=1, margin=0.0)
        for tokens in (8, 40) * 4:
            policy.observe(record(tokens, 10 + 0.1 * tokens))
        steps = tuple(RequestStep(f"r{i}", "d", Speculation(4) if i < users else PLAIN, 4 if i < users else 0,
                                  4 if i < users else 0, 4 if i < users else 0, None) for i in range(8))
        for _ in range(4):
            policy.observe(StepRecord(8, 8 + 4 * users, 0, 10.0, 10 + 0.1 * (8 + 4 * users), 0.0, steps,
                                      draft_ms_by=(("d", 10.0),)))
        return policy

    shared, alone = policy_seeing(8), policy_seeing(1)
    assert shared.draft_ms_per_position("d") == 1.25 / 4 and alone.draft_ms_per_position("d") == 10.0 / 4
    assert shared.window_for("d", 4, batch_size=8) == 4
    assert alone.window_for("d", 4, batch_size=8) == 0


def test_the_clusters_prior_keeps_a_good_draft_on_after_a_replicas_unlucky_first_steps():
    from specserve.replicas.request import RequestState, SpecRequest
    from specserve.replicas.sampling import SamplingParams
    import torch

    def fresh():
        policy = GoodputPolicy(StaticPolicy(), explore_share=0.0)
        for tokens in (5, 60) * 4:
            policy.observe(record(tokens, 10 + tokens))     # 10 ms + 1 ms per token fed
        return policy

    def warm_request(prior):
        return RequestState(SpecRequest([1, 2], 8, SamplingParams(), "d", 4, prior_alpha=prior), frozenset(),
                            torch.device("cpu"))

    cold, warm = fresh(), fresh()
    warm.choose(warm_request(0.9), batch_size=1)            # a request arrives with the cluster's α
    for policy in (cold, warm):
        policy.observe(record(5, 15, [outcome(0)] * 2))     # two unlucky first steps
    # Cold, too few steps to judge: it keeps speculating (min_steps); warm, the prior decides.
    assert cold.alpha("d") is None and cold.pays("d", 4, batch_size=1)
    # 8 pseudo-steps at 0.9 beside 2 failures: α̂ = 7.2 / 10 = 0.72, E(4) = 2.4 tokens in 15 ms.
    assert abs(warm.alpha("d") - 0.72) < 1e-9 and warm.pays("d", 4, batch_size=1)
    for policy in (cold, warm):
        policy.observe(record(5, 15, [outcome(0)] * 6))     # eight failures in all
    # Cold: α̂ = 0, plain wins. Warm: 7.2 / (7.2 + 0.8 + 8) = 0.45, E(4) = 1.79 tokens in 15 ms
    # still beats 1 token in 11 ms; the prior fades as the replica's own steps pile up.
    assert cold.alpha("d") == 0.0 and not cold.pays("d", 4, batch_size=1)
    assert abs(warm.alpha("d") - 0.45) < 1e-9 and warm.pays("d", 4, batch_size=1)


def test_the_cost_line_of_the_steps_load_bucket_prices_a_busy_step():
    """Idle and half-busy steps cost 10 ms + 0.1 ms a token fed; at batch 16 the extra tokens cost
    0.72 ms each. One line through all of them says speculating at batch 16 pays; the b8+ bucket's
    own line says it does not."""
    policy = GoodputPolicy(StaticPolicy(), explore_share=0.0, min_steps=1, margin=0.0)
    for _ in range(8):
        for batch, tokens, ms in ((1, 1, 10.1), (1, 5, 10.5), (4, 4, 10.4), (4, 20, 12.0), (8, 8, 10.8), (8, 40, 14.0)):
            policy.observe(StepRecord(batch, tokens, 0, 0.0, ms, 0.0, (outcome(2),) * batch))
    policy.observe(StepRecord(16, 16, 0, 0.0, 14.0, 0.0, (outcome(2),) * 16))
    policy.observe(StepRecord(16, 80, 0, 0.0, 60.0, 0.0, (outcome(2),) * 16))
    a, b = policy.cost_model(16)
    assert abs(a - 2.5) < 1e-9 and abs(b - 0.71875) < 1e-9
    # α̂ = 2 / (2 + 1): E(4) = 2.6 tokens a step.
    assert abs(policy.alpha("d") - 2 / 3) < 1e-12
    assert not policy.pays("d", 4, batch_size=16)   # 41.7 tokens in 60 ms < 16 in 14 ms
    assert policy.pays("d", 4, batch_size=1)        # the b1 line: 2.6 tokens in 10.5 ms > 1 in 10.1 ms
    # The pooled line (what the policy used before) prices the busy step as worth it.
    a, b = policy.cost_model()
    assert 16 * expected_emitted(2 / 3, 4) / (a + b * 80) > 16 / (a + b * 16)


def test_a_tree_that_pays_is_kept_even_when_a_shorter_chain_would_pay_more():
    """Trees are not shrunk: kept whole when their depth (priced at the node budget) pays."""
    import torch
    from specserve.replicas.sampling import SamplingParams
    from specserve.replicas.request import RequestState, SpecRequest
    from specserve.replicas.step import TreeShape

    policy = GoodputPolicy(StaticPolicy(), explore_share=0.0, min_steps=1, margin=0.0)
    for tokens in (5, 60) * 4:
        policy.observe(record(tokens, 10 + 2 * tokens))     # 10 ms + 2 ms a token
    policy.observe(record(5, 15, [outcome(3)] * 2 + [outcome(0)] * 2))   # α̂ = 6 / (6 + 4) = 0.6
    tree = TreeShape(4, 2, 6)
    net = policy.gains("d", 4, 1, tree.budget)
    assert net[-1] > 0 and max(net) > net[-1]          # pays at depth 4, a depth of 3 would pay more
    state = RequestState(SpecRequest([1, 2], 8, SamplingParams(), "d", 0, tree), frozenset(), torch.device("cpu"))
    assert policy.choose(state, batch_size=1) == Speculation(0, tree)
    assert policy.choose(state, batch_size=64).plain   # a busy step prices its 6 nodes too high



def test_the_start_up_probes_loaded_points_price_a_burst_before_its_first_steps():
    """Seeded with batch-1 points only, a burst's first steps are priced on the idle line, where
    drafting pays; the loaded probe's points give the busy bucket its own line from the start."""
    policy = GoodputPolicy(StaticPolicy(), explore_share=0.0, min_steps=1, margin=0.0)
    policy.seed_costs(((1, 10.1), (5, 10.5)), {"d": 0.05}, loaded=((12, ((12, 14.0), (60, 60.0))),))
    for _ in range(4):
        policy.observe(StepRecord(1, 5, 0, 0.0, 10.5, 0.0, (outcome(2),)))   # α̂ = 2/3
    assert policy.pays("d", 4, batch_size=1)
    assert not policy.pays("d", 4, batch_size=12)
