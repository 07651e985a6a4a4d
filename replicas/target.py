"""The target side of a step: score a proposal in one forward pass and keep what it accepts."""

from __future__ import annotations

import torch

from specserve.replicas.kv_session import KVSession, common_prefix_len
from specserve.replicas.rejection_sampler import verify
from specserve.replicas.sampling import SamplingParams
from specserve.replicas.step import Proposal, StepResult


class FeatureTap:
    """The output of one decoder layer in the model's last forward: the hidden states a
    hidden-state-reuse draft reads (``replicas/drafts/hsr_head.py``). One per model, shared by
    every session on it; forwards run one at a time (``ModelWorker``), so the slot is safe."""

    def __init__(self, layer: torch.nn.Module):
        self.last: torch.Tensor | None = None
        layer.register_forward_hook(self._keep)

    def _keep(self, module, args, output) -> None:
        self.last = output[0] if isinstance(output, tuple) else output


def feature_tap(model, layer: int = -2) -> FeatureTap | None:
    """The model's tap on decoder layer ``layer`` (-2: the second-to-last, Sparrow's ``h^h``);
    None for a model without a list of at least two decoder layers."""
    tap = getattr(model, "_specserve_feature_tap", None)
    layers = getattr(getattr(model, "model", None), "layers", None)
    if tap is None and layers is not None and len(layers) >= 2:
        tap = FeatureTap(layers[layer])
        model._specserve_feature_tap = tap
    return tap


class Target:
    def __init__(self, model):
        self.session = KVSession(model)
        self._tap = feature_tap(model)
        # Row p: the tapped hidden state at cache position p; rows < _known are valid. Grows by
        # doubling, so a step appends without copying the whole history.
        self._features: torch.Tensor | None = None
        self._known = 0

    def features(self, context: list[int], start: int = 0) -> torch.Tensor | None:
        """The hidden states this target holds for ``context`` (a view), from position ``start``:
        rows up to the root at most, and only where its cache holds these very tokens (a pooled
        cache may hold another request's). None without a tap."""
        if self._features is None:
            return None
        end = min(self._known, common_prefix_len(self.session.tokens, context), len(context) - 1)
        return self._features[start:max(start, end)]

    def _keep_features(self, first: int, rows: torch.Tensor) -> None:
        """Rows for positions ``first..``; everything after ``first`` is replaced."""
        end = first + len(rows)
        if self._features is None or end > len(self._features):
            grown = torch.empty(max(2 * end, 256), rows.shape[-1], dtype=rows.dtype, device=rows.device)
            if self._features is not None:
                grown[: self._known] = self._features[: self._known]
            self._features = grown
        self._features[first:end] = rows
        self._known = end

    def verify(
        self,
        context: list[int],
        proposal: Proposal,
        params: SamplingParams,
        generator: torch.Generator | None,
    ) -> StepResult:
        """One forward over [uncached context tail] + proposal; ``context[-1]`` is the root.

        The cache afterwards holds ``context`` + the accepted tokens (not the bonus token, which
        becomes the next step's root), and ``features()`` the hidden states of those positions.
        """
        missing = self.session.sync(context[:-1]) + context[-1:]
        base = len(context)  # cache positions 0..base-1 hold the context once the forward is done
        first = base - len(missing)
        rows = len(proposal) + 1
        if proposal.is_chain:
            logits = self.session.extend(missing + proposal.tokens, logits_rows=rows)
        else:
            # The uncached tail is a chain of tree nodes ending in the root; proposal nodes hang
            # below the root (parent -1 -> the root's index).
            tail = len(missing)
            parents = list(range(-1, tail - 1)) + [
                tail - 1 if p < 0 else tail + p for p in proposal.parents
            ]
            logits = self.session.extend_tree(missing + proposal.tokens, parents)[tail - 1 :]
        path, bonus = verify(logits, proposal, params, generator)
        accepted = [proposal.tokens[i] for i in path]
        if self._tap is not None:
            fed = self._tap.last[0]   # [len(missing) + len(proposal), H]
            keep = list(range(len(missing))) + [len(missing) + i for i in path]
            self._keep_features(first, fed[keep] if not proposal.is_chain else fed[: len(keep)])
        if proposal.is_chain:
            self.session.crop(base + len(path))
        else:
            keep = list(range(base)) + [base + i for i in path]
            self.session.keep(keep, context + accepted)
        depths = proposal.depths()
        return StepResult(
            proposed=len(proposal),
            accepted=len(path),
            accepted_path=path,
            emitted_tokens=accepted + [bonus],
            max_depth=max(depths, default=0),
        )
