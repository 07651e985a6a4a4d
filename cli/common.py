"""What every command shares: failing with a message, comma-separated names, torch's threads."""

from __future__ import annotations

import typer


def fail(message: str) -> None:
    typer.secho(f"error: {message}", fg=typer.colors.RED, err=True)
    raise typer.Exit(code=2)


def names(text: str | None) -> tuple[str, ...] | None:
    """A comma-separated option as names; None when not given (the benchmark's default)."""
    return tuple(text.split(",")) if text else None


def set_threads(threads: int | None) -> None:
    if threads is None:
        return
    if threads < 1:
        fail(f"--threads must be >= 1, got {threads}")
    import torch

    torch.set_num_threads(threads)
