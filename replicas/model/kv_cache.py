"""A preallocated KV cache: appends write in place, rollback only moves a length.

transformers' DynamicLayer grows by ``torch.cat`` every step, O(context) per step, where an
in-place copy costs the same at every length. Speculation also rolls back after every rejection,
which here is O(1). Logits are identical to DynamicCache (tests/replicas/model/test_kv_session.py).
"""

from __future__ import annotations

import torch
from transformers import DynamicCache
from transformers.cache_utils import DynamicLayer


class PreallocatedLayer(DynamicLayer):
    """DynamicLayer's interface (``keys``/``values`` are [B, H, length, D] views) over buffers
    that double when full."""

    def __init__(self, capacity: int = 1024):
        super().__init__()
        self.capacity = capacity
        self.length = 0
        self._keys: torch.Tensor | None = None
        self._values: torch.Tensor | None = None

    def lazy_initialization(self, key_states: torch.Tensor, value_states: torch.Tensor, *args, **kwargs) -> None:
        self.dtype, self.device = key_states.dtype, key_states.device
        batch, heads, _, _ = key_states.shape
        self._keys = key_states.new_empty(batch, heads, self.capacity, key_states.shape[-1])
        self._values = value_states.new_empty(batch, heads, self.capacity, value_states.shape[-1])
        self.is_initialized = True

    def _views(self) -> None:
        self.keys = self._keys[:, :, : self.length]
        self.values = self._values[:, :, : self.length]

    def _grow(self, needed: int) -> None:
        capacity = max(needed, 2 * self.capacity)
        keys = self._keys.new_empty(*self._keys.shape[:2], capacity, self._keys.shape[-1])
        values = self._values.new_empty(*self._values.shape[:2], capacity, self._values.shape[-1])
        keys[:, :, : self.length].copy_(self._keys[:, :, : self.length])
        values[:, :, : self.length].copy_(self._values[:, :, : self.length])
        self._keys, self._values, self.capacity = keys, values, capacity

    def update(self, key_states: torch.Tensor, value_states: torch.Tensor, *args, **kwargs):
        if not self.is_initialized:
            self.lazy_initialization(key_states, value_states)
        start, end = self.length, self.length + key_states.shape[-2]
        if end > self.capacity:
            self._grow(end)
        self._keys[:, :, start:end].copy_(key_states)
        self._values[:, :, start:end].copy_(value_states)
        self.length = end
        self._views()
        return self.keys, self.values

    def get_seq_length(self) -> int:
        return self.length

    def crop_to(self, length: int) -> None:
        if self.is_initialized and length < self.length:
            self.length = length
            self._views()

    def keep(self, index: torch.Tensor) -> None:
        """Compact to the cached positions ``index`` (ascending)."""
        n = index.numel()
        self._keys[:, :, :n].copy_(self._keys.index_select(2, index))
        self._values[:, :, :n].copy_(self._values.index_select(2, index))
        self.length = n
        self._views()

    def reset(self) -> None:
        self.length = 0
        if self.is_initialized:
            self._views()


def preallocated_cache(config, capacity: int = 1024) -> DynamicCache:
    """A DynamicCache whose full-attention layers are preallocated. Models with other layer
    kinds (sliding window, linear attention) keep transformers' own layers for those."""
    cache = DynamicCache(config=config)
    cache.layers = [
        PreallocatedLayer(capacity) if type(layer) is DynamicLayer else layer for layer in cache.layers
    ]
    return cache
