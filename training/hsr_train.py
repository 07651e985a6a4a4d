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
"training-time test" has the same attention pattern: "EAGLE-3: Scaling up Inference Acceleration
of Large Language Models via Training-Time Test"). Sparrow unrolls twice; ``steps`` is a
parameter, the zoo recipe says how many.

A head that reads several of the target's layers (EAGLE-3) takes them side by side in
``features`` ([B, T, n·H]) and fuses them once (``HSRHead.fused``) into step 1's input; the later
steps read the head's own outputs, as drafting does.

With ``ce_weight`` > 0 the loss adds, per step, the cross-entropy of the head on the token that
actually follows (``ce_weight · CE``). On the target's greedy answers that token is the target's
argmax given its whole context, which is what greedy verification accepts, while the KL's teacher
may have read a shortened context (``training/features.py`` keeps the last few prompt tokens).
EAGLE-3 trains on the token loss alone; the KL keeps the whole distribution, which sampled
drafting needs. Tokens outside the head's vocabulary cannot be drafted and score no CE.
"""

from __future__ import annotations

import math

import torch
import torch.nn.functional as F

from specserve.replicas.drafts.hsr_head import HSRHead
from specserve.training.distill import distill_loss, teacher_log_probs


def _shift(x: torch.Tensor, by: int) -> torch.Tensor:
    """``x`` [..., T, d] moved ``by`` positions later along T, zeros in front."""
    if by == 0:
        return x
    return torch.cat([torch.zeros_like(x[..., :by, :]), x[..., :-by, :]], dim=-2)


def unrolled_outputs(head: HSRHead, tokens: torch.Tensor, features: torch.Tensor, steps: int,
                     anchor: torch.Tensor | None = None, image: torch.Tensor | None = None) -> list[torch.Tensor]:
    """The head's outputs for positions 1..T-1, one tensor [B, T-1, H] per unrolled step.

    tokens [B, T]; features [B, T, n·H]: the target's states (row p = position p), its layers side
    by side for a head that fuses several. With Sparrow's visual anchor (IVSB, Eq. 3-4), the
    positions ``image`` [B, T] take ``anchor`` [B, T, H] as their input at every step in place of
    ``FC(e ⊕ h)``."""
    t = tokens.shape[1] - 1
    device = tokens.device
    positions = torch.arange(1, t + 1, device=device)
    cos, sin = head.rope(positions, features.dtype)
    layer = head.layer
    idx = torch.arange(t, device=device)
    outputs: list[torch.Tensor] = []
    keys: list[torch.Tensor] = []
    values: list[torch.Tensor] = []
    prev = head.fused(features[:, :-1])   # [B, T-1, H]
    for j in range(1, steps + 1):
        z = head.inputs(tokens[:, 1:], prev)
        if anchor is not None:
            z = torch.where(image[:, 1:, None], anchor[:, 1:].to(z.dtype), z)
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


def head_index(head: HSRHead, device: torch.device) -> torch.Tensor:
    """[V]: each full-vocabulary id's row in the head, -1 for ids outside it."""
    ids = head.head_token_ids(device)
    index = torch.full((head.config.vocab_size,), -1, dtype=torch.long, device=device)
    index[ids] = torch.arange(len(ids), device=device)
    return index


def next_tokens(tokens: torch.Tensor) -> torch.Tensor:
    """[B, T-1]: the token after each draft position p = 1..T-1 (the last one's is a filler: no
    position past the end is scored)."""
    return torch.cat([tokens[:, 2:], tokens[:, :1]], dim=1)


class Teacher:
    """The teacher at a batch's scored positions, computed once for every unrolled step: its
    distribution ``p`` over the head [N, K] and ``Σ p log p`` [N]."""

    def __init__(self, logp: torch.Tensor):
        self.logp = logp
        self.p = logp.exp()
        self.neg_entropy = (self.p * logp).sum(-1)


def kl_and_ce(head_logits: torch.Tensor, teacher: Teacher, weights: torch.Tensor, target: torch.Tensor,
              ce_weight: float) -> torch.Tensor:
    """``distill_loss`` (weighted mean KL(p ‖ q)) plus ``ce_weight`` times the weighted mean
    cross-entropy on ``target`` (head rows [N], -1: not in the head, unscored), from one
    log-softmax: KL = Σ p log p − Σ p log q, CE = −log q(target). head_logits [N, K]; weights [N].
    (One log-softmax and one product per step instead of ``distill_loss``'s exp, difference and
    product, and a second log-softmax for the CE: these are the largest tensors of a step.)"""
    logq = F.log_softmax(head_logits.float(), dim=-1)
    kl = teacher.neg_entropy - (teacher.p * logq).sum(-1)
    total = (kl * weights).sum() / weights.sum().clamp(min=1e-6)
    if ce_weight:
        scored = weights * (target >= 0)
        ce = -logq.gather(-1, target.clamp(min=0)[:, None])[:, 0]
        total = total + ce_weight * (ce * scored).sum() / scored.sum().clamp(min=1e-6)
    return total


def _scored(head: HSRHead, batch: dict, head_weight: torch.Tensor):
    """What every step is scored against: the weighted positions (``where``), their weights,
    positions p, the teacher's log-distribution and the next token's head row."""
    tokens = batch["tokens"]
    weights = batch["weights"][:, 1:]   # draft position p = 1..T-1 predicts token p + 1
    where = weights > 0
    teacher = teacher_log_probs(batch["final"][:, 1:][where], head_weight)   # the same for every step
    p = torch.arange(1, tokens.shape[1], device=tokens.device).expand_as(weights)[where]
    target = head_index(head, tokens.device)[next_tokens(tokens)[where]]
    return where, weights[where], p, teacher, target


def hsr_loss(head: HSRHead, head_weight: torch.Tensor, steps: int, autocast_bf16: bool = False,
             ce_weight: float = 0.0):
    """``loss(batch)`` on a batch ``{tokens, features, final, weights}``: the mean over the
    unrolled steps of the weighted KL to the teacher, plus ``ce_weight`` times the cross-entropy
    on the next token (see above); step j scores only positions with a full exact prefix (p >= j)."""

    def loss(batch: dict) -> torch.Tensor:
        where, weights, p, teacher_logp, target = _scored(head, batch, head_weight)
        teacher = Teacher(teacher_logp)
        with torch.autocast(batch["tokens"].device.type, dtype=torch.bfloat16, enabled=autocast_bf16):
            outputs = unrolled_outputs(head, batch["tokens"], batch["features"], steps, batch.get("anchor"),
                                       batch.get("image"))
            total = 0.0
            for j, out in enumerate(outputs, start=1):
                logits = head.head_logits(out[where])
                total = total + kl_and_ce(logits, teacher, weights * (p >= j), target, ce_weight)
        return total / steps

    return loss


@torch.no_grad()
def hsr_metrics(head: HSRHead, head_weight: torch.Tensor, steps: int, batches, autocast_bf16: bool = False) -> dict:
    """Validation over ``batches``: per unrolled step, the weighted KL to the teacher and how often
    the head's argmax is the next token (``top1``; step 1's is the first drafted token's greedy
    acceptance, given the target's states; later steps' are teacher-forced, not conditioned on
    the earlier steps being right) and the teacher's argmax over the head (``teacher_top1``)."""
    kl = [0.0] * steps
    hits = [0.0] * steps
    teacher_hits = [0.0] * steps
    total = [0.0] * steps
    for batch in batches:
        where, weights, p, teacher, target = _scored(head, batch, head_weight)
        teacher_best = teacher.argmax(-1)
        with torch.autocast(batch["tokens"].device.type, dtype=torch.bfloat16, enabled=autocast_bf16):
            outputs = unrolled_outputs(head, batch["tokens"], batch["features"], steps, batch.get("anchor"),
                                       batch.get("image"))
        for j, out in enumerate(outputs):
            w = weights * (p >= j + 1)
            logits = head.head_logits(out[where].float()).float()   # the float32 head, as the module path promotes
            best = logits.argmax(-1)
            kl[j] += float(distill_loss(logits, teacher, w)) * float(w.sum())
            hits[j] += float((w * (best == target)).sum())
            teacher_hits[j] += float((w * (best == teacher_best)).sum())
            total[j] += float(w.sum())
    return {"kl": [k / max(t, 1e-9) for k, t in zip(kl, total)],
            "top1": [h / max(t, 1e-9) for h, t in zip(hits, total)],
            "teacher_top1": [h / max(t, 1e-9) for h, t in zip(teacher_hits, total)],
            "positions": int(total[0])}


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

