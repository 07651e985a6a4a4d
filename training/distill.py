"""Distilling a small draft from the target: the student, the loss, and a resumable loop.

The student is a ``PrunedHeadLlamaForCausalLM`` as wide as the target, so it can take the
target's token embeddings as they are (frozen: they already encode what the target knows about
tokens, and they are most of a small model's parameters), its first layers as a starting point,
and the rows of the target's output layer for the head's tokens.

Loss (forward KL, per position): ``Σ_v p_T(v) (log p_T(v) − log q_S(v))`` over the head's tokens,
with the teacher's distribution renormalised over the head. Matching the target's whole
distribution, not only its argmax, is what makes the student's *sampled* proposals accepted too.
The teacher's distribution comes from the corpus (``training/corpus.py``): its final hidden
states times the output rows of the head's tokens, so training never runs the target.

Checkpoints hold the trainable weights, the optimizer, the step and the random state, written
atomically; a run that stops (its process is killed, a machine is reclaimed) resumes from the last
one and continues exactly as if it had never stopped (tests/training/test_distill.py checks this).
"""

from __future__ import annotations

import json
import math
import os
import time
from collections import Counter
from collections.abc import Callable, Iterable, Iterator
from dataclasses import asdict, dataclass
from pathlib import Path

import torch
import torch.nn.functional as F

from specserve.replicas.drafts.pruned_head import PrunedHeadConfig, PrunedHeadLlamaForCausalLM


def most_frequent_tokens(sequences: Iterable[list[int]], k: int, always: Iterable[int] = ()) -> list[int]:
    """The ``k`` most frequent token ids (``always`` included first: EOS and chat markers must be
    proposable), in ascending id order."""
    counts = Counter(t for seq in sequences for t in seq)
    chosen = list(dict.fromkeys(always))
    for token, _ in counts.most_common():
        if len(chosen) >= k:
            break
        if token not in chosen:
            chosen.append(token)
    return sorted(chosen[:k])


def build_student(target, layers: int, head_token_ids: list[int]) -> PrunedHeadLlamaForCausalLM:
    """A ``layers``-layer pruned-head student initialised from the target (a Llama-family model)."""
    tc = target.config
    config = PrunedHeadConfig.from_dict({
        **{k: v for k, v in tc.to_dict().items() if k not in ("architectures", "model_type", "auto_map")},
        "num_hidden_layers": layers, "head_token_ids": head_token_ids, "tie_word_embeddings": False,
    })
    student = PrunedHeadLlamaForCausalLM(config)
    state = {k: v for k, v in target.state_dict().items()
             if not k.startswith("model.layers.") or int(k.split(".")[2]) < layers}
    head = torch.tensor(head_token_ids)
    out_weight = target.get_output_embeddings().weight
    state["lm_head.weight"] = out_weight.detach()[head].clone()
    missing, unexpected = student.load_state_dict(state, strict=False)
    if missing or unexpected:
        raise ValueError(f"student and target disagree: missing {missing[:5]}, unexpected {unexpected[:5]}")
    student.model.embed_tokens.weight.requires_grad_(False)
    return student.float()


def teacher_log_probs(final: torch.Tensor, head_weight: torch.Tensor) -> torch.Tensor:
    """The teacher's log-distribution renormalised over the head, from its final-norm hidden
    states (the corpus stores those, not logits): final [N, H], head_weight [K, H] -> [N, K]."""
    return F.log_softmax(final.float() @ head_weight.float().T, dim=-1)


def distill_loss(student_head_logits: torch.Tensor, teacher_logp: torch.Tensor, weights: torch.Tensor) -> torch.Tensor:
    """Weighted mean forward KL per position. logits, teacher_logp: [N, K]; weights: [N]."""
    student = F.log_softmax(student_head_logits.float(), dim=-1)
    kl = (teacher_logp.exp() * (teacher_logp - student)).sum(-1)
    return (kl * weights).sum() / weights.sum().clamp(min=1e-6)


def standalone_loss(student: PrunedHeadLlamaForCausalLM, head_weight: torch.Tensor, autocast_bf16: bool = False):
    """``loss(batch)`` for a standalone draft on a corpus batch ``{tokens, final, weights}``:
    the KL at every weighted position, its head evaluated only there."""

    def loss(batch: dict) -> torch.Tensor:
        tokens, weights = batch["tokens"], batch["weights"]
        with torch.autocast(tokens.device.type, dtype=torch.bfloat16, enabled=autocast_bf16):
            hidden = student.model(input_ids=tokens).last_hidden_state
            where = weights > 0
            logits = student.head_logits(hidden[where])
        return distill_loss(logits, teacher_log_probs(batch["final"][where], head_weight), weights[where])

    return loss


@torch.no_grad()
def standalone_metrics(student: PrunedHeadLlamaForCausalLM, head_weight: torch.Tensor, batches,
                       autocast_bf16: bool = False) -> dict:
    """Validation over ``batches`` in ``hsr_train.hsr_metrics``'s form with one step: the weighted
    KL to the teacher, how often the student's argmax over its head is the next token (``top1``,
    teacher-forced: the first drafted token's greedy acceptance) and the teacher's argmax
    (``teacher_top1``)."""
    kl = hits = teacher_hits = total = 0.0
    for batch in batches:
        tokens, weights = batch["tokens"], batch["weights"]
        where = weights > 0
        head = student.head_token_ids(tokens.device)
        with torch.autocast(tokens.device.type, dtype=torch.bfloat16, enabled=autocast_bf16):
            hidden = student.model(input_ids=tokens).last_hidden_state
            logits = student.head_logits(hidden[where]).float()
        teacher = teacher_log_probs(batch["final"][where], head_weight)
        following = torch.cat([tokens[:, 1:], tokens[:, :1]], dim=1)[where]   # weight 0 on the last position
        best = logits.argmax(-1)
        w = weights[where]
        kl += float(distill_loss(logits, teacher, w)) * float(w.sum())
        hits += float((w * (head[best] == following)).sum())
        teacher_hits += float((w * (best == teacher.argmax(-1))).sum())
        total += float(w.sum())
    total = max(total, 1e-9)
    return {"kl": [kl / total], "top1": [hits / total], "teacher_top1": [teacher_hits / total], "positions": int(total)}


@dataclass(frozen=True)
class DistillConfig:
    steps: int
    lr: float = 1e-3
    warmup_steps: int = 50
    weight_decay: float = 0.0
    checkpoint_every: int = 100
    validate_every: int = 200
    seed: int = 0
    autocast_bf16: bool = False   # student forward under bfloat16 autocast (fast on AVX512-BF16 / CUDA)


def _lr_factor(step: int, config: DistillConfig) -> float:
    """Linear warm-up, then cosine decay to 10%."""
    if step < config.warmup_steps:
        return (step + 1) / config.warmup_steps
    progress = (step - config.warmup_steps) / max(1, config.steps - config.warmup_steps)
    return 0.1 + 0.9 * 0.5 * (1 + math.cos(math.pi * min(1.0, progress)))


def _trainable(student) -> list[torch.nn.Parameter]:
    return [p for p in student.parameters() if p.requires_grad]


def save_checkpoint(path: Path, student, optimizer, step: int, config: DistillConfig) -> None:
    tmp = path.with_suffix(".partial")
    names = {id(p): n for n, p in student.named_parameters()}
    torch.save({
        "step": step,
        "config": asdict(config),
        "trainable": {names[id(p)]: p.detach().clone() for p in _trainable(student)},
        "optimizer": optimizer.state_dict(),
        "rng": torch.get_rng_state(),
    }, tmp)
    os.replace(tmp, path)   # atomic: a stop mid-write leaves the previous checkpoint intact


def load_checkpoint(path: Path, student, optimizer) -> int:
    state = load_weights(path, student)
    optimizer.load_state_dict(state["optimizer"])
    torch.set_rng_state(state["rng"])
    return int(state["step"])


def best_path(checkpoint: Path) -> Path:
    """Where ``train`` keeps the weights that scored best on validation, beside ``checkpoint``."""
    return checkpoint.with_name("best.pt")


def save_best(path: Path, student, step: int, validation: float) -> None:
    tmp = path.with_suffix(".partial")
    torch.save({"step": step, "validation": validation,
                "trainable": {n: p.detach().clone() for n, p in student.named_parameters() if p.requires_grad}}, tmp)
    os.replace(tmp, path)


def load_weights(path: Path, student) -> dict:
    """Copy a checkpoint's (or best.pt's) trained weights into ``student``; returns its record."""
    state = torch.load(path, map_location="cpu", weights_only=False)
    with torch.no_grad():
        params = dict(student.named_parameters())
        for name, value in state["trainable"].items():
            params[name].copy_(value)
    return state


def train(
    model: torch.nn.Module,
    loss: Callable[[dict], torch.Tensor],
    batches: Callable[[int], Iterator[dict]],
    config: DistillConfig,
    checkpoint: Path,
    on_step: Callable[[int, float], None] = lambda step, loss: None,
    validate: Callable[[], float] | None = None,
    on_validate: Callable[[int, float, bool], None] = lambda step, value, best: None,
) -> int:
    """Train ``model``'s trainable parameters for ``config.steps`` steps; returns the step reached.

    ``batches(start)`` yields batches from batch number ``start`` on, so that a resumed run sees
    exactly the batches it had not seen yet. Every ``config.validate_every`` steps ``validate()``
    (lower is better) scores the model, and the best so far is kept in ``best_path(checkpoint)``:
    with a small corpus the last step is not the best one.
    """
    torch.manual_seed(config.seed)
    optimizer = torch.optim.AdamW(_trainable(model), lr=config.lr, weight_decay=config.weight_decay)
    step = load_checkpoint(checkpoint, model, optimizer) if checkpoint.exists() else 0
    best = best_path(checkpoint)
    if step == 0:
        best.unlink(missing_ok=True)   # a fresh run must not compete with an earlier run's best
    best_value = torch.load(best, weights_only=False)["validation"] if best.exists() else math.inf
    model.train()
    for batch in batches(step):
        if step >= config.steps:
            break
        for group in optimizer.param_groups:
            group["lr"] = config.lr * _lr_factor(step, config)
        value = loss(batch)
        optimizer.zero_grad(set_to_none=True)
        value.backward()
        torch.nn.utils.clip_grad_norm_(_trainable(model), 1.0)
        optimizer.step()
        step += 1
        on_step(step, float(value.detach()))
        if validate is not None and (step % config.validate_every == 0 or step == config.steps):
            model.eval()
            with torch.no_grad():
                score = float(validate())
            model.train()
            if score < best_value:
                best_value = score
                save_best(best, model, step, score)
            on_validate(step, score, score == best_value)
        if step % config.checkpoint_every == 0 or step == config.steps:
            save_checkpoint(checkpoint, model, optimizer, step, config)
    model.eval()
    return step


def seeded_batches(count: int, batch: int, make: Callable[[list[int]], dict], seed: int = 0):
    """``batches(start)`` for ``train`` over ``count`` items: batch ``b`` is ``make`` of a slice of
    a seeded shuffle per epoch, a pure function of ``b``, so a resumed run sees exactly the
    batches an unbroken one would."""
    per_epoch = count // batch

    def batches(start: int):
        b = start
        while True:
            epoch, i = divmod(b, per_epoch)
            order = torch.randperm(count, generator=torch.Generator().manual_seed(seed + epoch))
            yield make(order[i * batch:(i + 1) * batch].tolist())
            b += 1

    return batches


class TrainLog:
    """A run's ``train.log`` in ``work`` (a JSON line per step and per validation, appended: a
    resumed run goes on where it stopped) and its progress bar."""

    def __init__(self, work: Path, steps: int, desc: str, progress: bool = True):
        from tqdm import tqdm

        self.file = (Path(work) / "train.log").open("a")
        self.bar = tqdm(total=steps, desc=desc, unit="step", disable=not progress)
        self.began = time.monotonic()

    @property
    def elapsed_s(self) -> float:
        return round(time.monotonic() - self.began, 1)

    def on_step(self, step: int, loss: float) -> None:
        """``train``'s ``on_step``: the bar at ``step`` (a resumed run starts past 0), the loss logged."""
        self.bar.n = step
        self.bar.set_postfix(loss=f"{loss:.3f}")
        self.write({"step": step, "loss": round(loss, 5)})

    def write(self, record: dict) -> None:
        """One line: ``record`` and the seconds since the run (re)started."""
        self.file.write(json.dumps({**record, "elapsed_s": self.elapsed_s}) + "\n")
        self.file.flush()

    def close(self) -> None:
        self.bar.close()
        self.file.close()


def export_best(model, work: Path, out: Path) -> tuple[dict, list[dict], dict]:
    """``model`` with the weights of ``work``'s checkpoint that validated best (else its latest),
    written to ``out`` without what is the target's (``save_without_embeddings``) beside the
    target's tokenizer. Returns the weights chosen (their step and validation), the run's log
    records and the checkpoint."""
    from specserve.replicas.drafts.pruned_head import save_without_embeddings
    from specserve.replicas.model_store import REFERENCE_TARGET, load_causal_lm

    checkpoint = Path(work) / "checkpoint.pt"
    chosen = load_weights(best_path(checkpoint) if best_path(checkpoint).exists() else checkpoint, model)
    save_without_embeddings(model, out, embeddings_from=REFERENCE_TARGET)
    load_causal_lm(REFERENCE_TARGET, dtype="float32", device="cpu").tokenizer.save_pretrained(out)
    log = [json.loads(line) for line in (Path(work) / "train.log").read_text().splitlines() if line.strip()]
    return chosen, log, torch.load(checkpoint, map_location="cpu", weights_only=False)
