import pytest

from specserve.replicas.drafts.prompt_lookup import PromptLookupDraft
from specserve.replicas.sampling import SamplingParams
from specserve.replicas.step import TreeShape

GREEDY = SamplingParams()


def test_copies_what_followed_the_longest_match():
    # suffix [1, 2, 3] occurs at the start, followed by 4, 5.
    draft = PromptLookupDraft(max_ngram=3)
    proposal = draft.propose([1, 2, 3, 4, 5, 9, 1, 2, 3], window=2, params=GREEDY, generator=None)
    assert proposal.tokens == [4, 5] and proposal.is_chain and proposal.draft_probs is None


def test_most_recent_match_wins_among_equal_lengths():
    # [7] is followed by 1 early and by 2 later; the later one is proposed first.
    draft = PromptLookupDraft(max_ngram=1)
    assert draft.continuations([7, 1, 7, 2, 7], length=1, limit=2) == [[2], [1]]


def test_window_truncates_at_the_end_of_the_context():
    draft = PromptLookupDraft()
    assert draft.propose([5, 6, 5], window=4, params=GREEDY, generator=None).tokens == [6, 5]


def test_no_match_proposes_nothing():
    assert len(PromptLookupDraft().propose([1, 2, 3], 4, GREEDY, None)) == 0


def test_tree_merges_shared_prefixes():
    # after [9]: "1 2", "1 3" and "4 5" -> root children 1 and 4, with 1 branching to 2 and 3.
    context = [9, 1, 2, 0, 9, 1, 3, 0, 9, 4, 5, 0, 9]
    tree = PromptLookupDraft(max_ngram=1).propose_tree(context, TreeShape(depth=2, top_k=3, budget=10))
    edges = {(tree.parents[i], tok) for i, tok in enumerate(tree.tokens)}
    one = tree.tokens.index(1)
    assert edges == {(-1, 4), (-1, 1), (one, 3), (one, 2), (tree.tokens.index(4), 5)}
    assert len(tree.tokens) == 5


def test_tree_respects_budget_and_top_k():
    context = [9, 1, 2, 0, 9, 3, 4, 0, 9, 5, 6, 0, 9]
    tree = PromptLookupDraft(max_ngram=1).propose_tree(context, TreeShape(depth=2, top_k=2, budget=3))
    assert len(tree.tokens) <= 3
    assert sum(p == -1 for p in tree.parents) <= 2


def test_bad_ngram_bounds():
    with pytest.raises(ValueError, match="min_ngram"):
        PromptLookupDraft(max_ngram=1, min_ngram=2)
