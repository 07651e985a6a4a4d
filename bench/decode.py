"""Decode speed on one device: Hugging Face and specserve side by side, against the memory limit.

Every shape decodes the same random prompts (``prompt_len`` token ids, greedy, exactly ``tokens``
new tokens: no EOS ends a row early) at each batch, each row timed on its second run (the first
warms it up: compiles, captures graphs, touches memory). Rows:

- ``hf-eager``: ``model.generate`` with its dynamic cache.
- ``hf-static-compiled``: ``generate`` with ``cache_implementation="static"``, with which
  transformers compiles the decode step itself (``torch.compile``, ``reduce-overhead``: CUDA
  graphs; the prefill stays eager); the warm-up's extra seconds are ``compile_seconds``. CUDA
  only unless forced: inductor on the CPU takes minutes.
- ``specserve-eager``, ``specserve-graphs``: specserve's engine, target only, without and with
  CUDA graphs (``BatchKV.use_cuda_graphs``; CUDA only), the elementwise pieces fused as served
  (``fused_elementwise``, on CUDA); ``specserve-graphs-unfused``: graphs over eager torch's
  elementwise ops, the lever's worth side by side; ``specserve-compiled``: the same buckets with
  the whole forward under ``torch.compile(mode="reduce-overhead")`` instead of the manual capture
  (``StepGraphs.set_mode``; CUDA only); the warm-up's extra seconds are ``compile_seconds``.
- ``replay``: the verify step's forward of γ + 1 tokens per request, timed alone, turned into
  tokens/s with an assumed mean accepted length τ: batch × τ / verify seconds. A replay, not a
  measurement of acceptance; the draft's cost is left out.

``ms_per_step`` is seconds / ``tokens`` (the prefill spread over the steps). A decode step at
batch 1 reads every weight once, so weights bytes / the device's copy bandwidth (measured in the
same run) is the fastest a step can be: ``bandwidth_limit_ms``; ``fraction_of_bandwidth_limit``
is that over the measured step. With the reference target's real weights on the machine, the
``chat-*`` rows measure speculation (prompt lookup, the suffix draft seeded with the shipped
answers as served, and the zoo's EAGLE-3 head at window γ and in two trees, chat prompts
at every batch, batch 1 each prompt alone): tokens/s and τ beside target-only on the same
prompts, and how many outputs equal target-only's.

Shapes: ``reference`` (SmolLM2-135M-Instruct: its weights when cached, else random ones in its
shape), ``8b`` (Llama-3-8B's shape, random weights made on the device), ``tiny`` (for tests).
Rows run cheapest first across shapes and the JSON is rewritten after each, so a run cut short,
or past ``budget_s``, keeps what it measured; a row that fails records its error and the run goes on.

``profile``: where a one-token forward's time goes, per shape (``shapes.<shape>.profile``): the
eager forward at batch 1 under ``torch.profiler``, the device's busy time, the share in the
products (matmuls) and the kernels that take the most; the lever to pull next when a row misses
the bandwidth limit. On a CPU it sees torch's operators only, not specserve's C kernels.
"""

from __future__ import annotations

import json
import time
import traceback
from collections.abc import Callable
from contextlib import contextmanager, nullcontext
from dataclasses import dataclass
from pathlib import Path

import torch

from specserve.bench.engine import BASELINE, RowConfig, machine_info
from specserve.data.prompts import load_prompts
from specserve.replicas.drafts.base import draft_model, needs_features
from specserve.replicas.drafts.head_graphs import HeadGraphs
from specserve.replicas.model import cuda_graphs
from specserve.replicas.model.batch_kv import Feed
from specserve.replicas.engine import NO_DRAFT, GenerateRequest, SpecEngine
from specserve.replicas.model_store import (REFERENCE_TARGET, LoadedModel, load_causal_lm, model_cache_dir,
                                            resolve_dtype, zoo_dir)
from specserve.replicas.sampling import SamplingParams
from specserve.replicas.step import TreeShape
from specserve.replicas.target import feature_tap

GAMMA = 4                     # the window of the replay and of the chat rows
EAGLE3 = "smollm2-eagle3"     # the zoo's EAGLE-3 head; its folder holds the reference tokenizer too
CHAT_PROMPTS = 4
REPLAY_WARMUP_STEPS = 4
_LLAMA = dict(bos_token_id=1, eos_token_id=2, rms_norm_eps=1e-5, initializer_range=0.02)
SHAPES = {   # transformers' LlamaConfig fields
    "reference": dict(hidden_size=576, num_hidden_layers=30, num_attention_heads=9, num_key_value_heads=3,
                      intermediate_size=1536, vocab_size=49152, max_position_embeddings=8192,
                      rope_parameters={"rope_type": "default", "rope_theta": 100000.0}, tie_word_embeddings=True),
    "8b": dict(hidden_size=4096, num_hidden_layers=32, num_attention_heads=32, num_key_value_heads=8,
               intermediate_size=14336, vocab_size=128256, max_position_embeddings=8192,
               rope_parameters={"rope_type": "default", "rope_theta": 500000.0}, tie_word_embeddings=False),
    # The reference's vocabulary, so that the reference tokenizer fits it.
    "tiny": dict(hidden_size=64, num_hidden_layers=2, num_attention_heads=4, num_key_value_heads=2,
                 intermediate_size=128, vocab_size=49152, max_position_embeddings=1024,
                 rope_parameters={"rope_type": "default", "rope_theta": 10000.0}, tie_word_embeddings=True),
}
# Cheapest first. The compiled rows last: a compile outlasts every other row, and torch's CUDA
# graph pools are then captured after specserve's own graphs are done with.
ROWS = ("specserve-eager", "specserve-graphs", "specserve-graphs-unfused", "hf-eager", "replay", "specserve-compiled",
        "hf-static-compiled")
COMPILED_ROWS = ("specserve-compiled", "hf-static-compiled")   # the chat rows run before them


@dataclass(frozen=True, kw_only=True)
class DecodeBenchConfig:
    """``specserve bench decode``'s options, checked when made, before any model loads."""

    json_path: Path = Path("bench-decode.json")   # rewritten after every row
    plot_path: Path = Path("bench-decode.png")    # tokens/s per row, per shape and batch
    shapes: tuple[str, ...] = ("reference",)
    batches: tuple[int, ...] = (1, 16)
    tokens: int = 128         # new tokens per request: many steps per prefill
    prompt_len: int = 128     # random prompt token ids per request
    device: str | None = None   # None: cuda when available, else cpu
    dtype: str | None = None    # None: bfloat16 on cuda, float32 on cpu
    hf_compile: bool | None = None   # None: on CUDA only
    replay_tau: float = 2.35  # the τ to replay: the zoo's EAGLE-3 head served on chat at window 4 (docs/benchmarks.md §6.0c)
    budget_s: float | None = None    # rows not started this many seconds into the run are skipped
    profile: bool = False     # where a one-token forward's time goes, per shape
    rows: tuple[str, ...] = ROWS   # which rows, run in ``ROWS``' order
    chat: bool = True         # the chat rows, where the reference shape runs with its real weights

    def __post_init__(self) -> None:
        unknown = [s for s in self.shapes if s not in SHAPES]
        if unknown or not self.shapes:
            raise ValueError(f"--shapes: unknown {unknown or 'none given'}; choose from {', '.join(SHAPES)}")
        if not self.batches or min(self.batches) < 1:
            raise ValueError(f"--batches must be >= 1 each, got {self.batches}")
        if self.tokens < 1 or self.prompt_len < 1:
            raise ValueError(f"--tokens and --prompt-len must be >= 1, got {self.tokens}, {self.prompt_len}")
        if not 1.0 <= self.replay_tau <= GAMMA + 1:
            raise ValueError(f"--replay-tau must be in [1, {GAMMA + 1}] (γ + 1 tokens at most), got {self.replay_tau}")
        unknown = [r for r in self.rows if r not in ROWS]
        if unknown or not self.rows:
            raise ValueError(f"--rows: unknown {unknown or 'none given'}; choose from {', '.join(ROWS)}")
        if self.budget_s is not None and self.budget_s <= 0:
            raise ValueError(f"--budget-s must be > 0, got {self.budget_s}")


class Skipped(Exception):
    """A row that does not run here; ``status`` says so in one word, the message says why."""

    def __init__(self, reason: str, status: str = "skipped"):
        super().__init__(reason)
        self.status = status


@dataclass
class Subject:
    """One shape, ready to decode: the engine over the model that HF's rows run too."""

    engine: SpecEngine
    real_weights: bool
    weights_bytes: int   # every parameter once (tied embeddings are one parameter)

    @property
    def model(self):
        return self.engine.loaded.model


def sync(device: torch.device) -> None:
    if device.type == "cuda":
        torch.cuda.synchronize(device)


def reference_weights_present() -> bool:
    """Only the cached folder counts: fetching it from its GGUF is a slow step of its own."""
    return (model_cache_dir() / REFERENCE_TARGET / "model.safetensors").exists()


def copy_bandwidth(device: torch.device, repeats: int = 5) -> float:
    """Bytes per second of a device-to-device copy (each byte read once and written once), over
    ``repeats`` copies after two that warm up: the rate a step's weight reads can reach at best."""
    size = (2 << 30) if device.type == "cuda" else (64 << 20)
    src = torch.ones(size, dtype=torch.uint8, device=device)
    dst = torch.empty_like(src)
    for i in range(2 + repeats):
        if i == 2:
            sync(device)
            start = time.perf_counter()
        dst.copy_(src)
    sync(device)
    return 2 * size * repeats / (time.perf_counter() - start)


def random_model(shape: str, device: torch.device, dtype: torch.dtype):
    """``shape``'s model with random weights made where they run: transformers' initialisation
    (normal(0, 0.02) for products and embeddings, norms at 1) with the device as the default, so
    no weight passes through the host. The reference's config is its cached folder's when there."""
    from transformers import AutoConfig, AutoModelForCausalLM, LlamaConfig

    folder = model_cache_dir() / REFERENCE_TARGET
    if shape == "reference" and (folder / "config.json").exists():
        config = AutoConfig.from_pretrained(folder, local_files_only=True)
    else:
        config = LlamaConfig(**SHAPES[shape], **_LLAMA)
    with torch.device(device):
        return AutoModelForCausalLM.from_config(config, dtype=dtype).eval()


def load_subject(shape: str, device: torch.device, dtype_name: str, slots: int) -> Subject:
    """The shape's model under an engine of ``slots`` slots. A random model gets the reference
    tokenizer where it has the reference's vocabulary, else none: prompts are token ids, nothing
    decodes text, and its generation config names the EOS the engine asks for."""
    real = shape == "reference" and reference_weights_present()
    if real:
        loaded = load_causal_lm(REFERENCE_TARGET, dtype=dtype_name, device=device)
    else:
        model = random_model(shape, device, resolve_dtype(dtype_name, device))
        tokenizer = None
        if model.config.vocab_size == SHAPES["reference"]["vocab_size"]:
            from transformers import AutoTokenizer

            tokenizer = AutoTokenizer.from_pretrained(zoo_dir() / EAGLE3, local_files_only=True)
        loaded = LoadedModel(shape, model, tokenizer)
    weights = sum(p.numel() * p.element_size() for p in loaded.model.parameters())
    return Subject(SpecEngine(loaded, {}, slots), real, weights)


def timed_twice(run: Callable[[], None], device: torch.device) -> tuple[float, float]:
    """Seconds of a first call (the warm-up) and of a second, identical one (the measurement)."""
    seconds = []
    for _ in range(2):
        sync(device)
        start = time.perf_counter()
        run()
        sync(device)
        seconds.append(time.perf_counter() - start)
    return seconds[0], seconds[1]


def decode_fields(batch: int, tokens: int, warmup_s: float, seconds: float) -> dict:
    return {"tokens": batch * tokens, "seconds": round(seconds, 4), "warmup_seconds": round(warmup_s, 4),
            "tokens_per_s": round(batch * tokens / seconds, 3), "ms_per_step": round(seconds / tokens * 1e3, 4)}


# --- the rows: each takes (run, subject, prompts) and returns its fields --------------------


@contextmanager
def plain_hf(model):
    """The model as transformers has it: without the forward hooks specserve's target puts on
    decoder layers to keep hidden states (its own forward keeps them without hooks). A hook in a
    compiled step would also make each step's hidden state an output that outlives the step."""
    saved = {(layer, key): hook for layer in model.model.layers for key, hook in list(layer._forward_hooks.items())
             if getattr(hook, "__module__", "").startswith("specserve.")}
    for layer, key in saved:
        del layer._forward_hooks[key]
    try:
        yield
    finally:
        for (layer, key), hook in saved.items():
            layer._forward_hooks[key] = hook


def hf_generate(model, prompts: list[list[int]], tokens: int, **kwargs) -> None:
    ids = torch.tensor(prompts, device=model.device)
    # min_new_tokens masks the EOS until the last token; no row is padded (pad_token_id only
    # spares a warning).
    out = model.generate(ids, attention_mask=torch.ones_like(ids), do_sample=False, max_new_tokens=tokens,
                         min_new_tokens=tokens, pad_token_id=0, **kwargs)
    if out.shape[1] != ids.shape[1] + tokens:
        raise RuntimeError(f"generate returned {out.shape[1] - ids.shape[1]} new tokens, not {tokens}")


def hf_eager_row(run: Run, subject: Subject, prompts) -> dict:
    with plain_hf(subject.model):
        warmup, seconds = timed_twice(lambda: hf_generate(subject.model, prompts, run.config.tokens), run.device)
    return decode_fields(len(prompts), run.config.tokens, warmup, seconds)


def hf_compiled_row(run: Run, subject: Subject, prompts) -> dict:
    from transformers import CompileConfig

    if not (run.device.type == "cuda" if run.config.hf_compile is None else run.config.hf_compile):
        raise Skipped("HF's compiled decode runs on CUDA unless --hf-compile forces it (inductor on the CPU takes minutes)")
    compile_config = CompileConfig()   # transformers' defaults: inductor, reduce-overhead
    compile_config._compile_all_devices = run.device.type != "cuda"   # generate compiles off CUDA only when told
    model, tokens = subject.model, run.config.tokens
    with plain_hf(model):
        warmup, seconds = timed_twice(lambda: hf_generate(model, prompts, tokens, cache_implementation="static",
                                                          compile_config=compile_config), run.device)
    return {**decode_fields(len(prompts), tokens, warmup, seconds), "compile_seconds": round(warmup - seconds, 3),
            "compiled": hasattr(model, "_compiled_call")}   # where generate keeps its compiled step


@contextmanager
def engine_graphs(subject: Subject, device: torch.device, wanted: bool, required: bool = False):
    """The engine's CUDA graphs (``BatchKV.use_cuda_graphs``, on by default on CUDA) on or off for
    the block as ``wanted``, off after; yields whether they are on. Wanted and ``required`` but
    impossible here: ``Skipped``, saying why."""
    switch = getattr(subject.engine.target.kv, "use_cuda_graphs", None)
    on = wanted and switch is not None and switch(True) is not False   # it answers whether they are in use
    if wanted and required and not on:
        if device.type != "cuda":
            raise Skipped("CUDA graphs need a CUDA device")
        raise Skipped("BatchKV has no use_cuda_graphs in this checkout" if switch is None else
                      "BatchKV runs no CUDA graphs for this model", status="unavailable")
    try:
        if switch is not None and not on:
            switch(False)
        yield on
    finally:
        if switch is not None:
            switch(False)


@contextmanager
def engine_elementwise(subject: Subject, fused: bool):
    """The engine's elementwise pieces fused (``BatchKV.use_fused_elementwise``, the default on
    CUDA) or eager for the block, back to the default after; yields whether fused ones run."""
    switch = subject.engine.target.kv.use_fused_elementwise
    try:
        yield switch(fused)
    finally:
        switch(True)


@contextmanager
def graphs_mode(subject: Subject, mode: str):
    """The engine's bucketed steps in ``mode`` (``StepGraphs.set_mode``) for the block, captured after."""
    graphs = subject.engine.target.kv.graphs
    if graphs is not None:
        graphs.set_mode(mode)
    tap = feature_tap(subject.engine.target.model)
    try:
        # A compiled step keeps no hidden states: these rows decode target-only.
        with tap.paused() if mode == "compile" and tap is not None else nullcontext():
            yield
    finally:
        if graphs is not None:
            graphs.set_mode("capture")


def specserve_row(run: Run, subject: Subject, prompts, graphs: bool, fused: bool = True, mode: str = "capture") -> dict:
    engine, tokens = subject.engine, run.config.tokens
    request = GenerateRequest(prompt="", max_tokens=tokens, draft=NO_DRAFT, window=0,
                              params=SamplingParams(ignore_eos=True))

    def decode() -> None:
        engine.reset_caches()   # cold, as HF's generate starts
        out = engine.generate_batch_ids(prompts, [request] * len(prompts))
        if any(len(g.token_ids) != tokens for g in out):
            raise RuntimeError(f"the engine returned {[len(g.token_ids) for g in out]} tokens, not {tokens} each")

    with engine_elementwise(subject, fused) as fused_on, \
            engine_graphs(subject, run.device, wanted=graphs, required=True) as on, graphs_mode(subject, mode):
        warmup, seconds = timed_twice(decode, run.device)
    fields = {**decode_fields(len(prompts), tokens, warmup, seconds), "cuda_graphs": on, "fused_elementwise": fused_on}
    if mode == "compile":
        fields.update(graphs="torch.compile reduce-overhead", compile_seconds=round(warmup - seconds, 3))
    return fields


def forward_ms(subject: Subject, prompts, width: int, steps: int, device: torch.device) -> float:
    """Mean ms of one ``BatchKV.forward`` feeding every slot ``width`` tokens after its prompt,
    until its logits are ready (a step's sampling needs them). Each slot is cropped back to its
    prompt after each forward, so every step sees the same context."""
    kv = subject.engine.target.kv
    kv.reset()
    kv.forward([Feed(slot, ids, 1) for slot, ids in enumerate(prompts)])   # the prefill
    feeds = [Feed(slot, [ids[-1]] * width, width) for slot, ids in enumerate(prompts)]   # any ids cost the same
    for i in range(REPLAY_WARMUP_STEPS + steps):
        if i == REPLAY_WARMUP_STEPS:
            start = time.perf_counter()
        kv.forward(feeds)
        sync(device)
        for slot, ids in enumerate(prompts):
            kv.crop(slot, len(ids))
    return (time.perf_counter() - start) / steps * 1e3


def replay_row(run: Run, subject: Subject, prompts) -> dict:
    with engine_graphs(subject, run.device, wanted=True) as on:
        verify = forward_ms(subject, prompts, GAMMA + 1, run.config.tokens, run.device)
        single = forward_ms(subject, prompts, 1, run.config.tokens, run.device)
    batch, tau = len(prompts), run.config.replay_tau
    return {"replay": True, "note": "a replay: tokens/s from an assumed τ, not a measurement of acceptance",
            "gamma": GAMMA, "tau_assumed": tau, "draft_cost": "not included",
            "includes": "the target's forward only: no drafting, sampling or scheduling", "cuda_graphs": on,
            "ms_per_step": round(verify, 4), "verify_ms": round(verify, 4), "forward_1_token_ms": round(single, 4),
            "tokens_per_s": round(batch * tau / verify * 1e3, 3),
            # Like for like: the same forward at one token per request, timed the same way.
            "speedup_vs_forward_1_token": round(tau * single / verify, 4)}


RUNNERS = {
    "specserve-eager": lambda *a: specserve_row(*a, graphs=False),
    "specserve-graphs": lambda *a: specserve_row(*a, graphs=True),
    "specserve-graphs-unfused": lambda *a: specserve_row(*a, graphs=True, fused=False),
    "specserve-compiled": lambda *a: specserve_row(*a, graphs=True, fused=False, mode="compile"),
    "hf-eager": hf_eager_row,
    "replay": replay_row,
    "hf-static-compiled": hf_compiled_row,
}
# The EAGLE-3 head's trees: EAGLE's own default (60 nodes, top-10: six levels as grown here,
# ``tree_growth``) and a narrower one of the same depth.
HEAD_TREES = (TreeShape(depth=6, top_k=10, budget=60), TreeShape(depth=6, top_k=4, budget=24))
# EAGLE's default tree again, its levels chosen on the host: a threshold far below any kept node's
# path probability prunes nothing, but SAGE's threshold keeps a tree off the device
# (``device_growth``), so the row measures what growing on the device saves.
HOST_GROWN = TreeShape(depth=6, top_k=10, budget=60, threshold=1e-300)
# EAGLE's default tree grown on the device but replayed level by level (``HeadGraphs.whole_trees``
# off): beside the default row, what one graph for the whole tree saves.
PER_LEVEL = f"{EAGLE3}-tree-d6k10n60-per-level"
# Target-only and the head first (the GPU path's aim compares them), then the model-free drafts.
CHAT_ROWS = (RowConfig(BASELINE, "specserve"),
             *(RowConfig(f"{EAGLE3}-tree-d{t.depth}k{t.top_k}n{t.budget}", "specserve", EAGLE3, tree=t) for t in HEAD_TREES),
             RowConfig(PER_LEVEL, "specserve", EAGLE3, tree=HEAD_TREES[0]),
             RowConfig(f"{EAGLE3}-tree-d6k10n60-host-grown", "specserve", EAGLE3, tree=HOST_GROWN),
             RowConfig(f"{EAGLE3}-{GAMMA}", "specserve", EAGLE3, GAMMA),
             RowConfig(f"prompt-lookup-{GAMMA}", "specserve", "prompt-lookup", GAMMA),
             RowConfig(f"suffix-{GAMMA}", "specserve", "suffix", GAMMA))


def chat_row(engine: SpecEngine, row: RowConfig, prompts: list[list[int]], tokens: int, batch: int,
             reference: list[list[int]] | None = None) -> tuple[dict, list[list[int]]]:
    """One configuration over the chat prompts, ``batch`` at a time in one batch (batch 1: each
    alone); the EOS ends them, as served. Every group runs once untimed first, as on a replica
    that has served a while: whatever is made on first use (a graph outside the buckets captured
    at load, an allocation) is then made before the timed runs. In-process, the suffix draft
    learns nothing from these runs. ``reference``: target-only's outputs, which the row's are
    counted against (greedy: equal, up to the device's rounding at a different batch shape).
    Returns the row's fields and its outputs."""
    request = GenerateRequest(prompt="", max_tokens=tokens, draft=row.draft, window=row.window, tree=row.tree)
    groups = [prompts[i:i + batch] for i in range(0, len(prompts), batch)]

    def generate(group: list[list[int]]) -> list:
        engine.reset_caches()   # cold: no row's cache spares the next one a prefill
        return engine.generate_batch_ids(group, [request] * len(group))

    for group in groups:
        generate(group)
    outputs, seconds, steps, request_steps = [], 0.0, 0, 0
    for group in groups:
        start = time.perf_counter()
        generations = generate(group)
        seconds += time.perf_counter() - start
        outputs += [g.token_ids for g in generations]
        steps += max(g.stats.steps for g in generations)   # the group's steps: its longest request's
        request_steps += sum(g.stats.steps for g in generations)
    emitted = sum(len(ids) for ids in outputs)
    fields = {"tokens": emitted, "seconds": round(seconds, 4), "tokens_per_s": round(emitted / seconds, 3),
              "ms_per_step": round(seconds / steps * 1e3, 4), "mean_accepted_len": round(emitted / request_steps, 4),
              "prompts": len(prompts)}
    if reference is not None:
        fields["outputs_equal_to_target_only"] = sum(a == b for a, b in zip(outputs, reference))
    return fields, outputs


PROFILED_FORWARDS = 5
TOP_KERNELS = 12
PRODUCTS = ("aten::mm", "aten::addmm", "aten::bmm", "aten::_weight_int8pack_mm", "aten::_int_mm")


def profile_forward(subject: Subject, prompt: list[int], device: torch.device) -> dict:
    """The eager one-token forward after ``prompt`` (graphs off: a graph's kernels are the same
    ones, launched at once), ``PROFILED_FORWARDS`` times under ``torch.profiler``: per forward,
    the device's busy time, the products' share of it and the kernels that take the most."""
    from torch.profiler import ProfilerActivity, profile

    kv = subject.engine.target.kv
    switch = getattr(kv, "use_cuda_graphs", None)
    if switch is not None:
        switch(False)
    kv.reset()
    kv.forward([Feed(0, prompt, 1)])
    feed = [Feed(0, [prompt[-1]], 1)]
    kv.forward(feed)   # warm
    kv.crop(0, len(prompt))
    sync(device)
    on_cuda = device.type == "cuda"
    activities = [ProfilerActivity.CPU] + ([ProfilerActivity.CUDA] if on_cuda else [])
    with profile(activities=activities) as prof:
        for _ in range(PROFILED_FORWARDS):
            kv.forward(feed)
            kv.crop(0, len(prompt))
        sync(device)
    events = prof.key_averages()

    def own_ms(event) -> float:   # self time, so that nested operators are not counted twice
        return (event.self_device_time_total if on_cuda else event.self_cpu_time_total) / 1e3 / PROFILED_FORWARDS

    # On CUDA the kernels themselves carry the device time; on the CPU the operators do.
    timed = [e for e in events if own_ms(e) > 0 and (not on_cuda or not e.key.startswith("aten::"))]
    total = sum(own_ms(e) for e in timed)
    # On CUDA a product's device time sits on its kernels, which the operator's total counts.
    products = sum(e.device_time_total if on_cuda else e.self_cpu_time_total for e in events
                   if e.key in PRODUCTS) / 1e3 / PROFILED_FORWARDS
    top = sorted(timed, key=own_ms, reverse=True)[:TOP_KERNELS]
    return {"forwards": PROFILED_FORWARDS, "seen": "kernels" if on_cuda else "torch operators (not the C kernels)",
            "busy_ms_per_forward": round(total, 4),
            "products_ms_per_forward": round(products, 4),
            "calls_per_forward": round(sum(e.count for e in timed) / PROFILED_FORWARDS, 1),   # kernels, or operators
            "top": [{"name": e.key[:120], "ms_per_forward": round(own_ms(e), 4),
                     "calls_per_forward": round(e.count / PROFILED_FORWARDS, 2)} for e in top]}


# --- the run -------------------------------------------------------------------------------


def link(report: dict) -> None:
    """Fields that compare rows: the bandwidth limit at batch 1, speedups over target-only."""
    rows = [r for r in report["rows"] if r["status"] == "ok"]
    by_key = {(r["shape"], r["batch"], r["row"]): r for r in rows}
    bandwidth = report["meta"]["copy_bandwidth_bytes_per_s"]
    for r in rows:
        weights = report["shapes"].get(r["shape"], {}).get("weights_bytes")
        if r["batch"] == 1 and weights and bandwidth:
            r["bandwidth_limit_ms"] = round(weights / bandwidth * 1e3, 4)
            r["fraction_of_bandwidth_limit"] = round(r["bandwidth_limit_ms"] / r["ms_per_step"], 4)
        bases = (f"chat-{BASELINE}",) if r["row"].startswith("chat-") else \
            ("specserve-graphs", "specserve-eager") if r["row"] == "replay" else ()
        base = next((by_key[k] for b in bases if (k := (r["shape"], r["batch"], b)) in by_key), None)
        if base is not None:
            r["speedup_vs_target_only"] = round(r["tokens_per_s"] / base["tokens_per_s"], 4)
            r["target_only_row"] = base["row"]


class Run:
    """The report being written row by row, what every row runs with, and the clock."""

    def __init__(self, config: DecodeBenchConfig, device: torch.device, dtype_name: str, report: dict):
        self.config, self.device, self.dtype_name, self.report = config, device, dtype_name, report
        self.start = time.monotonic()

    def log(self, text: str) -> None:
        print(f"[{time.monotonic() - self.start:7.1f}s] {text}", flush=True)

    def row(self, ident: dict, measure: Callable[[], dict], skipped: str | None = None) -> None:
        """Measure one row (unless ``skipped`` says why not); whatever happens, record it, rewrite
        the JSON and go on."""
        row, start = dict(ident), time.monotonic()
        if skipped is None and self.config.budget_s is not None and start - self.start > self.config.budget_s:
            skipped = f"not started within --budget-s {self.config.budget_s}"
        if skipped is not None:
            row.update(status="skipped", reason=skipped)
        else:
            try:
                row.update(status="ok", **measure())
            except Skipped as skip:
                row.update(status=skip.status, reason=str(skip))
            except Exception as err:  # noqa: BLE001 - one row's failure must not cost the rows after it
                # The innermost frames too: a run on a borrowed device may be the only one.
                row.update(status="error", error=f"{type(err).__name__}: {err}", where=traceback.format_exc(limit=-4))
                if torch.cuda.is_available():
                    torch.cuda.empty_cache()
        row["wall_s"] = round(time.monotonic() - start, 2)
        self.report["rows"].append(row)
        link(self.report)
        self.config.json_path.parent.mkdir(parents=True, exist_ok=True)
        self.config.json_path.write_text(json.dumps(self.report, indent=2) + "\n")
        result = f"{row['tokens_per_s']:.1f} tok/s" if "tokens_per_s" in row else row.get("reason", row.get("error"))
        self.log(f"{row['shape']} batch {row['batch']} {row['row']}: {row['status']}, {result}")


def speculation_rows(run: Run) -> None:
    """The chat rows at every batch, on an engine of the real reference target and its drafts
    (loaded once)."""
    loaded, outputs = {}, {}
    if not reference_weights_present():
        for batch in run.config.batches:
            run.row({"shape": "reference", "batch": batch, "row": "chat-speculation"}, dict,
                    "reference weights not present on this machine")
        return

    def measure(row: RowConfig, batch: int) -> dict:
        if not loaded:
            from specserve.training.answers import ANSWERS_DIR

            drafts = [EAGLE3] if (zoo_dir() / EAGLE3 / "config.json").exists() else []
            engine = SpecEngine.load(REFERENCE_TARGET, draft_models=drafts, dtype=run.dtype_name, device=str(run.device),
                                     slots=max(run.config.batches), suffix_seed=ANSWERS_DIR)
            # As a served replica starts: the cache at its full length and every bucket's graph,
            # the target's and the head's, so that no timed step grows the cache (which drops the
            # graphs) or waits on a capture.
            kv, start = engine.target.kv, time.monotonic()
            heads = [HeadGraphs.for_head(draft_model(d)) for d in engine.drafts.values() if needs_features(d)]
            heads = [graphs for graphs in heads if graphs is not None]
            if kv.graphs is not None:
                kv.reserve()
                captured = kv.capture_graphs(cuda_graphs.TOKEN_BUCKETS)
                captured += sum(graphs.capture_buckets(kv.max_len, trees=HEAD_TREES) for graphs in heads)
                run.report["meta"]["chat_graphs"] = {"captured": captured, "seconds": round(time.monotonic() - start, 2)}
            texts = load_prompts("chat", max(CHAT_PROMPTS, *run.config.batches))
            loaded.update(engine=engine, heads=heads, prompts=[engine.encode(t, chat=True) for t in texts])
        for graphs in loaded["heads"]:
            graphs.whole_trees = row.name != PER_LEVEL
        prompts = loaded["prompts"][:max(CHAT_PROMPTS, batch)]
        fields, produced = chat_row(loaded["engine"], row, prompts, run.config.tokens, batch, outputs.get(batch))
        if row.name == BASELINE:
            outputs[batch] = produced
        return fields

    for batch in run.config.batches:
        for row in CHAT_ROWS:
            run.row({"shape": "reference", "batch": batch, "row": f"chat-{row.name}"},
                    lambda row=row, batch=batch: measure(row, batch))


def run_decode_bench(config: DecodeBenchConfig) -> dict:
    """Every row on every shape and batch; the JSON after each row, the plot at the end."""
    device = torch.device(config.device or ("cuda" if torch.cuda.is_available() else "cpu"))
    dtype_name = config.dtype or ("bfloat16" if device.type == "cuda" else "float32")
    resolve_dtype(dtype_name, device)   # a wrong name fails before anything loads
    machine = machine_info()
    name = torch.cuda.get_device_name(device) if device.type == "cuda" else machine["cpu_model"]
    meta = {"device": str(device), "device_name": name, "dtype": dtype_name, "torch": torch.__version__,
            "cuda": torch.version.cuda, "shapes": list(config.shapes), "batches": list(config.batches),
            "tokens": config.tokens, "prompt_len": config.prompt_len, "gamma": GAMMA,
            "replay_tau": config.replay_tau, "machine": machine}
    run = Run(config, device, dtype_name, {"meta": meta, "shapes": {}, "rows": []})
    run.log(f"decode bench on {name} ({device}, {dtype_name})")
    try:
        meta["copy_bandwidth_bytes_per_s"] = round(copy_bandwidth(device))
    except Exception as err:  # noqa: BLE001 - the rows still run, without the limit
        meta["copy_bandwidth_bytes_per_s"], meta["copy_bandwidth_error"] = None, f"{type(err).__name__}: {err}"
    run.log(f"copy bandwidth {meta['copy_bandwidth_bytes_per_s']} bytes/s")
    subjects, prompts = {}, {}
    for shape in config.shapes:
        start = time.monotonic()
        try:
            subject = subjects[shape] = load_subject(shape, device, dtype_name, max(config.batches))
            run.report["shapes"][shape] = {"real_weights": subject.real_weights, "weights_bytes": subject.weights_bytes,
                                           "build_seconds": round(time.monotonic() - start, 2)}
            for batch in config.batches:   # the same ids for every row of a (shape, batch)
                generator = torch.Generator().manual_seed(batch)
                prompts[(shape, batch)] = torch.randint(0, subject.model.config.vocab_size, (batch, config.prompt_len),
                                                        generator=generator).tolist()
        except Exception as err:  # noqa: BLE001 - the other shapes still run
            run.report["shapes"][shape] = {"error": f"{type(err).__name__}: {err}"}
        run.log(f"{shape}: {run.report['shapes'][shape]}")
        if config.profile and shape in subjects:
            try:
                first = prompts[(shape, min(config.batches))][0]
                run.report["shapes"][shape]["profile"] = profile_forward(subjects[shape], first, device)
            except Exception as err:  # noqa: BLE001 - the rows still run
                run.report["shapes"][shape]["profile"] = {"error": f"{type(err).__name__}: {err}"}
            run.log(f"{shape} profile: {run.report['shapes'][shape]['profile']}")
    chat = config.chat and "reference" in config.shapes
    for kind in (k for k in ROWS if k in config.rows):
        if chat and kind in COMPILED_ROWS:
            speculation_rows(run)
            chat = False
        for shape, subject in subjects.items():
            for batch in config.batches:
                run.row({"shape": shape, "batch": batch, "row": kind},
                        lambda: RUNNERS[kind](run, subject, prompts[(shape, batch)]))
    if chat:
        speculation_rows(run)
    plot(run.report, config.plot_path)
    run.log(f"wrote {config.json_path} and {config.plot_path}")
    return run.report


def plot(report: dict, path: Path) -> None:
    """Per shape, grouped bars of tokens/s by batch (log scale), the bandwidth limit at batch 1."""
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    shapes = [s for s in report["shapes"] if any(r["shape"] == s and r["status"] == "ok" for r in report["rows"])]
    fig, axes = plt.subplots(1, max(len(shapes), 1), figsize=(6.5 * max(len(shapes), 1), 4.8), squeeze=False)
    for ax, shape in zip(axes[0], shapes):
        rows = [r for r in report["rows"] if r["shape"] == shape and r["status"] == "ok"]
        batches, names = sorted({r["batch"] for r in rows}), list(dict.fromkeys(r["row"] for r in rows))
        by_key, width = {(r["batch"], r["row"]): r for r in rows}, 0.8 / len(names)
        for j, name in enumerate(names):
            at = [(g, by_key[(b, name)]["tokens_per_s"]) for g, b in enumerate(batches) if (b, name) in by_key]
            ax.bar([g + (j - (len(names) - 1) / 2) * width for g, _ in at], [v for _, v in at], width, label=name,
                   color=plt.cm.tab10(j % 10), hatch="//" if name == "replay" else None)
        limit = next((r["bandwidth_limit_ms"] for r in rows if "bandwidth_limit_ms" in r), None)
        if limit and 1 in batches:
            g = batches.index(1)
            ax.hlines(1e3 / limit, g - 0.45, g + 0.45, colors="black", linestyles="--",
                      label="bandwidth limit, one token a step")
        ax.set_yscale("log")
        ax.set_ylim(top=ax.get_ylim()[1] * 8)   # room for the legend above the bars
        ax.set_xticks(range(len(batches)), [f"batch {b}" for b in batches])
        ax.set_ylabel("tokens / s")
        ax.set_title(f"{shape} ({report['shapes'][shape]['weights_bytes'] / 1e9:.2f} GB of weights)", fontsize=9)
        ax.legend(fontsize=7, ncols=2, loc="upper left")
        ax.grid(axis="y", alpha=0.3)
    meta = report["meta"]
    fig.suptitle(f"{meta['device_name']}, {meta['dtype']}, {meta['tokens']} new tokens after {meta['prompt_len']}; "
                 f"replay: τ = {meta['replay_tau']} assumed, draft cost not included", fontsize=9)
    fig.tight_layout()
    path.parent.mkdir(parents=True, exist_ok=True)
    fig.savefig(path, dpi=120)
    plt.close(fig)
