"""A causal LM with the KV cache of one token sequence.

The session remembers which tokens its cache holds. Callers hand it the *whole* token sequence
they want conditioned on; it keeps the longest common prefix it already has and feeds only the
rest. So a replica that lost a session's cache (or never had it) rebuilds it from the tokens:
correctness never depends on which replica serves a call, affinity only saves recompute
(docs/design.md §7). Rolling back after a rejection is the same operation: the next call simply
shares a shorter prefix.
"""

from __future__ import annotations

from collections.abc import Iterator
from contextlib import contextmanager

import torch
from transformers import PreTrainedModel

from specserve.replicas.model.kv_cache import PreallocatedLayer, preallocated_cache
from specserve.replicas.model.tree_attention import tree_attention_mask, tree_position_ids


TREE_NODE = -1  # placeholder in KVSession.tokens for a cached tree node


def common_prefix_len(a: list[int], b: list[int]) -> int:
    n = min(len(a), len(b))
    i = 0
    while i < n and a[i] == b[i]:
        i += 1
    return i


class KVSession:
    def __init__(self, model: PreTrainedModel):
        self.model = model
        self.cache = preallocated_cache(model.config)
        self.tokens: list[int] = []   # tokens whose keys/values are in the cache, in order

    @property
    def device(self) -> torch.device:
        return self.model.device

    def reset(self) -> None:
        self.cache = preallocated_cache(self.model.config)
        self.tokens = []

    def crop(self, length: int) -> None:
        """Keep the first ``length`` cached positions."""
        if length == 0:
            self.reset()
        elif length < len(self.tokens):
            for layer in self.cache.layers:
                if isinstance(layer, PreallocatedLayer):
                    layer.crop_to(length)
                else:   # transformers' own layer kinds take the number of tokens to remove
                    layer.crop(length - len(self.tokens))
            self.tokens = self.tokens[:length]

    @contextmanager
    def _rolled_back_on_error(self) -> Iterator[None]:
        """Undo whatever a forward that raised wrote to the cache, then re-raise.

        Layers append their keys as the forward reaches them, so a failure in a late layer (say,
        out of memory) leaves the early layers longer than ``self.tokens``. The next call would
        attend to those orphaned keys and return wrong logits without any error.
        """
        try:
            yield
        except BaseException:
            self._truncate_to_tokens()
            raise

    def _truncate_to_tokens(self) -> None:
        if all(isinstance(layer, PreallocatedLayer) for layer in self.cache.layers):
            for layer in self.cache.layers:   # a layer the forward never reached is already there
                layer.crop_to(len(self.tokens))
        else:
            # Sliding-window and linear-attention layers cannot drop an unknown number of
            # positions (some reached the failure, some did not); rebuilding from the tokens is
            # always correct, as for any replica that lacks the cache.
            self.reset()

    @torch.inference_mode()   # the buffers are inference tensors: in-place writes need the mode
    def keep(self, positions: list[int], tokens: list[int]) -> None:
        """Compact the cache to ``positions`` (ascending), which now hold ``tokens``.

        Used after tree verification: the accepted path is scattered among rejected siblings.
        """
        # Check every layer before touching any: a half-compacted cache matches no token list.
        for layer in self.cache.layers:
            if not isinstance(layer, PreallocatedLayer):
                raise NotImplementedError(f"tree compaction needs full-attention layers, not {type(layer).__name__}")
        index = torch.tensor(positions, dtype=torch.long, device=self.device)
        try:
            for layer in self.cache.layers:
                layer.keep(index)
        except BaseException:
            self.reset()   # some layers compacted, some not: only a rebuild from tokens is right
            raise
        self.tokens = list(tokens)

    def sync(self, tokens: list[int]) -> list[int]:
        """Roll the cache back to its common prefix with ``tokens``; returns the uncached rest."""
        keep = common_prefix_len(self.tokens, tokens)
        self.crop(keep)
        return tokens[keep:]

    @torch.inference_mode()
    def extend(self, tokens: list[int], logits_rows: int) -> torch.Tensor:
        """Feed ``tokens`` causally after the cache; returns logits of the last ``logits_rows``.

        returns: [logits_rows, V]
        """
        if not tokens:
            raise ValueError("extend needs at least one token")
        ids = torch.tensor([tokens], dtype=torch.long, device=self.device)
        with self._rolled_back_on_error():
            out = self.model(
                input_ids=ids, past_key_values=self.cache, use_cache=True, logits_to_keep=logits_rows
            )
        self.tokens.extend(tokens)
        return out.logits[0]

    @torch.inference_mode()
    def extend_tree(self, tokens: list[int], parents: list[int], first_fed: int = 0) -> torch.Tensor:
        """Feed nodes ``first_fed..`` of a token tree whose root hangs off the cached prefix.

        ``tokens``/``parents`` describe the whole tree (parent -1 = the last cached token);
        nodes before ``first_fed`` must already be in the cache, fed by an earlier call.
        returns: [len(tokens) - first_fed, V], one row per fed node.
        """
        past_len = len(self.tokens) - first_fed
        dtype = self.model.dtype
        with self._rolled_back_on_error():
            out = self.model(
                input_ids=torch.tensor([tokens[first_fed:]], dtype=torch.long, device=self.device),
                attention_mask=tree_attention_mask(parents, past_len, first_fed, dtype, self.device),
                position_ids=tree_position_ids(parents, past_len, first_fed, self.device),
                past_key_values=self.cache,
                use_cache=True,
            )
        # Tree nodes are not a sequence: mark them unmatchable so that a later sync() can never
        # mistake a sibling's keys for those of the real token at that position. keep() or
        # crop() restores a true sequence.
        self.tokens.extend([TREE_NODE] * (len(tokens) - first_fed))
        return out.logits[0]
