"""The suffix index: counts of every window, its token-by-token extension, and speculation from
the longest match with the paper's scores and adaptive length."""

import random

import pytest

from specserve.replicas.drafts.suffix_index import SuffixIndex


def dump(node, prefix=()) -> dict:
    """{path: count} of every node below ``node``."""
    out = {}
    for tok, child in node.children.items():
        out[prefix + (tok,)] = child.count
        out.update(dump(child, prefix + (tok,)))
    return out


def test_each_node_counts_the_positions_where_its_string_occurs():
    index = SuffixIndex(depth=4)
    index.add([1, 2, 3, 1, 2, 4])
    paths = dump(index.root)
    assert index.root.count == 6
    assert paths[(1, 2)] == 2 and paths[(1, 2, 3)] == 1 and paths[(1, 2, 4)] == 1
    assert paths[(2, 3, 1, 2)] == 1 and (2, 3, 1, 2, 4) not in paths   # windows stop at depth
    assert index.nodes == 1 + len(paths)


def test_removing_what_was_added_frees_every_node():
    index = SuffixIndex(depth=5)
    a, b = [5, 6, 7, 5, 6, 8, 9], [6, 7, 5, 1]
    index.add(a)
    index.add(b)
    index.remove(a)
    only_b = SuffixIndex(depth=5)
    only_b.add(b)
    assert dump(index.root) == dump(only_b.root) and index.nodes == only_b.nodes
    index.remove(b)
    assert index.root.count == 0 and not index.root.children and index.nodes == 1
    with pytest.raises(KeyError):
        index.remove([3])


@pytest.mark.parametrize("depth", [2, 3, 8])
def test_extending_token_by_token_builds_what_adding_the_whole_builds(depth):
    rng = random.Random(depth)
    tokens = [rng.randrange(6) for _ in range(120)]
    whole, grown = SuffixIndex(depth), SuffixIndex(depth)
    whole.add(tokens)
    at = 0
    while at < len(tokens):   # in pieces of 1-5 tokens, as steps accept them
        step = rng.randint(1, 5)
        grown.extend(tokens[at:at + step])
        at += step
    assert dump(grown.root) == dump(whole.root) and grown.nodes == whole.nodes
    assert grown.context == tokens


def test_the_longest_suffix_with_a_continuation_is_matched():
    index = SuffixIndex(depth=8)
    index.add([1, 2, 3, 4, 9, 3, 4, 7])
    node, length = index.match([0, 2, 3, 4])   # [2, 3, 4] occurs, followed by 9
    assert length == 3 and set(node.children) == {9}
    node, length = index.match([0, 0, 3, 4])   # only [3, 4]: followed by 9 once and 7 once
    assert length == 2 and set(node.children) == {9, 7}
    assert index.match([0, 8]) == (None, 0)
    assert index.match([4, 7]) == (None, 0)    # [7] ends the sequence: no continuation


def test_a_chain_follows_the_most_frequent_continuation_while_its_score_holds():
    index = SuffixIndex(depth=8)
    for tail in ([3, 4], [3, 4], [3, 5], [6, 7]):
        index.add([1, 2, *tail])
    spec = index.speculate([9, 1, 2], max_tokens=4, max_spec_factor=2.0, min_token_prob=0.1)
    assert spec.match_len == 2 and spec.tokens == [3, 4] and spec.parents == [-1, 0]
    assert spec.scores == pytest.approx([0.75, 0.75 * 2 / 3])
    assert spec.score == pytest.approx(1.25)   # expected accepted tokens
    strict = index.speculate([9, 1, 2], max_tokens=4, max_spec_factor=2.0, min_token_prob=0.6)
    assert strict.tokens == [3]


def test_a_short_match_drafts_only_as_deep_as_the_spec_factor_allows():
    index = SuffixIndex(depth=16)
    index.add([5, 1, 2, 3, 4, 5, 6])
    assert index.speculate([8, 8, 5], max_tokens=8, max_spec_factor=1.0).tokens == [1]
    assert index.speculate([8, 8, 5], max_tokens=8, max_spec_factor=3.0).tokens == [1, 2, 3]
    assert index.speculate([4, 5], max_tokens=8, max_spec_factor=3.0).tokens == [6]   # the end of what was seen
    assert index.speculate([7], max_tokens=8).tokens == []


def test_a_tree_grows_best_first_and_its_score_sums_its_paths():
    index = SuffixIndex(depth=8)
    for tail in ([3, 4], [3, 4], [3, 5], [6, 7]):
        index.add([1, 2, *tail])
    spec = index.speculate([1, 2], max_tokens=3, max_spec_factor=2.0, min_token_prob=0.0, top_k=2)
    # 3 (0.75), then 3's child 4 (0.5) before 6 (0.25): best first across branches.
    assert spec.tokens == [3, 4, 6] and spec.parents == [-1, 0, -1]
    assert spec.scores == pytest.approx([0.75, 0.5, 0.25]) and spec.score == pytest.approx(1.5)


def test_a_long_match_leaves_the_trie_room_to_draft():
    # depth 6: a 5-token match would leave 1 token below it; the match is cut to leave the 3 asked.
    index = SuffixIndex(depth=6)
    seq = [1, 2, 3, 4, 5, 6, 7, 8, 9]
    index.add(seq)
    spec = index.speculate([1, 2, 3, 4, 5], max_tokens=3, max_spec_factor=2.0)
    assert spec.match_len == 3 and spec.tokens == [6, 7, 8]
