"""A hidden-state-reuse head's chain step as a CUDA graph.

Why: on a GPU one drafted token of the head (EAGLE-3's, Sparrow's) is one decoder layer and an
output layer, yet the module path launches ~40 small kernels for it, each paying Python and
driver time while the device idles; the whole step replays as one graph instead (the target's
steps do the same, ``model/cuda_graphs.py``).

A graph runs fixed shapes at fixed addresses, so a chain's keys live in static buffers of a
**bucket** of L positions (powers of two): a proposal copies the session's exact cache into the
bucket's buffers once, then each drafted token writes its key and value at the next index and
attends over the first L keys, masked past its own. The token, its input state, its rotary
position and its write index are copied into the graph's inputs before each replay. The maths
is the module path's (``HSRHead.step``); the masked keys add exact zeros to the softmax.

The buckets are the head's, shared by its sessions: one proposal runs at a time per head (a
draft server proposes in turn). Off CUDA the same buffers run eagerly (``capture=False``), which
the CPU tests check against the module path; drafting on the CPU keeps ``hsr_forward``'s packed
step.
"""

from __future__ import annotations

import torch
import torch.nn.functional as F

from specserve.replicas.model import cuda_graphs

SMALLEST_BUCKET = 64
# Up to 32k positions: each bucket size reached keeps its buffers (a few MB to a few hundred for
# large heads), allocated after the KV slots were sized, so the largest is bounded; longer
# contexts draft through the module path.
MAX_BUCKETS = 10


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


class HeadGraphs:
    """The chain steps of one head (``hsr_head.HSRHead``), a bucket per cache length."""

    def __init__(self, head, capture: bool = True):
        self.head = head
        self.capture = capture
        self._buckets: dict[int, _Bucket] = {}
        self._pool = None
        self.steps = 0   # chain steps run (replayed, or eagerly off CUDA)

    @staticmethod
    def for_head(head) -> "HeadGraphs | None":
        """The head's graphs, built once, where steps on its device run as graphs (CUDA)."""
        if not cuda_graphs.available(head.device):
            return None
        graphs = head.__dict__.get("_specserve_head_graphs")
        if graphs is None:
            graphs = head.__dict__["_specserve_head_graphs"] = HeadGraphs(head)
        return graphs

    def chain(self, keys: torch.Tensor, values: torch.Tensor, steps: int) -> "ChainSteps | None":
        """``steps`` drafted tokens after the session's exact cache ``keys``, ``values`` [1, kv
        heads, n, d] (copied into the bucket's buffers); None when no bucket holds them."""
        n = keys.shape[2]
        size = bucket_for(n + steps)
        if size is None:
            return None
        bucket = self._buckets.get(size)
        if bucket is None:
            bucket = self._buckets[size] = _Bucket(self.head, size)
        bucket.keys[:, :, :n].copy_(keys)
        bucket.values[:, :, :n].copy_(values)
        return ChainSteps(self, bucket, n)

    def run(self, bucket: _Bucket) -> tuple[torch.Tensor, torch.Tensor]:
        self.steps += 1
        if not self.capture:
            return self._step(bucket)
        if bucket.graph is None:
            self._capture(bucket)
        bucket.graph.replay()
        return bucket.out

    def _step(self, b: _Bucket) -> tuple[torch.Tensor, torch.Tensor]:
        """``HSRHead.step`` for one token over the bucket's buffers, then the head's logits."""
        head = self.head
        layer, attn = head.layer, head.layer.self_attn
        z = head.inputs(b.token, b.hidden)
        cos, sin = head.rope(b.position, z.dtype)
        q, k, v = attn.qkv(layer.input_layernorm(z), cos, sin, repeat_kv=False)
        b.keys.index_copy_(2, b.at, k)
        b.values.index_copy_(2, b.at, v)
        allowed = (b.indices <= b.at)[None]   # [1, L]: the exact cache, the chain so far, itself
        attended = F.scaled_dot_product_attention(q, b.keys, b.values, attn_mask=allowed, enable_gqa=True)
        out = layer.feed_forward(z + attn.out(attended))
        return out, head.head_logits(out)[0, -1]

    def _capture(self, bucket: _Bucket) -> None:
        """Warm up on a side stream (lazy initialisations stay outside the graph), then capture.
        The warm-ups compute the step from its present inputs: they write what it writes."""
        stream = torch.cuda.Stream(self.head.device)
        stream.wait_stream(torch.cuda.current_stream(self.head.device))
        with torch.cuda.stream(stream):
            for _ in range(2):
                self._step(bucket)
        torch.cuda.current_stream(self.head.device).wait_stream(stream)
        if self._pool is None:
            self._pool = torch.cuda.graph_pool_handle()
        bucket.graph = torch.cuda.CUDAGraph()
        # Thread-local: the target may run a step on its own thread while a draft captures.
        with torch.cuda.graph(bucket.graph, pool=self._pool, capture_error_mode="thread_local"):
            bucket.out = self._step(bucket)


class ChainSteps:
    """One proposal's drafted tokens through a bucket: ``step`` feeds one and returns its output
    state and the head's logits (valid until the next step)."""

    def __init__(self, graphs: HeadGraphs, bucket: _Bucket, cached: int):
        self._graphs, self._bucket, self._next = graphs, bucket, cached

    def step(self, token: int, hidden: torch.Tensor, position: int) -> tuple[torch.Tensor, torch.Tensor]:
        """token, its input state ``hidden`` [1, 1, H] (the root's or the last step's output) and
        its rotary position -> (output state [1, 1, H], logits [K])."""
        b = self._bucket
        if self._next >= b.size:
            raise IndexError(f"the chain outgrew its bucket of {b.size} positions")
        b.token.fill_(token)
        b.hidden.copy_(hidden)
        b.position.fill_(position)
        b.at.fill_(self._next)
        self._next += 1
        out, logits = self._graphs.run(b)
        return out, logits
