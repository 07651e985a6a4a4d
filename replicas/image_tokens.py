"""Image tokens as ids: a picture's image tokens travel through the engine as virtual token ids.

A VLM prompt holds ``tokens_per_image`` image tokens per picture, whose embeddings come from the
vision tower and projector, not the embedding table. Here each such token is an id at or above
``VIRTUAL_BASE`` (far above any vocabulary) that names the picture's content and the token's
place in it:

    id = VIRTUAL_BASE + digest(pixels) · tokens_per_image + j,     j = 0 .. tokens_per_image − 1

so everything that keys on token ids keys on the picture's content for free: the slot caches'
prefix reuse (two prompts share a cached prefix only where they show the same picture), the
prefix-affinity router, the scheduler's bookkeeping. The only places that must know are the ones
that embed ids: the target's forward asks ``ImageStore.rows`` for a virtual id's embedding (the
vision tower runs then, inside the prefill forward that first needs the picture, batched over
every picture that forward needs), and drafts, which see the VLM's placeholder token instead
(``draft_view``): their text-only view of the prompt.

The digest is 40 bits of BLAKE2b over the preprocessed pixels (the same picture sent as PNG or
as JPEG that decodes to the same pixels is one picture).
"""

from __future__ import annotations

import hashlib
import math
from collections import OrderedDict
from typing import Callable

import torch
import torch.nn.functional as F

VIRTUAL_BASE = 1 << 32
_DIGEST_BYTES = 5
# Pooled image tokens (a drafting view, ``pooled_view``) live in a namespace of their own above
# the pictures' ids: POOLED_BASE + digest · pooled tokens + j.
POOLED_BASE = VIRTUAL_BASE + (1 << 52)
POOLED_TOKENS = 4


def is_virtual(token: int) -> bool:
    return token >= VIRTUAL_BASE


def picture_ids(pixels: torch.Tensor, tokens_per_image: int) -> list[int]:
    """The ids of the image tokens of a prepared picture (its pixels as the store's ``prepare``
    gives them)."""
    digest = int.from_bytes(hashlib.blake2b(pixels.contiguous().cpu().numpy().tobytes(),
                                            digest_size=_DIGEST_BYTES).digest(), "little")
    base = VIRTUAL_BASE + digest * tokens_per_image
    return list(range(base, base + tokens_per_image))


def pooled_view(ids: list[int], tokens_per_image: int, pooled: int) -> list[int]:
    """``ids`` with each picture's image tokens as ``pooled`` tokens (its grid of patches averaged
    in blocks: 64 tokens on an 8 x 8 grid, pooled 4, as 2 x 2 blocks of 4 x 4): TABED's pooled
    view, whose embeddings ``ImageStore.rows`` computes."""
    out: list[int] = []
    for t in ids:
        if VIRTUAL_BASE <= t < POOLED_BASE:
            offset = t - VIRTUAL_BASE
            if offset % tokens_per_image == 0:   # a picture's first token stands for the picture
                digest = offset // tokens_per_image
                out.extend(range(POOLED_BASE + digest * pooled, POOLED_BASE + (digest + 1) * pooled))
            continue
        out.append(t)
    return out


def draft_view(ids: list[int], placeholder: int) -> list[int]:
    """``ids`` with every image token replaced by ``placeholder`` (what a draft reads)."""
    return [placeholder if t >= VIRTUAL_BASE else t for t in ids]


class ImageStore:
    """The pictures one target has been shown: ids for each, embeddings on demand.

    ``prepare(image) -> pixels`` (the VLM's image processor: [3, h, w], or Qwen2-VL's patches
    [patches, dim]); ``encode(pixels [n, ...]) -> [n, tokens_per_image, hidden]`` (vision tower
    + projector); ``placeholder``: the VLM's image token, which drafts read in place of image
    tokens. Pictures are kept, least recently used first out, up to ``capacity``: a prompt may
    not need a picture evicted before its prefill reached it (``rows`` raises), so ``capacity``
    must exceed the pictures of the requests in flight."""

    def __init__(self, prepare: Callable, encode: Callable[[torch.Tensor], torch.Tensor], tokens_per_image: int,
                 placeholder: int, capacity: int = 512):
        self.prepare, self.encode, self.tokens_per_image, self.capacity = prepare, encode, tokens_per_image, capacity
        self.placeholder = placeholder
        self.pooled = POOLED_TOKENS   # the pooled view's tokens per picture
        self._pixels: OrderedDict[int, torch.Tensor] = OrderedDict()   # digest -> prepared pixels
        self._rows: OrderedDict[int, torch.Tensor] = OrderedDict()     # digest -> [tokens_per_image, hidden]
        self.encoded_images = 0   # vision-tower runs, per picture (tests, metrics)
        self.captions = None      # the pictures' captions (``captions.Captions``) where a caption view reads them
        # Tokens the VLM's processor puts before and after a picture's image tokens (``vlm.picture_markers``).
        self.markers: tuple[list[int], list[int]] = ([], [])

    def register(self, image) -> list[int]:
        """The ids of ``image``'s image tokens (preparing it now; encoding waits for a forward)."""
        return self.add(self.prepare(image))

    def add(self, pixels: torch.Tensor) -> list[int]:
        """``register`` for a picture prepared elsewhere (the ingress sends pixels with a request)."""
        ids = picture_ids(pixels, self.tokens_per_image)
        digest = (ids[0] - VIRTUAL_BASE) // self.tokens_per_image
        self._remember(self._pixels, digest, pixels)
        if digest in self._rows:
            self._rows.move_to_end(digest)
        return ids

    def _remember(self, store: OrderedDict, digest: int, value: torch.Tensor) -> None:
        store[digest] = value
        store.move_to_end(digest)
        while len(store) > self.capacity:
            store.popitem(last=False)

    def rows(self, ids: torch.Tensor) -> torch.Tensor:
        """Embeddings [n, hidden] of virtual ``ids`` [n] (pooled ones too: ``pooled_view``),
        encoding the pictures not yet encoded in one batch."""
        pooled = ids >= POOLED_BASE
        if bool(pooled.any()):
            pooled_rows = self._pooled_rows(ids[pooled])
            out = pooled_rows.new_empty((len(ids), pooled_rows.shape[-1]))
            out[pooled] = pooled_rows
            if not bool(pooled.all()):
                out[~pooled] = self.rows(ids[~pooled]).to(out.dtype)
            return out
        offsets = (ids - VIRTUAL_BASE).tolist()
        digests = [o // self.tokens_per_image for o in offsets]
        pending = sorted({d for d in digests if d not in self._rows})
        if pending:
            missing = [d for d in pending if d not in self._pixels]
            if missing:
                raise KeyError(f"{len(missing)} picture(s) of this prompt left the image store before its prefill "
                               f"(capacity {self.capacity}): raise the capacity above the pictures in flight")
            with torch.no_grad():
                encoded = self.encode(torch.stack([self._pixels[d] for d in pending]))   # [p, T, hidden]
            self.encoded_images += len(pending)
            for d, rows in zip(pending, encoded):
                self._remember(self._rows, d, rows)
        return torch.stack([self._rows[d][o % self.tokens_per_image] for d, o in zip(digests, offsets)])

    def _pooled_rows(self, ids: torch.Tensor) -> torch.Tensor:
        """Pooled tokens' rows: the mean of each block of the picture's square patch grid."""
        side, blocks = math.isqrt(self.tokens_per_image), math.isqrt(self.pooled)
        block = side // blocks
        means: dict[int, torch.Tensor] = {}   # digest -> [pooled, hidden]
        rows = []
        for t in ids.tolist():
            digest, j = divmod(t - POOLED_BASE, self.pooled)
            if digest not in means:
                base = VIRTUAL_BASE + digest * self.tokens_per_image
                grid = self.rows(torch.arange(base, base + self.tokens_per_image)).view(side, side, -1)
                means[digest] = grid.view(blocks, block, blocks, block, -1).mean(dim=(1, 3)).reshape(self.pooled, -1)
            rows.append(means[digest][j])
        return torch.stack(rows)


def placeholder_for(images: ImageStore | None, prompt_ids: list[int]) -> int | None:
    """A request's ``SpecRequest.image_placeholder``: the store's placeholder when the prompt shows
    a picture, else None."""
    return images.placeholder if images is not None and any(t >= VIRTUAL_BASE for t in prompt_ids) else None


def embed(ids: torch.Tensor, weight: torch.Tensor, images: ImageStore | None) -> torch.Tensor:
    """``F.embedding(ids, weight)`` where virtual ids take their picture's rows (``images``: None
    when no id of this forward is virtual, which the caller knows without a device sync)."""
    if images is None:
        return F.embedding(ids, weight)
    virtual = ids >= VIRTUAL_BASE
    h = F.embedding(ids.masked_fill(virtual, 0), weight)
    h[virtual] = images.rows(ids[virtual]).to(device=h.device, dtype=h.dtype)
    return h
