"""Qwen2-VL's multimodal rotary positions (M-RoPE), for a slot's tokens as ids.

Qwen2-VL rotates each query and key by three positions, (t, h, w), each over its own section of
the rotary frequencies (``mrope_section``, e.g. 16, 24, 24 of 64). A text token has t = h = w = p,
which is ordinary 1-D RoPE at p. A picture of ``rows x columns`` image tokens (after the merger)
starting where the text would be at p0 has, for its token in row r and column c, t = p0,
h = p0 + r, w = p0 + c, and the text after it resumes at p0 + max(rows, columns), not
p0 + rows · columns. A clip is read as temporal patches (two frames a patch), each a unit on the
same grid (``image_tokens.CLIP_FLAG``): the token in row r and column c of patch k has t = p0 +
t_k, h = p0 + r, w = p0 + c, where t_k = k for Qwen2-VL and Qwen2.5-VL's patch k's time in steps
of its clip's frame rate (each unit carries its advance over the patch before it,
``image_tokens.clip_advance``); the text after the clip resumes at p0 + max(rows, columns), as
Hugging Face's ``get_rope_index`` places a video (the ingress refuses clips whose last patch's
time reaches that, where Qwen's own code resumes after the last patch: ``pictures.clip_preparer``).

Here a token's (t, h, w) is ``(p, p + dh, p + dw)``: ``positions`` gives p, dh and dw for the
tokens a feed appends to a slot, from the slot's cached tokens and the feed's own (image tokens are
virtual ids that carry their cell on the picture's grid, ``image_tokens``). The forward takes rows
of the ordinary rotary table at p, p + dh and p + dw and keeps each from its section
(``LlamaForward``).
"""

from __future__ import annotations

import numpy as np
import torch

from specserve.replicas.model.image_tokens import (CELL_BITS, CLIP_FLAG, POOLED_BASE, VIRTUAL_BASE, cell,
                                                   clip_advance, is_picture_token)


def section_dims(sections: list[int], head_dim: int) -> tuple[torch.Tensor, torch.Tensor]:
    """Which of a head's rotary dimensions turn by h and which by w ([head_dim] bool each; the
    rest by t)."""
    if sum(sections) != head_dim // 2:
        raise ValueError(f"mrope_section {sections} must cover half the head dimension ({head_dim // 2})")
    which = torch.cat([torch.full((n,), i % 3) for i, n in enumerate(sections)])
    which = torch.cat([which, which])           # rotate_half's layout: the frequencies twice
    return which == 1, which == 2


def _cells(tokens: np.ndarray) -> tuple[np.ndarray, np.ndarray, np.ndarray]:
    """(digest, row, column) arrays of picture tokens (``image_tokens.cell``, vectorised)."""
    offset = tokens - VIRTUAL_BASE
    mask = (1 << CELL_BITS) - 1
    return offset >> (2 * CELL_BITS), (offset >> CELL_BITS) & mask, offset & mask


class _Walk:
    """Positions along a slot's tokens: the next text token's position, and the picture (or clip)
    whose tokens are being read: its unit's digest, its first position, its extent so far and
    the time of the temporal patch being read."""

    def __init__(self):
        self.next = 0
        self.picture: tuple[int, int, int, int, int] | None = None   # (digest, p0, rows, columns, t)

    def close(self) -> int:
        """The next text token's position (a picture being read ends here)."""
        if self.picture is not None:
            _, p0, rows, columns, _ = self.picture
            self.next, self.picture = p0 + max(rows, columns), None
        return self.next

    @classmethod
    def after(cls, cached: list[int]) -> "_Walk":
        """The walk at the end of ``cached``, as ``take`` of each token leaves it, with the text
        counted in bulk (numpy over the ids): a slot's cache is long, a step's feed short."""
        walk = cls()
        ids = np.fromiter(cached, dtype=np.int64, count=len(cached))
        at = np.flatnonzero((ids >= VIRTUAL_BASE) & (ids < POOLED_BASE))   # picture tokens
        if not len(at):
            walk.next = len(cached)
            return walk
        digest, rows, columns = _cells(ids[at])
        first = np.ones(len(at), dtype=bool)   # where a unit starts: after text, another digest, cell (0, 0)
        first[1:] = (np.diff(at) != 1) | (digest[1:] != digest[:-1]) | ((rows[1:] == 0) & (columns[1:] == 0))
        units = np.flatnonzero(first)
        # A unit flagged as a clip's next temporal patch, right after another unit, is read with it.
        follows = np.r_[False, at[units[1:]] - at[units[1:] - 1] == 1]
        joins = follows & ((digest[units] & CLIP_FLAG) != 0)
        starts = units[~joins]                       # where a picture or clip starts
        lengths = np.diff(np.r_[starts, len(at)])
        extent = np.maximum.reduceat(np.maximum(rows, columns), starts) + 1
        shift = extent - lengths                     # later positions move by this once a picture ends
        before = np.r_[0, np.cumsum(shift)[:-1]]     # the shifts of the pictures before each one
        p0 = at[starts] + before
        if at[-1] == len(cached) - 1:   # the last picture is still being read
            walk.next = int(p0[-1])
            time = int(clip_advance(digest[units[(units >= starts[-1]) & joins]]).sum())
            walk.picture = (int(digest[units[-1]]), int(p0[-1]), int(rows[starts[-1]:].max()) + 1,
                            int(columns[starts[-1]:].max()) + 1, time)
        else:
            walk.next = len(cached) + int(shift.sum())
        return walk

    def take(self, token: int) -> tuple[int, int, int]:
        if not is_picture_token(token):
            p = self.close()
            self.next += 1
            return p, 0, 0
        digest, row, column = cell(token)
        if self.picture is None or self.picture[0] != digest or row == column == 0:
            if self.picture is not None and digest & CLIP_FLAG:   # the clip's next temporal patch
                _, p0, rows, columns, t = self.picture
                self.picture = (digest, p0, rows, columns, t + clip_advance(digest))
            else:
                self.close()
                self.picture = (digest, self.next, 0, 0, 0)
        _, p0, rows, columns, t = self.picture
        self.picture = (digest, p0, max(rows, row + 1), max(columns, column + 1), t)
        return p0 + t, row - t, column - t


class MRope:
    def __init__(self, sections: list[int], head_dim: int):
        section_dims(sections, head_dim)   # checked here, at load, rather than in a forward

    @classmethod
    def of(cls, model) -> "MRope | None":
        """The model's M-RoPE, or None for 1-D rotary."""
        rotary = getattr(getattr(model, "model", None), "rotary_emb", None)
        sections = getattr(rotary, "mrope_section", None)
        if sections is None:
            return None
        config = model.config
        head_dim = getattr(config, "head_dim", None) or config.hidden_size // config.num_attention_heads
        return cls(list(sections), head_dim)

    def positions(self, cached: list[int], tokens: list[int], depths: list[int]) -> tuple[list[int], list[int], list[int]]:
        """(p, dh, dw) of ``tokens`` appended after ``cached``, token i at depth ``depths[i]``
        (a chain: 1, 2, ...; a tree's nodes share depths, and a tree holds text only)."""
        walk = _Walk.after(cached)
        if not any(is_picture_token(t) for t in tokens):
            first = walk.close()
            return [first + d - 1 for d in depths], [0] * len(tokens), [0] * len(tokens)
        if depths != list(range(1, len(tokens) + 1)):
            raise ValueError("a feed with image tokens must be a chain")
        p, dh, dw = zip(*(walk.take(t) for t in tokens))
        return list(p), list(dh), list(dw)
