"""TextStream on the reference tokenizer: deltas add up to the decoded text, stop strings end it
without being sent, and nothing is sent that could later turn out to be part of a stop string."""

import random

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


# ---- incremental decoding: the same text as decoding everything, at a bounded cost per push ------

MIXED = list("abc xyz.,\n") + list("éüßç日本語中文한국어Ж") + ["🙂", "🚀"]   # 1- to 4-byte characters


def random_ids(tokenizer, rng: random.Random, words: int) -> list[int]:
    """Text of 1- to 4-byte characters, tokenized: byte-level BPE splits many of them over tokens."""
    return tokenizer("".join(rng.choice(MIXED) for _ in range(words)))["input_ids"]


def pushed(stream: TextStream, ids: list[int], rng: random.Random) -> list[str]:
    """Push ``ids`` in pieces of random sizes (a replica's items vary with acceptance), then flush."""
    deltas, i = [], 0
    while i < len(ids):
        n = rng.choice([1, 1, 2, 3, 5, 16])
        deltas.append(stream.push(ids[i:i + n]))
        i += n
    return deltas + [stream.flush()]


class WholeDecode:
    """The stream decoding everything on every push: the oracle for stop strings and held-back tails."""

    def __init__(self, tokenizer, stop):
        self.tokenizer, self.stop, self.ids, self.sent, self.stopped = tokenizer, stop, [], "", False

    def push(self, ids):
        if self.stopped:
            return ""
        self.ids.extend(ids)
        text = self.tokenizer.decode(self.ids, skip_special_tokens=True)
        for stop in self.stop:
            at = text.find(stop, max(0, len(self.sent) - len(stop) + 1))
            if at >= 0:
                text, self.stopped = text[:at], True
        if not self.stopped:
            text = text.rstrip("\ufffd")   # a character split over tokens
            hold = max([0] + [k for stop in self.stop for k in range(1, min(len(stop), len(text) + 1))
                              if text.endswith(stop[:k])])
            text = text[:len(text) - hold]
        return self.send(text)

    def flush(self):
        return "" if self.stopped else self.send(self.tokenizer.decode(self.ids, skip_special_tokens=True))

    def send(self, text):
        if not text.startswith(self.sent):
            return ""
        delta, self.sent = text[len(self.sent):], text
        return delta


@pytest.mark.parametrize("seed", range(6))
def test_incremental_text_equals_decoding_everything(tokenizer, seed):
    rng = random.Random(seed)
    ids = random_ids(tokenizer, rng, 600)
    assert "".join(pushed(TextStream(tokenizer), ids, rng)) == tokenizer.decode(ids, skip_special_tokens=True)
    # Any ids a model may produce, bytes that form no character included.
    ids = [rng.randrange(len(tokenizer)) for _ in range(400)]
    assert "".join(pushed(TextStream(tokenizer), ids, rng)) == tokenizer.decode(ids, skip_special_tokens=True)


@pytest.mark.parametrize("seed", range(6))
def test_stop_strings_end_the_text_where_decoding_everything_ends_it(tokenizer, seed):
    rng = random.Random(seed)
    ids = random_ids(tokenizer, rng, 300)
    text = tokenizer.decode(ids)
    # Stop strings cut from the text itself (so that they occur), one of them multi-byte, plus one
    # that never occurs but whose beginnings do.
    at = rng.randrange(len(text) - 8)
    stop = [text[at:at + rng.randint(1, 4)], text[rng.randrange(len(text) - 3):][:3] + "\x00", "日本🙂"]
    ours, oracle = TextStream(tokenizer, stop), WholeDecode(tokenizer, stop)
    sizes = [rng.choice([1, 2, 3, 7]) for _ in ids]
    starts = [sum(sizes[:k]) for k in range(len(sizes))]
    got, want = [], []
    for start, size in zip(starts, sizes):
        if start >= len(ids):
            break
        got.append(ours.push(ids[start:start + size]))
        want.append(oracle.push(ids[start:start + size]))
    # Piece by piece: a delta is sent as early as decoding everything would send it.
    assert got + [ours.flush()] == want + [oracle.flush()]
    assert ours.stopped == oracle.stopped and ours.token_ids == oracle.ids


def test_each_push_decodes_a_window_of_the_last_tokens_not_the_whole_output(tokenizer):
    rng = random.Random(7)
    ids = random_ids(tokenizer, rng, 3000)
    decoded: list[int] = []

    class Counting:
        def decode(self, token_ids, **kwargs):
            decoded.append(len(token_ids))
            return tokenizer.decode(token_ids, **kwargs)

    stream = TextStream(Counting(), stop=["Observation:"])
    text = "".join(stream.push([t]) for t in ids) + stream.flush()
    assert text == tokenizer.decode(ids) and len(ids) > 1000
    # One token per push: the window is the previous emission's tokens, the few a split character
    # waits for, and the new one; whole-output decoding would reach len(ids).
    assert max(decoded) <= 12, max(decoded)
    assert sum(decoded) <= 6 * len(ids)
