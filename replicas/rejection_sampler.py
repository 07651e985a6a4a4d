"""Verification: which proposed tokens the target accepts, and the bonus token.

The target scored the root (the last emitted token) and every proposal node in one forward
pass; row 0 of ``target_logits`` is the distribution after the root, row ``i + 1`` the one after
node ``i``. Two acceptance rules, both lossless (the emitted tokens are distributed exactly as
if the target had sampled them one by one):

* **sampled chain** (the draft drew token x from its warped ``q``): accept x with probability
  ``min(1, p(x) / q(x))``; on rejection the bonus token comes from ``norm(max(0, p − q))``
  (Leviathan et al. 2023; Chen et al. 2023).
* **deterministic proposals** (greedy or top-k drafts, prompt lookup, every tree): each
  candidate child x of a node is a point mass, ``q = δ_x``. Try the children in order: accept x
  with probability ``p(x)``; on rejection set ``p(x) = 0``, renormalise and try the next child;
  when all are rejected the bonus token comes from what is left of ``p``. This is sampling from
  ``p`` by elimination, so the output distribution is exactly ``p`` (the multi-candidate case of
  SpecInfer's recursive rejection sampling with point-mass drafts), and it is drawn so: one token
  y ~ p a row, following the child equal to y, y the bonus when none is. Under greedy ``p`` is
  one-hot and the rule reduces to "follow the child equal to the target's argmax".

A request that asked for a relaxed rule (``Relaxation``: LANTERN's for image tokens,
``lantern.py``) runs the same rules with x's mass raised to ``relaxation.mass(p, x)`` and the
tokens it took leaving ``p`` with x on rejection; under greedy it follows the first child whose
raised mass reaches the argmax's. Those rules are lossy, and only such a request runs them.
"""

from __future__ import annotations

from typing import Protocol

import torch

from specserve.replicas.model import cpu_row_ops
from specserve.replicas.model.transfer import sent
from specserve.replicas.sampling import (LOGITS_NOT_FINITE, NOT_A_DISTRIBUTION, NonFiniteScores, SamplingParams, draws,
                                         logits_to_probs, sample, uniform)
from specserve.replicas.step import Proposal


class Relaxation(Protocol):
    """A relaxed (lossy) acceptance rule: the mass a drafted token x is accepted against."""

    def mass(self, p: torch.Tensor, x: int) -> tuple[float, torch.Tensor]:
        """(x's raised mass under ``p`` [V], the other token ids whose mass it took)."""


def verify(
    target_logits: torch.Tensor,
    proposal: Proposal,
    params: SamplingParams,
    generator: torch.Generator | None = None,
    relaxation: Relaxation | None = None,
    choice: list[int] | None = None,
) -> tuple[list[int], int]:
    """Returns ``(accepted_path, bonus_token)``; ``accepted_path`` indexes ``proposal.tokens``.
    Raises ``NonFiniteScores`` when a row it reads is not a distribution (the caller fails that
    request alone). ``relaxation``: a relaxed rule the request asked for; None: exact.
    ``choice``: the rows' tokens already read, under the exact greedy rule their argmaxes
    (``greedy_choices``), under the exact point-mass rule one draw from each (``sampled_choices``).

    target_logits: [len(proposal) + 1, V]
    """
    if params.greedy:
        if relaxation is not None:
            return _verify_greedy_relaxed(target_logits, proposal, relaxation)
        return _verify_greedy(target_logits, proposal, choice)
    if proposal.draft_probs is not None and relaxation is None:
        verdict = sampled_chain_verdicts([target_logits], [proposal], [params], [generator])[0]
        if isinstance(verdict, NonFiniteScores):
            raise verdict
        return verdict
    if proposal.draft_probs is not None:
        return _verify_relaxed_chain(target_logits, proposal, params, generator, relaxation)
    return _verify_point_masses(target_logits, proposal, params, generator, relaxation, choice)


def _children(proposal: Proposal) -> list[list[int]]:
    """children[0] are the root's children, children[i + 1] those of node i, in proposal order."""
    children: list[list[int]] = [[] for _ in range(len(proposal) + 1)]
    for node, parent in enumerate(proposal.parents):
        children[parent + 1].append(node)
    return children


def greedy_choices(rows: list[torch.Tensor]) -> list[list[int]]:
    """Each tensor's rows' argmaxes (torch's rule: the first largest), -1 for a row holding NaN,
    which has no argmax to follow (torch would pick the NaN); rows: tensors [n_i, V] of one
    forward. Off the CPU, several requests' rows are read from the device at once: a read per
    request would wait for the device again each time (docs/design.md §9)."""
    if all(cpu_row_ops.usable(r) for r in rows):   # a C pass per row: torch's bfloat16 argmax is a scalar loop
        return [cpu_row_ops.argmax(r, nan=-1) for r in rows]
    # max carries a NaN through as the row's value, at its index; its index is argmax's.
    values, best = zip(*(r.max(-1) for r in rows))
    values, best = torch.cat(values), torch.cat(best)
    return _per_request(torch.where(values.isnan(), -1, best).tolist(), rows)


def _per_request(flat: list, rows: list[torch.Tensor]) -> list[list]:
    """One value per row of every request, read at once, split back by request."""
    out, at = [], 0
    for r in rows:
        out.append(flat[at:at + len(r)])
        at += len(r)
    return out


def draws_every_row(rows: torch.Tensor) -> bool:
    """Whether a point-mass walk over ``rows`` has them all drawn beforehand (``sampled_choices``):
    off the CPU, where each row's draw on arrival is a wait for the device; on the CPU the rows a
    walk skips cost more than the reads."""
    return rows.device.type != "cpu"


class DepthDraws:
    """A seeded request's draws for a point-mass walk made beforehand, as target-only decoding
    makes them: one u per depth of the proposal, each drawn alone and in order as ``sample``
    draws a token's, every row of a depth sharing its depth's. The walk visits one row per depth,
    so the row it visits at depth d reads the d-th draw, the one target-only decoding would make
    there. The draws past the walk's end are taken back (``rewind``): the generator is left where
    the draws the walk used leave it, and the request's later tokens are target-only's too."""

    def __init__(self, generator: torch.Generator, proposal: Proposal, device: torch.device):
        depths = [0] + proposal.depths()   # row 0 the root's, row i + 1 node i's
        self.generator = generator
        self.states = [generator.get_state()]   # after each number of draws (host-side state)
        uniforms = []
        for _ in range(max(depths) + 1):
            uniforms.append(torch.rand(1, 1, dtype=torch.float64, generator=generator, device=device))
            self.states.append(generator.get_state())
        self.u = torch.cat(uniforms).index_select(0, sent(depths, device, torch.long))   # [rows, 1]

    def rewind(self, visited: int) -> None:
        """Leave the generator as ``visited`` draws on arrival would have (the rows the walk visited)."""
        self.generator.set_state(self.states[visited])


def sampled_choices(rows: list[torch.Tensor], params: list[SamplingParams],
                    generators: list[torch.Generator | None],
                    depth_draws: list[DepthDraws | None] | None = None) -> list[list[int]]:
    """One token drawn from each row's warped distribution p, -1 for a row that is not one; rows:
    tensors [n_i, V] of one forward, each request's own params and generator. The point-mass walk
    visits one row per depth and follows the draw there, independent of the draws that led to it,
    so drawing every row beforehand samples exactly what drawing each row on arrival does: the
    rows it skips cost work, not correctness. ``depth_draws``: a seeded request's draws by depth
    (``DepthDraws``), else each row its own. Every request's draws are read from the device at
    once, where a walk waits for the device at each row (docs/design.md §9)."""
    if not rows:
        return []
    depth_draws = depth_draws or [None] * len(rows)
    flat = torch.cat([draws(logits_to_probs(r, p, check=False), g, None if d is None else d.u)
                      for r, p, g, d in zip(rows, params, generators, depth_draws)])
    return _per_request(flat.tolist(), rows)


def _verify_greedy(target_logits: torch.Tensor, proposal: Proposal,
                   choice: list[int] | None = None) -> tuple[list[int], int]:
    # Only the argmax matters: no softmax over the vocabulary.
    if choice is None:
        choice = greedy_choices([target_logits])[0]
    if -1 in choice:
        raise NonFiniteScores(LOGITS_NOT_FINITE)
    children = _children(proposal)
    path: list[int] = []
    row = 0
    while True:
        nxt = next((c for c in children[row] if proposal.tokens[c] == choice[row]), None)
        if nxt is None:
            return path, choice[row]
        path.append(nxt)
        row = nxt + 1


def _verify_greedy_relaxed(target_logits: torch.Tensor, proposal: Proposal,
                           relaxation: Relaxation) -> tuple[list[int], int]:
    # p is the softmax of the row's logits: the argmax's mass is what a raised x must reach.
    if not bool(torch.isfinite(target_logits.float().amax(-1)).all()):
        raise NonFiniteScores(LOGITS_NOT_FINITE)
    children = _children(proposal)
    path: list[int] = []
    row = 0
    while True:
        p = target_logits[row].float().softmax(-1)
        top, first = p.max(-1)
        first = int(first)
        nxt = next((c for c in children[row] if proposal.tokens[c] == first
                    or relaxation.mass(p, proposal.tokens[c])[0] >= float(top)), None)
        if nxt is None:
            return path, first
        path.append(nxt)
        row = nxt + 1


def _verify_point_masses(
    target_logits: torch.Tensor,
    proposal: Proposal,
    params: SamplingParams,
    generator: torch.Generator | None,
    relaxation: Relaxation | None = None,
    choice: list[int] | None = None,
) -> tuple[list[int], int]:
    children = _children(proposal)
    path: list[int] = []
    row = 0
    if relaxation is None:
        # Trying the children in turn, each accepted with its renormalised p(x), and the bonus
        # from what is left, is sampling from p by elimination: the same as one token y ~ p,
        # following the child equal to y, y the bonus when none is. One draw and one read from
        # the device a row (the draw's check refuses a row that is not finite), as target-only
        # decoding draws (a seeded request emits its tokens); or each row's draw made beforehand.
        while True:
            if choice is None:
                y = sample(logits_to_probs(target_logits[row], params, check=False), generator)
            elif (y := choice[row]) < 0:
                raise NonFiniteScores(NOT_A_DISTRIBUTION)
            nxt = next((c for c in children[row] if proposal.tokens[c] == y), None)
            if nxt is None:
                return path, y
            path.append(nxt)
            row = nxt + 1
    while True:
        p = logits_to_probs(target_logits[row], params)
        for child in children[row]:
            x = proposal.tokens[child]
            mass, taken = (p[x].item(), None) if relaxation is None else relaxation.mass(p, x)
            u = uniform(generator)
            if u < mass:                  # accept x with probability p(x) (relaxed: its raised mass)
                path.append(child)
                row = child + 1
                break
            p[x] = 0.0                    # rejected: p conditioned on "not x" (nor what x took)
            if taken is not None and float(p.sum() - p[taken].sum()) > 0.0:   # none left: only by round-off
                p[taken] = 0.0
            p = p / p.sum()
        else:
            return path, sample(p, generator)


def sampled_chain_verdicts(rows: list[torch.Tensor], proposals: list[Proposal], params: list[SamplingParams],
                           generators: list[torch.Generator | None]) -> list[tuple[list[int], int] | NonFiniteScores]:
    """Sampled chains verified by the exact rule, several requests at once: each request's rows
    ``[γ + 1, V]``, its chain (``draft_probs`` its q), params and generator. Two reads from the
    device for them all: every position's u, p(x), q(x) and each row's validity; then every
    bonus token, drawn from ``norm(max(0, p − q))`` at the first rejection, or from the row
    after the chain. Each request draws from its own generator in its own order (its u's, then
    its bonus), as verifying it alone does. A request with a row that is not finite gets
    ``NonFiniteScores`` in place of its verdict; the others go on."""
    probs, reads = [], []
    for r, proposal, prm, generator in zip(rows, proposals, params, generators):
        assert proposal.is_chain, "draft_probs are only defined for a chain proposal"
        p = logits_to_probs(r, prm, check=False)   # [γ + 1, V]; a row that is not finite is all NaN
        q, tokens = proposal.draft_probs, proposal.tokens
        us = torch.rand(len(tokens), generator=generator, device=p.device if generator is None else generator.device)
        parts = [p[:, 0], us.to(p.device, p.dtype)]   # a row's first entry: NaN where the row is
        if tokens:   # stacked views, not an index list (which a GPU would be sent first)
            parts += [torch.stack([p[i, x] for i, x in enumerate(tokens)]),
                      torch.stack([q[i, x] for i, x in enumerate(tokens)]).to(p.dtype)]
        probs.append(p)
        reads.append(torch.cat(parts))
    values = torch.cat(reads).tolist() if reads else []
    verdicts: list = []
    bonus_rows = []
    at = 0
    for p, proposal, generator in zip(probs, proposals, generators):
        n = len(proposal.tokens)
        heads, tests = values[at:at + n + 1], values[at + n + 1:at + 4 * n + 1]
        at += 4 * n + 1
        if any(v != v for v in heads):   # NaN
            verdicts.append(NonFiniteScores(LOGITS_NOT_FINITE))
            continue
        us, ps, qs = tests[:n], tests[n:2 * n], tests[2 * n:]
        # q(x) > 0 because x was drawn from q; p(x) >= q(x): always accept.
        accepted = next((i for i in range(n) if not us[i] * qs[i] < ps[i]), n)
        if accepted < n:
            # A rejection implies p(x) < q(x), so p − q has positive mass somewhere; p itself
            # stands in only when float round-off leaves none.
            residual = torch.clamp(p[accepted] - proposal.draft_probs[accepted], min=0.0)
            row = torch.where(residual.sum() > 0, residual, p[accepted])
        else:
            row = p[n]
        verdicts.append(list(range(accepted)))
        bonus_rows.append(draws(row[None], generator))
    bonuses = iter(torch.cat(bonus_rows).tolist() if bonus_rows else [])
    out: list = []
    for verdict in verdicts:
        if isinstance(verdict, NonFiniteScores):
            out.append(verdict)
        elif (bonus := next(bonuses)) < 0:
            out.append(NonFiniteScores(NOT_A_DISTRIBUTION))
        else:
            out.append((verdict, bonus))
    return out


def _verify_relaxed_chain(
    target_logits: torch.Tensor,
    proposal: Proposal,
    params: SamplingParams,
    generator: torch.Generator | None,
    relaxation: Relaxation,
) -> tuple[list[int], int]:
    """A sampled chain under a relaxed rule: x accepted against its raised mass, read a position
    at a time."""
    q = proposal.draft_probs
    p = logits_to_probs(target_logits, params)          # [γ + 1, V]
    for i, x in enumerate(proposal.tokens):
        u, mass, qx = uniform(generator), relaxation.mass(p[i], x)[0], q[i, x].item()
        if u * qx < mass:
            continue
        residual = torch.clamp(p[i] - q[i], min=0.0)
        total = residual.sum()
        return list(range(i)), sample(residual / total if total > 0 else p[i], generator)
    return list(range(len(proposal))), sample(p[len(proposal)], generator)
