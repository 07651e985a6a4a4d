"""The elementwise pieces of a decoder layer, between its products, as functions of tensors only:
eager torch, or each compiled by ``torch.compile`` (inductor) into one generated kernel.

Why: on a GPU a decode step's products run at the memory's bandwidth, and under a CUDA graph a
launch costs only its kernel's length; what a step spends beyond its products is the small
kernels between them (docs/benchmarks.md §10.2's profile): the residual add, RMSNorm in float32
with a cast on each side and the scale, rotary on q and k, SiLU(gate) * up, each pass reading and
writing the activations again. Fused, those are four kernels per layer (the norm runs twice)
instead of seventeen (the C kernels of ``cpu_row_ops`` fuse the same pieces on the CPU, which
keeps them).

The maths is Hugging Face's eager recipe: the residual sum rounded to the model's dtype, the norm
in float32, cast back, then scaled; rotary as ``x * cos + rotate_half(x) * sin``. Compiled, each
intermediate is still rounded where eager torch rounds it (inductor's
``emulate_precision_casts``), so a fused kernel differs from the eager ops only in the order of
the norm's sum. Shapes are dynamic (one compile serves every batch, width and head count, apart
from inductor's own specialisation of sizes 0 and 1); a compile happens on the first call of a
shape, which on CUDA is a graph's warm-up (``cuda_graphs``), never inside a capture.
"""

from __future__ import annotations

import functools
import importlib.util
import logging
import os
from dataclasses import dataclass
from typing import Callable

import torch
import torch.nn.functional as F

log = logging.getLogger(__name__)

# Compiles kept per function (``compiled``).
RECOMPILE_LIMIT = 64
# Set to 0 to run the elementwise pieces as eager torch ops on CUDA too (a debugging switch).
ENV_SWITCH = "SPECSERVE_FUSED_ELEMENTWISE"


def add_rms_norm(h: torch.Tensor, delta: torch.Tensor | None, weight: torch.Tensor,
                 eps: float) -> tuple[torch.Tensor, torch.Tensor]:
    """(h + delta, RMSNorm(h + delta) * weight); ``delta`` None: h as it is."""
    if delta is not None:
        h = h + delta
    return h, weight * F.rms_norm(h.float(), (h.shape[-1],), eps=eps).to(h.dtype)


def rope(qkv: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor,
         q_heads: int, kv_heads: int) -> tuple[torch.Tensor, torch.Tensor]:
    """Rotary embedding of q and k from the stacked projection's output ``qkv`` [B, S, q_heads +
    2 kv_heads, D] with ``cos``/``sin`` [B, S, 1, D]: q [B, q_heads, S, D] and k [B, kv_heads, S,
    D], contiguous (the layout attention and the cache take)."""
    half = qkv.shape[-1] // 2
    qk = qkv[:, :, : q_heads + kv_heads]
    qk = qk * cos + torch.cat((-qk[..., half:], qk[..., :half]), dim=-1) * sin
    return qk[:, :, :q_heads].transpose(1, 2).contiguous(), qk[:, :, q_heads:].transpose(1, 2).contiguous()


def silu_mul(gate_up: torch.Tensor) -> torch.Tensor:
    """SiLU(gate) * up from the stacked gate and up products [..., 2 I]."""
    gate, up = gate_up.chunk(2, dim=-1)
    return F.silu(gate) * up


@dataclass(frozen=True)
class ElementwiseOps:
    add_rms_norm: Callable
    rope: Callable
    silu_mul: Callable
    fused: bool


EAGER = ElementwiseOps(add_rms_norm, rope, silu_mul, fused=False)


def compile_one(fn: Callable) -> Callable:
    """``fn`` compiled once per dynamic shape family, with eager torch's roundings kept."""
    return torch.compile(fn, dynamic=True, fullgraph=True, options={"emulate_precision_casts": True})


@functools.cache
def compiled() -> ElementwiseOps:
    """The three pieces compiled (lazily: each compiles on its first call). Dynamo keeps a few
    compiles per function and runs it eagerly past them; a replica's models (dtypes, epsilons,
    sizes 1 and more, with and without a residual) need more than its default of 8."""
    config = torch._dynamo.config
    config.recompile_limit = max(config.recompile_limit, RECOMPILE_LIMIT)
    return ElementwiseOps(*(_falls_back(compile_one(fn), fn) for fn in (add_rms_norm, rope, silu_mul)), fused=True)


def _falls_back(fast: Callable, eager: Callable) -> Callable:
    """``fast``, or ``eager`` from the first call on that ``fast`` failed (no compiler for the
    device, an inductor bug): the same maths, unfused, logged once."""
    state = {"failed": False}

    def call(*args):
        if not state["failed"]:
            try:
                return fast(*args)
            except Exception as err:   # torch._dynamo / inductor raise many kinds of errors
                if torch.cuda.is_available() and torch.cuda.is_current_stream_capturing():
                    raise   # inside a capture nothing may compile: the warm-up should have
                state["failed"] = True
                log.warning("%s runs unfused from now on: its compiled kernel failed (%s)", eager.__name__, err)
        return eager(*args)

    return call


def available(device: torch.device) -> bool:
    """Whether the fused kernels run on ``device``: CUDA with Triton (inductor's GPU backend),
    unless switched off by env. The CPU keeps ``cpu_row_ops``."""
    return device.type == "cuda" and os.environ.get(ENV_SWITCH, "1") != "0" and _triton_installed()


@functools.cache
def _triton_installed() -> bool:
    return importlib.util.find_spec("triton") is not None


def for_device(device: torch.device) -> ElementwiseOps:
    """The compiled pieces where ``available``, else the eager ones."""
    return compiled() if available(device) else EAGER
