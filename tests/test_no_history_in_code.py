"""Code comments and docstrings state rules, not history.

The house rule: a comment states the rule and why in a clause, and cites papers by title and
``docs/design.md §N``; dates, CPU names, measured figures and the story of what was tried belong
in ``docs/benchmarks.md`` and commit messages, never in code. This test checks the parts of that
rule a pattern can see, in every comment (``tokenize``) and every module, class and function
docstring (``ast``) of the package's folders:

- **dates**: ``YYYY-MM-DD``;
- **CPU model names**: EPYC, Xeon, Ryzen, Threadripper, Graviton, Ampere Altra, and Intel's
  code names (Sapphire / Emerald / Granite Rapids, Ice / Cascade / Cooper Lake);
- **AMX as the feature of a machine**: "with AMX", "without AMX", "has AMX", "an AMX CPU", ...;
- **AVX-512 (and AVX2) as the feature of a machine**: "an AVX-512 machine", "AVX2 host", or an
  AVX mention beside a reference to the machine something ran on ("this CPU", "these machines",
  "the box here", "measured", "tok/s"). Allowed, because it is a rule about code and not about a
  machine: a kernel's or library's instruction-set requirement, such as "oneDNN has a bfloat16
  path only with AVX-512 or AVX-NE-CONVERT" or "bfloat16 autocast is fast on AVX512-BF16";
- **throughput figures**: a number followed by ``tok/s``, ``tokens/s`` or ``tokens per second``
  (zero excepted: "priced at 0 tokens/s" is a rule, not a measurement).

Consecutive comment lines and a docstring's lines are searched as one text, so a figure split
over two lines is found too; each hit is reported at the line it starts on.
"""

import ast
import io
import re
import tokenize
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
FOLDERS = ("cli", "cluster", "data", "ingress", "policies", "replicas", "router", "training", "bench")

_AVX = r"AVX[-_ ]?512[\w-]*|AVX-?2|AVX-NE-CONVERT"
_MACHINE = r"(?:CPU|machine|host|box|chip|server|node|VM|instance)s?"
CHECKS = (
    ("a date", re.compile(r"\b(?:19|20)\d{2}-(?:0[1-9]|1[0-2])-(?:0[1-9]|[12]\d|3[01])\b")),
    ("a CPU model name", re.compile(
        r"\b(?:EPYC|Xeon|Ryzen|Threadripper|Graviton\d*|Ampere\s+Altra"
        r"|(?:Sapphire|Emerald|Granite)\s+Rapids|(?:Ice|Cascade|Cooper)\s+Lake)\b", re.IGNORECASE)),
    ("AMX as a machine's feature", re.compile(
        rf"\b(?:with|without|has|have|having|lacks?|an?)\s+(?:native\s+)?AMX\b|\bAMX(?:[- ]capable)?[- ]{_MACHINE}\b")),
    ("AVX as a machine's feature", re.compile(
        rf"\b(?:{_AVX})[- ]{_MACHINE}\b"
        rf"|(?:\b(?:{_AVX})\b.*?(?:\b(?:this|these|our)\s+{_MACHINE}\b|\b{_MACHINE}\s+here\b|\bmeasured\b|tok/s|tokens/s)"
        rf"|(?:\b(?:this|these|our)\s+{_MACHINE}\b|\b{_MACHINE}\s+here\b|\bmeasured\b|tok/s|tokens/s).*?\b(?:{_AVX})\b)",
        re.IGNORECASE)),
    ("a throughput figure", re.compile(
        r"(?<![\w.])(?!0(?:\.0+)?\s*(?:tok|tokens)\b)\d[\d,]*(?:\.\d+)?\s*[kKM]?\s*"
        r"(?:tok/s|tokens/s|tokens? per second)\b")),
)


def _texts(path: Path) -> list[tuple[int, list[str]]]:
    """(first line, lines) of every comment block (consecutive comment lines) and docstring."""
    source = path.read_text()
    texts: list[tuple[int, list[str]]] = []
    for token in tokenize.generate_tokens(io.StringIO(source).readline):
        if token.type != tokenize.COMMENT:
            continue
        line = token.start[0]
        text = token.string.lstrip("#").strip()
        if texts and texts[-1][0] + len(texts[-1][1]) == line:
            texts[-1][1].append(text)
        else:
            texts.append((line, [text]))
    for node in ast.walk(ast.parse(source, str(path))):
        if isinstance(node, (ast.Module, ast.ClassDef, ast.FunctionDef, ast.AsyncFunctionDef)) and node.body:
            first = node.body[0]
            if isinstance(first, ast.Expr) and isinstance(first.value, ast.Constant) \
                    and isinstance(first.value.value, str):
                texts.append((first.value.lineno, first.value.value.split("\n")))
    return texts


def _hits(path: Path) -> list[str]:
    found = []
    for first, lines in _texts(path):
        joined = " ".join(lines)
        starts = [0]
        for line in lines[:-1]:
            starts.append(starts[-1] + len(line) + 1)
        for what, pattern in CHECKS:
            for match in pattern.finditer(joined):
                line = first + max(i for i, s in enumerate(starts) if s <= match.start())
                found.append(f"{path.relative_to(ROOT)}:{line}: {what}: {match.group(0)!r}")
    return found


def test_no_dates_cpu_names_or_throughput_figures_in_comments_or_docstrings():
    found = [hit for folder in FOLDERS for path in sorted((ROOT / folder).rglob("*.py")) for hit in _hits(path)]
    assert not found, (
        "history in code comments or docstrings (move it to docs/benchmarks.md and the commit message; "
        "keep the rule and why in a clause):\n" + "\n".join(found))


def test_the_checks_see_what_they_are_for():
    samples = {
        "measured 2026-11-29 on the box": "a date",
        "on a quiet 2-core EPYC": "a CPU model name",
        "a Sapphire Rapids host": "a CPU model name",
        "a CPU with AMX": "AMX as a machine's feature",
        "an AVX-512 machine": "AVX as a machine's feature",
        "this CPU has AVX512-BF16": "AVX as a machine's feature",
        "53.4 vs 35.4 tok/s": "a throughput figure",
        "1,996 tokens/s for every draft": "a throughput figure",
    }
    for text, expected in samples.items():
        assert [what for what, pattern in CHECKS if pattern.search(text)] == [expected], text
    allowed = ("priced at 0 tokens/s with and without", "(fast on AVX512-BF16 / CUDA)",
               "(without AVX-512 or AVX-NE-CONVERT it has none and refuses)", "Kim & Rush 2016",
               "emitted tokens per second of the step", "docs/benchmarks.md §2.0c")
    for text in allowed:
        assert not [what for what, pattern in CHECKS if pattern.search(text)], text
