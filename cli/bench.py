"""``specserve bench``: benchmarks, their configurations side by side in one run, JSON and a plot."""

from __future__ import annotations

import json
from pathlib import Path
from typing import Optional

import typer

from specserve.cli.common import fail, names, set_threads

bench_app = typer.Typer(help="Benchmarks: configurations side by side in one run, JSON + plot.", no_args_is_help=True)


@bench_app.command("engine")
def bench_engine(
    json_path: Path = typer.Option(Path("bench-engine.json"), "--json", help="Where to write the rows."),
    plot_path: Path = typer.Option(Path("bench-engine.png"), "--plot", help="Where to write the plot."),
    prompts_per_category: int = typer.Option(4, "--prompts", help="Prompts per category."),
    max_tokens: int = typer.Option(128, help="New tokens per prompt."),
    dtype: str = typer.Option("auto", help="auto, float32 or bfloat16 (the same for every configuration)."),
    configs: Optional[str] = typer.Option(None, help="Comma-separated subset of configuration names."),
    threads: Optional[int] = typer.Option(None, help="torch threads (default: torch's own, one per core). Use 1 when other jobs share the machine: oversubscribed OpenMP threads stall."),
) -> None:
    """In-process, one stream, reference target, greedy: HF generate vs specserve, by category."""
    from specserve.bench.engine import EngineBenchConfig, run_engine_bench

    set_threads(threads)
    try:
        run_engine_bench(EngineBenchConfig(
            json_path=json_path,
            plot_path=plot_path,
            prompts_per_category=prompts_per_category,
            max_tokens=max_tokens,
            dtype=dtype,
            configs=names(configs),
        ))
    except (ValueError, FileNotFoundError, ImportError) as err:
        fail(str(err))


@bench_app.command("steps")
def bench_steps(
    json_path: Path = typer.Option(Path("bench-steps.json"), "--json", help="Where to write the rows."),
    plot_path: Path = typer.Option(Path("bench-steps.png"), "--plot", help="Where to write the stacked plot."),
    draft: str = typer.Option("smollm2-draft-2l", help="A zoo draft LM, pinned."),
    window: int = typer.Option(4, help="Its window γ."),
    loads: str = typer.Option("1,4", help="Comma-separated requests at once."),
    prompts: int = typer.Option(8, help="Prompts per load, the categories in turn."),
    max_tokens: int = typer.Option(64, help="New tokens per prompt."),
    rounds: int = typer.Option(2, help="Rounds per load, the rows taking turns."),
    dtype: str = typer.Option("auto", help="auto, float32 or bfloat16."),
    threads: int = typer.Option(1, help="torch threads of the target (a draft apart runs one of its own)."),
) -> None:
    """Where one step's time goes, in-process: a model draft on the target's thread, on its own
    thread, and drafting ahead there, against target-only, at each load. JSON + stacked plot."""
    from specserve.bench.steps import StepsBenchConfig, run_steps_bench

    set_threads(threads)
    try:
        run_steps_bench(StepsBenchConfig(json_path=json_path, plot_path=plot_path, draft=draft, window=window,
                                         loads=tuple(int(x) for x in loads.split(",") if x.strip()), prompts=prompts,
                                         max_tokens=max_tokens, rounds=rounds, dtype=dtype))
    except (ValueError, FileNotFoundError, ImportError) as err:
        fail(str(err))


@bench_app.command("imagegen")
def bench_imagegen(
    json_path: Path = typer.Option(Path("bench-imagegen.json"), "--out", help="Where to write the rows."),
    pictures: int = typer.Option(8, help="Pictures per row (half on smooth backgrounds, half on busy ones)."),
    at_once: int = typer.Option(1, help="Pictures decoded together (1: one at a time, the paper's setting)."),
    temperatures: str = typer.Option("0,1", help="Comma-separated sampling temperatures (0: greedy)."),
    window: int = typer.Option(4, help="The chain row's window."),
    tree: str = typer.Option("4,4,16", help="DEPTH,TOPK,BUDGET: the static tree, where tree rules start."),
    rows: Optional[str] = typer.Option(None, help="Comma-separated rows (default: all)."),
    generator: Optional[Path] = typer.Option(None, help="A generator folder (default: the reference generator)."),
    draft: Optional[Path] = typer.Option(None, help="Its draft's folder (default: the zoo's)."),
    device: Optional[str] = typer.Option(None, help="cpu or cuda (default: cpu)."),
    threads: Optional[int] = typer.Option(None, help="torch threads."),
    lantern_delta: float = typer.Option(0.4, help="The LANTERN rows' δ (probability moved onto a drafted code)."),
    lantern_k: Optional[int] = typer.Option(None, help="The LANTERN rows' k nearest codes (default: an eighth of "
                                            "the codebook)."),
) -> None:
    """Image generation side by side: target-only, a chain, a static tree and the tree rules
    (ADT-Tree's three initialisations among them), and EAGLE-2's and ADT-Tree's trees under
    LANTERN's relaxed acceptance, on the reference generator, τ by grid position."""
    from specserve.bench.imagegen import ROWS, ImagegenBenchConfig, run_imagegen_bench
    from specserve.replicas.step import TreeShape

    set_threads(threads)
    try:
        run_imagegen_bench(ImagegenBenchConfig(
            json_path=json_path, plot_path=json_path.with_suffix(".png"), pictures=pictures, at_once=at_once,
            temperatures=tuple(float(t) for t in temperatures.split(",") if t.strip()), window=window,
            tree=TreeShape.parse(tree), rows=names(rows) or ROWS, generator=generator, draft=draft, device=device,
            lantern_delta=lantern_delta, lantern_k=lantern_k))
    except (ValueError, FileNotFoundError) as err:
        fail(str(err))
    typer.echo(f"wrote {json_path} and {json_path.with_suffix('.png')}")


@bench_app.command("decode")
def bench_decode(
    json_path: Path = typer.Option(Path("bench-decode.json"), "--out", "--json", help="Where to write the rows (rewritten after each)."),
    plot_path: Optional[Path] = typer.Option(None, "--plot", help="Where to write the plot (default: --out with .png)."),
    shapes: str = typer.Option("reference", "--shapes", "--shape", help="Comma-separated: reference, 8b, tiny."),
    batches: str = typer.Option("1,16", help="Comma-separated requests decoded at once."),
    tokens: int = typer.Option(128, help="New tokens per request, exactly (no EOS stops a row)."),
    prompt_len: int = typer.Option(128, "--prompt-len", help="Random prompt token ids per request."),
    device: Optional[str] = typer.Option(None, help="cuda or cpu (default: cuda when available)."),
    dtype: Optional[str] = typer.Option(None, help="bfloat16, float16 or float32 (default: bfloat16 on cuda, float32 on cpu)."),
    hf_compile: Optional[bool] = typer.Option(None, "--hf-compile/--no-hf-compile", help="HF's static-cache compiled row (default: on CUDA only)."),
    replay_tau: float = typer.Option(2.35, "--replay-tau", help="Mean accepted length τ the replay row assumes."),
    budget_s: Optional[float] = typer.Option(None, "--budget-s", help="Rows not started this many seconds into the run are skipped."),
    profile: bool = typer.Option(False, "--profile",
                                 help="Also where a one-token forward's time goes, per shape (kernels by time)."),
    rows: Optional[str] = typer.Option(None, "--rows", help="Comma-separated rows (default: all, cheapest first)."),
    chat: bool = typer.Option(True, "--chat/--no-chat", help="The chat rows (speculation on the reference's real weights)."),
) -> None:
    """Decode speed on one device: HF eager and compiled against specserve eager and with CUDA
    graphs, per shape and batch, beside the memory-bandwidth limit; a verify-step replay. JSON + plot."""
    from specserve.bench.decode import DecodeBenchConfig, run_decode_bench

    try:
        run_decode_bench(DecodeBenchConfig(
            json_path=json_path,
            plot_path=plot_path or json_path.with_suffix(".png"),
            shapes=names(shapes) or (),
            batches=tuple(int(x) for x in batches.split(",") if x.strip()),
            tokens=tokens,
            prompt_len=prompt_len,
            device=device,
            dtype=dtype,
            hf_compile=hf_compile,
            replay_tau=replay_tau,
            budget_s=budget_s,
            profile=profile,
            chat=chat,
            **({"rows": names(rows) or ()} if rows is not None else {}),
        ))
    except (ValueError, FileNotFoundError, ImportError) as err:
        fail(str(err))


@bench_app.command("serve")
def bench_serve(
    json_path: Path = typer.Option(Path("bench-serve.json"), "--json", help="Where to write the results."),
    plot_path: Path = typer.Option(Path("bench-serve.png"), "--plot", help="Where to write the plot."),
    server: Optional[str] = typer.Option(None, help="A running specserve deployment (http://HOST:PORT); default: bring the local stack up and down."),
    drafts: Optional[str] = typer.Option(None, help="Comma-separated drafts, a serve-spec[<draft>] row each; default: every draft the deployment lists in /v1/models (the local stack: deploy/serve.yaml's)."),
    peer: list[str] = typer.Option([], "--peer", help="NAME=URL of any OpenAI-compatible server (e.g. vllm=http://127.0.0.1:8100), measured as row peer[NAME] with the same requests and no specserve fields; repeatable."),
    in_process: str = typer.Option("prompt-lookup", "--in-process", help="Draft of the in-process-spec row (concurrency 1), or 'none' for no in-process row."),
    prompts: int = typer.Option(12, help="Prompts per run, the categories in turn (concurrency 16 binds only with more than 16)."),
    max_tokens: int = typer.Option(64, help="New tokens per request."),
    concurrency: str = typer.Option("1,4,8,16", help="Comma-separated concurrency limits."),
    rates: str = typer.Option("2,inf", help="Comma-separated Poisson arrival rates in requests/s (inf: all at once). At 2 req/s about 4 requests are in flight, so the limits 4-8 bind."),
    window: int = typer.Option(4, help="The pinned window γ of the serve-spec and in-process rows."),
    adaptive: bool = typer.Option(False, "--adaptive", help="serve-spec rows name their draft only: the deployment's policy picks each step's window, as for serve-default (the in-process row keeps --window)."),
    categories: Optional[str] = typer.Option(None, help="Comma-separated prompt categories (code,chat,summarise,edit), in turn; default: all four."),
    router_warmup: int = typer.Option(0, "--router-warmup", help="Other prompts per category sent with no spec before measuring, so the replicas' draft routers learn first; serve-default then runs first on each prompt."),
    dtype: str = typer.Option("auto", help="dtype of the in-process engine and of the local stack it brings up."),
    threads: Optional[int] = typer.Option(None, help="torch threads of the in-process engine."),
    repeats: int = typer.Option(2, help="Rounds of the loaded runs (concurrency > 1), the rows taking turns; each row's figures are over all rounds, its tok/s per round in the JSON."),
    stream_interval: int = typer.Option(1, "--stream-interval", help="Tokens per streamed piece of the local stack (its stream_interval); start peers with the same (vLLM: --stream-interval)."),
    no_prefix_reuse: bool = typer.Option(False, "--no-prefix-reuse", help="Send every row's and round's requests with a cache_salt of their own (vLLM's field, specserve's too), so that no server answers from a prefix cache another row or round filled: engine throughput, not cache hits. Peers must accept cache_salt. By default the same prompts repeat across rows and rounds, as a chat service's do."),
    only_drafts: bool = typer.Option(False, "--only-drafts", help="The local stack serves only --drafts (faster to start; serve-default then measures that app, not the shipped default)."),
    structured: bool = typer.Option(False, "--structured", help="Every request asks for JSON of its category's schema (response_format json_schema, peers too); rows serve-grammar-draft and serve-default[no-grammar-draft] measure the grammar as a draft. Needs --in-process none."),
) -> None:
    """Load generator (Poisson arrivals, concurrency limits): target-only, the deployment's default and
    each draft pinned, beside the in-process engine and any OpenAI-compatible peers, in one run.

    A default run (local stack, 12 prompts x 64 tokens, no peer) takes about 10 minutes on 2 cores,
    and each peer about a minute more."""
    from specserve.bench.serve import ServeBenchConfig, parse_drafts, parse_peers, run_serve_bench

    set_threads(threads)
    try:
        levels = tuple(int(c) for c in concurrency.split(",") if c.strip())
        arrival = tuple(float(r) for r in rates.split(",") if r.strip())
    except ValueError:
        fail(f"--concurrency takes integers and --rates numbers or inf, got {concurrency!r} and {rates!r}")
    try:
        drafts_asked = parse_drafts(drafts)
        run_serve_bench(ServeBenchConfig(
            json_path=json_path,
            plot_path=plot_path,
            server=server,
            drafts=None if drafts_asked is None else tuple(drafts_asked),
            peers=tuple(parse_peers(peer)),
            in_process=None if in_process == "none" else in_process,
            num_prompts=prompts,
            max_tokens=max_tokens,
            concurrency=levels,
            rates=arrival,
            window=window,
            adaptive=adaptive,
            categories=names(categories) or ServeBenchConfig.categories,
            router_warmup=router_warmup,
            dtype=dtype,
            repeats=repeats,
            stream_interval=stream_interval,
            no_prefix_reuse=no_prefix_reuse,
            only_drafts=only_drafts, structured=structured,
        ))
    except (ValueError, FileNotFoundError, ImportError, RuntimeError, TimeoutError) as err:
        fail(str(err))


@bench_app.command("suffix")
def bench_suffix(
    json_path: Path = typer.Option(Path("bench-suffix.json"), "--json", help="Where to write the results."),
    plot_path: Path = typer.Option(Path("bench-suffix.png"), "--plot", help="Where to write the plot."),
    server: Optional[str] = typer.Option(None, help="A running specserve deployment with a suffix draft (http://HOST:PORT); default: the local stack (the shipped default, a suffix draft added if it lists none), brought up and down."),
    prompts: int = typer.Option(16, help="Prompts, the categories in turn; each asked twice per row."),
    max_tokens: int = typer.Option(128, help="New tokens per request."),
    categories: Optional[str] = typer.Option(None, help="Comma-separated prompt categories; default: chat,code."),
    concurrency: int = typer.Option(1, help="Requests in flight at once."),
    restate: str = typer.Option("system", help="How a prompt comes back: system (under a system prompt: alike, not the same) or exact."),
    suffix: str = typer.Option("suffix", help="The suffix draft's name in the deployment."),
    dtype: str = typer.Option("auto", help="dtype of the local stack."),
) -> None:
    """The suffix draft's cluster index on prompts asked again: each row (target-only, prompt
    lookup, suffix, the default) cold, then warm, the warm requests split by whether the replica
    that answered first answered again or another one did (outputs shared through Redis).

    A default run (16 prompts x 128 tokens, 4 rows, 2 rounds) takes about 10 minutes on 2 cores."""
    from specserve.bench.suffix import SuffixBenchConfig, run_suffix_bench

    try:
        run_suffix_bench(SuffixBenchConfig(
            json_path=json_path, plot_path=plot_path, server=server, num_prompts=prompts, max_tokens=max_tokens,
            categories=tuple(names(categories) or SuffixBenchConfig.categories), concurrency=concurrency,
            restate=restate, suffix=suffix, dtype=dtype))
    except (ValueError, FileNotFoundError, RuntimeError, TimeoutError) as err:
        fail(str(err))


@bench_app.command("multimodal")
def bench_multimodal(
    json_path: Path = typer.Option(Path("bench-multimodal.json"), "--json", help="Where to write the rows."),
    plot_path: Path = typer.Option(Path("bench-multimodal.png"), "--plot", help="Where to write the plot."),
    target: str = typer.Option("smollm2-vlm", help="A VLM target (a local LLaVA-class folder)."),
    draft: str = typer.Option("smollm2-vlm-draft", help="The draft LM whose views are compared (default: the VLM's own)."),
    pictures: int = typer.Option(6, help="Held-out pictures per category (0: Sparrow's rows alone, with --frames)."),
    categories: Optional[str] = typer.Option(None, help="Comma-separated picture categories; default: all."),
    max_tokens: int = typer.Option(48, help="New tokens per answer at most (a description runs to ~45)."),
    window: int = typer.Option(3, help="Window: draft tokens per step."),
    repeats: int = typer.Option(2, help="Times every picture runs every row."),
    dtype: str = typer.Option("bfloat16", help="auto, float32 or bfloat16."),
    frames: str = typer.Option("1,4,16,64", help="Pictures per prompt for Sparrow's rows (target-only, full and "
                                                  "windowed attention of --head, --ivsb-head); empty: none."),
    frame_prompts: int = typer.Option(4, help="Prompts per frame count."),
    frame_category: str = typer.Option("describe", help="The question of Sparrow's rows: a picture category's, "
                                                        "asked of the last picture, or a clip category's "
                                                        "(sequence, moves), asked of a clip of that many frames."),
    head: str = typer.Option("smollm2-vlm-hsr", help="The hidden-state-reuse head of Sparrow's rows."),
    ivsb_head: str = typer.Option("smollm2-vlm-sparrow", help="The head trained with IVSB (a windowed row); "
                                                              "empty: no such row."),
    captions: str = typer.Option("cold", help="cold: the caption view's rows have their pictures captioned beside "
                                              "the answer (timed); warm: captioned before the rows."),
    views: Optional[str] = typer.Option(None, help="Comma-separated views compared and mixed (of multimodal, "
                                                   "text-only, pooled, caption); default: all four."),
    scenarios: Optional[str] = typer.Option(None, help="Comma-separated conversations instead of categories (single, "
                                                       "follow-up, text-turn, unseen, clip; 'all': every one)."),
    served: bool = typer.Option(False, "--served", help="The scenarios (or, with --pictures 0, Sparrow's rows on "
                                "clips) over HTTP instead of in-process: a local stack (Ray, Redis) whose target "
                                "replicas serve one draft per row, up and down."),
    server: Optional[str] = typer.Option(None, help="A running deployment serving one draft per row (as --served "
                                         "brings up) to measure over HTTP instead."),
    replicas: int = typer.Option(2, help="--served: target replicas (the ensemble's weights shared through Redis); "
                                 "the served scenarios take --scenarios, --views (not caption), --pictures, "
                                 "--repeats, --max-tokens, --window, --target, --draft, --dtype; Sparrow's served "
                                 "rows --frames, --frame-prompts, --frame-category, --head, --ivsb-head and --draft "
                                 "(its multimodal view) instead of the first three."),
    threads: Optional[int] = typer.Option(None, help="torch threads."),
) -> None:
    """TABED's drafting views of VLM requests side by side, per picture category (or scenario): multimodal,
    text-only, pooled, caption, their adaptive and static ensembles, and target-only (tokens/s and mean
    accepted length); then Sparrow's windowed draft against full attention as pictures grow. --served /
    --server: the scenarios (with --pictures 0: Sparrow's rows, clips as video_url parts) over HTTP, one
    draft of the deployment per row."""
    from specserve.bench.multimodal import SCENARIOS, VIEWS, MultimodalBenchConfig, run_multimodal_bench
    from specserve.bench.multimodal_served import run_served_multimodal_bench
    from specserve.data.synthetic_images import CATEGORIES

    set_threads(threads)
    if served and server:
        fail("--served brings a local stack up; --server URL measures a running one: give one of them")
    picked = dict(json_path=json_path, plot_path=plot_path, target=target, draft=draft, pictures=pictures,
                  categories=tuple(names(categories) or CATEGORIES), max_tokens=max_tokens, window=window,
                  repeats=repeats, dtype=dtype, views=tuple(names(views) or VIEWS),
                  scenarios=SCENARIOS if scenarios == "all" else tuple(names(scenarios) or ()),
                  frames=tuple(int(f) for f in names(frames) or ()), frame_prompts=frame_prompts,
                  frame_category=frame_category, head=head, ivsb_head=ivsb_head or None)
    if served or server:
        try:
            run_served_multimodal_bench(MultimodalBenchConfig(**picked), server=server, replicas=replicas)
        except (ValueError, FileNotFoundError, RuntimeError, TimeoutError) as err:
            fail(str(err))
        return
    try:
        run_multimodal_bench(MultimodalBenchConfig(**picked, captions=captions))
    except (ValueError, FileNotFoundError) as err:
        fail(str(err))


@bench_app.command("policies")
def bench_policies(
    json_path: Path = typer.Option(Path("bench-policies.json"), "--json", help="Where to write the rows."),
    plot_path: Path = typer.Option(Path("bench-policies.png"), "--plot", help="Where to write the plot."),
    prompts_per_category: int = typer.Option(2, "--prompts", help="Prompts per category (one stream each, every row)."),
    max_tokens: int = typer.Option(96, help="New tokens per request (the cold/warm rows take at most 32)."),
    categories: Optional[str] = typer.Option(None, help="Comma-separated subset of code,chat,summarise,edit."),
    policies: Optional[str] = typer.Option(None, help="Comma-separated subset of row names (static-1..static-8, oracle-static, online, fsm, cache-fsm, q-learning, q-learning-per-request, hf-heuristic, static-tree[-dDkKnN], sage, adt-tree, eagle2-depth, cold, warm, cold-tree, warm-tree, load-aware, target-only); default: all."),
    draft: str = typer.Option("prompt-lookup", help="The draft of every speculating row: prompt-lookup, a zoo draft or a model folder."),
    concurrency: str = typer.Option("1,4,16", help="Comma-separated concurrency levels of the load rows."),
    load_requests: int = typer.Option(32, help="Requests of the category mix per load row and round."),
    load_mode: str = typer.Option("steady", help="steady: at most c at once, the load rows' steps taking turns in one thread; waves: waves of c at once."),
    load_rounds: int = typer.Option(2, help="Rounds of the steady load rows per concurrency."),
    snapshot: Optional[Path] = typer.Option(None, help="A policy snapshot (JSON: GET /v1/policy's body, or the snapshot document) for the warm rows; without it only cold rows run.", exists=True, dir_okay=False),
    learn_snapshot: int = typer.Option(0, help="Instead of --snapshot: learn one in-process from this many other prompts of the categories (a replica's counters, the policy service's priors; no Redis) before the warm rows."),
    learn_policy: str = typer.Option("online", help="The policy the --learn-snapshot requests decode with (a registry name): the snapshot can only price windows they used."),
    start_policy: Optional[str] = typer.Option(None, help="The policy of the cold and warm rows (a registry name); default: the deployment default, load-aware."),
    tree_start_policy: str = typer.Option("adt-tree", help="The tree policy of the cold-tree and warm-tree rows (a registry name)."),
    learn_tree_policy: Optional[str] = typer.Option(None, help="The tree policy the --learn-snapshot requests' trees decode with (default: --tree-start-policy): the snapshot prices only tree shapes they used."),
    dtype: str = typer.Option("auto", help="auto, float32 or bfloat16 (the same for every row)."),
    threads: Optional[int] = typer.Option(None, help="torch threads (default: torch's own, one per core). Use 1 when other jobs share the machine."),
) -> None:
    """In-process, reference target, greedy: static windows 1..8 and their per-request oracle, every
    window and tree policy in the registry, cold vs warm start on short requests, and load-aware vs
    target-only at each concurrency, by category, side by side in one run.

    A default run (4 categories x 2 prompts x 96 tokens, 32 load requests in 2 steady rounds, prompt
    lookup) takes about 10 minutes on a quiet 2-core machine, twice that on a slower one; a model
    draft takes longer."""
    from specserve.bench.policies import PoliciesBenchConfig, run_policies_bench

    set_threads(threads)
    try:
        levels = tuple(int(c) for c in concurrency.split(",") if c.strip())
    except ValueError:
        fail(f"--concurrency takes comma-separated integers, got {concurrency!r}")
    snapshot_doc = None
    if snapshot is not None:
        try:
            snapshot_doc = json.loads(snapshot.read_text())
        except (OSError, ValueError) as err:
            fail(f"--snapshot {snapshot}: not readable JSON ({err})")
    try:
        run_policies_bench(PoliciesBenchConfig(
            json_path=json_path,
            plot_path=plot_path,
            prompts_per_category=prompts_per_category,
            max_tokens=max_tokens,
            categories=names(categories) or PoliciesBenchConfig.categories,
            policies=names(policies),
            draft=draft,
            concurrency=levels,
            load_requests=load_requests,
            load_mode=load_mode,
            load_rounds=load_rounds,
            learn_snapshot_requests=learn_snapshot,
            learn_policy=learn_policy,
            snapshot=snapshot_doc,
            dtype=dtype,
            start_policy=start_policy,
            tree_start_policy=tree_start_policy,
            learn_tree_policy=learn_tree_policy,
        ))
    except (ValueError, FileNotFoundError, ImportError) as err:
        fail(str(err))


@bench_app.command("router")
def bench_router(
    json_path: Path = typer.Option(Path("bench-router.json"), "--json", help="Where to write the rows."),
    plot_path: Path = typer.Option(Path("bench-router.png"), "--plot", help="Where to write the plot."),
    prompts_per_category: int = typer.Option(6, "--prompts", help="Evaluation prompts per category."),
    warmup_per_category: int = typer.Option(6, "--warmup", help="Warm-up prompts per category (other prompts)."),
    max_tokens: int = typer.Option(128, help="New tokens per request."),
    categories: Optional[str] = typer.Option(None, help="Comma-separated subset of code,chat,summarise,edit."),
    explore: float = typer.Option(0.2, help="The router's exploration weight (LinUCB's beta)."),
    repeats: int = typer.Option(1, help="Times each evaluation generation runs (timed by the median)."),
    switches: int = typer.Option(1, help="Draft switches the router may make per request mid-flight (0: none)."),
    dtype: str = typer.Option("auto", help="auto, float32 or bfloat16."),
    threads: Optional[int] = typer.Option(None, help="torch threads (default: torch's own, one per core)."),
) -> None:
    """In-process, reference target, greedy, a mix of code, chat, summarise and edit prompts: every
    draft and no speculation on every prompt (the per-prompt oracle, best single draft, random choice
    and the least squares of "A drop-in solution for on-the-fly adaptation of speculative decoding in
    large language models"), and the learned router after a warm-up on other prompts, side by side
    in one run; JSON, a plot of tokens/s and of the router's regret as it learns."""
    from specserve.bench.router import RouterBenchConfig, run_router_bench

    set_threads(threads)
    try:
        run_router_bench(RouterBenchConfig(
            json_path=json_path,
            plot_path=plot_path,
            prompts_per_category=prompts_per_category,
            warmup_per_category=warmup_per_category,
            max_tokens=max_tokens,
            categories=names(categories) or RouterBenchConfig.categories,
            explore=explore,
            repeats=repeats,
            switches=switches,
            dtype=dtype,
        ))
    except (ValueError, FileNotFoundError, ImportError) as err:
        fail(str(err))


@bench_app.command("soak")
def bench_soak(
    json_path: Path = typer.Option(Path("bench-soak.json"), "--json", help="Where to write the report."),
    plot_path: Path = typer.Option(Path("bench-soak.png"), "--plot", help="Where to write the plot."),
    minutes: float = typer.Option(10.0, help="How long requests keep arriving; then the run waits for those in flight."),
    rate: float = typer.Option(1.0, help="Requests per second (Poisson arrivals, open loop)."),
    max_tokens: int = typer.Option(64, help="New tokens per request."),
    server: Optional[str] = typer.Option(None, help="A running deployment's URL; default: bring the local stack up (and down after)."),
    window_s: float = typer.Option(30.0, "--window-s", help="Seconds per reporting window."),
    sample_s: float = typer.Option(5.0, "--sample-s", help="Seconds between replica memory samples."),
    drain_s: float = typer.Option(300.0, "--drain-s", help="How long to wait for requests in flight after the load stops."),
    dtype: str = typer.Option("auto", help="auto, float32 or bfloat16 (the local stack only)."),
) -> None:
    """A bounded, self-stopping load at a fixed rate against the local cluster (or --server): failed
    requests, latency percentiles per window over time, each replica's memory over time and its
    growth after warm-up; JSON and a plot. The aims: zero failed, memory growth under 5%."""
    from specserve.bench.soak import SoakBenchConfig, run_soak_bench

    try:
        report = run_soak_bench(SoakBenchConfig(
            json_path=json_path,
            plot_path=plot_path,
            server=server,
            minutes=minutes,
            rate=rate,
            max_tokens=max_tokens,
            window_s=window_s,
            sample_s=sample_s,
            drain_s=drain_s,
            dtype=dtype,
        ))
    except (ValueError, RuntimeError) as err:
        fail(str(err))
    if not report["aims"]["zero_failed"]:
        raise typer.Exit(1)
