"""What a TABED ensemble's request leaves to the cluster, and what a request brings back: the names,
their bounds, and the checks on both (``replicas/drafts/ensemble_carry.py``)."""

import math

import pytest

from specserve.replicas.drafts.ensemble_carry import (
    ENDING_TOKENS,
    MAX_CANDIDATES,
    candidates_of,
    cluster_sums,
    ending_of,
    hit_rates,
    prefix,
    released_counts,
    session_counts,
    valid_counts,
    valid_ending,
)

P = prefix([0, 1], 10)   # full + last-turn at grid 10: 11 candidates


def test_names_say_the_views_and_the_grid_and_a_candidate_that_never_hit_is_left_out():
    assert P == "tabed_01_g10_"
    # The simplex grid's points: C(grid + m - 1, m - 1), so 11 for two views, 286 for four.
    assert candidates_of(P) == 11 and candidates_of(prefix([0, 1, 2, 3], 10)) == 286 <= MAX_CANDIDATES
    assert session_counts(P, 12, [9, 0, 11]) == {"tabed_01_g10_positions": 12, "tabed_01_g10_hits_0": 9,
                                                 "tabed_01_g10_hits_2": 11}
    assert session_counts(P, 0, [0, 0]) == {}


@pytest.mark.parametrize("counts", [
    {"tabed_01_g10_positions": 4, "q_n_1_1": 1},                       # a name of another pattern
    {"tabed_01_g10_positions": 4, "tabed_01_g10_hits_11": 1},          # j beyond two views' 11 candidates
    {"tabed_01_g10_positions": 4, "tabed_01_g10_hits_0": 5},           # more hits than positions
    {"tabed_01_g10_hits_0": 1},                                        # hits without positions
    {"tabed_01_g10_positions": 4, "tabed_01_g10_hits_0": -1},
    {"tabed_01_g10_positions": 4.0},                                   # a float is not a count
    {"tabed_01_g10_positions": True},
    {"tabed_01_g10_positions": 4, "tabed_02_g10_positions": 4},        # two candidate sets
    {"tabed_01_g300_positions": 4},                                    # a grid beyond the pattern
    {"tabed_012345_g10_positions": 4},                                 # 3003 candidates: too many to carry
    {"tabed_01_g10_positions": 1 << 40},
    {f"tabed_01_g10_x{i}": 1 for i in range(400)},
    "tabed_01_g10_positions", None, {},
])
def test_a_bad_session_count_drops_the_sessions_counts_whole(counts):
    assert valid_counts(counts) == {}


def test_a_release_reply_keeps_the_valid_counts_of_the_sessions_asked():
    good = {"tabed_01_g10_positions": 4, "tabed_01_g10_hits_3": 4}
    reply = {"a": good, "b": {"tabed_01_g10_hits_3": 9}, "c": good}
    assert released_counts(reply, ["a", "b"]) == {"a": good}           # c was not asked, b is bad
    assert released_counts(None, ["a"]) == {} and released_counts(["a"], ["a"]) == {}


def test_a_request_sends_its_draft_only_the_ensembles_part_of_its_carried_sums():
    learned = {"version": 3, "sums": {"adt_requests": 2.0, "tabed_01_g10_positions": 8.0}}
    assert cluster_sums(learned) == {"tabed_01_g10_positions": 8.0}
    assert cluster_sums({"version": 3, "sums": {"adt_requests": 2.0}}) is None
    assert cluster_sums(None) is None and cluster_sums({"sums": "x"}) is None


def test_hit_rates_are_hits_over_positions_and_other_sets_are_not_read():
    # Decayed sums are floats: 6 of 8 positions hit for j = 1, none for the absent j = 0.
    sums = {"tabed_01_g10_positions": 8.0, "tabed_01_g10_hits_1": 6.0, "tabed_02_g10_hits_1": 99.0}
    rates, positions = hit_rates(sums, P, 11)
    assert positions == 8.0 and rates[1] == 0.75 and rates[0] == 0.0 and len(rates) == 11
    # Hits above positions by the snapshot's rounding (4 decimals) still read, capped at 1.
    assert hit_rates({"tabed_01_g10_positions": 1.0, "tabed_01_g10_hits_0": 1.0001}, P, 11)[0][0] == 1.0


@pytest.mark.parametrize("sums", [
    {"tabed_01_g10_positions": 8.0, "tabed_01_g10_hits_1": math.nan},
    {"tabed_01_g10_positions": math.inf},
    {"tabed_01_g10_positions": 8.0, "tabed_01_g10_hits_1": -1.0},
    {"tabed_01_g10_positions": 8.0, "tabed_01_g10_hits_11": 1.0},      # another grid's candidate count
    {"tabed_01_g10_positions": 8.0, "tabed_01_g10_hits_1": 9.0},
    {"tabed_01_g10_positions": 8.0, "tabed_01_g10_hits_¹": 1.0},
    {"tabed_01_g10_positions": 0.0},
    {"tabed_01_g10_positions": "8"},
    {"tabed_02_g10_positions": 8.0},                                   # only another set's
    {}, None, [],
])
def test_bad_cluster_sums_give_no_rates_and_raise_nothing(sums):
    assert hit_rates(sums, P, 11) is None


def test_a_releases_ending_is_the_contexts_length_and_last_tokens_and_is_checked():
    context = list(range(200))
    assert ending_of(context) == (200, context[-ENDING_TOKENS:]) and ending_of([3, 4]) == (2, [3, 4])
    assert valid_ending(ending_of(context)) == (200, context[-ENDING_TOKENS:])
    assert valid_ending([2, (3, 1 << 40)]) == (2, [3, 1 << 40])   # an image token's virtual id is a token
    for bad in (None, "x", (5,), (5, [1], 3), (0, [1]), (2, [1, 2, 3]), (-1, [1]), (True, [1]), (5, []),
                (5, [1.0]), (5, [-1]), (5, ["a"]), (1 << 40, [1]), (100, list(range(ENDING_TOKENS + 1)))):
        assert valid_ending(bad) is None, bad
