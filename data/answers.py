"""The self-distilled answers' chunk format (``training/answers.py`` writes them): the target's
greedy answers as token ids, read by training and by the suffix draft's seed corpus.

``answers-NNNNN.npz`` per chunk: ``tokens`` (prompt + answer ids of every sequence, concatenated,
int32), ``lengths``, ``prompt_lens``, ``kinds`` (an index into ``KINDS``), written atomically.
"""

from __future__ import annotations

import os
from dataclasses import dataclass
from pathlib import Path

import numpy as np

KINDS = ("chat", "turn", "code")


@dataclass
class Answer:
    kind: str
    prompt_len: int
    tokens: list[int]   # prompt + answer


def save_chunk(path: Path, answers: list[Answer]) -> None:
    tmp = path.with_name(path.name + ".partial.npz")
    np.savez_compressed(tmp, tokens=np.concatenate([np.asarray(a.tokens, dtype=np.int32) for a in answers]),
                        lengths=np.asarray([len(a.tokens) for a in answers], dtype=np.int32),
                        prompt_lens=np.asarray([a.prompt_len for a in answers], dtype=np.int32),
                        kinds=np.asarray([KINDS.index(a.kind) for a in answers], dtype=np.int8))
    os.replace(tmp, path)   # atomic: a stop mid-write leaves no half chunk


def load_chunk(path: Path) -> list[Answer]:
    with np.load(path) as data:
        ends = np.cumsum(data["lengths"])
        return [Answer(KINDS[int(kind)], int(prompt_len), tokens.tolist())
                for kind, prompt_len, tokens in zip(data["kinds"], data["prompt_lens"], np.split(data["tokens"], ends[:-1]))]


def load_answers(folder: Path) -> list[Answer]:
    return [a for path in sorted(folder.glob("answers-*.npz")) if not path.name.endswith(".partial.npz")
            for a in load_chunk(path)]




def answer_outputs(folder: Path | str) -> list[np.ndarray]:
    """The answers alone (no prompts), int32, in chunk order."""
    outputs = []
    for path in sorted(Path(folder).glob("answers-*.npz")):
        if path.name.endswith(".partial.npz"):
            continue
        with np.load(path) as data:
            ends = np.cumsum(data["lengths"])
            for prompt_len, tokens in zip(data["prompt_lens"], np.split(data["tokens"], ends[:-1])):
                if len(tokens) > prompt_len:
                    outputs.append(tokens[int(prompt_len):])
    return outputs
