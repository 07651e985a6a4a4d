"""How many KV slots a target replica allocates: on a GPU, what the device's memory holds after the
weights (vLLM's ``gpu_memory_utilization``); elsewhere, what the configuration says.

The rule on CUDA, measured once the models are loaded and before the cache is allocated::

    kv bytes = u x total - (total - free) - activation allowance
    slots    = min(max_batch + kv_sessions_idle, kv bytes // (bytes per token x max_model_len))

``total - free`` is the memory in use at start: this process's weights (and those of drafts placed
inside), its CUDA context, and whatever else runs on the device. Fewer slots than configured give
up the idle sessions' prefix caches first, then batch places (``max_running`` follows, so no
request is admitted without a slot); not even one slot is an error that says what to change.

Off CUDA (the CPU) the configuration stands: there the cache shares the host's memory, which no
fraction of one device describes.
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass

import torch

GiB = 1 << 30
# A forward's activations (and the allocator's slack, captured CUDA graphs' pools) get this
# fraction of the device: their peak depends on the attention kernel, the batch's layout and the
# graphs captured, which no formula here follows (vLLM measures it with a profiling forward).
ACTIVATION_FRACTION = 0.05

# A draft LM's cache on CUDA is reserved at start, at the longest context served or as many
# positions as this fraction of the device holds (and its free memory), and its graphs captured
# once; a context past a reservation grows the cache, which drops the graphs. Fewer positions than
# MIN_DRAFT_RESERVATION are not reserved: the first prompts would outgrow them.
DRAFT_KV_FRACTION = 0.1
MIN_DRAFT_RESERVATION = 256

SIZED_BY_DEVICE = "device memory"
SIZED_BY_CONFIG = "config"


def _text_config(config):
    """A VLM's language model's config; a text model's own."""
    return config.get_text_config() if hasattr(config, "get_text_config") else config


def _capped(max_model_len: int, context: int | None) -> int:
    """A slot holds at most the model's context, whatever max_model_len says (``BatchKV.max_len``)."""
    return max_model_len if context is None else min(max_model_len, context)


def kv_bytes_per_token(config, dtype: torch.dtype) -> int:
    """Bytes one cached position takes in every layer: keys and values, each ``kv_heads x
    head_dim`` elements of ``dtype`` (the defaults as ``llama_forward.LlamaForward`` reads them)."""
    config = _text_config(config)
    heads = config.num_attention_heads
    kv_heads = getattr(config, "num_key_value_heads", None) or heads
    head_dim = getattr(config, "head_dim", None) or config.hidden_size // heads
    return 2 * config.num_hidden_layers * kv_heads * head_dim * torch.empty((), dtype=dtype).element_size()


def check_utilization(gpu_memory_utilization: float) -> None:
    if not 0.0 < gpu_memory_utilization <= 1.0:
        raise ValueError(f"gpu_memory_utilization must be in (0, 1], got {gpu_memory_utilization}")


@dataclass(frozen=True)
class KVBudget:
    """What the device leaves the KV cache: ``kv_bytes``, the ``tokens`` (cached positions) they
    hold, and the ``slots`` of ``max_model_len`` positions among them."""

    kv_bytes: int
    tokens: int
    max_model_len: int
    slots: int


def kv_budget_bytes(total_bytes: int, free_bytes: int, *, gpu_memory_utilization: float, weights_bytes: int,
                    activation_fraction: float = ACTIVATION_FRACTION) -> int:
    """``u x total - in use at start - activation allowance`` (may be negative). In use is at least
    ``weights_bytes``, so that a reading taken before the weights loaded still counts them."""
    check_utilization(gpu_memory_utilization)
    in_use = max(total_bytes - free_bytes, weights_bytes)
    return int(gpu_memory_utilization * total_bytes) - in_use - int(activation_fraction * total_bytes)


def kv_budget(total_bytes: int, free_bytes: int, *, gpu_memory_utilization: float, weights_bytes: int,
              bytes_per_token: int, max_model_len: int, activation_fraction: float = ACTIVATION_FRACTION) -> KVBudget:
    """The slots of ``max_model_len`` positions that fit (``kv_budget_bytes``); a ValueError naming
    the figures when not even one does, since a replica without a slot serves nothing."""
    kv_bytes = kv_budget_bytes(total_bytes, free_bytes, gpu_memory_utilization=gpu_memory_utilization,
                               weights_bytes=weights_bytes, activation_fraction=activation_fraction)
    tokens = max(kv_bytes, 0) // bytes_per_token
    slots = tokens // max_model_len
    if slots < 1:
        raise ValueError(
            f"no KV slot fits: one of max_model_len {max_model_len} positions needs "
            f"{max_model_len * bytes_per_token / GiB:.2f} GiB, but the KV cache gets {max(kv_bytes, 0) / GiB:.2f} GiB "
            f"(gpu_memory_utilization {gpu_memory_utilization} x {total_bytes / GiB:.2f} GiB, less "
            f"{(total_bytes - free_bytes) / GiB:.2f} GiB in use at start with {weights_bytes / GiB:.2f} GiB of weights, "
            f"less {activation_fraction * total_bytes / GiB:.2f} GiB for activations): lower max_model_len or raise "
            "gpu_memory_utilization")
    return KVBudget(kv_bytes, tokens, max_model_len, slots)


@dataclass(frozen=True)
class KVSlots:
    """What a target replica allocates: ``slots`` KV caches of ``max_model_len`` positions (None:
    the model's context, grown as sequences do), at most ``max_running`` of them for running
    requests (the rest keep idle sessions as a prefix cache), and what decided it (``sized_by``)."""

    slots: int
    max_running: int
    max_model_len: int | None
    sized_by: str


def model_bytes(model: torch.nn.Module) -> int:
    """The bytes of ``model``'s parameters and buffers: its weights."""
    return sum(t.numel() * t.element_size() for t in (*model.parameters(), *model.buffers()))


def free_device_memory(device: torch.device) -> tuple[int, int]:
    """(free, total) bytes of ``device``, the allocator's cached blocks given back first: to the
    driver they are in use, yet the KV cache can take them."""
    torch.cuda.empty_cache()
    return torch.cuda.mem_get_info(device)


def choose_slots(max_batch: int, kv_sessions_idle: int, max_model_len: int | None, *, device: torch.device,
                 model_config, dtype: torch.dtype, weights_bytes: int, gpu_memory_utilization: float,
                 mem_get_info: Callable[[torch.device], tuple[int, int]] = free_device_memory) -> KVSlots:
    """The target replica's slots: on CUDA as many as the device holds (at most the configured
    ``max_batch + kv_sessions_idle``), with ``max_model_len`` None taken as the model's context
    capped so that ``max_batch`` slots fit; elsewhere as configured (``mem_get_info`` not called).
    ``mem_get_info(device)``: (free, total) bytes, as ``torch.cuda.mem_get_info``."""
    check_utilization(gpu_memory_utilization)
    configured = max_batch + kv_sessions_idle
    if torch.device(device).type != "cuda":
        return KVSlots(configured, max_batch, max_model_len, SIZED_BY_CONFIG)
    free_bytes, total_bytes = mem_get_info(device)
    per_token = kv_bytes_per_token(model_config, dtype)
    context = getattr(_text_config(model_config), "max_position_embeddings", None)
    if max_model_len is not None:
        length = _capped(max_model_len, context)
    else:
        tokens = max(kv_budget_bytes(total_bytes, free_bytes, gpu_memory_utilization=gpu_memory_utilization,
                                     weights_bytes=weights_bytes), 0) // per_token
        length = tokens // max_batch if context is None else min(context, tokens // max_batch)
        if length < 1:
            raise ValueError(f"the KV cache gets room for {tokens} positions on this device, not one per request "
                             f"of max_batch {max_batch}: lower max_batch, set max_model_len or raise "
                             "gpu_memory_utilization")
    budget = kv_budget(total_bytes, free_bytes, gpu_memory_utilization=gpu_memory_utilization,
                       weights_bytes=weights_bytes, bytes_per_token=per_token, max_model_len=length)
    slots = min(configured, budget.slots)
    return KVSlots(slots, min(max_batch, slots), length, SIZED_BY_DEVICE)


def draft_reservation(slots: int, max_model_len: int | None, *, device: torch.device, model_config,
                      dtype: torch.dtype, mem_get_info: Callable[[torch.device], tuple[int, int]] = free_device_memory
                      ) -> int | None:
    """The positions a draft LM's ``slots`` reserve each on CUDA: ``max_model_len`` (None: the
    model's context), or fewer, as many as ``DRAFT_KV_FRACTION`` of the device and its free memory
    hold for every slot; None where that is under ``MIN_DRAFT_RESERVATION``, and off CUDA (the
    cache grows on demand)."""
    if torch.device(device).type != "cuda":
        return None
    context = getattr(_text_config(model_config), "max_position_embeddings", None)
    length = context if max_model_len is None else _capped(max_model_len, context)
    if length is None:
        return None
    free_bytes, total_bytes = mem_get_info(device)
    fits = int(min(DRAFT_KV_FRACTION * total_bytes, free_bytes) // (slots * kv_bytes_per_token(model_config, dtype)))
    positions = min(length, fits)
    return positions if positions >= min(length, MIN_DRAFT_RESERVATION) else None
