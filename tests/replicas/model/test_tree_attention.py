import random

import pytest
import torch

from specserve.replicas.model.tree_attention import ancestor_matrix, node_depths, tree_attention_mask, tree_position_ids

#      root(-1)
#      /     \
#     0       1
#     |
#     2
PARENTS = [-1, -1, 0]


def test_depths():
    assert node_depths(PARENTS) == [1, 1, 2]


def test_mask_allows_prefix_ancestors_and_self_only():
    mask = tree_attention_mask(PARENTS, past_len=2, first_fed=0, dtype=torch.float32)
    assert mask.shape == (1, 1, 3, 5)
    allowed = (mask[0, 0] == 0).int().tolist()
    # columns: 2 cached tokens, then nodes 0, 1, 2
    assert allowed == [
        [1, 1, 1, 0, 0],
        [1, 1, 0, 1, 0],
        [1, 1, 1, 0, 1],
    ]
    assert mask[0, 0, 0, 3] == torch.finfo(torch.float32).min


def test_mask_for_a_later_chunk_keeps_full_width():
    # nodes 0 and 1 already cached; only node 2 is fed.
    mask = tree_attention_mask(PARENTS, past_len=2, first_fed=2, dtype=torch.float32)
    assert (mask[0, 0] == 0).int().tolist() == [[1, 1, 1, 0, 1]]


def test_positions_follow_depth():
    assert tree_position_ids(PARENTS, past_len=7, first_fed=0).tolist() == [[7, 7, 8]]
    assert tree_position_ids(PARENTS, past_len=7, first_fed=2).tolist() == [[8]]


@pytest.mark.parametrize("n", [0, 1, 7, 8, 9, 61, 300])
def test_each_row_marks_the_node_and_its_ancestors_walked_up_its_path(n):
    """Trees of every size around a byte's bits (rows are packed eight nodes a byte)."""
    rng = random.Random(n)
    parents = [rng.randrange(-1, i) for i in range(n)]
    want = torch.zeros(n, n, dtype=torch.bool)
    for i in range(n):
        node = i
        while node >= 0:
            want[i, node] = True
            node = parents[node]
    assert torch.equal(ancestor_matrix(parents), want)
    with pytest.raises(ValueError, match="parents must come before children"):
        ancestor_matrix(parents + [n])
