"""Policy benchmark: every window and tree policy beside static speculation and its oracle, by category.

In-process, the reference target, greedy, one draft (prompt lookup unless ``--draft``), prompts
rendered with the chat template; every row decodes the same prompts in the same run, the rows'
steps taking turns (below), so a noisy neighbour on these shared machines slows all of them
alike. Four sections:

- ``window`` (one stream, ``max_tokens``): ``static-1`` .. ``static-8`` (the static policy, that
  window every step); ``oracle-static``, per request the static window that was fastest on it,
  found after the fact (so no static row can beat it on any request); and every window policy the
  registry lists (``online``, ``fsm``, ``cache-fsm``, ``q-learning``, ``q-learning-per-request``,
  ``hf-heuristic``), each an object from ``build_policy(name)``, fresh per (policy, category) row
  and kept across that row's requests as a replica keeps it: ``q-learning`` carries its table from
  request to request (the paper's agent), ``q-learning-per-request`` starts each from a fresh one. Requests start at the deployment's default window and are not
  pinned, so the adaptive policies adapt them.
- ``tree`` (one stream, ``max_tokens``): ``static-tree`` (depth 4, top-2, 8 nodes: the shape every
  tree policy starts from; the registry's ``static-tree`` when registered, else the static policy),
  ``static-tree-d2k2n4`` and ``static-tree-d6k2n12`` (other static shapes, so that "the best
  static tree" means something), and every tree policy the registry lists (``sage``,
  ``adt-tree``, ``eagle2-depth``).
- ``start`` (one stream, short requests of at most ``SHORT_TOKENS`` new tokens, where the first
  steps weigh most): ``cold``, the start policy (the deployment default, ``load-aware``) from the
  default window; ``warm``, the same from the window the cluster snapshot's prior gives the
  request (``start_window``, the hook, mirrors the target replica's warm start); and
  ``static-1`` .. ``static-8`` with their ``oracle-static`` on the same short requests: the gap
  that warm start should close. ``cold-tree`` and ``warm-tree``: a tree request of the tree
  start policy (``adt-tree`` unless ``--tree-start-policy``) from the start tree, or from the tree
  shape and the rule's carried state the snapshot's prior gives it, a fresh policy per request.
  Warm starts look the prior up under the prompt's task topic (the topic basis a replica's router
  fits, ``router/topics.py``); ``warm-by-length`` and ``warm-tree-by-length``: the same from the
  prompt's length bucket alone, as before topics, side by side.
  ``warm`` rows need ``--snapshot``, or ``--learn-snapshot N``: one learned in-process from N
  other prompts (``learn_snapshot``; with ``warm-tree``, decoded as trees too).
In ``window``, ``tree`` and ``start`` every row of one length decodes the prompt side by side
with the others, their steps taking turns in one thread (``SpecEngine.generate_side_by_side``), each
row's time the sum of its own steps: rows measured minutes apart on a shared machine differ by
more than the few percent the aims are about, rows taking turns per step see the same machine.
- ``load`` (the mix of all categories, ``load_requests`` requests): ``load-aware``
  (``build_policy("load-aware")``, one object per concurrency, kept across its rounds as a replica
  keeps it) against ``target-only`` (no draft), batched in every step as a replica batches them.
  ``steady`` (the default): at each concurrency c, every request goes through one scheduler per
  row that holds at most c at once (the next enters as one finishes), and the two rows' schedulers
  take turns step by step in one thread (``SpecEngine.generate_side_by_side``), each row's time
  the sum of its own steps; ``load_rounds`` rounds. ``waves``: the requests in waves of c at once,
  the rows alternating per wave. Why steady and step by step: a wave's makespan is its slowest
  request (the speculating ones finish first, the others end the wave), and whole runs of the same
  code seconds apart differ by more on a shared machine than rows that take turns per step
  (figures: docs/benchmarks.md §4.2).

Per row (policy × section × category, plus an ``all`` row over the categories; the load rows are
``all``): ``tokens_per_s`` = Σ tokens / Σ seconds over the requests, ``mean_accepted_len`` τ =
Σ emitted tokens / Σ steps (per request-step), and ``ratio`` = tokens_per_s over the section's
reference row (``ratio_to``: oracle-static, static-tree, oracle-static, target-only at the same
concurrency). ``requests`` in the JSON has every timed generation (wave, or steady round) with its
numbers; the ``aims`` are computed on the ``all`` rows (see ``aims``). A policy the registry does
not have yet is absent, and ``notes`` says so.
"""

from __future__ import annotations

import contextlib
import json
import logging
import time
from collections.abc import Sequence
from dataclasses import asdict, dataclass, field, replace
from pathlib import Path

from specserve.bench.engine import ALL, ZOO_TREE, machine_info
from specserve.cluster.config import AppConfig
from specserve.data.prompts import CATEGORIES, check_categories, load_prompts, topic_corpus
from specserve.policies.stats import request_bucket, task_bucket
from specserve.router.router_factory import RouterFactory, topic_basis
from specserve.replicas.step import TreeShape
from specserve.replicas.engine import NO_DRAFT, GenerateRequest, SpecEngine

STATIC_WINDOWS = tuple(range(1, 9))
ORACLE = "oracle-static"
STATIC_TREE = "static-tree"
TARGET_ONLY = "target-only"
LOAD_AWARE = "load-aware"
COLD, WARM = "cold", "warm"
# The same for a tree request: its shape and its rule's carried state from the snapshot, or not.
COLD_TREE, WARM_TREE = "cold-tree", "warm-tree"
# Warm starts from the prompt's length bucket alone, its task topic not asked (the priors' wider
# bucket, ``priors.find_prior``): what the topic adds, side by side.
WARM_LENGTH, WARM_TREE_LENGTH = "warm-by-length", "warm-tree-by-length"
WARM_ROWS = (WARM, WARM_TREE, WARM_LENGTH, WARM_TREE_LENGTH)
TREE_START_POLICY = "adt-tree"
SECTIONS = ("window", "tree", "start", "load")
# The window of a request that names none (the deployment's default): where every adaptive window
# policy and the cold start begin.
START_WINDOW = AppConfig.model_fields["default_window"].default
# The tree every tree policy starts from, the engine benchmark's (depth 4, top-2, 8 nodes), and
# other static shapes around it.
START_TREE = ZOO_TREE
STATIC_TREES = (TreeShape(2, 2, 4), START_TREE, TreeShape(6, 2, 12))
# Cold vs warm start is measured on short requests, where the first steps weigh most.
SHORT_TOKENS = 32
CONCURRENCY = (1, 4, 16)
LOAD_REQUESTS = 32
LOAD_MODES = ("steady", "waves")
LOAD_ROUNDS = 2
# ``--learn-snapshot``: the learning requests' new tokens and how many run at once (a warm row
# starts alone, so the costs of a request alone must be measured; 4 at once adds the b4 bucket).
LEARN_TOKENS = 64
LEARN_LEVELS = (1, 4)
# ... and the policy they decode with: a snapshot can only price windows some request used, and
# the deployment default (load-aware over the request's window of 4) never asks for more than 4;
# the online rule asks for 1-8 as α and the costs say, so every window's cost gets measured.
LEARN_POLICY = "online"
WARMUP_TOKENS = 16
# The policies the benchmark has rows for: the ones the registry lacks are reported absent, not failed.
WINDOW_POLICIES_EXPECTED = ("online", "fsm", "cache-fsm", "q-learning", "q-learning-per-request", "hf-heuristic")
TREE_POLICIES_EXPECTED = (STATIC_TREE, "sage", "adt-tree", "eagle2-depth")
# Registry names that are not rows of the window or tree sections: measured as static-k rows, or
# in the load section.
NOT_ADAPTIVE = ("static", LOAD_AWARE)


def static_name(window: int) -> str:
    return f"static-{window}"


def tree_name(shape: TreeShape) -> str:
    """``static-tree`` for the shape the tree policies start from, ``static-tree-d2k2n4`` for others."""
    return STATIC_TREE if shape == START_TREE else f"{STATIC_TREE}-d{shape.depth}k{shape.top_k}n{shape.budget}"


@dataclass(frozen=True)
class Row:
    """One configuration: a JSON row's ``policy`` in one section."""

    name: str
    section: str
    policy: str | None = None          # a registry name, built fresh per row; None: the static policy
    window: int = 0                    # γ the request asks for (where an adaptive policy starts)
    tree: TreeShape | None = None
    speculate: bool = True             # False: target-only (draft "none")
    start_hook: bool = False           # cold / warm: the start window comes from start_window()
    by_topic: bool = True              # a warm start looks its prior up with the prompt's task topic


# --- the registry, read at run time ---------------------------------------------------------


def registered_policies() -> tuple[tuple[str, ...], tuple[str, ...], set[str]]:
    """(window policy names, tree policy names, every registered name). The registry's own
    ``WINDOW_POLICY_NAMES`` / ``TREE_POLICY_NAMES`` when it has them, else those of the expected
    names (``WINDOW_POLICIES_EXPECTED``, ``TREE_POLICIES_EXPECTED``) that it registers: rows follow
    whatever is registered when the benchmark runs."""
    from specserve.policies import registry

    known = set(registry.POLICIES)
    window = getattr(registry, "WINDOW_POLICY_NAMES", None)
    tree = getattr(registry, "TREE_POLICY_NAMES", None)
    if window is None:
        window = tuple(n for n in WINDOW_POLICIES_EXPECTED if n in known)
    if tree is None:
        tree = tuple(n for n in TREE_POLICIES_EXPECTED if n in known)
    window = tuple(n for n in window if n not in NOT_ADAPTIVE)
    tree = tuple(n for n in tree if n not in NOT_ADAPTIVE)
    return window, tree, known


def build_policy(name: str | None):
    """A fresh policy object; None: the static policy (the request's own window or tree)."""
    from specserve.policies.registry import build_policy as build
    from specserve.replicas.request import StaticPolicy

    return StaticPolicy() if name is None else build(name)


def plan_rows(selected: Sequence[str] | None, window_policies: Sequence[str], tree_policies: Sequence[str],
              trees_ok: bool, snapshot_given: bool, start_policy: str,
              tree_start_policy: str = TREE_START_POLICY) -> tuple[list[Row], list[str]]:
    """The rows of a run, in canonical order (``oracle-static`` is derived, not a row run), and
    the notes on what is absent and why. ``selected`` (``--policies``) picks by row name; picking
    ``oracle-static`` runs every static window it needs, picking ``cold`` or ``warm`` runs the short
    static windows their gap is measured against, a tree policy brings ``static-tree`` and
    ``load-aware`` brings ``target-only`` (their ratios' references)."""
    static = [Row(static_name(w), "window", window=w) for w in STATIC_WINDOWS]
    windows = [Row(n, "window", policy=n, window=START_WINDOW) for n in window_policies]
    trees = [Row(tree_name(s), "tree", policy=STATIC_TREE if s == START_TREE and STATIC_TREE in tree_policies else None,
                 tree=s) for s in STATIC_TREES]
    trees += [Row(n, "tree", policy=n, tree=START_TREE) for n in tree_policies if n != STATIC_TREE]
    short_static = [Row(r.name, "start", window=r.window) for r in static]
    starts = [Row(COLD, "start", policy=start_policy, window=START_WINDOW, start_hook=True),
              Row(WARM, "start", policy=start_policy, window=START_WINDOW, start_hook=True),
              Row(WARM_LENGTH, "start", policy=start_policy, window=START_WINDOW, start_hook=True, by_topic=False)]
    tree_starts = [Row(COLD_TREE, "start", policy=tree_start_policy, tree=START_TREE, start_hook=True),
                   Row(WARM_TREE, "start", policy=tree_start_policy, tree=START_TREE, start_hook=True),
                   Row(WARM_TREE_LENGTH, "start", policy=tree_start_policy, tree=START_TREE, start_hook=True,
                       by_topic=False)]
    load = [Row(LOAD_AWARE, "load", policy=LOAD_AWARE, window=START_WINDOW), Row(TARGET_ONLY, "load", speculate=False)]

    registered = {*window_policies, *tree_policies}
    expected = [*WINDOW_POLICIES_EXPECTED, *TREE_POLICIES_EXPECTED]
    notes = [f"policy {n!r} is not registered in specserve.policies.registry yet: no rows for it"
             for n in expected if n not in registered and n != STATIC_TREE]
    if STATIC_TREE not in registered:
        notes.append(f"{STATIC_TREE!r} is not registered: its row is the static policy on the request's tree "
                     f"(depth {START_TREE.depth}, top-{START_TREE.top_k}, {START_TREE.budget} nodes)")

    known = {r.name for r in [*static, *windows, *trees, *starts, *tree_starts, *load]} | {ORACLE} | set(expected)
    wanted = known if selected is None else {n.strip() for n in selected if n.strip()}
    unknown = wanted - known
    if unknown:
        raise ValueError(f"unknown policy row(s) {', '.join(sorted(unknown))}; choose from "
                         f"{', '.join(r.name for r in [*static, *windows, *trees, *starts, *tree_starts, *load])}, {ORACLE}"
                         f" (not registered yet: {', '.join(n for n in expected if n not in registered) or 'none'})")

    rows = [r for r in static if r.name in wanted or ORACLE in wanted]
    rows += [r for r in windows if r.name in wanted]
    # An adaptive tree row's ratio is to static-tree (one generation more per prompt): run it too.
    tree_rows = [r for r in trees if r.name in wanted or (r.name == STATIC_TREE and wanted & set(tree_policies))]
    if tree_rows and not trees_ok:
        notes.append("the draft builds no trees (no propose_tree): no tree rows")
        tree_rows = []
    rows += tree_rows
    if {COLD, WARM, WARM_LENGTH} & wanted:
        rows += short_static
        rows.append(starts[0])
        if snapshot_given:
            rows += [r for r in starts[1:] if r.name == WARM or r.name in wanted]
        else:
            notes.append("warm: no --snapshot given, so no warm rows (give a policy snapshot: `GET /v1/policy`'s "
                         "body or the snapshot document itself)")
    if {COLD_TREE, WARM_TREE, WARM_TREE_LENGTH} & wanted and trees_ok:
        rows.append(tree_starts[0])
        if snapshot_given:
            rows += [r for r in tree_starts[1:] if r.name == WARM_TREE or r.name in wanted]
        elif WARM_TREE in wanted and selected is not None:
            notes.append("warm-tree: no --snapshot given, so no warm-tree row")
    if LOAD_AWARE in wanted:
        rows += load   # load-aware's ratio needs target-only beside it
    elif TARGET_ONLY in wanted:
        rows.append(load[1])
    return rows, notes


# --- warm start: the hook -------------------------------------------------------------------


def read_snapshot(data: object) -> dict:
    """The snapshot document from ``--snapshot``'s JSON: ``GET /v1/policy``'s body
    (``{"object": "policy_snapshot", "snapshot": {...}}``) or the document itself
    (``specserve.policies.priors.compute_snapshot``'s ``{"format", "priors": [...]}``)."""
    from specserve.policies.priors import SNAPSHOT_FORMAT

    if isinstance(data, dict) and isinstance(data.get("snapshot"), dict):
        data = data["snapshot"]
    if not isinstance(data, dict) or not isinstance(data.get("priors", []), list):
        # A ValueError like every other bad argument: the CLI reports those as the user's mistake.
        raise ValueError(f"--snapshot: expected a JSON object with a 'priors' list (GET /v1/policy's body or the "  # noqa: TRY004
                         f"snapshot itself), got {type(data).__name__}")
    if data.get("format", SNAPSHOT_FORMAT) != SNAPSHOT_FORMAT:
        raise ValueError(f"--snapshot: snapshot format {data.get('format')!r}; this benchmark reads format "
                         f"{SNAPSHOT_FORMAT} (specserve.policies.priors)")
    return data


def start_window(prompt_ids: Sequence[int], draft: str, target: str, snapshot: dict | None = None,
                 default_window: int = START_WINDOW, topic: int | None = None) -> tuple[int, dict | None]:
    """The window a request starts from, and the warm start it came from (None: a cold start):
    the target replica's own rule (``policies.priors.warm_start``, under the prompt's task
    ``topic`` when given), else the deployment's default."""
    from specserve.policies.priors import warm_start

    bucket = task_bucket(len(prompt_ids), topic=topic)
    start = warm_start(snapshot, target, draft, bucket, batch_size=1)   # one request at a time
    return (default_window, None) if start is None else (start["window"], start)


class Collecting:
    """A policy that also counts every step in a replica's statistics collector, as a target
    replica does (``ReplicaLearning``: ``start`` per request, ``observe`` per step)."""

    def __init__(self, policy, collector):
        self.policy, self.collector = policy, collector
        self._started: set[str] = set()

    def choose(self, state, batch_size: int):
        if state.id not in self._started:
            self._started.add(state.id)
            self.collector.start(state.id, state.request.draft, request_bucket(state.request))
        return self.policy.choose(state, batch_size)

    def observe(self, record) -> None:
        self.collector.observe(record)
        self.policy.observe(record)


def learns_trees(rows: Sequence[Row]) -> bool:
    """A warm tree row runs: the snapshot's learners decode trees too."""
    return any(r.name in (WARM_TREE, WARM_TREE_LENGTH) for r in rows)


def learn_snapshot(engine: SpecEngine, draft: str, prompts: list[list[int]], policy: str,
                   max_tokens: int = LEARN_TOKENS, levels: Sequence[int] = LEARN_LEVELS,
                   tree_policy: str | None = None, topics: Sequence[int | None] | None = None) -> dict:
    """A snapshot learned in-process from ``prompts`` (none of the measured ones): they are decoded
    with ``policy`` from the default window at each of ``levels`` requests at once, and with
    ``tree_policy`` (when given) from each of ``STATIC_TREES`` in turn, counted by a replica's
    ``StatsCollector`` (the tree rule's carried state too, as a replica counts it) and priced by the policy service's
    ``compute_snapshot``: the counters and the maths of the cluster's snapshot, without Redis or a
    cluster. ``topics``: each prompt's task topic, counted in its bucket as a replica counts it."""
    from specserve.policies.per_request import Carries
    from specserve.policies.priors import compute_snapshot
    from specserve.policies.stats import StatsCollector

    collector = StatsCollector(engine.loaded.name)
    runs = [(policy, START_WINDOW, (None,))] + ([(tree_policy, 0, STATIC_TREES)] if tree_policy else [])
    for name, window, shapes in runs:
        for level, c in enumerate(levels):
            engine.reset_caches()
            # Tree learners start from each static shape in turn: a snapshot prices only the
            # shapes requests used, and a rule's own walk uses the shapes its state favours.
            requests = [GenerateRequest("", max_tokens, draft, window, shapes[(i + level) % len(shapes)], topic=topic)
                        for i, topic in enumerate(topics or [None] * len(prompts))]
            learner = build_policy(name)
            if isinstance(learner, Carries):   # a rule whose state carries: counted as a replica counts it
                learner.carried.sinks.append(collector.carry)
            engine.generate_batch_ids(prompts, requests, policy=Collecting(learner, collector), max_running=c)
    return compute_snapshot(collector.drain())


# --- the run -------------------------------------------------------------------------------


@dataclass
class Sample:
    """One timed generation (or, in the load section, one wave or one steady round of requests)."""

    policy: str
    section: str
    category: str
    request: int               # index into the run's prompts (the first request of a wave; a steady round's number)
    max_tokens: int
    concurrency: int
    tokens: int
    seconds: float
    steps: int                 # request-steps
    emitted: int
    start_window: int | None = None   # cold / warm: where the request started (a tree's depth) ...
    prior: bool | None = None         # ... and whether from a prior of the snapshot
    chosen: str | None = None         # oracle-static: the static window it took

    @property
    def tokens_per_s(self) -> float:
        return self.tokens / self.seconds if self.seconds else 0.0


@dataclass
class Run:
    """Everything one run needs besides the rows."""

    engine: SpecEngine
    draft: str
    snapshot: dict | None
    policies: dict[tuple, object] = field(default_factory=dict)   # (row, section, key) -> a policy object
    basis: object | None = None   # the replica's topic basis (``routing.topics.TopicBasis``); None: no topics

    def topic(self, prompt_ids: Sequence[int]) -> int | None:
        return None if self.basis is None else self.basis.topic(prompt_ids)

    def policy(self, row: Row, key: str):
        """The row's policy object, created on first use (fresh per row) and kept across its requests."""
        k = (row.name, row.section, key)
        if k not in self.policies:
            self.policies[k] = build_policy(row.policy)
        return self.policies[k]


def row_request(run: Run, row: Row, prompt_ids: list[int], max_tokens: int) -> tuple[GenerateRequest, tuple]:
    """The request a row sends (not pinned: the engine's requests never are, so adaptive policies
    adapt it), and for cold / warm rows (start window, whether a prior gave it)."""
    if not row.speculate:
        return GenerateRequest("", max_tokens, NO_DRAFT, 0), (None, None)
    window, tree, start, prior_alpha, learned = row.window, row.tree, (None, None), None, None
    topic = run.topic(prompt_ids)
    if row.start_hook:
        snapshot = run.snapshot if row.name in WARM_ROWS else None
        start_at, prior = start_window(prompt_ids, run.draft, run.engine.loaded.name, snapshot,
                                       topic=topic if row.by_topic else None)
        if prior is not None:
            prior_alpha, learned = prior["alpha"], {"version": prior["version"], "sums": prior["learned"]}
        if tree is None:
            window = start_at
        elif prior is not None and prior["tree"] is not None:   # the target replica's rule (ReplicaLearning.start)
            tree = replace(tree, depth=prior["tree"][0], top_k=prior["tree"][1])
        start = (window if tree is None else tree.depth, prior is not None)
    return GenerateRequest("", max_tokens, run.draft, window, tree, prior_alpha=prior_alpha, prior_learned=learned,
                           topic=topic), start


def timed(run: Run, row: Row, prompts: list[list[int]], max_tokens: int, policy) -> tuple[list, float, list]:
    requests, starts = zip(*(row_request(run, row, ids, max_tokens) for ids in prompts))
    # Slots keep their longest common prefix with the next request, so the previous row's run on
    # this prompt would spare this one the prefill: every generation starts cold.
    run.engine.reset_caches()
    start = time.perf_counter()
    gens = run.engine.generate_batch_ids(prompts, list(requests), policy=policy)
    return gens, time.perf_counter() - start, list(starts)


def measure(run: Run, rows: list[Row], prompts: list[tuple[str, list[int]]], load_prompts_: list[list[int]],
            max_tokens: int, concurrency: Sequence[int], bar=None, load_mode: str = "steady",
            load_rounds: int = LOAD_ROUNDS) -> list[Sample]:
    """Warm every row up once, then each prompt with its rows side by side, then the load rows."""
    short = min(SHORT_TOKENS, max_tokens)

    def tokens_of(row: Row) -> int:
        return short if row.section == "start" else max_tokens

    single = [r for r in rows if r.section != "load"]
    load = [r for r in rows if r.section == "load"]
    # Warm-up with throwaway policies, so that the timed rows' policies start fresh.
    for row in [*single, *load]:
        timed(run, row, [prompts[0][1]], min(max_tokens, WARMUP_TOKENS), build_policy(row.policy))
    samples: list[Sample] = []
    for i, (category, ids) in enumerate(prompts):
        # The rows of one length decode this prompt side by side, their steps taking turns.
        for tokens in sorted({tokens_of(r) for r in single}):
            mine = [r for r in single if tokens_of(r) == tokens]
            if bar is not None:
                bar.set_postfix_str(f"{category} prompt {i + 1}, {len(mine)} rows side by side ({tokens} tokens)")
            asks = [row_request(run, row, ids, tokens) for row in mine]
            # A tree start row's policy is fresh per request: its rule's carried state is then the
            # snapshot's alone (warm-tree) or none (cold-tree), the start each row is about.
            out = run.engine.generate_side_by_side(
                [ids], [([request], run.policy(row, f"{category}/{i}" if row.tree and row.start_hook else category))
                        for row, (request, _) in zip(mine, asks)], max_running=1)
            for row, (_, start), ((gen,), seconds) in zip(mine, asks, out):
                samples.append(Sample(row.name, row.section, category, i, tokens, 1, len(gen.token_ids), seconds,
                                      gen.stats.steps, gen.stats.emitted, *start))
            if bar is not None:
                bar.update(len(mine))
    if load and load_mode == "steady":
        samples += steady(run, load, load_prompts_, max_tokens, concurrency, load_rounds, bar)
        return samples
    for c in concurrency if load else ():
        for w, first in enumerate(range(0, len(load_prompts_), c)):
            wave = load_prompts_[first:first + c]
            for row in (load if w % 2 == 0 else load[::-1]):
                if bar is not None:
                    bar.set_postfix_str(f"{row.name} at {c}")
                gens, seconds, _ = timed(run, row, wave, max_tokens, run.policy(row, str(c)))
                samples.append(Sample(row.name, "load", ALL, first, max_tokens, c, sum(len(g.token_ids) for g in gens),
                                      seconds, sum(g.stats.steps for g in gens), sum(g.stats.emitted for g in gens)))
                if bar is not None:
                    bar.update()
    return samples


def steady(run: Run, rows: list[Row], load_prompts_: list[list[int]], max_tokens: int, concurrency: Sequence[int],
           rounds: int, bar=None) -> list[Sample]:
    """Per concurrency c and round, every load row decodes all of ``load_prompts_`` with at most c
    at once, the rows' steps taking turns; a sample per (row, round)."""
    samples = []
    for c in concurrency:
        for k in range(rounds):
            if bar is not None:
                bar.set_postfix_str(f"{' and '.join(r.name for r in rows)} at {c}, steady, round {k + 1}")
            runs = []
            for row in rows:
                requests, _ = zip(*(row_request(run, row, ids, max_tokens) for ids in load_prompts_))
                runs.append((list(requests), run.policy(row, str(c))))
            out = run.engine.generate_side_by_side(load_prompts_, runs, max_running=c)
            for row, (gens, seconds) in zip(rows, out):
                samples.append(Sample(row.name, "load", ALL, k, max_tokens, c, sum(len(g.token_ids) for g in gens),
                                      seconds, sum(g.stats.steps for g in gens), sum(g.stats.emitted for g in gens)))
            if bar is not None:
                bar.update(len(rows))
    return samples


def count_generations(rows: list[Row], prompts: int, load_requests: int, concurrency: Sequence[int],
                      load_mode: str = "steady", load_rounds: int = LOAD_ROUNDS) -> int:
    single = sum(r.section != "load" for r in rows)
    load = sum(r.section == "load" for r in rows)
    if load_mode == "steady":
        return prompts * single + load * load_rounds * len(concurrency)
    return prompts * single + load * sum(-(-load_requests // c) for c in concurrency)


def oracle_samples(samples: list[Sample]) -> list[Sample]:
    """Per request and section, the static window that was fastest on it: ``oracle-static``.
    Only where every window 1..8 ran on that request (a partial oracle would be no oracle)."""
    wanted = {static_name(w) for w in STATIC_WINDOWS}
    by_request: dict[tuple[str, int], list[Sample]] = {}
    for s in samples:
        if s.policy in wanted and s.section in ("window", "start"):
            by_request.setdefault((s.section, s.request), []).append(s)
    oracle = []
    for (section, _), group in sorted(by_request.items()):
        if {s.policy for s in group} == wanted:
            # Ties go to the smaller window (the cheaper one to draft).
            best = max(group, key=lambda s: (s.tokens_per_s, -int(s.policy.removeprefix("static-"))))
            oracle.append(Sample(ORACLE, section, best.category, best.request, best.max_tokens, 1, best.tokens,
                                 best.seconds, best.steps, best.emitted, chosen=best.policy))
    return oracle


REFERENCE = {"window": ORACLE, "tree": STATIC_TREE, "start": ORACLE, "load": TARGET_ONLY}


def aggregate(samples: list[Sample], row_order: Sequence[str], categories: Sequence[str]) -> list[dict]:
    """One row per (section, category, concurrency, policy), ``all`` over the categories."""
    order = {name: i for i, name in enumerate(row_order)}
    rows = []
    for section in SECTIONS:
        mine = [s for s in samples if s.section == section]
        groups = [ALL] if section == "load" else [*categories, ALL]
        for category in groups:
            in_category = [s for s in mine if category == ALL or s.category == category]
            for c in sorted({s.concurrency for s in in_category}):
                group = [s for s in in_category if s.concurrency == c]
                names = sorted({s.policy for s in group}, key=lambda n: order.get(n, len(order)))
                stats = {n: _totals([s for s in group if s.policy == n]) for n in names}
                reference = stats.get(REFERENCE[section])
                for n in names:
                    tokens, seconds, steps, emitted, count = stats[n]
                    tps = tokens / seconds if seconds else 0.0
                    ref_tps = reference[0] / reference[1] if reference and reference[1] else None
                    rows.append({
                        "policy": n, "category": category, "concurrency": c,
                        "tokens_per_s": round(tps, 3),
                        "mean_accepted_len": round(emitted / steps, 4) if steps else None,
                        "section": section,
                        "max_tokens": group[0].max_tokens,
                        "ratio": round(tps / ref_tps, 4) if ref_tps else None,
                        "ratio_to": REFERENCE[section],
                        "tokens": tokens, "seconds": round(seconds, 4), "requests": count,
                    })
    return rows


def _totals(group: list[Sample]) -> tuple[int, float, int, int, int]:
    return (sum(s.tokens for s in group), sum(s.seconds for s in group), sum(s.steps for s in group),
            sum(s.emitted for s in group), len(group))


def aims(rows: list[dict], window_policies: Sequence[str], tree_policies: Sequence[str]) -> dict:
    """What the policies should reach, on the ``all`` rows: online at least as fast as the best
    static window and within 3% of the oracle, a tree policy at least as fast as the best static
    tree, warm start closing half of cold start's gap to the oracle, a tree request 5% faster
    from the snapshot's tree prior than cold, Q-learning's table carried
    across requests at least as fast as a fresh table per request, and load-aware never slower
    than target-only. A value is None where its rows were not run."""
    def tps(section: str, name: str, c: int = 1) -> float | None:
        return next((r["tokens_per_s"] for r in rows if r["section"] == section and r["category"] == ALL
                     and r["policy"] == name and r["concurrency"] == c), None)

    def ratio(a: float | None, b: float | None) -> float | None:
        return round(a / b, 4) if a is not None and b else None

    online, oracle = tps("window", "online"), tps("window", ORACLE)
    statics = [v for v in (tps("window", static_name(w)) for w in STATIC_WINDOWS) if v is not None]
    static_trees = [v for v in (tps("tree", tree_name(s)) for s in STATIC_TREES) if v is not None]
    tree_adaptive = [v for v in (tps("tree", n) for n in tree_policies if n != STATIC_TREE) if v is not None]
    cold, warm, short_oracle = tps("start", COLD), tps("start", WARM), tps("start", ORACLE)
    cold_tree, warm_tree = tps("start", COLD_TREE), tps("start", WARM_TREE)
    gap = (round((warm - cold) / (short_oracle - cold), 4)
           if None not in (cold, warm, short_oracle) and short_oracle != cold else None)
    load = [r["ratio"] for r in rows if r["section"] == "load" and r["policy"] == LOAD_AWARE and r["ratio"] is not None]
    # "Best static" means the best of all of them: with part of them run, the aim is not measured.
    best_static = max(statics) if len(statics) == len(STATIC_WINDOWS) else None
    best_static_tree = max(static_trees) if len(static_trees) == len(STATIC_TREES) else None
    found = {
        "online_vs_best_static": (ratio(online, best_static), 1.0),
        "online_vs_oracle": (ratio(online, oracle), 0.97),
        "best_tree_policy_vs_best_static_tree": (ratio(max(tree_adaptive, default=None), best_static_tree), 1.0),
        "warm_share_of_cold_to_oracle_gap_closed": (gap, 0.5),
        "warm_tree_vs_cold_tree": (ratio(warm_tree, cold_tree), 1.05),
        "q_learning_carried_vs_per_request": (ratio(tps("window", "q-learning"), tps("window", "q-learning-per-request")), 1.0),
        "load_aware_vs_target_only_lowest": (min(load, default=None), 1.0),
    }
    return {name: {"value": value, "aim": f">= {aim}", "met": None if value is None else value >= aim}
            for name, (value, aim) in found.items()}


# --- reporting -----------------------------------------------------------------------------


def format_table(rows: list[dict]) -> str:
    header = f"{'policy':20s} {'section':7s} {'category':10s} {'conc':>4s} {'tok/s':>8s} {'ratio':>7s} {'to':14s} {'τ':>6s} {'tokens':>7s} {'s':>8s}"
    lines = [header, "-" * len(header)]
    previous = None
    for r in rows:
        key = (r["section"], r["category"])
        if previous is not None and key != previous:
            lines.append("")
        previous = key
        tau = f"{r['mean_accepted_len']:.2f}" if r["mean_accepted_len"] is not None else "-"
        ratio = f"{r['ratio']:.3f}" if r["ratio"] is not None else "-"
        lines.append(f"{r['policy']:20s} {r['section']:7s} {r['category']:10s} {r['concurrency']:4d} "
                     f"{r['tokens_per_s']:8.2f} {ratio:>7s} {r['ratio_to']:14s} {tau:>6s} {r['tokens']:7d} {r['seconds']:8.2f}")
    return "\n".join(lines)


SECTION_COLOURS = {"window": "tab:blue", "tree": "tab:green", "start": "tab:orange", "load": "tab:purple"}


def plot(rows: list[dict], categories: Sequence[str], meta: dict, path: Path) -> None:
    """One figure: a panel per category (and ``all``) with a bar of tokens/s per policy, coloured
    by section (short-request rows marked ``≤N``), the ratio to the section's reference over each
    bar; a last panel with the load rows by concurrency."""
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt
    from matplotlib.patches import Patch

    panels = [*categories, ALL]
    load = [r for r in rows if r["section"] == "load"]
    count = len(panels) + (1 if load else 0)
    cols = min(3, count)
    grid_rows = -(-count // cols)
    fig, axes = plt.subplots(grid_rows, cols, figsize=(7.0 * cols, 4.6 * grid_rows), squeeze=False)
    flat = list(axes.flat)
    for ax, category in zip(flat, panels):
        mine = [r for r in rows if r["category"] == category and r["section"] != "load"]
        labels = [r["policy"] if r["section"] != "start" else f"{r['policy']} (≤{r['max_tokens']})" for r in mine]
        bars = ax.bar(range(len(mine)), [r["tokens_per_s"] for r in mine],
                      color=[SECTION_COLOURS[r["section"]] for r in mine])
        top = max((r["tokens_per_s"] for r in mine), default=1.0) or 1.0
        for bar, r in zip(bars, mine):
            if r["ratio"] is not None:
                ax.text(bar.get_x() + bar.get_width() / 2, bar.get_height() + 0.01 * top, f"{r['ratio']:.2f}",
                        ha="center", va="bottom", rotation=90, fontsize=6)
        ax.set_xticks(range(len(mine)), labels, rotation=70, ha="right", fontsize=7)
        ax.set_ylim(0, top * 1.2)
        ax.set_ylabel("tokens / s (one stream)")
        ax.set_title(category, fontsize=10)
        ax.grid(axis="y", alpha=0.3)
    if load:
        ax = flat[len(panels)]
        levels = sorted({r["concurrency"] for r in load})
        names = list(dict.fromkeys(r["policy"] for r in load))
        width = 0.8 / len(names)
        by_key = {(r["policy"], r["concurrency"]): r for r in load}
        for j, name in enumerate(names):
            xs = [i + (j - (len(names) - 1) / 2) * width for i in range(len(levels))]
            found = [by_key.get((name, c)) for c in levels]
            bars = ax.bar(xs, [r["tokens_per_s"] if r else 0.0 for r in found], width, label=name)
            for bar, r in zip(bars, found):
                if r and r["ratio"] is not None:
                    ax.text(bar.get_x() + bar.get_width() / 2, bar.get_height(), f"{r['ratio']:.2f}x",
                            ha="center", va="bottom", fontsize=7)
        ax.set_xticks(range(len(levels)), [str(c) for c in levels])
        ax.set_xlabel("requests at once")
        ax.set_ylabel("tokens / s (all requests)")
        how = (f"at most c at once, rows taking turns per step, {meta['load_rounds']} rounds"
               if meta["load_mode"] == "steady" else "in waves of c")
        ax.set_title(f"load: {meta['load_requests']} requests of the mix, {how}", fontsize=10)
        ax.legend(fontsize=8)
        ax.grid(axis="y", alpha=0.3)
    for ax in flat[count:]:
        ax.axis("off")
    machine = meta["machine"]
    handles = [Patch(color=c, label=s) for s, c in SECTION_COLOURS.items() if s != "load"]
    fig.legend(handles=handles, loc="upper left", fontsize=8)
    fig.suptitle(
        f"{meta['target']} {meta['dtype']}, draft {meta['draft']}, greedy, {meta['max_tokens']} new tokens "
        f"(start rows {meta['short_max_tokens']}), {meta['prompts_per_category']} prompts/category; "
        f"{machine.get('cpu_model', '')}, {machine['torch_threads']} threads, load {machine['load_avg_1m']}\n"
        f"labels: ratio to oracle-static (window, start), static-tree (tree), target-only (load)",
        fontsize=9,
    )
    fig.tight_layout(rect=(0, 0, 1, 0.95))
    path.parent.mkdir(parents=True, exist_ok=True)
    fig.savefig(path, dpi=110)
    plt.close(fig)


def resolve_draft(draft: str) -> tuple[str, list[str]]:
    """(the draft's name in the engine, the draft models to load)."""
    from specserve.replicas.drafts.prompt_lookup import PromptLookupDraft
    from specserve.replicas.model_store import zoo_dir, zoo_drafts

    if draft == PromptLookupDraft.name:
        return draft, []
    if draft == NO_DRAFT:
        raise ValueError("--draft none cannot speculate: the window and tree rows need a draft "
                         "(target-only is measured in the load rows)")
    if (zoo_dir() / draft / "config.json").exists():
        return draft, [draft]
    if Path(draft).is_dir():
        return Path(draft).name, [draft]
    raise ValueError(f"unknown draft {draft!r}; choose prompt-lookup, a zoo draft "
                     f"({', '.join(zoo_drafts()) or 'none exported'}) or a model folder")


@contextlib.contextmanager
def quiet_draft_servers():
    """Every generation starts from fresh caches, and each in-process draft server says "ready" at
    INFO when made: hundreds of lines through the progress bar. Warnings still show."""
    log = logging.getLogger("ray.serve")
    level = log.level
    log.setLevel(max(level, logging.WARNING))
    try:
        yield
    finally:
        log.setLevel(level)


@dataclass(frozen=True, kw_only=True)
class PoliciesBenchConfig:
    """What one run measures and where it writes (``specserve bench policies``'s options, with its
    defaults). Checked when made, before any model loads, so that a mistake costs no waiting; the
    names that need the registry or the zoo (policies, drafts) are checked by the run, also before."""

    json_path: Path = Path("bench-policies.json")   # rows, aims, notes and every timed generation
    plot_path: Path = Path("bench-policies.png")    # a panel per category, and the load rows
    prompts_per_category: int = 2      # one stream each, every row: a run's time grows with it
    max_tokens: int = 96               # new tokens per request; the cold / warm rows take at most SHORT_TOKENS
    categories: tuple[str, ...] = CATEGORIES   # the prompt sets (checked; blanks and repeats dropped)
    policies: tuple[str, ...] | None = None    # row names to run (and what they are measured against); None: all
    draft: str = "prompt-lookup"       # of every speculating row; prompt lookup needs no model
    concurrency: tuple[int, ...] = CONCURRENCY   # requests at once in the load rows: alone, a few, many
    load_requests: int = LOAD_REQUESTS   # of the category mix, per load row and round: 16 at once binds
    load_mode: str = "steady"          # steady or waves (see the module's docstring for why steady)
    load_rounds: int = LOAD_ROUNDS     # steady rounds per concurrency, the figures over all of them
    snapshot: dict | None = None       # a policy snapshot for the warm rows (``read_snapshot`` reads it)
    learn_snapshot_requests: int = 0   # instead of ``snapshot``: learn one from this many other prompts
    learn_policy: str = LEARN_POLICY   # what those requests decode with: a snapshot prices only windows used
    start_policy: str | None = None    # of the cold and warm rows; None: the deployment default
    tree_start_policy: str = TREE_START_POLICY   # of the cold-tree and warm-tree rows
    # What the learning requests' trees decode with; None: the tree start policy. A snapshot
    # prices only the tree shapes some request used: an adaptive rule tries many, a static one one.
    learn_tree_policy: str | None = None
    dtype: str = "auto"                # bfloat16 where the CPU has it natively, else float32; every row the same

    def __post_init__(self) -> None:
        if self.prompts_per_category < 1:
            raise ValueError(f"--prompts must be >= 1, got {self.prompts_per_category}")
        if self.max_tokens < 1:
            raise ValueError(f"--max-tokens must be >= 1, got {self.max_tokens}")
        if self.load_requests < 1 or not self.concurrency or min(self.concurrency) < 1:
            raise ValueError(f"--load-requests and every --concurrency must be >= 1, got {self.load_requests} and "
                             f"{list(self.concurrency)}")
        if self.load_mode not in LOAD_MODES:
            raise ValueError(f"--load-mode: choose from {', '.join(LOAD_MODES)}, got {self.load_mode!r}")
        if self.load_rounds < 1:
            raise ValueError(f"--load-rounds must be >= 1, got {self.load_rounds}")
        # Frozen: the checked names replace the given ones through object.__setattr__.
        object.__setattr__(self, "categories", tuple(check_categories(self.categories)))
        if self.learn_snapshot_requests < 0 or (self.learn_snapshot_requests and self.snapshot is not None):
            raise ValueError("--learn-snapshot takes a number of requests >= 1 and replaces --snapshot: give one of them")


def _checked_names(config: PoliciesBenchConfig) -> tuple[str, str, tuple, tuple]:
    """(start policy, tree policy to learn with, window policies, tree policies), every name
    checked against the registry and the rows planned once, before anything is loaded."""
    from specserve.policies.registry import DEFAULT_POLICY

    start_policy = config.start_policy or DEFAULT_POLICY
    window_policies, tree_policies, registered = registered_policies()
    learn_tree_policy = config.learn_tree_policy or config.tree_start_policy
    for option, name in (("start policy", start_policy), ("tree start policy", config.tree_start_policy),
                         ("--learn-tree-policy", learn_tree_policy)):
        if name not in registered:
            raise ValueError(f"{option} {name!r} is not registered; choose from {', '.join(sorted(registered))}")
    if config.learn_policy not in registered:
        raise ValueError(f"--learn-policy {config.learn_policy!r} is not registered; choose from "
                         f"{', '.join(sorted(registered))}")
    plan_rows(config.policies, window_policies, tree_policies, True,
              config.snapshot is not None or bool(config.learn_snapshot_requests), start_policy,
              config.tree_start_policy)
    return start_policy, learn_tree_policy, window_policies, tree_policies


@dataclass
class _Prompts:
    """The run's prompts as ids: the single-stream ones (category, ids; the first per category),
    the load rows' mix (round robin, as many distinct prompts as they need) and the snapshot's
    learning prompts (others)."""

    single: list[tuple[str, list[int]]]
    mix: list[list[int]]
    learn: list[list[int]]

    @staticmethod
    def per_category(config: PoliciesBenchConfig) -> tuple[int, int]:
        """(prompts per category the rows take, others per category the snapshot learns from)."""
        n = len(config.categories)
        return (max(config.prompts_per_category, -(-config.load_requests // n)),
                -(-config.learn_snapshot_requests // n))

    @classmethod
    def texts(cls, config: PoliciesBenchConfig) -> dict[str, list[str]]:
        """Loaded before the model, so that a missing dataset costs no waiting."""
        return {c: load_prompts(c, sum(cls.per_category(config))) for c in config.categories}

    @classmethod
    def encoded(cls, config: PoliciesBenchConfig, engine: SpecEngine, texts: dict[str, list[str]]) -> "_Prompts":
        categories = list(config.categories)
        per_category, learn_per_category = cls.per_category(config)
        encoded = {c: [engine.encode(t, chat=True) for t in ts] for c, ts in texts.items()}
        single = [(c, encoded[c][i]) for c in categories for i in range(config.prompts_per_category)]
        mix = [encoded[c][i] for i in range(per_category) for c in categories][:config.load_requests]
        learn = [encoded[c][per_category + i] for i in range(learn_per_category)
                 for c in categories][:config.learn_snapshot_requests]
        return cls(single, mix, learn)


def run_policies_bench(config: PoliciesBenchConfig, engine: SpecEngine | None = None, progress: bool = True) -> dict:
    """Run every row on the same prompts; write JSON and plot, print a table; return the JSON.
    ``engine``: one already loaded (its dtype and drafts are used as they are); ``progress``: a
    progress bar on stderr."""
    from tqdm import tqdm

    # Check the names and load the prompts before the model, so that a mistake costs no waiting.
    start_policy, learn_tree_policy, window_policies, tree_policies = _checked_names(config)
    snapshot = None if config.snapshot is None else read_snapshot(config.snapshot)
    learning = bool(config.learn_snapshot_requests)
    draft_name, draft_models = resolve_draft(config.draft)
    texts = _Prompts.texts(config)

    machine_before = machine_info()
    if engine is None:
        engine = SpecEngine.load(dtype=config.dtype, draft_models=draft_models)
    if draft_name not in engine.drafts:
        raise ValueError(f"the engine has no draft {draft_name!r}; it has {', '.join(engine.drafts)}")
    trees_ok = callable(getattr(engine.drafts[draft_name], "propose_tree", None))
    rows_run, notes = plan_rows(config.policies, window_policies, tree_policies, trees_ok, snapshot is not None or learning,
                                start_policy, config.tree_start_policy)
    prompts = _Prompts.encoded(config, engine, texts)
    basis = topic_basis(engine.loaded.name, engine.tokenizer, topic_corpus, RouterFactory.topic_dims)   # a replica's
    trees_learned = learning and learns_trees(rows_run)
    if learning and any(r.name in WARM_ROWS for r in rows_run):
        snapshot = _learned_snapshot(config, engine, draft_name, prompts.learn, learn_tree_policy if trees_learned else None,
                                     basis, notes, progress)

    run = Run(engine, draft_name, snapshot, basis=basis)
    total = count_generations(rows_run, len(prompts.single), config.load_requests, config.concurrency,
                              config.load_mode, config.load_rounds)
    with tqdm(total=total, desc="bench policies", unit="gen", disable=not progress) as bar, quiet_draft_servers():
        samples = measure(run, rows_run, prompts.single, prompts.mix, config.max_tokens, config.concurrency, bar,
                          config.load_mode, config.load_rounds)
    samples += oracle_samples(samples)
    order = [*dict.fromkeys(r.name for r in rows_run)]
    order.insert(order.index(static_name(8)) + 1 if static_name(8) in order else 0, ORACLE)
    rows = aggregate(samples, order, list(config.categories))
    if snapshot is not None:
        warm = [s for s in samples if s.policy == WARM]
        found = sum(bool(s.prior) for s in warm)
        notes.append(f"warm: {found} of {len(warm)} requests found a prior for target {engine.loaded.name!r}, draft "
                     f"{draft_name!r} in the snapshot (the others started cold, at window {START_WINDOW})")

    meta = {
        "target": engine.loaded.name,
        "dtype": str(engine.loaded.model.dtype).removeprefix("torch."),
        "dtype_requested": config.dtype,
        "draft": draft_name,
        "max_tokens": config.max_tokens,
        "short_max_tokens": min(SHORT_TOKENS, config.max_tokens),
        "prompts_per_category": config.prompts_per_category,
        "categories": list(config.categories),
        "prompt_tokens": {c: [len(ids) for cat, ids in prompts.single if cat == c] for c in config.categories},
        "concurrency": list(config.concurrency),
        "load_requests": config.load_requests,
        "load_mode": config.load_mode,
        "load_rounds": config.load_rounds if config.load_mode == "steady" else None,
        "start_window": START_WINDOW,
        "start_tree": asdict(START_TREE),
        "static_trees": {tree_name(s): asdict(s) for s in STATIC_TREES},
        "start_policy": start_policy,
        "tree_start_policy": config.tree_start_policy,
        "snapshot_trees_learned_with": learn_tree_policy if trees_learned else None,
        "prompt_topics": {c: [run.topic(ids) for cat, ids in prompts.single if cat == c] for c in config.categories},
        "window_policies": list(window_policies),
        "tree_policies": list(tree_policies),
        "rows_run": order,
        "snapshot": None if snapshot is None else {k: snapshot.get(k) for k in ("format", "version", "computed_at")},
        "snapshot_learned_from": config.learn_snapshot_requests or None,
        "snapshot_learned_with": config.learn_policy if learning else None,
        "machine": machine_before,
        "load_avg_1m_after": machine_info()["load_avg_1m"],
    }
    report = {"meta": meta, "notes": notes, "aims": aims(rows, window_policies, tree_policies), "rows": rows,
              "requests": [asdict(s) for s in samples]}
    if learning:
        report["learned_snapshot"] = snapshot   # to start another run's warm rows from (--snapshot)
    _report(report, config)
    return report


def _learned_snapshot(config: PoliciesBenchConfig, engine: SpecEngine, draft_name: str, learn: list[list[int]],
                      tree_policy: str | None, basis, notes: list[str], progress: bool) -> dict:
    """The warm rows' snapshot, learned in-process from other prompts of the categories."""
    if progress:
        print(f"learning a snapshot from {len(learn)} other prompts ({LEARN_TOKENS} tokens, "
              f"{' and '.join(map(str, LEARN_LEVELS))} at once)...", flush=True)
    with quiet_draft_servers():
        snapshot = learn_snapshot(engine, draft_name, learn, config.learn_policy, tree_policy=tree_policy,
                                  topics=[None if basis is None else basis.topic(ids) for ids in learn])
    notes.append(f"warm: the snapshot was learned in-process from {len(learn)} other prompts of the categories "
                 f"({LEARN_TOKENS} tokens, {', '.join(map(str, LEARN_LEVELS))} at once, {config.learn_policy}): "
                 f"{len(snapshot['priors'])} priors")
    return snapshot


def _report(report: dict, config: PoliciesBenchConfig) -> None:
    """Write the JSON and the plot; print the table, the notes and the aims."""
    json_path, plot_path = config.json_path, config.plot_path
    json_path.parent.mkdir(parents=True, exist_ok=True)
    json_path.write_text(json.dumps(report, indent=2) + "\n")
    plot(report["rows"], report["meta"]["categories"], report["meta"], plot_path)
    print(format_table(report["rows"]))
    for note in report["notes"]:
        print(f"note: {note}")
    for name, aim in report["aims"].items():
        if aim["value"] is not None:
            print(f"aim {name}: {aim['value']} ({aim['aim']}: {'met' if aim['met'] else 'not met'})")
    print(f"\nwrote {json_path} and {plot_path}")
