"""Attention of a verify step on the CPU with a small C kernel (``kernels/decode_attention.c``):
each sequence's cached keys and values are read once, in place, and only up to its own length.

Why: at a large batch attention is a large share of a one-core step, and torch's batched products
of 3-row query blocks (9 query heads over 3 kv heads, one new token) with the slot cache's views
run far below memory speed: they need a copy of every view first (strided views are slower
still), and every sequence is padded to the batch's longest (figures: docs/benchmarks.md §2.5).

The step is flat (``batch_kv``: each sequence's new tokens one after another, no padding): each
sequence has its slot, its first token in the step, its token count and its cached length, and
the mask is only the block among its own new tokens (every cached position is visible). The
kernel computes the scores (scaled q.k plus that mask, float32); torch's softmax runs between its
two calls, so the probabilities are torch's; the weighted sum of values accumulates in float32
and is written as the output projection takes it ([tokens, heads x head_dim]). Each sequence is
computed on its own, so a request's numbers do not depend on what else is in the step.

The library is compiled once per machine (``native_kernels.py``); without a compiler, or on
another device, ``usable`` says no and the caller takes the padded layout with torch's products.
"""

from __future__ import annotations

import ctypes

import torch

from specserve.replicas.model import native_kernels

MAX_HEAD_DIM = 256     # the kernel's per-thread buffers (kernels/decode_attention.c)
MAX_ROWS = 256         # query rows per kv head: (query heads per kv head) x new tokens
# Tokens a sequence may feed in one step (a window, a tree, a short prefill chunk). A step with a
# longer feed takes the padded layout, where every row is as wide as the longest feed, which makes
# a step with one tree beside many decoding requests several times slower than flat
# (docs/benchmarks.md §2.3). Longer queries (prefill chunks) are matrix products torch does well.
MAX_NEW_TOKENS = 64

_I64, _INT, _FLOAT, _PTR = ctypes.c_int64, ctypes.c_int, ctypes.c_float, ctypes.c_void_p
_SCORES = [_PTR, _PTR, _I64, _I64, _I64, _PTR, _INT, _PTR, _PTR, _INT, _INT, _INT, _INT, _INT, _INT, _FLOAT, _INT]
_MIX = [_PTR, _PTR, _I64, _I64, _I64, _PTR, _PTR, _INT, _INT, _INT, _INT, _INT, _INT]
_WRITE = [_PTR, _I64, _I64, _I64, _PTR, _I64, _I64, _I64, _PTR, _PTR, _INT, _INT, _INT, _INT, _INT]


def library() -> ctypes.CDLL | None:
    """The compiled kernel, built on first use; None (logged once) where it cannot be built."""
    signatures = {f"{op}_{suffix}": args for op, args in (("scores", _SCORES), ("mix", _MIX)) for suffix in ("bf16", "f32")}
    signatures["kv_write"] = _WRITE
    return native_kernels.load("decode_attention", signatures, "attention uses torch's products")


def usable(device: torch.device, dtype: torch.dtype, new_tokens: int, heads: int, kv_heads: int, head_dim: int) -> bool:
    """Whether ``attention`` takes a forward whose sequences get at most ``new_tokens`` each: a CPU
    verify step in bfloat16 or float32, with no gradient wanted, and a kernel that could be built."""
    return (device.type == "cpu" and dtype in (torch.bfloat16, torch.float32) and new_tokens <= MAX_NEW_TOKENS
            and head_dim <= MAX_HEAD_DIM and head_dim % 16 == 0 and (heads // kv_heads) * new_tokens <= MAX_ROWS
            and not torch.is_grad_enabled() and library() is not None)


def attention(q: torch.Tensor, keys: torch.Tensor, values: torch.Tensor, sequences: torch.Tensor,
              mask: torch.Tensor, length: int) -> torch.Tensor:
    """Attention of a flat (ragged) step's tokens, each over its own sequence's cache.

    q [nq, T, D] (the T tokens of the step, sequences one after another); keys, values: the slot
    buffers [slots, nkv, capacity, D], this step's keys already written; ``sequences`` int64
    [N, 4] of (slot, first token, tokens, cached positions) per sequence; ``mask`` [T, W] float32:
    0 where token j may see the step's c-th token of its own sequence, -inf elsewhere; ``length``:
    the longest sequence's cached + new positions. Returns [T, nq * D] in q's dtype, the output
    projection's input. Call only where ``usable`` said yes."""
    lib = library()
    nq, T, D = q.shape
    nkv = keys.shape[1]
    if keys.stride(-1) != 1 or values.stride(-1) != 1:   # the kernel walks the last dimension densely
        raise ValueError("the slot buffers must have a contiguous last dimension")
    q = q.contiguous()
    suffix = "bf16" if q.dtype == torch.bfloat16 else "f32"
    threads = torch.get_num_threads()
    scores = torch.empty(T, nq, length, dtype=torch.float32)
    getattr(lib, f"scores_{suffix}")(q.data_ptr(), keys.data_ptr(), keys.stride(0), keys.stride(1), keys.stride(2),
                                     mask.data_ptr(), mask.shape[1], sequences.data_ptr(), scores.data_ptr(),
                                     len(sequences), nq, nkv, T, D, length, D ** -0.5, threads)
    probs = torch.softmax(scores, dim=-1)
    out = torch.empty(T, nq * D, dtype=q.dtype)
    getattr(lib, f"mix_{suffix}")(probs.data_ptr(), values.data_ptr(), values.stride(0), values.stride(1),
                                  values.stride(2), sequences.data_ptr(), out.data_ptr(), len(sequences), nq, nkv,
                                  D, length, threads)
    return out


def write(cache: torch.Tensor, states: torch.Tensor, slots: torch.Tensor, columns: torch.Tensor) -> bool:
    """cache[slots[b, s], :, columns[b, s]] = states[b, :, s] for cache [slots, H, capacity, D]
    and states [B, H, S, D] on the CPU (``slots``, ``columns`` [B, S] int64, contiguous). False
    (nothing written) where the kernel cannot take it: the caller assigns with torch."""
    if cache.device.type != "cpu":   # decided before the library is looked up: a traced step reads no C library
        return False
    lib = library()
    if (lib is None or states.dtype != cache.dtype or cache.stride(-1) != 1
            or states.stride(-1) != 1 or not cache.is_contiguous() or columns.dtype != torch.int64
            or not columns.is_contiguous() or slots.dtype != torch.int64 or not slots.is_contiguous()):
        return False
    B, H, S, D = states.shape
    lib.kv_write(cache.data_ptr(), cache.stride(0), cache.stride(1), cache.stride(2), states.data_ptr(),
                 states.stride(0), states.stride(1), states.stride(2), slots.data_ptr(), columns.data_ptr(),
                 B, H, S, D, cache.element_size())
    return True
