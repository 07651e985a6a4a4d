"""M-RoPE positions from a slot's tokens: a picture's tokens on its grid, a clip's temporal
patches at their times (a step apart, or by the clip's frame rate), the text after either
resumed at the grid's longer side, whatever the chunks the prompt arrives in; as Hugging Face's
Qwen2-VL and Qwen2.5-VL place them."""

import pytest
import torch

from specserve.replicas.model.image_tokens import Grid, continuing, grid_ids
from specserve.replicas.model.mrope import MRope, section_dims
from specserve.replicas.pictures import clip_times


def picture(digest: int, rows: int = 2, columns: int = 2) -> list[int]:
    return grid_ids(digest, Grid(rows * columns, columns))


def clip(digests: list[int], rows: int = 2, columns: int = 2, times: list[int] | None = None) -> list[int]:
    """A clip of ``len(digests)`` temporal patches at ``times`` (0, 1, 2, ... unless given): the
    first a unit of its own, each next one continuing it."""
    times = list(range(len(digests))) if times is None else times
    return [t for k, d in enumerate(digests)
            for t in picture(continuing(d, times[k] - times[k - 1]) if k else d, rows, columns)]


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


def test_a_clips_patches_step_in_time_on_one_grid_and_the_text_resumes_after_its_side():
    mrope = MRope([1, 1, 2], head_dim=8)
    tokens = [7, *clip([5, 6, 5], rows=1, columns=2), 9]
    p, dh, dw = mrope.positions([], tokens, list(range(1, len(tokens) + 1)))
    # patch k's token (r, c): t = 1 + k, h = 1 + r, w = 1 + c; the text resumes at 1 + 2
    assert [p[i] for i in range(len(tokens))] == [0, 1, 1, 2, 2, 3, 3, 3]
    assert [a + b for a, b in zip(p, dh)] == [0, 1, 1, 1, 1, 1, 1, 3]
    assert [a + b for a, b in zip(p, dw)] == [0, 1, 2, 1, 2, 1, 2, 3]


def test_positions_equal_hugging_faces_qwen2_vl_for_pictures_and_clips():
    from tiny_models import tiny_qwen2_vl

    model = tiny_qwen2_vl(seed=0)
    rope_index = model.model.get_rope_index
    mrope = MRope.of(model.model.language_model) or MRope([1, 1, 2], head_dim=8)
    # (kind, rows, columns, patches): text runs between them
    shown = [("image", 2, 3, 1), ("video", 2, 2, 3), ("video", 3, 1, 2), ("image", 1, 4, 1)]
    tokens, kinds, image_grids, video_grids, digest = [1, 2], [0, 0], [], [], 10
    for kind, rows, columns, patches in shown:
        units = (clip(list(range(digest, digest + patches)), rows, columns) if kind == "video"
                 else picture(digest, rows, columns))
        digest += patches
        tokens += units + [3, 4]
        kinds += [1 if kind == "image" else 2] * len(units) + [0, 0]
        (image_grids if kind == "image" else video_grids).append([patches, 2 * rows, 2 * columns])
    ids = torch.tensor([[1] * len(tokens)])
    theirs, _ = rope_index(ids, torch.tensor([kinds]), image_grid_thw=torch.tensor(image_grids),
                           video_grid_thw=torch.tensor(video_grids))
    p, dh, dw = mrope.positions([], tokens, list(range(1, len(tokens) + 1)))
    ours = [p, [a + b for a, b in zip(p, dh)], [a + b for a, b in zip(p, dw)]]
    assert ours == theirs[:, 0].tolist()


def test_a_clips_patches_sit_at_their_times_and_a_still_pair_shares_one():
    mrope = MRope([1, 1, 2], head_dim=8)
    tokens = [7, *clip([5, 6, 5, 6], rows=1, columns=5, times=[0, 0, 2, 3]), 9]
    p, _, _ = mrope.positions([], tokens, list(range(1, len(tokens) + 1)))
    assert p == [0] + [1] * 10 + [3] * 5 + [4] * 5 + [6]


def test_positions_equal_hugging_faces_qwen2_5_vl_for_clips_at_their_frame_rates():
    """Qwen2.5-VL's patch k sits at k · tokens_per_second · 2 / fps (rounded down in float32), the
    text after resuming at the grid's longer side."""
    from transformers import Qwen2_5_VLConfig, Qwen2_5_VLModel

    from tiny_models import tiny_config

    text = tiny_config("qwen2").to_dict()
    text["rope_parameters"] = {"rope_type": "default", "rope_theta": 10000.0, "mrope_section": [2, 3, 3]}
    vision = {"depth": 1, "hidden_size": 32, "intermediate_size": 64, "num_heads": 2, "patch_size": 4,
              "spatial_merge_size": 2, "temporal_patch_size": 2, "out_hidden_size": text["hidden_size"],
              "tokens_per_second": 2}
    model = Qwen2_5_VLModel(Qwen2_5_VLConfig(text_config=text, vision_config=vision))
    # (kind, rows, columns, patches, fps): 3 fps makes 4/3 steps a patch, whose float32 rounding matters
    shown = [("image", 2, 3, 1, None), ("video", 4, 5, 4, 3.0), ("video", 9, 2, 3, 0.5), ("video", 2, 6, 6, 24.0),
             ("image", 1, 4, 1, None), ("video", 8, 8, 6, 3.0)]
    tokens, kinds, image_grids, video_grids, seconds, digest = [1, 2], [0, 0], [], [], [], 10
    for kind, rows, columns, patches, fps in shown:
        if kind == "video":
            times = clip_times(patches, 2, 2, fps)
            units = clip(list(range(digest, digest + patches)), rows, columns, times)
            video_grids.append([patches, 2 * rows, 2 * columns])
            seconds.append(2 / fps)
        else:
            units = picture(digest, rows, columns)
            image_grids.append([1, 2 * rows, 2 * columns])
        digest += patches
        tokens += units + [3, 4]
        kinds += [1 if kind == "image" else 2] * len(units) + [0, 0]
    assert clip_times(4, 2, 2, 3.0) == [0, 1, 2, 4]   # 3 · 4/3 is 4 in float32, 3 in float64
    theirs, _ = model.get_rope_index(torch.tensor([[1] * len(tokens)]), torch.tensor([kinds]),
                                     image_grid_thw=torch.tensor(image_grids), video_grid_thw=torch.tensor(video_grids),
                                     second_per_grid_ts=torch.tensor(seconds))
    p, dh, dw = MRope([2, 3, 3], 16).positions([], tokens, list(range(1, len(tokens) + 1)))
    ours = [p, [a + b for a, b in zip(p, dh)], [a + b for a, b in zip(p, dw)]]
    assert ours == theirs[:, 0].tolist()


def test_positions_do_not_depend_on_where_the_chunks_end():
    mrope = MRope([1, 1, 2], head_dim=8)
    tokens = [1, *picture(3, 3, 3), 2, 3, *picture(4, 2, 4), *picture(4, 2, 4), *clip([6, 7, 6], 2, 3),
              *picture(5, 4, 1), *clip([8, 9]), *clip([4, 5, 6], 1, 5, times=[0, 0, 3]), 4]
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
    random text, pictures of random grids (one shown twice in a row) and clips, cut anywhere."""
    import random

    from specserve.replicas.model.mrope import _Walk

    rng = random.Random(0)
    for _ in range(200):
        tokens: list[int] = []
        for _ in range(rng.randint(0, 6)):
            tokens += [rng.randint(1, 50) for _ in range(rng.randint(0, 4))]
            rows, columns = rng.randint(1, 4), rng.randint(1, 4)
            if rng.random() < 0.3:
                patches = rng.randint(1, 4)
                times = sorted(rng.randint(0, 6) for _ in range(patches))
                tokens += clip([rng.randint(1, 3) for _ in range(patches)], rows, columns, [0, *times[1:]])
            else:
                tokens += picture(rng.randint(1, 3), rows, columns) * rng.choice((1, 1, 2))
        cut = rng.randint(0, len(tokens))
        stepped = _Walk()
        for t in tokens[:cut]:
            stepped.take(t)
        bulk = _Walk.after(tokens[:cut])
        assert (bulk.next, bulk.picture) == (stepped.next, stepped.picture), tokens[:cut]
