"""Qwen2-VL's multimodal rotary positions (M-RoPE), for a slot's tokens as ids.

Qwen2-VL rotates each query and key by three positions, (t, h, w), each over its own section of
the rotary frequencies (``mrope_section``, e.g. 16, 24, 24 of 64). A text token has t = h = w = p,
which is ordinary 1-D RoPE at p. A picture of ``rows x columns`` image tokens (after the merger)
starting where the text would be at p0 has, for its token in row r and column c, t = p0,
h = p0 + r, w = p0 + c, and the text after it resumes at p0 + max(rows, columns), not
p0 + rows · columns.

Here a token's (t, h, w) is ``(p, p + dh, p + dw)``: ``positions`` gives p, dh and dw for the
tokens a feed appends to a slot, from the slot's cached tokens and the feed's own (image tokens are
virtual ids that carry their cell on the picture's grid, ``image_tokens``). The forward takes rows
of the ordinary rotary table at p, p + dh and p + dw and keeps each from its section
(``LlamaForward``).
"""

from __future__ import annotations

import torch

from specserve.replicas.model.image_tokens import cell, is_picture_token


def section_dims(sections: list[int], head_dim: int) -> tuple[torch.Tensor, torch.Tensor]:
    """Which of a head's rotary dimensions turn by h and which by w ([head_dim] bool each; the
    rest by t)."""
    if sum(sections) != head_dim // 2:
        raise ValueError(f"mrope_section {sections} must cover half the head dimension ({head_dim // 2})")
    which = torch.cat([torch.full((n,), i % 3) for i, n in enumerate(sections)])
    which = torch.cat([which, which])           # rotate_half's layout: the frequencies twice
    return which == 1, which == 2


class _Walk:
    """Positions along a slot's tokens: the next text token's position, and the picture whose
    tokens are being read (its first position, its extent so far)."""

    def __init__(self):
        self.next = 0
        self.picture: tuple[int, int, int, int] | None = None   # (digest, p0, rows, columns)

    def close(self) -> int:
        """The next text token's position (a picture being read ends here)."""
        if self.picture is not None:
            _, p0, rows, columns = self.picture
            self.next, self.picture = p0 + max(rows, columns), None
        return self.next

    def take(self, token: int) -> tuple[int, int, int]:
        if not is_picture_token(token):
            p = self.close()
            self.next += 1
            return p, 0, 0
        digest, row, column = cell(token)
        if self.picture is None or self.picture[0] != digest or row == column == 0:
            self.close()
            self.picture = (digest, self.next, 0, 0)
        _, p0, rows, columns = self.picture
        self.picture = (digest, p0, max(rows, row + 1), max(columns, column + 1))
        return p0, row, column


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
        walk = _Walk()
        for t in cached:
            walk.take(t)
        if not any(is_picture_token(t) for t in tokens):
            first = walk.close()
            return [first + d - 1 for d in depths], [0] * len(tokens), [0] * len(tokens)
        if depths != list(range(1, len(tokens) + 1)):
            raise ValueError("a feed with image tokens must be a chain")
        p, dh, dw = zip(*(walk.take(t) for t in tokens))
        return list(p), list(dh), list(dw)
