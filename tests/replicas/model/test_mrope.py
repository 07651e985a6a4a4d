"""M-RoPE positions from a slot's tokens: a picture's tokens on its grid, the text after it resumed
at the grid's longer side, whatever the chunks the prompt arrives in."""

import pytest

from specserve.replicas.model.image_tokens import Grid, grid_ids
from specserve.replicas.model.mrope import MRope, section_dims


def picture(digest: int, rows: int = 2, columns: int = 2) -> list[int]:
    return grid_ids(digest, Grid(rows * columns, columns))


def test_a_pictures_tokens_sit_on_its_grid_and_the_text_after_resumes_side_later():
    mrope = MRope([1, 1, 2], head_dim=8)
    tokens = [7, 8, *picture(5), 9, *picture(6), 10]
    p, dh, dw = mrope.positions([], tokens, list(range(1, len(tokens) + 1)))
    assert p == [0, 1, 2, 2, 2, 2, 4, 5, 5, 5, 5, 7]
    assert dh == [0, 0, 0, 0, 1, 1, 0, 0, 0, 1, 1, 0] and dw == [0, 0, 0, 1, 0, 1, 0, 0, 1, 0, 1, 0]


def test_a_wide_picture_resumes_the_text_after_its_longer_side():
    mrope = MRope([1, 1, 2], head_dim=8)
    tokens = [7, *picture(5, rows=2, columns=3), 9, *picture(6, rows=3, columns=1), 10]
    p, dh, dw = mrope.positions([], tokens, list(range(1, len(tokens) + 1)))
    assert p == [0, 1, 1, 1, 1, 1, 1, 4, 5, 5, 5, 8]
    assert dh == [0, 0, 0, 0, 1, 1, 1, 0, 0, 1, 2, 0] and dw == [0, 0, 1, 2, 0, 1, 2, 0, 0, 0, 0, 0]


def test_positions_do_not_depend_on_where_the_chunks_end():
    mrope = MRope([1, 1, 2], head_dim=8)
    tokens = [1, *picture(3, 3, 3), 2, 3, *picture(4, 2, 4), *picture(4, 2, 4), *picture(5, 4, 1), 4]
    whole = mrope.positions([], tokens, list(range(1, len(tokens) + 1)))
    for cut in range(1, len(tokens)):
        head = mrope.positions([], tokens[:cut], list(range(1, cut + 1)))
        tail = mrope.positions(tokens[:cut], tokens[cut:], list(range(1, len(tokens) - cut + 1)))
        assert tuple(a + b for a, b in zip(head, tail)) == whole, cut


def test_a_trees_nodes_share_the_position_of_their_depth():
    mrope = MRope([1, 1, 2], head_dim=8)
    cached = [7, *picture(5), 9]                      # the next text position: 1 + 2 + 1 = 4
    p, dh, dw = mrope.positions(cached, [11, 12, 13, 14], [1, 2, 2, 3])
    assert p == [4, 5, 5, 6] and dh == dw == [0, 0, 0, 0]
    ends_on_a_picture = [7, *picture(5, 2, 3)]        # the picture ends where the tree starts: 1 + 3
    assert mrope.positions(ends_on_a_picture, [11, 12], [1, 1])[0] == [4, 4]
    with pytest.raises(ValueError, match="chain"):
        mrope.positions([], [1, *picture(5)], [1, 2, 2, 2, 2])


def test_sections_pick_the_h_and_w_dimensions_in_both_halves():
    h, w = section_dims([1, 1, 2], head_dim=8)
    assert h.tolist() == [False, True, False, False] * 2 and w.tolist() == [False, False, True, True] * 2


def test_the_walk_over_a_slots_cache_counts_as_token_by_token():
    """The cached prefix's walk (numpy over the ids) leaves the same state as taking each token:
    random text and pictures of random grids, one shown twice in a row, cut anywhere."""
    import random

    from specserve.replicas.model.mrope import _Walk

    rng = random.Random(0)
    for _ in range(200):
        tokens: list[int] = []
        for _ in range(rng.randint(0, 6)):
            tokens += [rng.randint(1, 50) for _ in range(rng.randint(0, 4))]
            shown = picture(rng.randint(1, 3), rng.randint(1, 4), rng.randint(1, 4))
            tokens += shown * rng.choice((1, 1, 2))
        cut = rng.randint(0, len(tokens))
        stepped = _Walk()
        for t in tokens[:cut]:
            stepped.take(t)
        bulk = _Walk.after(tokens[:cut])
        assert (bulk.next, bulk.picture) == (stepped.next, stepped.picture), tokens[:cut]
