"""CUDA graphs for the padded step: a forward captured once per bucketed shape, replayed with
static buffers.

Why: on a GPU a small model's decode or verify step is a few hundred kernel launches, each a few
microseconds of Python and driver time while the device waits; a graph replays all of them in one
launch. A graph runs fixed shapes at fixed addresses, so a step is padded up to a **bucket**
(batch rows B, tokens per row S, keys per row L) and its inputs are copied into that bucket's
buffers:

- rows are slots ``0..B-1`` (the scheduler keeps busy slots low and dense); rows without a feed
  are padding rows, as in ``BatchKV``'s padded layout;
- S pads every feed to the bucket's width with padding columns that see only themselves;
- L is the keys every row attends over, masked past each row's own; the slot buffers' first L
  positions are a fixed view of the cache, so a graph holds as long as the cache is not
  reallocated (``BatchKV`` drops its graphs when it grows).

Each graph's logits are for all B x S positions (the rows each feed wants are read after the
replay); a watched decoder layer's output (``target.FeatureTap``) is a buffer of the graph too,
handed to the tap after each replay. Shapes outside the buckets (long prefill chunks, a batch
above the largest bucket, keys beyond the cache) run eagerly. A graph is captured the first time
its bucket is used (``capture`` captures chosen buckets at start), from that step's own inputs:
the warm-up forwards before the capture compute that step exactly, writing the keys and values it
would write anyway.

The alternative, ``torch.compile(mode="reduce-overhead")`` of the whole forward (inductor fuses
it, and its CUDA graph trees capture it), runs over the same buckets in ``mode="compile"``, for
``bench decode`` to measure beside the manual capture (docs/design.md §9).
"""

from __future__ import annotations

import os
import threading
from dataclasses import dataclass, field

import torch

from specserve.replicas.model import fused_elementwise
from specserve.replicas.model.transfer import copy_in

# One capture at a time in a process: the target's and a draft's threads each capture lazily, and
# a capture's start synchronises the device, which another thread's capture forbids.
CAPTURE_LOCK = threading.Lock()

# Tokens per row: decode (1), chains and trees up to 63 drafted tokens (EAGLE-2's trees of 60
# nodes); longer feeds run eagerly.
TOKEN_BUCKETS = (1, 2, 4, 8, 16, 32, 64)
# Rows x tokens of a bucket at most: a graph keeps logits for all of them, so wide feeds take
# graphs at small batches only (a batch of 16 trees of 60 nodes runs eagerly).
MAX_BUCKET_TOKENS = 256
# The widths a replica captures at start (decode, and windows up to 15); wider buckets are
# captured the first time a step uses them.
START_WIDTHS = (1, 2, 4, 8, 16)
# Keys per row: powers of two from this up to the cache's capacity, and the capacity itself.
SMALLEST_KEY_BUCKET = 256
# Graphs kept per model: each holds its own static inputs and outputs (the pool is shared).
MAX_GRAPHS = 256
# How a bucket's step runs (``StepGraphs.set_mode``).
MODES = ("capture", "buffers", "compile")
# Set to 0 to run every step eagerly on CUDA (a debugging switch; the config's is ``cuda_graphs``).
ENV_SWITCH = "SPECSERVE_CUDA_GRAPHS"


def available(device: torch.device) -> bool:
    """Whether steps on ``device`` can run as graphs: CUDA only, unless switched off by env."""
    return device.type == "cuda" and os.environ.get(ENV_SWITCH, "1") != "0"


def batch_buckets(slots: int) -> tuple[int, ...]:
    """1, 2, 4, ... up to the slot count, which is always a bucket (rows never pass the slots)."""
    sizes, b = [], 1
    while b < slots:
        sizes.append(b)
        b *= 2
    return (*sizes, slots)


def key_buckets(capacity: int) -> tuple[int, ...]:
    """``SMALLEST_KEY_BUCKET``, doubling, up to the cache's capacity (itself a bucket)."""
    sizes, L = [], SMALLEST_KEY_BUCKET
    while L < capacity:
        sizes.append(L)
        L *= 2
    return (*sizes, capacity)


def smallest_at_least(n: int, buckets: tuple[int, ...]) -> int | None:
    return next((b for b in buckets if b >= n), None)


@dataclass(frozen=True)
class Bucket:
    rows: int      # B: slots 0..B-1
    tokens: int    # S: columns per row
    keys: int      # L: cached + new positions every row attends over


@dataclass
class _Graph:
    """A captured forward and the buffers it reads and writes."""

    ids: torch.Tensor            # [B, S]
    positions: torch.Tensor      # [B, S]
    mask: torch.Tensor           # [B, 1, S, L] additive
    rows: torch.Tensor           # [B, S] slot of each column (the cache write)
    columns: torch.Tensor        # [B, S] cache position of each column
    graph: torch.cuda.CUDAGraph | None = None
    logits: torch.Tensor | None = None                          # [B, S, V]
    tapped: dict[int, torch.Tensor] = field(default_factory=dict)   # decoder layer -> [B, S, hidden]


class StepGraphs:
    """The bucketed graphs of one ``BatchKV``'s forward (``llama_forward.LlamaForward``)."""

    def __init__(self, forward, device: torch.device, slots: int, mode: str = "capture"):
        """``mode``: ``"capture"``, CUDA graphs captured here; ``"buffers"``, each bucket's forward
        run eagerly over the same padded buffers (the bucketed layout without graphs, which any
        device can check); ``"compile"``, see ``set_mode``."""
        self.forward = forward
        self.device = device
        self.batch_buckets = batch_buckets(slots)
        self.enabled = True
        self._graphs: dict[tuple[Bucket, frozenset[int]], _Graph] = {}
        self._pool = None
        self._compiled = None
        self.set_mode(mode)
        self.replays = 0     # steps served by a graph
        self.eager = 0       # padded steps that fit no bucket

    def bucket(self, hi: int, width: int, cached: list[int], capacity: int) -> Bucket | None:
        """The smallest bucket holding a padded step over slots below ``hi`` whose longest feed
        has ``width`` tokens (``cached``: each slot's cached positions), or None: run eagerly.
        Every row of the bucket's slots writes its columns after its own cached tokens, so the
        keys cover the longest of them."""
        if not self.enabled:
            return None
        B = smallest_at_least(hi, self.batch_buckets)
        S = smallest_at_least(width, TOKEN_BUCKETS)
        if B is not None and S is not None and B * S > MAX_BUCKET_TOKENS:
            S = None
        L = None if B is None or S is None else smallest_at_least(max(cached[:B]) + S, key_buckets(capacity))
        if L is None:
            self.eager += 1
            return None
        return Bucket(B, S, L)

    def set_mode(self, mode: str) -> None:
        """How buckets run from now on (``__init__``); drops the graphs of the mode before.
        ``"compile"``: the whole forward under ``torch.compile(mode="reduce-overhead", fullgraph=
        True)``, one compile per bucket (static shapes, as a graph has), over the cache's buffers
        marked as static addresses; inductor fuses the elementwise pieces itself, so the forward
        runs the eager ones (``fused_elementwise.EAGER``). No feature tap: for measuring beside
        the capture, not for serving."""
        if mode not in MODES:
            raise ValueError(f"mode must be one of {MODES}, got {mode!r}")
        self.mode = mode
        self.clear()
        if mode == "compile":
            self.forward.elementwise = fused_elementwise.EAGER

    def clear(self) -> None:
        """Forget every graph (the cache they read was reallocated)."""
        self._graphs.clear()

    def __len__(self) -> int:
        return len(self._graphs)

    def run(self, bucket: Bucket, ids: torch.Tensor, positions: torch.Tensor, mask: torch.Tensor,
            rows: torch.Tensor, columns: torch.Tensor, cache_layers, plan, tap) -> torch.Tensor:
        """Logits [B, S, V] of the padded step whose host tensors are given at the bucket's shape
        (ids, positions, rows, columns [B, S]; mask [B, 1, S, L]); fills ``tap`` as an eager
        forward would."""
        if tap is not None and not tap.watched_layers:
            tap = None   # a tap watching nothing keeps nothing (and a compiled step takes no tap)
        watched = frozenset() if tap is None else tap.watched_layers
        key = (bucket, watched)
        graph = self._graphs.get(key)
        fresh = graph is None
        if not fresh:   # moved last: the least recently used goes first
            self._graphs[key] = self._graphs.pop(key)
        else:
            if len(self._graphs) >= MAX_GRAPHS:
                self._graphs.pop(next(iter(self._graphs)))
            graph = _Graph(*(torch.empty_like(t, device=self.device) for t in (ids, positions, mask, rows, columns)))
        for static, value in zip((graph.ids, graph.positions, graph.mask, graph.rows, graph.columns),
                                 (ids, positions, mask, rows, columns)):
            copy_in(static, value)
        plan.lo, plan.hi, plan.kv_len = 0, bucket.rows, bucket.keys
        plan.rows, plan.columns = graph.rows, graph.columns
        if self.mode == "buffers":
            self._record(graph, cache_layers, tap)
        elif self.mode == "compile":
            self._compiled_step(graph, cache_layers, tap, fresh)
        elif fresh:
            self._capture(graph, cache_layers, tap)
        if fresh:
            self._graphs[key] = graph
        if self.mode == "capture":
            graph.graph.replay()
        self.replays += 1
        if tap is not None:
            for layer, out in graph.tapped.items():
                tap.keep(layer, out.clone())
        return graph.logits

    def _call(self, graph: _Graph, cache_layers, tap) -> torch.Tensor:
        return self.forward(graph.ids, graph.positions, graph.mask, cache_layers, graph.ids.shape[1], tap)

    def _capture(self, graph: _Graph, cache_layers, tap) -> None:
        """Warm up on a side stream (lazy initialisations happen outside the capture), then
        capture. The warm-ups compute this step from its own inputs: what they write into the
        cache is what the step writes."""
        self.forward._rope_table(graph.mask.shape[-1], self.device, graph.mask.dtype)   # built outside the graph
        with CAPTURE_LOCK:
            current = torch.cuda.current_stream(self.device)
            stream = torch.cuda.Stream(self.device)
            stream.wait_stream(current)
            with torch.cuda.stream(stream):
                for _ in range(2):
                    self._call(graph, cache_layers, tap)
            current.wait_stream(stream)
            # A cache allocated in the warm-ups belongs to their stream; the steps use it on this
            # one, whose work must end before its memory is reused.
            for layer in cache_layers:
                for buf in getattr(layer, "buffers", None) or ():
                    buf.record_stream(current)
            if self._pool is None:
                self._pool = torch.cuda.graph_pool_handle()
            graph.graph = torch.cuda.CUDAGraph()
            # Thread-local: a draft's thread may read from the device while the target captures.
            with torch.cuda.graph(graph.graph, pool=self._pool, capture_error_mode="thread_local"):
                self._record(graph, cache_layers, tap)

    def _compiled_step(self, graph: _Graph, cache_layers, tap, fresh: bool) -> None:
        """The step through the compiled forward (``set_mode``); a new bucket first runs once
        eagerly, which allocates the cache and builds the rotary table outside the trace (and
        writes what the step writes)."""
        if tap is not None:
            raise ValueError("a compiled step keeps no feature tap (mode 'compile' is for target-only measurements)")
        if fresh:
            self._record(graph, cache_layers, None)
            for static in (graph.ids, graph.positions, graph.mask, graph.rows, graph.columns,
                           *(buf for layer in cache_layers for buf in layer.buffers)):
                torch._dynamo.mark_static_address(static)
        if self._compiled is None:
            self._compiled = torch.compile(self._plain_step, mode="reduce-overhead", dynamic=False, fullgraph=True)
        torch.compiler.cudagraph_mark_step_begin()   # the last step's outputs are read: its graph may run again
        graph.logits = self._compiled(graph.ids, graph.positions, graph.mask, cache_layers)

    def _plain_step(self, ids: torch.Tensor, positions: torch.Tensor, mask: torch.Tensor, cache_layers) -> torch.Tensor:
        return self.forward(ids, positions, mask, cache_layers, ids.shape[1])

    def _record(self, graph: _Graph, cache_layers, tap) -> None:
        """One forward over the graph's buffers, keeping its logits and the watched layers' outputs."""
        recorder = _Recorder() if tap is not None else None
        graph.logits = self._call(graph, cache_layers, None if tap is None else _RecordingTap(tap, recorder))
        graph.tapped = {} if recorder is None else recorder.outputs


class _Recorder:
    def __init__(self):
        self.outputs: dict[int, torch.Tensor] = {}


class _RecordingTap:
    """Stands in for a ``FeatureTap`` during capture: the watched layers' outputs become buffers
    of the graph (handed to the real tap after each replay)."""

    def __init__(self, tap, recorder: _Recorder):
        self._tap, self._recorder = tap, recorder

    def layer_of(self, module):
        return self._tap.layer_of(module)

    def keep(self, layer: int, output: torch.Tensor) -> None:
        self._recorder.outputs[layer] = output
