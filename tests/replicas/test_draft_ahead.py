"""Drafting ahead (``StepLoop``: a draft on a thread of its own drafts the next step while the
target verifies) keeps the output exactly the target's: greedy output equals target-only output,
and sampled tokens that follow a step drafted ahead are distributed as under the target alone.
Proposals the verdict rules out, and those that come too late, are dropped, never used."""

from __future__ import annotations

import asyncio
import time

from dataclasses import replace

import pytest
import torch

from chi_square import chi_square_pvalue
from equality import assert_greedy_equal
from specserve.replicas.drafts.draft_lm import DraftLM
from specserve.replicas.engine import in_process_server, speculative_generate
from specserve.replicas.model_worker import InlineWorker
from specserve.replicas.request import SpecRequest, StaticPolicy
from specserve.replicas.sampling import SamplingParams, logits_to_probs
from specserve.replicas.scheduler import Scheduler
from specserve.replicas.step_loop import StepLoop
from specserve.replicas.target import Target
from tiny_models import VOCAB, perturbed, tiny_model

GREEDY = SamplingParams()
PROMPTS = [[5, 6, 7, 8, 5, 6, 9, 10, 11, 5, 6], list(range(20, 50))]
NEW_TOKENS = 40


@pytest.fixture(scope="module")
def target():
    return tiny_model("llama", seed=0)


def run(target, draft, requests, slots: int = 4, draft_ahead: bool = True, loop_hook=None, verify_s: float = 0.01):
    """The requests through one scheduler, the draft on its own model thread; the loop after.
    Each verify takes at least ``verify_s``: a real target's verify is many times a tiny draft's
    drafted position, and drafting ahead asks only what fits in one."""
    server = in_process_server(draft.name, draft, apart=True)
    target_ = Target(target, slots=slots)
    verify = target_.verify

    def at_a_real_pace(items):
        t0 = time.perf_counter()
        out = verify(items)
        time.sleep(max(0.0, verify_s - (time.perf_counter() - t0)))
        return out

    target_.verify = at_a_real_pace
    loop = StepLoop(Scheduler(target_, StaticPolicy()), {draft.name: server}, InlineWorker(), draft_ahead=draft_ahead)
    if loop_hook is not None:
        loop_hook(loop)
    states = [loop.add(r) for r in requests]
    asyncio.run(loop.run_until_idle())
    server.worker.close()
    return [s.out for s in states], loop


@pytest.mark.parametrize("window", [1, 2, 3])
def test_greedy_output_equals_target_only_and_chains_drafted_ahead_are_used(target, window):
    # A close draft: its chain and its guess of the bonus must both be right for a hit (5 to 17
    # of ~40 per run here; at the usual noise 0.5, 0 to 2).
    draft = DraftLM("close", perturbed(target, seed=1, noise=0.1))
    requests = [SpecRequest(p, NEW_TOKENS, GREEDY, "close", window, None, f"r{i}") for i, p in enumerate(PROMPTS)]
    outs, loop = run(target, draft, requests)
    for prompt, out in zip(PROMPTS, outs):
        expected = speculative_generate(Target(target), None, prompt, NEW_TOKENS, GREEDY).token_ids
        assert_greedy_equal(target, prompt, out, expected, f"draft ahead γ={window}")
    counts = loop.ahead
    assert counts.drafted > 0 and counts.used > 0, counts
    assert counts.used + counts.ruled_out + counts.late <= counts.drafted
    assert counts.ruled_out > 0, "a perturbed draft is rejected somewhere: those chains must be dropped"


def test_outcomes_with_a_rejection_are_drafted_ahead_too_and_used_when_the_target_emits_the_runner_up(target):
    """A greedy request among few is also drafted ahead from a rejection at each of its chain's
    first positions, the target emitting there the draft's runner-up, as far as a verify's time
    allows at the draft's pace."""
    draft = DraftLM("near", perturbed(target, seed=1))
    requests = [SpecRequest(p, NEW_TOKENS, GREEDY, "near", 3, None, f"rej{i}") for i, p in enumerate(PROMPTS)]
    outs, loop = run(target, draft, requests, verify_s=0.03)
    for prompt, out in zip(PROMPTS, outs):
        assert out == speculative_generate(Target(target), None, prompt, NEW_TOKENS, GREEDY).token_ids
    assert loop.ahead.used_after_rejection > 0, loop.ahead
    assert not loop._outcome_sessions, "the sessions drafted ahead in were not released"


def test_a_far_draft_is_ruled_out_and_the_output_is_still_the_targets(target):
    far = DraftLM("far", tiny_model("llama", seed=7, layers=1))
    requests = [SpecRequest(PROMPTS[1], NEW_TOKENS, GREEDY, "far", 3, None, "far")]
    outs, loop = run(target, far, requests)
    expected = speculative_generate(Target(target), None, PROMPTS[1], NEW_TOKENS, GREEDY).token_ids
    assert outs[0] == expected
    assert loop.ahead.ruled_out >= loop.ahead.drafted - loop.ahead.used - loop.ahead.late > 0


def test_chains_drafted_too_late_are_dropped_and_the_step_goes_on(target):
    """A draft that answers after one verify's time: its chains drafted ahead are not waited for."""
    draft = DraftLM("close", perturbed(target, seed=1, noise=0.1))
    requests = [SpecRequest(PROMPTS[1], NEW_TOKENS, GREEDY, "close", 2, None, "slow")]

    def slow_drafts(loop):
        server = loop.drafts["close"]
        propose = server.propose_batch

        async def slow(asks):
            # drafting ahead: an all-accepted outcome (γ + 1) or a rejection's (a session of its own)
            if any(a.window == 3 or a.session_id != "slow" for a in asks):
                await asyncio.sleep(0.2)
            return await propose(asks)

        server.propose_batch = slow

    outs, loop = run(target, draft, requests, loop_hook=slow_drafts)
    expected = speculative_generate(Target(target), None, PROMPTS[1], NEW_TOKENS, GREEDY).token_ids
    assert outs[0] == expected
    assert loop.ahead.late > 0 and loop.ahead.used == 0, loop.ahead


def test_a_stalled_draft_holds_no_step_and_is_not_asked_again_while_its_call_runs(target):
    """A draft apart that stalls (one call far beyond its usual pace): its requests decode plainly
    meanwhile (the output unchanged), and no second call is made to it while that one runs."""
    draft = DraftLM("close", perturbed(target, seed=1, noise=0.1))
    requests = [SpecRequest(PROMPTS[1], 32, GREEDY, "close", 3, None, "stall")]
    calls, running, overlapping = [0], [0], [0]

    def stalling(loop):
        server = loop.drafts["close"]
        propose = server.propose_batch

        async def stall(asks):
            overlapping[0] += running[0] > 0
            running[0] += 1
            calls[0] += 1
            try:
                if calls[0] == 4:
                    await asyncio.sleep(0.5)
                return await propose(asks)
            finally:
                running[0] -= 1

        server.propose_batch = stall

    outs, loop = run(target, draft, requests, loop_hook=stalling, draft_ahead=False)
    assert outs[0] == speculative_generate(Target(target), None, PROMPTS[1], 32, GREEDY).token_ids
    assert loop.late.get("close", 0) >= 2, loop.late   # plain steps while the stalled call ran
    assert overlapping[0] == 0, "a draft was asked again while its late call still ran"


def paced_draft(loop, seconds: float = 0.05) -> None:
    """The draft's calls take at least ``seconds``: a drafted position then costs several of the
    tiny target's verifies, however loaded the machine, and drafting ahead fits none."""
    server = loop.drafts["close"]
    propose = server.propose_batch

    async def paced(asks):
        started = time.perf_counter()
        out = await propose(asks)
        await asyncio.sleep(max(0.0, seconds - (time.perf_counter() - started)))
        return out

    server.propose_batch = paced


def test_nothing_is_drafted_ahead_that_does_not_fit_in_a_verify(target):
    """A verify much quicker than the draft's positions leaves no time to draft ahead in: none is asked."""
    draft = DraftLM("close", perturbed(target, seed=1, noise=0.1))
    outs, loop = run(target, draft, [SpecRequest(PROMPTS[0], 20, GREEDY, "close", 3, None, "quick")], verify_s=0.0,
                     loop_hook=paced_draft)
    assert outs[0] == speculative_generate(Target(target), None, PROMPTS[0], 20, GREEDY).token_ids
    assert loop.ahead.drafted <= 2, loop.ahead   # at most before the pace is known


def test_one_slow_verify_does_not_widen_what_is_drafted_ahead(target):
    """A verify delayed once (the host preempted, say) is not the next verify's length: the
    budget stays what the usual quick verify leaves, and nothing is drafted ahead after it."""
    draft = DraftLM("close", perturbed(target, seed=1, noise=0.1))
    verifies, drafted_before = [0], []

    def one_slow_verify(loop):
        paced_draft(loop)
        execute = loop.scheduler.execute

        def slow_once(*args):
            verifies[0] += 1
            if verifies[0] == 4:
                drafted_before.append(loop.ahead.drafted)
                time.sleep(0.5)
            return execute(*args)

        loop.scheduler.execute = slow_once

    outs, loop = run(target, draft, [SpecRequest(PROMPTS[0], 20, GREEDY, "close", 3, None, "slow")], verify_s=0.0,
                     loop_hook=one_slow_verify)
    assert outs[0] == speculative_generate(Target(target), None, PROMPTS[0], 20, GREEDY).token_ids
    assert verifies[0] > 5
    assert loop.ahead.drafted == drafted_before[0], (drafted_before, loop.ahead)   # nothing after the slow verify


def test_without_draft_ahead_nothing_is_drafted_ahead(target):
    draft = DraftLM("near", perturbed(target, seed=1))
    outs, loop = run(target, draft, [SpecRequest(PROMPTS[0], 20, GREEDY, "near", 3, None, "off")], draft_ahead=False)
    assert loop.ahead.drafted == 0
    assert outs[0] == speculative_generate(Target(target), None, PROMPTS[0], 20, GREEDY).token_ids


def test_a_chain_used_from_ahead_has_the_draft_rows_of_its_own_positions(target):
    """Each proposal taken from a chain drafted ahead carries, for each of its tokens, the draft's
    warped distribution at that token's own position of the request's context (the rows shifted
    past the bonus guess): the rejection sampler's q."""
    close = perturbed(target, seed=1, noise=0.02)
    # A low temperature: a chain drafted ahead is used only when the draft's guess of the bonus
    # token is the token the target samples, which at 0.5 was too rare for the test to see one.
    params = SamplingParams(temperature=0.2, top_k=30)
    draft = DraftLM("close", close)
    requests = [SpecRequest(PROMPTS[i % 2], 16, replace(params, seed=i), "close", 2, None, f"q{i}")
                for i in range(8)]
    used = []

    def record(loop):
        take = loop._take_ahead

        async def recording(plan):
            proposals = await take(plan)
            contexts = {s.id: list(s.context) for s in plan.decode}
            used.extend((contexts[rid], p) for rid, p in proposals.items())
            return proposals

        loop._take_ahead = recording

    run(target, draft, requests, loop_hook=record)
    assert used, "no chain drafted ahead was used"
    with torch.inference_mode():
        for context, proposal in used:
            assert proposal.draft_probs is not None and len(proposal.draft_probs) == len(proposal)
            for i, token in enumerate(proposal.tokens):
                q = logits_to_probs(close(torch.tensor([context + proposal.tokens[:i]])).logits[0, -1], params)
                torch.testing.assert_close(proposal.draft_probs[i], q, atol=1e-5, rtol=1e-4)
                assert q[token] > 0


RUNS = 3000


def exact_third(model, prompt: list[int], params: SamplingParams) -> torch.Tensor:
    """[V]: P(t3) under the target's warped distributions, summed over (t1, t2)."""
    with torch.inference_mode():
        first = logits_to_probs(model(torch.tensor([prompt])).logits[0, -1], params)
        second = logits_to_probs(model(torch.tensor([prompt + [t] for t in range(VOCAB)])).logits[:, -1], params)
        pairs = torch.tensor([prompt + [a, b] for a in range(VOCAB) for b in range(VOCAB)])
        third = torch.cat([logits_to_probs(model(chunk).logits[:, -1], params) for chunk in pairs.split(2048)])
    joint = (first[:, None] * second).flatten()
    return (joint[:, None] * third).sum(0)


# Low temperatures: a hit needs the draft's sampled guess of the sampled bonus token to be right,
# rare where the tiny model's distributions are flat.
@pytest.mark.parametrize("params", [SamplingParams(temperature=0.4), SamplingParams(temperature=0.5, top_p=0.9, top_k=20)],
                         ids=["t0.4", "warped"])
@pytest.mark.slow
def test_the_token_after_a_step_drafted_ahead_follows_the_target(target, params):
    """Window 1: a first step that accepts its draft token and whose bonus the draft guessed
    leaves the second step's proposal drafted ahead, so the third token is verified against a
    chain drafted ahead (its draft rows shifted by one) in a large share of the runs. Four tokens
    asked, so that the second step still has room for its draft token."""
    prompt = [4, 9, 12, 30, 4, 9]
    draft = DraftLM("close", perturbed(target, seed=1, noise=0.02))   # its guesses of sampled bonus tokens hit
    requests = [SpecRequest(prompt, 4, SamplingParams(params.temperature, params.top_p, params.top_k, seed=seed),
                            "close", 1, None, f"seed-{seed}") for seed in range(RUNS)]
    outs, loop = run(target, draft, requests, slots=16)
    counts = torch.zeros(VOCAB)
    for out in outs:
        counts[out[2]] += 1
    pvalue = chi_square_pvalue(counts, exact_third(target, prompt, params))
    assert pvalue > 1e-3, f"chi-square p={pvalue:.2e}"
    assert loop.ahead.used > RUNS // 20, loop.ahead
