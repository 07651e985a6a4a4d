"""A hidden-state-reuse head's chain step, and a draft tree's level, as CUDA graphs.

Why: on a GPU one drafted token of the head (EAGLE-3's, Sparrow's) is one decoder layer and an
output layer, yet the module path launches ~40 small kernels for it, each paying Python and
driver time while the device idles; the whole step replays as one graph instead (the target's
steps do the same, ``model/cuda_graphs.py``).

A graph runs fixed shapes at fixed addresses, so a chain's keys live in static buffers of a
**bucket** of L positions (powers of two): a proposal copies the session's exact cache into the
bucket's buffers once, then each drafted token writes its key and value at the next index and
attends over the first L keys, masked past its own. The token, its input state, its rotary
position and its write index are copied into the graph's inputs before each replay. The maths
is the module path's (``HSRHead.step``); the masked keys add exact zeros to the softmax. q/k/v,
and gate/up, run as one product each: the layer's projections become views of one stacked weight
(``_stacked``), so nothing is copied and the module path reads the same values.

Before drafting, each step feeds the head the positions verification accepted, with the
target's states (up to the root): that **feed** of up to ``MAX_FEED`` rows replays a graph too,
in the bucket the proposal then drafts in, so the exact cache is copied in once and the new
positions' keys are written where the chain or tree reads them. Its rows are padded up to a
power of two like a tree level's; padding rows write after the real ones, where the drafted
tokens' keys overwrite them. A longer feed (a request's first, over its prompt) runs the module
path.

A tree (EAGLE-2's, ``tree_growth``) feeds a level of nodes at once: the level's rows are padded
up to a power-of-two **width** and replay that width's graph over the same bucket. Each row
carries its token, rotary position, key index and the row of its parent's output state in the
bucket's ``tree_hidden`` (row 0 the root's), where its own output goes too; the level's mask
(which keys each row sees: the exact cache, its ancestors, itself) is written before each
replay. A padding row writes its key after the level's real ones and sees the cache and itself
only, so no real row reads it; the next level's keys overwrite it. A SAGE tree's levels are
chosen on the host and copied in (``TreeLevels.step``).

An EAGLE-2 tree grows on the device (``device_growth``): every level's size follows from the
tree's shape, so the whole tree — the root's logits, each level's choice, the next level's
inputs and mask written from it, the level's step — is **one graph per bucket and shape**
(``TreeLevels.grow``), its exact cache length and root position read from the bucket's
``tree_at``; the host fills those, replays once and reads the tree once (launched from Python
kernel by kernel, a level's choice, inputs and mask keep the device waiting on the host).
Shapes change online (the tree policies), so a shape's graph is captured on its first tree in a
bucket (the served default's at start, ``capture_buckets``), up to ``MAX_TREE_GRAPHS`` per head;
past them a tree replays its levels' graphs one by one, its growth launched between them.

The buckets are the head's, shared by its sessions: one proposal runs at a time per head (a
draft server proposes in turn). Off CUDA the same buffers run eagerly (``capture=False``), which
the CPU tests check against the module path; drafting on the CPU keeps ``hsr_forward``'s packed
step.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch
import torch.nn.functional as F

from specserve.replicas.drafts.device_growth import DeviceGrowth, level_sizes
from specserve.replicas.drafts.hsr_head import apply_rope
from specserve.replicas.model import cuda_graphs, llama_forward
from specserve.replicas.model.transfer import copy_in
from specserve.replicas.step import Proposal, TreeShape

SMALLEST_BUCKET = 64
# Up to 32k positions: each bucket size reached keeps its buffers (a few MB to a few hundred for
# large heads), allocated after the KV slots were sized, so the largest is bounded; longer
# contexts draft through the module path.
MAX_BUCKETS = 10
_ATTRIBUTE = "_specserve_head_graphs"   # where a head keeps its graphs
# A tree of more nodes drafts through the module path; a level's rows pad up to a power of two.
MAX_TREE_NODES = 256
# A feed up to the root of more positions runs the module path (a step accepts at most a window).
MAX_FEED = 16
# Whole-tree graphs a head holds (each bucket and shape its own): the EAGLE-2 depth policy's eight
# depths at one top-k and budget, over the eight buckets of an 8k context.
MAX_TREE_GRAPHS = 64


def bucket_for(positions: int) -> int | None:
    """The smallest power-of-two bucket of at least ``positions`` keys, or None past the largest."""
    size = SMALLEST_BUCKET
    for _ in range(MAX_BUCKETS):
        if size >= positions:
            return size
        size *= 2
    return None


class _Bucket:
    """Static inputs, key/value buffers and outputs of one bucket's step, and its graph."""

    def __init__(self, head, size: int):
        config, device, dtype = head.config, head.device, head.dtype
        attn = head.layer.self_attn
        self.size = size
        self.token = torch.zeros(1, 1, dtype=torch.long, device=device)
        self.hidden = torch.zeros(1, 1, config.hidden_size, dtype=dtype, device=device)
        self.position = torch.zeros(1, dtype=torch.long, device=device)
        self.at = torch.zeros(1, dtype=torch.long, device=device)          # the write index
        self.keys = torch.zeros(1, attn.kv_heads, size, attn.head_dim, dtype=dtype, device=device)
        self.values = torch.zeros_like(self.keys)
        self.indices = torch.arange(size, device=device)
        self.graph: torch.cuda.CUDAGraph | None = None
        self.out: tuple[torch.Tensor, torch.Tensor] | None = None        # hidden [1, 1, H], logits [K]
        # Trees: output states (row 0 the root, 1 + i node i, then padding rows' scratch) and
        # each width's level step, made on a tree's first use of the bucket.
        self.tree_hidden: torch.Tensor | None = None
        self.levels: dict[int, _Level] = {}
        self.feeds: dict[int, _Feed] = {}   # the feed up to the root, per padded width
        # An EAGLE-2 tree's exact cache length and root position, and its whole-tree graphs per shape.
        self.tree_at = torch.zeros(2, dtype=torch.long, device=device)
        self.trees: dict[TreeShape, _Tree] = {}

    def tree_states(self, head) -> torch.Tensor:
        """``tree_hidden``, made on first use."""
        if self.tree_hidden is None:
            self.tree_hidden = torch.zeros(1 + 2 * MAX_TREE_NODES, head.config.hidden_size, dtype=self.keys.dtype,
                                           device=self.keys.device)
        return self.tree_hidden

    def level(self, width: int) -> "_Level":
        if width not in self.levels:
            self.levels[width] = _Level(self, width)
        return self.levels[width]

    def feed(self, head, width: int) -> "_Feed":
        if width not in self.feeds:
            self.feeds[width] = _Feed(head, self, width)
        return self.feeds[width]


class _Feed:
    """Static inputs and outputs of a feed of ``width`` rows up to the root, and its graph."""

    TOKEN, POSITION, KEY = range(3)   # the rows of ``ints``

    def __init__(self, head, bucket: _Bucket, width: int):
        device = bucket.keys.device
        self.width = width
        self.ints = torch.zeros(3, width, dtype=torch.long, device=device)
        self.states = torch.zeros(1, width, head.config.hidden_size, dtype=bucket.keys.dtype, device=device)
        self.graph: torch.cuda.CUDAGraph | None = None
        self.out: torch.Tensor | None = None   # output states [1, width, H]


@dataclass
class Fed:
    """A feed run in a bucket: the fed positions' output states, keys and values (the caller's
    to keep), and the bucket, whose first ``cached`` keys are now the session's exact cache."""

    out: torch.Tensor      # [1, T, H]
    keys: torch.Tensor     # [1, kv heads, T, d]
    values: torch.Tensor
    bucket: _Bucket
    cached: int


class _Level:
    """Static inputs and outputs of a tree level's step of ``width`` rows over a bucket, and its graph."""

    TOKEN, POSITION, KEY, PARENT, OUT = range(5)   # the rows of ``ints``

    def __init__(self, bucket: _Bucket, width: int):
        device = bucket.keys.device
        self.width = width
        self.ints = torch.zeros(5, width, dtype=torch.long, device=device)
        self.allowed = torch.zeros(width, bucket.size, dtype=torch.bool, device=device)   # [rows, keys]
        self.proposal = -1   # the proposal whose exact-cache columns ``allowed`` holds
        self.graph: torch.cuda.CUDAGraph | None = None
        self.out: torch.Tensor | None = None   # logits [width, V]


class _Tree:
    """A whole EAGLE-2 tree of one shape over a bucket: the growth's tensors, and its graph."""

    CACHED, POSITION = range(2)   # the entries of the bucket's ``tree_at``

    def __init__(self, shape: TreeShape, device: torch.device):
        self.growth = growth = DeviceGrowth(shape, device)
        # Each fed level's key offsets and output rows (``_places``): constants of the shape.
        self.places = [_places(first, rows, width_for(rows), device)
                       for first, rows in zip(growth.firsts[:-1], growth.sizes[:-1])]
        self.graph: torch.cuda.CUDAGraph | None = None
        self.out: torch.Tensor | None = None   # the tree, packed (``DeviceGrowth.packed``)


class HeadGraphs:
    """The feeds up to the root, chain steps and tree levels of one head (``hsr_head.HSRHead``),
    a bucket per cache length."""

    def __init__(self, head, capture: bool = True):
        self.head = head
        self.capture = capture
        self._buckets: dict[int, _Bucket] = {}
        self._pool = None
        self.steps = 0   # chain steps run (replayed, or eagerly off CUDA)
        self.levels = 0  # tree levels run
        self.proposals = 0   # trees begun
        self.feeds = 0   # feeds up to the root run in a bucket
        self.trees = 0   # EAGLE-2 trees run whole (one replay each on CUDA)
        # False: EAGLE-2 trees replay level by level (what the whole-tree graph saves, measured).
        self.whole_trees = True
        self._captured = None
        self._rotary_tables: dict[torch.dtype, tuple[torch.Tensor, torch.Tensor]] = {}
        attn, mlp = head.layer.self_attn, head.layer.mlp
        with torch.no_grad():
            self._qkv = _stacked(attn.q_proj, attn.k_proj, attn.v_proj)
            self._gate_up = _stacked(mlp["gate_proj"], mlp["up_proj"])

    @staticmethod
    def for_head(head) -> "HeadGraphs | None":
        """The head's graphs, built once, where steps on its device run as graphs (CUDA), or
        those ``attach`` gave it."""
        graphs = head.__dict__.get(_ATTRIBUTE)
        if graphs is None and cuda_graphs.available(head.device):
            graphs = HeadGraphs.attach(head)
        return graphs

    @staticmethod
    def attach(head, capture: bool = True) -> "HeadGraphs":
        """New graphs for ``head``, which its drafts made from now on use; ``capture=False`` runs
        the buckets eagerly, on any device (the bucketed layout, checkable on the CPU)."""
        graphs = head.__dict__[_ATTRIBUTE] = HeadGraphs(head, capture)
        return graphs

    @staticmethod
    def detach(head) -> None:
        head.__dict__.pop(_ATTRIBUTE, None)

    def feed(self, keys: torch.Tensor | None, values: torch.Tensor | None, tokens: list[int], states: torch.Tensor,
             positions: list[int], room: int) -> Fed | None:
        """Feed ``tokens`` (their target states ``states`` [T, H], rotary ``positions``) after the
        session's exact cache ``keys``, ``values`` [1, kv heads, n, d] (or None), in a bucket with
        ``room`` positions to spare after them (the proposal's); None when no bucket takes it."""
        n, rows = 0 if keys is None else keys.shape[2], len(tokens)
        width = width_for(rows)
        size = bucket_for(n + max(width, rows + room))
        if rows > MAX_FEED or size is None:
            return None
        bucket = self._bucket(size)
        if n:
            bucket.keys[:, :, :n].copy_(keys)
            bucket.values[:, :, :n].copy_(values)
        feed = bucket.feed(self.head, width)
        ints = torch.zeros(3, width, dtype=torch.long)
        ints[_Feed.TOKEN, :rows] = torch.tensor(tokens)
        ints[_Feed.POSITION, :rows] = torch.tensor(positions)
        ints[_Feed.KEY] = torch.arange(n, n + width)
        copy_in(feed.ints, ints)
        feed.states[0, :rows].copy_(states)
        self.feeds += 1
        out = self._replay(feed, lambda: self._feed_step(bucket, feed))
        return Fed(out[:, :rows], bucket.keys[:, :, n:n + rows].clone(), bucket.values[:, :, n:n + rows].clone(),
                   bucket, n + rows)

    def chain(self, keys: torch.Tensor, values: torch.Tensor, steps: int, fed: Fed | None = None) -> "ChainSteps | None":
        """``steps`` drafted tokens after the session's exact cache ``keys``, ``values`` [1, kv
        heads, n, d] (copied into the bucket's buffers, unless ``fed`` left them in a bucket with
        room for the chain); None when no bucket holds them."""
        n = keys.shape[2]
        if fed is not None and fed.cached == n and n + steps <= fed.bucket.size:
            return ChainSteps(self, fed.bucket, n)
        size = bucket_for(n + steps)
        if size is None:
            return None
        bucket = self._bucket(size)
        bucket.keys[:, :, :n].copy_(keys)
        bucket.values[:, :, :n].copy_(values)
        return ChainSteps(self, bucket, n)

    def tree(self, keys: torch.Tensor, values: torch.Tensor, nodes: int, root: torch.Tensor,
             fed: Fed | None = None) -> "TreeLevels | None":
        """A tree of at most ``nodes`` nodes after the session's exact cache ``keys``, ``values``
        [1, kv heads, n, d] (copied into the bucket's buffers, unless ``fed`` left them in a
        bucket with room for the tree), grown from the root's output state ``root`` [H]; None
        when it is too large for the buckets."""
        n = keys.shape[2]
        if nodes > MAX_TREE_NODES:
            return None
        if fed is not None and fed.cached == n and n + 2 * nodes <= fed.bucket.size:
            bucket = fed.bucket
        else:
            size = bucket_for(n + 2 * nodes)   # a level's padding keys sit after its real ones
            if size is None:
                return None
            bucket = self._bucket(size)
            bucket.keys[:, :, :n].copy_(keys)
            bucket.values[:, :, :n].copy_(values)
        bucket.tree_states(self.head)[0].copy_(root)
        self.proposals += 1
        return TreeLevels(self, bucket, n, self.proposals)

    @torch.inference_mode()
    def capture_buckets(self, positions: int | None = None, trees: tuple[TreeShape, ...] = ()) -> int:
        """Every graph of every bucket up to ``positions`` keys (None: all ``MAX_BUCKETS``): the
        chain step, each feed width and each tree-level width a bucket can hold, and the whole
        tree of each EAGLE-2 shape in ``trees``, before any proposal, so that no request waits on
        a capture. Returns the graphs held; off CUDA (``capture=False``) each step runs once
        eagerly instead, building the same buffers.

        Placeholder rows write keys ``0..width-1`` and each sees its own key only, since a row
        that sees no key has no softmax (some attention kernels leave NaNs, which a later
        proposal's masked keys would still multiply). What they write is stale like an earlier
        proposal's keys, and the next tree sets its level's whole mask."""
        sizes = [SMALLEST_BUCKET << i for i in range(MAX_BUCKETS)]
        if positions is not None:
            sizes = [size for size in sizes if size <= (bucket_for(positions) or sizes[-1])]
        feed_widths = sorted({width_for(rows) for rows in range(1, MAX_FEED + 1)})
        level_widths = sorted({width_for(rows) for rows in range(1, MAX_TREE_NODES + 1)})
        for size in sizes:
            b = self._bucket(size)
            for placeholder in (b.token, b.hidden, b.position, b.at):
                placeholder.zero_()
            self._replay(b, lambda: self._step(b), replay=False)
            for width in feed_widths:
                feed = b.feed(self.head, width)
                feed.ints.zero_()
                feed.ints[_Feed.KEY] = torch.arange(width)
                self._replay(feed, lambda: self._feed_step(b, feed), replay=False)
            b.tree_states(self.head)
            for width in (w for w in level_widths if w < size):   # a level follows at least one cached key
                level = b.level(width)
                level.ints.zero_()
                level.ints[_Level.KEY] = torch.arange(width)
                level.allowed.zero_()
                level.allowed[:, :width].fill_diagonal_(True)
                self._replay(level, lambda: self._level_step(b, level), replay=False)
            b.tree_at.zero_()
            for shape in trees:
                if DeviceGrowth.grows(shape) and shape.budget <= MAX_TREE_NODES and 2 * shape.budget < size:
                    tree = self._tree(b, shape)
                    if tree is not None:
                        self._replay(tree, lambda: self._grow(b, tree.growth, self._level_step, tree.places),
                                     replay=False)
        return self.captured

    @property
    def captured(self) -> int:
        """Graphs held: each bucket's chain step, feeds, tree levels and whole trees captured so far."""
        return sum((b.graph is not None) + sum(f.graph is not None for f in b.feeds.values())
                   + sum(lv.graph is not None for lv in b.levels.values())
                   + sum(t.graph is not None for t in b.trees.values()) for b in self._buckets.values())

    def _tree(self, b: _Bucket, shape: TreeShape) -> _Tree | None:
        """The bucket's whole-tree holder for ``shape``, made while the head holds fewer than
        ``MAX_TREE_GRAPHS``; None past them."""
        tree = b.trees.get(shape)
        if tree is None and sum(len(other.trees) for other in self._buckets.values()) < MAX_TREE_GRAPHS:
            tree = b.trees[shape] = _Tree(shape, b.keys.device)
        return tree

    def grow(self, b: _Bucket, shape: TreeShape) -> tuple[DeviceGrowth, torch.Tensor]:
        """An EAGLE-2 tree of ``shape`` from the root in ``b`` (``tree_at``, ``tree_hidden``
        row 0): one replay of the shape's whole-tree graph, else each level's graph replayed
        with its growth launched between them. The growth and its packed tree (unread)."""
        self.levels += len(level_sizes(shape)) - 1   # every level but the last is fed
        tree = self._tree(b, shape) if self.whole_trees else None
        if tree is None:
            growth = DeviceGrowth(shape, b.keys.device)
            return growth, self._grow(b, growth, lambda bucket, level: self.run_level(bucket, level, count=False))
        self.trees += 1
        return tree.growth, self._replay(tree, lambda: self._grow(b, tree.growth, self._level_step, tree.places))

    def _grow(self, b: _Bucket, growth: DeviceGrowth, run_level, places=None) -> torch.Tensor:
        """The tree's body: the root's logits; then per level its choice (``growth``), its nodes'
        inputs and mask written from it, the level run (``run_level(b, level)``), until the last
        level; the tree packed. ``places``: each fed level's ``_places``, made beforehand. Nothing
        here waits for the device."""
        growth.restart()
        cached = b.tree_at[_Tree.CACHED]
        column = b.indices - cached   # a key's index after the exact cache
        # The column of the growth's marks each key reads: every row sees the exact cache, the
        # tree's keys by lineage (a padding row: itself), nothing past them.
        pick = torch.where(column < 0, growth.always, column.clamp(max=growth.never))
        logits = self.head.full_logits(b.tree_hidden[:1])
        while True:
            first, rows = growth.grow(logits)
            if not growth.more_levels:
                return growth.packed()
            level = b.level(width_for(rows))
            ints, width = level.ints, level.width
            ints[_Level.TOKEN, :rows] = growth.tokens[first:first + rows]
            ints[_Level.POSITION] = b.tree_at[_Tree.POSITION] + growth.level   # a node at depth d: root + d
            ints[_Level.PARENT, :rows] = growth.parents[first:first + rows] + 1
            keys, ints[_Level.OUT] = (places[growth.level - 1] if places is not None
                                      else _places(first, rows, width, b.keys.device))
            ints[_Level.KEY] = keys + cached
            torch.gather(growth.marks[first:first + width], 1, pick.expand(width, -1), out=level.allowed)
            logits = run_level(b, level)[:rows]

    def _bucket(self, size: int) -> _Bucket:
        bucket = self._buckets.get(size)
        if bucket is None:
            bucket = self._buckets[size] = _Bucket(self.head, size)
        return bucket

    def run(self, bucket: _Bucket) -> tuple[torch.Tensor, torch.Tensor]:
        self.steps += 1
        return self._replay(bucket, lambda: self._step(bucket))

    def run_level(self, bucket: _Bucket, level: _Level, count: bool = True) -> torch.Tensor:
        self.levels += count
        return self._replay(level, lambda: self._level_step(bucket, level))

    def _replay(self, holder, step, replay: bool = True):
        """``holder``'s graph replayed (captured on first use), or ``step`` run eagerly off CUDA;
        ``replay=False`` captures it only."""
        if not self.capture:
            return step()
        if holder.graph is None:
            holder.graph = self._capture(step)
            holder.out = self._captured
        if replay:
            holder.graph.replay()
        return holder.out

    def _rows_step(self, b: _Bucket, token: torch.Tensor, hidden: torch.Tensor, position: torch.Tensor,
                   at: torch.Tensor) -> torch.Tensor:
        """``HSRHead.step`` for rows ``token`` [1, W] with input states ``hidden`` [1, W, H] at
        ``position`` [W], their keys written at ``at`` [W] (ascending), each attending over the
        bucket's keys up to its own index: output states [1, W, H]."""
        allowed = b.indices[None, :] <= at[:, None]   # [W, L]: the exact cache, the rows so far, itself
        return self._layer(b, self.head.inputs(token, hidden), position, at, allowed)

    def _layer(self, b: _Bucket, z: torch.Tensor, position: torch.Tensor, at: torch.Tensor,
               allowed: torch.Tensor) -> torch.Tensor:
        """The head's decoder layer on inputs ``z`` [1, W, H] at ``position`` [W], their keys
        written at ``at`` [W], row i attending over the bucket's keys ``allowed[i]``: output
        states [1, W, H]. ``HSRHead.step``'s maths with q/k/v and gate/up as one product each, and
        the queries and keys rotated together."""
        layer, attn = self.head.layer, self.head.layer.self_attn
        w = z.shape[1]
        cos, sin = self._rotary(position, z.dtype)
        qkv = F.linear(layer.input_layernorm(z), self._qkv).view(1, w, attn.heads + 2 * attn.kv_heads, attn.head_dim)
        qk, v = qkv.transpose(1, 2).split([attn.heads + attn.kv_heads, attn.kv_heads], dim=1)
        q, k = apply_rope(qk, cos, sin).split([attn.heads, attn.kv_heads], dim=1)   # both rotated at once
        b.keys.index_copy_(2, at, k)
        b.values.index_copy_(2, at, v)
        h = z + attn.out(self._attention(q, b, allowed))
        gate, up = F.linear(layer.post_attention_layernorm(h), self._gate_up).chunk(2, dim=-1)
        return h + layer.mlp["down_proj"](F.silu(gate) * up)

    def _rotary(self, position: torch.Tensor, dtype: torch.dtype) -> tuple[torch.Tensor, torch.Tensor]:
        """``HSRHead.rope``'s cos and sin for ``position`` [W], read from a table of every position
        the head serves, built once: two gathers, where computing them is a dozen kernels. The
        table holds the same values (each entry is computed alone, by the same operations).
        Positions past the head's context cannot arrive (a served length is capped at the
        model's); the clamp keeps one from reading outside the table."""
        table = self._rotary_tables.get(dtype)
        if table is None:
            positions = torch.arange(self.head.config.max_position_embeddings, device=self.head.device)
            table = self._rotary_tables[dtype] = self.head.rope(positions, dtype)
        cos, sin = table
        position = position.clamp(max=cos.shape[0] - 1)
        return cos.index_select(0, position), sin.index_select(0, position)

    def _attention(self, q: torch.Tensor, b: _Bucket, allowed: torch.Tensor) -> torch.Tensor:
        """Rows ``q`` [1, heads, W, d] over the bucket's keys, ``allowed`` [W, L] saying which
        each row sees, as the target's forward attends (``llama_forward.sdpa_attention``: a kv
        head's query heads stacked as its rows). Grouped keys with a mask would take the fused
        kernels' slow fallback (``enable_gqa`` with a mask: unfused, the keys repeated per head)."""
        groups = q.shape[1] // b.keys.shape[1]
        return llama_forward.sdpa_attention(q, b.keys, b.values, llama_forward.sdpa_mask(allowed[None, None], groups))

    def _feed_step(self, b: _Bucket, feed: _Feed) -> torch.Tensor:
        return self._rows_step(b, feed.ints[_Feed.TOKEN][None], feed.states, feed.ints[_Feed.POSITION],
                               feed.ints[_Feed.KEY])

    def _step(self, b: _Bucket) -> tuple[torch.Tensor, torch.Tensor]:
        """A chain's drafted token over the bucket's buffers, then the head's logits."""
        out = self._rows_step(b, b.token, b.hidden, b.position, b.at)
        return out, self.head.head_logits(out)[0, -1]

    def _level_step(self, b: _Bucket, level: _Level) -> torch.Tensor:
        """``HSRHead.step`` for a tree level's rows over the bucket's buffers, then the head's
        logits over the full vocabulary [width, V]."""
        token, position, key, parent, out_row = level.ints
        z = self.head.inputs(token[None], b.tree_hidden.index_select(0, parent)[None])   # Eq. 4: the parent's output
        out = self._layer(b, z, position, key, level.allowed)
        b.tree_hidden.index_copy_(0, out_row, out[0])
        return self.head.full_logits(out)[0]

    def _capture(self, step) -> torch.cuda.CUDAGraph:
        """Warm up on a side stream (lazy initialisations stay outside the graph), then capture;
        the captured step's outputs are left in ``_captured``. The warm-ups compute the step from
        its present inputs: they write what it writes."""
        with cuda_graphs.CAPTURE_LOCK:   # one capture at a time in a process
            stream = torch.cuda.Stream(self.head.device)
            stream.wait_stream(torch.cuda.current_stream(self.head.device))
            with torch.cuda.stream(stream):
                for _ in range(2):
                    step()
            torch.cuda.current_stream(self.head.device).wait_stream(stream)
            if self._pool is None:
                self._pool = torch.cuda.graph_pool_handle()
            graph = torch.cuda.CUDAGraph()
            # Thread-local: the target may run a step on its own thread while a draft captures.
            with torch.cuda.graph(graph, pool=self._pool, capture_error_mode="thread_local"):
                self._captured = step()
        return graph


class ChainSteps:
    """One proposal's drafted tokens through a bucket: ``step`` feeds one and returns its output
    state and the head's logits (valid until the next step)."""

    def __init__(self, graphs: HeadGraphs, bucket: _Bucket, cached: int):
        self._graphs, self._bucket, self._next = graphs, bucket, cached

    def step(self, token: torch.Tensor, hidden: torch.Tensor, position: int) -> tuple[torch.Tensor, torch.Tensor]:
        """token [1] on the device (the last choice, unread), its input state ``hidden`` [1, 1, H]
        (the root's or the last step's output) and its rotary position -> (output state [1, 1, H],
        logits [K]). Nothing here waits for the device."""
        b = self._bucket
        if self._next >= b.size:
            raise IndexError(f"the chain outgrew its bucket of {b.size} positions")
        b.token.copy_(token.view(1, 1))
        b.hidden.copy_(hidden)
        b.position.fill_(position)
        b.at.fill_(self._next)
        self._next += 1
        out, logits = self._graphs.run(b)
        return out, logits


def _stacked(*linears: torch.nn.Linear) -> torch.Tensor:
    """The linears' weights stacked into one [sum of outputs, inputs], each linear's weight made a
    view of its rows: one product where there were several, with no second copy of the weights
    (their values, and the module path's results, unchanged)."""
    weight = torch.cat([linear.weight for linear in linears])
    at = 0
    for linear in linears:
        rows = linear.weight.shape[0]
        linear.weight.data = weight[at:at + rows]
        at += rows
    return weight


def width_for(rows: int) -> int:
    """A level's rows padded up to a power of two."""
    return 1 << max(0, rows - 1).bit_length()


class TreeLevels:
    """One proposal's tree through a bucket: ``step`` feeds a level's nodes and returns their
    logits over the full vocabulary (valid until the next step)."""

    def __init__(self, graphs: HeadGraphs, bucket: _Bucket, cached: int, proposal: int):
        self._graphs, self._bucket, self._cached, self._proposal = graphs, bucket, cached, proposal

    def step(self, tokens: list[int], parents: list[int], positions: list[int], first: int,
             sees: torch.Tensor) -> torch.Tensor:
        """Nodes ``first..first+F-1``: their tokens, parents (-1 the root), rotary positions and
        ``sees`` [F, first+F] (which tree nodes each row attends to: its ancestors and itself)
        -> logits [F, V]."""
        rows, n, b = len(tokens), self._cached, self._bucket
        level = self._level(rows, first)
        width = level.width
        ints = torch.zeros(5, width, dtype=torch.long)
        ints[_Level.TOKEN, :rows] = torch.tensor(tokens)
        ints[_Level.POSITION, :rows] = torch.tensor(positions)
        ints[_Level.PARENT, :rows] = torch.tensor(parents) + 1
        keys, ints[_Level.OUT] = _places(first, rows, width, ints.device)
        ints[_Level.KEY] = keys + n
        mask = torch.zeros(width, first + width, dtype=torch.bool)
        mask[:rows, :first + rows] = sees
        mask[torch.arange(rows, width), torch.arange(first + rows, first + width)] = True   # padding: itself
        copy_in(level.ints, ints)
        copy_in(level.allowed[:, n:n + first + width], mask)
        return self._graphs.run_level(b, level)[:rows]

    def grow(self, shape: TreeShape, position: int) -> Proposal:
        """An EAGLE-2 tree of ``shape`` (``DeviceGrowth.grows``) from the root at rotary
        ``position``, grown on the device (``HeadGraphs.grow``) and read to the host once."""
        growth, packed = self.grown(shape, position)
        return growth.proposal(packed)

    def grown(self, shape: TreeShape, position: int) -> tuple[DeviceGrowth, torch.Tensor]:
        """``grow``'s tree before it is read: nothing here waits for the device."""
        n, b = self._cached, self._bucket
        if shape.budget > MAX_TREE_NODES or n + 2 * shape.budget > b.size:
            raise IndexError(f"a tree of {shape.budget} nodes outgrows the bucket of {b.size} positions")
        b.tree_at[_Tree.CACHED].fill_(n)
        b.tree_at[_Tree.POSITION].fill_(position)
        return self._graphs.grow(b, shape)

    def _level(self, rows: int, first: int) -> _Level:
        """The level step of ``rows`` padded rows from node ``first``, its mask's exact-cache
        columns set for this proposal."""
        n, b = self._cached, self._bucket
        level = b.level(width_for(rows))
        if first + rows > MAX_TREE_NODES or n + first + level.width > b.size:
            raise IndexError(f"the tree outgrew its bucket of {b.size} positions")
        if level.proposal != self._proposal:   # every row sees the exact cache; later keys by the mask
            level.allowed[:, :n] = True
            level.allowed[:, n:] = False
            level.proposal = self._proposal
        return level


def _places(first: int, rows: int, width: int, device) -> tuple[torch.Tensor, torch.Tensor]:
    """Where a tree level's ``width`` padded rows from node ``first`` write: their key indices
    after the exact cache (after the earlier nodes) and their output-state rows in
    ``tree_hidden`` (a node's at 1 + its index, padding rows' past ``MAX_TREE_NODES``)."""
    out = torch.cat([torch.arange(1 + first, 1 + first + rows, device=device),
                     torch.arange(1 + MAX_TREE_NODES, 1 + MAX_TREE_NODES + width - rows, device=device)])
    return torch.arange(first, first + width, device=device), out
