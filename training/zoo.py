"""The draft zoo: named recipes for drafts distilled from the reference target.

    specserve zoo corpus                      # once: the target's answers and reading + hidden states (resumable)
    features.build_features()                 # once, for smollm2-eagle3: the committed answers' feature cache (resumable)
    specserve zoo list
    specserve zoo train NAME [--steps N]      # resumable: run it again to go on
    specserve zoo export NAME                 # into the package's zoo folder, loadable by name
    specserve zoo eval NAME...                # acceptance, latency ratio c, speedup, per category

Every recipe trains on the same corpus (``training/corpus.py``): the target's own greedy
answers to prompts that no benchmark uses and its reading of held-out ShareGPT conversations,
with its hidden states, so no training step runs the target. Every 20th answer is held out, and
the weights exported are those that validate best on them. Two kinds of draft:

- ``standalone``: a small Llama (the target's first layers, retrained) with a pruned head; it
  drafts from tokens alone, so it can run anywhere, for any request.
- ``hsr``: a hidden-state-reuse head (Sparrow Eq. 1): one layer reading the target's
  second-to-last hidden states, trained with unrolled steps (``training/hsr_train.py``); or, with
  ``feature_layers``, an EAGLE-3 head fusing several of them, trained on the feature cache of the
  committed answers instead of the corpus (``training/features.py``, ``training/eagle3.py``).

An exported draft does not store its token embeddings nor its head: they are the target's
(embeddings and output rows), frozen during training, and at half precision the embeddings alone
would take 56 MB of the 60 MB budget for all drafts. Its config names the target
(``embeddings_from``) and the model store copies them in at load.
"""

from __future__ import annotations

import json
import time
from dataclasses import dataclass
from pathlib import Path

import torch
from specserve.data.prompts import HUMANEVAL_HELD_OUT, SHAREGPT_HELD_OUT
from specserve.replicas.drafts.hsr_head import build_hsr_head
from specserve.replicas.drafts.pruned_head import save_without_embeddings
from specserve.replicas.model_store import (
    REFERENCE_TARGET,
    bf16_is_fast,
    load_causal_lm,
    model_cache_dir,
    zoo_dir,
)
from specserve.training import corpus as zoo_corpus
from specserve.training import eagle3
from specserve.training.distill import (
    DistillConfig,
    TrainLog,
    best_path,
    build_student,
    load_weights,
    most_frequent_tokens,
    standalone_loss,
)
from specserve.training.distill import train as train_loop
from specserve.training.hsr_train import hsr_loss


@dataclass(frozen=True)
class Recipe:
    name: str
    kind: str                 # "standalone" or "hsr"
    description: str
    head_tokens: int          # K: the output layer's vocabulary
    layers: int = 1           # standalone: decoder layers (the target's first ones, retrained)
    unroll: int = 1           # hsr: unrolled drafting steps per training step
    seq_len: int = 256
    batch: int = 8
    steps: int = 1000
    lr: float = 1e-3
    # The head starts as the target's own output rows; frozen (as EAGLE freezes the LM head), the
    # draft learns to produce states the target's output layer reads, with far fewer parameters
    # to fit from a small corpus.
    train_head: bool = False
    # hsr: the target's hidden states the head reads (indices into transformers' hidden_states);
    # several are fused (EAGLE-3). None: the second-to-last layer's alone.
    feature_layers: tuple[int, ...] | None = None
    # hsr: weight of the cross-entropy on the next answer token beside the KL (hsr_train.py).
    ce_weight: float = 0.0
    # "corpus" (training/corpus.py) or "features" (training/features.py: the committed answers).
    data: str = "corpus"
    warmup_steps: int = 50
    export_dtype: str = "float16"


RECIPES = {
    r.name: r for r in (
        # The shipped weights are the checkpoint with the best validation KL, halfway through
        # ``steps``: past it the validation KL rises (training record: docs/benchmarks.md §6.0c).
        Recipe("smollm2-draft-2l", "standalone", "standalone draft LM: the target's first 2 layers, retrained, "
               "8k-token head, frozen target embeddings, on the feature cache's tokens and teacher", head_tokens=8192,
               layers=2, batch=32, steps=7248, data="features"),
        Recipe("smollm2-hsr", "hsr", "hidden-state-reuse head: FC(e_t + h_t-1) into one decoder layer "
               "(from the target's last), 8k-token head, 2 unrolled steps", head_tokens=8192, unroll=2, lr=2e-3,
               steps=1500),
        # Choices: training/eagle3.py. The shipped weights are the last checkpoint, still improving
        # at the end; train it on a GPU, where the whole feature cache fits in memory and a step is
        # far faster than on a CPU (training record: docs/benchmarks.md §6.0c).
        Recipe("smollm2-eagle3", "hsr", "EAGLE-3 head: the target's hidden states 2, 15 and -2 fused, FC(e_t + h_t-1) "
               "into one decoder layer (from the target's last), 16k-token head, 6 unrolled steps, KL + 0.2 CE, on "
               "the feature cache of the committed answers", head_tokens=16384, unroll=6, seq_len=320, batch=32,
               lr=1e-3, steps=2287, warmup_steps=100, feature_layers=(2, 15, -2), ce_weight=0.2, data="features",
               export_dtype="bfloat16"),
    )
}


def recipe(name: str) -> Recipe:
    if name not in RECIPES:
        raise ValueError(f"unknown draft recipe {name!r}; the zoo has: {', '.join(RECIPES)}")
    return RECIPES[name]


def work_dir(name: str) -> Path:
    return model_cache_dir().parent / "zoo" / name


def _build(spec: Recipe, target, head: list[int]):
    layers = list(spec.feature_layers) if spec.feature_layers else None
    model = build_hsr_head(target, head, layers) if spec.kind == "hsr" else build_student(target, spec.layers, head)
    model.lm_head.weight.requires_grad_(spec.train_head)
    return model


def _loss(spec: Recipe, model, head_weight: torch.Tensor, autocast_bf16: bool):
    if spec.kind == "hsr":
        return hsr_loss(model, head_weight, spec.unroll, autocast_bf16)
    return standalone_loss(model, head_weight, autocast_bf16)


def train(name: str, steps: int | None = None, work: Path | None = None, corpus: Path | None = None,
          batch: int | None = None, validation_every: int = zoo_corpus.VALIDATION_EVERY,
          validate_every: int = 200, validation_sequences: int = 64, device: str | None = None) -> Path:
    """Distil ``name`` (resuming its checkpoint if there is one); returns the work directory.
    ``steps`` and ``batch`` override the recipe's (a resumed run must keep the batch).
    ``corpus``: the corpus folder, or for a recipe trained on features the feature cache
    (default ``features.features_dir()``). For those, ``validate_every`` steps the first
    ``validation_sequences`` held-out answers are scored (``validation_every`` is the corpus's
    split), on ``device`` (default: the CPU; the corpus recipes train on the CPU only)."""
    spec = recipe(name)
    work = work or work_dir(name)
    work.mkdir(parents=True, exist_ok=True)
    if spec.data == "features":
        return eagle3.train_recipe(spec, work, corpus, steps, batch, validate_every, validation_sequences,
                                   device=device)
    corpus = corpus or zoo_corpus.corpus_dir()
    transcripts = zoo_corpus.transcripts_dir(corpus)
    for part in (corpus, *([transcripts] if transcripts.exists() else [])):
        if not (part / "meta.json").exists():   # a half-built part would change the batches under a resumed run
            raise FileNotFoundError(f"no finished corpus in {part}: run `specserve zoo corpus` first (it resumes)")
    sequences, validation = zoo_corpus.split(zoo_corpus.load(corpus), validation_every)
    loaded = load_causal_lm(REFERENCE_TARGET, dtype="float32", device="cpu")
    target = loaded.model
    head_file = work / "head_token_ids.json"
    if head_file.exists():
        head = json.loads(head_file.read_text())
    else:   # the corpus's most frequent tokens, EOS always, counted over answers and transcripts
        # (they cover held-out answer tokens better than the answers alone: docs/benchmarks.md §6.3)
        head = most_frequent_tokens((s.tokens.tolist() for s in sequences), spec.head_tokens,
                                    always=sorted(loaded.eos_token_ids))
        head_file.write_text(json.dumps(head))
    head_weight = target.get_output_embeddings().weight.detach()[torch.tensor(head)].clone()
    model = _build(spec, target, head)
    del target, loaded
    # The student trains in float32 (optimizer state too), under bf16 autocast where the CPU
    # has native bf16. (Training runs on the CPU: the corpus lives in its memory.)
    autocast = bf16_is_fast(torch.device("cpu"))
    config = DistillConfig(steps=steps or spec.steps, lr=spec.lr, autocast_bf16=autocast)
    log = TrainLog(work, config.steps, f"zoo train {name}")

    loss = _loss(spec, model, head_weight, autocast)
    held_out = [zoo_corpus.collate([zoo_corpus.training_row(s, spec.seq_len) for s in validation[i:i + spec.batch]])
                for i in range(0, len(validation), spec.batch)]

    def on_validate(step: int, value: float, best: bool) -> None:
        log.bar.write(f"step {step}: validation KL {value:.4f}{' (best so far)' if best else ''}")
        log.write({"step": step, "validation": round(value, 5), "best": best})

    train_loop(model, loss, zoo_corpus.batch_stream(sequences, spec.seq_len, batch or spec.batch), config,
               work / "checkpoint.pt", on_step=log.on_step, on_validate=on_validate,
               validate=(lambda: sum(float(loss(b)) for b in held_out) / len(held_out)) if held_out else None)
    log.close()
    return work


def export(name: str, work: Path | None = None, out: Path | None = None, corpus: Path | None = None) -> Path:
    """The checkpoint that scored best on validation (else the latest) as a loadable draft in the
    zoo folder (half precision, no embeddings)."""
    spec = recipe(name)
    work = work or work_dir(name)
    checkpoint = work / "checkpoint.pt"
    if not checkpoint.exists():
        raise FileNotFoundError(f"no checkpoint in {work}: run `specserve zoo train {name}` first")
    if spec.data == "features":
        return eagle3.export_recipe(spec, work, out or zoo_dir() / name)
    target = load_causal_lm(REFERENCE_TARGET, dtype="float32", device="cpu")
    model = _build(spec, target.model, json.loads((work / "head_token_ids.json").read_text()))
    chosen = load_weights(best_path(checkpoint) if best_path(checkpoint).exists() else checkpoint, model)
    out = out or zoo_dir() / name
    save_without_embeddings(model, out, embeddings_from=REFERENCE_TARGET)
    target.tokenizer.save_pretrained(out)
    log = [json.loads(line) for line in (work / "train.log").read_text().splitlines() if line.strip()]
    seconds = sum(b["elapsed_s"] - a["elapsed_s"] for a, b in zip(log, log[1:]) if b["elapsed_s"] > a["elapsed_s"])
    steps = [r for r in log if "loss" in r]
    trained = torch.load(checkpoint, map_location="cpu", weights_only=False)["step"]
    meta_file = (corpus or zoo_corpus.corpus_dir()) / "meta.json"
    meta = json.loads(meta_file.read_text()) if meta_file.exists() else {}
    read_file = zoo_corpus.transcripts_dir(corpus) / "meta.json"
    read = json.loads(read_file.read_text()) if read_file.exists() else {}
    (out / "training.json").write_text(json.dumps({
        "recipe": name, "kind": spec.kind, "description": spec.description, "steps": trained,
        "rows_seen": trained * spec.batch, "train_seconds": round(seconds), "exported_step": chosen["step"],
        "validation_kl": chosen.get("validation"),
        "final_loss": steps[-1]["loss"] if steps else None, "teacher": REFERENCE_TARGET,
        "data": f"the target's own greedy answers (<= {zoo_corpus.MAX_NEW_TOKENS} new tokens) to held-out prompts: "
                f"{meta.get('mix', zoo_corpus.MIX)} (ShareGPT V3 from conversation #{SHAREGPT_HELD_OUT}, HumanEval "
                f"from problem #{HUMANEVAL_HELD_OUT}), rows the last {spec.seq_len} tokens of prompt + answer, answer "
                f"positions scored, every {zoo_corpus.VALIDATION_EVERY}th answer held out for validation"
                + (f"; and {read['conversations']} ShareGPT conversations from #{read['first_conversation']} as "
                   f"written, read by the target (first {read['tokens_each']} tokens, every position scored)"
                   if read else ""),
    }, indent=2) + "\n")
    return out


def forward_ms(model, context: list[int], reps: int = 20) -> float:
    """Median time of one cached decode forward after ``context``: the unit of the latency ratio c."""
    from specserve.replicas.model.kv_session import KVSession

    session = KVSession(model)
    session.extend(context, logits_rows=1)
    times = []
    for i in range(reps + 3):
        start = time.perf_counter()
        session.extend([context[i % len(context)]], logits_rows=1)
        times.append(time.perf_counter() - start)
        session.crop(len(context))
    return 1e3 * sorted(times[3:])[reps // 2]


def draft_ms(engine, name: str, context: list[int], reps: int = 20) -> float:
    """Median time of proposing one token after ``context``, cache warm: the draft's side of c.
    (One forward of a standalone draft; one step of an HSR head, given the target's states.)"""
    from specserve.replicas.sampling import SamplingParams
    from specserve.replicas.step import Proposal
    from specserve.replicas.drafts.base import needs_features, propose
    from specserve.replicas.drafts.hsr_head import feature_layers
    from specserve.replicas.step import ProposeRequest

    greedy = SamplingParams()
    draft = engine.drafts[name]
    engine.reset_caches()
    layers = feature_layers(draft.head.config) if needs_features(draft) else None
    if layers:   # SpecEngine taps its drafts' layers; a draft added to it later needs them too
        engine.target.tap_features(layers)
    bonus = engine.target.verify_one(context, Proposal.empty(), greedy).emitted_tokens
    context = context + bonus
    features = engine.target.features(context, layers=layers) if layers else None
    ask = ProposeRequest("probe", context, 1, None, greedy, features=features)
    times = []
    for _ in range(reps + 3):
        start = time.perf_counter()
        propose(draft, ask, None)
        times.append(time.perf_counter() - start)
    return 1e3 * sorted(times[3:])[reps // 2]


def evaluate(drafts: list[str], prompts_per_category: int = 4, max_tokens: int = 64, window: int = 3,
             dtype: str = "auto") -> list[dict]:
    """Per draft and category, on benchmark prompts (held out from training), greedy, one stream:
    ``{draft, category, acceptance_rate, mean_accepted_len, latency_ratio, speedup_vs_ar}``."""
    from specserve.data.prompts import CATEGORIES, load_prompts
    from specserve.replicas.engine import GenerateRequest, SpecEngine
    from tqdm import tqdm

    from specserve.training.answers import ANSWERS_DIR

    # "suffix": the model-free suffix draft, seeded with the shipped answers (held out, as training data is);
    # "tabed:MODEL" / "tabed-static:MODEL": a TABED ensemble of the draft LM MODEL's full and last-turn views.
    ensembles = {d: {"model": d.split(":", 1)[1], "weights": "static" if d.startswith("tabed-static:") else "adaptive"}
                 for d in drafts if d.startswith(("tabed:", "tabed-static:"))}
    engine = SpecEngine.load(dtype=dtype, draft_models=[d for d in drafts if d != "suffix" and d not in ensembles],
                             suffix_seed=ANSWERS_DIR if "suffix" in drafts else None, ensembles=ensembles)
    names = [n for n in engine.drafts if n != "prompt-lookup"]
    probe = engine.encode(load_prompts("chat", 1)[0])
    target_ms = forward_ms(engine.loaded.model, probe)
    ratio = {n: draft_ms(engine, n, probe) / target_ms for n in names}
    rows = []
    for category in CATEGORIES:
        prompts = [engine.encode(p) for p in load_prompts(category, prompts_per_category)]
        seconds = {n: 0.0 for n in ["none", *names]}
        tokens = dict.fromkeys(seconds, 0)
        stats = {n: [0, 0, 0, 0] for n in names}   # accepted, rejections, emitted, steps
        for ids in tqdm(prompts, desc=f"zoo eval {category}", unit="prompt"):
            for name in seconds:   # the same prompt under every draft, back to back
                engine.reset_caches()
                start = time.perf_counter()
                gen = engine.generate_ids(ids, GenerateRequest("", max_tokens, name, window))
                seconds[name] += time.perf_counter() - start
                tokens[name] += len(gen.token_ids)
                if name != "none":
                    s = gen.stats
                    for i, v in enumerate((s.accepted, s.rejections, s.emitted, s.steps)):
                        stats[name][i] += v
        base = tokens["none"] / seconds["none"]
        for name in names:
            accepted, rejections, emitted, steps = stats[name]
            rows.append({
                "draft": name, "category": category, "window": window,
                "acceptance_rate": round(accepted / max(1, accepted + rejections), 4),
                "mean_accepted_len": round(emitted / max(1, steps), 3),
                "latency_ratio": round(ratio[name], 4),
                "speedup_vs_ar": round(tokens[name] / seconds[name] / base, 3),
            })
    return rows


def _stored_dtype(folder: Path) -> str:
    """The dtype the weights are stored in (the config's records what they were trained in)."""
    from safetensors import safe_open

    with safe_open(str(next(folder.glob("*.safetensors"))), framework="pt") as weights:
        stored = weights.get_slice(next(iter(weights.keys()))).get_dtype()
    return {"BF16": "bfloat16", "F16": "float16", "F32": "float32"}.get(stored, stored.lower())


def write_card(folder: Path, rows: list[dict], meta: dict) -> Path:
    """``README.md`` beside a zoo draft's weights: what it is, what it was trained on and for how
    long, and what it measured on held-out prompts (``rows`` from ``evaluate``)."""
    training = json.loads((folder / "training.json").read_text())
    config = json.loads((folder / "config.json").read_text())
    weights_mb = sum(f.stat().st_size for f in folder.glob("*.safetensors")) / 2**20
    if training["kind"] == "hsr" and config.get("feature_layers"):
        layers = config["feature_layers"]
        arch = (f"EAGLE-3 head: the target's hidden states {layers} fused, `h = fuse(h_low ⊕ h_mid ⊕ h_high)` "
                f"({len(layers) * config['hidden_size']} → {config['hidden_size']}), then `FC(e_t ⊕ h_(t-1))` "
                f"({2 * config['hidden_size']} → {config['hidden_size']}) into one Llama decoder layer (initialised "
                f"from the target's last), final norm, {len(config['head_token_ids'])}-token head; trained with "
                f"{RECIPES[training['recipe']].unroll} unrolled steps (training-time test)")
    elif training["kind"] == "hsr":
        arch = (f"hidden-state-reuse head (Sparrow Eq. 1): `FC(e_t ⊕ h_(t-1))` ({2 * config['hidden_size']} → "
                f"{config['hidden_size']}) into one Llama decoder layer (initialised from the target's last), "
                f"final norm, {len(config['head_token_ids'])}-token head; `h` = the target's second-to-last "
                f"layer output; trained with {RECIPES[training['recipe']].unroll} unrolled steps")
    else:
        arch = (f"Llama, {config['num_hidden_layers']} decoder layers (initialised from the target's first), "
                f"hidden {config['hidden_size']}, {len(config['head_token_ids'])}-token head")
    lines = [
        f"# {folder.name}", "",
        f"A draft for `{training['teacher']}`, distilled by `specserve zoo train {training['recipe']}` and "
        f"exported by `specserve zoo export {training['recipe']}`.", "",
        f"- **Architecture**: {arch}. Token embeddings{' and head rows' if config.get('head_from_target') else ''} "
        f"are the target's (frozen, not stored here: `embeddings_from: {config.get('embeddings_from')}`).",
        f"- **Weights**: {weights_mb:.1f} MB, {_stored_dtype(folder)} safetensors.",
        f"- **Data**: {training['data']}.",
        f"- **Training**: {training['steps']} steps, {training['rows_seen']} rows seen, forward KL to the "
        f"target over the head's tokens on scored positions"
        + (f" plus {training['ce_weight']} x the cross-entropy on the answer's next token" if training.get("ce_weight") else "")
        + f"; {training['train_seconds'] / 60:.0f} min on "
        f"{training.get('trained_on') or meta.get('machine', 'this machine')}; final training loss {training['final_loss']}"
        + (f"; exported: step {training['exported_step']}, the best validation KL ({training['validation_kl']:.3f}) "
           f"on held-out answers" if training.get("validation_kl") is not None else "") + ".",
        "", "## Measured on held-out prompts", "",
        f"`specserve zoo eval {folder.name}`: {meta.get('prompts')} benchmark prompts per category (never seen in "
        f"training), greedy, {meta.get('max_tokens')} new tokens, window γ = {meta.get('window')}, "
        f"{meta.get('dtype', '')}. α = acceptance rate, τ = mean accepted length (tokens per step), "
        f"c = latency ratio (one draft step / one target decode step), speedup over target-only in the same run.",
        "", "| category | α | τ | c | speedup |", "| --- | --- | --- | --- | --- |",
    ]
    lines += [f"| {r['category']} | {r['acceptance_rate']:.3f} | {r['mean_accepted_len']:.2f} | "
              f"{r['latency_ratio']:.3f} | {r['speedup_vs_ar']:.2f}x |" for r in rows if r["draft"] == folder.name]
    card = folder / "README.md"
    card.write_text("\n".join(lines) + "\n")
    return card
