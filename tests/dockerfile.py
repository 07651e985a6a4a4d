"""A Dockerfile read as Docker reads it, for the manifest and install-path tests."""

from __future__ import annotations

from pathlib import Path


def dockerfile_instructions(path: Path) -> list[tuple[str, str]]:
    """(INSTRUCTION, arguments) pairs, continuation lines joined, comments dropped."""
    lines, current = [], ""
    for raw in path.read_text().splitlines():
        line = raw.strip()
        if line.startswith("#") or (not current and not line):
            continue
        if line.endswith("\\"):
            current += line[:-1] + " "
            continue
        lines.append(current + line)
        current = ""
    pairs = []
    for line in lines:
        instruction, _, rest = line.partition(" ")
        pairs.append((instruction.upper(), rest.strip()))
    return pairs
