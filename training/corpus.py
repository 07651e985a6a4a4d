"""The distillation corpus, computed once and reused by every draft recipe, in two parts:

- **answers**: the target's own greedy answers to held-out prompts, with its hidden states;
- **transcripts**: held-out ShareGPT conversations as written, read by the target in one
  teacher-forced pass (``<dir>/transcripts``). A pass costs far less than generating the same
  number of tokens, so this part is where the bulk of the data comes from: a draft trained on the
  answers alone (140k answer tokens) learns them by heart and stops generalising. EAGLE trains on
  such fixed ShareGPT text for the same reason.

Why the target's answers and not the dataset's: a draft is judged on how often it agrees with
what the target writes, and a 135M model writes quite differently from ShareGPT's GPT-3.5
(sequence-level knowledge distillation, Kim & Rush 2016; EAGLE and Sparrow regenerate their
training answers with the target for the same reason). Greedy, up to 128 new tokens: exactly
what the acceptance thresholds are measured on.

Why store hidden states: for every position the corpus keeps the target's
- ``features``: the output of its second-to-last decoder layer, the input of a hidden-state-reuse
  head (Sparrow Eq. 1, ``h^h``);
- ``final``: its last hidden state after the final norm, from which the teacher's logits over any
  head are one small matmul (``final @ W_out[head].T``).
So training never runs the 30-layer target again: a training step costs only the student.

Layout: ``<dir>/shard-NNNNN.pt``, one per generation batch, each a list of records
``{category, prompt_len, tokens [T], features [T, H], final [T, H]}`` (bfloat16), written
atomically; an interrupted build resumes at the first missing shard. ``meta.json`` marks a
finished build.
"""

from __future__ import annotations

import json
import os
from collections.abc import Callable
from dataclasses import dataclass
from itertools import islice
from pathlib import Path

import torch

from specserve.data.prompts import SHAREGPT_HELD_OUT, looks_english, sharegpt_conversations, training_prompts
from specserve.replicas.model_store import REFERENCE_TARGET, load_causal_lm, model_cache_dir
from specserve.replicas.prompt_ids import encode_chat
from specserve.training.distill import seeded_batches

# Prompts per category. code is every held-out HumanEval problem in two wordings, edit every one
# in one; chat and summarise fill the rest (summarise prompts are long and cost more to answer).
MIX = {"chat": 640, "summarise": 256, "code": 128, "edit": 64}
MAX_NEW_TOKENS = 128
GENERATE_BATCH = 16
# Transcripts: the first TRANSCRIPT_TOKENS tokens (= the training row length) of each conversation
# long enough to fill them, so a batch needs no padding. 9,000 of them are 2.3M tokens (16 times
# the answers' 140k answer tokens), read in one teacher-forced pass, far cheaper than generating them.
TRANSCRIPTS = 9000
TRANSCRIPT_TOKENS = 256
# Every VALIDATION_EVERY-th answer is held out of training to pick the best checkpoint by.
VALIDATION_EVERY = 20


@dataclass
class Sequence:
    category: str
    prompt_len: int
    tokens: torch.Tensor     # [T] int64: prompt + the target's greedy answer (EOS included)
    features: torch.Tensor   # [T, H] bf16: second-to-last layer output
    final: torch.Tensor      # [T, H] bf16: final-norm output (teacher logits = final @ W_out.T)


def corpus_dir() -> Path:
    return model_cache_dir().parent / "zoo" / "corpus"


def transcripts_dir(corpus: Path | None = None) -> Path:
    return (corpus or corpus_dir()) / "transcripts"


def feature_and_final(hidden_states: tuple[torch.Tensor, ...]) -> tuple[torch.Tensor, torch.Tensor]:
    """From ``output_hidden_states``: (second-to-last layer output, final-norm output).

    transformers' Llama returns the embeddings, each layer's output but the last, and the last
    after the final norm, so ``[-2]`` is the output of layer L-1 (Sparrow's ``h^h``)."""
    return hidden_states[-2], hidden_states[-1]


def planned_batches(tokenizer, mix: dict[str, int], batch: int) -> list[list[tuple[str, list[int]]]]:
    """Generation batches of similar-length prompts, categories interleaved so that a partial
    build already holds every category."""
    per_category = []
    for category, n in mix.items():
        prompts = [(category, encode_chat(tokenizer, [{"role": "user", "content": text}]))
                   for text in islice(training_prompts(category), n)]
        prompts.sort(key=lambda p: len(p[1]))   # less padding
        per_category.append([prompts[i:i + batch] for i in range(0, len(prompts), batch)])
    batches = []
    for i in range(max(map(len, per_category))):
        batches.extend(c[i] for c in per_category if i < len(c))
    return batches


@torch.inference_mode()
def answer_batch(model, prompts: list[list[int]], eos_token_ids: set[int], pad_id: int,
                 max_new_tokens: int) -> list[tuple[list[int], torch.Tensor, torch.Tensor]]:
    """Greedy answers for a batch, then one forward over each full sequence for its hidden states.
    returns per prompt: (prompt + answer ids, features [T, H], final [T, H])"""
    width = max(map(len, prompts))
    ids = torch.tensor([[pad_id] * (width - len(p)) + p for p in prompts], device=model.device)
    mask = torch.tensor([[0] * (width - len(p)) + [1] * len(p) for p in prompts], device=model.device)
    out = model.generate(input_ids=ids, attention_mask=mask, max_new_tokens=max_new_tokens, do_sample=False,
                         eos_token_id=sorted(eos_token_ids), pad_token_id=pad_id)
    sequences = []
    for prompt, row in zip(prompts, out[:, width:].tolist()):
        answer = []
        for tok in row:
            answer.append(tok)
            if tok in eos_token_ids:
                break
        sequences.append(prompt + answer)
    # Right-padded for the feature pass: positions then start at 0 for every row, as in serving.
    longest = max(map(len, sequences))
    ids = torch.tensor([s + [pad_id] * (longest - len(s)) for s in sequences], device=model.device)
    mask = torch.tensor([[1] * len(s) + [0] * (longest - len(s)) for s in sequences], device=model.device)
    hidden = model(input_ids=ids, attention_mask=mask, output_hidden_states=True, logits_to_keep=1).hidden_states
    features, final = feature_and_final(hidden)
    return [(s, features[i, :len(s)].to(torch.bfloat16).cpu(), final[i, :len(s)].to(torch.bfloat16).cpu())
            for i, s in enumerate(sequences)]


def build(out: Path | None = None, mix: dict[str, int] = MIX, batch: int = GENERATE_BATCH,
          max_new_tokens: int = MAX_NEW_TOKENS, target: str = REFERENCE_TARGET, dtype: str = "auto",
          on_batch: Callable[[int, int], None] = lambda done, total: None) -> Path:
    """Generate the corpus into ``out`` (resuming a partial build); returns ``out``."""
    out = out or corpus_dir()
    out.mkdir(parents=True, exist_ok=True)
    loaded = load_causal_lm(target, dtype=dtype)
    tokenizer = loaded.tokenizer
    pad_id = tokenizer.pad_token_id if tokenizer.pad_token_id is not None else 0
    batches = planned_batches(tokenizer, mix, batch)
    for b, chunk in enumerate(batches):
        shard = out / f"shard-{b:05d}.pt"
        if not shard.exists():
            answers = answer_batch(loaded.model, [ids for _, ids in chunk], loaded.eos_token_ids, pad_id, max_new_tokens)
            records = [{"category": category, "prompt_len": len(ids), "tokens": torch.tensor(seq),
                        "features": features, "final": final}
                       for (category, ids), (seq, features, final) in zip(chunk, answers)]
            tmp = shard.with_suffix(".partial")
            torch.save(records, tmp)
            os.replace(tmp, shard)   # atomic: a stop mid-write leaves no half shard
        on_batch(b + 1, len(batches))
    (out / "meta.json").write_text(json.dumps({
        "target": target, "dtype": str(loaded.model.dtype), "mix": mix, "max_new_tokens": max_new_tokens,
        "shards": len(batches), "hidden_size": loaded.model.config.hidden_size,
    }, indent=2) + "\n")
    return out


def planned_transcripts(tokenizer, n: int, tokens: int, batch: int) -> list[list[list[int]]]:
    """Batches of ``tokens``-token conversation openings: held-out English ShareGPT conversations
    through the chat template (system prompt, user and assistant turns), cut to ``tokens``."""
    roles = {"human": "user", "user": "user", "gpt": "assistant", "chatgpt": "assistant"}
    chosen: list[list[int]] = []
    for i, turns in enumerate(sharegpt_conversations()):
        if len(chosen) >= n:
            break
        messages = [{"role": roles[t["from"]], "content": t.get("value", "")}
                    for t in turns if t.get("from") in roles]
        if i < SHAREGPT_HELD_OUT or not messages or not looks_english(messages[0]["content"]):
            continue
        ids = encode_chat(tokenizer, messages, open_assistant_turn=False)
        if len(ids) >= tokens:
            chosen.append(ids[:tokens])
    return [chosen[i:i + batch] for i in range(0, len(chosen), batch)]


def build_transcripts(out: Path | None = None, n: int = TRANSCRIPTS, tokens: int = TRANSCRIPT_TOKENS,
                      batch: int = GENERATE_BATCH, target: str = REFERENCE_TARGET, dtype: str = "auto",
                      on_batch: Callable[[int, int], None] = lambda done, total: None) -> Path:
    """Read ``n`` conversations with the target into ``out`` (resuming a partial build)."""
    out = out or transcripts_dir()
    out.mkdir(parents=True, exist_ok=True)
    loaded = load_causal_lm(target, dtype=dtype)
    batches = planned_transcripts(loaded.tokenizer, n, tokens, batch)
    for b, chunk in enumerate(batches):
        shard = out / f"shard-{b:05d}.pt"
        if not shard.exists():
            with torch.inference_mode():
                ids = torch.tensor(chunk, device=loaded.model.device)
                hidden = loaded.model(input_ids=ids, output_hidden_states=True, logits_to_keep=1).hidden_states
            features, final = feature_and_final(hidden)
            # prompt_len 0: every position is scored; the teacher is the target's distribution
            # wherever it reads, user turns included.
            records = [{"category": "transcript", "prompt_len": 0, "tokens": ids[i].cpu(),
                        "features": features[i].to(torch.bfloat16).cpu(), "final": final[i].to(torch.bfloat16).cpu()}
                       for i in range(len(chunk))]
            tmp = shard.with_suffix(".partial")
            torch.save(records, tmp)
            os.replace(tmp, shard)
        on_batch(b + 1, len(batches))
    (out / "meta.json").write_text(json.dumps({
        "target": target, "dtype": str(loaded.model.dtype), "conversations": sum(map(len, batches)),
        "tokens_each": tokens, "first_conversation": SHAREGPT_HELD_OUT, "shards": len(batches),
    }, indent=2) + "\n")
    return out


def load(corpus: Path | None = None) -> list[Sequence]:
    """Every sequence of a finished (or partial) build, in shard order: the answers, then the
    transcripts if they were built."""
    corpus = corpus or corpus_dir()
    shards = sorted(corpus.glob("shard-*.pt"))
    if not shards:
        raise FileNotFoundError(f"no corpus in {corpus}: run `specserve zoo corpus` first")
    shards += sorted(transcripts_dir(corpus).glob("shard-*.pt"))
    return [Sequence(**record) for shard in shards for record in torch.load(shard, weights_only=True)]


def split(sequences: list[Sequence], every: int = VALIDATION_EVERY) -> tuple[list[Sequence], list[Sequence]]:
    """(training, validation): every ``every``-th answer is validation: what the drafts are
    judged on (the target's answers), never trained on."""
    answers = [s for s in sequences if s.category != "transcript"]
    held = {id(s) for s in answers[every - 1::every]}
    return [s for s in sequences if id(s) not in held], [s for s in sequences if id(s) in held]


# --- training batches ----------------------------------------------------------------------

# Loss weight of positions inside the prompt, next to 1 for the answer: the drafts are judged on
# answers, but the prompt's many tokens still teach them the language.
PROMPT_WEIGHT = 0.0


def training_row(seq: Sequence, seq_len: int) -> dict:
    """The last ``seq_len`` tokens of ``seq`` (the end of the prompt and the whole answer) with a
    loss weight per position: position p is scored on predicting token p + 1."""
    start = max(0, len(seq.tokens) - seq_len)
    positions = torch.arange(start, len(seq.tokens))
    weights = torch.where(positions >= seq.prompt_len - 1, 1.0, PROMPT_WEIGHT)
    weights[-1] = 0.0   # nothing follows the last token
    return {"tokens": seq.tokens[start:], "features": seq.features[start:], "final": seq.final[start:],
            "weights": weights}


def collate(rows: list[dict]) -> dict:
    """Right-padded to the longest row; padding has weight 0."""
    width = max(len(r["tokens"]) for r in rows)

    def pad(key: str, value=0):
        parts = []
        for r in rows:
            x = r[key]
            extra = width - len(x)
            parts.append(torch.cat([x, x.new_full((extra, *x.shape[1:]), value)]) if extra else x)
        return torch.stack(parts)

    return {"tokens": pad("tokens"), "features": pad("features").float(), "final": pad("final").float(),
            "weights": pad("weights")}


def batch_stream(sequences: list[Sequence], seq_len: int, batch: int, seed: int = 0):
    """``batches(start)`` for ``distill.train``: batch ``b`` is a pure function of ``b`` (a seeded
    shuffle per epoch), so a resumed run sees exactly the batches an unbroken one would."""
    rows = [training_row(s, seq_len) for s in sequences]
    per_epoch = len(rows) // batch
    if per_epoch == 0:
        raise ValueError(f"the corpus has {len(rows)} sequences, fewer than one batch of {batch}")

    return seeded_batches(len(rows), batch, lambda picked: collate([rows[j] for j in picked]), seed)
