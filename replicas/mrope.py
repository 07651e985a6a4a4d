"""Qwen2-VL's multimodal rotary positions (M-RoPE), for a slot's tokens as ids.

Qwen2-VL rotates each query and key by three positions, (t, h, w), each over its own section of
the rotary frequencies (``mrope_section``, e.g. 16, 24, 24 of 64). A text token has t = h = w = p,
which is ordinary 1-D RoPE at p. A picture of ``side x side`` image tokens (after the merger)
starting where the text would be at p0 has, for its token j, t = p0, h = p0 + j // side,
w = p0 + j % side, and the text after it resumes at p0 + side, not p0 + side²: each picture
shifts every later position by ``side - side²``.

Here a token's (t, h, w) is ``(p, p + dh, p + dw)``: ``positions`` gives p, dh and dw for the
tokens a feed appends to a slot, from the slot's cached tokens and the feed's own (image tokens are
virtual ids, ``image_tokens``, whose offset in their picture is j). The forward takes rows of the
ordinary rotary table at p, p + dh and p + dw and keeps each from its section (``LlamaForward``).
"""

from __future__ import annotations

import math

import torch

from specserve.replicas.image_tokens import POOLED_BASE, VIRTUAL_BASE


def section_dims(sections: list[int], head_dim: int) -> tuple[torch.Tensor, torch.Tensor]:
    """Which of a head's rotary dimensions turn by h and which by w ([head_dim] bool each; the
    rest by t)."""
    if sum(sections) != head_dim // 2:
        raise ValueError(f"mrope_section {sections} must cover half the head dimension ({head_dim // 2})")
    which = torch.cat([torch.full((n,), i % 3) for i, n in enumerate(sections)])
    which = torch.cat([which, which])           # rotate_half's layout: the frequencies twice
    return which == 1, which == 2


class MRope:
    def __init__(self, sections: list[int], head_dim: int, tokens_per_image: int):
        side = math.isqrt(tokens_per_image)
        if side * side != tokens_per_image:
            raise ValueError(f"a picture's image tokens must form a square grid; got {tokens_per_image}")
        self.side, self.tokens_per_image = side, tokens_per_image
        section_dims(sections, head_dim)   # checked here, at load, rather than in a forward

    @classmethod
    def of(cls, model, tokens_per_image: int) -> "MRope | None":
        """The model's M-RoPE, or None for 1-D rotary."""
        rotary = getattr(getattr(model, "model", None), "rotary_emb", None)
        sections = getattr(rotary, "mrope_section", None)
        if sections is None:
            return None
        config = model.config
        head_dim = getattr(config, "head_dim", None) or config.hidden_size // config.num_attention_heads
        return cls(list(sections), head_dim, tokens_per_image)

    def positions(self, cached: list[int], tokens: list[int], depths: list[int]) -> tuple[list[int], list[int], list[int]]:
        """(p, dh, dw) of ``tokens`` appended after ``cached``, token i at depth ``depths[i]``
        (a chain: 1, 2, ...; a tree's nodes share depths)."""
        per, side = self.tokens_per_image, self.side
        shift = side - per
        # Pictures completed in the cache (their last image token cached) shift every later position.
        delta = shift * sum(1 for t in cached if VIRTUAL_BASE <= t < POOLED_BASE and (t - VIRTUAL_BASE) % per == per - 1)
        base = len(cached) - 1
        p, dh, dw = [], [], []
        for t, d in zip(tokens, depths):
            column = base + d
            if VIRTUAL_BASE <= t < POOLED_BASE:
                j = (t - VIRTUAL_BASE) % per
                row, col = divmod(j, side)
                p.append(column - j + delta)   # the picture's first token's position
                dh.append(row)
                dw.append(col)
                if j == per - 1:
                    delta += shift
            else:
                p.append(column + delta)
                dh.append(0)
                dw.append(0)
        return p, dh, dw
