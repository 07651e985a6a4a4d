"""Image generation with speculative decoding: ADT-Tree where it was made for, side by side.

In-process (``replicas/image_engine.py``): the reference image generator, its distilled draft,
classifier-free guidance at the generator's scale, pictures of classes half on smooth backgrounds
and half on busy ones, at temperature 0 and 1 (the ADT-Tree paper's two settings). Rows, all over
the same pictures, their steps taking turns (``run_side_by_side``):

- ``target-only``: guided decoding one token per step, the baseline;
- ``chain``: the draft at a fixed window; ``static-tree``: a fixed tree (EAGLE-2's N nodes);
- ``adt-tree`` (Horizontal Repeat), ``adt-tree-vertical``, ``adt-tree-random``: ADT-Tree's three
  initialisations, then its bisectional adaptation; ``eagle2-depth`` and ``sage``: the other tree
  rules, all starting from the static tree;
- ``lantern`` and ``adt-tree-lantern``: EAGLE-2's and ADT-Tree's trees under LANTERN's relaxed
  acceptance (``replicas/lantern.py``; lossy, the paper's LANTERN rows), δ and k as configured.

Pictures are decoded ``at_once`` at a time (default 1: the paper measures one picture's latency),
after one untimed picture per row.
Per row and temperature: tokens/s, the speedup over target-only, τ (tokens per step), τ on smooth
and on busy backgrounds, and at temperature 0 the pictures whose tokens equal target-only's (every
exact row's must), the share of tokens that do, and the mean pixel difference from target-only's
pictures (0-255: what relaxed acceptance costs a picture). τ by grid position: each step's tokens counted at the position its first token fills,
averaged over pictures: the paper's observation (smooth regions τ > 3, textured τ ≤ 2) measured
here. JSON and a plot: the τ maps and the speedups.
"""

from __future__ import annotations

import json
from dataclasses import dataclass
from pathlib import Path

import numpy as np

from specserve.bench.engine import machine_info
from specserve.data.scenes import BACKGROUNDS, SMOOTH_BACKGROUNDS, class_label, label_parts
from specserve.data.synthetic_images import COLOURS, SHAPES
from specserve.policies.registry import build_policy
from specserve.replicas.engine import in_process_server, run_side_by_side
from specserve.replicas.image_engine import GENERATOR_DRAFT, ImageEngine
from specserve.replicas.lantern import DEFAULT_DELTA, Lantern, default_k
from specserve.replicas.request import NO_DRAFT
from specserve.replicas.step import TreeShape

BASELINE = "target-only"
# Rows: (draft used, policy name or None for pinned, window, tree).
TREE_POLICIES = ("adt-tree", "adt-tree-vertical", "adt-tree-random", "eagle2-depth", "sage")
# Relaxed rows: the tree rule each runs under LANTERN's acceptance.
RELAXED = {"lantern": "eagle2-depth", "adt-tree-lantern": "adt-tree"}
ROWS = (BASELINE, "chain", "static-tree", *TREE_POLICIES, *RELAXED)


@dataclass(frozen=True, kw_only=True)
class ImagegenBenchConfig:
    json_path: Path = Path("bench-imagegen.json")
    plot_path: Path = Path("bench-imagegen.png")
    pictures: int = 8                  # half on smooth backgrounds, half on busy ones
    at_once: int = 1                   # pictures decoded together; 1: one at a time, the paper's latency setting
    temperatures: tuple[float, ...] = (0.0, 1.0)
    window: int = 4                    # the chain row's
    tree: TreeShape = TreeShape(4, 4, 16)   # the static row's, and where the tree rules start
    rows: tuple[str, ...] = ROWS
    generator: Path | None = None      # default: the reference generator
    draft: Path | None = None          # default: its zoo draft
    device: str | None = None          # default: the CPU
    seed: int = 0
    lantern_delta: float = DEFAULT_DELTA
    lantern_k: int | None = None       # default: an eighth of the codebook (``lantern.default_k``)

    def __post_init__(self) -> None:
        if self.pictures < 2:
            raise ValueError(f"--pictures must be >= 2 (smooth and busy), got {self.pictures}")
        if self.at_once < 1:
            raise ValueError(f"--at-once must be >= 1, got {self.at_once}")
        unknown = set(self.rows) - set(ROWS)
        if unknown:
            raise ValueError(f"unknown row(s) {', '.join(sorted(unknown))}; choose from {', '.join(ROWS)}")
        if any(t < 0 for t in self.temperatures):
            raise ValueError("temperatures must be >= 0")
        Lantern(self.lantern_delta, self.lantern_k or 1)   # checks δ and k


def picture_labels(n: int) -> list[int]:
    """n classes, shapes and colours in turn, smooth and busy backgrounds alternating."""
    busy = [b for b in BACKGROUNDS if b not in SMOOTH_BACKGROUNDS]
    colours = list(COLOURS)
    return [class_label(SHAPES[i % len(SHAPES)], colours[(i // 2) % len(colours)],
                        (SMOOTH_BACKGROUNDS if i % 2 == 0 else busy)[(i // 2) % 2]) for i in range(n)]


def _requests(engine: ImageEngine, row: str, labels: list[int], temperature: float, config: ImagegenBenchConfig):
    drafted = row != BASELINE and engine.drafts
    kwargs = dict(draft=GENERATOR_DRAFT if drafted else NO_DRAFT, temperature=temperature)
    if row in RELAXED:
        kwargs.update(lantern=Lantern(config.lantern_delta, config.lantern_k or default_k(engine.settings.codebook_size)))
    if drafted and row == "chain":
        kwargs.update(window=config.window)
    elif drafted:
        kwargs.update(tree=config.tree, pinned=row == "static-tree")
    return [engine.request(label, f"{row}-{i}", seed=config.seed + i, **kwargs) for i, label in enumerate(labels)]


def run_imagegen_bench(config: ImagegenBenchConfig, progress: bool = True) -> dict:
    from tqdm import tqdm

    engine = ImageEngine(config.generator, config.draft, device=config.device)
    if not engine.drafts:
        raise FileNotFoundError("the generator has no draft: train one (`specserve zoo imagegen-draft`) or give --draft")
    labels = picture_labels(config.pictures)
    smooth = [label_parts(label)[2] in SMOOTH_BACKGROUNDS for label in labels]
    grid = engine.settings.grid
    servers = {name: in_process_server(name, draft) for name, draft in engine.drafts.items()}
    rows_out, maps = [], {}
    # A picture's tokens, every row and temperature: what the bar counts as the rows verify them.
    bar = tqdm(total=len(config.temperatures) * len(config.rows) * len(labels) * grid * grid, unit="tok",
               desc="bench imagegen", disable=not progress)
    for temperature in config.temperatures:
        # One untimed picture per row first: a row's first steps pay one-time costs (buffers,
        # kernels' first calls) that would weigh on a short run.
        def runs_of(pictures: list[int]) -> list[tuple]:   # each row's requests, with a fresh policy of its own
            return [(_requests(engine, row, pictures, temperature, config),
                     None if row in (BASELINE, "chain", "static-tree") else build_policy(RELAXED.get(row, row)))
                    for row in config.rows]

        run_side_by_side([engine.target(slots=2) for _ in config.rows], servers, runs_of(labels[:1]),
                         max_running=2)
        runs = runs_of(labels)
        steps: list[list[list[int]]] = [[[] for _ in labels] for _ in config.rows]   # run -> picture -> tokens per step

        def record(run: int, i: int, tokens: list[int]) -> None:
            if tokens:
                steps[run][i].append(len(tokens))
                bar.update(len(tokens))

        at_once = min(config.at_once, len(labels))
        targets = [engine.target(slots=2 * at_once) for _ in config.rows]   # two rows a picture (guidance)
        results = run_side_by_side(targets, servers, runs, max_running=2 * at_once, on_tokens=record)
        baseline = config.rows.index(BASELINE) if BASELINE in config.rows else None
        base_speed = None
        for r, (row, (gens, seconds)) in enumerate(zip(config.rows, results)):
            tokens = sum(len(g.token_ids) for g in gens)
            taus = [np.mean(s) for s in steps[r]]
            tau_map = np.zeros(grid * grid)
            counts = np.zeros(grid * grid)
            for per_picture in steps[r]:
                position = 0
                for n in per_picture:
                    tau_map[position] += n
                    counts[position] += 1
                    position += n
            tau_map = np.divide(tau_map, counts, out=np.full_like(tau_map, np.nan), where=counts > 0)
            maps[f"{row}@T={temperature:g}"] = tau_map.reshape(grid, grid).round(3).tolist()
            speed = tokens / seconds
            if r == baseline:
                base_speed = speed
            out = {
                "row": row, "temperature": temperature, "tokens_per_s": round(speed, 2), "seconds": round(seconds, 3),
                "mean_accepted_len": round(float(np.mean(taus)), 3),
                "tau_smooth": round(float(np.mean([t for t, s in zip(taus, smooth) if s])), 3),
                "tau_busy": round(float(np.mean([t for t, s in zip(taus, smooth) if not s])), 3),
                "trees": [g.stats.summary().get("trees") for g in gens][:1],
            }
            if temperature == 0 and baseline is not None:
                out.update(_against(engine, gens, results[baseline][0]))
            rows_out.append(out)
        for out in rows_out:
            if out["temperature"] == temperature and base_speed:
                out["speedup"] = round(out["tokens_per_s"] / base_speed, 3)
    report = {"meta": {"pictures": config.pictures, "at_once": min(config.at_once, len(labels)), "labels": labels,
                       "grid": grid,
                       "cfg_scale": engine.settings.cfg_scale, "top_k": engine.settings.top_k,
                       "window": config.window, "device": str(engine.model.device),
                       "tree": [config.tree.depth, config.tree.top_k, config.tree.budget],
                       "lantern": {"delta": config.lantern_delta,
                                   "k": config.lantern_k or default_k(engine.settings.codebook_size)},
                       "machine": machine_info()},
              "rows": rows_out, "tau_maps": maps}
    bar.close()
    config.json_path.write_text(json.dumps(report, indent=1))
    plot(report, config.plot_path)
    return report


def _against(engine: ImageEngine, gens: list, reference: list) -> dict:
    """How a row's greedy pictures compare with target-only's: pictures equal token for token,
    the share of equal tokens, and the mean absolute pixel difference (0-255) of the decoded
    pictures."""
    equal = sum(g.token_ids == ref.token_ids for g, ref in zip(gens, reference))
    same = np.mean([np.mean(np.array(g.token_ids) == np.array(ref.token_ids)) for g, ref in zip(gens, reference)])
    ours, theirs = engine.pictures(gens), engine.pictures(reference)
    pixels = np.mean([np.abs(np.asarray(a, dtype=float) - np.asarray(b, dtype=float)).mean()
                      for a, b in zip(ours, theirs)])
    return {"matches_target_only": equal, "token_agreement": round(float(same), 4), "pixel_error": round(float(pixels), 3)}


def plot(report: dict, path: Path) -> None:
    """τ by grid position per drafted row, a line of maps per temperature, and the speedups."""
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    temperatures = sorted({r["temperature"] for r in report["rows"]})
    drafted = [r for r in dict.fromkeys(r["row"] for r in report["rows"]) if r != BASELINE]
    fig, axes = plt.subplots(len(temperatures), len(drafted) + 1, figsize=(2.6 * (len(drafted) + 1), 2.8 * len(temperatures)),
                             squeeze=False)
    for line, temperature in zip(axes, temperatures):
        for ax, row in zip(line, drafted):
            tau = np.array(report["tau_maps"][f"{row}@T={temperature:g}"], dtype=float)
            image = ax.imshow(tau, vmin=1, cmap="viridis")
            ax.set_title(f"{row}, T={temperature:g}", fontsize=7)
            ax.axis("off")
            fig.colorbar(image, ax=ax, fraction=0.046)
        ax = line[-1]
        rows = [r for r in report["rows"] if r["temperature"] == temperature]
        ax.bar([r["row"] for r in rows], [r.get("speedup", 0) for r in rows])
        ax.axhline(1.0, color="grey", lw=0.5)
        ax.set_title(f"speedup over target-only, T={temperature:g}", fontsize=7)
        ax.tick_params(axis="x", rotation=70, labelsize=6)
    fig.suptitle("τ (tokens per step) by the grid position a step starts at (blank: no step started there)", fontsize=9)
    fig.tight_layout()
    fig.savefig(path, dpi=100)
    plt.close(fig)
