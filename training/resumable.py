"""A resumable next-token training loop over rows of token ids: the image generator's and its
draft's (``imagegen_train.py``, ``imagegen_draft.py``).

Each step's rows come from the step's number alone, so a resumed run trains on what the
uninterrupted one would have; the learning rate warms up then follows a cosine; gradients are
clipped at norm 1. Every ``save_every`` steps, and when it stops (the last step, or past
``max_seconds``), the weights, optimizer, step and log go to ``checkpoint`` with ``saved``'s
entries beside them; every ``eval_every`` steps (and when it stops) ``evaluate`` adds its figures
to the step's log entry.
"""

from __future__ import annotations

import json
import time
from collections.abc import Callable
from pathlib import Path

import torch
import torch.nn.functional as F

from specserve.training.schedule import warmup_cosine


def next_token_loss(model, rows: torch.Tensor) -> torch.Tensor:
    """Cross-entropy of each token after the first given the tokens before it."""
    logits = model(input_ids=rows[:, :-1]).logits
    return F.cross_entropy(logits.reshape(-1, logits.shape[-1]).float(), rows[:, 1:].reshape(-1))


def train_loop(model, optimizer, checkpoint: Path, *, steps: int, lr: float, warmup_steps: int, eval_every: int,
               save_every: int, rows: Callable[[int], torch.Tensor], evaluate: Callable[[], tuple[dict, str]],
               saved: dict, desc: str, progress: bool = True, max_seconds: float | None = None) -> list[dict]:
    """Train ``model`` from ``checkpoint`` (if there is one) to ``steps``; returns the log, also
    written as ``log.json`` beside the checkpoint. ``rows(step)``: the step's rows on the model's
    device; ``evaluate()``: (figures for the log entry, a line to print)."""
    from tqdm import tqdm

    start, log = 0, []
    if checkpoint.exists():
        state = torch.load(checkpoint, map_location=next(model.parameters()).device)
        model.load_state_dict(state["weights"])
        optimizer.load_state_dict(state["optimizer"])
        start, log = state["step"], state["log"]
    model.train()
    bar = tqdm(range(start, steps), initial=start, total=steps, desc=desc, disable=not progress)
    began = time.perf_counter()
    for step in bar:
        batch = rows(step)
        for group in optimizer.param_groups:
            group["lr"] = warmup_cosine(lr, step, warmup_steps, steps)
        loss = next_token_loss(model, batch)
        loss.backward()
        torch.nn.utils.clip_grad_norm_(model.parameters(), 1.0)
        optimizer.step()
        optimizer.zero_grad(set_to_none=True)
        entry = {"step": step + 1, "loss": loss.item(), "seconds": time.perf_counter() - began}
        done = step + 1 == steps or (max_seconds is not None and entry["seconds"] > max_seconds)
        if (step + 1) % eval_every == 0 or done:
            model.eval()
            with torch.no_grad():
                figures, line = evaluate()
            model.train()
            entry.update(figures)
            bar.write(f"step {step + 1}: loss {entry['loss']:.3f}, {line}")
        log.append(entry)
        bar.set_postfix(loss=f"{entry['loss']:.3f}")
        if (step + 1) % save_every == 0 or done:
            torch.save({"weights": model.state_dict(), "optimizer": optimizer.state_dict(), "step": step + 1,
                        "log": log, **saved}, checkpoint)
        if done:
            break
    (checkpoint.parent / "log.json").write_text(json.dumps(log))
    return log
