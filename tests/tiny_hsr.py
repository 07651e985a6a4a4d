"""A hidden-state-reuse head for a tiny random target, trained for a few seconds on the target's
own sampled text, so tests can check that the head reads the target's states (it agrees with the
target far more often than chance) and not only that it is harmless. ``layers`` (several of the
target's hidden states) makes it an EAGLE-3 head that fuses them."""

from __future__ import annotations

import tempfile
from pathlib import Path

import torch

from specserve.replicas.drafts.hsr_head import HSRHead, build_hsr_head, stack_features
from specserve.training.distill import DistillConfig, train
from specserve.training.hsr_train import hsr_loss
from tiny_models import VOCAB


# The layers of a fusing head on a 3-layer tiny target: hidden_states[1] and [-2] are the outputs
# of its decoder layers 0 and 1 (a 2-layer target has one tappable layer only).
FUSED_LAYERS = [1, -2]


def teacher_batch(target, seed: int, batch: int = 8, length: int = 48, layers: list[int] | None = None) -> dict:
    """The target's own sampled continuations of random prompts, with its hidden states
    (``layers`` side by side, default the second-to-last layer's)."""
    gen = torch.Generator().manual_seed(seed)
    prompts = torch.randint(1, VOCAB, (batch, 4), generator=gen).to(target.device)   # 0 is the pad id
    torch.manual_seed(seed)
    with torch.inference_mode():
        tokens = target.generate(prompts, max_new_tokens=length - 4, do_sample=True, top_k=0,
                                 pad_token_id=0, eos_token_id=None)
        hidden = target(tokens, output_hidden_states=True).hidden_states
        features, final = stack_features(hidden, layers or [-2]), hidden[-1]
    weights = torch.ones(tokens.shape, dtype=torch.float32, device=tokens.device)
    weights[:, -1] = 0
    return {"tokens": tokens.clone(), "features": features.clone(), "final": final.clone(), "weights": weights}


def trained_hsr_head(target, steps: int = 300, unroll: int = 2, layers: list[int] | None = None) -> HSRHead:
    head = build_hsr_head(target, list(range(VOCAB)), layers)
    head_weight = target.get_output_embeddings().weight.detach()
    data = [teacher_batch(target, seed, layers=layers) for seed in range(16)]

    def batches(start: int):
        for b in range(start, steps):
            yield data[b % len(data)]

    with tempfile.TemporaryDirectory() as work:
        train(head, hsr_loss(head, head_weight, unroll), batches,
              DistillConfig(steps=steps, lr=3e-3, warmup_steps=10, checkpoint_every=10**9),
              Path(work) / "checkpoint.pt")
    return head.eval()


def save_tiny_pair(target, head: HSRHead, folder: Path) -> Path:
    """``folder/target`` and ``folder/head`` (without embeddings, which load from the target),
    each with a word-level tokenizer over the tiny vocabulary; returns the head's folder."""
    from tokenizers import Tokenizer, models
    from transformers import PreTrainedTokenizerFast

    from specserve.replicas.drafts.pruned_head import save_without_embeddings

    tokenizer = PreTrainedTokenizerFast(
        tokenizer_object=Tokenizer(models.WordLevel({str(i): i for i in range(VOCAB)}, unk_token="0")))
    target.save_pretrained(folder / "target")
    tokenizer.save_pretrained(folder / "target")
    save_without_embeddings(head, folder / "head", embeddings_from=str(folder / "target"))
    tokenizer.save_pretrained(folder / "head")
    return folder / "head"


def one_thread(make):
    """``make()`` on one torch thread: a module-scoped fixture runs before the per-test fixture
    that sets one thread for tiny models, and two OpenMP threads on a busy machine stall."""
    threads = torch.get_num_threads()
    torch.set_num_threads(1)
    try:
        return make()
    finally:
        torch.set_num_threads(threads)
