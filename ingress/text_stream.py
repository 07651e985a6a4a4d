"""Tokens in, text deltas out: incremental detokenization with stop strings.

Each push decodes a small window, not the whole output (vLLM's and TGI's detokenizer): the
tokens already turned into text before the last ones (``prefix``) and those since (``read`` on):

    ids      = [... | prefix window | new tokens ]
    new text = decode(prefix window + new tokens)[len(decode(prefix window)):]

The prefix window gives the new tokens their context (a SentencePiece tokenizer drops the leading
space of a window's first token), and its text is subtracted again. New text that ends in U+FFFD
is a multi-byte character split over tokens: the text before it is taken, and the window moves on
once the character is whole.

A streamed delta can never be taken back, so the stream also holds back text that could still
grow into a stop string (``"Obs"`` when a stop string is ``"Observation:"``). When a stop string
appears, the text ends just before it and ``stopped`` is set.
"""

from __future__ import annotations

REPLACEMENT = "\ufffd"
# Tokens that decode to no text (special tokens) wait for text to follow them at most this many,
# so that the window, and each push's cost, stays bounded.
MAX_PENDING = 8


class TextStream:
    def __init__(self, tokenizer, stop: list[str] = ()):
        self.tokenizer = tokenizer
        self.stop = list(stop)
        self.token_ids: list[int] = []
        self.stopped = False    # a stop string ended the text
        self._prefix = self._read = 0   # token offsets: the prefix window is token_ids[_prefix:_read]
        self._prefix_text = ""
        self._taken = 0         # characters already taken from the window past the prefix window
        self._unsent = ""       # decoded text held back: it may begin a stop string
        # The sent text's last characters: a stop string may begin in them and end in new text.
        self._keep = max((len(s) - 1 for s in self.stop), default=0)
        self._sent_tail = ""

    def _decode(self, ids: list[int]) -> str:
        return self.tokenizer.decode(ids, skip_special_tokens=True)

    def _new_text(self, final: bool = False) -> str:
        """The text the tokens past ``_read`` add, up to a character split over tokens (unless ``final``)."""
        ids = self.token_ids
        text = self._decode(ids[self._prefix:])
        end = len(text)
        while not final and end > 0 and text[end - 1] == REPLACEMENT:
            end -= 1
        start = len(self._prefix_text) + self._taken
        new = text[start:end] if end > start else ""
        whole = end == len(text) and (len(text) > len(self._prefix_text) or len(ids) - self._read > MAX_PENDING)
        if final or whole:   # the window ends on a character: it becomes the next prefix window
            self._prefix, self._read, self._taken = self._read, len(ids), 0
            self._prefix_text = self._decode(ids[self._prefix:self._read])
        else:
            self._taken += len(new)
        return new

    def push(self, token_ids: list[int]) -> str:
        """Add tokens; returns the text that is now safe to send."""
        if self.stopped:
            return ""
        self.token_ids.extend(token_ids)
        text = self._unsent + self._new_text()
        for stop in self.stop:
            # Search from the sent text's last len(stop) - 1 characters: a stop string found
            # earlier would have ended the text then.
            tail = self._sent_tail[max(0, len(self._sent_tail) - len(stop) + 1):] if len(stop) > 1 else ""
            at = (tail + text).find(stop)
            if at >= 0:
                text, self.stopped = text[:max(0, at - len(tail))], True
        if self.stopped:
            self._unsent = ""
            return self._send(text)
        hold = self._holdback(text)
        self._unsent = text[len(text) - hold:] if hold else ""
        return self._send(text[:len(text) - hold])

    def flush(self) -> str:
        """The generation ended: send what was held back (an unfinished stop string is just text)."""
        if self.stopped:
            return ""
        text = self._unsent + (self._new_text(final=True) if len(self.token_ids) > self._read else "")
        self._unsent = ""
        return self._send(text)

    def _holdback(self, text: str) -> int:
        """How many of ``text``'s last characters to hold back: the longest end (counting the sent
        text's tail) that begins a stop string."""
        hold = 0
        seen = self._sent_tail + text
        for stop in self.stop:
            for k in range(min(len(stop) - 1, len(seen)), 0, -1):
                if seen.endswith(stop[:k]):
                    hold = max(hold, k)
                    break
        return min(hold, len(text))

    def _send(self, delta: str) -> str:
        if self._keep:
            tail = self._sent_tail + delta
            self._sent_tail = tail[max(0, len(tail) - self._keep):]
        return delta
