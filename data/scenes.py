"""Synthetic scenes for the reference image generator: a picture, its class label and its prompt.

No image dataset or generator weights reach these machines, so the visual autoregressive
reference (a VQ tokenizer and a Llama over its tokens) learns from pictures drawn here with
Pillow. What matters for speculative decoding is what matters in the ADT-Tree paper ("Fast
Inference of Visual Autoregressive Model with Adjacency-Adaptive Dynamical Draft Trees"):
difficulty varies across a picture. So a scene is a background that is either smooth (one
colour, a gradient) or busy (stripes, checks, speckle), with one or two filled shapes on it:
smooth regions make long runs of predictable image tokens, busy ones and the shapes' edges do not.

Each scene comes from a seed (``scene(seed)``), so a training stream and a held-out set are
disjoint seed ranges. The class label is (first shape, its colour, background): a generator
conditioned on it, or on the prompt that says the same in words.
"""

from __future__ import annotations

import random
from dataclasses import dataclass

from PIL import Image, ImageDraw

from specserve.data.synthetic_images import COLOURS, SHAPES, draw_shape

SCENE_SIZE = 64
BACKGROUNDS = ("plain", "gradient", "stripes", "checks", "speckle")
SMOOTH_BACKGROUNDS = ("plain", "gradient")
_COLOUR_NAMES = tuple(COLOURS)
# Background tones, away from the shapes' colours so a shape always stands out.
_TONES = {"white": (236, 236, 232), "grey": (150, 150, 150), "sand": (214, 196, 160), "sky": (170, 205, 235),
          "mint": (185, 225, 200)}
CLASSES = len(SHAPES) * len(_COLOUR_NAMES) * len(BACKGROUNDS)
# Held-out scenes live far from the training stream's seeds (which count up from 0).
TEST_SEED = 10**9


@dataclass(frozen=True)
class Scene:
    seed: int
    image: Image.Image
    label: int        # class_label(shape, colour, background) of the first shape
    prompt: str       # the same in words: "a red circle on a striped background"
    background: str


def class_label(shape: str, colour: str, background: str) -> int:
    return (SHAPES.index(shape) * len(_COLOUR_NAMES) + _COLOUR_NAMES.index(colour)) * len(BACKGROUNDS) \
        + BACKGROUNDS.index(background)


def label_parts(label: int) -> tuple[str, str, str]:
    """(shape, colour, background) of a class label."""
    if not 0 <= label < CLASSES:
        raise ValueError(f"class label {label}: one of 0..{CLASSES - 1}")
    rest, background = divmod(label, len(BACKGROUNDS))
    shape, colour = divmod(rest, len(_COLOUR_NAMES))
    return SHAPES[shape], _COLOUR_NAMES[colour], BACKGROUNDS[background]


def label_prompt(label: int) -> str:
    shape, colour, background = label_parts(label)
    where = {"plain": "a plain", "gradient": "a shaded", "stripes": "a striped", "checks": "a checked",
             "speckle": "a speckled"}[background]
    return f"{'an' if colour[0] in 'aeiou' else 'a'} {colour} {shape} on {where} background"


# The words a prompt may name each background by (``label_prompt`` uses the first).
_BACKGROUND_WORDS = {"plain": ("plain",), "gradient": ("shaded", "gradient"), "stripes": ("striped", "stripes"),
                     "checks": ("checked", "checks", "checkered"), "speckle": ("speckled", "speckle")}


def prompt_label(prompt: str) -> int:
    """The class a prompt names: exactly one shape, one colour and one background among its
    words ("a red circle on a striped background"); ValueError saying what is missing or twice."""
    words = set(prompt.lower().replace(",", " ").replace(".", " ").split())
    found = {"shape": [s for s in SHAPES if s in words], "colour": [c for c in _COLOUR_NAMES if c in words],
             "background": [b for b, names in _BACKGROUND_WORDS.items() if words & set(names)]}
    choices = {"shape": SHAPES, "colour": _COLOUR_NAMES,
               "background": tuple(names[0] for names in _BACKGROUND_WORDS.values())}
    for part, hits in found.items():
        if len(hits) != 1:
            raise ValueError(f"the prompt must name one {part} ({', '.join(choices[part])}); "
                             f"it names {' and '.join(hits) if hits else 'none'}")
    return class_label(found["shape"][0], found["colour"][0], found["background"][0])


def _background(rng: random.Random, kind: str) -> Image.Image:
    tone = _TONES[rng.choice(list(_TONES))]
    image = Image.new("RGB", (SCENE_SIZE, SCENE_SIZE), tone)
    draw = ImageDraw.Draw(image)
    if kind == "gradient":
        other = _TONES[rng.choice(list(_TONES))]
        for y in range(SCENE_SIZE):
            t = y / (SCENE_SIZE - 1)
            draw.line((0, y, SCENE_SIZE, y), fill=tuple(round(a + (b - a) * t) for a, b in zip(tone, other)))
    elif kind == "stripes":
        dark = tuple(max(0, c - 70) for c in tone)
        width = rng.choice((2, 3, 4))
        vertical = rng.random() < 0.5
        for i in range(0, SCENE_SIZE, 2 * width):
            box = (i, 0, i + width - 1, SCENE_SIZE) if vertical else (0, i, SCENE_SIZE, i + width - 1)
            draw.rectangle(box, fill=dark)
    elif kind == "checks":
        dark = tuple(max(0, c - 70) for c in tone)
        cell = rng.choice((3, 4, 6))
        for y in range(0, SCENE_SIZE, cell):
            for x in range(0, SCENE_SIZE, cell):
                if (x // cell + y // cell) % 2:
                    draw.rectangle((x, y, x + cell - 1, y + cell - 1), fill=dark)
    elif kind == "speckle":
        pixels = image.load()
        for y in range(SCENE_SIZE):
            for x in range(SCENE_SIZE):
                d = rng.randint(-60, 60)
                pixels[x, y] = tuple(max(0, min(255, c + d)) for c in tone)
    return image


def scene(seed: int) -> Scene:
    """The scene of ``seed``: a background, a first shape (the label's) and sometimes a second one."""
    rng = random.Random(seed)
    background = rng.choice(BACKGROUNDS)
    image = _background(rng, background)
    draw = ImageDraw.Draw(image)
    shape, colour = rng.choice(SHAPES), rng.choice(_COLOUR_NAMES)
    size = rng.randint(22, 44)
    x0, y0 = rng.randint(2, SCENE_SIZE - size - 2), rng.randint(2, SCENE_SIZE - size - 2)
    draw_shape(draw, shape, (x0, y0, x0 + size, y0 + size), COLOURS[colour])
    if rng.random() < 0.3:   # a smaller second shape, anywhere (it may overlap the first)
        other = rng.randint(10, 18)
        x1, y1 = rng.randint(1, SCENE_SIZE - other - 1), rng.randint(1, SCENE_SIZE - other - 1)
        draw_shape(draw, rng.choice(SHAPES), (x1, y1, x1 + other, y1 + other), COLOURS[rng.choice(_COLOUR_NAMES)])
    label = class_label(shape, colour, background)
    return Scene(seed, image, label, label_prompt(label), background)
