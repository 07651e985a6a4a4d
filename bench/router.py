"""Router benchmark: does the learned draft router earn its keep on a mixed workload?

In-process, the reference target, greedy, chat-rendered prompts of every category; every
generation starts from cold caches. Candidates: prompt lookup, every draft the zoo has exported
(``smollm2-draft-2l``, ``smollm2-hsr``) and ``none`` (no speculation). Every strategy decodes
with the deployment's default per-step policy (one policy object per strategy, kept across its
requests as a replica keeps it), so only the draft choice differs.

The least-squares baseline and the α estimate are those of "A drop-in solution for on-the-fly
adaptation of speculative decoding in large language models" (the drop-in paper below).

1. **Warm-up** (``--warmup`` prompts per category, held out from the evaluation prompts): each
   prompt is decoded with every candidate pinned (the full-information table the least-squares
   baseline fits from, as the drop-in paper's §5 observes α for r prompts per draft), and once by
   the **router** (``auto``), which learns as a bandit: it observes only what it chose.
2. **Evaluation** (``--prompts`` per category): each prompt, in rotating order, with every
   candidate pinned and with the router (still learning). From the table, per prompt:
   ``oracle`` (the fastest candidate, found after the fact: see below), ``best-single`` (the candidate
   fastest over the whole mix, also after the fact), ``random`` (the expectation of a uniform
   choice: the mean over candidates) and ``least-squares`` (the drop-in paper's baseline: per draft
   a least-squares fit of α on the warm-up prompts' features, then the candidate the same
   objective prefers; its tokens/s is the table's for that candidate, not a separate run).

The oracle is chosen on some timings and read on others. The fastest of four noisy medians is
faster than the fastest candidate really is (the winner's curse, a sizeable part of the aims'
margin: docs/benchmarks.md §5.1), while the router's row is one live run
that nothing selected. So with ``repeats`` ≥ 2 each repeat k is held out in turn: the candidate
with the best median over the other repeats is picked and its k-th timing read; the prompt's
oracle is their median. ``oracle-in-sample`` (the best median, the same timings choosing and
scoring) is kept beside it: the truth lies between the two.

A **feature ablation** from the same table, no extra run: the least-squares baseline refitted on
the warm-up with one feature group left out at a time (length, perplexity, repetition, topics),
each fit's α error on the evaluation prompts' pinned runs and the tokens/s of its choices; what a
feature is worth decides whether its cost is (the perplexity costs an output layer over 64 rows
of every prefill).

Rows ``{strategy, category, tokens_per_s}`` (Σ tokens / Σ seconds over the category's prompts,
and ``all`` over the mix), ratios to the oracle and to best-single, the aims on ``all`` (the
router at 0.97x the oracle or better, and 1.08x best-single), every generation in ``requests``,
and a plot: tokens/s per strategy and category, and the router's cumulative regret against the
per-prompt oracle over its requests (warm-up, then evaluation), as the bandit learns.
"""

from __future__ import annotations

import json
import statistics
import time
from collections.abc import Sequence
from dataclasses import asdict, dataclass
from pathlib import Path

import numpy as np
from sklearn.linear_model import Ridge

from specserve.bench.engine import machine_info
from specserve.bench.turns import in_turn
from specserve.bench.policies import quiet_draft_servers
from specserve.data.prompts import CATEGORIES, check_categories, load_prompts, topic_corpus
from specserve.router.draft_router import LearnedDraftRouter
from specserve.replicas.engine import NO_DRAFT, GenerateRequest, SpecEngine
from specserve.router.features import PromptFeatures
from specserve.router.router_factory import topic_basis

ORACLE, ROUTER, BEST_SINGLE, RANDOM, LEAST_SQUARES = "oracle", "router", "best-single", "random", "least-squares"
ORACLE_IN_SAMPLE = "oracle-in-sample"
STRATEGIES = (ORACLE, ROUTER, BEST_SINGLE, RANDOM, LEAST_SQUARES, ORACLE_IN_SAMPLE)
AUTO = "auto"
WINDOW = 4   # where each request starts; the per-step policy adapts it
AIM_ORACLE, AIM_BEST_SINGLE = 0.97, 1.08


@dataclass
class Generation:
    phase: str          # warmup / eval
    prompt: int         # index into the run's prompts of that phase
    category: str
    draft: str          # the candidate pinned, or "auto" (the router)
    tokens: int
    seconds: float
    choice: str | None = None        # the router's: what it chose, why, what it ended on
    reason: str | None = None
    final_draft: str | None = None
    predicted_alpha: dict | None = None
    realised_alpha: float | None = None   # of the (last) draft segment, the drop-in paper's Eq. 2
    features: list | None = None          # the router's feature vector of the prompt
    timings: list | None = None           # seconds of each repeat (``seconds`` is their median)

    @property
    def tokens_per_s(self) -> float:
        return self.tokens / self.seconds if self.seconds > 0 else 0.0


# --- strategies from a table (pure) ---------------------------------------------------------


def table_of(generations: Sequence[Generation], phase: str) -> dict[int, dict[str, Generation]]:
    """prompt -> candidate -> its pinned generation."""
    table: dict[int, dict[str, Generation]] = {}
    for g in generations:
        if g.phase == phase and g.draft != AUTO:
            table.setdefault(g.prompt, {})[g.draft] = g
    return table


def oracle_choice(row: dict[str, Generation]) -> str:
    return max(row, key=lambda d: row[d].tokens_per_s)


def held_out_oracle(row: dict[str, Generation]) -> tuple[float, float]:
    """(tokens, seconds) of the prompt's oracle, each repeat scored by a choice made on the other
    repeats; with fewer than two repeats, the in-sample best."""
    repeats = min(len(g.timings or ()) for g in row.values())
    if repeats < 2:
        best = row[oracle_choice(row)]
        return best.tokens, best.seconds
    pairs = []
    for k in range(repeats):
        others = {d: statistics.median(t for j, t in enumerate(g.timings) if j != k) for d, g in row.items()}
        pick = max(row, key=lambda d: row[d].tokens / others[d])
        pairs.append((row[pick].tokens, row[pick].timings[k]))
    pairs.sort(key=lambda p: p[0] / p[1])
    middle = len(pairs) // 2
    if len(pairs) % 2:
        return pairs[middle]
    (t0, s0), (t1, s1) = pairs[middle - 1], pairs[middle]
    return (t0 + t1) / 2, (s0 + s1) / 2


def best_single_choice(table: dict[int, dict[str, Generation]]) -> str:
    candidates = set.intersection(*(set(r) for r in table.values()))
    return max(sorted(candidates), key=lambda d: sum(r[d].tokens for r in table.values()) / sum(r[d].seconds for r in table.values()))


def totals(pairs: Sequence[tuple[float, float]]) -> float | None:
    """Σ tokens / Σ seconds."""
    tokens, seconds = sum(t for t, _ in pairs), sum(s for _, s in pairs)
    return round(tokens / seconds, 2) if seconds > 0 else None


def strategy_rows(generations: Sequence[Generation], ls_choice: dict[int, str], categories: Sequence[str]) -> list[dict]:
    """``{strategy, category, tokens_per_s}`` for every strategy, per category and ``all``."""
    table = table_of(generations, "eval")
    single = best_single_choice(table)
    router = {g.prompt: g for g in generations if g.phase == "eval" and g.draft == AUTO}
    picks: dict[str, dict[int, tuple[float, float]]] = {s: {} for s in STRATEGIES}
    for prompt, row in table.items():
        picks[ORACLE][prompt] = held_out_oracle(row)
        picks[ORACLE_IN_SAMPLE][prompt] = (row[oracle_choice(row)].tokens, row[oracle_choice(row)].seconds)
        picks[BEST_SINGLE][prompt] = (row[single].tokens, row[single].seconds)
        picks[RANDOM][prompt] = (sum(g.tokens for g in row.values()) / len(row), sum(g.seconds for g in row.values()) / len(row))
        if prompt in ls_choice:
            picks[LEAST_SQUARES][prompt] = (row[ls_choice[prompt]].tokens, row[ls_choice[prompt]].seconds)
        if prompt in router:
            picks[ROUTER][prompt] = (router[prompt].tokens, router[prompt].seconds)
    category_of = {p: next(iter(row.values())).category for p, row in table.items()}
    rows = []
    for strategy in STRATEGIES:
        for category in [*categories, "all"]:
            pairs = [v for p, v in picks[strategy].items() if category in ("all", category_of[p])]
            rows.append({"strategy": strategy, "category": category, "tokens_per_s": totals(pairs),
                         "prompts": len(pairs), **({"draft": single} if strategy == BEST_SINGLE else {})})
    return rows


def aims(rows: Sequence[dict]) -> dict:
    mix = {r["strategy"]: r["tokens_per_s"] for r in rows if r["category"] == "all"}

    def ratio(a: str, b: str) -> float | None:
        return round(mix[a] / mix[b], 4) if mix.get(a) and mix.get(b) else None

    to_oracle, to_single = ratio(ROUTER, ORACLE), ratio(ROUTER, BEST_SINGLE)
    return {
        "router_over_oracle": {"value": to_oracle, "aim": f">= {AIM_ORACLE}",
                               "met": None if to_oracle is None else to_oracle >= AIM_ORACLE,
                               "in_sample": ratio(ROUTER, ORACLE_IN_SAMPLE)},
        "router_over_best_single": {"value": to_single, "aim": f">= {AIM_BEST_SINGLE}",
                                    "met": None if to_single is None else to_single >= AIM_BEST_SINGLE},
    }


def regret(generations: Sequence[Generation]) -> list[dict]:
    """Per router request, in the order served: tokens/s the per-prompt oracle had over it."""
    tables = {phase: table_of(generations, phase) for phase in ("warmup", "eval")}
    out = []
    for g in generations:
        if g.draft == AUTO and g.prompt in tables[g.phase]:
            row = tables[g.phase][g.prompt]
            best = row[oracle_choice(row)]
            out.append({"phase": g.phase, "prompt": g.prompt, "category": g.category, "choice": g.choice,
                        "oracle": oracle_choice(row), "regret_tokens_per_s": round(best.tokens_per_s - g.tokens_per_s, 3),
                        "seconds_lost": round(g.seconds - best.seconds * g.tokens / max(1, best.tokens), 4)})
    return out


# --- feature ablation (pure) ---------------------------------------------------------------


def feature_groups(dims: int) -> dict[str, tuple[int, ...]]:
    """Columns of ``PromptFeatures.vector`` per feature group (the bias, column 0, stays in every fit)."""
    names = PromptFeatures.names(dims)
    return {"length": (names.index("log_length"),),
            "perplexity": (names.index("log_perplexity"), names.index("perplexity_missing")),
            "repeat_rate": (names.index("repeat_rate"),), "constrained": (names.index("constrained"),),
            "topics": tuple(i for i, n in enumerate(names) if n.startswith("topic_"))}


def without(x: Sequence[float], columns: Sequence[int]) -> list[float]:
    """``x`` with ``columns`` zeroed: to a least-squares fit, a feature that is not there."""
    return [0.0 if i in columns else v for i, v in enumerate(x)]


def ablation(generations: Sequence[Generation], choose, dims: int) -> list[dict]:
    """Least squares on all features, then without each group: the mean absolute error of α on the
    evaluation prompts' pinned runs, and the tokens/s of the candidates it then picks (read from
    the table). ``choose(models, x)``: the candidate the objective prefers for features ``x``."""
    table = table_of(generations, "eval")
    pinned = [g for g in generations if g.phase == "eval" and g.draft not in (AUTO, NO_DRAFT)
              and g.features is not None and g.realised_alpha is not None]
    features = {g.prompt: g.features for g in generations if g.phase == "eval" and g.features is not None}
    rows = []
    for name, columns in [("all", ()), *((f"-{group}", cols) for group, cols in feature_groups(dims).items())]:
        models = Bench.least_squares(generations, columns)
        errors = [abs(models[g.draft].predict(without(g.features, columns)) - g.realised_alpha)
                  for g in pinned if g.draft in models]
        picks = {p: choose(models, without(x, columns)) for p, x in features.items() if p in table}
        rows.append({"features": name, "alpha_mae": round(statistics.mean(errors), 4) if errors else None,
                     "tokens_per_s": totals([(table[p][c].tokens, table[p][c].seconds) for p, c in picks.items()]),
                     "choices": {c: sum(1 for v in picks.values() if v == c) for c in sorted(set(picks.values()))}})
    return rows


# --- the run --------------------------------------------------------------------------------


class LeastSquares:
    """The drop-in paper's §5 estimate of one draft's α from a fixed set of (features, α): its
    ordinary least squares, as scikit-learn's ridge with a vanishing penalty (so that collinear
    features, a topic dimension that is always 0, stay solvable), clipped to a rate."""

    def __init__(self, xs: Sequence[Sequence[float]], alphas: Sequence[float], ridge: float = 1e-3,
                 alpha_max: float = 0.95):
        self.fit = Ridge(alpha=ridge, fit_intercept=False).fit(np.asarray(xs, dtype=float), np.asarray(alphas, dtype=float))
        self.alpha_max, self.observations = alpha_max, len(xs)

    def predict(self, x: Sequence[float]) -> float:
        return float(np.clip(self.fit.predict(np.asarray([x], dtype=float))[0], 0.0, self.alpha_max))


class Bench:
    def __init__(self, engine: SpecEngine, candidates: list[str], max_tokens: int, explore: float, basis,
                 repeats: int = 1, switches: int = 1):
        from specserve.policies.registry import DEFAULT_POLICY, build_policy

        drafts = [c for c in candidates if c != NO_DRAFT]
        self.engine = engine
        self.candidates = candidates
        self.max_tokens = max_tokens
        self.repeats = repeats
        # Two routers: the bandit under test sees only its own choices; the recorder sees the
        # pinned full-information runs (features and realised α per draft, for least squares).
        self.bandit = LearnedDraftRouter(drafts, basis, explore=explore, max_switches=switches, log=False)
        self.recorder = LearnedDraftRouter(drafts, basis, log=False)
        self.policies = {name: build_policy(DEFAULT_POLICY) for name in [*candidates, AUTO]}

    def run(self, phase: str, prompt: int, category: str, ids: list[int], draft: str) -> Generation:
        """One generation; in the evaluation, ``repeats`` of them back to back, timed by their
        median (single timings scatter, with identical choices and α, by as much as the aims are
        about). The router learns from each repeat, as it would from a resend."""
        self.engine.router = self.bandit if draft == AUTO else self.recorder
        request = GenerateRequest("", self.max_tokens, draft, 0 if draft == NO_DRAFT else WINDOW)
        timings = []
        for _ in range(self.repeats if phase == "eval" else 1):
            self.engine.reset_caches()
            start = time.perf_counter()
            gen = self.engine.generate_batch_ids([ids], [request], policy=self.policies[draft])[0]
            timings.append(time.perf_counter() - start)
        out = Generation(phase, prompt, category, draft, len(gen.token_ids), statistics.median(timings))
        out.timings = [round(t, 4) for t in timings]
        outcome = self.engine.router.recent[-1]
        out.features, out.realised_alpha = outcome["features"], (outcome["observed"] or {}).get("alpha")
        if draft == AUTO:
            out.choice, out.reason = gen.routing["choice"], gen.routing["reason"]
            out.final_draft, out.predicted_alpha = outcome["final_draft"], gen.routing["predicted_alpha"]
        return out

    def prompt_rounds(self, phase: str, prompts: list[tuple[str, list[int]]], bar) -> list[Generation]:
        """Every candidate pinned and the router on each prompt, the starting row rotating."""
        rows = [*self.candidates, AUTO]
        out = []
        for i, (category, ids) in enumerate(prompts):
            for draft in in_turn(rows, i):
                out.append(self.run(phase, i, category, ids, draft))
                bar.update(1)
        return out

    @staticmethod
    def least_squares(generations: Sequence[Generation], drop: Sequence[int] = ()) -> dict[str, "LeastSquares"]:
        """The drop-in paper's estimate per draft from the warm-up's pinned runs (``drop``: feature
        columns left out, for the ablation)."""
        data: dict[str, tuple[list, list]] = {}
        for g in generations:
            if g.phase == "warmup" and g.draft not in (AUTO, NO_DRAFT) and g.realised_alpha is not None:
                xs, alphas = data.setdefault(g.draft, ([], []))
                xs.append(without(g.features, drop))
                alphas.append(g.realised_alpha)
        return {d: LeastSquares(xs, a) for d, (xs, a) in data.items()}

    def ls_choice(self, models: dict[str, "LeastSquares"], features: list[float]) -> str:
        scores = {d: self.recorder.costs.best(m.predict(features), d, 1)[0] for d, m in models.items()}
        scores[NO_DRAFT] = self.recorder.costs.plain(1)
        return max(scores, key=scores.get)


@dataclass(frozen=True, kw_only=True)
class RouterBenchConfig:
    """What one run measures and where it writes (``specserve bench router``'s options, with its
    defaults). Checked when made, before any model loads, so that a mistake costs no waiting."""

    json_path: Path = Path("bench-router.json")   # rows, aims, regret, ablation and every generation
    plot_path: Path = Path("bench-router.png")    # tokens/s per strategy, the router's regret
    prompts_per_category: int = 6     # evaluation prompts: 24 over the mix, each with every candidate
    warmup_per_category: int = 6      # other prompts the router and the least-squares fit learn from first
    max_tokens: int = 128             # new tokens per request: many steps per prefill, so a draft's α shows
    categories: tuple[str, ...] = CATEGORIES   # the mix (checked; blanks and repeats dropped)
    explore: float = 0.2              # the router's exploration weight (LinUCB's β): the deployment's router_explore
    repeats: int = 1                  # runs per evaluation generation, timed by the median; ≥ 2 holds the oracle out
    switches: int = 1                 # draft switches the router may make per request mid-flight (0: none)
    dtype: str = "auto"               # bfloat16 where the CPU has it natively, else float32

    def __post_init__(self) -> None:
        if self.prompts_per_category < 1 or self.warmup_per_category < 1 or self.max_tokens < 1 or self.repeats < 1:
            raise ValueError("--prompts, --warmup, --max-tokens and --repeats must be >= 1")
        if self.switches < 0:
            raise ValueError(f"--switches must be >= 0 (0: the router never switches mid-flight), got {self.switches}")
        # Frozen: the checked names replace the given ones through object.__setattr__.
        object.__setattr__(self, "categories", tuple(check_categories(self.categories)))


def run_router_bench(config: RouterBenchConfig, engine: SpecEngine | None = None, progress: bool = True) -> dict:
    """Every strategy on the same prompts; write JSON and plot, print a table; return the JSON.
    ``engine``: one already loaded (every draft it has is a candidate); ``progress``: a progress
    bar on stderr."""
    from tqdm import tqdm

    from specserve.replicas.model_store import zoo_dir, zoo_drafts
    from specserve.training.answers import ANSWERS_DIR

    categories = list(config.categories)
    prompts_per_category, warmup_per_category = config.prompts_per_category, config.warmup_per_category
    # Evaluation prompts first in each list, the warm-up's after them: disjoint, the same every run.
    texts = {c: load_prompts(c, prompts_per_category + warmup_per_category) for c in categories}
    machine_before = machine_info()
    if engine is None:
        zoo = [d for d in zoo_drafts() if (zoo_dir() / d / "config.json").exists()]
        engine = SpecEngine.load(dtype=config.dtype, draft_models=zoo, suffix_seed=ANSWERS_DIR)
    candidates = [*engine.drafts, NO_DRAFT]
    basis = topic_basis(engine.loaded.name, engine.tokenizer, topic_corpus, 8)
    encoded = {c: [engine.encode(t) for t in ts] for c, ts in texts.items()}
    evaluation = [(c, encoded[c][i]) for i in range(prompts_per_category) for c in categories]
    warmup = [(c, encoded[c][prompts_per_category + i]) for i in range(warmup_per_category) for c in categories]
    bench = Bench(engine, candidates, config.max_tokens, config.explore, basis, config.repeats, config.switches)

    total = (len(warmup) + len(evaluation)) * (len(candidates) + 1) + 1
    generations: list[Generation] = []
    with tqdm(total=total, desc="bench router", unit="gen", disable=not progress) as bar, quiet_draft_servers():
        bench.run("init", -1, warmup[0][0], warmup[0][1][:64], NO_DRAFT)   # warm the code paths; not counted
        bar.update(1)
        generations += bench.prompt_rounds("warmup", warmup, bar)
        models = bench.least_squares(generations)
        generations += bench.prompt_rounds("eval", evaluation, bar)
    # The least-squares choice per evaluation prompt, from its features as the router computes them.
    features = {g.prompt: g.features for g in generations if g.phase == "eval" and g.features is not None}
    ls_choice = {i: bench.ls_choice(models, x) for i, x in features.items()}
    rows = strategy_rows(generations, ls_choice, categories)
    ablated = ablation(generations, bench.ls_choice, bench.recorder.topic_dims)
    report_aims = aims(rows)
    regrets = regret(generations)
    meta = {
        "target": engine.loaded.name, "dtype": str(engine.loaded.model.dtype).removeprefix("torch."),
        "candidates": candidates, "max_tokens": config.max_tokens, "start_window": WINDOW,
        "prompts_per_category": prompts_per_category, "warmup_per_category": warmup_per_category,
        "categories": categories, "explore": config.explore, "switches": config.switches, "repeats": config.repeats,
        "topic_basis": bench.bandit.basis_id,
        "least_squares_fitted_on": {d: m.observations for d, m in models.items()}, "machine": machine_before,
        "load_avg_1m_after": machine_info()["load_avg_1m"],
    }
    notes = ["oracle, best-single, random and least-squares are read from the pinned runs of the same prompts in "
             "the same run (best-single and oracle are chosen after the fact); router is its own live run",
             "oracle: each repeat scored by the candidate the other repeats chose (free of the winner's curse); "
             "oracle-in-sample: the best median, the same timings choosing and scoring (biased upwards)",
             "the least-squares baseline never explores and never updates: it is fitted once on the warm-up table"]
    report = {"meta": meta, "notes": notes, "aims": report_aims, "rows": rows, "regret": regrets, "ablation": ablated,
              "router_choices": {c: sum(1 for g in generations if g.phase == "eval" and g.choice == c) for c in candidates},
              "least_squares_choices": {c: sum(1 for v in ls_choice.values() if v == c) for c in candidates},
              "requests": [asdict(g) | {"tokens_per_s": round(g.tokens_per_s, 3)} for g in generations]}
    json_path, plot_path = config.json_path, config.plot_path
    json_path.parent.mkdir(parents=True, exist_ok=True)
    json_path.write_text(json.dumps(report, indent=2) + "\n")
    plot(rows, regrets, categories, meta, plot_path)
    print(format_table(rows))
    print("\nleast squares without each feature group (α error on the evaluation's pinned runs, tokens/s of its choices):")
    for r in ablated:
        print(f"  {r['features']:14s} alpha MAE {r['alpha_mae']}  {r['tokens_per_s']} tok/s  {r['choices']}")
    for name, aim in report_aims.items():
        print(f"aim {name}: {aim['value']} ({aim['aim']}: {'met' if aim['met'] else 'not met'})")
    print(f"  (router over the in-sample oracle: {report_aims['router_over_oracle']['in_sample']})")
    print(f"\nwrote {json_path} and {plot_path}")
    return report


def format_table(rows: Sequence[dict]) -> str:
    categories = list(dict.fromkeys(r["category"] for r in rows))
    header = f"{'strategy':16s} " + " ".join(f"{c:>10s}" for c in categories)
    lines = [header, "-" * len(header)]
    for strategy in STRATEGIES:
        cells = {r["category"]: r["tokens_per_s"] for r in rows if r["strategy"] == strategy}
        lines.append(f"{strategy:16s} " + " ".join(f"{cells.get(c) or float('nan'):10.2f}" for c in categories))
    return "\n".join(lines)


def plot(rows: Sequence[dict], regrets: Sequence[dict], categories: Sequence[str], meta: dict, path: Path) -> None:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    fig, (bars, curve) = plt.subplots(1, 2, figsize=(14, 5))
    groups = [*categories, "all"]
    width = 0.8 / len(STRATEGIES)
    for k, strategy in enumerate(STRATEGIES):
        values = {r["category"]: r["tokens_per_s"] or 0.0 for r in rows if r["strategy"] == strategy}
        bars.bar([i + k * width for i in range(len(groups))], [values.get(g, 0.0) for g in groups], width, label=strategy)
    bars.set_xticks([i + 0.4 - width / 2 for i in range(len(groups))], groups)
    bars.set_ylabel("tokens/s")
    bars.set_title(f"draft choice on a mixed workload ({meta['dtype']}, {meta['machine'].get('cpu_model', '')[:28]})")
    bars.legend(fontsize=8)
    cumulative, total = [], 0.0
    for r in regrets:
        total += r["seconds_lost"]
        cumulative.append(total)
    curve.plot(range(1, len(cumulative) + 1), cumulative, marker=".")
    warm = sum(1 for r in regrets if r["phase"] == "warmup")
    if warm:
        curve.axvline(warm + 0.5, color="grey", linestyle="--", label="warm-up | evaluation")
        curve.legend()
    curve.set_xlabel("router request")
    curve.set_ylabel("cumulative seconds lost to the per-prompt oracle")
    curve.set_title("router regret as the bandit learns")
    fig.tight_layout()
    path.parent.mkdir(parents=True, exist_ok=True)
    fig.savefig(path, dpi=120)
    plt.close(fig)
