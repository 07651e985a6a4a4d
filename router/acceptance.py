"""Per-draft acceptance models: α predicted from a prompt's feature vector (α ≈ uᵀZ, Eq. 8 of
"A Drop-in Solution for On-the-Fly Adaptation of Speculative Decoding in Large Language
Models"), learned from the α each finished request realised.

One class serves both models:

- **online** (the router's): ridge regression updated after every observation, the sufficient
  statistics ``A = λI + Σ w·x·xᵀ`` and ``b = Σ w·α·x`` kept, so that the estimate is exactly the
  least-squares fit of everything seen so far, and LinUCB's confidence width ``sqrt(xᵀA⁻¹x)``
  comes for free (it shrinks as similar prompts are observed: exploration fades with confidence);
- **least squares** (the paper's §5 baseline, ``bench/router.py``): the same fit over a fixed set
  of prompts, then frozen, by scikit-learn's ``Ridge``; kept here as the online model only, which
  scikit-learn has no exact incremental form of (LinUCB needs A⁻¹).

**The prior** (``prior_alpha``, α₀): the ridge pulls the fit towards α₀ instead of 0 (it regresses
α − α₀), so a draft nothing has been observed for is predicted α₀. Pulled towards 0, a draft
tried on a few unlucky prompts is predicted so low that LinUCB's bonus never brings it back, and
the bandit keeps choosing another draft where this one is faster. The router's
models start at ``ROUTER_PRIOR_ALPHA``.

Two replicas' statistics add (``A₁ + A₂ − λI``, ``b₁ + b₂``), which is how the policy service
merges the cluster's observations; they travel as JSON (never pickle).
"""

from __future__ import annotations

from collections.abc import Sequence

import numpy as np

# What the router predicts for a draft before it has observed it: an even chance per token.
ROUTER_PRIOR_ALPHA = 0.5
# Features a model may have: the router's five plus up to 64 topic dimensions, with room. A model
# read from outside is checked against this before its dims² matrix is allocated.
MAX_FEATURES = 256


class LinearAcceptance:
    def __init__(self, dims: int, ridge: float = 1.0, alpha_max: float = 0.95, prior_alpha: float = 0.0):
        if dims < 1 or ridge <= 0:
            raise ValueError(f"dims must be >= 1 and ridge > 0, got dims={dims}, ridge={ridge}")
        self.dims = dims
        self.ridge = ridge
        self.alpha_max = alpha_max
        self.prior_alpha = prior_alpha
        self.A = ridge * np.eye(dims)
        self.b = np.zeros(dims)
        self.observations = 0.0   # Σ w
        self._inverse: np.ndarray | None = None

    def _vector(self, x: Sequence[float]) -> np.ndarray:
        v = np.asarray(x, dtype=float)
        if v.shape != (self.dims,):
            raise ValueError(f"feature vector of length {len(v)}; this model has {self.dims} features")
        return v

    def update(self, x: Sequence[float], alpha: float, weight: float = 1.0) -> None:
        """One request's realised α on features ``x``; ``weight`` < 1 for a request that drafted
        only a few steps (its α is a noisier measurement)."""
        if weight <= 0:
            return
        v = self._vector(x)
        self.A += weight * np.outer(v, v)
        self.b += weight * (float(alpha) - self.prior_alpha) * v
        self.observations += weight
        self._inverse = None

    @property
    def inverse(self) -> np.ndarray:
        if self._inverse is None:
            self._inverse = np.linalg.inv(self.A)
        return self._inverse

    @property
    def weights(self) -> np.ndarray:
        """θ = A⁻¹b (Ẑ of the paper's Eq. 8; of α − α₀ when there is a prior)."""
        return self.inverse @ self.b

    def predict(self, x: Sequence[float]) -> float:
        """The expected α for features ``x``, within [0, α_max]."""
        return float(np.clip(self.prior_alpha + self.weights @ self._vector(x), 0.0, self.alpha_max))

    def width(self, x: Sequence[float]) -> float:
        """LinUCB's confidence width sqrt(xᵀA⁻¹x): large for prompts unlike any observed."""
        v = self._vector(x)
        return float(np.sqrt(max(0.0, v @ self.inverse @ v)))

    def merged(self, other: "LinearAcceptance") -> "LinearAcceptance":
        """The model of both observation sets (their sufficient statistics add; the ridge once)."""
        if other.dims != self.dims or other.ridge != self.ridge or other.prior_alpha != self.prior_alpha:
            raise ValueError("only models of the same features, ridge and prior merge")
        out = LinearAcceptance(self.dims, self.ridge, self.alpha_max, self.prior_alpha)
        out.A = self.A + other.A - self.ridge * np.eye(self.dims)
        out.b = self.b + other.b
        out.observations = self.observations + other.observations
        return out

    def to_dict(self) -> dict:
        return {"dims": self.dims, "ridge": self.ridge, "alpha_max": self.alpha_max, "prior_alpha": self.prior_alpha,
                "observations": self.observations, "A": self.A.tolist(), "b": self.b.tolist()}

    @classmethod
    def from_dict(cls, data: dict, dims: int | None = None) -> "LinearAcceptance":
        """The model of ``to_dict``'s data; ``dims``: the features it must have. Raises
        ``ValueError`` for data that is not a usable model (checked before anything is sized
        from it): dims outside 1..``MAX_FEATURES`` or not ``dims``, A and b of other shapes or not
        finite, A not symmetric positive definite (as λI + Σ w·x·xᵀ always is; predicting inverts it)."""
        size = data.get("dims")
        if not isinstance(size, int) or isinstance(size, bool) or not 1 <= size <= MAX_FEATURES \
                or (dims is not None and size != dims):
            raise ValueError(f"acceptance model of {size!r} features; expected {dims or f'1..{MAX_FEATURES}'}")
        A, b = np.asarray(data["A"], dtype=float), np.asarray(data["b"], dtype=float)
        if A.shape != (size, size) or b.shape != (size,):
            raise ValueError(f"acceptance model of {size} features with A {A.shape} and b {b.shape}")
        if not (np.isfinite(A).all() and np.isfinite(b).all()) or not np.allclose(A, A.T):
            raise ValueError("acceptance model whose A or b is not finite, or whose A is not symmetric")
        try:
            np.linalg.cholesky(A)
        except np.linalg.LinAlgError as err:
            raise ValueError("acceptance model whose A is not positive definite") from err
        # A document without ``prior_alpha`` was fitted towards 0.
        model = cls(size, float(data["ridge"]), float(data.get("alpha_max", 0.95)), float(data.get("prior_alpha", 0.0)))
        model.A, model.b, model.observations = A, b, float(data.get("observations", 0.0))
        return model
