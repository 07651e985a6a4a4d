"""Tokens in, text deltas out: incremental detokenization with stop strings.

A streamed delta can never be taken back, so the stream holds back two kinds of tail:
- an incomplete UTF-8 sequence (a multi-byte character split over tokens decodes to U+FFFD);
- text that could still grow into a stop string (``"Obs"`` when a stop string is
  ``"Observation:"``).
When a stop string appears, the text ends just before it and ``stopped`` is set.
"""

from __future__ import annotations

REPLACEMENT = "\ufffd"


class TextStream:
    def __init__(self, tokenizer, stop: list[str] = ()):
        self.tokenizer = tokenizer
        self.stop = list(stop)
        self.token_ids: list[int] = []
        self.sent = ""          # text already handed out
        self.stopped = False    # a stop string ended the text

    def _decoded(self) -> str:
        return self.tokenizer.decode(self.token_ids, skip_special_tokens=True)

    def push(self, token_ids: list[int]) -> str:
        """Add tokens; returns the text that is now safe to send."""
        if self.stopped:
            return ""
        self.token_ids.extend(token_ids)
        text = self._decoded()
        for stop in self.stop:
            at = text.find(stop, max(0, len(self.sent) - len(stop) + 1))
            if at >= 0:
                text, self.stopped = text[:at], True
        if not self.stopped:
            text = text[: len(text) - self._holdback(text)]
        return self._send(text)

    def flush(self) -> str:
        """The generation ended: send what was held back (an unfinished stop string is just text)."""
        if self.stopped:
            return ""
        return self._send(self._decoded())

    def _holdback(self, text: str) -> int:
        hold = len(text) - len(text.rstrip(REPLACEMENT))
        for stop in self.stop:
            for k in range(min(len(stop) - 1, len(text)), 0, -1):
                if text.endswith(stop[:k]):
                    hold = max(hold, k)
                    break
        return hold

    def _send(self, text: str) -> str:
        # Byte-level BPE decodes a prefix of the tokens to a prefix of the text; if a tokenizer
        # ever rewrote earlier text, send only what extends what was sent.
        if not text.startswith(self.sent):
            return ""
        delta, self.sent = text[len(self.sent):], text
        return delta
