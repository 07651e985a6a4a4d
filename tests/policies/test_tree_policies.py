"""Tree policies on literal traces: the pure rules (SAGE, ADT-Tree, EAGLE-2 depth),
the draft's SAGE tree builder on literal distributions, the wrapper that makes a rule the
scheduler's Policy, then each policy end to end on tiny models. Records are the real StepRecord /
RequestStep of replicas/step.py."""

import asyncio
import math
import random

import pytest
import torch

from equality import assert_greedy_equal
from specserve.policies.adt_tree import ADTState, ADTTree
from specserve.policies.eagle2_depth_tree import Eagle2DepthState, Eagle2DepthTree
from specserve.policies.registry import POLICIES, TREE_POLICY_NAMES, WINDOW_POLICY_NAMES, build_policy
from specserve.policies.sage_tree import SageState, SageTree, sage_confidence
from specserve.policies.tree import TreeOutcome, TreePolicy
from specserve.replicas.drafts.draft_lm import DraftLM
from specserve.replicas.drafts.tree_growth import TreeGrowth, decayed_width
from specserve.replicas.model_worker import InlineWorker
from specserve.replicas.sampling import SamplingParams
from specserve.replicas.request import NO_DRAFT, RequestState, SpecRequest
from specserve.replicas.scheduler import Scheduler
from specserve.replicas.step import PLAIN, RequestStep, Speculation, StepRecord, StepResult, TreeShape
from specserve.replicas.step_loop import StepLoop
from specserve.replicas.target import Target
from specserve.replicas.engine import in_process_server, speculative_generate
from tiny_models import perturbed, tiny_model

RNG = random.Random(0)
START = TreeShape(4, 2, 8)   # the tree the benchmark's tree policies start from
ONE_HOT = (1.0,) + (0.0,) * 15          # a certain draft: H = 0, α = 1
UNIFORM = (0.1,) * 10 + (0.0,) * 6      # top-10 equally likely: H = log 10, α = 0


def request(tree=START, window: int = 0, pinned: bool = False, draft: str = "d", request_id: str = "r",
            max_tokens: int = 200) -> SpecRequest:
    return SpecRequest([1, 2, 3], max_tokens, SamplingParams(), draft, window, tree, request_id, pinned)


def tstep(accepted: int, depth: int, nodes: int | None = None, request_id: str = "r", root_probs=None,
          asked: TreeShape | None = None) -> RequestStep:
    """One request's tree step: ``depth`` is the longest path the draft offered."""
    asked = asked or TreeShape(max(depth, 1), 2, 8)
    return RequestStep(request_id, "d", Speculation(0, asked), depth if nodes is None else nodes, accepted, depth,
                       None, root_probs)


def record(*steps: RequestStep, draft_ms: float = 0.0, verify_ms: float = 20.0,
           forward_tokens: int | None = None) -> StepRecord:
    tokens = forward_tokens if forward_tokens is not None else sum(1 + s.proposed for s in steps)
    return StepRecord(len(steps), tokens, 0, draft_ms, verify_ms, 0.0, tuple(steps))


def outcome(accepted: int, depth: int, nodes: int | None = None, root_probs=None, **costs) -> TreeOutcome:
    rec = record(tstep(accepted, depth, nodes, root_probs=root_probs), **costs)
    return TreeOutcome.of(rec, rec.requests[0])


# ---- what a tree rule learns from -----------------------------------------------------------------

def test_outcome_reads_the_request_its_tree_and_the_rest_of_its_batch():
    mine = tstep(2, 3, nodes=6, root_probs=(0.7, 0.2), asked=TreeShape(3, 2, 6))
    other = RequestStep("s", "d", Speculation(4), 4, 1, 4, None)
    o = TreeOutcome.of(record(mine, other, draft_ms=12.0, verify_ms=30.0), mine)
    # forward = (1 + 6) + (1 + 4) = 12 tokens; the other request emitted n + 1 = 2 and was offered 4.
    assert (o.asked_depth, o.depth, o.nodes, o.accepted, o.root_probs) == (3, 3, 6, 2, (0.7, 0.2))
    assert (o.forward_tokens, o.others_depth, o.others_emitted, o.batch_size) == (12, 4, 2, 2)
    assert TreeOutcome.from_json(o.to_json()) == o


def test_registry_names_tell_window_and_tree_policies_apart():
    assert set(WINDOW_POLICY_NAMES) | set(TREE_POLICY_NAMES) <= set(POLICIES)
    assert not set(WINDOW_POLICY_NAMES) & set(TREE_POLICY_NAMES)
    assert TREE_POLICY_NAMES == ("static-tree", "sage", "adt-tree", "adt-tree-vertical", "adt-tree-random",
                                 "eagle2-depth")
    assert build_policy("sage") is not build_policy("sage")   # state is per replica


# ---- SAGE: the entropy -----------------------------------------------------------------------------

def test_sage_confidence_is_one_minus_normalised_top_k_entropy():
    assert sage_confidence(ONE_HOT, 10) == 1.0
    assert sage_confidence(UNIFORM, 10) == pytest.approx(0.0)
    # (0.6, 0.2, 0.2): H = −(0.6 ln 0.6 + 2 · 0.2 ln 0.2) = 0.95027, / ln 3 = 0.86497 → α = 0.13503.
    assert sage_confidence((0.6, 0.2, 0.2), 3) == pytest.approx(0.13503, abs=1e-5)
    # Eq. 7 renormalises the top-k: the same shape with a third of the mass gives the same α, and
    # probabilities past the top k do not count.
    assert sage_confidence((0.3, 0.1, 0.1, 0.05), 3) == pytest.approx(0.13503, abs=1e-5)


# ---- SAGE: the rule --------------------------------------------------------------------------------

def test_sage_first_tree_is_the_requests_then_depth_and_width_follow_the_entropy():
    rule = SageTree()
    state = rule.start(request())
    # App. A.1: the static tree first.
    assert rule.decide(state, 1, RNG)[0] == START
    # n = 2 keeps the history's mean within [2, 3], so D_max stays 8 and only α moves the shape.
    certain = rule.update(state, outcome(2, 4, root_probs=ONE_HOT))
    unsure = rule.update(state, outcome(2, 4, root_probs=UNIFORM))
    # α = 1: D = 3 + 1·(8 − 3) = 8, W = 2 + 0·8 = 2: deep and narrow. Budget: the request's 8.
    assert rule.decide(certain, 1, RNG)[0] == TreeShape(8, 2, 8, width_decay=True, threshold=0.1)
    # α = 0: D = 3, W = 2 + 1·(10 − 2) = 10: shallow and wide.
    assert rule.decide(unsure, 1, RNG)[0] == TreeShape(3, 10, 8, width_decay=True, threshold=0.1)
    # α = 0.5 (Alg. 1's initial value): D = 5.5 and W = 6, rounded half up: (6, 6).
    assert rule.shape(SageState((4, 2, 8), max_depth=8, confidence=0.5, steps=1)) == \
        TreeShape(6, 6, 8, width_decay=True, threshold=0.1)
    # The paper's N_max when asked for.
    assert SageTree(node_budget=64).shape(certain).budget == 64


def test_sage_hysteresis_moves_max_depth_only_outside_the_band():
    rule = SageTree()   # window 10, thresholds 2 and 3, D_max from 8, ceiling 12
    state = rule.start(request())
    trace = [5, 5, 5, 5, 5, 0, 0, 0, 0, 0, 0, 0, 0, 0, 0]
    max_depths = []
    for n in trace:
        state = rule.update(state, outcome(n, 8))
        max_depths.append(state.max_depth)
    # Means of the last ≤10 n: 5 ×5 (> 3: +1 each, saturating at the ceiling 12), then
    # 25/6, 25/7, 25/8 (> 3: stay at 12), 25/9, 25/10 (in [2, 3]: hold), 20/10 = 2 (not below 2:
    # hold), 15/10, 10/10, 5/10, 0 (< 2: −1 each).
    assert max_depths == [9, 10, 11, 12, 12, 12, 12, 12, 12, 12, 12, 11, 10, 9, 8]
    # With no root probabilities reported α stays 0.5: D = round(3 + 0.5 · (8 − 3)) = 6.
    assert rule.decide(state, 1, RNG)[0].depth == 6
    for _ in range(10):
        state = rule.update(state, outcome(0, 3))
    assert state.max_depth == 3                      # never below D_min
    assert rule.decide(state, 1, RNG)[0].depth == 3
    # A step whose draft offered nothing teaches nothing (but α still comes from its probabilities).
    quiet = rule.update(state, outcome(0, 0))
    assert (quiet.max_depth, quiet.accepted) == (state.max_depth, state.accepted)


def test_sage_state_round_trips_through_json():
    rule = SageTree()
    state = rule.update(rule.start(request()), outcome(3, 4, root_probs=(0.6, 0.2, 0.2)))
    assert SageState.from_json(state.to_json()) == state
    with pytest.raises(ValueError, match="no fields"):
        SageState.from_json('{"start_tree": [4, 2, 8], "max_depth": 8, "bogus": 1}')


# ---- SAGE: the draft's tree builder ----------------------------------------------------------------

def logits_of(*rows: list[float]) -> torch.Tensor:
    """Logits whose softmax is each row (rows sum to 1; zeros become a negligible probability)."""
    return torch.tensor([[math.log(max(p, 1e-12)) for p in row] for row in rows])


ROOT = [0.5, 0.3, 0.1, 0.05, 0.04, 0.01, 0.0, 0.0]
CHILD = [0.6, 0.25, 0.1, 0.05, 0.0, 0.0, 0.0, 0.0]


def test_width_decay_is_eq_12_rounded_to_at_least_one():
    assert decayed_width(10, 1, 0.2) == 10                # level 1: all W
    assert decayed_width(10, 2, 0.9) == 7                 # 10 · 1/2 · 1.4 = 7
    assert decayed_width(4, 2, 0.3) == 2                  # 4 · 1/2 · 0.8 = 1.6 → 2
    assert decayed_width(2, 8, 1.0) == 1                  # 2 · 1/8 · 1.5 = 0.375 → at least 1


def test_sage_builder_applies_width_decay_threshold_and_budget():
    growth = TreeGrowth(TreeShape(2, 4, 20, width_decay=True, threshold=0.1))
    growth.grow(logits_of(ROOT))
    # Level 1: the top W = 4 are 0.5, 0.3, 0.1, 0.05; θ_1 = 0.1 · 1/2 = 0.05 drops 0.05 (not above).
    assert (growth.tokens, growth.parents) == ([0, 1, 2], [-1, -1, -1])
    assert growth.root_probs[:6] == pytest.approx([0.5, 0.3, 0.1, 0.05, 0.04, 0.01])
    growth.grow(logits_of(CHILD, CHILD, CHILD))
    # Level 2 widths (Eq. 12): 4/2 · (0.5 + P_parent) = 2 (P 0.5), 1.6 → 2 (P 0.3), 1.2 → 1 (P 0.1).
    # θ_2 = 0.1: paths 0.5·0.6 = 0.3, 0.3·0.6 = 0.18, 0.5·0.25 = 0.125 pass, in that order;
    # 0.3·0.25 = 0.075 and 0.1·0.6 = 0.06 do not. The level is not cut to W = 4 nodes: only N is.
    assert (growth.tokens[3:], growth.parents[3:]) == ([0, 0, 1], [0, 1, 0])
    proposal = growth.proposal()
    assert proposal.token_probs == pytest.approx([0.5, 0.3, 0.1, 0.6, 0.6, 0.25])

    small = TreeGrowth(TreeShape(2, 4, 4, width_decay=True, threshold=0.1))
    small.grow(logits_of(ROOT))
    small.grow(logits_of(CHILD, CHILD, CHILD))
    # Budget 4: the level keeps its most probable candidate only.
    assert (small.tokens, small.parents) == ([0, 1, 2, 0], [-1, -1, -1, 0])


def test_default_tree_shape_keeps_the_eagle2_level_of_k_best():
    growth = TreeGrowth(TreeShape(2, 4, 20))
    growth.grow(logits_of(ROOT))
    growth.grow(logits_of(CHILD, CHILD, CHILD, CHILD))
    # No threshold: all 4 at level 1; level 2 keeps the 4 best of its 16 candidates, the paths
    # 0.5·0.6 = 0.3, 0.3·0.6 = 0.18, 0.5·0.25 = 0.125 and 0.3·0.25 = 0.075 (then 0.1·0.6 = 0.06).
    assert growth.tokens == [0, 1, 2, 3, 0, 0, 1, 1]
    assert growth.parents == [-1, -1, -1, -1, 0, 1, 0, 1]


def test_what_each_node_sees_is_itself_and_its_ancestors():
    from specserve.replicas.model.tree_attention import ancestor_matrix

    growth = TreeGrowth(TreeShape(4, 3, 11))
    growth.grow(logits_of(ROOT))
    assert growth.sees(0).tolist() == torch.eye(3, dtype=torch.bool).tolist()
    growth.grow(logits_of(CHILD, CHILD, CHILD))
    growth.grow(logits_of(ROOT, CHILD, ROOT))
    first = len(growth.tokens) - 3
    assert torch.equal(growth.sees(first), ancestor_matrix(growth.parents)[first:])
    assert torch.equal(growth.sees(0), ancestor_matrix(growth.parents))   # every row, asked again


def test_a_fully_pruned_level_ends_the_tree():
    growth = TreeGrowth(TreeShape(3, 2, 20, width_decay=True, threshold=0.9))
    growth.grow(logits_of(ROOT))   # θ_1 = 0.3: only 0.5 passes
    assert growth.tokens == [0] and growth.more_levels(0)
    growth.grow(logits_of(CHILD))  # θ_2 = 0.6: 0.5 · 0.6 = 0.3 does not
    assert growth.frontier == [] and not growth.growing and not growth.more_levels(1)


@pytest.fixture(scope="module")
def models():
    target = tiny_model("llama", seed=0)
    return target, perturbed(target, seed=1)


PROMPT = list(range(20, 50))
NEW_TOKENS = 40
GREEDY = SamplingParams()


def test_sage_shaped_trees_are_lossless_and_differ_from_eagle2_trees(models):
    """Below the scheduler: the draft grows SAGE trees, the target verifies them, and greedy
    output equals plain decoding's."""
    target_model, draft_model = models
    expected = speculative_generate(Target(target_model), None, PROMPT, NEW_TOKENS, GREEDY).token_ids
    for shape in (TreeShape(6, 6, 16, width_decay=True, threshold=0.1), TreeShape(3, 10, 16, width_decay=True, threshold=0.1)):
        target, draft = Target(target_model), DraftLM("near", draft_model)
        context, out, accepted, sizes = list(PROMPT), [], 0, set()
        while len(out) < NEW_TOKENS:
            proposal = draft.propose_tree(context, shape)
            assert proposal.root_probs is not None and len(proposal.root_probs) == 16
            sizes.add(len(proposal))
            result = target.verify_one(context, proposal, GREEDY)
            accepted += result.accepted
            out += result.emitted_tokens
            context += result.emitted_tokens
        assert_greedy_equal(target_model, PROMPT, out[:NEW_TOKENS], expected, str(shape))
        assert accepted > 0, f"{shape}: nothing accepted, so equality proves little"
        # θ_l prunes differently at different roots, so the trees are not all of one size.
        assert len(sizes) > 1, sizes


# ---- ADT-Tree ---------------------------------------------------------------------------------------

def test_adt_tree_moves_by_the_bisection_rule_within_its_bounds():
    rule = ADTTree()   # β = 1, l_d = 1, l_k = 3, depth 1..9, top-k 4..13 (the paper's open intervals)
    state = rule.start(request(TreeShape(3, 10, 40)))
    assert rule.decide(state, 1, RNG)[0] == TreeShape(3, 10, 40)
    # (n, depth offered) → α = n / d̂; Eq. 2: α ≥ 1 → (d + 1, k − 3), else (d − 1, k + 3).
    trace = [(1, 3),   # α = 1/3 < 1   → (2, 13)
             (0, 2),   # α = 0         → (1, 16): at depth 1 only the budget (40) bounds top-k
             (0, 1),   # α = 0         → depth 0 clamps to 1, top-k 19
             (1, 1),   # α = 1         → (2, 16) → top-k back within 13 at depth 2
             (2, 2),   # α = 1         → (3, 10)
             (3, 3),   # α = 1         → (4, 7)
             (4, 4),   # α = 1         → (5, 4)
             (5, 5),   # α = 1         → (6, 1) → top-k clamps to 4
             (0, 0),   # nothing offered: no change
             (2, 6)]   # α = 1/3       → (5, 7)
    shapes = []
    for n, d in trace:
        state = rule.update(state, outcome(n, d))
        shapes.append(rule.decide(state, 1, RNG)[0])
    assert [(s.depth, s.top_k) for s in shapes] == [
        (2, 13), (1, 16), (1, 19), (2, 13), (3, 10), (4, 7), (5, 4), (6, 4), (6, 4), (5, 7)]
    assert all(s.budget == 40 for s in shapes)        # N is not adapted
    # Full acceptance forever: depth saturates at 9, top-k at 4.
    for _ in range(12):
        state = rule.update(state, outcome(state.depth, state.depth))
    assert (state.depth, state.top_k) == (9, 4)
    assert ADTState.from_json(state.to_json()) == state


def test_adt_tree_starts_from_the_requests_tree_within_bounds():
    # The benchmark's start tree has top-2, below the paper's k_min: the first tree is brought in.
    assert ADTTree().decide(ADTTree().start(request(START)), 1, RNG)[0] == TreeShape(4, 4, 8)


def grid_request(grid: int = 4, tree=TreeShape(3, 7, 40)) -> SpecRequest:
    return SpecRequest([1], 64, SamplingParams(), "d", 0, tree, "r", grid=grid)


def walk(rule: ADTTree, trace: list[tuple[int, int]], grid: int = 4) -> list[tuple[int, int]]:
    """The (depth, top-k) each step asks over a trace of (accepted n, depth offered)."""
    state, asked = rule.start(grid_request(grid)), []
    for n, d in trace:
        shape, state = rule.decide(state, 1, RNG)
        asked.append((shape.depth, shape.top_k))
        state = rule.update(state, outcome(n, d))
    return asked


def test_adt_tree_horizontal_repeat_on_a_grid_is_the_text_walk():
    trace = [(3, 3), (0, 4), (1, 3), (3, 3), (0, 4), (2, 2), (0, 3)]
    assert walk(ADTTree(), trace) == walk(ADTTree(), trace, grid=0)


def test_adt_tree_vertical_repeat_starts_from_the_tree_above_moved_by_the_last_status():
    rule = ADTTree(init="vertical")
    # Grid of 4 per row. Step 1 covers positions 0-3 (n = 3: the whole first row) with (3, 7);
    # α = 1: positive. Step 2 predicts (1, 0): the tree above is (3, 7), moved +1/-3 -> (4, 4).
    # Step 2 covers (1, 0) only (n = 0, α = 0: negative); step 3 predicts (1, 1): above (3, 7),
    # moved -1/+3 -> (2, 10).
    assert walk(rule, [(3, 3), (0, 4), (0, 2)]) == [(3, 7), (4, 4), (2, 10)]
    # Horizontal from the same trace: each tree is the previous one moved.
    assert walk(ADTTree(), [(3, 3), (0, 4), (0, 2)]) == [(3, 7), (4, 4), (3, 7)]


def test_adt_tree_vertical_repeat_reads_each_columns_own_tree():
    rule = ADTTree(init="vertical")
    state = rule.start(grid_request(grid=3))
    for n, d in [(0, 3), (0, 2), (0, 1)]:   # row 0: one token a step, each step's own tree
        state = rule.decide(state, 1, RNG)[1]
        state = rule.update(state, outcome(n, d))
    assert [c for c in state.covered] == [(3, 7), (2, 10), (1, 13)] and state.position == 3
    shape, state = rule.decide(state, 1, RNG)    # (1, 0): above (3, 7), last status negative
    assert (shape.depth, shape.top_k) == (2, 10)
    assert ADTState.from_json(state.to_json()) == state


def test_adt_tree_random_initialisation_draws_within_the_bounds():
    rule = ADTTree(init="random")
    asked = walk(rule, [(1, 3)] * 30)   # every tree a draw, moved by the last status (negative)
    # (at depth 1 the top-k may pass its bound, up to the node budget: §IV-B)
    assert all(1 <= d <= 9 and 4 <= k <= (13 if d > 1 else 40) for d, k in asked) and len(set(asked)) > 3
    with pytest.raises(ValueError):
        ADTTree(init="diagonal")


# ---- EAGLE-2 adaptive depth -----------------------------------------------------------------------
# App. C.4 of "A Drop-in Solution for On-the-Fly Adaptation of Speculative Decoding in Large Language
# Models".

def test_eagle2_depth_maximises_eq_1_over_the_depth():
    rule = Eagle2DepthTree(depth_max=6)
    state = rule.start(request(START))
    # Unmeasured: the request's depth, then depth 1 (the fewest nodes), so two forward sizes are seen.
    shape, state = rule.decide(state, 1, RNG)
    assert shape == START
    state = rule.update(state, outcome(1, 4, nodes=8, draft_ms=8.0, verify_ms=20.0))   # 9 tokens
    shape, state = rule.decide(state, 1, RNG)
    assert shape == TreeShape(1, 2, 8)
    state = rule.update(state, outcome(1, 1, nodes=2, draft_ms=2.0, verify_ms=14.0))   # 3 tokens
    # Measured: α̂ = Eq. 2 over (1, 4), (1, 1) = 2 / (2 + 1) = 2/3; a = (8 + 2) / (4 + 1) = 2 ms per
    # level; b(t) = 11 + t ms (through (3, 14) and (9, 20)); nodes(d) = min(8, 2d).
    #   G(0) = 1 / 12                       = 0.0833
    #   G(1) = 1.6667 / (2 + 14)            = 0.1042
    #   G(2) = 2.1111 / (4 + 16)            = 0.1056   ← the best
    #   G(3) = 2.4074 / (6 + 18)            = 0.1003
    #   G(4) = 2.6049 / (8 + 20)            = 0.0930
    shape, state = rule.decide(state, 1, RNG)
    assert shape == TreeShape(2, 2, 8)
    assert [round(rule.objective(state, 2 / 3, d), 4) for d in range(5)] == [0.0833, 0.1042, 0.1056, 0.1003, 0.093]
    assert Eagle2DepthState.from_json(state.to_json()) == state


def test_eagle2_depth_goes_deep_when_alpha_is_high_and_plain_when_it_is_nil():
    rule = Eagle2DepthTree(depth_max=6, explore_every=3)
    # Flat verification (20 ms at 3 and 9 tokens), free drafting, every level accepted: α̂ = 0.95
    # (the cap), and G grows with d, so the deepest tree.
    high = rule.start(request(START))
    for n, d, nodes in [(4, 4, 8), (1, 1, 2)]:
        high = rule.update(high, outcome(n, d, nodes=nodes, verify_ms=20.0))
    assert rule.decide(high, 1, RNG)[0] == TreeShape(6, 2, 8)
    # Nothing ever accepted: α̂ = 0, E(d) = 1 for every d, so depth 0 (a plain step) is cheapest...
    low = rule.start(request(START))
    for n, d, nodes, ms in [(0, 4, 8, 20.0), (0, 1, 2, 14.0)]:
        low = rule.update(low, outcome(n, d, nodes=nodes, draft_ms=2.0 * d, verify_ms=ms))
    shapes = []
    for _ in range(3):
        shape, low = rule.decide(low, 1, RNG)
        shapes.append(shape)
        low = rule.update(low, TreeOutcome(asked_depth=0, depth=0, nodes=0, accepted=0, forward_tokens=1, verify_ms=12.0))
    # ...until explore_every = 3 plain steps in a row: then a depth-1 tree looks at α̂ again.
    assert shapes == [None, None, TreeShape(1, 2, 8)]


# ---- the wrapper --------------------------------------------------------------------------------------

def state_of(req: SpecRequest) -> RequestState:
    return RequestState(req, frozenset(), torch.device("cpu"))


def test_tree_policy_adapts_only_unpinned_tree_requests_and_forgets_finished_ones():
    policy = TreePolicy(ADTTree())
    chain = state_of(request(tree=None, window=3, request_id="chain"))
    pinned = state_of(request(TreeShape(2, 2, 4), pinned=True, request_id="pinned"))
    plain = state_of(request(draft=NO_DRAFT, request_id="plain"))
    # A chain request is the window policies' business: it gets exactly what it asked for.
    assert policy.choose(chain, 3) == Speculation(3)
    assert policy.choose(pinned, 3) == Speculation(0, TreeShape(2, 2, 4))
    assert policy.choose(plain, 3) == PLAIN
    assert policy.states == {}

    rs = state_of(request(TreeShape(4, 4, 8), max_tokens=6))
    assert policy.choose(rs, 1) == Speculation(0, TreeShape(4, 4, 8))
    rs.advance(StepResult(8, 4, [0, 1, 2, 3], [5, 6, 7, 8, 9], 4))
    policy.observe(record(tstep(4, 4, nodes=8)))
    assert policy.states["r"] == ADTState(5, 4, 8, steps=1)   # α = 1: deeper, top-k at its floor
    assert policy.choose(rs, 1) == Speculation(0, TreeShape(5, 4, 8))
    rs.advance(StepResult(8, 0, [], [10], 5))           # 6 tokens: max_tokens reached
    policy.observe(record(tstep(0, 5, nodes=8)))
    assert rs.done and policy.states == {}


# ---- end to end: the in-process engine --------------------------------------------------------------

def run_engine(target_model, draft_model, policy, max_tokens: int) -> tuple[list[int], list[StepRecord]]:
    """One tree request through the scheduler and step loop, as ``replicas.engine.run_batch`` runs
    it; returns the tokens and the step records (which run_batch does not expose)."""
    scheduler = Scheduler(Target(target_model), policy)
    loop = StepLoop(scheduler, {"near": in_process_server("near", DraftLM("near", draft_model))}, InlineWorker())
    state = loop.add(SpecRequest(list(PROMPT), max_tokens, GREEDY, "near", 0, START, "r"))
    asyncio.run(loop.run_until_idle())
    return state.out, list(scheduler.records)


def uncapped_shapes(records: list[StepRecord], max_tokens: int) -> list[TreeShape]:
    """The trees the policy asked, leaving out steps whose depth the request's remaining room may
    have cut (the scheduler's cap), so that a difference is the policy's own."""
    shapes, emitted = [], 0
    for rec in records:
        step = next((s for s in rec.requests if s.request_id == "r"), None)
        if step is None:   # a step that only prefilled
            continue
        room = max_tokens - emitted - 1
        if step.asked.tree is not None and step.asked.tree.depth < room:
            shapes.append(step.asked.tree)
        emitted += step.accepted + 1
    return shapes


@pytest.mark.parametrize("name", ["sage", "adt-tree", "eagle2-depth"])
def test_each_tree_policy_keeps_greedy_output_and_varies_the_tree(models, name):
    target_model, draft_model = models
    max_tokens = 60
    expected = speculative_generate(Target(target_model), None, PROMPT, max_tokens, GREEDY).token_ids
    out, records = run_engine(target_model, draft_model, build_policy(name), max_tokens)
    assert_greedy_equal(target_model, PROMPT, out, expected, name)
    assert sum(s.accepted for r in records for s in r.requests) > 0, f"{name}: nothing accepted"
    shapes = uncapped_shapes(records, max_tokens)
    assert len(set(shapes)) > 1, f"{name} used one tree only: {shapes}"


def test_sage_sees_the_drafts_entropy_and_its_builder_gets_the_sage_fields_end_to_end(models):
    target_model, draft_model = models
    _, records = run_engine(target_model, draft_model, build_policy("sage"), 40)
    steps = [s for r in records for s in r.requests]
    assert any(s.draft_root_probs for s in steps), "no step carried the draft's root probabilities"
    assert any(s.asked.tree is not None and s.asked.tree.width_decay for s in steps), \
        "the scheduler's cap dropped SAGE's width decay and threshold"
