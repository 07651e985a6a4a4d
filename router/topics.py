"""TF-IDF over token ids, reduced to a few dimensions (latent semantic analysis): the router's
"what kind of prompt is this" feature ("A Drop-in Solution for On-the-Fly Adaptation of
Speculative Decoding in Large Language Models", §5, uses TF-IDF; it tried 4-16 dimensions).
Fitted with scikit-learn (``TfidfVectorizer``, ``TruncatedSVD``, ``KMeans``):

    tf     1 + log(count) of each kept token id in the prompt (sublinear: a repeated identifier
           should not drown the rest)
    idf    log((1 + N) / (1 + df)) + 1 over the fit corpus (smoothed)
    basis  the top ``dims`` right-singular vectors of the corpus's L2-normalised TF-IDF matrix

Not centred, as LSA on TF-IDF usually is not: centring would make a dense matrix of a sparse one
and the first component then mostly separates long from short documents, which the length
feature already gives. Token ids, not words, so that the basis needs only the target's tokenizer.

Only the ``vocab_size`` ids most documents contain are kept (the rest are rare, and mostly
noise to a basis fitted on a few thousand prompts); ties go to the lower id, so that a fit is the
same on every machine (scikit-learn's ``max_features`` ranks by total count and breaks ties
unstably).

    topics  ``clusters`` centroids of the corpus's projections (scikit-learn's k-means): a
            prompt's topic is its nearest centroid, the task key under which the policy service
            keeps priors (``policies/stats.task_bucket``, docs/design.md §4), so that a code
            request does not start from the window or tree that chat requests favour

The basis is data (tuples of numbers) with a JSON round trip: it travels inside Serve deployment
arguments and a cache file, never pickled, so a served prompt is projected here over those
numbers (one pass over its ids) rather than by the fitted scikit-learn objects.
"""

from __future__ import annotations

import hashlib
import json
import os
import tempfile
from collections import Counter
from collections.abc import Callable, Iterable, Sequence
from dataclasses import dataclass, field
from pathlib import Path

import numpy as np
from sklearn.cluster import KMeans
from sklearn.decomposition import TruncatedSVD
from sklearn.feature_extraction.text import TfidfVectorizer

from specserve.replicas.model_store import model_cache_dir


@dataclass(frozen=True)
class TopicBasis:
    vocab: tuple[int, ...]
    idf: tuple[float, ...]
    components: tuple[tuple[float, ...], ...]   # dims x len(vocab)
    centroids: tuple[tuple[float, ...], ...] = ()   # topics x dims; none: no topics
    _index: dict = field(default=None, init=False, repr=False, compare=False)

    def __post_init__(self) -> None:
        if len(self.idf) != len(self.vocab) or any(len(c) != len(self.vocab) for c in self.components):
            raise ValueError("a topic basis needs one idf and one component entry per kept token id")
        if any(len(c) != len(self.components) for c in self.centroids):
            raise ValueError("a topic centroid needs one entry per dimension of the basis")
        # Lookup tables built once: projecting a prompt is then one pass over its ids.
        object.__setattr__(self, "_index", {
            "column": {token: i for i, token in enumerate(self.vocab)},
            "idf": np.asarray(self.idf, dtype=np.float64),
            "components": np.asarray(self.components, dtype=np.float64).reshape(len(self.components), len(self.vocab)),
            "centroids": np.asarray(self.centroids, dtype=np.float64).reshape(len(self.centroids), len(self.components)),
        })

    @property
    def dims(self) -> int:
        return len(self.components)

    def tfidf(self, ids: Sequence[int]) -> np.ndarray:
        """The prompt's L2-normalised TF-IDF vector over ``vocab`` (zeros when nothing is kept)."""
        column = self._index["column"]
        counts = Counter(column[t] for t in ids if t in column)
        v = np.zeros(len(self.vocab))
        if counts:
            cols = np.fromiter(counts.keys(), dtype=np.int64)
            tf = 1.0 + np.log(np.fromiter(counts.values(), dtype=np.float64))
            v[cols] = tf * self._index["idf"][cols]
            v /= np.linalg.norm(v)
        return v

    def project(self, ids: Sequence[int]) -> tuple[float, ...]:
        """``dims`` numbers in [-1, 1]: the prompt's TF-IDF vector on each component."""
        return tuple(float(x) for x in self._index["components"] @ self.tfidf(ids))

    @property
    def topics(self) -> int:
        return len(self.centroids)

    def topic(self, ids: Sequence[int]) -> int | None:
        """The index of the centroid nearest the prompt's projection; None without centroids or
        when none of the prompt's ids is kept (nothing to tell its topic by)."""
        if not self.centroids:
            return None
        v = self.tfidf(ids)
        if not v.any():
            return None
        point = self._index["components"] @ v
        return int(np.argmin(((self._index["centroids"] - point) ** 2).sum(axis=1)))

    @property
    def fingerprint(self) -> str:
        """Names the projection (vocab, idf, components), which the router's models are fitted
        over; the topics' centroids do not change it."""
        return hashlib.sha1(self.to_json(centroids=False).encode()).hexdigest()[:12]

    # ---- fitting ---------------------------------------------------------------------------

    @classmethod
    def fit(cls, docs: Sequence[Sequence[int]], dims: int = 8, vocab_size: int = 4096, clusters: int = 0) -> "TopicBasis":
        if dims < 1 or vocab_size < dims:
            raise ValueError(f"need dims >= 1 and vocab_size >= dims, got dims={dims}, vocab_size={vocab_size}")
        if clusters < 0:
            raise ValueError(f"clusters must be >= 0, got {clusters}")
        docs = [d for d in docs if d]
        if len(docs) < dims:
            raise ValueError(f"fitting {dims} topic dimensions needs at least {dims} non-empty documents, got {len(docs)}")
        df = Counter(t for d in docs for t in set(d))
        # Most documents first; ties by id, so a fit is the same on every machine.
        vocab = tuple(sorted(df, key=lambda t: (-df[t], t))[:vocab_size])
        if len(vocab) <= dims or len(docs) <= dims:
            raise ValueError(f"fitting {dims} topic dimensions needs more than {dims} documents and kept ids, "
                             f"got {len(docs)} and {len(vocab)}")
        vectorizer = TfidfVectorizer(analyzer=list, lowercase=False, vocabulary=vocab, sublinear_tf=True, norm="l2")
        matrix = vectorizer.fit_transform(docs)   # sparse [docs, vocab]
        idf = tuple(float(x) for x in vectorizer.idf_)
        components = TruncatedSVD(dims, algorithm="arpack", random_state=0).fit(matrix).components_
        # SVD signs are arbitrary: make each component's largest entry positive (deterministic).
        signs = np.sign(components[np.arange(len(components)), np.abs(components).argmax(axis=1)])
        components = np.round(components * signs[:, None], 6)
        centroids = ()
        if clusters:
            projected = np.asarray(matrix @ components.T)
            if len(np.unique(projected, axis=0)) < clusters:
                raise ValueError(f"{clusters} topics need at least {clusters} distinct documents")
            means = KMeans(clusters, n_init=10, random_state=0).fit(projected).cluster_centers_
            centroids = tuple(tuple(round(float(x), 6) for x in row) for row in means)
        return cls(vocab, idf, tuple(tuple(float(x) for x in row) for row in components), centroids)

    # ---- JSON ------------------------------------------------------------------------------

    def to_json(self, centroids: bool = True) -> str:
        data = {"vocab": list(self.vocab), "idf": [round(x, 6) for x in self.idf],
                "components": [list(c) for c in self.components]}
        if centroids and self.centroids:
            data["centroids"] = [list(c) for c in self.centroids]
        return json.dumps(data, separators=(",", ":"))

    @classmethod
    def from_json(cls, text: str) -> "TopicBasis":
        data = json.loads(text)
        return cls(tuple(int(t) for t in data["vocab"]), tuple(float(x) for x in data["idf"]),
                   tuple(tuple(float(x) for x in c) for c in data["components"]),
                   tuple(tuple(float(x) for x in c) for c in data.get("centroids", ())))


def fit_texts(texts: Iterable[str], encode: Callable[[str], list[int]], dims: int = 8,
              vocab_size: int = 4096, clusters: int = 0) -> TopicBasis:
    return TopicBasis.fit([encode(t) for t in texts], dims, vocab_size, clusters)


def cache_dir() -> Path:
    """Beside the model cache (``$SPECSERVE_MODEL_CACHE``/../router)."""
    return model_cache_dir().parent / "router"


def cached_basis(name: str, build: Callable[[], TopicBasis], directory: Path | None = None) -> TopicBasis:
    """The basis cached as ``topics-<name>.json``, built (and written atomically) when absent."""
    path = (directory or cache_dir()) / f"topics-{name}.json"
    if path.exists():
        return TopicBasis.from_json(path.read_text())
    basis = build()
    path.parent.mkdir(parents=True, exist_ok=True)
    with tempfile.NamedTemporaryFile("w", dir=path.parent, suffix=".tmp", delete=False) as tmp:
        tmp.write(basis.to_json())
    os.replace(tmp.name, path)   # two replicas fitting at once: the last complete file wins
    return basis
