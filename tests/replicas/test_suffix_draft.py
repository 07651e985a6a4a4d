"""The suffix draft: the request's own index kept and extended across steps, the cluster's
outputs remembered per tenant within a bound, and the better of the two proposed."""

from specserve.replicas.drafts.base import propose
from specserve.replicas.drafts.suffix import SuffixDraft
from specserve.replicas.sampling import SamplingParams
from specserve.replicas.step import ProposeRequest, TreeShape

GREEDY = SamplingParams()


def test_a_requests_index_is_found_by_its_context_and_extended_not_rebuilt():
    draft = SuffixDraft(depth=6)
    context = [1, 2, 3, 4, 1, 2, 3]
    first = draft._own(context)
    assert draft._own(context + [4, 9]) is first and first.context == context + [4, 9]
    other = draft._own([1, 2, 3, 7])   # same opening, another request
    assert other is not first and other.context == [1, 2, 3, 7]
    assert draft.propose(context, 3, GREEDY, None).tokens == [4, 1, 2]   # it copies its own prompt


def test_what_another_request_produced_is_proposed_once_built_and_forgotten_past_the_bound():
    draft = SuffixDraft(depth=8, remembered_tokens=12, recent_tokens=8)
    draft.remember([40, 41, 42, 43, 44, 45])
    assert draft.propose([7, 8, 40, 41, 42], 3, GREEDY, None).tokens == []   # queued, not built yet
    draft.refresh()
    proposal = draft.propose([7, 8, 40, 41, 42], 3, GREEDY, None)
    assert proposal.tokens == [43, 44, 45] and proposal.token_probs == [1.0, 1.0, 1.0]
    draft.remember([60, 61, 62, 63, 64, 65])
    draft.remember([70, 71, 72])       # 15 tokens > 8 recent: a merge keeps the newest 12 or fewer
    draft.refresh()
    assert draft.remembered == 9
    assert draft.propose([7, 8, 40, 41, 42], 3, GREEDY, None).tokens == []
    assert draft.propose([5, 60, 61, 62], 3, GREEDY, None).tokens == [63, 64, 65]


def test_outputs_queued_while_a_build_runs_join_the_next_one():
    draft = SuffixDraft(depth=8)
    draft.remember([1, 2, 3, 4])
    builds = draft.pending()
    draft.remember([5, 6, 7, 8])       # arrives while the first build runs elsewhere
    draft.install(draft.build(builds))
    assert draft.propose([9, 1, 2], 2, GREEDY, None).tokens == [3, 4]
    assert draft.propose([9, 5, 6], 2, GREEDY, None).tokens == []
    draft.refresh()
    assert draft.propose([9, 5, 6], 2, GREEDY, None).tokens == [7, 8] and draft.remembered == 8


def test_a_tenant_drafts_from_its_own_outputs_and_the_seed_only():
    draft = SuffixDraft(depth=8, seed=[[20, 21, 22, 23]])
    draft.remember([40, 41, 42, 43], cache_salt="a")
    draft.refresh()
    assert draft.propose([9, 40, 41], 2, GREEDY, None, cache_salt="a").tokens == [42, 43]
    assert draft.propose([9, 40, 41], 2, GREEDY, None, cache_salt="b").tokens == []
    assert draft.propose([9, 40, 41], 2, GREEDY, None).tokens == []          # None is a tenant too
    for salt in ("a", "b", None):
        assert draft.propose([9, 20, 21], 2, GREEDY, None, cache_salt=salt).tokens == [22, 23]


def test_the_request_tells_the_draft_its_salt():
    draft = SuffixDraft(depth=8)
    draft.remember([40, 41, 42, 43], cache_salt="a")
    draft.refresh()
    ask = ProposeRequest("s", [9, 40, 41], 2, None, GREEDY, cache_salt="a")
    assert propose(draft, ask, None).tokens == [42, 43]
    assert propose(draft, ProposeRequest("t", [9, 40, 41], 2, None, GREEDY, cache_salt="b"), None).tokens == []


def test_the_least_recently_used_tenant_is_forgotten_past_the_tenant_bound():
    draft = SuffixDraft(depth=8, salts=2)
    for salt in ("a", "b", "c"):
        draft.remember([40, 41, 42], cache_salt=salt)
    draft.refresh()
    assert draft.propose([40, 41], 1, GREEDY, None, cache_salt="a").tokens == []
    assert draft.propose([40, 41], 1, GREEDY, None, cache_salt="c").tokens == [42]


def test_the_higher_scoring_index_wins():
    draft = SuffixDraft(depth=8)
    draft.remember([1, 5, 6, 7, 8, 2])
    draft.refresh()
    # The request's own matches [5, 6] (then 9, 1: two tokens deep for a 2-token match); the
    # cluster matches [1, 5, 6] and drafts three tokens deep: 3 expected accepted against 2.
    assert draft.propose([5, 6, 9, 1, 5, 6], 3, GREEDY, None).tokens == [7, 8, 2]
    assert draft.propose([5, 6, 9, 1, 5, 6], 2, GREEDY, None).tokens == [9, 1]   # a tie: its own
    tree = draft.propose_tree([5, 6, 9, 1, 5, 6], TreeShape(3, 2, 6))
    assert tree.tokens == [7, 8, 2] and tree.parents == [-1, 0, 1]
