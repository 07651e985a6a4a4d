"""Synthetic scenes for the reference image generator: from a seed, labelled, smooth or busy."""

import numpy as np
import pytest

from specserve.data.scenes import BACKGROUNDS, CLASSES, SCENE_SIZE, SMOOTH_BACKGROUNDS, class_label, label_parts, \
    label_prompt, scene


def test_a_scene_is_its_seeds_and_says_what_it_shows():
    a, b = scene(7), scene(7)
    assert np.array_equal(np.asarray(a.image), np.asarray(b.image)) and a.label == b.label
    assert a.image.size == (SCENE_SIZE, SCENE_SIZE) and a.image.mode == "RGB"
    shape, colour, background = label_parts(a.label)
    assert background == a.background and a.prompt == label_prompt(a.label)
    assert f"{colour} {shape}" in a.prompt


def test_labels_round_trip_and_cover_every_class():
    labels = {class_label(*label_parts(i)) for i in range(CLASSES)}
    assert labels == set(range(CLASSES))
    with pytest.raises(ValueError):
        label_parts(CLASSES)
    assert {scene(s).background for s in range(200)} == set(BACKGROUNDS)


def test_busy_backgrounds_vary_from_pixel_to_pixel_and_smooth_ones_do_not():
    """What makes image tokens easy or hard to predict: neighbouring pixels alike or not."""
    def roughness(s) -> float:
        a = np.asarray(s.image, dtype=np.float32)
        return float(np.abs(np.diff(a, axis=1)).mean())

    smooth = [roughness(s) for s in map(scene, range(300)) if s.background in SMOOTH_BACKGROUNDS]
    busy = [roughness(s) for s in map(scene, range(300)) if s.background not in SMOOTH_BACKGROUNDS]
    assert smooth and busy and np.median(busy) > 4 * np.median(smooth)
