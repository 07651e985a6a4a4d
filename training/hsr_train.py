"""Training a hidden-state-reuse head with unrolled steps (Sparrow §3.2 multi-token prediction).

At inference the head drafts token 1 from the target's state, token 2 from its own output for
token 1, and so on (``replicas/drafts/hsr_draft.py``). Trained only on the target's states
(step 1), it would never see its own outputs as input, and the tokens after the first drift:
exposure bias. So each batch is run ``steps`` times, every position at once:

- step 1 reads the target's states: ``z¹_p = FC(e_p ⊕ h_{p-1})``, causal attention;
- step j reads step j-1's outputs: ``z^j_p = FC(e_p ⊕ o^{j-1}_{p-1})``, and position ``p`` stands
  for the j-th drafted token after the exact prefix ending at ``p-j+1``. So it attends as
  inference does: to step 1's keys up to ``p-j+1`` (the head's cache, fed with true states) and to
  step m's key at ``p-j+m`` for m = 2..j (the tokens drafted before it, and itself);

and the loss is the KL to the teacher at every weighted position of every step (EAGLE-3's
"training-time test" has the same attention pattern). Sparrow unrolls twice; ``steps`` is a
parameter, the zoo recipe says how many.
"""

from __future__ import annotations

import math

import torch

from specserve.replicas.drafts.hsr_head import HSRHead
from specserve.training.distill import distill_loss, teacher_log_probs


def _shift(x: torch.Tensor, by: int) -> torch.Tensor:
    """``x`` [..., T, d] moved ``by`` positions later along T, zeros in front."""
    if by == 0:
        return x
    return torch.cat([torch.zeros_like(x[..., :by, :]), x[..., :-by, :]], dim=-2)


def unrolled_outputs(head: HSRHead, tokens: torch.Tensor, features: torch.Tensor, steps: int) -> list[torch.Tensor]:
    """The head's outputs for positions 1..T-1, one tensor [B, T-1, H] per unrolled step.

    tokens [B, T]; features [B, T, H]: the target's states (row p = position p)."""
    t = tokens.shape[1] - 1
    device = tokens.device
    positions = torch.arange(1, t + 1, device=device)
    cos, sin = head.rope(positions, features.dtype)
    layer = head.layer
    idx = torch.arange(t, device=device)
    outputs: list[torch.Tensor] = []
    keys: list[torch.Tensor] = []
    values: list[torch.Tensor] = []
    prev = features[:, :-1]
    for j in range(1, steps + 1):
        z = head.inputs(tokens[:, 1:], prev)
        q, k, v = layer.self_attn.qkv(layer.input_layernorm(z), cos, sin)
        keys.append(k)
        values.append(v)
        scale = 1.0 / math.sqrt(q.shape[-1])
        # Step 1's keys (the exact cache), up to p - j + 1.
        scores = [(q @ keys[0].transpose(-1, -2)) * scale]
        exact_visible = idx[None, :] <= idx[:, None] - (j - 1)                     # [T, T]
        scores[0] = scores[0].masked_fill(~exact_visible, float("-inf"))
        # Step m's key at p - j + m, m = 2..j: one score per position.
        shifted_v = []
        for m in range(2, j + 1):
            k_m, v_m = _shift(keys[m - 1], j - m), _shift(values[m - 1], j - m)
            score = (q * k_m).sum(-1, keepdim=True) * scale                       # [B, h, T, 1]
            scores.append(score.masked_fill((idx < j - m)[:, None], float("-inf")))
            shifted_v.append(v_m)
        weights = torch.softmax(torch.cat(scores, dim=-1).float(), dim=-1).to(q.dtype)
        attended = weights[..., :t] @ values[0]
        for i, v_m in enumerate(shifted_v):
            attended = attended + weights[..., t + i: t + i + 1] * v_m
        out = layer.feed_forward(z + layer.self_attn.out(attended))
        outputs.append(out)
        prev = _shift(out, 1)
    return outputs


def hsr_loss(head: HSRHead, head_weight: torch.Tensor, steps: int, autocast_bf16: bool = False):
    """``loss(batch)`` on a corpus batch ``{tokens, features, final, weights}``: the mean over the
    unrolled steps of the weighted KL to the teacher; step j scores only positions with a full
    exact prefix (p >= j)."""

    def loss(batch: dict) -> torch.Tensor:
        tokens, features = batch["tokens"], batch["features"]
        weights = batch["weights"][:, 1:]   # draft position p = 1..T-1 predicts token p + 1
        where = weights > 0
        teacher = teacher_log_probs(batch["final"][:, 1:][where], head_weight)   # the same for every step
        p = torch.arange(1, tokens.shape[1], device=tokens.device).expand_as(weights)[where]
        with torch.autocast(tokens.device.type, dtype=torch.bfloat16, enabled=autocast_bf16):
            outputs = unrolled_outputs(head, tokens, features, steps)
            total = 0.0
            for j, out in enumerate(outputs, start=1):
                w = weights[where] * (p >= j)
                total = total + distill_loss(head.head_logits(out[where]), teacher, w)
        return total / steps

    return loss


@torch.no_grad()
def step_matches_inference(head: HSRHead, tokens: list[int], features: torch.Tensor, exact: int, drafted: int) -> float:
    """Max |difference| between the unrolled training outputs and what ``HSRDraft`` computes for
    the ``drafted``-th token after an exact prefix of ``exact`` positions: the two must agree.
    (For tests; here because it documents the training/inference correspondence.)"""
    from specserve.replicas.drafts.hsr_draft import HSRSession

    device = features.device
    outputs = unrolled_outputs(head, torch.tensor([tokens], device=device), features[None].float(), drafted)
    session = HSRSession(head)
    session.sync(tokens[: exact + 1], features[:exact], 0)
    hidden = session.root_hidden()
    keys, values = session.keys, session.values
    for i in range(1, drafted):
        z = head.inputs(torch.tensor([[tokens[exact + i]]], device=device), hidden)
        hidden, k, v = head.step(z, torch.tensor([exact + i], device=device), keys, values)
        keys, values = torch.cat([keys, k], 2), torch.cat([values, v], 2)
    p = exact + drafted - 1   # the position of the drafted-th token's input
    return float((outputs[drafted - 1][0, p - 1] - hidden[0, -1]).abs().max())

