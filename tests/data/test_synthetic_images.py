"""The reference VLM's pictures: one per seed, the same on every machine, each category's answer
the one the picture shows."""

import pytest
from specserve.replicas.captions import CAPTION_PROMPT
from specserve.data.synthetic_images import (CATEGORIES, COLOURS, IMAGE_SIZE, QUESTIONS, SHAPES, WORDS, example,
                                             normalise_answer)


def test_a_seed_names_one_picture():
    a, b = example(11), example(11)
    assert a.category == b.category and a.answer == b.answer and a.image.tobytes() == b.image.tobytes()
    assert example(12).image.tobytes() != a.image.tobytes()


@pytest.mark.parametrize("category", CATEGORIES[:6])
def test_every_category_draws_a_picture_with_its_question_and_answer(category):
    answers = set()
    for seed in range(40):
        ex = example(seed, category)
        assert ex.image.size == (IMAGE_SIZE, IMAGE_SIZE) and ex.image.mode == "RGB"
        assert ex.question == QUESTIONS[category]
        answers.add(normalise_answer(ex.answer))
    allowed = {
        "shape": {f"a {s}" for s in SHAPES}, "colour": set(COLOURS), "word": set(WORDS),
        "bars": {f"the {c} bar" for c in COLOURS}, "dots": {str(n) for n in range(1, 10)},
        "digits": {str(n) for n in range(10, 100)},
    }[category]
    assert answers <= allowed and len(answers) > 2   # varied, and only what the question allows


def test_captions_and_descriptions_name_what_the_picture_shows():
    # The same seed draws the same picture whatever is asked of it; a description holds the
    # caption's facts, some of them twice.
    for seed in range(30):
        caption, description = example(seed, "caption"), example(seed, "describe")
        assert caption.image.tobytes() == description.image.tobytes()
        assert caption.question == QUESTIONS["caption"] == CAPTION_PROMPT
        assert description.question == QUESTIONS["describe"] and len(description.answer.split()) >= 20
        words = [w.strip('.;"') for w in caption.answer.lower().split() if w not in ("a", "the", "is")]
        said = description.answer.lower().replace('"', " ").replace(".", " ").split()
        assert all(w in said for w in words) and max(said.count(w) for w in words) >= 2, seed


def test_the_picture_shows_its_answer():
    # The shape is drawn in the colour the answer names (within the jitter).
    ex = example(5, "colour")
    colours = {c for n, c in ex.image.getcolors(IMAGE_SIZE * IMAGE_SIZE) if n > 200}
    want = COLOURS[normalise_answer(ex.answer)]
    assert any(max(abs(a - b) for a, b in zip(c, want)) <= 20 for c in colours)


def test_an_unknown_category_is_refused():
    with pytest.raises(ValueError, match="unknown category"):
        example(1, "faces")
