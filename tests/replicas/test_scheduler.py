"""The batched scheduler: every request's greedy output equals its output alone, however the
batch is mixed (lengths, windows, trees, drafts, joining mid-flight), and a bad proposal costs
speculation, never the request."""

import asyncio

import pytest
import torch

from specserve.replicas.drafts.base import CONTEXT_ONLY
from specserve.replicas.request import StaticPolicy
from specserve.replicas.model_worker import InlineWorker
from specserve.replicas.sampling import SamplingParams
from specserve.replicas.request import SpecRequest, draft_seed
from specserve.replicas.scheduler import Scheduler
from specserve.replicas.step import Proposal, TreeShape
from specserve.replicas.step_loop import StepLoop
from specserve.replicas.target import Target
from specserve.replicas.engine import run_batch, run_side_by_side, speculative_generate
from tiny_servers import alone, servers
from tiny_models import ARCHITECTURES, tiny_model

GREEDY = SamplingParams()
PROMPTS = [[5, 6, 7, 8, 5, 6, 9, 10, 11, 5, 6], [1, 2, 3, 4, 1, 2, 3, 4, 1], list(range(20, 50)), [7], [3, 3, 3, 9]]
# (draft, window, tree) per request: chains of different windows, trees, plain, side by side.
ASKS = [("near", 3, None), ("prompt-lookup", 4, None), ("near", 0, TreeShape(3, 2, 6)),
        ("none", 0, None), ("prompt-lookup", 0, TreeShape(4, 2, 8))]
NEW_TOKENS = 24


@pytest.mark.parametrize("arch", ARCHITECTURES)
def test_batched_greedy_equals_each_request_alone(arch):
    model = tiny_model(arch, seed=0)
    requests = [SpecRequest(p, NEW_TOKENS, GREEDY, d, w, t, f"r{i}") for i, (p, (d, w, t)) in enumerate(zip(PROMPTS, ASKS))]
    got = run_batch(Target(model, slots=8), servers(model), requests)
    for prompt, gen, (name, *_) in zip(PROMPTS, got, ASKS):
        assert gen.token_ids == alone(model, prompt), f"{arch}: {name} differs from target-only"
    # Speculation really happened in the batch (a compaction bug that drops the accepted path
    # would also show up as a mismatch above, but only if something was accepted).
    assert sum(g.stats.accepted for g in got) > 10


def test_requests_join_and_leave_mid_flight_and_slots_stay_dense():
    model = tiny_model("llama", seed=0)
    target = Target(model, slots=3)
    scheduler = Scheduler(target, StaticPolicy(), prefill_chunk=4)
    loop = StepLoop(scheduler, servers(model), InlineWorker())
    lengths = [6, 20, 12, 9, 15]
    states = [loop.add(SpecRequest(PROMPTS[i % len(PROMPTS)], n, GREEDY, "near", 2, None, f"r{i}"))
              for i, n in enumerate(lengths[:2])]

    async def run():
        for _ in range(3):   # the first two are running (prompt 0 took two prefill chunks of 4)
            await loop.step()
        for i in range(2, 5):
            states.append(loop.add(SpecRequest(PROMPTS[i], lengths[i], GREEDY, "near", 2, None, f"r{i}")))
        while scheduler.has_work:
            await loop.step()
            busy = [i for i, s in enumerate(scheduler.slots) if s is not None]
            assert busy == list(range(len(busy))), f"busy slots {busy} are not dense from 0"
            assert len(busy) <= 3

    asyncio.run(run())
    for i, state in enumerate(states):
        prompt = PROMPTS[i % len(PROMPTS)]
        expected = speculative_generate(Target(model), None, prompt, lengths[i], GREEDY).token_ids
        assert state.out == expected, f"request {i} joined mid-flight and diverged"
    assert max(r.batch_size for r in scheduler.records) == 3


class BadDraft:
    """Proposals a buggy draft could send: out-of-vocabulary ids, a child before its parent,
    draft_probs of the wrong vocabulary."""

    name = "bad"
    inputs = CONTEXT_ONLY

    def __init__(self):
        self.calls = 0

    def propose(self, context, window, params, generator):
        self.calls += 1
        kind = self.calls % 3
        if kind == 0:
            return Proposal.chain([10**6, 3])
        if kind == 1:
            return Proposal([4, 5], [1, -1])
        return Proposal.chain([1, 2], draft_probs=torch.full((2, 7), 1 / 7))

    def propose_tree(self, context, shape):
        return Proposal([1, 2], [0, -1])


def test_a_malformed_proposal_costs_speculation_not_the_request():
    model = tiny_model("llama", seed=0)
    gen = speculative_generate(Target(model), BadDraft(), PROMPTS[0], 12, GREEDY, window=2)
    assert gen.token_ids == alone(model, PROMPTS[0])[:12]
    # Every proposal was dropped; the last step had no room to draft (the bonus token ends it).
    assert gen.stats.proposal_errors == gen.stats.steps - 1 > 0


def test_the_draft_seed_is_its_own_stream():
    # Same request seed -> same draft seed (repeatable runs), never the target's own seed.
    assert draft_seed(7) == draft_seed(7) != 7
    assert draft_seed(None) is None
    target = torch.Generator().manual_seed(7)
    draft = torch.Generator().manual_seed(draft_seed(7))
    assert not torch.equal(torch.rand(8, generator=target), torch.rand(8, generator=draft))


def test_a_model_free_draft_keeps_proposing_after_other_sessions_end():
    # More requests than slots: later ones are admitted after earlier ones released their draft
    # sessions. Each prompt ends with an n-gram it contains earlier, so prompt lookup always has a
    # proposal; a draft server that failed once sessions ended would send those requests plain.
    model = tiny_model("llama", seed=0)
    requests = []
    for i in range(6):
        seed = [4 + i, 9]
        prompt = seed + speculative_generate(Target(model), None, seed, 6, GREEDY).token_ids + seed
        requests.append(SpecRequest(prompt, 6, GREEDY, "prompt-lookup", 3, None, f"r{i}"))
    gens = run_batch(Target(model, slots=2), servers(model), requests)
    assert all(max(g.stats.windows) > 0 for g in gens), [g.stats.windows for g in gens]
    assert sum(g.stats.accepted for g in gens) > 0


def test_the_loop_awaits_on_idle_when_work_runs_out_and_still_serves_a_request_added_meanwhile():
    """The replica gives memory back in ``on_idle``; a request that arrives while it does must not
    be left waiting for a wake-up that already happened."""
    model = tiny_model("llama", seed=0)
    scheduler = Scheduler(Target(model, slots=2), StaticPolicy())
    idles, added = [], []

    async def on_idle():
        idles.append(len(scheduler.records))
        if len(idles) == 1:
            added.append(loop.add(SpecRequest(PROMPTS[1], 5, GREEDY, request_id="b")))
            await asyncio.sleep(0)

    loop = StepLoop(scheduler, {}, InlineWorker(), on_idle=on_idle)

    async def run():
        first = loop.add(SpecRequest(PROMPTS[0], 5, GREEDY, request_id="a"))
        task = asyncio.create_task(loop.serve_forever())
        for _ in range(500):
            await asyncio.sleep(0.01)
            if len(idles) == 2:
                break
        task.cancel()
        return first

    first = asyncio.run(run())
    assert len(idles) == 2 and idles[1] > idles[0], idles   # idle after each request's steps
    assert first.done and added[0].done
    assert added[0].out == alone(model, PROMPTS[1])[:5]


def test_tokens_reach_their_requests_on_the_event_loops_thread_in_order():
    """The model runs on its own thread; ``asyncio`` queues are not thread-safe, so every item must
    be handed over on the loop's thread (a served replica's streams wait on such queues), and the
    concatenated items must be the request's whole output."""
    import threading

    from specserve.replicas.model_worker import ModelWorker

    model = tiny_model("llama", seed=0)
    scheduler = Scheduler(Target(model, slots=4), StaticPolicy())
    loop = StepLoop(scheduler, {}, ModelWorker("t"))
    threads, items = set(), {}

    async def run():
        loop_thread = threading.get_ident()
        states = []
        for i, prompt in enumerate(PROMPTS[:3]):
            def emit(item, i=i):
                threads.add(threading.get_ident())
                items.setdefault(i, []).append(item)
            states.append(loop.add(SpecRequest(prompt, 9, GREEDY, request_id=f"r{i}"), emit))
        await loop.run_until_idle()
        return loop_thread, states

    loop_thread, states = asyncio.run(run())
    assert threads == {loop_thread}
    for i, state in enumerate(states):
        assert [t for item in items[i] for t in item.token_ids] == state.out == alone(model, PROMPTS[i])[:9]
        assert items[i][-1].finish_reason == "length" and not any(it.last for it in items[i][:-1])
        # The scheduler's items carry no spec: the served replica builds it once, on the last item.
        assert all(it.spec is None for it in items[i])


def test_finished_requests_caches_survive_compaction_and_serve_the_same_prompts_again():
    # The short request ends first, so the long one moves down into its slot: the move must not
    # overwrite the short one's cache. Then every prompt, asked again, finds its whole prefix.
    model = tiny_model("llama", seed=0)
    target = Target(model, slots=4)
    scheduler = Scheduler(target, StaticPolicy(), prefill_chunk=64)
    loop = StepLoop(scheduler, servers(model), InlineWorker())
    prompts, lengths = PROMPTS[:3], [20, 3, 10]

    def run(tag: str):
        states = [loop.add(SpecRequest(p, n, GREEDY, "none", 0, None, f"{tag}{i}")) for i, (p, n) in enumerate(zip(prompts, lengths))]
        asyncio.run(loop.run_until_idle())
        return states

    first = run("a")
    prefilled_before = sum(r.prefill_tokens for r in scheduler.records)
    assert prefilled_before == sum(len(p) - 1 for p in prompts)
    assert [s.cached_tokens for s in first] == [0, 0, 0]
    again = run("b")
    assert [s.out for s in again] == [s.out for s in first]
    assert sum(r.prefill_tokens for r in scheduler.records) == prefilled_before, "a prompt was prefilled again"
    # What the response's usage reports (OpenAI's prompt_tokens_details.cached_tokens): all but
    # the last prompt token, which every request feeds as its first step's root.
    assert [s.cached_tokens for s in again] == [len(p) - 1 for p in prompts]


def test_a_cache_salt_reuses_only_its_own_salts_caches():
    model = tiny_model("llama", seed=0)
    target = Target(model, slots=3)
    scheduler = Scheduler(target, StaticPolicy(), prefill_chunk=64)
    loop = StepLoop(scheduler, servers(model), InlineWorker())
    prompt = PROMPTS[2]

    def once(i: int, salt: str | None):
        state = loop.add(SpecRequest(prompt, 4, GREEDY, "none", 0, None, f"r{i}", cache_salt=salt))
        asyncio.run(loop.run_until_idle())
        return state

    first = once(0, "tenant-a")
    assert once(1, "tenant-b").cached_tokens == 0           # another tenant's cache is never read
    assert once(2, None).cached_tokens == 0
    again = once(3, "tenant-a")
    assert again.cached_tokens == len(prompt) - 1           # its own tenant's cache is
    assert again.out == first.out


class BatchSizes(StaticPolicy):
    """The static policy, recording every step's batch size."""

    def __init__(self):
        super().__init__()
        self.sizes = []

    def observe(self, record):
        super().observe(record)
        self.sizes.append(record.batch_size)


def test_runs_side_by_side_take_turns_and_each_equals_its_requests_alone():
    model = tiny_model("llama", seed=0)
    speculating = [SpecRequest(p, NEW_TOKENS, GREEDY, d, w, t, f"s{i}") for i, (p, (d, w, t)) in enumerate(zip(PROMPTS, ASKS))]
    plain = [SpecRequest(p, NEW_TOKENS, GREEDY, "none", 0, None, f"p{i}") for i, p in enumerate(PROMPTS)]
    policies = [BatchSizes(), BatchSizes()]
    out = run_side_by_side([Target(model, slots=8), Target(model, slots=8)], servers(model),
                           [(speculating, policies[0]), (plain, policies[1])], max_running=2)
    for gens, seconds in out:
        assert seconds > 0
        for prompt, gen in zip(PROMPTS, gens):
            assert gen.token_ids == alone(model, prompt)
    # At most two at once (the others waited their turn).
    for policy in policies:
        assert max(policy.sizes) == 2 and policy.sizes.count(2) > NEW_TOKENS
    assert sum(g.stats.accepted for g in out[0][0]) > 10 and sum(g.stats.accepted for g in out[1][0]) == 0
    with pytest.raises(ValueError, match="one target per run"):
        run_side_by_side([Target(model, slots=2)], servers(model), [(plain, None), (plain, None)])


def _poisoned_rows(target: Target, state):
    """The target's forward with every row of ``state``'s feed NaN: a request whose own scores
    are not a distribution, beside healthy ones in the same forward."""
    forward = target.kv.forward

    def poisoned(feeds):
        logits = forward(feeds)
        return [torch.full_like(rows, float("nan")) if feed.slot == state.slot and not state.done else rows for feed, rows in zip(feeds, logits)]

    target.kv.forward = poisoned


@pytest.mark.parametrize("params", [GREEDY, SamplingParams(temperature=0.8, seed=3)], ids=["greedy", "sampled"])
def test_a_request_whose_scores_are_not_finite_fails_alone_and_the_step_goes_on(params):
    model = tiny_model("llama", seed=0)
    target = Target(model, slots=4)
    scheduler = Scheduler(target, StaticPolicy())
    loop = StepLoop(scheduler, servers(model), InlineWorker())
    items: dict[int, list] = {i: [] for i in range(4)}
    asks = [("near", 3), ("prompt-lookup", 4), ("none", 0), ("near", 2)]
    states = [loop.add(SpecRequest(PROMPTS[i], NEW_TOKENS, params if i == 2 else GREEDY, d, w, None, f"r{i}"),
                       items[i].append) for i, (d, w) in enumerate(asks)]
    _poisoned_rows(target, states[2])
    asyncio.run(loop.run_until_idle())
    failed = items[2][-1]
    assert failed.error is not None and failed.error.request_fault, "the poisoned request must fail as its own fault"
    assert "not finite" in failed.error.message and states[2].out == []
    assert loop.failures == 0, "no step failed: the replica stays healthy"
    for i in (0, 1, 3):
        assert items[i][-1].error is None and states[i].out == alone(model, PROMPTS[i]), f"request {i} was hurt"


@pytest.mark.parametrize("temperature", [1e-300, 5e-324, 1e-45])
def test_a_tiny_temperature_decodes_as_greedy_beside_greedy_requests(temperature):
    # softmax(l / T) tends to the argmax as T -> 0: with no tied maxima that is greedy decoding.
    model = tiny_model("llama", seed=0)
    requests = [SpecRequest(PROMPTS[i], NEW_TOKENS, GREEDY if i else SamplingParams(temperature=temperature, seed=i),
                            d, w, t, f"r{i}") for i, (d, w, t) in enumerate(ASKS)]
    got = run_batch(Target(model, slots=8), servers(model), requests)
    for prompt, gen in zip(PROMPTS, got):
        assert gen.finish_reason == "length" and gen.token_ids == alone(model, prompt)


class MalformedProbsDraft:
    """A sampled chain whose ``draft_probs`` are not the distribution its tokens were drawn from:
    NaN, out of [0, 1], rows not summing to 1, or no mass on a proposed token."""

    name = "malformed-q"
    inputs = CONTEXT_ONLY

    def __init__(self):
        self.calls = 0

    def propose(self, context, window, params, generator):
        self.calls += 1
        q = torch.full((2, 96), 1 / 96)
        kind = self.calls % 4
        if kind == 0:
            q[0, 5] = float("nan")
        elif kind == 1:
            q[1] = 0.0
            q[1, 0] = 1.0                # the proposed token 7 has q(x) = 0: it would always be accepted
        elif kind == 2:
            q *= 2                       # sums to 2
        else:
            q[0, 0], q[0, 1] = 1.5, -0.5
        return Proposal.chain([3, 7], draft_probs=q)

    def propose_tree(self, context, shape):
        return Proposal.empty()


def test_malformed_draft_probs_cost_speculation_never_the_distribution():
    model = tiny_model("llama", seed=0)
    params = SamplingParams(temperature=1.0, seed=11)
    gen = speculative_generate(Target(model), MalformedProbsDraft(), PROMPTS[1], 12, params, window=2)
    # Every proposal is dropped, so each step is a plain sampled step drawing from the same
    # generator as target-only decoding: the same tokens.
    assert gen.token_ids == speculative_generate(Target(model), None, PROMPTS[1], 12, params).token_ids
    assert gen.stats.proposal_errors == gen.stats.steps - 1 > 0


def test_an_empty_chain_with_its_empty_draft_probs_is_a_plain_step_not_an_error():
    from specserve.replicas.target import proposal_error

    assert proposal_error(Proposal.chain([], draft_probs=torch.empty(0, 96)), 96, torch.device("cpu")) is None


def test_a_draft_lms_own_sampled_chains_pass_the_draft_probs_checks():
    # The checks must refuse only what is not a distribution: a real draft's q is never dropped.
    from specserve.replicas.drafts.draft_lm import DraftLM
    from tiny_models import perturbed

    model = tiny_model("llama", seed=0)
    draft = DraftLM("near", perturbed(model, seed=1))
    gen = speculative_generate(Target(model), draft, PROMPTS[2], 16, SamplingParams(temperature=0.9, seed=4), window=3)
    assert gen.stats.proposal_errors == 0 and gen.stats.steps < 16


def test_requests_that_share_a_prompt_prefill_it_once_and_each_decodes_as_alone():
    """A request's choices (one prompt, one salt): the first prefills it, in chunks, the others
    wait and take a copy of its KV rows. Greedy and seeded sampled outputs equal each request's
    run alone; another salt's request computes its own."""
    model = tiny_model("llama", seed=0)
    prompt = list(range(20, 50))
    sampled = SamplingParams(temperature=0.8, seed=11)
    asks = [(GREEDY, "near", "a"), (sampled, "near", "a"), (GREEDY, "prompt-lookup", "a"), (GREEDY, "none", "b")]

    def served(requests, slots=5):
        scheduler = Scheduler(Target(model, slots=slots), StaticPolicy(), prefill_chunk=8)
        loop = StepLoop(scheduler, servers(model), InlineWorker())
        states = [loop.add(r) for r in requests]
        asyncio.run(loop.run_until_idle())
        return states, sum(r.prefill_tokens for r in scheduler.records)

    requests = [SpecRequest(prompt, 12, params, draft, 3, None, f"c{i}", cache_salt=salt)
                for i, (params, draft, salt) in enumerate(asks)]
    together, prefilled = served(requests)
    assert prefilled == 2 * (len(prompt) - 1), "the shared prompt was prefilled more than once per salt"
    assert [s.cached_tokens for s in together] == [0, len(prompt) - 1, len(prompt) - 1, 0]
    for request, state in zip(requests, together):
        alone_state, _ = served([request], slots=1)
        assert state.out == alone_state[0].out, request.request_id


def test_a_long_common_prefix_is_prefilled_once_and_the_rest_by_each():
    model = tiny_model("llama", seed=0)
    system = list(range(30, 70))
    prompts = [system + [5, 6, 7], system + [8, 9], [1, 2, 3] + system]   # the last shares no prefix
    scheduler = Scheduler(Target(model, slots=4), StaticPolicy(), prefill_chunk=16)
    loop = StepLoop(scheduler, servers(model), InlineWorker())
    states = [loop.add(SpecRequest(p, 8, GREEDY, "near", 2, None, f"p{i}")) for i, p in enumerate(prompts)]
    asyncio.run(loop.run_until_idle())
    assert sum(r.prefill_tokens for r in scheduler.records) == sum(len(p) - 1 for p in prompts) - len(system)
    assert [s.cached_tokens for s in states] == [0, len(system), 0]
    for prompt, state in zip(prompts, states):
        assert state.out == alone(model, prompt, 8)


def test_a_copied_prefix_carries_its_hidden_states_and_verifies_as_the_original():
    model = tiny_model("llama", seed=0)
    target = Target(model, slots=2)
    prompt = list(range(20, 50))
    target.prefill(0, prompt, chunk=64)
    target.copy_prefix(0, 1, 20)
    assert target.kv.tokens[1] == prompt[:20]
    assert torch.equal(target.features(prompt[:21], slot=1), target.features(prompt[:21], slot=0))
    target.prefill(1, prompt, chunk=64)   # computes only the 10 positions not copied
    assert target.kv.tokens[1] == prompt
    torch.testing.assert_close(target.features(prompt + [1], slot=1), target.features(prompt + [1], slot=0))


def test_a_steps_greedy_requests_have_their_argmaxes_read_at_once(monkeypatch):
    """One read of the target's argmaxes per verify for every greedy request, over its rows after
    its own processors, beside a sampled request that reads its own rows; each greedy request
    still decodes as alone."""
    import specserve.replicas.target as target_module

    model = tiny_model("llama", seed=0)
    target = Target(model, slots=4)
    reads, greedy = [], []
    choices, verify = target_module.greedy_choices, target.verify

    def counted(rows):
        reads.append(len(rows))
        return choices(rows)

    def verify_counted(items):
        greedy.append(sum(1 for i in items if i.params.greedy))
        return verify(items)

    monkeypatch.setattr(target_module, "greedy_choices", counted)
    target.verify = verify_counted
    penalized = SamplingParams(repetition_penalty=1.3)
    requests = [SpecRequest(PROMPTS[0], NEW_TOKENS, GREEDY, "near", 3, None, "a"),
                SpecRequest(PROMPTS[1], NEW_TOKENS, GREEDY, "prompt-lookup", 4, None, "b"),
                SpecRequest(PROMPTS[2], NEW_TOKENS, penalized, "near", 2, None, "c"),
                SpecRequest(PROMPTS[3], NEW_TOKENS, SamplingParams(temperature=0.8, seed=1), "near", 2, None, "d")]
    gens = run_batch(target, servers(model), requests)
    assert reads == greedy and max(reads) == 3 and len(reads) >= NEW_TOKENS // 5
    for i in (0, 1):
        assert gens[i].token_ids == alone(model, PROMPTS[i])
    assert gens[2].token_ids == speculative_generate(Target(model), None, PROMPTS[2], NEW_TOKENS, penalized).token_ids
    assert len(gens[3].token_ids) == NEW_TOKENS
