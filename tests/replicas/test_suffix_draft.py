"""The suffix draft: the request's own index kept and extended across steps, the cluster's
outputs remembered within a bound, and the better of the two proposed."""

from specserve.replicas.drafts.suffix import SuffixDraft
from specserve.replicas.sampling import SamplingParams
from specserve.replicas.step import TreeShape

GREEDY = SamplingParams()


def test_a_requests_index_is_found_by_its_context_and_extended_not_rebuilt():
    draft = SuffixDraft(depth=6)
    context = [1, 2, 3, 4, 1, 2, 3]
    first = draft._own(context)
    assert draft._own(context + [4, 9]) is first and first.context == context + [4, 9]
    other = draft._own([1, 2, 3, 7])   # same opening, another request
    assert other is not first and other.context == [1, 2, 3, 7]
    assert draft.propose(context, 3, GREEDY, None).tokens == [4, 1, 2]   # it copies its own prompt


def test_what_another_request_produced_is_proposed_and_forgotten_past_the_bound():
    draft = SuffixDraft(depth=8, remembered_tokens=12)
    draft.remember([40, 41, 42, 43, 44, 45])
    proposal = draft.propose([7, 8, 40, 41, 42], 3, GREEDY, None)
    assert proposal.tokens == [43, 44, 45] and proposal.token_probs == [1.0, 1.0, 1.0]
    draft.remember([60, 61, 62, 63, 64, 65])
    draft.remember([70, 71, 72])                      # 15 tokens > 12: the first output leaves
    assert draft.propose([7, 8, 40, 41, 42], 3, GREEDY, None).tokens == []
    assert draft.cluster.root.count == 9


def test_the_higher_scoring_index_wins():
    draft = SuffixDraft(depth=8)
    draft.remember([1, 5, 6, 7, 8, 2])
    # The request's own matches [5, 6] (then 9, 1: two tokens deep for a 2-token match); the
    # cluster matches [1, 5, 6] and drafts three tokens deep: 3 expected accepted against 2.
    assert draft.propose([5, 6, 9, 1, 5, 6], 3, GREEDY, None).tokens == [7, 8, 2]
    assert draft.propose([5, 6, 9, 1, 5, 6], 2, GREEDY, None).tokens == [9, 1]   # a tie: its own
    tree = draft.propose_tree([5, 6, 9, 1, 5, 6], TreeShape(3, 2, 6))
    assert tree.tokens == [7, 8, 2] and tree.parents == [-1, 0, 1]
