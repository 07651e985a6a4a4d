"""The target's verify waits for the device a fixed number of times, however many requests share
it: what each request reads (its argmaxes, draws, chain tests and bonus tokens, its processors'
check, its log-probabilities, its draft's checks) comes back in one read per kind for them all.

On the CPU the reads are counted (``tolist``, ``item``, ``bool``, ``int``, ``float`` on tensors)
with the paths a GPU takes forced; on CUDA the waits themselves (``SPECSERVE_TEST_DEVICE=cuda``)."""

import torch

from device_reads import reads
import specserve.replicas.target as target_module
from specserve.replicas.logits_processors import RowProcessors
from specserve.replicas.model import cpu_row_ops
from specserve.replicas.sampling import SamplingParams
from specserve.replicas.step import Proposal
from specserve.replicas.target import Target, VerifyItem
from tiny_models import DEVICE, VOCAB, tiny_model

PROMPT = [5, 6, 7, 8, 5, 6, 9, 10, 11, 5, 6]


def mix(first_slot: int) -> list[VerifyItem]:
    """Five requests of every kind a step batches: plain greedy; sampled, a point-mass chain;
    sampled, a chain drawn from the draft's q; greedy with a penalty and log-probabilities;
    seeded, a point-mass tree."""
    generator = torch.Generator(device=DEVICE).manual_seed(first_slot)
    q = torch.softmax(torch.randn(3, VOCAB, generator=generator, device=DEVICE), -1)
    penalized = SamplingParams(repetition_penalty=1.3)
    sampled = SamplingParams(temperature=0.8)
    seeded = SamplingParams(temperature=0.8, seed=first_slot)
    return [
        VerifyItem(first_slot, PROMPT, Proposal.chain([7, 8, 5]), SamplingParams()),
        VerifyItem(first_slot + 1, PROMPT, Proposal.chain([7, 8, 5]), sampled, sampled.generator(DEVICE)),
        VerifyItem(first_slot + 2, PROMPT, Proposal.chain([int(t) for t in q.argmax(-1)], draft_probs=q), sampled,
                   sampled.generator(DEVICE)),
        VerifyItem(first_slot + 3, PROMPT, Proposal.chain([7, 8]), penalized, logprobs=2,
                   processors=RowProcessors(penalized, len(PROMPT), frozenset({2}))),
        VerifyItem(first_slot + 4, PROMPT, Proposal([7, 9, 8], [-1, -1, 0]), seeded, seeded.generator(DEVICE)),
    ]


def reads_of(target: Target, items: list[VerifyItem]) -> int:
    results, count = reads(lambda: target.verify(items), DEVICE)
    assert all(r.error is None and r.emitted_tokens for r in results), results
    return count


def test_a_verify_reads_as_often_for_fifteen_requests_as_for_five(monkeypatch):
    if DEVICE.type != "cuda":   # the CPU's own paths read per request where that is cheaper
        monkeypatch.setattr(cpu_row_ops, "usable", lambda rows: False)
        monkeypatch.setattr(target_module, "draws_every_row", lambda rows: True)
    model = tiny_model("llama", seed=0)
    target = Target(model, slots=15)
    for warm in (mix(0), mix(0) + mix(5) + mix(10)):   # caches, both batches' graphs and constants made
        target.verify(warm)
    five = reads_of(target, mix(0))
    fifteen = reads_of(target, mix(0) + mix(5) + mix(10))
    assert fifteen == five, (five, fifteen)
    assert five <= 8, five
