"""The self-distilled answers: the target's own greedy answers to prompts no benchmark uses,
generated with specserve's batched engine (continuous batching, ``SpecEngine.generate_batch_ids``),
kept as token ids only.

Why token ids: the answers are what costs hours (every token a decode step of the target); the
training inputs derived from them (the target's hidden states at chosen layers, its top-k
distribution) are one teacher-forced pass, a twentieth of the cost, and differ per recipe. So
the ids are committed (``training/answers/``, compressed numpy, tens of MB when complete) and the
features are a local cache any machine rebuilds.

Prompts, in a fixed order and interleaved so that a partial build already holds every kind:
- ``chat``: the first user turn of each held-out ShareGPT conversation (from ``SHAREGPT_HELD_OUT``);
- ``turn``: for a conversation with several user turns, one later turn (chosen by a seed per
  conversation) with every turn before it as written, as its context (at most ``CONTEXT_TOKENS``);
- ``code``: the HumanEval problems no benchmark uses, in both wordings.
Answers are greedy, at most ``ANSWER_TOKENS`` new tokens, in the dtype the target is served in.

Layout (``data/answers.py``): ``answers-NNNNN.npz`` per chunk of ``CHUNK`` prompts (``tokens``: prompt + answer ids of
every sequence, concatenated, int32; ``lengths``, ``prompt_lens``, ``kinds``), written atomically:
an interrupted build resumes at the first missing chunk. ``meta.json`` says how they were made.
"""

from __future__ import annotations

import json
import random
from collections.abc import Callable, Iterator
from itertools import islice
from pathlib import Path

from specserve.data.answers import Answer, save_chunk
from specserve.data.prompts import SHAREGPT_HELD_OUT, looks_english, sharegpt_conversations, training_prompts
from specserve.replicas.prompt_ids import encode_chat

ANSWER_TOKENS = 256
CONTEXT_TOKENS = 1024
CHUNK = 64
ANSWERS_DIR = Path(__file__).parent / "answers"
_ROLES = {"human": "user", "user": "user", "gpt": "assistant", "chatgpt": "assistant"}


def _conversation_prompts(tokenizer, conversations: int) -> Iterator[tuple[str, list[int]]]:
    """(kind, ids) of the held-out conversations: each one's first turn, then a later turn."""
    seen: set[str] = set()
    for i, turns in enumerate(islice(sharegpt_conversations(), SHAREGPT_HELD_OUT, SHAREGPT_HELD_OUT + conversations)):
        messages = [{"role": _ROLES[t["from"]], "content": t.get("value", "").strip()}
                    for t in turns if t.get("from") in _ROLES and t.get("value", "").strip()]
        if not messages or messages[0]["role"] != "user" or not looks_english(messages[0]["content"]):
            continue
        key = " ".join(messages[0]["content"].lower().split())
        if key not in seen:   # ShareGPT repeats popular openings
            seen.add(key)
            ids = encode_chat(tokenizer, messages[:1])
            if len(ids) <= CONTEXT_TOKENS:
                yield "chat", ids
        later = [j for j, m in enumerate(messages) if m["role"] == "user" and j > 0
                 and all(messages[k]["role"] != messages[k + 1]["role"] for k in range(j))]
        if later:
            j = random.Random(SHAREGPT_HELD_OUT + i).choice(later)
            ids = encode_chat(tokenizer, messages[: j + 1])
            if len(ids) <= CONTEXT_TOKENS:
                yield "turn", ids


def planned_prompts(tokenizer, conversations: int) -> list[tuple[str, list[int]]]:
    """Every prompt of a build over ``conversations`` held-out conversations, kinds interleaved
    (the code prompts spread evenly through the conversation ones)."""
    talk = list(_conversation_prompts(tokenizer, conversations))
    code = [("code", encode_chat(tokenizer, [{"role": "user", "content": text}])) for text in training_prompts("code")]
    every = max(1, len(talk) // max(1, len(code)))
    plan: list[tuple[str, list[int]]] = []
    for i, item in enumerate(talk):
        plan.append(item)
        if i % every == every - 1 and code:
            plan.append(code.pop(0))
    return plan + code


def build(out: Path = ANSWERS_DIR, conversations: int = 8000, dtype: str = "auto", slots: int = 32,
          chunks: int | None = None, engine=None,
          on_chunk: Callable[[int, int, int], None] = lambda done, total, tokens: None) -> Path:
    """Answer the planned prompts into ``out``, resuming a partial build; at most ``chunks``
    chunks this call (all when None). ``on_chunk(done, total, new tokens)`` after each."""
    from specserve.replicas.engine import GenerateRequest, SpecEngine

    out.mkdir(parents=True, exist_ok=True)
    engine = engine or SpecEngine.load(dtype=dtype, slots=slots)
    plan = planned_prompts(engine.tokenizer, conversations)
    total = (len(plan) + CHUNK - 1) // CHUNK
    meta = {
        "target": engine.loaded.name, "dtype": str(engine.loaded.model.dtype), "answer_tokens": ANSWER_TOKENS,
        "context_tokens": CONTEXT_TOKENS, "conversations": conversations, "first_conversation": SHAREGPT_HELD_OUT,
        "prompts": len(plan), "chunks": total, "greedy": True, "engine": "SpecEngine.generate_batch_ids, draft none",
    }
    if (out / "meta.json").exists() and any(out.glob("answers-*.npz")):
        before = json.loads((out / "meta.json").read_text())
        changed = {k: (before.get(k), v) for k, v in meta.items() if before.get(k) != v}
        if changed:   # the chunks already there answer another plan
            raise ValueError(f"{out} holds answers made with other settings {changed}: resume with the same ones, "
                             "or build into another folder")
    (out / "meta.json").write_text(json.dumps(meta, indent=2) + "\n")
    done = 0
    for c in range(total):
        path = out / f"answers-{c:05d}.npz"
        if path.exists():
            continue
        if chunks is not None and done >= chunks:
            break
        chunk = plan[c * CHUNK:(c + 1) * CHUNK]
        request = GenerateRequest("", ANSWER_TOKENS, "none", 0)
        gens = engine.generate_batch_ids([ids for _, ids in chunk], [request] * len(chunk), max_running=slots)
        save_chunk(path, [Answer(kind, len(ids), ids + gen.token_ids) for (kind, ids), gen in zip(chunk, gens)])
        done += 1
        on_chunk(c + 1, total, sum(len(g.token_ids) for g in gens))
    return out
