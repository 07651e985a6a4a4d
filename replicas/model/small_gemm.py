"""``y = x W^T + b`` in float32 for the few rows of a decode or verify step, one pass over the
weights whatever the row count (``kernels/small_gemm.c``).

Why: on some CPUs torch's float32 ``F.linear`` re-reads the weights for each of a step's first
rows (a BLAS on a generic path), so a verify of 1 + γ tokens costs nearly 1 + γ plain steps and no
draft can pay (docs/benchmarks.md §3.0 has the measurements). Memory-bound, one pass is the floor
for up to a few rows: the kernel multiplies each weight row with up to 8 rows of x while it sits
in cache.

Each output is a fixed-order dot product, the same whatever the step's row count (a row's result
never depends on the batch), but not the same order as the BLAS's: float32 results may differ
from ``F.linear``'s in the last bits, so greedy output may differ from torch's path only at a
near-tie. It is used where a probe on this machine finds it faster than ``F.linear`` at a few
rows (``pays``), for float32 weights on the CPU larger than the caches, and for steps of up to
``MAX_ROWS`` rows (prefill chunks and large batches keep the BLAS, whose blocking wins there);
without a compiler, never.
"""

from __future__ import annotations

import ctypes
import functools
import time

import torch
import torch.nn.functional as F

from specserve.replicas.model import native_kernels

# Rows above this go to torch's BLAS, whose blocking wins there (a prefill chunk, a large batch).
MAX_ROWS = 24
# Smaller weights stay with torch: they sit in cache, where re-reading costs little (and the tiny
# test models keep torch's arithmetic).
MIN_WEIGHT = 1 << 18
_I64, _PTR = ctypes.c_int64, ctypes.c_void_p
_SIGNATURES = {"linear_f32": [_PTR, _I64, _PTR, _PTR, _PTR, _I64, _I64, _I64, _I64]}


def library() -> ctypes.CDLL | None:
    return native_kernels.load("small_gemm", _SIGNATURES, "float32 products use F.linear")


def takes(weight: torch.Tensor) -> bool:
    """Whether the kernel serves this weight's products: float32 on the CPU, large, contiguous, a
    kernel that could be built, and one that pays on this machine."""
    return (weight.device.type == "cpu" and weight.dtype == torch.float32 and weight.dim() == 2
            and weight.numel() >= MIN_WEIGHT and weight.is_contiguous() and library() is not None and pays())


def linear(x: torch.Tensor, weight: torch.Tensor, bias: torch.Tensor | None) -> torch.Tensor:
    """``F.linear(x, weight, bias)`` for x [..., K]; the kernel for up to MAX_ROWS rows (it is not
    differentiable: a forward that records gradients keeps ``F.linear``)."""
    rows = x.numel() // x.shape[-1] if x.shape[-1] else 0
    if (rows == 0 or rows > MAX_ROWS or x.dtype != torch.float32 or x.device.type != "cpu"
            or (torch.is_grad_enabled() and (x.requires_grad or weight.requires_grad))):
        return F.linear(x, weight, bias)
    flat = x.reshape(rows, x.shape[-1])
    if flat.stride(-1) != 1:
        flat = flat.contiguous()
    out = torch.empty(rows, weight.shape[0], dtype=torch.float32)
    library().linear_f32(flat.data_ptr(), flat.stride(0), weight.data_ptr(),
                         None if bias is None else bias.data_ptr(), out.data_ptr(), out.stride(0),
                         rows, weight.shape[0], weight.shape[1])
    return out.reshape(*x.shape[:-1], weight.shape[0])


@functools.cache
def pays(rows: int = 3, out_features: int = 16384, in_features: int = 1024, rounds: int = 5) -> bool:
    """Whether the kernel beats ``F.linear`` on this machine at a verify's few rows, on a weight
    too large for the caches (as a model's are): timed once per process, in a fraction of a second."""
    weight = torch.randn(out_features, in_features)
    x = torch.randn(rows, in_features)

    def best(fn) -> float:
        fn()
        times = []
        for _ in range(rounds):
            t0 = time.perf_counter()
            fn()
            times.append(time.perf_counter() - t0)
        return min(times)

    ours = best(lambda: linear(x, weight, None))
    theirs = best(lambda: F.linear(x, weight))
    return ours < 0.9 * theirs
