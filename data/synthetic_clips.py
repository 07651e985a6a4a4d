"""Synthetic clips with a question whose answer needs more than one frame: the reference video data.

A clip is ``MIN_FRAMES`` to ``MAX_FRAMES`` pictures of ``synthetic_images``' size (the count drawn
from the seed, so that a model learns prompts of several lengths), shown to a VLM as consecutive
pictures (as a served ``video_url`` part reaches it). Each category asks what no single frame
answers:

- ``sequence``: every frame one shape of its own; which shapes appear, in order ("A circle, a
  square, a circle, then a triangle.");
- ``moves``: one shape crossing the frame in a straight line; which way it moves ("To the right.").

Seeds name clips as they name pictures (``clip_example(seed)``), so training and held-out clips
are disjoint seed ranges.
"""

from __future__ import annotations

import random
from dataclasses import dataclass

from PIL import Image

from specserve.data.synthetic_images import COLOURS, IMAGE_SIZE, SHAPES, _canvas, _jitter, draw_shape

MIN_FRAMES, MAX_FRAMES = 2, 8
CLIP_CATEGORIES = ("sequence", "moves")
CLIP_QUESTIONS = {
    "sequence": "These are frames of a clip. Which shapes appear, in order?",
    "moves": "These are frames of a clip. Which way does the shape move?",
}
DIRECTIONS = {"right": (1, 0), "left": (-1, 0), "down": (0, 1), "up": (0, -1)}


@dataclass(frozen=True)
class ClipExample:
    seed: int
    category: str
    frames: tuple[Image.Image, ...]
    question: str
    answer: str


def _sequence(rng: random.Random, count: int) -> tuple[tuple[Image.Image, ...], str]:
    frames, shapes = [], []
    for _ in range(count):
        image, draw = _canvas(rng)
        shape, colour = rng.choice(SHAPES), rng.choice(list(COLOURS))
        size = rng.randint(40, 70)
        x0, y0 = rng.randint(4, IMAGE_SIZE - size - 4), rng.randint(4, IMAGE_SIZE - size - 4)
        draw_shape(draw, shape, (x0, y0, x0 + size, y0 + size), _jitter(COLOURS[colour], rng))
        frames.append(image)
        shapes.append(shape)
    named = [f"a {s}" for s in shapes]
    return tuple(frames), f"{', '.join(named[:-1])}, then {named[-1]}.".capitalize()


def _moves(rng: random.Random, count: int) -> tuple[tuple[Image.Image, ...], str]:
    direction = rng.choice(list(DIRECTIONS))
    dx, dy = DIRECTIONS[direction]
    shape, colour = rng.choice(SHAPES), rng.choice(list(COLOURS))
    size = rng.randint(22, 30)
    span = IMAGE_SIZE - size - 8                       # the track the shape crosses, frame to frame
    across = [4 + round(span * i / (count - 1)) for i in range(count)]
    if dx < 0 or dy < 0:
        across = across[::-1]
    fixed = rng.randint(4, IMAGE_SIZE - size - 4)      # its place on the other axis, the same throughout
    fill = _jitter(COLOURS[colour], rng)
    frames = []
    for a in across:
        image, draw = _canvas(rng)
        x0, y0 = (a, fixed) if dx else (fixed, a)
        draw_shape(draw, shape, (x0, y0, x0 + size, y0 + size), fill)
        frames.append(image)
    return tuple(frames), f"To the {direction}." if dx else f"{direction.capitalize()}."


def clip_example(seed: int, category: str | None = None, frames: int | None = None) -> ClipExample:
    """The frames, question and answer of ``seed`` (its category drawn from the seed unless given;
    ``frames``: its frame count, else ``MIN_FRAMES`` to ``MAX_FRAMES`` drawn from the seed)."""
    rng = random.Random(seed)
    category = category or CLIP_CATEGORIES[rng.randrange(len(CLIP_CATEGORIES))]
    if category not in CLIP_QUESTIONS:
        raise ValueError(f"unknown clip category {category!r}; known: {', '.join(CLIP_CATEGORIES)}")
    if frames is not None and frames < MIN_FRAMES:
        raise ValueError(f"a clip has at least {MIN_FRAMES} frames; got {frames}")
    count = rng.randint(MIN_FRAMES, MAX_FRAMES)
    count = count if frames is None else frames
    frames, answer = (_sequence if category == "sequence" else _moves)(rng, count)
    return ClipExample(seed, category, frames, CLIP_QUESTIONS[category], answer)
