"""The suffix array: the trie's counts from sorted positions, and the same speculation over one
array or several as the trie gives over all their sequences."""

import random

import numpy as np
import pytest

from specserve.replicas.drafts.suffix_array import SuffixArray, SuffixArrays
from specserve.replicas.drafts.suffix_index import SuffixIndex
from test_suffix_index import dump


def sequences(rng: random.Random, count: int, vocab: int = 6) -> list[list[int]]:
    # A small vocabulary, so that strings repeat and continuations branch.
    return [[rng.randrange(vocab) for _ in range(rng.randrange(1, 30))] for _ in range(count)]


def array_counts(array: SuffixArray, lo: int, hi: int, offset: int, prefix=()) -> dict:
    out = {}
    for tok, start, end in zip(*(a.tolist() for a in array.continuations(lo, hi, offset))):
        out[prefix + (tok,)] = end - start
        out.update(array_counts(array, start, end, offset + 1, prefix + (tok,)))
    return out


def test_every_string_counts_its_occurrences_as_in_the_trie():
    rng = random.Random(0)
    seqs = sequences(rng, 40)
    trie = SuffixIndex(depth=5)
    for s in seqs:
        trie.add(s)
    array = SuffixArray(seqs, depth=5)
    assert array.tokens == sum(map(len, seqs))
    # Top level: the array's first column holds every position, the trie's root every window.
    assert array_counts(array, 0, array.tokens, 0) == dump(trie.root)


def test_no_window_crosses_two_sequences_and_the_sequences_come_back():
    array = SuffixArray([[1, 2, 3], [4, 5], [], [3, 4]], depth=4)
    lo, hi = array.find([3, 4])
    assert hi - lo == 1                          # only the last sequence's: [1, 2, 3] ends before [4, 5]
    assert array.find([2, 3, 4])[0] == array.find([2, 3, 4])[1]
    assert [a.tolist() for a in array.token_arrays()] == [[1, 2, 3], [4, 5], [3, 4]]
    lo, hi = array.find([5])
    assert [len(a) for a in array.continuations(lo, hi, 1)] == [0, 0, 0]   # a sequence's end: no child


def test_speculation_over_arrays_equals_the_tries_over_all_their_sequences():
    rng = random.Random(1)
    for trial in range(30):
        seqs = sequences(rng, 12)
        split = rng.randrange(len(seqs) + 1)
        arrays = SuffixArrays([SuffixArray(seqs[:split], depth=8), SuffixArray(seqs[split:], depth=8)])
        trie = SuffixIndex(depth=8)
        for s in seqs:
            trie.add(s)
        for _ in range(10):
            context = [rng.randrange(6) for _ in range(rng.randrange(1, 12))]
            top_k, budget = rng.choice([(1, 4), (2, 6), (3, 8)])
            want = trie.speculate(context, budget, 1.0, 0.05, top_k, max_depth=4)
            got = arrays.speculate(context, budget, 1.0, 0.05, top_k, max_depth=4)
            assert (got.tokens, got.parents, got.match_len) == (want.tokens, want.parents, want.match_len), (trial, context)
            assert np.allclose(got.scores, want.scores)


def test_empty_arrays_speculate_nothing():
    assert SuffixArrays([SuffixArray([], depth=6)]).speculate([1, 2], 4).tokens == []
    assert SuffixArrays([]).speculate([1, 2], 4).tokens == []


def test_the_c_kernel_finds_and_splits_exactly_as_numpy_does():
    rng = random.Random(2)
    seqs = sequences(rng, 60, vocab=9)
    fast, slow = SuffixArray(seqs, depth=6), SuffixArray(seqs, depth=6)
    if fast._c is None:
        pytest.skip("no C compiler here: numpy is the only path")
    slow._c = None
    for _ in range(300):
        pattern = [rng.randrange(9) for _ in range(rng.randrange(1, 6))]
        found = [(lo, hi) if hi > lo else "empty" for lo, hi in (fast.find(pattern), slow.find(pattern))]
        assert found[0] == found[1], pattern
        lo, hi = fast.find(pattern[:-1]) if len(pattern) > 1 else (0, fast.tokens)
        offset = len(pattern) - 1
        got, want = fast.continuations(lo, hi, offset), slow.continuations(lo, hi, offset)
        assert all(np.array_equal(g, w) for g, w in zip(got, want)), pattern
