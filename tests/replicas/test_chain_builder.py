"""A greedy chain's token, its probability and its runner-up (``ChainBuilder``), read from the
device once a token: the argmax (the first of equal maxima), softmax at it, and the next best,
over the full vocabulary or a pruned head's tokens mapped to their ids."""

import pytest
import torch

from specserve.replicas.drafts.base import ChainBuilder, draft_chain
from specserve.replicas.drafts.hsr_head import HSRConfig, HSRHead
from specserve.replicas.sampling import SamplingParams
from tiny_models import DEVICE

GREEDY = SamplingParams()


def chosen(logits: list[float], head=None) -> tuple[int, float, int]:
    chain = ChainBuilder(GREEDY, None, head)
    tok = chain.choose(torch.tensor(logits, device=DEVICE))
    return tok, chain.token_probs[0], chain.alternatives[0]


def softmax_at(logits: list[float], i: int) -> float:
    return float(torch.softmax(torch.tensor(logits), -1)[i])


@pytest.mark.parametrize("logits, tok, alternative", [
    ([1.0, 5.0, 3.0, 2.0], 1, 2),
    ([5.0, 5.0, 1.0], 0, 1),          # equal maxima: the first is chosen, the other is the runner-up
    ([0.5, 2.0, 2.0 - 1e-3, -4.0], 1, 2),
    ([2.0], 0, -1),                   # one token: no runner-up
], ids=["plain", "tied", "close", "one-token"])
def test_a_greedy_token_its_probability_and_runner_up(logits, tok, alternative):
    assert chosen(logits) == (tok, pytest.approx(softmax_at(logits, tok), abs=1e-7), alternative)


def test_a_pruned_heads_picks_are_its_tokens_ids():
    ids = [7, 30, 12, 41]
    head = HSRHead(HSRConfig(vocab_size=50, hidden_size=16, intermediate_size=32, num_attention_heads=2,
                             num_key_value_heads=1, head_token_ids=ids)).to(DEVICE)
    logits = [0.1, 0.2, 3.0, 1.5]   # the head's own K rows
    assert chosen(logits, head) == (12, pytest.approx(softmax_at(logits, 2), abs=1e-7), 41)


def test_a_chain_feeds_each_choice_to_the_next_step():
    rows = {None: [0.0, 4.0, 1.0], 1: [3.0, 0.0, 2.0], 0: [0.0, 1.0, 2.5]}
    fed = []

    def next_logits(tok: int) -> torch.Tensor:
        fed.append(tok)
        return torch.tensor(rows[tok], device=DEVICE)

    proposal = draft_chain(torch.tensor(rows[None], device=DEVICE), 3, GREEDY, None, next_logits)
    assert proposal.tokens == [1, 0, 2] and fed == [1, 0] and proposal.alternatives == [2, 2, 1]
    assert proposal.token_probs == pytest.approx([softmax_at(rows[None], 1), softmax_at(rows[1], 0),
                                                  softmax_at(rows[0], 2)], abs=1e-7)
