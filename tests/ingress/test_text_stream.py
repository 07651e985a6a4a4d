"""TextStream on the reference tokenizer: deltas add up to the decoded text, stop strings end it
without being sent, and nothing is sent that could later turn out to be part of a stop string."""

import pytest

from specserve.replicas.model_store import load_tokenizer_and_config
from specserve.ingress.text_stream import TextStream

pytestmark = pytest.mark.reference


@pytest.fixture(scope="module")
def tokenizer():
    return load_tokenizer_and_config()[0]


def feed(stream: TextStream, ids: list[int], step: int = 1) -> list[str]:
    deltas = [stream.push(ids[i : i + step]) for i in range(0, len(ids), step)]
    return deltas + [stream.flush()]


@pytest.mark.parametrize("step", [1, 3])
def test_deltas_add_up_to_the_decoded_text(tokenizer, step):
    text = "Hello world, the café serves crème brûlée — and 日本語 too."
    ids = tokenizer(text)["input_ids"]
    assert "".join(feed(TextStream(tokenizer), ids, step)) == tokenizer.decode(ids)


def test_a_split_multibyte_character_is_held_back_until_complete(tokenizer):
    ids = tokenizer("日")["input_ids"]
    assert len(ids) > 1, "needs a character spread over several byte-level tokens"
    stream = TextStream(tokenizer)
    assert [stream.push([t]) for t in ids[:-1]] == [""] * (len(ids) - 1)
    assert stream.push(ids[-1:]) == "日"


def test_stop_string_ends_the_text_and_is_not_sent(tokenizer):
    ids = tokenizer("one two three four five")["input_ids"]
    stream = TextStream(tokenizer, stop=[" four"])
    deltas = feed(stream, ids)
    assert "".join(deltas) == "one two three"
    assert stream.stopped


def test_a_possible_stop_prefix_is_held_back_then_released(tokenizer):
    stream = TextStream(tokenizer, stop=["Observation:"])
    sent = stream.push(tokenizer("Thought: go. Obs")["input_ids"])
    assert sent == "Thought: go. "          # "Obs" might be the start of the stop string
    assert stream.flush() == "Obs"           # the generation ended: it was just text
    assert not stream.stopped


def test_the_earliest_of_several_stop_strings_wins(tokenizer):
    stream = TextStream(tokenizer, stop=["c", "b"])
    assert "".join(feed(stream, tokenizer("a b c")["input_ids"])) == "a "
