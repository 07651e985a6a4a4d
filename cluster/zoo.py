"""The draft zoo: named recipes for drafts distilled from the reference target.

    specserve zoo list
    specserve zoo train smollm2-draft-2l [--steps N] [--work DIR]     # resumable: run it again to go on

Training text is held out from every benchmark: ShareGPT conversations after the first
``SHAREGPT_HELD_OUT`` (the benchmark prompts come from the start of the file) and HumanEval
problems from ``HUMANEVAL_HELD_OUT`` on (problems 0..99 are the code / edit benchmark prompts).
Conversations are rendered with the target's chat template and packed into fixed-length rows.

An exported draft does not store its token embeddings: they are the target's, frozen during
training, and at half precision they alone would take 56 MB of the 60 MB budget for all drafts.
Its config names the target (``embeddings_from``) and the model store copies them in at load.
"""

from __future__ import annotations

import json
import time
from collections.abc import Iterator
from dataclasses import dataclass
from itertools import islice
from pathlib import Path

import torch

from specserve.cluster.prompts import CODE_TEMPLATE, human_eval_problems, sharegpt_conversations
from specserve.replicas.distill import DistillConfig, build_student, distill, load_checkpoint, most_frequent_tokens
from specserve.replicas.drafts.pruned_head import save_without_embeddings
from specserve.replicas.model_store import REFERENCE_TARGET, load_causal_lm, model_cache_dir, zoo_dir
from specserve.router.prompt_ids import encode_chat

SHAREGPT_HELD_OUT = 5000
HUMANEVAL_HELD_OUT = 100
_ROLES = {"human": "user", "user": "user", "gpt": "assistant", "chatgpt": "assistant", "assistant": "assistant"}


@dataclass(frozen=True)
class Recipe:
    name: str
    description: str
    layers: int
    head_tokens: int          # K: the output layer's vocabulary
    seq_len: int = 256
    batch: int = 8
    steps: int = 1500         # 1500 x 8 x 256 = 3.1M tokens
    lr: float = 1e-3


RECIPES = {
    r.name: r for r in (
        Recipe("smollm2-draft-2l", "standalone draft LM: the target's first 2 layers, retrained, "
               "8k-token head, frozen target embeddings", layers=2, head_tokens=8192),
    )
}


def recipe(name: str) -> Recipe:
    if name not in RECIPES:
        raise ValueError(f"unknown draft recipe {name!r}; the zoo has: {', '.join(RECIPES)}")
    return RECIPES[name]


def training_conversations() -> Iterator[list[dict]]:
    """Held-out chat conversations as ``[{"role", "content"}]``, HumanEval interleaved with ShareGPT."""
    code = [
        [{"role": "user", "content": CODE_TEMPLATE.format(code=p["prompt"])},
         {"role": "assistant", "content": p["canonical_solution"]}]
        for p in human_eval_problems()[HUMANEVAL_HELD_OUT:]
    ]
    for i, turns in enumerate(islice(sharegpt_conversations(), SHAREGPT_HELD_OUT, None)):
        messages = [{"role": _ROLES[t["from"]], "content": t["value"]} for t in turns
                    if t.get("from") in _ROLES and t.get("value")]
        if len(messages) >= 2 and messages[0]["role"] == "user":
            yield messages
        if code and i % 50 == 0:        # code is a few percent of the mix, spread through it
            yield code[(i // 50) % len(code)]


def token_rows(tokenizer, seq_len: int) -> Iterator[list[int]]:
    """Rendered conversations packed back to back into rows of ``seq_len`` tokens."""
    buffer: list[int] = []
    for messages in training_conversations():
        try:
            buffer.extend(encode_chat(tokenizer, messages))
        except Exception:  # noqa: BLE001 - a template that rejects a conversation's role order: skip it
            continue
        while len(buffer) >= seq_len:
            yield buffer[:seq_len]
            del buffer[:seq_len]


def batch_stream(tokenizer, seq_len: int, batch: int):
    """``batches(start)`` for ``distill``: the same rows on every call, from batch ``start`` on."""

    def batches(start: int):
        rows = token_rows(tokenizer, seq_len)
        for _ in islice(rows, start * batch):   # skip what a resumed run has already seen
            pass
        while True:
            chunk = list(islice(rows, batch))
            if len(chunk) < batch:
                return
            ids = torch.tensor(chunk)
            yield ids, torch.ones_like(ids)

    return batches


def work_dir(name: str) -> Path:
    return model_cache_dir().parent / "zoo" / name


def train(name: str, steps: int | None = None, work: Path | None = None, head_sample_rows: int = 4000) -> Path:
    """Distil ``name`` (resuming its checkpoint if there is one); returns the work directory."""
    from tqdm import tqdm

    spec = recipe(name)
    work = work or work_dir(name)
    work.mkdir(parents=True, exist_ok=True)
    teacher = load_causal_lm(REFERENCE_TARGET, dtype="auto")
    tokenizer = teacher.tokenizer
    head_file = work / "head_token_ids.json"
    if head_file.exists():
        head = json.loads(head_file.read_text())
    else:
        always = sorted(teacher.eos_token_ids | set(tokenizer.all_special_ids))
        head = most_frequent_tokens(islice(token_rows(tokenizer, spec.seq_len), head_sample_rows),
                                    spec.head_tokens, always=always)
        head_file.write_text(json.dumps(head))
    # The student trains in float32 (optimizer state too), under bf16 autocast where the teacher
    # itself runs in bf16, i.e. where the hardware has native bf16.
    student = build_student(teacher.model, spec.layers, head)
    config = DistillConfig(steps=steps or spec.steps, lr=spec.lr, autocast_bf16=teacher.model.dtype == torch.bfloat16)
    log = (work / "train.log").open("a")
    bar = tqdm(total=config.steps, desc=f"zoo train {name}", unit="step")
    started = time.monotonic()

    def on_step(step: int, loss: float) -> None:
        if bar.n == 0:
            bar.update(step - 1)
        bar.update(1)
        bar.set_postfix(loss=f"{loss:.3f}")
        log.write(json.dumps({"step": step, "loss": round(loss, 5), "elapsed_s": round(time.monotonic() - started, 1)}) + "\n")
        log.flush()

    distill(teacher.model, student, batch_stream(tokenizer, spec.seq_len, spec.batch), config,
            work / "checkpoint.pt", on_step=on_step)
    bar.close()
    return work


def export(name: str, work: Path | None = None, out: Path | None = None) -> Path:
    """The latest checkpoint as a loadable draft in the zoo folder (half precision, no embeddings)."""
    spec = recipe(name)
    work = work or work_dir(name)
    checkpoint = work / "checkpoint.pt"
    if not checkpoint.exists():
        raise FileNotFoundError(f"no checkpoint in {work}: run `specserve zoo train {name}` first")
    teacher = load_causal_lm(REFERENCE_TARGET, dtype="float32")
    student = build_student(teacher.model, spec.layers, json.loads((work / "head_token_ids.json").read_text()))
    step = load_checkpoint(checkpoint, student, torch.optim.AdamW([p for p in student.parameters() if p.requires_grad]))
    out = out or zoo_dir() / name
    save_without_embeddings(student, out, embeddings_from=REFERENCE_TARGET)
    teacher.tokenizer.save_pretrained(out)
    log = [json.loads(line) for line in (work / "train.log").read_text().splitlines() if line.strip()]
    seconds = sum(b["elapsed_s"] - a["elapsed_s"] for a, b in zip(log, log[1:]) if b["elapsed_s"] > a["elapsed_s"])
    (out / "training.json").write_text(json.dumps({
        "recipe": name, "description": spec.description, "steps": step,
        "tokens_seen": step * spec.batch * spec.seq_len, "train_seconds": round(seconds),
        "final_loss": log[-1]["loss"] if log else None, "teacher": REFERENCE_TARGET,
        "data": f"ShareGPT V3 conversations from #{SHAREGPT_HELD_OUT} on, HumanEval problems from #{HUMANEVAL_HELD_OUT} "
                f"on (held out: every benchmark prompt), chat-templated, packed into {spec.seq_len}-token rows",
    }, indent=2) + "\n")
    return out


def forward_ms(model, context: list[int], reps: int = 20) -> float:
    """Median time of one cached decode forward after ``context``: the unit of the latency ratio c."""
    from specserve.replicas.kv_session import KVSession

    session = KVSession(model)
    session.extend(context, logits_rows=1)
    times = []
    for i in range(reps + 3):
        start = time.perf_counter()
        session.extend([context[i % len(context)]], logits_rows=1)
        times.append(time.perf_counter() - start)
        session.crop(len(context))
    return 1e3 * sorted(times[3:])[reps // 2]


def evaluate(drafts: list[str], prompts_per_category: int = 4, max_tokens: int = 64, window: int = 3,
             dtype: str = "auto") -> list[dict]:
    """Per draft and category, on benchmark prompts (held out from training), greedy, one stream:
    ``{draft, category, acceptance_rate, mean_accepted_len, latency_ratio, speedup_vs_ar}``."""
    from tqdm import tqdm

    from specserve.cluster.prompts import CATEGORIES, load_prompts
    from specserve.router.engine import GenerateRequest, SpecEngine

    engine = SpecEngine.load(dtype=dtype, draft_models=drafts)
    names = [n for n in engine.drafts if n != "prompt-lookup"]
    probe = engine.encode(load_prompts("chat", 1)[0])
    target_ms = forward_ms(engine.loaded.model, probe)
    ratio = {n: forward_ms(engine.drafts[n].session.model, probe) / target_ms for n in names}
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
