"""Batched chain drafting proposes exactly what one-session drafting proposes, for every session
of a call, with sessions coming, going and being evicted."""

import torch

from device_reads import reads
from specserve.replicas.drafts.batched_lm import BatchedDraftLM
from specserve.replicas.drafts.draft_lm import DraftLM
from specserve.replicas.sampling import SamplingParams
from specserve.replicas.step import ProposeRequest
from tiny_models import DEVICE, tiny_model

GREEDY = SamplingParams()
CONTEXTS = [[5, 6, 7, 8, 5, 6], [1, 2, 3], list(range(20, 45)), [9]]


def asks(contexts, windows, params=GREEDY):
    return [ProposeRequest(f"s{i}", c, w, None, params) for i, (c, w) in enumerate(zip(contexts, windows))]


def test_batched_chains_equal_one_session_chains_as_contexts_grow():
    model = tiny_model("llama", seed=3)
    batched = BatchedDraftLM("d", model, slots=3)   # fewer slots than sessions over time: eviction
    contexts = [list(c) for c in CONTEXTS[:3]]
    for step in range(4):
        windows = [1 + (step + i) % 4 for i in range(3)]
        got = batched.propose_chains(asks(contexts, windows), [None] * 3)
        for context, window, proposal in zip(contexts, windows, got):
            want = DraftLM("d", model).propose(context, window, GREEDY, None)
            assert proposal.tokens == want.tokens and len(want.tokens) == window
        # Each session commits some of its proposal plus a token of its own, as after verification.
        for context, proposal in zip(contexts, got):
            context.extend(proposal.tokens[:1] + [11])
    batched.release("s1")
    other = [ProposeRequest("s9", CONTEXTS[3], 3, None, GREEDY)]   # takes the released slot
    assert batched.propose_chains(other, [None])[0].tokens == DraftLM("d", model).propose(CONTEXTS[3], 3, GREEDY, None).tokens


def test_sampled_chains_carry_the_rows_of_q():
    model = tiny_model("llama", seed=3)
    params = SamplingParams(temperature=1.0)
    got = BatchedDraftLM("d", model, slots=4).propose_chains(
        asks(CONTEXTS, [2, 3, 1, 2], params), [torch.Generator(model.device).manual_seed(i) for i in range(4)])
    for proposal, window in zip(got, [2, 3, 1, 2]):
        assert proposal.draft_probs.shape == (window, model.config.vocab_size)
        # Each drafted token was drawn from its own row: it has probability > 0 there.
        assert all(proposal.draft_probs[i, t] > 0 for i, t in enumerate(proposal.tokens))


def test_sessions_one_after_another_keep_a_calls_slots_dense_from_zero():
    """A padded forward runs the whole range of its slots: requests served one at a time, each
    releasing its session, must not walk their slots across the cache (two sessions at either
    end of it would cost a forward of every slot)."""
    model = tiny_model("llama", seed=3)
    batched = BatchedDraftLM("d", model, slots=5)
    spans = []
    forward = batched.kv.forward

    def recording(feeds):
        slots = [f.slot for f in feeds]
        spans.append(max(slots) - min(slots) + 1)
        return forward(feeds)

    batched.kv.forward = recording
    for i in range(12):   # more sessions than slots; a request of one session, then one of two
        sessions = [f"r{i}/{k}" for k in range(1 + i % 2)]
        batched.propose_chains([ProposeRequest(s, CONTEXTS[k], 2, None, GREEDY) for k, s in enumerate(sessions)],
                               [None] * len(sessions))
        for session in sessions:
            batched.release(session)
    assert spans == [1, 1, 2, 2] * 6   # two forwards a call (window 2)


def test_a_session_moves_down_into_a_freed_slot_and_drafts_as_before():
    model = tiny_model("llama", seed=3)
    batched = BatchedDraftLM("d", model, slots=4)
    contexts = [list(CONTEXTS[0]), list(CONTEXTS[2])]
    batched.propose_chains(asks(contexts, [2, 2]), [None, None])   # s0 in slot 0, s1 in slot 1
    batched.release("s0")
    released = list(batched.kv.tokens[0])   # s0's prefix cache
    contexts[1].append(7)
    fed = []
    forward = batched.kv.forward
    batched.kv.forward = lambda feeds: fed.append([(f.slot, len(f.tokens)) for f in feeds]) or forward(feeds)
    got = batched.propose_chains([ProposeRequest("s1", contexts[1], 3, None, GREEDY)], [None])[0]
    assert batched.owner.index("s1") == 0
    assert got.tokens == DraftLM("d", model).propose(contexts[1], 3, GREEDY, None).tokens
    # Its cache came along: the first forward fed slot 0 only the token the context gained.
    assert fed[0] == [(0, 1)]
    # The released session's prefix cache was not overwritten: it sits in the slot left behind.
    assert released and batched.kv.tokens[1] == released


def fed_per_forward(batched: BatchedDraftLM) -> list[int]:
    """Tokens fed by each of the draft cache's forwards from now on (the real forward runs)."""
    fed, forward = [], batched.kv.forward

    def counting(feeds):
        fed.append(sum(len(f.tokens) for f in feeds))
        return forward(feeds)

    batched.kv.forward = counting
    return fed


def test_a_slots_prefix_cache_serves_only_requests_of_its_own_salt():
    model = tiny_model("llama", seed=3)
    batched = BatchedDraftLM("d", model, slots=1)
    prompt = list(range(20, 45))
    first = ProposeRequest("a", prompt, 2, None, GREEDY, cache_salt="tenant-a")
    want = batched.propose_chains([first], [None])[0].tokens
    batched.release("a")
    fed = fed_per_forward(batched)
    # Another tenant, the same prompt: the slot's cache is forgotten, the whole prompt is fed.
    other = ProposeRequest("b", prompt, 2, None, GREEDY, cache_salt="tenant-b")
    assert batched.propose_chains([other], [None])[0].tokens == want
    assert fed[0] == len(prompt) and batched.kv.salts[0] == "tenant-b"
    batched.release("b")
    # The same tenant again: the cached prompt is read, only its last token is fed again.
    again = ProposeRequest("c", prompt, 2, None, GREEDY, cache_salt="tenant-b")
    assert batched.propose_chains([again], [None])[0].tokens == want
    assert fed[2] == 1


SAMPLED = SamplingParams(temperature=0.8)


def test_a_call_reads_the_device_once_a_drafted_position_for_every_session():
    model = tiny_model("llama", seed=3)
    counts = []
    for sessions in (1, 6):
        batched = BatchedDraftLM("d", model, slots=6)
        generators = [torch.Generator(DEVICE).manual_seed(i) for i in range(sessions)]
        contexts = [[5, 6, 7, 8, i + 1] for i in range(sessions)]
        proposals, count = reads(lambda: batched.propose_chains(asks(contexts, [3] * sessions, SAMPLED), generators),
                                 DEVICE)
        assert [len(p.tokens) for p in proposals] == [3] * sessions
        counts.append(count)
    assert counts[0] == counts[1], counts


def test_a_session_whose_q_is_not_a_distribution_proposes_nothing_alone(monkeypatch):
    """Its neighbours in the call draft what they draft without it."""
    model = tiny_model("llama", seed=3)
    contexts = [list(c) for c in CONTEXTS]

    def chains(poisoned: int | None):
        batched = BatchedDraftLM("d", model, slots=4)
        forward = batched.kv.forward

        def poisoning(feeds):
            rows = forward(feeds)
            return [torch.full_like(r, float("nan")) if f.slot == poisoned else r for f, r in zip(feeds, rows)]

        monkeypatch.setattr(batched.kv, "forward", poisoning)
        generators = [torch.Generator(DEVICE).manual_seed(i) for i in range(4)]
        return batched.propose_chains(asks(contexts, [3, 2, 4, 3], SAMPLED), generators)

    clean, poisoned = chains(None), chains(2)
    assert poisoned[2].tokens == [] and clean[2].tokens
    assert [p.tokens for i, p in enumerate(poisoned) if i != 2] == [p.tokens for i, p in enumerate(clean) if i != 2]
