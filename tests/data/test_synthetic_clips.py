"""The reference clips: one per seed, two to eight frames, each answer one that needs more than one frame."""

import numpy as np
import pytest

from specserve.data.synthetic_clips import CLIP_CATEGORIES, CLIP_QUESTIONS, MAX_FRAMES, MIN_FRAMES, clip_example
from specserve.data.synthetic_images import IMAGE_SIZE, SHAPES


def test_a_seed_names_one_clip():
    a, b = clip_example(5), clip_example(5)
    assert a.category == b.category and a.answer == b.answer
    assert [f.tobytes() for f in a.frames] == [f.tobytes() for f in b.frames]
    with pytest.raises(ValueError, match="unknown clip category"):
        clip_example(5, "karaoke")


@pytest.mark.parametrize("category", CLIP_CATEGORIES)
def test_a_clip_of_a_given_length_keeps_its_answer_whole(category):
    """Longer than training clips (Sparrow's rows): a sequence names a shape per frame, a motion
    still crosses the frame the way the answer says."""
    ex = clip_example(7, category, frames=16)
    assert len(ex.frames) == 16 and ex.question == CLIP_QUESTIONS[category]
    if category == "sequence":
        assert len(ex.answer.lower().rstrip(".").replace(", then", ",").split(", ")) == 16
    else:
        travel = centre(ex.frames[-1]) - centre(ex.frames[0])
        way = {"To the right.": (0, 1), "To the left.": (0, -1), "Down.": (1, 1), "Up.": (1, -1)}[ex.answer]
        assert np.sign(travel[way[0]]) == way[1] and abs(travel[way[0]]) > 30
    with pytest.raises(ValueError, match="at least 2 frames"):
        clip_example(7, category, frames=1)


def test_a_sequence_names_a_shape_per_frame_in_order():
    answers, counts = set(), set()
    for seed in range(30):
        ex = clip_example(seed, "sequence")
        assert MIN_FRAMES <= len(ex.frames) <= MAX_FRAMES and ex.question == CLIP_QUESTIONS["sequence"]
        assert all(f.size == (IMAGE_SIZE, IMAGE_SIZE) for f in ex.frames)
        named = ex.answer.lower().rstrip(".").replace(", then", ",").split(", ")
        assert len(named) == len(ex.frames) and all(n.removeprefix("a ") in SHAPES for n in named)
        answers.add(ex.answer)
        counts.add(len(ex.frames))
    assert len(answers) > 20 and len(counts) > 3


def centre(frame) -> np.ndarray:
    """The centre of the frame's coloured pixels (the background is near-grey and light)."""
    pixels = np.asarray(frame).astype(int)
    coloured = (pixels.max(-1) - pixels.min(-1)) > 60
    ys, xs = np.nonzero(coloured)
    return np.array([xs.mean(), ys.mean()])


def test_a_moving_shape_crosses_the_frame_the_way_the_answer_says():
    seen = set()
    for seed in range(40):
        ex = clip_example(seed, "moves")
        step = {"To the right.": (1, 0), "To the left.": (-1, 0), "Down.": (0, 1), "Up.": (0, -1)}[ex.answer]
        centres = [centre(f) for f in ex.frames]
        moves = np.diff(np.array(centres), axis=0)
        along, other = (0, 1) if step[0] else (1, 0)
        assert (np.sign(moves[:, along]) == sum(step)).all(), (seed, ex.answer)
        assert np.abs(moves[:, other]).max() < 2.0, (seed, ex.answer)
        seen.add(ex.answer)
    assert len(seen) == 4 and set(CLIP_CATEGORIES) == {"sequence", "moves"}
