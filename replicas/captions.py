"""TABED's caption view: a picture stands in a draft's context as a caption the VLM wrote of it.

A draft LM reads text; its ``text-only`` view drops a VLM request's pictures. The ``caption`` view
puts each picture's caption there instead, so a text draft knows what the picture shows. TABED
("Test-Time Adaptive Batched Ensemble Drafting", §6.2, App. I.2) captions each picture once with a
lightweight captioning model (Florence-2) running beside the target's prefill, and replaces the
image token with the caption after the string "image:".

Here the captioner is the VLM itself (no other captioning model reaches these machines, and the
VLM knows its own pictures best): when a request shows a picture this replica has not captioned,
and its draft reads the caption view, the scheduler queues an internal request beside it, the picture with ``CAPTION_PROMPT``, greedy,
at most ``CAPTION_TOKENS`` tokens, no draft. It shares the request's steps (continuous batching)
as the paper's captioner shares the prefill's time, but costs a row of the target's verify
forward for each of its tokens, where the paper's runs on the side. Until the caption is written
the view reads as ``text-only``; then the draft's cache for the view is rebuilt from the picture
on (``BatchKV.sync``). Captions are kept per picture (its content digest), so a follow-up turn
or another request showing the same picture finds it at once.

Captions change nothing the target computes: the internal request is plain decoding in a slot of
its own, and any draft's view is only a proposal the target verifies.
"""

from __future__ import annotations

import logging
from collections import OrderedDict
from collections.abc import Callable

from specserve.replicas.model.image_tokens import cell, is_picture_token, starts_picture
from specserve.replicas.request import SpecRequest, StreamItem

logger = logging.getLogger("ray.serve")

CAPTION_PROMPT = "Write a short caption for the picture."
CAPTION_TOKENS = 24
LABEL = "image: "   # TABED's prefix before a caption


class Captions:
    """The captions of one replica's pictures, and the requests that write them.

    ``encode(text) -> ids`` / ``decode(ids) -> text``: the VLM's tokenizer; ``prompt``: the chat
    prompt of one picture and ``CAPTION_PROMPT`` as text ids with the placeholder where the
    picture goes, its image tokens between the processor's ``markers`` (``pictures.caption_writer``)."""

    def __init__(self, encode: Callable[[str], list[int]], decode: Callable[[list[int]], str], prompt: list[int],
                 placeholder: int, capacity: int = 512, markers: tuple[list[int], list[int]] = ([], [])):
        if prompt.count(placeholder) != 1:
            raise ValueError("the caption prompt must show exactly one picture")
        self.encode, self.decode, self.capacity = encode, decode, capacity
        at = prompt.index(placeholder)
        self._before, self._after = [*prompt[:at], *markers[0]], [*markers[1], *prompt[at + 1:]]
        # The drafts with a caption view: only their requests have pictures captioned (captions
        # cost target steps).
        self.readers: set[str] = set()
        self._written: OrderedDict[int, list[int]] = OrderedDict()   # digest -> the view's ids
        self._writing: set[int] = set()
        self.written_captions = 0   # tests, metrics

    def get(self, digest: int) -> list[int] | None:
        """The view's ids for the picture (``LABEL`` + caption + a newline), or None while unwritten."""
        return self._written.get(digest)

    def digests(self, prompt_ids: list[int]) -> list[int]:
        """The pictures a prompt shows, in order (a picture shown twice, once)."""
        return list(dict.fromkeys(cell(t)[0] for t in prompt_ids if starts_picture(t)))

    def requests(self, prompt_ids: list[int]) -> list[tuple[SpecRequest, Callable[[StreamItem], None]]]:
        """The caption requests to queue beside a request with ``prompt_ids``, each with the sink
        its tokens go to: one per picture neither captioned nor being captioned."""
        out = []
        for digest, picture in shown_pictures(prompt_ids).items():
            if digest in self._written or digest in self._writing:
                continue
            self._writing.add(digest)
            ids = [*self._before, *picture, *self._after]
            request = SpecRequest(ids, CAPTION_TOKENS, request_id=f"caption-{digest:010x}", internal=True)
            out.append((request, self._sink(digest)))
        return out

    def _sink(self, digest: int) -> Callable[[StreamItem], None]:
        tokens: list[int] = []

        def take(item: StreamItem) -> None:
            tokens.extend(item.token_ids)
            if not item.last:
                return
            self._writing.discard(digest)
            if item.error is not None or item.finish_reason == "abort":
                logger.info("caption of picture %010x not written (%s)", digest, item.error or "aborted")
                return
            self.put(digest, self.decode(tokens))
        return take

    def clear(self) -> None:
        """Forget every written caption (one being written still lands)."""
        self._written.clear()

    def put(self, digest: int, caption: str) -> None:
        """Keep ``caption`` as the picture's (the view's ids: ``LABEL`` + caption + newline)."""
        self._written[digest] = self.encode(f"{LABEL}{caption.strip()}\n")
        self._written.move_to_end(digest)
        self.written_captions += 1
        while len(self._written) > self.capacity:
            self._written.popitem(last=False)


def caption_view(ids: list[int], captions: Captions, placeholder: int) -> list[int]:
    """``ids`` with each picture's image tokens as its caption's ids, or, while it has none, as
    the placeholder (the text-only view's reading)."""
    out: list[int] = []
    caption = None
    for t in ids:
        if not is_picture_token(t):
            out.append(t)
        elif starts_picture(t):   # a picture's first token stands for the picture
            caption = captions.get(cell(t)[0])
            out.extend(caption if caption is not None else (placeholder,))
        elif caption is None:
            out.append(placeholder)
    return out


def shown_pictures(prompt_ids: list[int]) -> dict[int, list[int]]:
    """Each picture a prompt shows (digest -> its image tokens), in order; a picture shown twice,
    once."""
    out: dict[int, list[int]] = {}
    current = None   # the tokens of the picture being read, where it is shown for the first time
    for t in prompt_ids:
        if not is_picture_token(t):
            current = None
        elif starts_picture(t):
            digest = cell(t)[0]
            current = None if digest in out else out.setdefault(digest, [])
        if current is not None:
            current.append(t)
    return out
