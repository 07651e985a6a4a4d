"""Where one step's time goes: a model draft on the target's thread, on a thread of its own, and
drafting ahead there, at several loads, side by side in one run.

In-process (the engine's scheduler and step loop, as a target replica runs them), the reference
target, greedy, a model draft pinned at one window. Rows:

- ``target-only``: plain decoding, the baseline;
- ``shared``: the draft on the target's model thread (``placement: inside``): drafting and
  verifying take turns;
- ``apart``: the draft on a one-thread model worker of its own, drafting ahead off: its time is
  still waited for, on another core (the thread hand-off's cost shows here);
- ``ahead``: the same, drafting ahead on (``StepLoop``, docs/design.md §9).

At each load (requests in the batch at once, the next entering as one finishes) every row runs
the same prompts, the rows taking turns round by round. Per row: output tokens/s over the run,
and per step the mean ms spent waiting for proposals, in the verify forward, in prefill and
elsewhere (planning, streaming, the loop), from the scheduler's own step records; for ``ahead``
also what became of the chains drafted ahead. JSON and a stacked-bar plot.
"""

from __future__ import annotations

import asyncio
import json
import time
from dataclasses import dataclass
from pathlib import Path

from specserve.bench.engine import machine_info
from specserve.data.prompts import CATEGORIES, load_prompts
from specserve.replicas.engine import SpecEngine, in_process_server
from specserve.replicas.model_worker import InlineWorker
from specserve.replicas.request import NO_DRAFT, SpecRequest, StaticPolicy
from specserve.replicas.sampling import SamplingParams
from specserve.replicas.scheduler import Scheduler
from specserve.replicas.step import StepRecord
from specserve.replicas.step_loop import StepLoop

ROWS = ("target-only", "shared", "apart", "ahead")
PARTS = ("draft_ms", "verify_ms", "prefill_ms", "other_ms")


@dataclass(frozen=True, kw_only=True)
class StepsBenchConfig:
    json_path: Path = Path("bench-steps.json")
    plot_path: Path = Path("bench-steps.png")
    draft: str = "smollm2-draft-2l"   # a zoo draft LM (drafting ahead needs no target states)
    window: int = 4
    loads: tuple[int, ...] = (1, 4)
    prompts: int = 8                  # per load, the categories in turn
    max_tokens: int = 64
    rounds: int = 2
    dtype: str = "auto"

    def __post_init__(self) -> None:
        if self.window < 1 or self.prompts < 1 or self.max_tokens < 1 or self.rounds < 1:
            raise ValueError("--window, --prompts, --max-tokens and --rounds must be >= 1")
        if not self.loads or min(self.loads) < 1:
            raise ValueError(f"--loads must be positive integers, got {self.loads}")


def run_row(engine: SpecEngine, row: str, config: StepsBenchConfig, prompts: list[list[int]], load: int) -> dict:
    """One row at one load: every prompt through one scheduler, ``load`` at a time, cold caches."""
    engine.reset_caches()
    draft = engine.drafts[config.draft]
    server = (in_process_server(config.draft, draft, apart=row in ("apart", "ahead")) if row != "target-only"
              else None)
    records: list[StepRecord] = []
    scheduler = Scheduler(engine.target, StaticPolicy(), engine.loaded.eos_token_ids, max_running=load,
                          observers=[records.append])
    loop = StepLoop(scheduler, {} if server is None else {config.draft: server}, InlineWorker(),
                    draft_ahead=row == "ahead")
    name = NO_DRAFT if server is None else config.draft
    states = [loop.add(SpecRequest(ids, config.max_tokens, SamplingParams(), name, config.window, None, f"{row}-{i}"))
              for i, ids in enumerate(prompts)]
    start = time.perf_counter()
    asyncio.run(loop.run_until_idle())
    seconds = time.perf_counter() - start
    if server is not None and row != "shared":
        server.worker.close()
    tokens = sum(len(s.out) for s in states)
    n = max(1, len(records))
    parts = {"draft_ms": sum(r.draft_ms for r in records) / n, "verify_ms": sum(r.verify_ms for r in records) / n,
             "prefill_ms": sum(r.prefill_ms for r in records) / n}
    parts["other_ms"] = max(0.0, 1e3 * seconds / n - sum(parts.values()))
    out = {"row": row, "load": load, "tokens": tokens, "seconds": seconds, "steps": len(records),
           "tokens_per_s": tokens / seconds, "ms_per_step": {k: round(v, 3) for k, v in parts.items()},
           "late": sum(loop.late.values()), "outputs": [s.out for s in states]}
    if row == "ahead":
        out["ahead"] = loop.ahead.to_dict()
    return out


def merge(runs: list[dict]) -> dict:
    """One row at one load over its rounds: tokens/s over all of them, step parts averaged."""
    tokens, seconds = sum(r["tokens"] for r in runs), sum(r["seconds"] for r in runs)
    merged = {"row": runs[0]["row"], "load": runs[0]["load"], "tokens": tokens, "seconds": round(seconds, 3),
              "tokens_per_s": round(tokens / seconds, 3), "tokens_per_s_by_round": [round(r["tokens_per_s"], 3) for r in runs],
              "steps": sum(r["steps"] for r in runs), "late": sum(r["late"] for r in runs),
              "ms_per_step": {p: round(sum(r["ms_per_step"][p] for r in runs) / len(runs), 3) for p in PARTS}}
    if "ahead" in runs[0]:
        merged["ahead"] = {k: sum(r["ahead"][k] for r in runs) for k in runs[0]["ahead"]}
    return merged


def run_steps_bench(config: StepsBenchConfig) -> list[dict]:
    from tqdm import tqdm

    texts = [load_prompts(CATEGORIES[i % len(CATEGORIES)], 1, offset=i // len(CATEGORIES))[0] for i in range(config.prompts)]
    machine = machine_info()
    engine = SpecEngine.load(dtype=config.dtype, draft_models=[config.draft])
    if config.draft not in engine.drafts:
        raise ValueError(f"{config.draft!r} is not a draft LM of the zoo")
    prompts = [engine.encode(text, chat=True) for text in texts]
    rows, outputs = [], {}
    with tqdm(total=len(config.loads) * config.rounds * len(ROWS), desc="bench steps", unit="run") as bar:
        for load in config.loads:
            runs: dict[str, list[dict]] = {row: [] for row in ROWS}
            for r in range(config.rounds):
                order = ROWS[r % len(ROWS):] + ROWS[:r % len(ROWS)]
                for row in order:
                    bar.set_postfix_str(f"load {load} {row}")
                    result = run_row(engine, row, config, prompts, load)
                    outputs.setdefault((load, row), result.pop("outputs"))
                    runs[row].append(result)
                    bar.update()
            base = merge(runs["target-only"])["tokens_per_s"]
            for row in ROWS:
                merged = merge(runs[row])
                merged["vs_target_only"] = round(merged["tokens_per_s"] / base, 4)
                merged["same_as_target_only"] = sum(a == b for a, b in zip(outputs[(load, row)], outputs[(load, "target-only")]))
                rows.append(merged)
    meta = {"target": engine.loaded.name, "draft": config.draft, "window": config.window,
            "dtype": str(engine.loaded.model.dtype).removeprefix("torch."), "prompts": config.prompts,
            "max_tokens": config.max_tokens, "rounds": config.rounds, "loads": list(config.loads),
            "machine": machine, "load_avg_1m_after": machine_info()["load_avg_1m"]}
    config.json_path.parent.mkdir(parents=True, exist_ok=True)
    config.json_path.write_text(json.dumps({"meta": meta, "rows": rows}, indent=2) + "\n")
    plot(rows, meta, config.plot_path)
    for r in rows:
        parts = " ".join(f"{p.removesuffix('_ms')} {r['ms_per_step'][p]:.1f}" for p in PARTS)
        extra = f" ahead {r['ahead']}" if "ahead" in r else ""
        print(f"load {r['load']:3d} {r['row']:12s} {r['tokens_per_s']:8.2f} tok/s {r['vs_target_only']:.3f}x "
              f"same {r['same_as_target_only']}/{config.prompts}  ms/step: {parts}  late {r['late']}{extra}")
    print(f"wrote {config.json_path} and {config.plot_path}")
    return rows


def plot(rows: list[dict], meta: dict, path: Path) -> None:
    """Stacked bars of one step's ms by part, per load and row; tokens/s above each bar."""
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    loads = meta["loads"]
    fig, axes = plt.subplots(1, len(loads), figsize=(4.2 * len(loads), 4.4), squeeze=False)
    colours = {"draft_ms": "tab:orange", "verify_ms": "tab:blue", "prefill_ms": "tab:green", "other_ms": "tab:gray"}
    for ax, load in zip(axes[0], loads):
        mine = [r for r in rows if r["load"] == load]
        bottoms = [0.0] * len(mine)
        for part in PARTS:
            values = [r["ms_per_step"][part] for r in mine]
            ax.bar(range(len(mine)), values, bottom=bottoms, color=colours[part], label=part.removesuffix("_ms"))
            bottoms = [b + v for b, v in zip(bottoms, values)]
        for i, r in enumerate(mine):
            ax.text(i, bottoms[i] * 1.01, f"{r['tokens_per_s']:.1f} tok/s\n{r['vs_target_only']:.2f}x",
                    ha="center", va="bottom", fontsize=7)
        ax.set_xticks(range(len(mine)), [r["row"] for r in mine], fontsize=8)
        ax.set_title(f"{load} at once", fontsize=9)
        ax.set_ylim(0, max(bottoms) * 1.25)
        ax.grid(axis="y", alpha=0.3)
    axes[0][0].set_ylabel("ms per step")
    axes[0][0].legend(fontsize=7, loc="upper left")
    machine = meta["machine"]
    fig.suptitle(f"{meta['target']} {meta['dtype']}, draft {meta['draft']} γ={meta['window']}, greedy, "
                 f"{meta['max_tokens']} tokens; {machine['cpu_model']} ({machine['cpu_count']} CPUs)", fontsize=9)
    fig.tight_layout()
    path.parent.mkdir(parents=True, exist_ok=True)
    fig.savefig(path, dpi=120)
    plt.close(fig)
