"""``specserve bench multimodal``: TABED's drafting views of a VLM request, side by side.

The reference VLM (``smollm2-vlm``) answers held-out synthetic pictures of every category; each
row drafts with a view of one draft LM (the zoo's ``smollm2-vlm-draft`` by default: the target's
first layers retrained on the VLM's own answers while reading their pictures' image rows; any
draft LM as wide as the target reads them): ``multimodal`` (the pictures' image tokens),
``text-only`` (the placeholder instead), ``pooled`` (each picture averaged to four tokens),
``caption`` (below), ``ensemble`` (the views mixed, weights chosen every block from the verified
tokens, TABED Alg. 1) and ``ensemble-static`` (the equal mix), against ``target-only``. Every
picture runs every row in turn, ``--repeats`` times, the pictures in a seeded order that
interleaves the categories, each row from cold caches (what a draft learned across requests, an
ensemble's prior, is kept, as a replica keeps it); a row's tokens/s is its tokens over its own
seconds, its mean accepted length the emitted tokens per step.
``caption`` reads the picture as the caption the VLM writes of it. ``--captions cold`` (the
default): every row reading it has its picture captioned beside its answer (an internal request
of up to 24 tokens, timed with the row), as the first request showing a picture does, the view
reading the placeholder until then; ``warm``: every picture captioned before the rows (untimed),
as for a follow-up about a picture shown before.
The ``caption`` and ``describe`` categories ask for text about the whole picture; ``describe``'s
answers run to ~45 tokens, the others' to 2-12.

Aim (TABED's robustness claim): the ensemble at least 0.97x the best single view on every
category, and above it on the mix.

``--scenarios`` measures the same rows over conversations where different views should win
(TABED's setting), instead of categories: ``single`` (one picture question of a category, in
turn), ``follow-up`` (the picture, the question, the VLM's own answer, then "say it again in a
full sentence"), ``text-turn`` (the same first turn, then a text-only question from the chat
prompts), ``unseen`` (pictures unlike the training ones: inverted, rotated and noisy), ``clip``
(a synthetic clip's 2-8 frames shown as consecutive pictures, as a served clip is, and its
question: which shapes appear in order, or which way the shape moves; ``data/synthetic_clips.py``).

Sparrow's rows (``--frames``): prompts showing 1 to 64 pictures ("frames", 64 image tokens each)
and a question about the last (``--frame-category``; by default "describe", whose answers run to
~45 tokens, as Sparrow measures captions and descriptions), or a clip of that many frames and its
question (a clip category: ``sequence`` names every frame's shape), answered target-only and drafted by
the VLM's hidden-state-reuse head (``smollm2-vlm-hsr``) with full attention and with Sparrow's
text-anchored window (``HSRDraft(windowed=True)``), and by the head trained with IVSB
(``smollm2-vlm-sparrow``, windowed): tokens/s and the speedup over target-only end to end and while decoding, the draft's
milliseconds per drafted token (its catch-up on the prompt included), α and τ. Aims
(``frame_aims``): the windowed draft's speedup does not fall as frames grow, its cost stays flat,
and IVSB raises τ at the fewest frames.
"""

from __future__ import annotations

import json
import random
import time
from collections.abc import Callable
from dataclasses import dataclass
from pathlib import Path

from specserve.bench.engine import machine_info
from specserve.data.prompts import load_prompts
from specserve.data.synthetic_clips import CLIP_CATEGORIES, MIN_FRAMES, clip_example
from specserve.data.synthetic_images import CATEGORIES, TEST_SEED, example
from specserve.replicas.engine import GenerateRequest, SpecEngine

VIEWS = ("multimodal", "text-only", "pooled", "caption")
MIXES = ("ensemble", "ensemble-static")
ROWS = (*VIEWS, *MIXES, "target-only")


def rows_of(views: tuple[str, ...]) -> tuple[str, ...]:
    """The rows of a run comparing ``views``: each alone, both mixes of them, target-only."""
    return (*views, *MIXES, "target-only")
SEED_OFFSET = 500_000   # held-out pictures other than the model card's and the tests'
SCENARIOS = ("single", "follow-up", "text-turn", "unseen", "clip")
FOLLOW_UP = "Say that again, in one full sentence."


@dataclass(frozen=True, kw_only=True)
class MultimodalBenchConfig:
    json_path: Path = Path("bench-multimodal.json")
    plot_path: Path = Path("bench-multimodal.png")
    target: str = "smollm2-vlm"
    draft: str = "smollm2-vlm-draft"
    pictures: int = 6          # per category
    categories: tuple[str, ...] = CATEGORIES
    max_tokens: int = 48
    window: int = 3
    repeats: int = 2
    dtype: str = "bfloat16"
    frames: tuple[int, ...] = (1, 4, 16, 64)
    frame_prompts: int = 4
    frame_category: str = "describe"   # Sparrow's rows: a picture category (about the last picture) or a clip's
    head: str = "smollm2-vlm-hsr"            # Sparrow's rows: full and windowed attention of this head
    ivsb_head: str | None = "smollm2-vlm-sparrow"   # and this one, trained with IVSB (windowed)
    captions: str = "cold"
    views: tuple[str, ...] = VIEWS   # the views compared, and mixed by the ensembles
    scenarios: tuple[str, ...] = ()  # conversations instead of categories (``SCENARIOS``); none: categories

    def __post_init__(self) -> None:
        unknown = sorted(set(self.categories) - set(CATEGORIES))
        if unknown:
            raise ValueError(f"unknown categories {unknown}; known: {', '.join(CATEGORIES)}")
        if min(self.max_tokens, self.window, self.repeats, self.frame_prompts) < 1 or self.pictures < 0:
            raise ValueError("--max-tokens, --window, --repeats and --frame-prompts must be at least 1, --pictures "
                             "at least 0")
        if self.pictures == 0 and not self.frames:
            raise ValueError("--pictures 0 runs Sparrow's rows alone: give --frames")
        if not self.views or not set(self.views) <= set(VIEWS) or len(set(self.views)) != len(self.views):
            raise ValueError(f"--views must name distinct views of {', '.join(VIEWS)}; got {list(self.views)}")
        if not set(self.scenarios) <= set(SCENARIOS):
            raise ValueError(f"unknown scenarios {sorted(set(self.scenarios) - set(SCENARIOS))}; known: {', '.join(SCENARIOS)}")
        if self.captions not in ("cold", "warm"):
            raise ValueError(f"--captions must be cold or warm; got {self.captions!r}")
        if self.frame_category not in CATEGORIES + CLIP_CATEGORIES:
            raise ValueError(f"unknown --frame-category {self.frame_category!r}; known: "
                             f"{', '.join(CATEGORIES + CLIP_CATEGORIES)}")
        if self.frame_category in CLIP_CATEGORIES and any(f < MIN_FRAMES for f in self.frames):
            raise ValueError(f"a clip's --frames are at least {MIN_FRAMES}; got {list(self.frames)}")
        if any(f < 1 for f in self.frames):
            raise ValueError(f"--frames are pictures per prompt, each at least 1; got {list(self.frames)}")


def row_ensembles(draft: str, views: tuple[str, ...]) -> dict[str, dict]:
    """The draft of each drafting row: each view of ``draft`` alone, and both mixes of them."""
    alone = {view: {"model": draft, "views": [view]} for view in views}
    return {**alone, "ensemble": {"model": draft, "views": list(views)},
            "ensemble-static": {"model": draft, "views": list(views), "weights": "static"}}


def run_multimodal_bench(config: MultimodalBenchConfig, engine: SpecEngine | None = None, progress: bool = True) -> dict:
    from tqdm import tqdm

    engine = engine or SpecEngine.load(config.target, dtype=config.dtype,
                                       ensembles=row_ensembles(config.draft, config.views),
                                       draft_models=[h for h in (config.head, config.ivsb_head) if h] if config.frames else [])
    if engine.images is None:
        raise ValueError(f"{config.target} reads text only: the multimodal benchmark needs a VLM target")
    if config.scenarios:
        work = scenario_work(config, lambda messages, images: engine.tokenizer.decode(engine.generate_ids(
            engine.encode_messages(messages, images),
            GenerateRequest("", max_tokens=config.max_tokens, draft="none", window=0)).token_ids,
            skip_special_tokens=True))
        groups = list(config.scenarios)
    else:
        work = [(c, *single_turn(example(TEST_SEED + SEED_OFFSET + 1000 * i + n, c)))
                for i, c in enumerate(config.categories) for n in range(config.pictures)]
        groups = list(config.categories)
    # Categories interleaved, as a replica's traffic is: what a draft learns across requests (an
    # ensemble's prior) is learned from the mix, not from the same question asked just before.
    random.Random(0).shuffle(work)
    rows_run = rows_of(config.views)
    totals = {(row, c): {"tokens": 0, "seconds": 0.0, "steps": 0} for row in rows_run for c in groups}
    machine = machine_info()
    if config.captions == "warm":
        write_captions(engine, [image for _, _, images in work for image in images])
    bar = tqdm(total=len(work) * len(rows_run) * config.repeats, desc="bench multimodal", disable=not progress)
    for _ in range(config.repeats):
        for category, messages, images in work:
            for row in rows_run:
                draft = "none" if row == "target-only" else row
                request = GenerateRequest("", max_tokens=config.max_tokens, draft=draft,
                                          window=0 if row == "target-only" else config.window)
                # Every row starts cold: no row reuses another's prefill (nor its captions, unless warm).
                engine.reset_caches(captions=config.captions == "cold")
                began = time.perf_counter()
                out = engine.generate_ids(engine.encode_messages(messages, images), request)
                cell = totals[(row, category)]
                cell["seconds"] += time.perf_counter() - began
                cell["tokens"] += len(out.token_ids)
                cell["steps"] += out.stats.steps
                bar.update()
    bar.close()
    rows = table(totals, rows_run, groups) if config.pictures else []
    frames = frame_rows(engine, config, progress) if config.frames else []
    result = {"config": {k: (str(v) if isinstance(v, Path) else v) for k, v in config.__dict__.items()},
              "machine": machine, "date": time.strftime("%Y-%m-%d"), "rows": rows, "aims": aims(rows),
              "frames": frames, "frame_aims": frame_aims(frames)}
    config.json_path.write_text(json.dumps(result, indent=2))
    plot(result, config.plot_path)
    print(format_table(result))
    return result


def table(totals: dict, rows_run: tuple[str, ...], groups: list[str]) -> list[dict]:
    """``{view, category, tokens_per_s, mean_accepted_len}`` per row and category (or scenario) of
    ``totals`` (``{(row, group): {tokens, seconds, steps}}``), and per row on the mix: every
    group's tokens over its seconds."""
    rows = []
    for (row, category), cell in totals.items():
        rows.append({"view": row, "category": category, "tokens_per_s": round(cell["tokens"] / cell["seconds"], 2),
                     "mean_accepted_len": round(cell["tokens"] / max(1, cell["steps"]), 3)})
    for row in rows_run:
        cells = [totals[(row, c)] for c in groups]
        tokens, seconds, steps = (sum(c[k] for c in cells) for k in ("tokens", "seconds", "steps"))
        rows.append({"view": row, "category": "mix", "tokens_per_s": round(tokens / seconds, 2),
                     "mean_accepted_len": round(tokens / max(1, steps), 3)})
    return rows


def single_turn(ex) -> tuple[list[dict], tuple]:
    """One user turn: the picture, then its question."""
    return [{"role": "user", "content": [{"type": "image"}, {"type": "text", "text": ex.question}]}], (ex.image,)


def unseen(image):
    """A picture unlike the training ones: colours inverted, turned a quarter, speckled."""
    import numpy as np
    from PIL import Image, ImageOps

    turned = ImageOps.invert(image.convert("RGB")).rotate(90, expand=True)
    pixels = np.asarray(turned).astype(np.int16)
    noise = np.random.default_rng(0).integers(-40, 41, pixels.shape)
    return Image.fromarray(np.clip(pixels + noise, 0, 255).astype(np.uint8))


def scenario_work(config: MultimodalBenchConfig, answer: Callable[[list[dict], tuple], str]
                  ) -> list[tuple[str, list[dict], tuple]]:
    """(scenario, messages, pictures) per conversation, ``config.pictures`` per scenario; a
    message's ``{"type": "image"}`` parts take the pictures in turn. The first turns' answers are
    the VLM's own (greedy: ``answer(messages, pictures)``), as a client's conversation would carry
    them."""
    chats = [t for t in load_prompts("chat", 4 * config.pictures) if len(t) < 300][:config.pictures]
    work = []
    for n in range(config.pictures):
        ex = example(TEST_SEED + SEED_OFFSET + 900_000 + n, config.categories[n % len(config.categories)])
        first, images = single_turn(ex)
        said = answer(first, images)
        earlier = [*first, {"role": "assistant", "content": said}]
        clip = clip_example(TEST_SEED + SEED_OFFSET + 950_000 + n, CLIP_CATEGORIES[n % len(CLIP_CATEGORIES)])
        odd = example(TEST_SEED + SEED_OFFSET + 980_000 + n, config.categories[n % len(config.categories)])
        conversations = {
            "single": (first, images),
            "follow-up": ([*earlier, {"role": "user", "content": FOLLOW_UP}], images),
            "text-turn": ([*earlier, {"role": "user", "content": chats[n % len(chats)]}], images),
            "unseen": (single_turn(odd)[0], (unseen(odd.image),)),
            "clip": ([{"role": "user", "content": [*({"type": "image"} for _ in clip.frames),
                                                    {"type": "text", "text": clip.question}]}], clip.frames),
        }
        work += [(scenario, *conversations[scenario]) for scenario in config.scenarios]
    return work


def write_captions(engine: SpecEngine, images: list) -> None:
    """Each picture's caption, as the caption view's internal request writes it (the VLM's greedy
    answer to the caption prompt), written now."""
    from specserve.replicas.captions import CAPTION_PROMPT, CAPTION_TOKENS

    captions = engine.images.captions
    for image in images:
        digest, = captions.digests(engine.images.register(image))
        out = engine.generate(GenerateRequest(CAPTION_PROMPT, max_tokens=CAPTION_TOKENS, draft="none", window=0,
                                              images=(image,)))
        captions.put(digest, out["text"])


def frame_rows(engine: SpecEngine, config: MultimodalBenchConfig, progress: bool = True) -> list[dict]:
    """Rows ``{draft_attention, frames, tokens_per_s, decode_tokens_per_s, speedup, decode_speedup,
    draft_ms_per_token, acceptance_rate, mean_accepted_len}`` on prompts of ``frames`` pictures:
    target-only, ``--head`` with full and with windowed attention, ``--ivsb-head`` (windowed: it
    was trained with IVSB). The rows take turns on every prompt, each from cold caches. Decode
    time is a request's time less its prompt's prefill chunks (``SpecStats.prefill_s``; every
    token comes from a verify step after them, the draft's catch-up on the prompt included):
    Sparrow's decoding speedup beside the end-to-end one."""
    from tqdm import tqdm

    from specserve.replicas.drafts.base import draft_model
    from specserve.replicas.drafts.hsr_draft import HSRDraft

    head = draft_model(engine.drafts[Path(config.head).name])
    names = {"target-only": "none", "full": Path(config.head).name, "windowed": f"{Path(config.head).name}-windowed"}
    engine.drafts[names["windowed"]] = HSRDraft(names["windowed"], head, windowed=True)
    if config.ivsb_head:
        names["windowed+ivsb"] = Path(config.ivsb_head).name
        if not engine.drafts[names["windowed+ivsb"]].windowed:
            raise ValueError(f"{config.ivsb_head} was not trained with IVSB (its config names no visual_anchor_layer)")
    engine.servers = engine._servers()
    warm = example(TEST_SEED + SEED_OFFSET + 899_999)
    for name in names.values():   # untimed: each draft's first call pays its warm-up
        engine.generate(GenerateRequest(warm.question, max_tokens=4, draft=name, window=config.window,
                                        images=(warm.image,)))
    rows = []
    bar = tqdm(total=len(config.frames) * config.frame_prompts * len(names), desc="bench multimodal frames",
               disable=not progress)
    for frames in config.frames:
        totals = {row: {"tokens": 0, "seconds": 0.0, "prefill": 0.0, "drafted": 0, "draft_s": 0.0, "accepted": 0,
                        "rejected": 0, "steps": 0} for row in names}
        for n in range(config.frame_prompts):
            question, shown = frame_prompt(config.frame_category, frames, n)
            ids = engine.encode(question, images=shown)
            for row, name in names.items():
                engine.reset_caches()
                began = time.perf_counter()
                out = engine.generate_ids(ids, GenerateRequest(question, max_tokens=config.max_tokens, draft=name,
                                                               window=0 if name == "none" else config.window))
                cell, stats = totals[row], out.stats
                cell["seconds"] += time.perf_counter() - began
                cell["prefill"] += stats.prefill_s
                cell["tokens"] += len(out.token_ids)
                cell["steps"] += stats.steps
                if name != "none":
                    cell["drafted"] += sum(stats.windows)
                    cell["draft_s"] += stats.draft_s
                    cell["accepted"] += stats.accepted
                    cell["rejected"] += stats.rejections
                bar.update()
        for row, cell in totals.items():
            rows.append(frame_row(row, frames, cell, totals["target-only"],
                                  cell["accepted"] / max(1, cell["accepted"] + cell["rejected"])))
    bar.close()
    return rows


def frame_row(row: str, frames: int, cell: dict, base: dict, acceptance_rate: float) -> dict:
    """One of Sparrow's rows from ``cell`` and target-only's ``base`` (each ``{tokens, seconds,
    prefill, steps, drafted, draft_s}`` summed over the prompts): decode time is the requests'
    time less their prefill."""
    tokens_per_s = cell["tokens"] / cell["seconds"]
    decode = cell["tokens"] / max(1e-9, cell["seconds"] - cell["prefill"])
    base_decode = base["tokens"] / max(1e-9, base["seconds"] - base["prefill"])
    return {"draft_attention": row, "frames": frames, "tokens_per_s": round(tokens_per_s, 2),
            "decode_tokens_per_s": round(decode, 2),
            "speedup": round(tokens_per_s / (base["tokens"] / base["seconds"]), 3),
            "decode_speedup": round(decode / base_decode, 3),
            # A row that drafts nothing has no cost per drafted token (a step's draft phase,
            # bookkeeping included, is shared by every request in it).
            "draft_ms_per_token": round(1e3 * cell["draft_s"] / cell["drafted"], 3) if cell["drafted"] else 0.0,
            "acceptance_rate": round(acceptance_rate, 3),
            "mean_accepted_len": round(cell["tokens"] / max(1, cell["steps"]), 3)}


def frame_prompt(category: str, frames: int, n: int) -> tuple[str, tuple]:
    """Prompt ``n`` of Sparrow's rows at ``frames`` pictures: a clip category's clip of that many
    frames and its question (its answer can need every frame), else as many held-out pictures and
    the category's question about the last one."""
    if category in CLIP_CATEGORIES:
        clip = clip_example(TEST_SEED + SEED_OFFSET + 960_000 + 1000 * n + frames, category, frames=frames)
        return clip.question, clip.frames
    pictures = [example(TEST_SEED + SEED_OFFSET + 900_000 + 100 * n + f, category) for f in range(frames)]
    return pictures[-1].question.replace("the picture", "the last picture"), tuple(p.image for p in pictures)


def frame_aims(rows: list[dict]) -> dict:
    """Sparrow's aims over the frame rows: the windowed draft's decoding speedup over target-only
    at the most frames at least 0.95x its speedup at the fewest (it does not fall as frames grow;
    0.95 leaves room for the timing's noise), with full attention's beside it; the windowed cost
    per drafted token at the most frames over the fewest (aim ≤ 1.3); and, with an IVSB row, its
    mean accepted length above the windowed draft's at the fewest frames (Sparrow's ablation)."""
    if not rows:
        return {}
    by = {(r["draft_attention"], r["frames"]): r for r in rows}
    frames = sorted({r["frames"] for r in rows})
    low, high = frames[0], frames[-1]

    def kept(row: str) -> float:
        return round(by[(row, high)]["decode_speedup"] / max(1e-9, by[(row, low)]["decode_speedup"]), 3)

    growth = by[("windowed", high)]["draft_ms_per_token"] / max(1e-9, by[("windowed", low)]["draft_ms_per_token"])
    aims = {"windowed_speedup_kept": kept("windowed"), "full_speedup_kept": kept("full"),
            "windowed_cost_growth": round(growth, 3)}
    met = aims["windowed_speedup_kept"] >= 0.95 and growth <= 1.3
    if ("windowed+ivsb", low) in by:
        aims["ivsb_speedup_kept"] = kept("windowed+ivsb")
        aims["ivsb_tau_gain_at_fewest"] = round(by[("windowed+ivsb", low)]["mean_accepted_len"]
                                                - by[("windowed", low)]["mean_accepted_len"], 3)
        met = met and aims["ivsb_tau_gain_at_fewest"] > 0 and aims["ivsb_speedup_kept"] >= 0.95
    return {**aims, "met": met}


def _views(rows: list[dict]) -> list[str]:
    """The single views a result's rows compare."""
    return [v for v in dict.fromkeys(r["view"] for r in rows) if v in VIEWS]


def aims(rows: list[dict]) -> dict:
    """Per category, the ensemble over the best single view (tokens/s); the aim: ≥ 0.97 on every
    category, > 1 on the mix."""
    by = {(r["view"], r["category"]): r["tokens_per_s"] for r in rows}
    ratios = {}
    for category in sorted({r["category"] for r in rows}):
        best = max(by[(view, category)] for view in _views(rows))
        ratios[category] = round(by[("ensemble", category)] / best, 3)
    per_category = [v for c, v in ratios.items() if c != "mix"]
    return {"ensemble_over_best_view": ratios,
            "met": bool(per_category and min(per_category) >= 0.97 and ratios.get("mix", 0) > 1.0)}


def format_table(result: dict) -> str:
    rows = result["rows"]
    categories = [c for c in dict.fromkeys(r["category"] for r in rows)]
    by = {(r["view"], r["category"]): r for r in rows}
    lines = []
    if rows:
        lines += ["tokens/s (mean accepted length)", f"{'view':<16}" + "".join(f"{c:>16}" for c in categories)]
        for view in rows_of(tuple(_views(rows))):
            lines.append(f"{view:<16}" + "".join(
                f"{by[(view, c)]['tokens_per_s']:>9.1f} ({by[(view, c)]['mean_accepted_len']:.2f})" for c in categories))
        ratios = result["aims"]["ensemble_over_best_view"]
        lines.append("ensemble / best view: " + ", ".join(f"{c} {v:.3f}" for c, v in ratios.items())
                     + f"  (aim >= 0.97 each, > 1 on the mix: {'met' if result['aims']['met'] else 'not met'})")
    if result.get("frames"):
        lines.append(f"{'row':<15}{'frames':>7}{'tok/s':>8}{'speedup':>9}{'decode speedup':>16}"
                     f"{'ms/drafted token':>18}{'alpha':>8}{'tau':>7}")
        for r in result["frames"]:
            lines.append(f"{r['draft_attention']:<15}{r['frames']:>7}{r['tokens_per_s']:>8.1f}{r['speedup']:>9.2f}"
                         f"{r['decode_speedup']:>16.2f}{r['draft_ms_per_token']:>18.3f}"
                         f"{r['acceptance_rate']:>8.3f}{r['mean_accepted_len']:>7.2f}")
        aim = result["frame_aims"]
        lines.append(", ".join(f"{k} {v}" for k, v in aim.items() if k != "met")
                     + f": {'met' if aim['met'] else 'not met'}")
    return "\n".join(lines)


def plot(result: dict, path: Path) -> None:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    rows, frames = result["rows"], result.get("frames") or []
    categories = list(dict.fromkeys(r["category"] for r in rows))
    by = {(r["view"], r["category"]): r["tokens_per_s"] for r in rows}
    both = bool(rows) and bool(frames)
    where = f"{result['machine'].get('cpu_model', '?')}, {result['date']}{', served' if result.get('served') else ''}"
    fig, axes = plt.subplots(1, 2 if both else 1, figsize=(15 if both else (11 if rows else 6), 4.5), squeeze=False,
                             gridspec_kw={"width_ratios": [3, 1]} if both else None)
    if rows:
        ax = axes[0][0]
        shown = rows_of(tuple(_views(rows)))
        width = 0.8 / len(shown)
        for i, view in enumerate(shown):
            ax.bar([c + i * width for c in range(len(categories))], [by[(view, c)] for c in categories], width,
                   label=view)
        ax.set_xticks([c + 0.4 - width / 2 for c in range(len(categories))], categories)
        ax.set_ylabel("tokens/s")
        ax.set_title(f"TABED views of the reference VLM ({where})")
        ax.legend(ncol=3, fontsize=8)
    if frames:   # Sparrow: the decoding speedup over target-only as pictures ("frames") grow
        ax = axes[0][-1]
        for row in (name for name in dict.fromkeys(r["draft_attention"] for r in frames) if name != "target-only"):
            mine = sorted((r for r in frames if r["draft_attention"] == row), key=lambda r: r["frames"])
            if mine:
                ax.plot([r["frames"] for r in mine], [r["decode_speedup"] for r in mine], marker="o", label=row)
        ax.axhline(1.0, color="grey", lw=0.8)
        ax.set_xscale("log", base=2)
        ax.set_xlabel("pictures per prompt")
        ax.set_ylabel("decoding speedup over target-only")
        ax.set_title("Sparrow's rows" if rows else f"Sparrow's rows ({where})")
        ax.legend(fontsize=8)
    fig.tight_layout()
    fig.savefig(path, dpi=120)
    plt.close(fig)
