"""A chain's tokens (``ChainBuilder``): greedy, the argmax (the first of equal maxima), softmax at
it and the next best, over the full vocabulary or a pruned head's tokens mapped to their ids;
read token by token, or once at the chain's end (fed on the device), alike."""

import pytest
import torch

from device_reads import reads
from specserve.replicas.drafts.base import ChainBuilder, draft_chain
from specserve.replicas.drafts.hsr_head import HSRConfig, HSRHead
from specserve.replicas.sampling import NonFiniteScores, SamplingParams
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


def rows_after(token: int, vocab: int) -> torch.Tensor:
    """Logits that depend on the token fed: a chain that fed another token sees other rows."""
    generator = torch.Generator().manual_seed(1000 + token)
    return torch.randn(vocab, generator=generator).to(DEVICE)


def chain_of(window: int, params: SamplingParams, unread: bool, head=None, vocab: int = 50, seed: int = 4):
    fed = []

    def next_logits(tok) -> torch.Tensor:
        token = int(tok) if unread else tok   # the test reads what a draft would feed on the device
        fed.append(token)
        return rows_after(token, vocab)

    generator = None if params.greedy else torch.Generator(DEVICE).manual_seed(seed)
    proposal = draft_chain(rows_after(-1, vocab), window, params, generator, next_logits, head, unread=unread)
    return proposal, fed


@pytest.mark.parametrize("params", [GREEDY, SamplingParams(temperature=0.8), SamplingParams(temperature=1.0, top_k=5)],
                         ids=["greedy", "sampled", "top-k"])
@pytest.mark.parametrize("pruned", [False, True], ids=["full", "pruned-head"])
def test_a_chain_read_at_its_end_is_the_chain_read_token_by_token(params, pruned):
    """The same tokens fed, the same draws in the same order, the same probabilities, runner-ups
    and draft rows."""
    head = None
    if pruned:
        head = HSRHead(HSRConfig(vocab_size=60, hidden_size=16, intermediate_size=32, num_attention_heads=2,
                                 num_key_value_heads=1, head_token_ids=list(range(10, 60)))).to(DEVICE)
    want, fed = chain_of(6, params, unread=False, head=head)
    got, fed_unread = chain_of(6, params, unread=True, head=head)
    assert got.tokens == want.tokens and fed_unread == fed == want.tokens[:-1]
    assert got.token_probs == pytest.approx(want.token_probs, abs=1e-12)
    assert got.alternatives == want.alternatives
    if params.greedy:
        assert got.draft_probs is None and want.draft_probs is None
    else:
        assert torch.equal(got.draft_probs, want.draft_probs)
        assert [float(got.draft_probs[i, t]) for i, t in enumerate(got.tokens)] == pytest.approx(got.token_probs)


@pytest.mark.parametrize("unread", [False, True], ids=["token-by-token", "at-the-end"])
def test_a_draft_whose_q_is_not_a_distribution_fails_its_proposal(unread):
    fed = []

    def next_logits(tok) -> torch.Tensor:
        fed.append(int(tok))
        return torch.full((50,), float("nan"), device=DEVICE)

    with pytest.raises(NonFiniteScores):
        draft_chain(rows_after(-1, 50), 4, SamplingParams(temperature=0.8), torch.Generator(DEVICE).manual_seed(0),
                    next_logits, unread=unread)
    assert all(0 <= token < 50 for token in fed)   # what was fed on the device was an id still


@pytest.mark.parametrize("params", [GREEDY, SamplingParams(temperature=0.8)], ids=["greedy", "sampled"])
def test_a_chain_read_at_its_end_reads_the_device_once(params):
    table = torch.randn(50, 50, generator=torch.Generator().manual_seed(0)).to(DEVICE)

    def unread_chain(window: int):
        generator = None if params.greedy else torch.Generator(DEVICE).manual_seed(0)
        # The token stays on the device: the next step's rows follow from it there.
        return draft_chain(table[0], window, params, generator, lambda tok: table.index_select(0, tok)[0], unread=True)

    for window in (2, 7):
        proposal, count = reads(lambda: unread_chain(window), DEVICE)
        assert count == 1 and len(proposal.tokens) == window
