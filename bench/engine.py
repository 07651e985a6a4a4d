"""Engine benchmark: Hugging Face ``generate`` against specserve, side by side, by category.

In-process, one stream, the reference target, greedy decoding, prompts rendered with the chat
template. Every configuration decodes the same prompts in the same run, and the configurations
take turns on each prompt (the starting one rotates from prompt to prompt), so a noisy
neighbour on these shared machines slows all of them alike. Ratios are the result; absolute
numbers sit beside them.

Configurations:

- ``hf-plain``: ``model.generate(do_sample=False)`` on the very model object the engine uses.
- ``hf-prompt-lookup``: the same with ``prompt_lookup_num_tokens`` (HF's prompt lookup).
- ``target-only``: specserve with draft ``none``, one token per step: the autoregressive (AR)
  baseline every ``speedup_vs_ar`` divides by.
- ``prompt-lookup-{2,4,6}``: specserve's prompt-lookup draft with window γ = 2, 4, 6, and
  ``prompt-lookup-10``, HF's window, for a like-for-like comparison with ``hf-prompt-lookup``.
- ``<zoo draft>-{2,3,4}`` and ``<zoo draft>-tree``: each draft exported into the package's zoo
  (``specserve zoo export``) with window γ = 2, 3, 4 and with a token tree (depth 4, top-2, 8
  nodes); ``<zoo draft>-int8-{2,3,4}``: the same draft with its weights as int8 rows.

Per row (config × category, plus an ``all`` row per config): ``tokens_per_s`` = Σ tokens / Σ
seconds over the category's prompts; ``mean_accepted_len`` τ = emitted tokens / steps (null for
HF, which does not report it); ``matches_target_only`` = prompts whose greedy output equals
target-only's token for token, a cheap losslessness check (speculation must not change greedy
output, up to floating-point ties).
"""

from __future__ import annotations

import json
import os
import platform
import time
from collections.abc import Sequence
from dataclasses import dataclass
from pathlib import Path

import torch

from specserve.bench.turns import in_turn
from specserve.data.prompts import CATEGORIES, load_prompts
from specserve.replicas.model_store import INT8_SUFFIX, quantized_name, zoo_dir
from specserve.replicas.step import SpecStats, TreeShape
from specserve.replicas.engine import NO_DRAFT, GenerateRequest, SpecEngine

BASELINE = "target-only"
ALL = "all"   # the aggregate pseudo-category
# HF's documented typical value ("usually 10", generation strategies guide); its n-gram size
# stays at HF's default of 2.
HF_PROMPT_LOOKUP_TOKENS = 10
# Warm-up decodes this many tokens per configuration: enough to run both prefill and steps.
WARMUP_TOKENS = 16


@dataclass(frozen=True)
class RowConfig:
    """One configuration: a JSON row's ``config``."""

    name: str
    backend: str                       # "hf" or "specserve"
    draft: str = NO_DRAFT              # specserve only
    window: int = 0                    # specserve only: γ
    prompt_lookup_tokens: int | None = None   # hf only
    tree: TreeShape | None = None      # specserve only


CONFIGS = (
    RowConfig("hf-plain", "hf"),
    RowConfig("hf-prompt-lookup", "hf", prompt_lookup_tokens=HF_PROMPT_LOOKUP_TOKENS),
    RowConfig(BASELINE, "specserve"),
    RowConfig("prompt-lookup-2", "specserve", "prompt-lookup", 2),
    RowConfig("prompt-lookup-4", "specserve", "prompt-lookup", 4),
    RowConfig("prompt-lookup-6", "specserve", "prompt-lookup", 6),
    # The same window as hf-prompt-lookup: separates the engine from the choice of γ.
    RowConfig("prompt-lookup-10", "specserve", "prompt-lookup", HF_PROMPT_LOOKUP_TOKENS),
)


ZOO_TREE = TreeShape(depth=4, top_k=2, budget=8)


def zoo_configs() -> list[RowConfig]:
    """Rows for every draft exported into the zoo folder."""
    from specserve.training.zoo import RECIPES

    configs = []
    for name in RECIPES:
        if (zoo_dir() / name / "config.json").exists():
            configs += [RowConfig(f"{name}-{w}", "specserve", name, w) for w in (2, 3, 4)]
            configs.append(RowConfig(f"{name}-tree", "specserve", name, tree=ZOO_TREE))
            int8 = name + INT8_SUFFIX   # its weights as int8 rows
            configs += [RowConfig(f"{int8}-{w}", "specserve", int8, w) for w in (2, 3, 4)]
    return configs


def select_configs(names: Sequence[str] | None) -> list[RowConfig]:
    """The named configurations in canonical order, always with the baseline (speedups need it)."""
    known = [*CONFIGS, *zoo_configs()]
    if names is None:
        return known
    wanted = {n.strip() for n in names if n.strip()}
    unknown = wanted - {c.name for c in known}
    if unknown:
        raise ValueError(
            f"unknown configuration(s) {', '.join(sorted(unknown))}; "
            f"choose from {', '.join(c.name for c in known)}"
        )
    return [c for c in known if c.name in wanted or c.name == BASELINE]


# --- one generation ------------------------------------------------------------------------


@dataclass
class Sample:
    """One timed generation."""

    config: str
    category: str
    prompt: int                # index into the run's prompt list
    token_ids: list[int]
    seconds: float
    stats: SpecStats | None    # None for HF configurations


def cut_at_eos(token_ids: list[int], eos_token_ids: set[int]) -> list[int]:
    """Up to and including the first EOS, as the engine emits (it counts the EOS token too)."""
    for i, tok in enumerate(token_ids):
        if tok in eos_token_ids:
            return token_ids[: i + 1]
    return token_ids


def hf_generate(engine: SpecEngine, config: RowConfig, prompt_ids: list[int], max_tokens: int) -> tuple[list[int], None]:
    eos = sorted(engine.loaded.eos_token_ids)
    model = engine.loaded.model
    input_ids = torch.tensor([prompt_ids], dtype=torch.long, device=model.device)
    kwargs = {}
    if config.prompt_lookup_tokens is not None:
        kwargs["prompt_lookup_num_tokens"] = config.prompt_lookup_tokens
    with torch.inference_mode():
        out = model.generate(
            input_ids,
            attention_mask=torch.ones_like(input_ids),
            max_new_tokens=max_tokens,
            do_sample=False,
            eos_token_id=eos or None,
            pad_token_id=eos[0] if eos else None,
            **kwargs,
        )
    # Batch of one: generation stops at EOS, so nothing pads the tail; cut anyway to be sure.
    return cut_at_eos(out[0, len(prompt_ids):].tolist(), set(eos)), None


def spec_generate(engine: SpecEngine, config: RowConfig, prompt_ids: list[int], max_tokens: int) -> tuple[list[int], SpecStats]:
    # Sessions keep their longest common prefix with the next request, so the previous
    # configuration's run on this same prompt would spare this one the prefill. Start cold,
    # like HF generate does.
    engine.reset_caches()
    request = GenerateRequest(prompt="", max_tokens=max_tokens, draft=config.draft, window=config.window,
                              tree=config.tree)
    gen = engine.generate_ids(prompt_ids, request)
    return gen.token_ids, gen.stats


def generate_once(engine: SpecEngine, config: RowConfig, prompt_ids: list[int], max_tokens: int) -> tuple[list[int], SpecStats | None, float]:
    run = hf_generate if config.backend == "hf" else spec_generate
    start = time.perf_counter()
    token_ids, stats = run(engine, config, prompt_ids, max_tokens)
    return token_ids, stats, time.perf_counter() - start


# --- the run -------------------------------------------------------------------------------


def measure(
    engine: SpecEngine,
    configs: list[RowConfig],
    prompts: list[tuple[str, list[int]]],
    max_tokens: int,
) -> list[Sample]:
    """Warm every configuration up once, then time each (prompt, config), rotating the order."""
    from tqdm import tqdm

    for config in configs:
        generate_once(engine, config, prompts[0][1], min(max_tokens, WARMUP_TOKENS))
    samples: list[Sample] = []
    with tqdm(total=len(prompts) * len(configs), desc="bench engine", unit="gen") as bar:
        for i, (category, prompt_ids) in enumerate(prompts):
            for config in in_turn(configs, i):
                bar.set_postfix_str(f"{category} {config.name}")
                token_ids, stats, seconds = generate_once(engine, config, prompt_ids, max_tokens)
                samples.append(Sample(config.name, category, i, token_ids, seconds, stats))
                bar.update()
    return samples


def aggregate(samples: list[Sample], configs: list[RowConfig], categories: Sequence[str]) -> list[dict]:
    """One row per (config, category) and per config over all categories."""
    reference = {s.prompt: s.token_ids for s in samples if s.config == BASELINE}
    rows = []
    for category in [*categories, ALL]:
        group = [s for s in samples if category == ALL or s.category == category]
        baseline_tps = _tokens_per_s([s for s in group if s.config == BASELINE])
        for config in configs:
            mine = [s for s in group if s.config == config.name]
            tps = _tokens_per_s(mine)
            stats = [s.stats for s in mine if s.stats is not None]
            steps = sum(st.steps for st in stats)
            accepted = sum(st.accepted for st in stats)
            decided = accepted + sum(st.rejections for st in stats)
            rows.append({
                "config": config.name,
                "category": category,
                "tokens_per_s": round(tps, 3),
                "speedup_vs_ar": round(tps / baseline_tps, 4) if baseline_tps else None,
                "mean_accepted_len": round(sum(st.emitted for st in stats) / steps, 4) if steps else None,
                "acceptance_rate": round(accepted / decided, 4) if stats and decided else None,
                "tokens": sum(len(s.token_ids) for s in mine),
                "seconds": round(sum(s.seconds for s in mine), 4),
                "prompts": len(mine),
                "matches_target_only": sum(s.token_ids == reference.get(s.prompt) for s in mine),
            })
    return rows


def divergences(engine: SpecEngine, samples: list[Sample], prompts: list[tuple[str, list[int]]]) -> list[dict]:
    """Where a configuration's greedy output first leaves target-only's, and how close the
    target's top-2 logits were there (a near-tie explains a bfloat16 divergence: verifying k
    tokens at once rounds differently from decoding one at a time)."""
    reference = {s.prompt: s.token_ids for s in samples if s.config == BASELINE}
    model = engine.loaded.model
    found = []
    for s in samples:
        expected = reference.get(s.prompt)
        if expected is None or s.token_ids == expected:
            continue
        first = next((i for i, (a, b) in enumerate(zip(s.token_ids, expected)) if a != b),
                     min(len(s.token_ids), len(expected)))
        context = prompts[s.prompt][1] + expected[:first]
        with torch.inference_mode():
            logits = model(torch.tensor([context], device=model.device)).logits[0, -1].float()
        top2 = logits.topk(2).values
        found.append({"config": s.config, "category": s.category, "prompt": s.prompt,
                      "position": first, "top2_logit_gap": round(float(top2[0] - top2[1]), 6)})
    return found


def _tokens_per_s(samples: list[Sample]) -> float:
    seconds = sum(s.seconds for s in samples)
    return sum(len(s.token_ids) for s in samples) / seconds if seconds else 0.0


# --- reporting -----------------------------------------------------------------------------


def cpu_model() -> dict:
    """The CPU's model name and the instruction sets that decide bfloat16 speed: machines of one
    model name may or may not have them, and their speed differs with them, so every figure records
    them."""
    try:
        text = Path("/proc/cpuinfo").read_text()
    except OSError:
        return {"cpu_model": platform.processor() or platform.machine()}
    name = next((line.split(":", 1)[1].strip() for line in text.splitlines() if line.startswith("model name")), "")
    flags = next((line.split(":", 1)[1].split() for line in text.splitlines() if line.startswith("flags")), [])
    return {"cpu_model": name, "cpu_bf16": [f for f in ("avx512_bf16", "amx_bf16", "avx512f") if f in flags]}


def machine_info() -> dict:
    import transformers

    return {
        **cpu_model(),
        "cpu_count": os.cpu_count(),
        "torch_threads": torch.get_num_threads(),
        "torch": torch.__version__,
        "transformers": transformers.__version__,
        "python": platform.python_version(),
        "processor": platform.processor() or platform.machine(),
        # Other work on a shared machine shows here; the ratios survive it, absolutes do not.
        "load_avg_1m": round(os.getloadavg()[0], 2),
    }


def format_table(rows: list[dict]) -> str:
    header = f"{'config':18s} {'category':10s} {'tok/s':>8s} {'vs AR':>7s} {'τ':>6s} {'α':>6s} {'same':>7s} {'tokens':>7s} {'s':>8s}"
    lines = [header, "-" * len(header)]
    previous = None
    for r in rows:
        if previous is not None and r["category"] != previous:
            lines.append("")
        previous = r["category"]
        tau = f"{r['mean_accepted_len']:.2f}" if r["mean_accepted_len"] is not None else "-"
        alpha = f"{r['acceptance_rate']:.2f}" if r["acceptance_rate"] is not None else "-"
        speedup = f"{r['speedup_vs_ar']:.2f}x" if r["speedup_vs_ar"] is not None else "-"
        lines.append(
            f"{r['config']:18s} {r['category']:10s} {r['tokens_per_s']:8.2f} {speedup:>7s} {tau:>6s} "
            f"{alpha:>6s} {r['matches_target_only']:>3d}/{r['prompts']:<3d} {r['tokens']:7d} {r['seconds']:8.2f}"
        )
    return "\n".join(lines)


def plot(rows: list[dict], configs: list[RowConfig], categories: Sequence[str], meta: dict, path: Path) -> None:
    """Grouped bars: tokens/s by category, one bar per configuration, speedup over each bar."""
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    groups = [*categories, ALL]
    by_key = {(r["config"], r["category"]): r for r in rows}
    width = 0.8 / len(configs)
    fig, ax = plt.subplots(figsize=(max(8.0, 1.9 * len(groups)), 4.8))
    top = max((r["tokens_per_s"] for r in rows), default=1.0)
    for j, config in enumerate(configs):
        xs = [g + (j - (len(configs) - 1) / 2) * width for g in range(len(groups))]
        values = [by_key[(config.name, cat)]["tokens_per_s"] for cat in groups]
        bars = ax.bar(xs, values, width, label=config.name, color=plt.cm.tab20(j % 20))
        for bar, cat in zip(bars, groups):
            speedup = by_key[(config.name, cat)]["speedup_vs_ar"]
            if speedup is not None:
                ax.text(bar.get_x() + bar.get_width() / 2, bar.get_height() + 0.01 * top, f"{speedup:.2f}x",
                        ha="center", va="bottom", rotation=90, fontsize=7)
    ax.set_xticks(range(len(groups)), groups)
    ax.set_ylim(0, top * 1.25)
    ax.set_ylabel("tokens / s (one stream)")
    machine = meta["machine"]
    ax.set_title(
        f"{meta['target']} {meta['dtype']}, greedy, {meta['max_tokens']} new tokens, "
        f"{meta['prompts_per_category']} prompts/category; {machine['cpu_count']} CPUs, "
        f"{machine['torch_threads']} threads, load {machine['load_avg_1m']}\nlabels: speedup vs {BASELINE}",
        fontsize=9,
    )
    ax.legend(fontsize=8, ncols=3, loc="upper left")
    ax.grid(axis="y", alpha=0.3)
    fig.tight_layout()
    path.parent.mkdir(parents=True, exist_ok=True)
    fig.savefig(path, dpi=120)
    plt.close(fig)


@dataclass(frozen=True, kw_only=True)
class EngineBenchConfig:
    """What one run measures and where it writes (``specserve bench engine``'s options, with its
    defaults). Checked when made, before any model loads, so that a mistake costs no waiting."""

    json_path: Path = Path("bench-engine.json")   # rows, divergences and the machine they ran on
    plot_path: Path = Path("bench-engine.png")    # tokens/s by category, the speedup over each bar
    prompts_per_category: int = 4     # per category, every configuration on each: 16 prompts in all
    max_tokens: int = 128             # new tokens per prompt: many steps per prefill, so rows differ by their steps
    dtype: str = "auto"               # bfloat16 where the CPU has it natively, else float32; every row the same
    configs: tuple[str, ...] | None = None   # row names to run (target-only always runs); None: every row

    def __post_init__(self) -> None:
        if self.prompts_per_category < 1:
            raise ValueError(f"--prompts must be >= 1, got {self.prompts_per_category}")
        if self.max_tokens < 1:
            raise ValueError(f"--max-tokens must be >= 1, got {self.max_tokens}")


def run_engine_bench(config: EngineBenchConfig) -> list[dict]:
    """Run every configuration on the same prompts; write JSON and plot, print a table."""
    # Check the names and load the prompts before the model, so a mistake costs no waiting.
    chosen = select_configs(config.configs)
    texts = [(cat, text) for cat in CATEGORIES for text in load_prompts(cat, config.prompts_per_category)]

    machine_before = machine_info()
    drafts = sorted({c.draft for c in chosen
                     if c.backend == "specserve" and (zoo_dir() / quantized_name(c.draft)[0]).exists()})
    engine = SpecEngine.load(dtype=config.dtype, draft_models=drafts)
    prompts = [(cat, engine.encode(text, chat=True)) for cat, text in texts]
    samples = measure(engine, chosen, prompts, config.max_tokens)
    rows = aggregate(samples, chosen, CATEGORIES)
    diverged = divergences(engine, samples, prompts)

    meta = {
        "target": engine.loaded.name,
        "dtype": str(engine.loaded.model.dtype).removeprefix("torch."),
        "dtype_requested": config.dtype,
        "max_tokens": config.max_tokens,
        "prompts_per_category": config.prompts_per_category,
        "prompt_tokens": {cat: [len(ids) for c, ids in prompts if c == cat] for cat in CATEGORIES},
        "configs": [c.name for c in chosen],
        "hf_prompt_lookup_num_tokens": HF_PROMPT_LOOKUP_TOKENS,
        "machine": machine_before,
        "load_avg_1m_after": machine_info()["load_avg_1m"],
    }
    json_path, plot_path = config.json_path, config.plot_path
    json_path.parent.mkdir(parents=True, exist_ok=True)
    json_path.write_text(json.dumps({"meta": meta, "rows": rows, "divergences": diverged}, indent=2) + "\n")
    plot(rows, chosen, CATEGORIES, meta, plot_path)
    print(format_table(rows))
    if diverged:
        gaps = sorted(d["top2_logit_gap"] for d in diverged)
        print(f"\n{len(diverged)} generations left target-only's greedy output; target top-2 logit gap "
              f"at the first divergent token: median {gaps[len(gaps) // 2]:.4f}, max {gaps[-1]:.4f}")
    print(f"\nwrote {json_path} and {plot_path}")
    return rows
