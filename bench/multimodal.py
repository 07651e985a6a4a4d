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
(four frames of one scene shown as consecutive pictures, as a served clip is, and a question
about them).

Sparrow's rows (``--frames``): prompts showing 1, 4 or 16 pictures ("frames") and a question,
drafted by the zoo's EAGLE-3 head with full attention and with Sparrow's text-anchored window
(``HSRDraft(windowed=True)``): the draft's milliseconds per drafted token (its catch-up on the
prompt included) and its acceptance rate. Aims: the windowed draft's cost at 16 frames at most
1.3x its cost at 1 frame, its α within 0.05 of the full-attention draft's.
"""

from __future__ import annotations

import json
import random
import time
from dataclasses import dataclass
from pathlib import Path

from specserve.bench.engine import machine_info
from specserve.data.prompts import load_prompts
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
CLIP_FRAMES = 4
CLIP_QUESTION = "These are frames of a clip. What shape is in the last frame, and what colour is it?"


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
    frames: tuple[int, ...] = (1, 4, 16)
    frame_prompts: int = 4
    head: str = "smollm2-eagle3"
    captions: str = "cold"
    views: tuple[str, ...] = VIEWS   # the views compared, and mixed by the ensembles
    scenarios: tuple[str, ...] = ()  # conversations instead of categories (``SCENARIOS``); none: categories

    def __post_init__(self) -> None:
        unknown = sorted(set(self.categories) - set(CATEGORIES))
        if unknown:
            raise ValueError(f"unknown categories {unknown}; known: {', '.join(CATEGORIES)}")
        if min(self.pictures, self.max_tokens, self.window, self.repeats, self.frame_prompts) < 1:
            raise ValueError("--pictures, --max-tokens, --window, --repeats and --frame-prompts must be at least 1")
        if not self.views or not set(self.views) <= set(VIEWS) or len(set(self.views)) != len(self.views):
            raise ValueError(f"--views must name distinct views of {', '.join(VIEWS)}; got {list(self.views)}")
        if not set(self.scenarios) <= set(SCENARIOS):
            raise ValueError(f"unknown scenarios {sorted(set(self.scenarios) - set(SCENARIOS))}; known: {', '.join(SCENARIOS)}")
        if self.captions not in ("cold", "warm"):
            raise ValueError(f"--captions must be cold or warm; got {self.captions!r}")
        if any(f < 1 for f in self.frames):
            raise ValueError(f"--frames are pictures per prompt, each at least 1; got {list(self.frames)}")


def _ensembles(draft: str, views: tuple[str, ...]) -> dict[str, dict]:
    alone = {view: {"model": draft, "views": [view]} for view in views}
    return {**alone, "ensemble": {"model": draft, "views": list(views)},
            "ensemble-static": {"model": draft, "views": list(views), "weights": "static"}}


def run_multimodal_bench(config: MultimodalBenchConfig, engine: SpecEngine | None = None, progress: bool = True) -> dict:
    from tqdm import tqdm

    engine = engine or SpecEngine.load(config.target, dtype=config.dtype, ensembles=_ensembles(config.draft, config.views),
                                       draft_models=[config.head] if config.frames else [])
    if engine.images is None:
        raise ValueError(f"{config.target} reads text only: the multimodal benchmark needs a VLM target")
    if config.scenarios:
        work = scenario_work(engine, config)
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
    rows = []
    for (row, category), cell in totals.items():
        rows.append({"view": row, "category": category, "tokens_per_s": round(cell["tokens"] / cell["seconds"], 2),
                     "mean_accepted_len": round(cell["tokens"] / max(1, cell["steps"]), 3)})
    for row in rows_run:   # the mix: every category's tokens over every category's seconds
        cells = [totals[(row, c)] for c in groups]
        tokens, seconds, steps = (sum(c[k] for c in cells) for k in ("tokens", "seconds", "steps"))
        rows.append({"view": row, "category": "mix", "tokens_per_s": round(tokens / seconds, 2),
                     "mean_accepted_len": round(tokens / max(1, steps), 3)})
    frames = frame_rows(engine, config, progress) if config.frames else []
    result = {"config": {k: (str(v) if isinstance(v, Path) else v) for k, v in config.__dict__.items()},
              "machine": machine, "date": time.strftime("%Y-%m-%d"), "rows": rows, "aims": aims(rows),
              "frames": frames, "frame_aims": frame_aims(frames)}
    config.json_path.write_text(json.dumps(result, indent=2))
    plot(result, config.plot_path)
    print(format_table(result))
    return result


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


def scenario_work(engine: SpecEngine, config: MultimodalBenchConfig) -> list[tuple[str, list[dict], tuple]]:
    """(scenario, messages, pictures) per conversation, ``config.pictures`` per scenario. The first
    turns' answers are the VLM's own (greedy), as a client's conversation would carry them."""
    chats = [t for t in load_prompts("chat", 4 * config.pictures) if len(t) < 300][:config.pictures]
    work = []
    for n in range(config.pictures):
        ex = example(TEST_SEED + SEED_OFFSET + 900_000 + n, config.categories[n % len(config.categories)])
        first, images = single_turn(ex)
        answer = engine.generate_ids(engine.encode_messages(first, images),
                                     GenerateRequest("", max_tokens=config.max_tokens, draft="none", window=0))
        said = engine.tokenizer.decode(answer.token_ids, skip_special_tokens=True)
        earlier = [*first, {"role": "assistant", "content": said}]
        frames = [example(TEST_SEED + SEED_OFFSET + 950_000 + CLIP_FRAMES * n + f, "shape").image for f in range(CLIP_FRAMES)]
        odd = example(TEST_SEED + SEED_OFFSET + 980_000 + n, config.categories[n % len(config.categories)])
        conversations = {
            "single": (first, images),
            "follow-up": ([*earlier, {"role": "user", "content": FOLLOW_UP}], images),
            "text-turn": ([*earlier, {"role": "user", "content": chats[n % len(chats)]}], images),
            "unseen": (single_turn(odd)[0], (unseen(odd.image),)),
            "clip": ([{"role": "user", "content": [*({"type": "image"} for _ in frames),
                                                    {"type": "text", "text": CLIP_QUESTION}]}], tuple(frames)),
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
    """Rows ``{draft_attention, frames, draft_ms_per_token, acceptance_rate, mean_accepted_len}``:
    the head with full and with windowed attention on prompts of ``frames`` pictures."""
    from tqdm import tqdm

    from specserve.replicas.drafts.base import draft_model
    from specserve.replicas.drafts.hsr_draft import HSRDraft

    head = draft_model(engine.drafts[config.head])
    names = {"full": config.head, "windowed": f"{config.head}-windowed"}
    engine.drafts[names["windowed"]] = HSRDraft(names["windowed"], head, windowed=True)
    engine.servers = engine._servers()
    warm = example(TEST_SEED + SEED_OFFSET + 899_999)
    for name in names.values():   # untimed: each draft's first call pays its warm-up
        engine.generate(GenerateRequest(warm.question, max_tokens=4, draft=name, window=config.window,
                                        images=(warm.image,)))
    rows = []
    bar = tqdm(total=len(config.frames) * config.frame_prompts * 2, desc="bench multimodal frames", disable=not progress)
    for frames in config.frames:
        prompts = []
        for n in range(config.frame_prompts):
            pictures = [example(TEST_SEED + SEED_OFFSET + 900_000 + 100 * n + f) for f in range(frames)]
            prompts.append((pictures, pictures[-1].question.replace("the picture", "the last picture")))
        for attention, name in names.items():
            drafted = accepted = rejected = emitted = steps = 0
            seconds = 0.0
            for pictures, question in prompts:
                engine.reset_caches()
                ids = engine.encode(question, images=tuple(p.image for p in pictures))
                stats = engine.generate_ids(ids, GenerateRequest(question, max_tokens=config.max_tokens, draft=name,
                                                                 window=config.window)).stats
                seconds += stats.draft_s
                drafted += sum(stats.windows)
                accepted, rejected = accepted + stats.accepted, rejected + stats.rejections
                emitted, steps = emitted + stats.emitted, steps + stats.steps
                bar.update()
            rows.append({"draft_attention": attention, "frames": frames,
                         "draft_ms_per_token": round(1e3 * seconds / max(1, drafted), 3),
                         "acceptance_rate": round(accepted / max(1, accepted + rejected), 3),
                         "mean_accepted_len": round(emitted / max(1, steps), 3)})
    bar.close()
    return rows


def frame_aims(rows: list[dict]) -> dict:
    """Windowed cost at the most frames over its cost at the fewest (aim ≤ 1.3), and its α against
    full attention's at every frame count (aim: within 0.05)."""
    if not rows:
        return {}
    by = {(r["draft_attention"], r["frames"]): r for r in rows}
    frames = sorted({r["frames"] for r in rows})
    growth = by[("windowed", frames[-1])]["draft_ms_per_token"] / max(1e-9, by[("windowed", frames[0])]["draft_ms_per_token"])
    gaps = {f: round(by[("windowed", f)]["acceptance_rate"] - by[("full", f)]["acceptance_rate"], 3) for f in frames}
    return {"windowed_cost_growth": round(growth, 3), "alpha_gap": gaps,
            "met": growth <= 1.3 and all(abs(g) <= 0.05 for g in gaps.values())}


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
    lines = ["tokens/s (mean accepted length)", f"{'view':<16}" + "".join(f"{c:>16}" for c in categories)]
    for view in rows_of(tuple(_views(rows))):
        lines.append(f"{view:<16}" + "".join(
            f"{by[(view, c)]['tokens_per_s']:>9.1f} ({by[(view, c)]['mean_accepted_len']:.2f})" for c in categories))
    ratios = result["aims"]["ensemble_over_best_view"]
    lines.append("ensemble / best view: " + ", ".join(f"{c} {v:.3f}" for c, v in ratios.items())
                 + f"  (aim >= 0.97 each, > 1 on the mix: {'met' if result['aims']['met'] else 'not met'})")
    if result.get("frames"):
        lines.append(f"{'attention':<10}{'frames':>7}{'ms/drafted token':>18}{'alpha':>8}{'tau':>7}")
        for r in result["frames"]:
            lines.append(f"{r['draft_attention']:<10}{r['frames']:>7}{r['draft_ms_per_token']:>18.3f}"
                         f"{r['acceptance_rate']:>8.3f}{r['mean_accepted_len']:>7.2f}")
        aim = result["frame_aims"]
        lines.append(f"windowed cost growth {aim['windowed_cost_growth']:.2f}x (aim <= 1.3), alpha gap "
                     f"{aim['alpha_gap']} (aim within 0.05): {'met' if aim['met'] else 'not met'}")
    return "\n".join(lines)


def plot(result: dict, path: Path) -> None:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    rows, frames = result["rows"], result.get("frames") or []
    categories = list(dict.fromkeys(r["category"] for r in rows))
    by = {(r["view"], r["category"]): r["tokens_per_s"] for r in rows}
    fig, axes = plt.subplots(1, 2 if frames else 1, figsize=(15 if frames else 11, 4.5), squeeze=False,
                             gridspec_kw={"width_ratios": [3, 1]} if frames else None)
    ax = axes[0][0]
    shown = rows_of(tuple(_views(rows)))
    width = 0.8 / len(shown)
    for i, view in enumerate(shown):
        ax.bar([c + i * width for c in range(len(categories))], [by[(view, c)] for c in categories], width, label=view)
    ax.set_xticks([c + 0.4 - width / 2 for c in range(len(categories))], categories)
    ax.set_ylabel("tokens/s")
    ax.set_title(f"TABED views of the reference VLM ({result['machine'].get('cpu_model', '?')}, {result['date']})")
    ax.legend(ncol=3, fontsize=8)
    if frames:   # Sparrow: the draft's cost per drafted token as pictures ("frames") grow
        ax = axes[0][1]
        for attention in ("full", "windowed"):
            mine = sorted((r for r in frames if r["draft_attention"] == attention), key=lambda r: r["frames"])
            ax.plot([r["frames"] for r in mine], [r["draft_ms_per_token"] for r in mine], marker="o",
                    label=f"{attention} attention")
        ax.set_xscale("log", base=2)
        ax.set_xlabel("pictures per prompt")
        ax.set_ylabel("draft ms per drafted token")
        ax.set_title("Sparrow's windowed draft")
        ax.legend(fontsize=8)
    fig.tight_layout()
    fig.savefig(path, dpi=120)
    plt.close(fig)
