"""Window policies on literal traces: the pure rules first, then the wrapper that makes
them the scheduler's Policy. Records are the real StepRecord / RequestStep of replicas/step.py."""

import random
from dataclasses import replace

import pytest
import torch

from specserve.policies.cache_fsm_window import CacheFSMState, CacheFSMWindow
from specserve.policies.fsm_window import FSMState, FSMWindow
from specserve.policies.hf_window import HFState, HFWindow
from specserve.policies.online_window import OnlineState, OnlineWindow, verify_ms_at
from specserve.policies.q_learning_window import QLearningWindow, QState
from specserve.policies.window import WindowOutcome, WindowPolicy, estimate_alpha, fit_verify_ms
from specserve.replicas.sampling import SamplingParams
from specserve.replicas.request import NO_DRAFT, RequestState, SpecRequest
from specserve.replicas.step import PLAIN, RequestStep, Speculation, StepRecord, StepResult, TreeShape

RNG = random.Random(0)


def request(window: int = 4, prompt=(1, 2, 3), pinned: bool = False, draft: str = "d", tree=None,
            request_id: str = "r", max_tokens: int = 200) -> SpecRequest:
    return SpecRequest(list(prompt), max_tokens, SamplingParams(), draft, window, tree, request_id, pinned)


def step(accepted: int, window: int, request_id: str = "r") -> RequestStep:
    return RequestStep(request_id, "d", Speculation(window), window, accepted, window, None)


def record(*steps: RequestStep, draft_ms: float = 0.0, verify_ms: float = 20.0,
           forward_tokens: int | None = None) -> StepRecord:
    tokens = forward_tokens if forward_tokens is not None else sum(1 + s.proposed for s in steps)
    return StepRecord(len(steps), tokens, 0, draft_ms, verify_ms, 0.0, tuple(steps))


def outcome(accepted: int, window: int, tokens=(), **costs) -> WindowOutcome:
    rec = record(step(accepted, window), **costs)
    return WindowOutcome.of(rec, rec.requests[0], tokens)


def run(rule, state, outcomes):
    """The windows a rule asks after each outcome of a trace."""
    windows = []
    for o in outcomes:
        state = rule.update(state, o)
        window, state = rule.decide(state, 1, RNG)
        windows.append(window)
    return windows, state


# ---- shared helpers -------------------------------------------------------------------------------

def test_outcome_reads_the_request_and_the_rest_of_its_batch():
    mine, other = step(2, 4, "r"), step(1, 6, "s")
    o = WindowOutcome.of(record(mine, other, draft_ms=12.0, verify_ms=30.0), mine, (7, 8, 9))
    # forward = (1 + 4) + (1 + 6) = 12 tokens; the other request emitted n + 1 = 2 and was offered 6.
    assert (o.asked, o.window, o.accepted, o.emitted_tokens) == (4, 4, 2, (7, 8, 9))
    assert (o.forward_tokens, o.others_window, o.others_emitted, o.batch_size) == (12, 6, 2, 2)
    assert not o.fully_accepted and outcome(4, 4).fully_accepted


def test_alpha_is_eq_2_capped_and_the_cost_fit_is_least_squares():
    # Σn = 3 + 0 = 3, Σ1[n < γ] = 2 -> 3 / 5; plain steps (γ = 0) say nothing.
    assert estimate_alpha([(3, 4), (0, 4), (0, 0)], alpha_max=0.95) == pytest.approx(0.6)
    # Only full acceptances: Eq. 2 gives 1, the cap keeps E(γ) finite.
    assert estimate_alpha([(4, 4)] * 3, alpha_max=0.9) == 0.9
    assert estimate_alpha([], 0.9) is None
    # 10 ms + 1 ms per token, exactly; a single size cannot give a slope.
    assert fit_verify_ms([(5, 15.0), (60, 70.0)]) == pytest.approx((10.0, 1.0))
    assert fit_verify_ms([(5, 15.0), (5, 16.0)]) is None


# ---- FSM ------------------------------------------------------------------------------------------

def test_fsm_full_acceptances_raise_the_window_to_its_bound():
    rule = FSMWindow(window_max=5)
    # A saturating counter: +1 per fully accepted window (n = γ), never past γ_max = 5.
    windows, _ = run(rule, rule.start(request(window=2)), [outcome(2, 2), outcome(3, 3), outcome(4, 4),
                                                           outcome(5, 5), outcome(5, 5)])
    assert windows == [3, 4, 5, 5, 5]


def test_fsm_a_rejection_lowers_the_window_by_one_down_to_its_floor():
    rule = FSMWindow(window_max=5)
    # §4.2: "decreasing γ by 1 if a token from the draft model is rejected" (n < γ, whatever n is).
    windows, _ = run(rule, FSMState(5), [outcome(4, 5), outcome(0, 4), outcome(1, 3), outcome(0, 2), outcome(0, 1)])
    assert windows == [4, 3, 2, 1, 1]
    # A step where the draft offered nothing (no prompt-lookup match) teaches nothing.
    assert rule.update(FSMState(3), outcome(0, 0)) == FSMState(3)


def test_fsm_with_a_floor_of_zero_leaves_it_by_a_plain_step():
    rule = FSMWindow(window_max=5, window_min=0)
    state = rule.update(FSMState(1), outcome(0, 1))
    assert state == FSMState(0)
    # γ = 0 asked: an empty window, fully accepted, so the counter climbs back to look again.
    plain = WindowOutcome(asked=0, window=0, accepted=0)
    assert rule.update(state, plain) == FSMState(1)


# ---- cache-enabled FSM ------------------------------------------------------------------------------

def test_cache_fsm_follows_the_paper_rules():
    rule = CacheFSMWindow(window_max=6)
    state = rule.start(request(window=3, prompt=(10, 11, 12)))
    assert state == CacheFSMState(3, (10, 11, 12))
    # 2 of 3 accepted, token 10 is in the prompt: +1 (a cached token), no full acceptance.
    state = rule.update(state, outcome(2, 3, tokens=(10, 99, 50)))
    assert state.window == 4 and state.cache == (10, 11, 12, 50, 99)   # accepted and bonus tokens join
    # 4 of 4 accepted, all cached (99 and 50 joined last step): +1 +1.
    state = rule.update(state, outcome(4, 4, tokens=(99, 50, 10, 11, 7)))
    assert state.window == 6
    # Full acceptance of tokens never seen: −1 (none cached) + 1 (all accepted) = 0.
    state = rule.update(state, outcome(2, 2, tokens=(70, 71, 72)))
    assert state.window == 6
    # Nothing accepted: none of the (zero) accepted tokens is cached, −1.
    state = rule.update(state, outcome(0, 6, tokens=(10,)))
    assert state.window == 5
    # A partial acceptance that hits the cache raises γ although a token was rejected (the paper's rule).
    state = rule.update(state, outcome(1, 5, tokens=(72, 3)))
    assert state.window == 6


# ---- online window optimisation -----------------------------------------------------------------------

def measured(rule: OnlineWindow, accepted_windows, draft_ms: float, verify_ms: float) -> OnlineState:
    """A request alone in its batch whose steps cost ``draft_ms`` and a flat ``verify_ms``."""
    state = rule.start(request(window=4))
    for n, g in accepted_windows:
        state = rule.update(state, outcome(n, g, draft_ms=draft_ms, verify_ms=verify_ms))
    return state


def test_online_picks_zero_when_alpha_is_tiny():
    rule = OnlineWindow(window_max=8, history_steps=20)
    # Steps of γ = 4 (forward 5 tokens) and γ = 1 (2 tokens), both 20 ms: b flat, measured at two sizes.
    # a = 8 ms / 4 forwards = 2 ms (γ = 4 steps) and 2 / 1 (γ = 1 steps).
    trace = [(0, 4)] * 10 + [(1, 1)] + [(0, 1)] * 9
    state = measured(rule, [], 0, 0)
    for n, g in trace:
        state = rule.update(state, outcome(n, g, draft_ms=3.0 * g, verify_ms=20.0))
    # Eq. 2: α̂ = Σn / (Σn + Σ1[n<γ]) = 1 / (1 + 19) = 0.05. With the default prior (0.5 over 3
    # pseudo-steps) α̂ = 2.5 / 23 = 0.109: G(0) = 1/20 = 0.05 beats G(1) = 1.109/23 = 0.0482, and
    # every longer window costs 3 ms more per token while adding less than 0.012 tokens.
    assert estimate_alpha(state.outcomes, rule.alpha_max) == pytest.approx(0.05)
    assert estimate_alpha(state.outcomes, rule.alpha_max, (0.5, 3)) == pytest.approx(2.5 / 23)
    assert rule.decide(state, 1, RNG)[0] == 0
    # The paper's cold estimator (no prior) agrees.
    cold = OnlineWindow(window_max=8, history_steps=20, default_alpha=None)
    assert cold.decide(replace(state, prior_alpha=None), 1, RNG)[0] == 0


def test_online_picks_the_largest_window_when_alpha_is_near_one_and_verification_is_flat():
    rule = OnlineWindow(window_max=8)
    state = measured(rule, [(4, 4), (2, 2)] * 3, draft_ms=0.0, verify_ms=20.0)
    state = replace(state, draft_costs=((4, 2.0),))   # a = 0.5 ms per draft token
    # α̂ = 1 capped at 0.95; E(γ) = (1 − .95^(γ+1)) / .05 grows by .95^γ ≥ 0.63 tokens per step of γ while
    # the step grows by a = 0.5 ms on 20 ms: G(7) = 6.73 / 23.5 = 0.286 < G(8) = 7.40 / 24 = 0.308.
    assert rule.decide(state, 1, RNG)[0] == 8


def test_online_stops_earlier_when_verification_grows_with_the_window():
    rule = OnlineWindow(window_max=8)
    trace = [(2, 4), (0, 4), (1, 1), (0, 1)] * 2          # α̂ = 6 / (6 + 6) = 0.5
    flat = measured(rule, [], 0, 0)
    grows = flat
    for n, g in trace:
        flat = rule.update(flat, outcome(n, g, verify_ms=20.0))
        grows = rule.update(grows, outcome(n, g, verify_ms=14.0 + 3.0 * (1 + g)))   # 3 ms per fed token
    # Free draft. Flat b: E(γ) keeps growing, so the longest window wins. At 3 ms per fed token
    # b(γ) = 17 + 3γ: G(0) = 1/17 = .059, G(1) = 1.5/20 = .075, G(2) = 1.75/23 = .0761,
    # G(3) = 1.875/26 = .0721, and E grows by less than 3/b per step after that: γ = 2.
    assert rule.decide(flat, 1, RNG)[0] == 8
    assert rule.decide(grows, 1, RNG)[0] == 2


def test_online_measures_before_it_optimises_and_looks_again_after_plain_steps():
    rule = OnlineWindow(window_max=8, explore_every=3, default_alpha=None)   # Eq. 2 alone: α̂ can reach 0
    state = rule.start(request(window=4))
    # Nothing measured: its own window, then half of it, so the first cost fit spans two sizes.
    window, state = rule.decide(state, 1, RNG)
    assert window == 4
    state = rule.update(state, outcome(0, 4, draft_ms=8.0))
    window, state = rule.decide(state, 1, RNG)
    assert window == 2
    state = rule.update(state, outcome(0, 2, draft_ms=4.0))
    # α̂ = 0 now: plain steps, and every third a one-token look.
    decisions = []
    for _ in range(6):
        window, state = rule.decide(state, 1, RNG)
        decisions.append(window)
    assert decisions == [0, 0, 1, 0, 0, 1]


def test_online_prices_windows_from_the_replicas_table_plus_its_own_level():
    # The replica measured verification flat up to 6 tokens and dearer from 7 (γ = 6); this request
    # ran only windows 4 and 1 (5 and 2 tokens), each step 2 ms above the table (a long context).
    table = ((1, 20.0), (2, 20.0), (3, 20.0), (4, 20.0), (5, 20.0), (6, 20.0), (7, 24.0), (8, 25.0), (9, 26.0))
    rule = OnlineWindow(window_max=8, history_steps=8)
    pooled = own = rule.start(request(window=4))
    for n, g in [(2, 4), (0, 4), (1, 1), (0, 1)] * 2:          # α̂ = (6 + 1.5) / (6 + 6 + 3) = 0.5
        o = outcome(n, g, verify_ms=22.0)
        own = rule.update(own, o)
        pooled = rule.update(pooled, replace(o, verify_table=table))
    assert pooled.verify_excess == (2.0,) * 8
    assert rule.verify_ms(pooled, 7) == 26.0 and rule.verify_ms(pooled, 3) == 22.0
    # Own steps alone: flat at 22 over 2 and 5 tokens, extended flat: E(γ) grows, so γ = 8.
    assert rule.decide(own, 1, RNG)[0] == 8
    # The table: G(4) = 1.9375 / 22 = .0881, G(5) = 1.9688 / 22 = .0895, G(6) = 1.9844 / 26 = .0763.
    assert rule.decide(pooled, 1, RNG)[0] == 5
    assert OnlineState.from_json(pooled.to_json()) == pooled


def test_the_policy_hands_every_request_the_table_of_all_requests_steps():
    policy = WindowPolicy(OnlineWindow(window_max=8))
    a, b = state_of(request(request_id="a")), state_of(request(request_id="b"))
    policy.choose(a, 1)
    policy.choose(b, 1)
    policy.costs.min_samples = 1
    policy.observe(record(step(0, 4, request_id="a"), verify_ms=30.0))    # 5 tokens, batch 1 (each
    policy.observe(record(step(0, 1, request_id="b"), verify_ms=20.0))    # record is its own batch)
    # b's outcome came with the table of both steps: a's 5-token step and its own 2-token one.
    assert policy.states["b"].verify_table == ((2, 20.0), (5, 30.0))
    assert policy.states["a"].verify_table == ((5, 30.0),)


def test_online_b_interpolates_measured_sizes():
    # Verify ms of SmolLM2-135M (float32) for 1 / 4 / 8 draft tokens after a 200-token prefix, as
    # measured on a 2-core CPU (docs/benchmarks.md §13).
    costs = ((2, 39.0), (5, 62.0), (9, 65.0))
    assert verify_ms_at(costs, 5) == 62.0
    assert verify_ms_at(costs, 7) == pytest.approx(63.5)
    assert verify_ms_at(costs, 1) < 39.0 < verify_ms_at(costs, 3)


# ---- Hugging Face heuristic ---------------------------------------------------------------------------

def test_hf_heuristic_adds_two_on_full_acceptance_and_takes_one_otherwise():
    rule = HFWindow(window_max=7)
    trace = [outcome(2, 2), outcome(4, 4), outcome(6, 6), outcome(3, 7), outcome(0, 6), outcome(5, 5),
             outcome(0, 7), outcome(0, 6), outcome(0, 5), outcome(0, 4), outcome(0, 3), outcome(0, 2), outcome(0, 1)]
    windows, _ = run(rule, rule.start(request(window=2)), trace)
    # 2 → 4 → 6 → 7 (8 saturates at window_max) → 6 → 5 → 7 → 6 ... → 1, and never below 1.
    assert windows == [4, 6, 7, 6, 5, 7, 6, 5, 4, 3, 2, 1, 1]


# ---- Q-learning ----------------------------------------------------------------------------------------

def test_q_learning_update_moves_q_toward_the_reward():
    rule = QLearningWindow(window_max=2, lr=0.5, discount=0.0)
    state = QState(q=((0.0,) * 3,) * 3, previous=1, window=2)
    # 2 of 2 accepted + bonus = 3 tokens in 10 + 20 ms: reward 100 tokens/s; Q[1][2] = 0 + .5·(100 − 0).
    o = outcome(2, 2, draft_ms=10.0, verify_ms=20.0)
    state = rule.update(state, o)
    assert state.q[1] == (0.0, 0.0, 50.0)
    state = rule.update(QState(state.q, 1, 2), o)          # again: 50 + .5·(100 − 50)
    assert state.q[1][2] == 75.0
    # With discount .5 the target adds half of the best value from s' = a = 2: Q[2] = (0, 40, 0).
    discounted = QLearningWindow(window_max=2, lr=0.5, discount=0.5)
    q = ((0.0,) * 3, (0.0,) * 3, (0.0, 40.0, 0.0))
    assert discounted.update(QState(q, 1, 2), o).q[1][2] == 0.5 * (100 + 0.5 * 40)


def test_q_learning_is_greedy_without_exploration_and_explores_with_the_injected_generator():
    q = ((0.0,) * 4, (1.0, 5.0, 9.0, 2.0), (0.0,) * 4, (0.0,) * 4)
    greedy = QLearningWindow(window_max=3, epsilon=0.0)
    window, state = greedy.decide(QState(q, 0, 1), 1, random.Random(123))
    assert window == 2 and (state.previous, state.window) == (1, 2)   # argmax of row s = 1

    class Always:
        """A generator that always explores and always draws window 3."""

        def random(self):
            return 0.0

        def randrange(self, n):
            return n - 1

    assert QLearningWindow(window_max=3, epsilon=0.5).decide(QState(q, 0, 1), 1, Always())[0] == 3


# ---- states as JSON --------------------------------------------------------------------------------------

def test_every_state_round_trips_through_json():
    online = measured(OnlineWindow(), [(2, 4), (4, 4)], draft_ms=3.0, verify_ms=21.5)
    states = [FSMState(3), CacheFSMState(2, (1, 5, 9)), HFState(6), online,
              QState(((0.0, 1.5), (2.0, 3.25)), 1, 0), outcome(1, 3, tokens=(4, 5))]
    for state in states:
        assert type(state).from_json(state.to_json()) == state
    with pytest.raises(ValueError, match="no fields"):
        FSMState.from_json('{"window": 2, "gamma": 3}')


# ---- the wrapper -------------------------------------------------------------------------------------------

def state_of(req: SpecRequest) -> RequestState:
    return RequestState(req, frozenset(), torch.device("cpu"))


def test_the_policy_leaves_pinned_plain_and_tree_requests_as_they_asked():
    policy = WindowPolicy(HFWindow(window_max=2))
    tree = TreeShape(3, 2, 6)
    assert policy.choose(state_of(request(window=6, pinned=True)), 1) == Speculation(6)   # pinned above the bound too
    assert policy.choose(state_of(request(draft=NO_DRAFT)), 1) == PLAIN
    assert policy.choose(state_of(request(window=0, tree=tree)), 1) == Speculation(0, tree)
    assert policy.states == {}
    assert policy.choose(state_of(request(window=6)), 1) == Speculation(2)                # unpinned: bounded


def test_the_policy_never_exceeds_window_max():
    class Greedy:
        window_max = 3

        def start(self, request):
            return FSMState(99)

        def update(self, state, outcome):
            return state

        def decide(self, state, batch_size, rng):
            return state.window, state

    assert WindowPolicy(Greedy()).choose(state_of(request()), 1) == Speculation(3)


def test_the_policy_runs_a_trace_through_the_scheduler_types_and_drops_finished_requests():
    policy = WindowPolicy(CacheFSMWindow(window_max=4))
    rs = state_of(request(window=2, prompt=(10, 11), max_tokens=9))
    # Step 1: γ = 2, both accepted (10 is in the prompt) + bonus 30: +1 +1 → 4.
    assert policy.choose(rs, 1) == Speculation(2)
    rs.advance(StepResult(2, 2, [0, 1], [10, 20, 30], 2))
    policy.observe(record(step(2, 2)))
    assert policy.states["r"] == CacheFSMState(4, (10, 11, 20, 30))
    # Step 2: γ = 4, one accepted (20, cached last step): +1, saturating at 4.
    assert policy.choose(rs, 1) == Speculation(4)
    rs.advance(StepResult(4, 1, [0], [20, 40], 4))
    policy.observe(record(step(1, 4)))
    assert "r" in policy.states and policy.states["r"].window == 4
    rs.advance(StepResult(4, 3, [0, 1, 2], [1, 2, 3, 4], 4))   # 9 tokens: max_tokens reached
    assert rs.done
    policy.observe(record())                             # the next step: the finished request's state goes
    assert policy.states == {}


def test_every_named_policy_builds_and_the_config_rejects_unknown_ones():
    from specserve.cluster.config import AppConfig
    from specserve.policies.registry import POLICIES, build_policy

    for name in POLICIES:
        policy = build_policy(name)
        assert callable(policy.choose) and callable(policy.observe), name
        assert AppConfig(policy=name).policy == name
    assert build_policy("online") is not build_policy("online")   # state is per replica
    with pytest.raises(ValueError, match="unknown policy 'nope'"):
        AppConfig(policy="nope")


# ---- warm start from the cluster's prior ------------------------------------------------------------

def test_a_prior_counts_as_pseudo_steps_in_alpha():
    assert estimate_alpha([], 0.95) is None
    assert estimate_alpha([], 0.95, prior=(0.8, 3)) == pytest.approx(0.8)
    # One failed step of γ = 4 beside a prior of α0 = 0.8 over 3 pseudo-steps: 2.4 / (2.4 + 0.6 + 1).
    assert estimate_alpha([(0, 4)], 0.95, prior=(0.8, 3)) == pytest.approx(2.4 / 4.0)


def test_online_with_the_clusters_prior_keeps_drafting_after_an_unlucky_first_step():
    rule = OnlineWindow(window_max=8, history_steps=6, default_alpha=None)   # cold: Eq. 2 alone
    costs = dict(draft_ms=0.4, verify_ms=20.0)
    cold = rule.start(request(window=4))
    warm = rule.start(replace(request(window=4), prior_alpha=0.9))
    for n, g in [(0, 4), (0, 2)]:     # two failed steps at two sizes (so the cost fit exists)
        cold = rule.update(cold, outcome(n, g, **costs))
        warm = rule.update(warm, outcome(n, g, **costs))
    # Cold, α̂ = 0 and γ = 0 wins; warm, α̂ = 2.7 / (2.7 + 0.3 + 2) = 0.54 and drafting still pays.
    assert rule.decide(cold, 1, RNG)[0] == 0
    assert rule.decide(warm, 1, RNG)[0] > 0
    assert OnlineState.from_json(warm.to_json()) == warm


def test_online_without_a_cluster_prior_counts_the_default_one():
    rule = OnlineWindow(window_max=8, history_steps=6)
    state = rule.start(request(window=4))
    assert state.prior_alpha == 0.5          # the default, since the request brought none
    assert rule.start(replace(request(window=4), prior_alpha=0.8)).prior_alpha == 0.8
    for n, g in [(0, 4), (0, 2), (0, 4)]:    # three misses in a row, cheap drafting (prompt lookup)
        state = rule.update(state, outcome(n, g, draft_ms=0.1 * g, verify_ms=20.0))
    # α̂ = 1.5 / (1.5 + 1.5 + 3) = 0.25 instead of Eq. 2's 0, and the request keeps drafting:
    # a = 0.1 ms, b flat at 20: G(0) = 1/20 = .0500, G(2) = 1.3125/20.2 = .0650, G(3) = 1.3281/20.3 = .0654,
    # G(4) = 1.3320/20.4 = .0653 (E(γ) gains 0.25^γ, less than 0.1 ms buys after γ = 3).
    assert estimate_alpha(state.outcomes, rule.alpha_max, (0.5, 3)) == pytest.approx(0.25)
    assert rule.decide(state, 1, RNG)[0] == 3
