"""Training an EAGLE-3-style head ("EAGLE-3: Scaling up Inference Acceleration of Large Language
Models via Training-Time Test") on the feature cache (``training/features.py``).

The head (``replicas/drafts/hsr_head.py``) fuses the target's low, middle and high hidden states,
``h = fuse(h^low ⊕ h^mid ⊕ h^high)``, reads ``FC(e_t ⊕ h_{t-1})`` into one decoder layer, and is
trained with ``steps`` unrolled drafting steps (EAGLE-3's training-time test,
``training/hsr_train.py``): step j > 1 reads the head's own outputs, as drafting does. The loss per
step is the KL to the target over the head's vocabulary (the teacher from the cached final
states) plus ``ce_weight`` times the cross-entropy on the answer's next token. The same loop trains
the standalone draft LM from the cache too (its tokens, and the final states as the teacher:
``distill.standalone_loss``), on the CPU or, holding the whole cache in its memory, a GPU.

Choices for the reference target (30 layers, H = 576), and why (figures, measured on the committed
answers: docs/benchmarks.md):

- layers ``[2, 15, -2]`` (indices into transformers' ``hidden_states``: the outputs of decoder
  layers 1, 14 and 28). EAGLE-3 takes ``[2, L/2, L-3]``. The low and middle states carry what the
  top one has lost (a linear map from layer 28's state recovers little of them), while L-3 adds
  little to -2. -2 it is, because it is the input of the target's last layer, which the head's
  layer starts as a copy of: the fusion starts as ``[0 | 0 | I]``, exactly the single-layer head's
  input.
- 6 unrolled steps: the shipped windows are 4 by default and 1-8 under the window policies, and
  a step the head never trained on drifts (what the unrolling is for); positions past 6 are
  rarely reached (acceptance compounds). EAGLE-3 unrolls 7. Each step adds a sixth of a
  training step's cost.
- a 16,384-token head: the most frequent answer tokens of the training answers (ranked by answer
  counts, then prompt counts, then lowest id), because the head's rows are most of a drafting
  step's cost and of a training step's, and a wider head buys only a few points of coverage of
  held-out answer tokens on a CPU.
- the head's rows start as the target's output rows and stay frozen, as in the other recipes
  (not stored in the export);
- ``ce_weight`` 0.2: the cached teacher read only a window of a long prompt, so it is off where a
  long prompt matters, while the answer token is what greedy verification checks. The CE
  pulls toward it at a fifth of the weight, so the KL (the whole distribution, which sampled
  drafting needs) still leads.

Deviations from EAGLE-3 beyond the head's (``hsr_head``): data is the target's own greedy
answers, not ShareGPT and UltraChat regenerated at temperature; the loss adds the KL to the
target's distribution to EAGLE-3's token loss; the head's vocabulary is ranked by the answers'
token counts (EAGLE-3 ranks the draft vocabulary the same way, over its training data).
"""

from __future__ import annotations

import json
import os
from collections import Counter
from collections.abc import Iterable
from pathlib import Path

import torch

from specserve.data.answers import Answer
from specserve.replicas.drafts.hsr_head import HSRHead, build_hsr_head
from specserve.replicas.drafts.pruned_head import save_without_embeddings
from specserve.replicas.model_store import bf16_is_fast, load_causal_lm
from specserve.training import features as feature_cache
from specserve.training.distill import (
    DistillConfig,
    TrainLog,
    best_path,
    build_student,
    load_weights,
    standalone_loss,
    standalone_metrics,
)
from specserve.training.distill import train as train_loop
from specserve.training.hsr_train import hsr_loss, hsr_metrics


def head_vocabulary(answers: Iterable[Answer], k: int, vocab_size: int, always: Iterable[int] = ()) -> list[int]:
    """The ``k`` ids a head covers, ascending: ``always`` (EOS: it must be proposable), then by
    count in the answers' answer tokens, then in their prompts, then the lowest ids left (a BPE
    vocabulary's first merges are its most frequent)."""
    written, read = Counter(), Counter()
    for a in answers:
        written.update(a.tokens[a.prompt_len:])
        read.update(a.tokens[:a.prompt_len])
    chosen = dict.fromkeys(int(t) for t in always)
    for ranking in ([t for t, _ in written.most_common()], [t for t, _ in read.most_common()], range(vocab_size)):
        for token in ranking:
            if len(chosen) >= k:
                break
            chosen.setdefault(int(token))
    return sorted(chosen)


def coverage(answers: Iterable[Answer], head: list[int]) -> float:
    """The share of the answers' answer tokens the head can propose."""
    inside = set(head)
    total = hits = 0
    for a in answers:
        written = a.tokens[a.prompt_len:]
        total += len(written)
        hits += sum(t in inside for t in written)
    return hits / max(1, total)


def train_on_features(spec, model, head_weight: torch.Tensor, work: Path, cache: Path | None = None,
                      steps: int | None = None, batch: int | None = None, validate_every: int = 200,
                      validation_sequences: int = 64, autocast_bf16: bool = False, checkpoint_every: int = 100,
                      device: str | None = None) -> Path:
    """Train ``model`` (an HSR head or a standalone draft built for the recipe ``spec``) on the
    feature cache, on ``device`` (default: where ``model`` is), resuming ``work/checkpoint.pt``. The shards of the first start are pinned in ``work/data.json``: a
    resumed run sees exactly the batches an unbroken one would, even if the cache grew since.
    Logs ``work/train.log`` (per step: loss; per validation: KL per step, top-1 per step, the
    first of which is the first drafted token's greedy acceptance) and plots it (``plot_training``)."""
    data_file = work / "data.json"
    pinned = json.loads(data_file.read_text()) if data_file.exists() else None
    device = torch.device(device) if device is not None else next(model.parameters()).device
    # On an accelerator the whole cache moves into its memory; on the CPU rows stay memory-mapped.
    reader = feature_cache.FeatureCache(cache, shards=pinned["shards"] if pinned else None,
                                        device=device if device.type != "cpu" else None)
    model.to(device)
    head_weight = head_weight.to(device)
    if spec.feature_layers is not None and list(reader.layers) != list(spec.feature_layers):
        raise ValueError(f"the feature cache in {reader.folder} holds layers {reader.layers}; {spec.name} reads "
                         f"{list(spec.feature_layers)}: build the cache with layers={tuple(spec.feature_layers)}")
    batch = batch or spec.batch
    if pinned is None:
        pinned = {"shards": reader.shards, "batch": batch, "cache": str(reader.folder),
                  "settings": reader.meta["settings"], "device": describe(device)}
        data_file.write_text(json.dumps(pinned, indent=2) + "\n")
    elif pinned["batch"] != batch:
        raise ValueError(f"{work} was started with batch {pinned['batch']}; a resumed run must keep it (got {batch})")
    training, validation = reader.split()
    held_out = [feature_cache.collate([reader.row(s) for s in validation[i:i + batch]])
                for i in range(0, min(len(validation), validation_sequences), batch)]
    config = DistillConfig(steps=steps or spec.steps, lr=spec.lr, warmup_steps=spec.warmup_steps,
                           checkpoint_every=checkpoint_every, validate_every=validate_every,
                           autocast_bf16=autocast_bf16)
    if spec.kind == "hsr":
        loss = hsr_loss(model, head_weight, spec.unroll, autocast_bf16, spec.ce_weight)
    else:
        loss = standalone_loss(model, head_weight, autocast_bf16)
    log = TrainLog(work, config.steps, f"zoo train {spec.name}")
    last: dict = {}

    def validate() -> float:   # lower is better: the mean KL over the unrolled steps
        last.update(hsr_metrics(model, head_weight, spec.unroll, held_out, autocast_bf16) if spec.kind == "hsr"
                    else standalone_metrics(model, head_weight, held_out, autocast_bf16))
        return sum(last["kl"]) / len(last["kl"])

    def on_validate(step: int, value: float, best: bool) -> None:
        log.bar.write(f"step {step}: validation KL {value:.4f}, first-token acceptance {last['top1'][0]:.3f}"
                      f"{' (best so far)' if best else ''}")
        log.write({"step": step, "validation": round(value, 5), "best": best,
                   "kl_by_step": [round(k, 4) for k in last["kl"]], "top1_by_step": [round(a, 4) for a in last["top1"]],
                   "teacher_top1_by_step": [round(a, 4) for a in last["teacher_top1"]],
                   "acceptance_1": round(last["top1"][0], 4), "positions": last["positions"]})
        plot_training(work)

    try:
        train_loop(model, loss, feature_cache.batch_stream(reader, training, batch), config, work / "checkpoint.pt",
                   on_step=log.on_step, validate=validate if held_out else None, on_validate=on_validate)
    finally:
        log.close()
    plot_training(work)
    return work


def describe(device: torch.device) -> str:
    """The device a run trained on, for its card: the accelerator's name, or the CPU's."""
    if device.type == "cuda":
        return f"one {torch.cuda.get_device_name(device)} GPU"
    import platform

    return f"{os.cpu_count()} CPU cores ({platform.machine()})"


def _moving_average(values: list[float], width: int) -> list[float]:
    out, total = [], 0.0
    for i, v in enumerate(values):
        total += v - (values[i - width] if i >= width else 0.0)
        out.append(total / min(i + 1, width))
    return out


def plot_training(work: Path, out: Path | None = None) -> Path:
    """``train.png`` beside ``work/train.log`` (callable while a run goes on): the training loss,
    the validation KL per unrolled step, and the validation's top-1 agreement per step (step 1's
    is the first drafted token's greedy acceptance)."""
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    records = [json.loads(line) for line in (work / "train.log").read_text().splitlines() if line.strip()]
    losses = [r for r in records if "loss" in r]
    checks = [r for r in records if "validation" in r]
    fig, (ax_loss, ax_kl, ax_acc) = plt.subplots(1, 3, figsize=(15, 4.2))
    if losses:
        steps = [r["step"] for r in losses]
        values = [r["loss"] for r in losses]
        ax_loss.plot(steps, values, color="0.8", lw=0.8, label="per step")
        ax_loss.plot(steps, _moving_average(values, 50), color="C0", label="mean of 50")
    ax_loss.set(title="training loss (KL + CE, mean over steps)", xlabel="step")
    ax_loss.legend()
    if checks:
        steps = [r["step"] for r in checks]
        ax_kl.plot(steps, [r["validation"] for r in checks], "k-o", ms=3, label="mean")
        for j in range(len(checks[-1].get("kl_by_step", []))):
            ax_kl.plot(steps, [r["kl_by_step"][j] for r in checks], lw=1, label=f"step {j + 1}")
            ax_acc.plot(steps, [r["top1_by_step"][j] for r in checks], lw=1.5 if j == 0 else 1,
                        label="step 1: acceptance" if j == 0 else f"step {j + 1}")
        ax_acc.plot(steps, [r["teacher_top1_by_step"][0] for r in checks], "k--", lw=1,
                    label="step 1: = teacher argmax")
    ax_kl.set(title="validation KL to the target", xlabel="step")
    ax_acc.set(title="validation: head argmax = next answer token", xlabel="step", ylim=(0, 1))
    for ax in (ax_kl, ax_acc):
        if ax.lines:
            ax.legend(fontsize=7)
    fig.suptitle(work.name)
    fig.tight_layout()
    out = out or work / "train.png"
    fig.savefig(out, dpi=110)
    plt.close(fig)
    return out


def best_or_last(work: Path) -> Path:
    checkpoint = work / "checkpoint.pt"
    return best_path(checkpoint) if best_path(checkpoint).exists() else checkpoint


def build_head(spec, target, head: list[int]) -> HSRHead:
    """The recipe's draft for ``target``: an HSR head reading its feature layers, or a
    standalone draft of ``spec.layers`` layers; the head rows trained or frozen."""
    if spec.kind == "hsr":
        model = build_hsr_head(target, head, list(spec.feature_layers) if spec.feature_layers else None)
    else:
        model = build_student(target, spec.layers, head)
    model.lm_head.weight.requires_grad_(spec.train_head)
    return model


def train_recipe(spec, work: Path, cache: Path | None = None, steps: int | None = None, batch: int | None = None,
                 validate_every: int = 200, validation_sequences: int = 64, autocast_bf16: bool | None = None,
                 checkpoint_every: int = 100, device: str | None = None) -> Path:
    """Train the recipe ``spec`` (a ``zoo.Recipe`` with ``data="features"``) on the feature cache
    ``cache`` (default ``features.features_dir()``) into ``work``, resuming its checkpoint: the
    head's vocabulary counted on the cached training answers, the target the cache was built
    from. ``steps`` and ``batch`` override the recipe's (the learning rate's schedule spans
    ``steps``: a run resumed with other ``steps`` is not the unbroken run's). ``autocast_bf16``: the
    head's forward under bfloat16 autocast (None: where ``device`` has native bf16). ``device``:
    where it trains (default: the CPU; an accelerator holds the whole cache in its memory). A
    stopped run loses at most ``checkpoint_every`` steps. Returns ``work``."""
    work.mkdir(parents=True, exist_ok=True)
    data_file = work / "data.json"
    pinned = json.loads(data_file.read_text())["shards"] if data_file.exists() else None
    reader = feature_cache.FeatureCache(cache, shards=pinned)
    loaded = load_causal_lm(reader.meta["settings"]["target"], dtype="float32", device="cpu")
    target = loaded.model
    head_file = work / "head_token_ids.json"
    if head_file.exists():
        head = json.loads(head_file.read_text())
    else:
        training, _ = reader.split()
        head = head_vocabulary(reader.answers(training), spec.head_tokens, target.config.vocab_size,
                               always=sorted(loaded.eos_token_ids))
        head_file.write_text(json.dumps(head))
    head_weight = target.get_output_embeddings().weight.detach()[torch.tensor(head)].clone()
    model = build_head(spec, target, head)
    del target, loaded
    # float32 weights and optimizer state, bfloat16 autocast where the device has native bf16.
    device = torch.device(device or "cpu")
    autocast = bf16_is_fast(device) if autocast_bf16 is None else autocast_bf16
    return train_on_features(spec, model, head_weight, work, reader.folder, steps, batch, validate_every,
                             validation_sequences, autocast, checkpoint_every, device)


def export_recipe(spec, work: Path, out: Path) -> Path:
    """The best-validating weights of ``work`` (else the latest) as a draft folder ``out`` that
    ``load_causal_lm`` loads: the head in ``spec.export_dtype`` without the target's embeddings
    and frozen head rows (they load from the target the cache was built from), the tokenizer,
    and ``training.json``."""
    checkpoint = work / "checkpoint.pt"
    if not checkpoint.exists():
        raise FileNotFoundError(f"no checkpoint in {work}: train {spec.name} first")
    data = json.loads((work / "data.json").read_text())
    settings = data["settings"]
    target = load_causal_lm(settings["target"], dtype="float32", device="cpu")
    model = build_head(spec, target.model, json.loads((work / "head_token_ids.json").read_text()))
    chosen = load_weights(best_or_last(work), model)
    save_without_embeddings(model, out, embeddings_from=settings["target"], dtype=getattr(torch, spec.export_dtype))
    target.tokenizer.save_pretrained(out)
    log = [json.loads(line) for line in (work / "train.log").read_text().splitlines() if line.strip()]
    seconds = sum(b["elapsed_s"] - a["elapsed_s"] for a, b in zip(log, log[1:]) if b["elapsed_s"] > a["elapsed_s"])
    losses = [r for r in log if "loss" in r]
    checks = {r["step"]: r for r in log if "validation" in r}
    trained = torch.load(checkpoint, map_location="cpu", weights_only=False)["step"]
    answers = settings.get("answers", {})
    (out / "training.json").write_text(json.dumps({
        "recipe": spec.name, "kind": spec.kind, "description": spec.description, "steps": trained,
        "rows_seen": trained * data["batch"], "train_seconds": round(seconds), "trained_on": data.get("device"),
        "exported_step": chosen["step"],
        "validation_kl": chosen.get("validation"),
        "validation_acceptance_1": checks.get(chosen["step"], {}).get("acceptance_1"),
        "final_loss": losses[-1]["loss"] if losses else None, "teacher": settings["target"],
        "feature_layers": list(spec.feature_layers) if spec.feature_layers else None, "unroll": spec.unroll, "ce_weight": spec.ce_weight,
        "data": f"the target's own greedy answers (<= {answers.get('answer_tokens')} new tokens) to held-out ShareGPT "
                f"prompts (first turns, later turns with their context; from conversation "
                f"#{answers.get('first_conversation')}) and HumanEval problems, read by the target with the last "
                f"{settings['context']} prompt tokens before each answer ({len(data['shards'])} shards of the feature "
                f"cache), answer positions scored, every {feature_cache.VALIDATION_EVERY}th answer held out",
    }, indent=2) + "\n")
    return out
