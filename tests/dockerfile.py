"""A Dockerfile read as Docker reads it, and shell commands split as a shell runs them, for the
manifest and install-path tests."""

from __future__ import annotations

import shlex
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


def shell_commands(run: str) -> list[list[str]]:
    """A shell command line's commands (split on && || ; | &), as word lists."""
    lexer = shlex.shlex(run, posix=True, punctuation_chars=";&|")
    lexer.whitespace_split = True
    commands, words = [], []
    for token in [*lexer, ";"]:
        if token in (";", "&&", "||", "|", "&"):
            if words:
                commands.append(words)
            words = []
        else:
            words.append(token)
    return commands
