"""A draft's weights as int8 rows, one float32 scale per row: ``y = (x Q^T) s + b``
(``kernels/int8_gemm.c``), what ``quantization: int8`` on a draft asks for.

Why: a draft's step on a CPU is bound by reading its weights (an output layer of 8-16k rows is
most of a small draft's bytes), and int8 rows are a quarter of float32's. A draft only proposes:
rounding its weights changes how often its tokens are accepted, never the output, which
verification decides against the target's own distribution with the draft's own q
(docs/design.md §4). torch's quantized tensors are deprecated, hence the kernel of our own.

Rounding is symmetric per output row (s = max |w| / 127, round half to even). A step of up to
``MAX_ROWS`` rows goes through the kernel; a larger one (a prefill chunk) multiplies the
dequantized weights with torch's BLAS: the same rounded weights, the sums in another order.
"""

from __future__ import annotations

import ctypes

import torch
import torch.nn.functional as F

from specserve.replicas.model import native_kernels

MAX_ROWS = 24
_I64, _PTR = ctypes.c_int64, ctypes.c_void_p
_SIGNATURES = {"linear_i8": [_PTR, _I64, _PTR, _PTR, _PTR, _PTR, _I64, _I64, _I64, _I64]}


def library() -> ctypes.CDLL | None:
    return native_kernels.load("int8_gemm", _SIGNATURES, "int8 draft weights stay float32")


def quantize_rows(weight: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """int8 rows Q [N, K] and float32 scales s [N] with Q * s ≈ weight (an all-zero row: s = 1)."""
    w = weight.detach().float()
    top = w.abs().amax(dim=1)
    scale = torch.where(top > 0, top / 127.0, torch.ones_like(top))
    q = torch.round(w / scale[:, None]).clamp_(-127, 127).to(torch.int8)
    return q.contiguous(), scale.contiguous()


class Int8Linear:
    """``F.linear`` with the weight rounded to int8 rows; float32 in and out, on the CPU."""

    def __init__(self, weight: torch.Tensor, bias: torch.Tensor | None):
        self.q, self.scale = quantize_rows(weight)
        self.bias = None if bias is None else bias.detach().float().contiguous()
        self.dequantized = self.q.float() * self.scale[:, None]   # the BLAS's weight for large steps
        self.out_features, self.in_features = self.q.shape

    @staticmethod
    def takes(weight: torch.Tensor) -> bool:
        """Float32 2-D weights on the CPU, where the kernel could be built."""
        return (weight.device.type == "cpu" and weight.dtype == torch.float32 and weight.dim() == 2
                and library() is not None)

    def __call__(self, x: torch.Tensor) -> torch.Tensor:
        rows = x.numel() // x.shape[-1] if x.shape[-1] else 0
        if rows == 0 or rows > MAX_ROWS or x.dtype != torch.float32:
            return F.linear(x.float(), self.dequantized, self.bias)
        flat = x.reshape(rows, x.shape[-1])
        if flat.stride(-1) != 1:
            flat = flat.contiguous()
        out = torch.empty(rows, self.out_features, dtype=torch.float32)
        library().linear_i8(flat.data_ptr(), flat.stride(0), self.q.data_ptr(), self.scale.data_ptr(),
                            None if self.bias is None else self.bias.data_ptr(), out.data_ptr(), out.stride(0),
                            rows, self.out_features, self.in_features)
        return out.reshape(*x.shape[:-1], self.out_features)
