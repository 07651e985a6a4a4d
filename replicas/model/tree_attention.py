"""Attention mask and position ids for feeding a token tree to a causal LM in one forward pass.

Nodes are laid out after ``past_len`` cached tokens, in index order, parents before children.
A node may attend to every cached token, to its ancestors and to itself; it sits at position
``past_len + depth - 1`` so that each node sees exactly the positions its path would have had if
decoded sequentially. transformers takes a 4D float mask, 0 where attention is allowed and the
dtype's minimum elsewhere (checked against sequential decoding in tests/replicas/model/test_kv_session.py).
"""

from __future__ import annotations

import numpy as np
import torch
import torch.nn.functional as F


def node_depths(parents: list[int]) -> list[int]:
    """Depth of each node; a node whose parent is -1 (hangs off the cache) has depth 1."""
    depths: list[int] = []
    for i, p in enumerate(parents):
        if p >= i:
            raise ValueError(f"node {i} has parent {p}: parents must come before children")
        depths.append(1 if p < 0 else depths[p] + 1)
    return depths


def ancestor_matrix(parents: list[int]) -> torch.Tensor:
    """[n, n] bool: ``[i, j]`` is True when node ``j`` is ``i`` itself or one of its ancestors."""
    # Each row as a Python int's bits (its parent's row and its own bit), unpacked at once: a
    # verify step builds this on the host, where a tensor operation per node costs a dispatch each.
    n = len(parents)
    rows: list[int] = []
    for i, p in enumerate(parents):
        if p >= i:
            raise ValueError(f"node {i} has parent {p}: parents must come before children")
        rows.append((rows[p] if p >= 0 else 0) | 1 << i)
    width = (n + 7) // 8
    packed = np.frombuffer(b"".join(row.to_bytes(width, "little") for row in rows), dtype=np.uint8)
    bits = np.unpackbits(packed.reshape(n, width), axis=1, count=n, bitorder="little")
    return torch.from_numpy(bits.astype(bool))


def tree_attention_mask(
    parents: list[int],
    past_len: int,
    first_fed: int,
    dtype: torch.dtype,
    device: torch.device | str = "cpu",
) -> torch.Tensor:
    """Mask for feeding nodes ``first_fed..`` of the tree when nodes ``..first_fed-1`` are cached.

    Returns [1, 1, len(parents) - first_fed, past_len + len(parents)].
    """
    n = len(parents)
    allowed = torch.cat([torch.ones(n, past_len, dtype=torch.bool), ancestor_matrix(parents)], dim=1)[first_fed:]
    mask = torch.zeros(allowed.shape, dtype=dtype)
    mask.masked_fill_(~allowed, torch.finfo(dtype).min)
    return mask[None, None].to(device)


def tree_position_ids(
    parents: list[int], past_len: int, first_fed: int, device: torch.device | str = "cpu"
) -> torch.Tensor:
    """[1, len(parents) - first_fed]: ``past_len + depth - 1`` for each fed node."""
    depths = node_depths(parents)[first_fed:]
    return torch.tensor([[past_len + d - 1 for d in depths]], dtype=torch.long, device=device)


def attend_after_cache(q: torch.Tensor, keys: torch.Tensor, values: torch.Tensor,
                       allowed: torch.Tensor | None = None) -> torch.Tensor:
    """Queries ``q`` [1, heads, T, d] of T new positions over ``keys``, ``values`` [1, kv heads,
    S, d] (the cache, then the new positions'; grouped, nothing repeated). ``allowed`` [T, S]:
    which keys each query sees (a tree's node: the cache, its ancestors, itself); None: query i,
    at cache index S - T + i, sees every key up to its own. A first feed (T == S) is plain causal,
    which the fused kernels take with grouped keys (as a mask it would take their unfused fallback
    on CUDA, scores of heads x T x T), and one query sees every key: neither needs a mask."""
    t, s = q.shape[2], keys.shape[2]
    causal = allowed is None and t == s
    if allowed is None and t > 1 and not causal:
        allowed = torch.ones(t, s, dtype=torch.bool, device=q.device).tril(diagonal=s - t)
    return F.scaled_dot_product_attention(q, keys, values, attn_mask=allowed, is_causal=causal, enable_gqa=True)

