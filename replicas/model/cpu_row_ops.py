"""Per-row operations of a decode step in one C pass each (``kernels/row_ops.c``): the greedy
argmax over the vocabulary, RMSNorm fused with the residual add before it, and the rotary
embedding of q and k.

Why: at decode sizes (1-16 rows) torch runs each of these as several passes with temporaries
and a dispatch each, and its bfloat16 argmax is a scalar loop, a noticeable share of a step that
one C pass makes small (figures: docs/benchmarks.md §2.4).

The numbers are Hugging Face's eager ones to the rounding: float32 arithmetic, each
intermediate rounded to the model's dtype where torch's ops round it (the residual sum; the norm
in float32, cast, then scaled). SiLU(gate) * up is left to torch, whose vectorised exp a plain
C loop does not match. Sums run in a different order than torch's, so a
float32 result can differ in the last bit: greedy tokens can differ from torch's path only at a
near-tie, and a row's result never depends on the other rows of the batch. Where the kernel
cannot be built, or off the CPU, callers keep torch's ops (``usable``).
"""

from __future__ import annotations

import ctypes

import torch

from specserve.replicas.model import native_kernels

MAX_HIDDEN = 16384   # kernels/row_ops.c's per-row buffer

_I64, _INT, _FLOAT, _PTR = ctypes.c_int64, ctypes.c_int, ctypes.c_float, ctypes.c_void_p
_SIGNATURES = {
    **{f"argmax_{s}": [_PTR, _I64, _INT, _I64, _PTR] for s in ("bf16", "f32")},
    **{f"add_rms_norm_{s}": [_PTR, _PTR, _PTR, _PTR, _INT, _INT, _FLOAT] for s in ("bf16", "f32")},
    **{f"rope_{s}": [_PTR, _PTR, _PTR, _PTR, _PTR, _INT, _INT, _INT, _INT, _INT] for s in ("bf16", "f32")},
}
_SUFFIX = {torch.bfloat16: "bf16", torch.float32: "f32"}


def library() -> ctypes.CDLL | None:
    return native_kernels.load("row_ops", _SIGNATURES, "decode steps use torch's ops")


def usable(x: torch.Tensor) -> bool:
    """Whether the kernels take ``x``: on the CPU, bfloat16 or float32, and a kernel that could be
    built. (They are not differentiable: a forward that wants gradients keeps torch's ops.)"""
    return x.device.type == "cpu" and x.dtype in _SUFFIX and library() is not None


def argmax(logits: torch.Tensor, nan: int | None = None) -> list[int]:
    """The first index of each row's largest value (torch's rule): logits [R, V], rows may be
    strided. A row holding NaN takes torch's own argmax (NaN counts as the largest there), or
    ``nan`` when given (a caller that must refuse such rows learns of them for free)."""
    rows, n = logits.shape
    if logits.stride(-1) != 1:
        logits = logits.contiguous()
    out = torch.empty(rows, dtype=torch.int64)
    getattr(library(), f"argmax_{_SUFFIX[logits.dtype]}")(logits.data_ptr(), logits.stride(0), rows, n, out.data_ptr())
    choice = out.tolist()
    for r, c in enumerate(choice):
        if c < 0:   # a NaN or a largest zero: torch decides
            choice[r] = int(logits[r].argmax())
            if nan is not None and logits[r, choice[r]].isnan():
                choice[r] = nan
    return choice


def add_rms_norm(h: torch.Tensor, delta: torch.Tensor | None, weight: torch.Tensor, eps: float) -> torch.Tensor:
    """``h += delta`` in place (none when ``delta`` is None), then RMSNorm(h) * weight, new tensor.
    h, delta: [..., n] contiguous of one dtype; weight [n]."""
    n = h.shape[-1]
    if not h.is_contiguous() or (delta is not None and not delta.is_contiguous()) or n > MAX_HIDDEN:
        raise ValueError("add_rms_norm needs contiguous rows of at most MAX_HIDDEN elements")
    y = torch.empty_like(h)
    getattr(library(), f"add_rms_norm_{_SUFFIX[h.dtype]}")(
        h.data_ptr(), None if delta is None else delta.data_ptr(), weight.contiguous().data_ptr(), y.data_ptr(),
        h.numel() // n, n, eps)
    return y


def rope(qkv: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor, nq: int, nkv: int) -> tuple[torch.Tensor, torch.Tensor]:
    """Rotary embedding of q and k from the stacked projection's output ``qkv`` [B, S, nq + 2 nkv, D]
    with ``cos``/``sin`` [B, S, D] (each position's row): q [B, nq, S, D] and k [B, nkv, S, D],
    contiguous, rounded as Hugging Face's ``q * cos + rotate_half(q) * sin``."""
    B, S, heads, D = qkv.shape
    qkv, cos, sin = qkv.contiguous(), cos.contiguous(), sin.contiguous()
    q = qkv.new_empty(B, nq, S, D)
    k = qkv.new_empty(B, nkv, S, D)
    getattr(library(), f"rope_{_SUFFIX[qkv.dtype]}")(qkv.data_ptr(), cos.data_ptr(), sin.data_ptr(), q.data_ptr(),
                                                     k.data_ptr(), B, S, nq, nkv, D)
    return q, k
