"""Greedy equality with a near-tie escape (two logits within 1e-4 may swap under another batch
shape's arithmetic), shared by the equality tests."""

from __future__ import annotations

import warnings

import torch

NEAR_TIE = 1e-4


def assert_greedy_equal(model, prompt_ids: list[int], got: list[int], expected: list[int], label: str) -> None:
    """``got`` must equal ``expected`` token for token, unless the first divergent position is a
    near-tie of the target's logits (top-2 within 1e-4), which is reported, not failed."""
    if got == expected:
        return
    first = next((i for i, (a, b) in enumerate(zip(got, expected)) if a != b), min(len(got), len(expected)))
    with torch.inference_mode():
        logits = model(torch.tensor([prompt_ids + expected[:first]], device=model.device)).logits[0, -1].float()
    top2 = logits.topk(2).values
    gap = float(top2[0] - top2[1])
    assert gap < NEAR_TIE, (
        f"{label}: speculative output diverges from target-only at token {first} "
        f"(got {got[first:first + 5]}, expected {expected[first:first + 5]}); top-2 logit gap {gap:.3g} is no near-tie"
    )
    warnings.warn(f"{label}: near-tie divergence at token {first} (top-2 gap {gap:.2e})")
