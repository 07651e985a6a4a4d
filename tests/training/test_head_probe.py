"""The offline per-position probe counts what the drafting path would accept."""

import pytest
import torch

from specserve.replicas.drafts.hsr_draft import HSRSession
from specserve.training.head_probe import PositionReport, offline_reach
from tiny_hsr import trained_hsr_head
from tiny_models import tiny_model

STEPS = 4


@pytest.fixture(scope="module")
def target():
    return tiny_model("llama", seed=3)


@pytest.fixture(scope="module")
def head(target):
    return trained_hsr_head(target)


def drafted_depth(head, tokens: list[int], features: torch.Tensor, q: int) -> int:
    """How many of its greedy drafts from the exact feature at ``q`` (token q + 1 known) the
    drafting path (``HSRSession``, ``head.step``) gets right, feeding its own tokens."""
    device = head.device
    session = HSRSession(head)
    session.sync(tokens[: q + 2], features[: q + 1], 0)
    hidden, keys, values = session.root_hidden(), session.keys, session.values
    ids = head.head_token_ids(device)
    for i in range(STEPS):
        token = int(ids[head.head_logits(hidden[0, -1]).argmax()])
        if q + 2 + i >= len(tokens) or token != tokens[q + 2 + i]:
            return i
        z = head.inputs(torch.tensor([[token]], device=device), hidden)
        hidden, k, v = head.step(z, torch.tensor([q + 2 + i], device=device), keys, values)
        keys, values = torch.cat([keys, k], 2), torch.cat([values, v], 2)
    return STEPS


@torch.no_grad()
def test_offline_reach_counts_the_chains_drafting_gets_right(target, head):
    # The target's own greedy continuation, so the head has chains worth counting.
    tokens = [5, 17, 3, 29, 11]
    for _ in range(40):
        logits = target(torch.tensor([tokens], device=target.device)).logits[0, -1]
        tokens.append(int(logits.argmax()))
    prompt_len = 5
    reach = offline_reach(target, head, tokens, prompt_len, STEPS)
    features = target(torch.tensor([tokens], device=target.device), output_hidden_states=True).hidden_states[-2][0]
    depths = [drafted_depth(head, tokens, features, q) for q in range(prompt_len - 1, len(tokens) - 1 - STEPS)]
    assert reach == [sum(d >= k for d in depths) for k in range(STEPS + 1)]
    assert reach[1] > 0, "a trained head gets some first tokens right"


def test_alpha_and_tau_follow_from_reach():
    report = PositionReport(3, reach=[100, 60, 30, 6])
    assert report.alpha == [0.6, 0.5, 0.2]
    assert report.tau(2) == 1.9 and report.tau(3) == pytest.approx(1.96)
