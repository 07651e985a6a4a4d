"""TABED ensembles of a draft LM's views: the candidate weights, the last-turn view, the weights
chosen from verified tokens, greedy output equal to the target's, and the draft server built
from a config. (The sampled distribution through the mixed q: test_sampling_distribution.py.)"""

import math
import zlib

import pytest
import torch

from device_reads import reads
from equality import assert_greedy_equal
from specserve.cluster.config import DraftSpec
from specserve.replicas.drafts.draft_lm import DraftLM
from specserve.replicas.drafts.ensemble import (
    PRIOR_POSITIONS,
    EnsembleDraftLM,
    _Drafted,
    last_turn_start,
    user_turn_marker,
    weight_grid,
)
from specserve.replicas.engine import in_process_server, run_batch
from specserve.replicas.request import SpecRequest
from specserve.replicas.sampling import SamplingParams
from specserve.replicas.step import ProposeRequest
from specserve.replicas.target import Target
from tiny_models import ARCHITECTURES, DEVICE, VOCAB, perturbed, pruned_copy, tiny_model

MARKER = [7, 3]


def test_the_candidates_cover_the_simplex_equal_mix_first():
    two = weight_grid(2, 10)
    assert two.shape == (11, 2) and torch.allclose(two.sum(1), torch.ones(11))
    assert two[0].tolist() == [0.5, 0.5] and {tuple(w) for w in two[-2:].tolist()} == {(0.0, 1.0), (1.0, 0.0)}
    three = weight_grid(3, 4)
    assert three.shape == (15, 3) and torch.allclose(three.sum(1), torch.ones(15))


def test_the_last_turn_view_starts_at_the_last_user_turn():
    from specserve.replicas.model_store import load_tokenizer_and_config
    from specserve.replicas.prompt_ids import encode_chat

    tokenizer, _ = load_tokenizer_and_config()
    marker = user_turn_marker(tokenizer)
    assert tokenizer.decode(marker) == "<|im_start|>user\n"
    turns = [{"role": "user", "content": "Name a colour."}, {"role": "assistant", "content": "Blue."},
             {"role": "user", "content": "And another?"}]
    ids = encode_chat(tokenizer, turns)
    start = last_turn_start(ids, marker)
    assert tokenizer.decode(ids[start:]).startswith("<|im_start|>user\nAnd another?")
    assert last_turn_start(ids, marker, since=start + 1) is None
    assert last_turn_start([1, 2, 3], []) is None


def test_weights_follow_the_view_that_predicted_the_verified_tokens():
    draft = EnsembleDraftLM("e", tiny_model("llama", seed=1), turn_marker=MARKER, distance="kl")
    session = draft._session("s")
    assert draft.weights_for("s").tolist() == [0.5, 0.5]   # nothing verified yet: the equal mix
    # Three drafted positions: the full view put 0.6 on the token the target then verified, the
    # last-turn view nothing (all on token 50); the block's second token was rejected (the target
    # said 11, not 10), so its third position, drafted after a wrong token, does not count.
    probs = torch.tensor([[0.6, 0.0], [0.4, 1.0]])   # [tokens, views]
    positions = [_Drafted(torch.tensor([t, 50]), probs, torch.zeros(2), t) for t in (5, 10, 12)]
    positions[1] = _Drafted(torch.tensor([11, 50]), probs, torch.zeros(2), 10)
    session.pending = (4, 2, positions)
    draft._learn(session, [1, 1, 1, 2, 5, 11, 40])
    assert len(session.scores) == 2
    assert draft.weights_for("s").tolist() == [1.0, 0.0]
    for distance in ("tvd", "matches"):
        other = EnsembleDraftLM("e", tiny_model("llama", seed=1), turn_marker=MARKER, distance=distance)
        s = other._session("s")
        s.pending = (4, 2, positions)
        other._learn(s, [1, 1, 1, 2, 5, 11, 40])
        assert other.weights_for("s")[0] > other.weights_for("s")[1], distance
    # A context that does not continue the block teaches nothing; static weights never move.
    session.pending = (4, 2, positions)
    draft._learn(session, [9, 9, 9])
    assert len(session.scores) == 2
    static = EnsembleDraftLM("e", tiny_model("llama", seed=1), weights="static")
    static._session("s").pending = (4, 2, positions)
    static._learn(static._session("s"), [1, 1, 1, 2, 5, 11, 40])
    assert static.weights_for("s").tolist() == [0.5, 0.5]


def test_a_new_request_starts_from_the_replicas_prior_and_its_own_positions_decide_after():
    from specserve.replicas.drafts import ensemble

    draft = EnsembleDraftLM("e", tiny_model("llama", seed=1), turn_marker=MARKER, distance="matches")
    # Request a: the full view put 0.6 on each token the target verified (5, then 11), the last-turn
    # view all its mass on token 50: only mixes with the full view's weight above 5/6 draft them.
    full_right = torch.tensor([[0.6, 0.0], [0.4, 1.0]])   # [tokens, views]
    a = draft._session("a")
    a.pending = (4, 2, [_Drafted(torch.tensor([t, 50]), full_right, torch.zeros(2), t) for t in (5, 11)])
    draft._learn(a, [1, 1, 1, 2, 5, 11])
    assert len(draft.prior.scores) == 2
    # Request b has verified nothing: its first block takes the prior's best, not the equal mix.
    assert draft.weights_for("b")[0] > 5 / 6
    # Its own positions decide once it has some: here the last-turn view was the right one twice.
    last_right = torch.tensor([[0.0, 0.6], [1.0, 0.4]])
    b = draft._session("b")
    b.pending = (4, 2, [_Drafted(torch.tensor([t, 50]), last_right, torch.zeros(2), t) for t in (7, 8)])
    draft._learn(b, [1, 1, 1, 2, 7, 8])
    assert draft.weights_for("b")[1] > 5 / 6
    # The prior keeps the replica's last PRIOR_POSITIONS positions.
    for _ in range(ensemble.PRIOR_POSITIONS):
        draft.prior.add(torch.zeros(len(draft.candidates)))
    assert len(draft.prior.scores) == ensemble.PRIOR_POSITIONS and not bool(draft.prior.total.any())
    assert int((draft.weights_for("c") > 0).sum()) == 1   # an even prior: all tie, and one view costs least


def learned_from(draft, session_id, probs, tokens):
    """``draft``'s session scores a block of ``tokens`` that the target verified as drafted, each
    position's views ``probs`` [tokens, views] over (the token, 50)."""
    session = draft._session(session_id)
    session.pending = (4, 2, [_Drafted(torch.tensor([t, 50]), probs, torch.zeros(2), t) for t in tokens])
    draft._learn(session, [1, 1, 1, 2, *tokens])


FULL_RIGHT = torch.tensor([[0.6, 0.0], [0.4, 1.0]])   # the full view put 0.6 on the verified token
LAST_RIGHT = torch.tensor([[0.0, 0.6], [1.0, 0.4]])


def candidate(draft, full_weight: float) -> int:
    return next(j for j, w in enumerate(draft.candidates.tolist()) if abs(w[0] - full_weight) < 1e-6)


def test_an_ask_ahead_of_a_verify_neither_scores_nor_is_scored():
    # Drafting ahead asks with the draft's own chain as if the target had accepted it: scoring
    # that guess would teach the mix in use. The block drafted before stays the one to score.
    draft = EnsembleDraftLM("e", tiny_model("llama", seed=1), turn_marker=MARKER)
    session = draft._session("s")
    block = (4, 2, [_Drafted(torch.tensor([t, 50]), FULL_RIGHT, torch.zeros(2), t) for t in (5, 11)])
    session.pending = block
    ahead = ProposeRequest("s", [1, 1, 1, 2, 5, 11], 2, None, SamplingParams(), ahead=True)
    draft.propose_chains([ahead], [None])
    assert session.pending is block and not session.scores and not draft.prior.scores
    draft.propose_chains([ProposeRequest("s", [1, 1, 1, 2, 5, 11], 2, None, SamplingParams())], [None])
    assert len(session.scores) == 2 and session.pending is not block


def test_a_views_slot_reads_a_cache_of_its_own_salt_only():
    draft = EnsembleDraftLM("e", tiny_model("llama", seed=1), turn_marker=MARKER)
    prompt = [1, 1, 1, 2, 5, 11, 4, 9]
    draft.propose_chains([ProposeRequest("a", prompt, 2, None, SamplingParams(), cache_salt="x")], [None])
    draft.release("a")
    fed, forward = [], draft.kv.forward
    draft.kv.forward = lambda feeds: fed.append(sum(len(f.tokens) for f in feeds)) or forward(feeds)
    draft.propose_chains([ProposeRequest("b", prompt, 2, None, SamplingParams(), cache_salt="y")], [None])
    views = sum(len(tokens) > 0 for tokens in draft.kv.tokens)
    # Every view of the other tenant's request fed its whole context: no slot's cache was read.
    assert fed[0] == sum(len(t) for t in draft.kv.tokens if t) and views >= 1
    assert {draft.kv.salts[s] for s, t in enumerate(draft.kv.tokens) if t} == {"y"}


def test_a_finished_session_leaves_each_candidates_hits_and_its_positions():
    draft = EnsembleDraftLM("e", tiny_model("llama", seed=1), turn_marker=MARKER)
    # Token 5 under a mix is 0.6 w_full against 1 − 0.6 w_full for token 50: only w_full > 5/6
    # (0.9 and 1.0 on the grid) drafts it, at both positions.
    learned_from(draft, "a", FULL_RIGHT, (5, 11))
    prefix = "tabed_01_g10_"
    assert draft.release("a") == {f"{prefix}positions": 2, f"{prefix}hits_{candidate(draft, 0.9)}": 2,
                                  f"{prefix}hits_{candidate(draft, 1.0)}": 2}
    assert draft.release("a") == {} and len(draft.prior.scores) == 2   # released once; the replica keeps its prior
    # Only an adaptive matches ensemble of two views or more carries.
    for settings in ({"distance": "kl"}, {"weights": "static"}):
        other = EnsembleDraftLM("e", tiny_model("llama", seed=1), turn_marker=MARKER, **settings)
        learned_from(other, "a", FULL_RIGHT, (5, 11))
        assert other.carried_prefix is None and other.release("a") == {}, settings
    assert EnsembleDraftLM("e", tiny_model("llama", seed=1), views=("full",)).carried_prefix is None


def test_a_release_with_the_final_context_scores_the_last_block():
    """No ask follows a request's last block, so only the release's ending can verify it: the
    block's positions are scored where the ending reaches back to its root, and not otherwise."""
    draft = EnsembleDraftLM("e", tiny_model("llama", seed=1), turn_marker=MARKER)
    prefix = "tabed_01_g10_"
    for session_id, ending, scored in (("a", (6, [1, 2, 5, 11]), 2), ("b", (6, [5, 11]), 0), ("c", None, 0),
                                       ("d", (5, [1, 2, 5]), 1), ("e", (6, [1, 2, 5, 12]), 2)):
        session = draft._session(session_id)
        session.pending = (4, 2, [_Drafted(torch.tensor([t, 50]), FULL_RIGHT, torch.zeros(2), t) for t in (5, 11)])
        left = draft.release(session_id, ending)
        assert left.get(f"{prefix}positions", 0) == scored, session_id
        # "e": the target said 12 where the draft said 11: scored, and a miss for every mix.
        hits = left.get(f"{prefix}hits_{candidate(draft, 1.0)}", 0)
        assert hits == {"a": 2, "d": 1, "e": 1}.get(session_id, 0), session_id


def ask(session_id, carried=None):
    return ProposeRequest(session_id, [1, 2, 3, 4], 1, None, SamplingParams(), carried=carried)


def test_a_fresh_request_on_a_replica_that_verified_nothing_starts_from_the_clusters_best_mix():
    draft = EnsembleDraftLM("e", tiny_model("llama", seed=1), turn_marker=MARKER)
    # What other replicas' requests left, decayed: the full-view-heavy mixes hit 7 of 8 positions.
    sums = {"tabed_01_g10_positions": 8.0, f"tabed_01_g10_hits_{candidate(draft, 1.0)}": 7.0,
            f"tabed_01_g10_hits_{candidate(draft, 0.9)}": 6.0, "tabed_02_g10_positions": 50.0}
    draft.propose_chains([ask("new", sums)], [None])
    assert not draft.prior.scores and draft.weights_for("new").tolist() == [1.0, 0.0]
    # Beside the replica's prior: two positions where the last-turn view was right weigh less than
    # the cluster's eight, and more than the cluster's one.
    learned_from(draft, "b", LAST_RIGHT, (7, 8))
    draft.release("b")
    assert draft.weights_for("new")[0] > 5 / 6
    draft.propose_chains([ask("few", {**sums, "tabed_01_g10_positions": 1.0,
                                      f"tabed_01_g10_hits_{candidate(draft, 1.0)}": 1.0,
                                      f"tabed_01_g10_hits_{candidate(draft, 0.9)}": 1.0})], [None])
    assert draft.weights_for("few")[1] > 5 / 6
    # The cluster weighs as PRIOR_POSITIONS positions at most, beside the replica's own.
    assert draft.cluster_prior({"tabed_01_g10_positions": 1e6})[1] == PRIOR_POSITIONS
    # Sums a session's later asks bring are not read again: the first ask's stand.
    draft.propose_chains([ask("new", {"tabed_01_g10_positions": 8.0})], [None])
    assert draft.weights_for("new")[0] > 5 / 6


@pytest.mark.parametrize("sums", [
    {"tabed_01_g10_positions": 8.0, "tabed_01_g10_hits_9": math.nan},
    {"tabed_01_g10_positions": 8.0, "tabed_01_g10_hits_9": -3.0},
    {"tabed_01_g10_positions": -8.0, "tabed_01_g10_hits_9": 3.0},
    {"tabed_01_g10_positions": 8.0, "tabed_01_g10_hits_9": 3.0, "tabed_01_g10_hits_40": 3.0},   # 41+ candidates
    {"tabed_02_g10_positions": 8.0, "tabed_02_g10_hits_9": 3.0},      # another ensemble's views
    {"tabed_01_g5_positions": 8.0, "tabed_01_g5_hits_4": 3.0},        # another grid
    {"adt_requests": 3.0}, {}, {"tabed_01_g10_positions": "many"},
], ids=["nan", "negative hits", "negative positions", "candidate count", "views", "grid", "no ensemble",
        "empty", "a string"])
def test_bad_cluster_sums_are_ignored_and_never_raise(sums):
    draft = EnsembleDraftLM("e", tiny_model("llama", seed=1), turn_marker=MARKER)
    proposal, = draft.propose_chains([ask("new", sums)], [None])
    assert len(proposal.tokens) == 1 and draft.sessions["new"].cluster is None
    assert draft.weights_for("new").tolist() == [0.5, 0.5]


def test_a_server_rebuilt_without_its_caches_keeps_the_ensembles_prior():
    model = tiny_model("llama", seed=1)
    before = in_process_server("tabed", DraftLM("tabed", model), ensemble={"turn_marker": MARKER})
    before._batched.prior.add(torch.arange(len(before._batched.candidates), 0, -1, dtype=torch.float32))
    after = in_process_server("tabed", DraftLM("tabed", model), ensemble={"turn_marker": MARKER})
    after.keep_learning_of(before)
    assert len(after._batched.prior.scores) == 1 and torch.equal(after._batched.prior.total, before._batched.prior.total)
    assert after._batched.weights_for("new").tolist() == after._batched.candidates[-1].tolist()   # the lowest score


def test_a_mix_of_one_view_runs_that_view_alone_and_every_view_on_its_scoring_blocks(monkeypatch):
    """Where the block's mix weighs one view the other's row is not run, except on one block in
    ``SCORE_EVERY`` from the session's phase, which runs both, catches the skipped view up and
    alone is scored. What is drafted (tokens and q, sampled) and what a scoring block keeps equal
    an ensemble that runs every view every block."""
    from specserve.replicas.drafts import ensemble

    model = perturbed(tiny_model("llama", seed=0), seed=1)
    params = SamplingParams(temperature=1.0)

    def blocks(every: int) -> tuple[list, list, list]:
        monkeypatch.setattr(ensemble, "SCORE_EVERY", every)
        draft = EnsembleDraftLM("e", model, turn_marker=MARKER)
        rows, forward = [], draft.kv.forward
        draft.kv.forward = lambda feeds: (rows.append(len(feeds)), forward(feeds))[1]
        draft.weights_for = lambda session_id: draft.candidates[candidate(draft, 1.0)]   # the full view alone
        context, out, kept = [5, 6, *MARKER, 8, 9, *MARKER, 11], [], []
        for block in range(6):
            rows.append("block")
            gen = torch.Generator().manual_seed(block)
            proposal, = draft.propose_chains([ProposeRequest("b", list(context), 3, None, params)], [gen])
            out.append((proposal.tokens, proposal.draft_probs))
            pending = draft.sessions["b"].pending
            kept.append(None if pending is None else [(d.tokens, d.probs) for d in pending[2]])
            context += [*proposal.tokens[:2], 30 + block]   # two accepted, then the target's own token
        return out, kept, rows

    lazy, lazy_kept, lazy_rows = blocks(4)   # the shipped SCORE_EVERY
    every, every_kept, _ = blocks(1)
    for (tokens, q), (tokens_e, q_e) in zip(lazy, every):
        assert tokens == tokens_e and torch.allclose(q, q_e, atol=1e-6)
    # Session "b"'s phase is 1: blocks 1 and 5 run both views (2 rows in their first forward) and
    # are scored, the rest one row; block 0 never runs the other view's prefill of the prompt.
    assert zlib.crc32(b"b") % 4 == 1
    firsts = [lazy_rows[i + 1] for i, r in enumerate(lazy_rows) if r == "block"]
    assert firsts == [1, 2, 1, 1, 1, 2]
    assert [k is not None for k in lazy_kept] == [False, True, False, False, False, True]
    for k, k_e in ((lazy_kept[1], every_kept[1]), (lazy_kept[5], every_kept[5])):   # the caught-up view reads the same
        assert all(torch.equal(a, b) and torch.allclose(p, p_e, atol=1e-6) for (a, p), (b, p_e) in zip(k, k_e))


def test_ties_go_to_the_mix_of_fewer_views():
    draft = EnsembleDraftLM("e", tiny_model("llama", seed=1), turn_marker=MARKER)
    learned_from(draft, "a", FULL_RIGHT, (5, 11))   # w_full 0.9 and 1.0 both hit twice: 1.0 runs one view
    assert draft.weights_for("a").tolist() == [1.0, 0.0]
    assert draft.weights_for("fresh").tolist() == [1.0, 0.0]   # from the prior, the same
    # Many tied hits: the sums grow past where float32 holds the tie-break, and it still decides.
    even = torch.tensor([[0.5, 0.5], [0.5, 0.5]])   # both views alike: every mix hits
    for _ in range(40):
        learned_from(draft, "long", even, (5, 11))
    assert float(draft.sessions["long"].total.min()) <= -80 and int((draft.weights_for("long") > 0).sum()) == 1


def test_bad_settings_are_refused():
    model = tiny_model("llama", seed=1)
    with pytest.raises(ValueError, match="distinct views"):
        EnsembleDraftLM("e", model, views=("full", "full"))
    with pytest.raises(ValueError, match="distinct views"):
        EnsembleDraftLM("e", model, views=("thumbnail",))
    with pytest.raises(ValueError, match="distance"):
        EnsembleDraftLM("e", model, distance="l2")
    with pytest.raises(ValueError, match="give it a model"):
        DraftSpec(name="e", ensemble={})
    with pytest.raises(ValueError, match="views must differ"):
        DraftSpec(name="e", model="m", ensemble={"views": ["full", "full"]})


@pytest.mark.parametrize("arch", ARCHITECTURES)
@pytest.mark.parametrize("settings", [{}, {"distance": "kl"}, {"distance": "tvd", "history": 4},
                                      {"weights": "static"}], ids=["matches", "kl", "tvd-h4", "static"])
def test_greedy_output_is_the_targets(arch, settings):
    """Prompts holding the marker twice, so the two views differ; several requests batched; every
    window the engine asks for."""
    target = tiny_model(arch, seed=0)
    check_greedy_equal(target, DraftLM("tabed", perturbed(target, seed=1)), settings, f"{arch} {settings}")


@pytest.mark.parametrize("settings", [{}, {"distance": "kl"}], ids=["matches", "kl"])
def test_a_pruned_heads_views_mix_over_its_tokens_and_keep_the_targets_output(settings, monkeypatch):
    """A draft whose head covers every other token: its views are mixed, drafted from and scored
    over those tokens alone, named by their vocabulary ids."""
    target = tiny_model("llama", seed=0)
    draft = DraftLM("tabed", pruned_copy(perturbed(target, seed=1), list(range(0, VOCAB, 2))))
    kept = []
    keep = EnsembleDraftLM._keep
    monkeypatch.setattr(EnsembleDraftLM, "_keep", staticmethod(lambda *args: kept.append(keep(*args)) or kept[-1]))
    check_greedy_equal(target, draft, settings, f"pruned head {settings}")
    assert kept and all(d.token % 2 == 0 and bool((d.tokens % 2 == 0).all()) for d in kept)


def check_greedy_equal(target, draft, settings: dict, label: str) -> None:
    gen = torch.Generator().manual_seed(0)
    prompts = [torch.randint(1, VOCAB, (4,), generator=gen).tolist() + MARKER
               + torch.randint(1, VOCAB, (3 + i,), generator=gen).tolist() + MARKER + [20 + i] for i in range(4)]
    server = in_process_server("tabed", draft, ensemble={**settings, "turn_marker": MARKER})
    assert isinstance(server._batched, EnsembleDraftLM)
    scored = []   # verified positions each session had scored, at every block
    learn = server._batched._learn
    server._batched._learn = lambda session, context: (learn(session, context), scored.append(len(session.scores)))
    requests = [SpecRequest(p, 24, SamplingParams(), "tabed", 2 + i % 3, None, f"r{i}") for i, p in enumerate(prompts)]
    got = run_batch(Target(target, slots=8), {"tabed": server}, requests)
    plain = run_batch(Target(target, slots=8), {}, [SpecRequest(p, 24, SamplingParams(), "none", 0, None, f"p{i}")
                                                     for i, p in enumerate(prompts)])
    drafted = 0
    for prompt, g, p in zip(prompts, got, plain):
        assert_greedy_equal(target, prompt, g.token_ids, p.token_ids, label)
        drafted += g.stats.accepted
    assert drafted > 0, "the ensemble's tokens were never accepted"
    assert (max(scored) > 0) == (settings.get("weights") != "static"), "adaptive weights learn from verified tokens"


SAMPLED = SamplingParams(temperature=0.8)
PROMPTS = [[1, 1, 1, 2, 5, 11, 4, 9, 3 + i] for i in range(4)]


def test_a_call_reads_the_device_once_a_drafted_position_for_every_ask():
    """Every ask's token of a depth is chosen on the device, and the depth read once for them all:
    three more positions for four asks, three more reads (the weights' bookkeeping is the host's)."""
    model = tiny_model("llama", seed=1)
    counts = []
    for window in (2, 5):
        draft = EnsembleDraftLM("e", model, turn_marker=MARKER, weights="static")
        asks = [ProposeRequest(f"s{i}", PROMPTS[i], window, None, SAMPLED) for i in range(4)]
        generators = [torch.Generator(DEVICE).manual_seed(i) for i in range(4)]
        proposals, reads_made = reads(lambda: draft.propose_chains(asks, generators), DEVICE)
        assert [len(p.tokens) for p in proposals] == [window] * 4
        counts.append(reads_made)
    assert counts[1] - counts[0] == 3, counts


def test_an_ask_whose_q_is_not_a_distribution_proposes_nothing_alone(monkeypatch):
    model = tiny_model("llama", seed=1)

    def chains(poisoned: str | None):
        draft = EnsembleDraftLM("e", model, turn_marker=MARKER, weights="static")
        forward = draft.kv.forward

        def poisoning(feeds):
            rows = forward(feeds)
            return [torch.full_like(r, float("nan")) if draft.owner[f.slot].startswith(f"{poisoned}/") else r
                    for f, r in zip(feeds, rows)]

        monkeypatch.setattr(draft.kv, "forward", poisoning)
        asks = [ProposeRequest(f"s{i}", PROMPTS[i], 2 + i % 2, None, SAMPLED) for i in range(4)]
        return draft.propose_chains(asks, [torch.Generator(DEVICE).manual_seed(i) for i in range(4)])

    clean, poisoned = chains(None), chains("s1")
    assert poisoned[1].tokens == [] and clean[1].tokens
    assert [p.tokens for i, p in enumerate(poisoned) if i != 1] == [p.tokens for i, p in enumerate(clean) if i != 1]
