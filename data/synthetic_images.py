"""Synthetic pictures with a question and its one right answer: the reference VLM's training and test data.

No VLM weights or image datasets reach these machines, and tests need a real VLM whose answers
depend on the picture, so the reference VLM learns from pictures drawn here with Pillow. Each
category asks one thing a small vision encoder can learn from scratch:

- ``shape`` / ``colour``: one filled shape (circle, square, triangle, diamond) of one colour;
- ``word``: a short lower-case word written in black;
- ``bars``: a bar chart of three or four coloured bars, which is tallest;
- ``dots``: how many dots (1-9);
- ``digits``: a two-digit number;
- ``caption``: any of the pictures above, captioned in a few words ("A green circle.");
- ``describe``: any of them described in a paragraph of about forty tokens, a template per kind
  with the caption's facts in it, some of them twice (an answer a drafting view can partly copy
  from itself once it has said a fact, and must read from the picture before).

Every picture comes from a seed (``example(seed)``), so a training stream and a held-out test set
are just disjoint seed ranges, and a failing test names the picture it saw.
"""

from __future__ import annotations

import random
from dataclasses import dataclass
from functools import lru_cache

from PIL import Image, ImageDraw, ImageFont

IMAGE_SIZE = 96
CATEGORIES = ("shape", "colour", "word", "bars", "dots", "digits", "caption", "describe")
KINDS = ("shape", "word", "bars", "dots", "digits")   # the kinds of picture a caption or description is of

COLOURS = {
    "red": (215, 35, 35), "green": (30, 160, 60), "blue": (35, 75, 215), "yellow": (235, 200, 20),
    "purple": (135, 55, 185), "orange": (245, 125, 20),
}
SHAPES = ("circle", "square", "triangle", "diamond")
WORDS = (
    "cat", "dog", "sun", "tree", "book", "fish", "bird", "car", "moon", "star", "cake", "milk", "rain", "snow",
    "ship", "door", "lamp", "ball", "hat", "cup", "bed", "pen", "key", "map", "box", "egg", "owl", "fox", "bee",
    "cow", "pig", "ant", "bus", "sea", "sky", "ice", "red", "blue", "frog", "duck", "rose", "leaf", "wind",
    "fire", "gold", "king", "home", "road", "farm", "bell",
)
QUESTIONS = {
    "shape": "What shape is in the picture?",
    "colour": "What colour is the shape?",
    "word": "What word is written in the picture?",
    "bars": "Which bar is the tallest?",
    "dots": "How many dots are there?",
    "digits": "What number is written in the picture?",
    "caption": "Write a short caption for the picture.",
    "describe": "Describe the picture in detail.",
}


@dataclass(frozen=True)
class Example:
    seed: int
    category: str
    image: Image.Image
    question: str
    answer: str


@lru_cache(maxsize=8)
def _font(size: int) -> ImageFont.FreeTypeFont:
    # Pillow's own scalable font: the same glyphs on every machine, no system font needed.
    return ImageFont.load_default(size=size)


def _canvas(rng: random.Random) -> tuple[Image.Image, ImageDraw.ImageDraw]:
    shade = rng.randint(225, 255)
    tint = tuple(min(255, shade + rng.randint(-12, 0)) for _ in range(3))
    image = Image.new("RGB", (IMAGE_SIZE, IMAGE_SIZE), tint)
    return image, ImageDraw.Draw(image)


def _jitter(rgb: tuple[int, int, int], rng: random.Random) -> tuple[int, ...]:
    return tuple(max(0, min(255, c + rng.randint(-20, 20))) for c in rgb)


def draw_shape(draw: ImageDraw.ImageDraw, shape: str, box: tuple[int, int, int, int], fill) -> None:
    x0, y0, x1, y1 = box
    cx, cy = (x0 + x1) / 2, (y0 + y1) / 2
    if shape == "circle":
        draw.ellipse(box, fill=fill)
    elif shape == "square":
        draw.rectangle(box, fill=fill)
    elif shape == "triangle":
        draw.polygon([(cx, y0), (x1, y1), (x0, y1)], fill=fill)
    else:   # diamond
        draw.polygon([(cx, y0), (x1, cy), (cx, y1), (x0, cy)], fill=fill)


def _shape_picture(rng: random.Random) -> tuple[Image.Image, str, str]:
    image, draw = _canvas(rng)
    shape, colour = rng.choice(SHAPES), rng.choice(list(COLOURS))
    size = rng.randint(34, 70)
    x0, y0 = rng.randint(4, IMAGE_SIZE - size - 4), rng.randint(4, IMAGE_SIZE - size - 4)
    draw_shape(draw, shape, (x0, y0, x0 + size, y0 + size), _jitter(COLOURS[colour], rng))
    return image, shape, colour


def _text_picture(rng: random.Random, text: str) -> Image.Image:
    image, draw = _canvas(rng)
    font = _font(rng.randint(26, 34))
    left, top, right, bottom = draw.textbbox((0, 0), text, font=font)
    w, h = right - left, bottom - top
    x = rng.randint(2, max(2, IMAGE_SIZE - w - 2)) - left
    y = rng.randint(2, max(2, IMAGE_SIZE - h - 2)) - top
    draw.text((x, y), text, fill=(rng.randint(0, 40),) * 3, font=font)
    return image


def _bars_picture(rng: random.Random) -> tuple[Image.Image, str]:
    image, draw = _canvas(rng)
    colours = rng.sample(list(COLOURS), rng.choice((3, 4)))
    heights = rng.sample(range(12, 84, 6), len(colours))   # distinct: one tallest, no tie
    width = (IMAGE_SIZE - 8) // len(colours)
    for i, (colour, height) in enumerate(zip(colours, heights)):
        x0 = 4 + i * width + 3
        draw.rectangle((x0, IMAGE_SIZE - 4 - height, x0 + width - 6, IMAGE_SIZE - 4), fill=_jitter(COLOURS[colour], rng))
    return image, colours[heights.index(max(heights))]


def _dots_picture(rng: random.Random) -> tuple[Image.Image, int]:
    image, draw = _canvas(rng)
    count, radius = rng.randint(1, 9), rng.randint(5, 7)
    colour = _jitter((25, 25, 25), rng) if rng.random() < 0.5 else _jitter(COLOURS[rng.choice(list(COLOURS))], rng)
    centres: list[tuple[int, int]] = []
    while len(centres) < count:   # dots apart enough to count: no overlap, one dot's width between
        c = (rng.randint(radius + 2, IMAGE_SIZE - radius - 3), rng.randint(radius + 2, IMAGE_SIZE - radius - 3))
        if all((c[0] - o[0]) ** 2 + (c[1] - o[1]) ** 2 > (3 * radius) ** 2 for o in centres):
            centres.append(c)
    for x, y in centres:
        draw.ellipse((x - radius, y - radius, x + radius, y + radius), fill=colour)
    return image, count


def example(seed: int, category: str | None = None) -> Example:
    """The picture, question and answer of ``seed`` (its category drawn from the seed unless given)."""
    rng = random.Random(seed)
    category = category or CATEGORIES[rng.randrange(len(CATEGORIES))]
    if category not in QUESTIONS:
        raise ValueError(f"unknown category {category!r}; known: {', '.join(CATEGORIES)}")
    kind = KINDS[rng.randrange(len(KINDS))] if category in ("caption", "describe") else category
    if kind in ("shape", "colour"):
        image, shape, colour = _shape_picture(rng)
        answers = {"shape": f"A {shape}.", "colour": f"{colour.capitalize()}.",
                   "caption": f"A {colour} {shape}.",
                   "describe": f"The picture shows a {colour} {shape} on a light background. It is the only shape "
                               f"in the picture, and its colour is {colour}. There is no text in the picture."}
    elif kind == "word":
        word = rng.choice(WORDS)
        image = _text_picture(rng, word)
        answers = {"word": f'"{word}"', "caption": f'The word "{word}".',
                   "describe": f'The picture shows the word "{word}" written in black letters on a light '
                               f'background. There are no shapes in the picture, only the word "{word}".'}
    elif kind == "bars":
        image, colour = _bars_picture(rng)
        answers = {"bars": f"The {colour} bar.", "caption": f"A bar chart; the {colour} bar is the tallest.",
                   "describe": f"The picture shows a bar chart with coloured bars on a light background. The "
                               f"tallest bar is the {colour} one. There are no words or numbers on the chart."}
    elif kind == "dots":
        image, count = _dots_picture(rng)
        answers = {"dots": f"{count}.", "caption": f"{count} dots.",
                   "describe": f"The picture shows {count} dots on a light background. The dots are all the "
                               f"same size, and there are {count} of them in total."}
    else:   # digits
        number = rng.randint(10, 99)
        image = _text_picture(rng, str(number))
        answers = {"digits": f"{number}.", "caption": f"The number {number}.",
                   "describe": f"The picture shows the number {number} written in black on a light background. "
                               f"The number has two digits: {number // 10} and {number % 10}."}
    return Example(seed, category, image, QUESTIONS[category], answers[category])


def normalise_answer(text: str) -> str:
    """An answer as compared for accuracy: lower case, no quotes, full stops or outer spaces."""
    return text.strip().strip('".').strip().lower()


# Held-out pictures live far from the training stream's seeds (which count up from 0).
TEST_SEED = 10**9
