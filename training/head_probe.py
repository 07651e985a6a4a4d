"""How a hidden-state-reuse head drafts, position by position: teacher-forced offline against
what the served engine realises, on prompts held out from training.

Offline, the target reads its own greedy answer once (teacher forcing); from every answer
position q the head drafts ``steps`` tokens from the exact feature at q and the known token q+1,
its later steps reading its own outputs (``unrolled_outputs``: what drafting computes). The chain
from q reaches depth k when its first k tokens all equal the target's. Per depth:

    α_k = reach(k) / reach(k - 1)           (the acceptance of position k, given k - 1 accepted)
    τ_W = 1 + Σ_{k=1..W} reach(k) / reach(0)   (tokens per step a window W would give, greedy)

Served, the engine drafts with the same head at a fixed window W (no policy, no tree) and
reports what it emitted per step. A τ served well below τ offline is a serving or feature bug
(the wrong layer's states, a stale cache, positions off by one), to be fixed before training
data is bought.
"""

from __future__ import annotations

from dataclasses import dataclass, field

import torch

from specserve.replicas.drafts.hsr_head import feature_layers, stack_features
from specserve.training.hsr_train import unrolled_outputs


@dataclass
class PositionReport:
    steps: int
    reach: list[int] = field(default_factory=list)   # reach[k]: chains whose first k tokens matched
    served_emitted: int = 0
    served_steps: int = 0
    # Answers the served draft ended differently from plain decoding: none in float32; in
    # bfloat16 a verify of several tokens rounds differently from one token's, and near-ties flip.
    diverged: int = 0

    def __post_init__(self):
        self.reach = self.reach or [0] * (self.steps + 1)

    @property
    def alpha(self) -> list[float]:
        return [round(self.reach[k] / max(1, self.reach[k - 1]), 4) for k in range(1, self.steps + 1)]

    def tau(self, window: int) -> float:
        return round(1 + sum(self.reach[k] for k in range(1, window + 1)) / max(1, self.reach[0]), 3)

    @property
    def served_tau(self) -> float:
        return round(self.served_emitted / max(1, self.served_steps), 3)

    def summary(self, window: int) -> dict:
        return {"alpha_by_position": self.alpha, "offline_tau": self.tau(window), "served_tau": self.served_tau,
                "chains": self.reach[0], "window": window, "diverged": self.diverged}


@torch.no_grad()
def offline_reach(model, head, tokens: list[int], prompt_len: int, steps: int) -> list[int]:
    """reach[k] over the answer's draft starts q = prompt_len - 1 .. (each with all ``steps``
    positions inside the sequence)."""
    device = head.device
    ids = torch.tensor([tokens], device=device)
    hidden = model(ids, output_hidden_states=True).hidden_states
    features = stack_features(hidden, feature_layers(head.config)).to(head.dtype)   # [1, T, n·H]
    head_ids = head.head_token_ids(device)
    # Row i of step j predicts token i + 2 from the exact feature at i + 1 - j.
    preds = [head_ids[head.head_logits(out).argmax(-1)][0].tolist() for out in unrolled_outputs(head, ids, features, steps)]
    reach = [0] * (steps + 1)
    for q in range(prompt_len - 1, len(tokens) - 1 - steps):
        reach[0] += 1
        for j in range(1, steps + 1):
            if preds[j - 1][q + j - 1] != tokens[q + j + 1]:
                break
            reach[j] += 1
    return reach


def probe(engine, draft: str, prompts: list[list[int]], max_tokens: int = 96, window: int = 4,
          steps: int = 4) -> PositionReport:
    """Offline reach and served τ of the engine's HSR draft ``draft`` over ``prompts``."""
    from tqdm import tqdm

    from specserve.replicas.engine import GenerateRequest

    head = engine.drafts[draft].head
    report = PositionReport(steps)
    for ids in tqdm(prompts, desc=f"{draft} by position", unit="prompt"):
        engine.reset_caches()
        answer = engine.generate_ids(ids, GenerateRequest("", max_tokens, "none", 0)).token_ids
        for k, n in enumerate(offline_reach(engine.loaded.model, head, ids + answer, len(ids), steps)):
            report.reach[k] += n
        engine.reset_caches()
        served = engine.generate_ids(ids, GenerateRequest("", max_tokens, draft, window))
        report.diverged += served.token_ids != answer
        report.served_emitted += served.stats.emitted
        report.served_steps += served.stats.steps
    return report
