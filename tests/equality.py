"""Greedy equality with a near-tie escape (two logits within 1e-4 may swap under another batch
shape's arithmetic), and a VLM engine's model's own greedy answer, shared by the equality tests."""

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


def own_vlm_answer(engine, pictures, question: str, max_new_tokens: int) -> list[int]:
    """The greedy answer of ``engine``'s VLM through its own processor and ``generate`` to one user
    turn of ``pictures`` then ``question``, up to and including its first end-of-turn token."""
    processor, model = engine.processor, engine.loaded.model
    messages = [{"role": "user", "content": [*({"type": "image"} for _ in pictures), {"type": "text", "text": question}]}]
    text = processor.apply_chat_template(messages, add_generation_prompt=True, tokenize=False)
    inputs = processor(text=text, images=list(pictures), return_tensors="pt")
    with torch.inference_mode():
        out = model.generate(**inputs, max_new_tokens=max_new_tokens, do_sample=False)
    ids = out[0, inputs["input_ids"].shape[1]:].tolist()
    return ids[:next((i + 1 for i, t in enumerate(ids) if t in engine.loaded.eos_token_ids), len(ids))]
