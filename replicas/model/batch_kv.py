"""The KV caches of all of a replica's requests in one buffer per layer, so that one forward
serves them all.

Each request holds a **slot**: row ``s`` of every layer's buffers ``[slots, kv_heads, capacity,
head_dim]``, filled to its own length (``tokens[s]``: the tokens whose keys it holds). One
``forward`` feeds each participating slot its own tokens at its own positions. Each token sees
its slot's cached prefix and its ancestors among the new tokens (a chain: the tokens before it;
a tree: its path), nothing of other slots. Two layouts:

- **flat** (Llama-family models on the CPU when no feed has more than
  ``cpu_attention.MAX_NEW_TOKENS`` tokens: verify steps, unless a window, tree or uncached tail
  is longer): the feeds' tokens one after another, no padding (``LlamaForward.flat``). A request
  verifying 5 tokens beside fifteen decoding 1 makes a forward of 20 tokens, not 16 x 5
  (docs/benchmarks.md §2.3).
- **padded** (any other model, device or long prefill chunk): rows are left-padded to the longest
  feed, so every row's real tokens end at the last column, with a 4D mask. The batch is the slot
  range ``[lo, hi)``: a *view* of the buffers, no gather; slots in that range that take no part
  are padding rows; every padding column writes beyond its slot's length (where nothing reads: the
  length is the token list) and attends only to what it wrote, so its softmax is never empty. The
  scheduler keeps busy slots low and dense so that the range stays tight.
  On CUDA a padded step of our forward is padded further, to a bucket of slots ``[0, B)``, S
  columns and L keys, and replays that bucket's CUDA graph (``cuda_graphs``).

Rolling back is free (``crop`` shortens the token list); keeping a tree's accepted path compacts
one slot. Like ``KVSession``, a slot is correct from its token list alone: ``sync`` keeps the
longest common prefix with what a request needs and feeds the rest, so a slot that held another
request's tokens is a prefix cache, never a wrong answer.

Any Hugging Face causal LM whose cache layers are full attention (Llama, Qwen2, GPT-2, ...) works:
the model is unchanged, it only sees a ``Cache`` whose ``update`` writes at per-row positions.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch
from transformers import DynamicCache
from transformers.cache_utils import DynamicLayer

from specserve.replicas.model import cpu_attention, cuda_graphs, fused_elementwise, llama_forward
from specserve.replicas.model.image_tokens import VIRTUAL_BASE, embed
from specserve.replicas.model.kv_session import TREE_NODE, common_prefix_len
from specserve.replicas.model.transfer import sent
from specserve.replicas.model.tree_attention import ancestor_matrix, node_depths


@dataclass(frozen=True)
class Feed:
    """Tokens for one slot in a batched forward.

    ``parents`` is None for a chain; else ``tokens`` form a tree (``parents[i]`` before ``i``, -1 =
    hangs off the cached prefix). The first ``committed`` tokens are part of the sequence; the
    rest are tree nodes (recorded as ``TREE_NODE`` until the caller keeps a path). The logits of
    the last ``logits_rows`` tokens come back.
    """

    slot: int
    tokens: list[int]                  # [n]
    logits_rows: int = 1               # forward returns [logits_rows, V] for this feed
    parents: list[int] | None = None   # [n]; None: a chain
    committed: int | None = None       # None: all of them


def _structure(feed: Feed) -> tuple[list[int], torch.Tensor]:
    """Each of the feed's tokens' depth below the cached prefix (1 = right after it) and which of
    the feed's tokens it sees ([n, n] bool): a chain sees itself and the tokens before it, a tree
    node itself and its ancestors."""
    n = len(feed.tokens)
    if feed.parents is None:
        return list(range(1, n + 1)), torch.ones(n, n, dtype=torch.bool).tril()
    return node_depths(feed.parents), ancestor_matrix(feed.parents)


class _Plan:
    """Where this forward's keys go; shared by every layer of one cache."""

    lo: int = 0
    hi: int = 0
    kv_len: int = 0
    rows: torch.Tensor | None = None     # [B, S] slot index of each column
    columns: torch.Tensor | None = None  # [B, S] cache position each column writes


class SlotLayer(DynamicLayer):
    def __init__(self, plan: _Plan, slots: int, capacity: int):
        super().__init__()
        self.plan = plan
        self.slots = slots
        self.capacity = capacity
        # (keys, values), each [slots, kv_heads, capacity, head_dim]
        self.buffers: tuple[torch.Tensor, torch.Tensor] | None = None

    def update(self, key_states: torch.Tensor, value_states: torch.Tensor, *args, **kwargs):
        """key_states: [B, H, S, D] for slots lo..hi-1; returns keys/values [B, H, kv_len, D] (views)."""
        plan = self.plan
        if self.buffers is None:
            self.allocate(key_states.shape[1], key_states.shape[-1], value_states.shape[-1], key_states.dtype,
                          key_states.device)
        keys, values = self.buffers
        # On the CPU one C copy per layer (cpu_attention.write); else torch's indexed assignment
        # (advanced indices around a slice: the indexed view is [B, S, H, D]).
        if not (cpu_attention.write(keys, key_states, plan.rows, plan.columns)
                and cpu_attention.write(values, value_states, plan.rows, plan.columns)):
            keys[plan.rows, :, plan.columns] = key_states.transpose(1, 2)
            values[plan.rows, :, plan.columns] = value_states.transpose(1, 2)
        self.keys = keys[plan.lo:plan.hi, :, : plan.kv_len]
        self.values = values[plan.lo:plan.hi, :, : plan.kv_len]
        return self.keys, self.values

    def allocate(self, kv_heads: int, key_dim: int, value_dim: int, dtype: torch.dtype, device: torch.device) -> None:
        """The buffers, on first use. Zeros, not empty: masked keys still enter the product
        (weight 0 x NaN garbage = NaN)."""
        if self.buffers is None:
            self.dtype, self.device = dtype, device
            shape = (self.slots, kv_heads, self.capacity)
            self.buffers = (torch.zeros(*shape, key_dim, dtype=dtype, device=device),
                            torch.zeros(*shape, value_dim, dtype=dtype, device=device))
            self.is_initialized = True

    def grow(self, capacity: int) -> None:
        if self.buffers is not None:
            grown = []
            for buf in self.buffers:
                new = buf.new_zeros(buf.shape[0], buf.shape[1], capacity, buf.shape[-1])
                new[:, :, : self.capacity].copy_(buf)
                grown.append(new)
            self.buffers = tuple(grown)
        self.capacity = capacity

    def get_seq_length(self) -> int:
        return self.plan.kv_len


class BatchKV:
    """``slots`` KV caches of ``model`` that one forward can feed together."""

    def __init__(self, model, slots: int, capacity: int = 512, max_len: int | None = None):
        """``max_len``: positions a slot may hold (default: the model's context)."""
        if slots < 1:
            raise ValueError(f"a batch cache needs at least one slot, got {slots}")
        self.model = model
        self.slots = slots
        self.max_len = getattr(model.config, "max_position_embeddings", None) or 1 << 20
        if max_len is not None:
            self.max_len = min(self.max_len, max_len)
        self.tokens: list[list[int]] = [[] for _ in range(slots)]
        self.salts: list[str | None] = [None] * slots   # each slot's cache_salt (the scheduler's)
        self._plan = _Plan()
        self.cache = DynamicCache(config=model.config)
        for layer in self.cache.layers:
            if type(layer) is not DynamicLayer:
                raise NotImplementedError(
                    f"batched KV caches need full-attention layers; {type(model).__name__} has {type(layer).__name__}"
                )
        self.cache.layers = [SlotLayer(self._plan, slots, min(capacity, self.max_len)) for _ in self.cache.layers]
        # transformers' ``model.dtype`` and ``model.device`` walk the parameters on every read:
        # read them once.
        self._dtype, self._device = model.dtype, model.device
        # Llama-family models run our own forward (fewer, larger operations); others run theirs.
        self._fast = llama_forward.for_model(model) if llama_forward.supports(model) else None
        # On CUDA our forward's padded steps replay captured graphs (``cuda_graphs``).
        self.graphs = (cuda_graphs.StepGraphs(self._fast, self.device, slots)
                       if self._fast is not None and cuda_graphs.available(self.device) else None)
        self._fed_rows: list[tuple[int, int, int]] = []   # per feed of the last forward (``fed_rows``)
        # A VLM target's pictures (``image_tokens.ImageStore``): the embeddings of its image tokens.
        self.images = None
        # Qwen2-VL's multimodal rotary positions (``mrope.MRope``): positions from the slot's
        # tokens rather than their columns; None: a token's position is its column.
        self.mrope = None

    @property
    def device(self) -> torch.device:
        return self._device

    @property
    def capacity(self) -> int:
        return self.cache.layers[0].capacity

    # ---- bookkeeping (no tensor work) ---------------------------------------------------------

    def sync(self, slot: int, tokens: list[int]) -> list[int]:
        """Roll ``slot`` back to its common prefix with ``tokens``; returns the uncached rest."""
        keep = common_prefix_len(self.tokens[slot], tokens)
        self.crop(slot, keep)
        return tokens[keep:]

    def crop(self, slot: int, length: int) -> None:
        del self.tokens[slot][length:]

    def reset(self, slot: int | None = None) -> None:
        for s in range(self.slots) if slot is None else [slot]:
            self.tokens[s] = []

    def claim(self, slot: int, salt: str | None) -> None:
        """``slot`` now serves a request of ``salt`` (its ``cache_salt``): a cache another salt
        left there is forgotten, never read, so no tenant's prefix speeds up another's."""
        if self.salts[slot] != salt:
            self.reset(slot)
            self.salts[slot] = salt

    # ---- slot moves ---------------------------------------------------------------------------

    @torch.inference_mode()
    def keep(self, slot: int, positions: list[int], tokens: list[int]) -> None:
        """Compact ``slot`` to the cached ``positions`` (ascending), which now hold ``tokens``.
        After tree verification the accepted path sits among rejected siblings. Positions
        already in place (the context, and the path as far as it runs along the first nodes) are
        not moved: a step copies its accepted path, not the whole context."""
        start = next((i for i, p in enumerate(positions) if p != i), len(positions))
        if start < len(positions):
            index = sent(positions[start:], self.device, torch.long)
            for layer in self.cache.layers:
                for buf in layer.buffers or ():
                    buf[slot, :, start:len(positions)] = buf[slot].index_select(1, index)
        self.tokens[slot] = list(tokens)

    @torch.inference_mode()
    def swap(self, a: int, b: int) -> None:
        """Slots ``a`` and ``b`` exchange their caches. Moving a request to keep busy slots dense
        must not overwrite the slot it lands on: that slot's cache is a finished request's prefix
        cache, which the next request with that prompt would find."""
        n = max(len(self.tokens[a]), len(self.tokens[b]))
        if a != b and n:
            pair, swapped = sent([a, b], self.device, torch.long), sent([b, a], self.device, torch.long)
            for layer in self.cache.layers:
                for buf in layer.buffers or ():
                    buf[pair, :, :n] = buf[swapped, :, :n]   # the right side is gathered first: a copy
        self.tokens[a], self.tokens[b] = self.tokens[b], self.tokens[a]
        self.salts[a], self.salts[b] = self.salts[b], self.salts[a]

    @torch.inference_mode()
    def copy_prefix(self, src: int, dst: int, length: int) -> None:
        """``dst`` holds the first ``length`` cached positions of ``src`` (and its salt): requests
        that share a prompt (a request's choices, a repeated prompt) compute its prefill once."""
        length = min(length, len(self.tokens[src]))
        if src == dst:
            return
        if length:
            for layer in self.cache.layers:
                for buf in layer.buffers or ():
                    buf[dst, :, :length] = buf[src, :, :length]
        self.tokens[dst] = self.tokens[src][:length]
        self.salts[dst] = self.salts[src]

    # ---- the batched forward ------------------------------------------------------------------

    def reserve(self, positions: int | None = None) -> None:
        """Every slot's capacity at ``max_len`` (or ``positions``, if fewer) from now on (allocated
        by the next forward), so the cache does not grow under load: what a replica holds is known
        when it starts."""
        for layer in self.cache.layers:
            layer.grow(self.max_len if positions is None else min(positions, self.max_len))
        if self.graphs is not None:   # they read the buffers just replaced
            self.graphs.clear()

    @property
    def allocated_bytes(self) -> int:
        return sum(buf.numel() * buf.element_size() for layer in self.cache.layers for buf in (layer.buffers or ()))

    def _ensure_capacity(self, needed: int) -> None:
        if needed > self.max_len:
            raise ValueError(f"{needed} positions exceed the cache's limit of {self.max_len} (max_model_len or the model's context)")
        if needed > self.capacity:
            capacity = min(self.max_len, max(needed, 2 * self.capacity))
            for layer in self.cache.layers:
                layer.grow(capacity)
            if self.graphs is not None:   # they read the buffers just replaced
                self.graphs.clear()

    def use_cuda_graphs(self, enabled: bool) -> bool:
        """Switch graph replay of padded steps on or off (eager steps are the reference); returns
        whether graphs are in use (never off CUDA or for a model without our forward)."""
        if self.graphs is not None:
            self.graphs.enabled = enabled
        return self.graphs is not None and self.graphs.enabled

    def use_fused_elementwise(self, enabled: bool) -> bool:
        """Run our forward's elementwise pieces as compiled, fused kernels (``fused_elementwise``;
        the default on CUDA) or as eager torch ops; drops the graphs captured with the other.
        Returns whether the fused kernels are in use."""
        if self._fast is None:
            return False
        self._fast.elementwise = None if enabled else fused_elementwise.EAGER
        if self.graphs is not None:
            self.graphs.clear()
        return self.fused_elementwise

    @property
    def fused_elementwise(self) -> bool:
        """Whether our forward's steps here run the compiled elementwise pieces."""
        return self._fast is not None and self._fast.fuses(self.device)

    @torch.inference_mode()
    def capture_graphs(self, widths: tuple[int, ...] = (1,)) -> int:
        """Capture the graphs of every bucket of ``widths`` tokens per row (1: decoding; a window
        γ verifies γ + 1) at the cache's present capacity, before any request runs: each is one
        step of placeholder tokens over slots made as long as the bucket's keys need, forgotten
        afterwards (every slot is reset). Returns the graphs held; 0 off CUDA."""
        if self.graphs is None or not self.graphs.enabled:
            return 0
        if any(self.tokens):
            raise RuntimeError("graphs are captured before any slot holds tokens")
        buckets = {cuda_graphs.smallest_at_least(w, cuda_graphs.TOKEN_BUCKETS) for w in widths} - {None}
        for keys in cuda_graphs.key_buckets(self.capacity):
            for rows in self.graphs.batch_buckets:
                for tokens in sorted(buckets):
                    if keys < tokens or rows * tokens > cuda_graphs.MAX_BUCKET_TOKENS:
                        continue
                    if len(self.graphs) >= cuda_graphs.MAX_GRAPHS:   # the shorter keys, the more used, kept
                        return len(self.graphs)
                    for slot in range(rows):
                        self.tokens[slot] = [TREE_NODE] * (keys - tokens)
                    self.forward([Feed(slot, [0] * tokens) for slot in range(rows)])
                    self.reset()
        return len(self.graphs)

    @torch.inference_mode()
    def forward(self, feeds: list[Feed]) -> list[torch.Tensor]:
        """One forward for every feed; returns each feed's logits ``[logits_rows, V]``.

        The caller keeps what it wants afterwards (``crop``, ``keep``): the slots' token lists
        then say which of the fed keys count.
        """
        if not feeds:
            return []
        slots = [f.slot for f in feeds]
        if len(set(slots)) != len(slots):
            raise ValueError(f"one feed per slot per forward, got slots {slots}")
        for f in feeds:
            if not 1 <= f.logits_rows <= len(f.tokens):
                raise ValueError(f"slot {f.slot}: logits_rows must be in 1..{len(f.tokens)} (its tokens), got {f.logits_rows}")
        width = max(len(f.tokens) for f in feeds)
        # Known here, from the host's lists, so the forward needs no device sync to find out.
        images = self.images if self.images is not None and any(
            t >= VIRTUAL_BASE for f in feeds for t in f.tokens) else None
        if self._fast is not None and self._fast.flat_usable(width, self.device, self._dtype):
            logits = self._forward_flat(feeds, width, images)     # per feed: [f.logits_rows, V]
        else:
            logits = self._forward_padded(feeds, width, images)   # per feed: [f.logits_rows, V]
        for f in feeds:
            committed = len(f.tokens) if f.committed is None else f.committed
            self.tokens[f.slot].extend(f.tokens[:committed])
            self.tokens[f.slot].extend([TREE_NODE] * (len(f.tokens) - committed))
        return logits

    def fed_rows(self, states: torch.Tensor, index: int) -> torch.Tensor:
        """The rows of ``states`` ([B, S, ...] laid out as the last forward's tokens, e.g. a
        tapped layer's output) that feed ``index`` of that forward produced: [its tokens, ...]."""
        row, start, end = self._fed_rows[index]
        return states[row, start:end]

    def _forward_flat(self, feeds: list[Feed], width: int, images=None) -> list[torch.Tensor]:
        """The feeds' tokens one after another (``LlamaForward.flat``): no padding anywhere."""
        cached = [len(self.tokens[f.slot]) for f in feeds]
        length = max(c + len(f.tokens) for c, f in zip(cached, feeds))
        self._ensure_capacity(length)
        total = sum(len(f.tokens) for f in feeds)
        # As tensors (T = total, W = width, R = the feeds' logits_rows summed): ids, positions [T];
        # token_slots, columns [1, T]; sequences [len(feeds), 4]; keep [R].
        ids, positions, token_slots, columns, sequences, keep, rows = [], [], [], [], [], [], []
        spatial: list[tuple[int, int]] = []   # M-RoPE's (dh, dw) per token
        mask = torch.full((total, width), float("-inf"))   # [T, W]
        start = 0
        for f, c in zip(feeds, cached):
            n = len(f.tokens)
            depths, block = _structure(f)
            mask[start:start + n, :n].masked_fill_(block, 0.0)
            ids += f.tokens
            if self.mrope is None:
                positions += [c + d - 1 for d in depths]
            else:
                p, dh, dw = self.mrope.positions(self.tokens[f.slot], f.tokens, depths)
                positions += p
                spatial += zip(dh, dw)
            token_slots += [f.slot] * n
            columns += range(c, c + n)
            sequences.append((f.slot, start, n, c))
            keep += range(start + n - f.logits_rows, start + n)
            rows.append((0, start, start + n))
            start += n
        step = llama_forward.FlatStep(torch.tensor(sequences), torch.tensor([token_slots]), torch.tensor([columns]), mask, length)
        fast = self._fast
        buffers = []
        for layer in self.cache.layers:
            layer.allocate(fast.kv_heads, fast.head_dim, fast.head_dim, self._dtype, self.device)
            buffers.append(layer.buffers)
        logits = fast.flat(torch.tensor(ids), torch.tensor(positions), step, buffers, torch.tensor(keep),
                           getattr(self.model, "_specserve_feature_tap", None), images,
                           torch.tensor(spatial).view(-1, 2) if self.mrope is not None else None)   # [R, V]
        self._fed_rows = rows
        out, at = [], 0
        for f in feeds:
            out.append(logits[at:at + f.logits_rows])
            at += f.logits_rows
        return out

    def _forward_padded(self, feeds: list[Feed], width: int, images=None) -> list[torch.Tensor]:
        """Rows left-padded to the longest feed ([B, S]): any model, any device, long prefill chunks."""
        slots = [f.slot for f in feeds]
        lo, hi = min(slots), max(slots) + 1
        # Pictures and M-RoPE offsets are inputs no graph takes: those steps run eagerly.
        bucket = (self.graphs.bucket(hi, width, [len(t) for t in self.tokens], self.capacity)
                  if self.graphs is not None and images is None and self.mrope is None else None)
        if bucket is not None:   # slots 0..B-1, S columns, L keys (cuda_graphs)
            lo, hi, width = 0, bucket.rows, bucket.tokens
        lengths = [len(self.tokens[s]) for s in range(lo, hi)]
        kv_len = max(lengths) + width if bucket is None else bucket.keys
        self._ensure_capacity(kv_len)
        rows = hi - lo   # B = rows, S = width below
        ids = torch.zeros(rows, width, dtype=torch.long)                # [B, S]
        positions = torch.zeros(rows, width, dtype=torch.long)          # [B, S]
        spatial = torch.zeros(rows, width, 2, dtype=torch.long) if self.mrope is not None else None   # [B, S, 2]
        columns = torch.zeros(rows, width, dtype=torch.long)            # [B, S]
        allowed = torch.zeros(rows, width, kv_len, dtype=torch.bool)    # [B, S, kv_len]
        by_slot = {f.slot: f for f in feeds}
        for r in range(rows):
            cached = lengths[r]
            feed = by_slot.get(lo + r)
            n = len(feed.tokens) if feed is not None else 0
            pad = width - n
            # Padding columns first: they write past the row's real tokens and see only themselves.
            pad_cols = torch.arange(cached + n, cached + width)
            columns[r, :pad] = pad_cols
            positions[r, :pad] = cached
            allowed[r, torch.arange(pad), pad_cols] = True
            if n == 0:
                continue
            ids[r, pad:] = torch.tensor(feed.tokens)
            columns[r, pad:] = torch.arange(cached, cached + n)
            allowed[r, pad:, :cached] = True
            depths, block = _structure(feed)
            if spatial is None:
                positions[r, pad:] = cached + torch.tensor(depths) - 1
            else:
                p, dh, dw = self.mrope.positions(self.tokens[lo + r], feed.tokens, depths)
                positions[r, pad:] = torch.tensor(p)
                spatial[r, pad:] = torch.tensor([dh, dw]).T
            allowed[r, pad:, cached:cached + n] = block
        dtype = self._dtype
        mask = torch.zeros(rows, 1, width, kv_len, dtype=dtype)   # [B, 1, S, kv_len], additive
        mask.masked_fill_(~allowed[:, None], torch.finfo(dtype).min)
        plan = self._plan
        tap = getattr(self.model, "_specserve_feature_tap", None)
        if bucket is not None:
            slot_rows = torch.arange(lo, hi)[:, None].expand(rows, width)
            logits = self.graphs.run(bucket, ids, positions, mask, slot_rows, columns, self.cache.layers, plan, tap)
            self._fed_rows = [(f.slot - lo, width - len(f.tokens), width) for f in feeds]
            # The graph's logits are its buffer, rewritten by its next replay.
            return [logits[f.slot - lo, width - f.logits_rows:].clone() for f in feeds]
        plan.lo, plan.hi, plan.kv_len = lo, hi, kv_len
        plan.rows = torch.arange(lo, hi, device=self.device)[:, None].expand(rows, width).contiguous()
        plan.columns = sent(columns, self.device)
        keep = max(f.logits_rows for f in feeds)
        # logits: [B, keep, V] either way
        if self._fast is not None:
            logits = self._fast(sent(ids, self.device), sent(positions, self.device), sent(mask, self.device),
                                self.cache.layers, keep, tap, images,
                                None if spatial is None else sent(spatial, self.device))
        else:
            tokens = ({"input_ids": ids.to(self.device)} if images is None else
                      {"inputs_embeds": embed(ids.to(self.device), self.model.get_input_embeddings().weight, images)})
            if spatial is not None:   # M-RoPE's (t, h, w) rows, as Qwen2-VL's text model takes them
                positions = torch.stack([positions, positions + spatial[..., 0], positions + spatial[..., 1]])
            logits = self.model(
                **tokens,
                attention_mask=mask.to(self.device),
                position_ids=positions.to(self.device),
                past_key_values=self.cache,
                use_cache=True,
                logits_to_keep=keep,
            ).logits   # [B, keep, V]
        self._fed_rows = [(f.slot - lo, width - len(f.tokens), width) for f in feeds]
        return [logits[f.slot - lo, keep - f.logits_rows:] for f in feeds]
