"""TF-IDF topics over token ids: fitted from a corpus, projected per prompt, JSON and cache."""

import numpy as np
import pytest

from specserve.data.prompts import load_prompts, training_prompts
from specserve.replicas.model_store import load_tokenizer_and_config
from specserve.router.router_factory import encode_user
from specserve.router.topics import TopicBasis, cached_basis


def synthetic(seed, n=40):
    rng = np.random.default_rng(seed)
    docs = [list(rng.integers(0, 50, 30)) for _ in range(n // 2)]          # topic A: ids 0..49
    docs += [list(rng.integers(1000, 1050, 30)) for _ in range(n // 2)]    # topic B: ids 1000..1049
    return [[int(t) for t in d] for d in docs]


def test_fit_separates_two_topics_and_is_deterministic():
    docs = synthetic(0)
    basis = TopicBasis.fit(docs, dims=4, vocab_size=200)
    assert basis == TopicBasis.fit(docs, dims=4, vocab_size=200)
    a, b = synthetic(1)[0], synthetic(1)[-1]
    pa, pb = np.array(basis.project(a)), np.array(basis.project(b))
    assert np.all(np.abs(pa) <= 1.0 + 1e-9) and np.linalg.norm(pa - pb) > 0.5
    assert basis.project([]) == (0.0,) * 4 and basis.project([99999]) == (0.0,) * 4
    with pytest.raises(ValueError, match="documents"):
        TopicBasis.fit(docs[:2], dims=4)


def test_json_round_trip_and_cache(tmp_path):
    basis = TopicBasis.fit(synthetic(0), dims=3, vocab_size=100)
    again = TopicBasis.from_json(basis.to_json())
    doc = synthetic(2)[5]
    assert again.project(doc) == pytest.approx(basis.project(doc), abs=1e-5)
    built = []
    first = cached_basis("t", lambda: built.append(1) or basis, tmp_path)
    second = cached_basis("t", lambda: built.append(1) or basis, tmp_path)
    assert built == [1] and second.project(doc) == pytest.approx(first.project(doc), abs=1e-5)


@pytest.mark.slow
def test_real_prompts_code_and_prose_land_apart():
    tokenizer, _ = load_tokenizer_and_config()
    corpus = [p for c in ("code", "chat", "summarise", "edit") for p in list(training_prompts(c))[:50]]
    basis = TopicBasis.fit([encode_user(tokenizer, t) for t in corpus], dims=8, vocab_size=2048)
    centroid = {}
    for category in ("code", "chat"):
        train = [basis.project(encode_user(tokenizer, t)) for t in list(training_prompts(category))[50:80]]
        centroid[category] = np.mean(train, axis=0)
    held_out = [(c, basis.project(encode_user(tokenizer, t))) for c in ("code", "chat") for t in load_prompts(c, 10)]
    right = sum(min(centroid, key=lambda k: np.linalg.norm(np.array(p) - centroid[k])) == c for c, p in held_out)
    assert right >= 16, f"nearest topic centroid right on {right} of 20 held-out code/chat prompts"


@pytest.mark.slow
def test_the_reference_corpus_topics_tell_code_from_prose():
    """The priors' task topics from the corpus a replica fits them on: held-out code prompts
    share a topic no chat or summarise prompt has."""
    from specserve.data.prompts import topic_corpus

    tokenizer, _ = load_tokenizer_and_config()
    basis = TopicBasis.fit([encode_user(tokenizer, t) for t in topic_corpus()], dims=8, vocab_size=4096, clusters=4)
    topics = {c: [basis.topic(encode_user(tokenizer, t)) for t in load_prompts(c, 8)] for c in ("code", "chat", "summarise")}
    code = max(set(topics["code"]), key=topics["code"].count)
    assert topics["code"].count(code) >= 7, topics
    assert code not in topics["chat"] + topics["summarise"], topics


def test_topics_are_the_nearest_centroid_and_leave_the_projection_and_its_fingerprint_alone():
    docs = synthetic(0)
    plain, clustered = TopicBasis.fit(docs, dims=4, vocab_size=200), TopicBasis.fit(docs, dims=4, vocab_size=200, clusters=2)
    assert clustered.topics == 2 and plain.topics == 0 and plain.topic(docs[0]) is None
    assert clustered.components == plain.components and clustered.fingerprint == plain.fingerprint
    held_out = synthetic(3)
    a, b = {clustered.topic(d) for d in held_out[:20]}, {clustered.topic(d) for d in held_out[20:]}
    assert len(a) == 1 and len(b) == 1 and a != b, (a, b)    # one topic per kind of document, two kinds
    assert clustered.topic([]) is None and clustered.topic([99999]) is None   # nothing to tell it by
    again = TopicBasis.from_json(clustered.to_json())
    assert again.centroids == clustered.centroids and again.topic(held_out[0]) == clustered.topic(held_out[0])
    assert TopicBasis.fit(docs, dims=4, vocab_size=200, clusters=2) == clustered   # deterministic
    with pytest.raises(ValueError, match="distinct"):
        TopicBasis.fit([[1, 2]] * 5, dims=1, clusters=3)


def test_the_basis_is_the_top_singular_directions_of_the_corpus_tfidf_matrix():
    """scikit-learn's fit, checked against its definition: each component is one of the top
    right-singular vectors (up to sign) of the corpus's TF-IDF rows as the basis computes them."""
    docs = synthetic(0)
    basis = TopicBasis.fit(docs, dims=4, vocab_size=200)
    matrix = np.stack([basis.tfidf(d) for d in docs])
    assert np.allclose(np.linalg.norm(matrix, axis=1), 1.0)
    _, _, vt = np.linalg.svd(matrix, full_matrices=False)
    for component, reference in zip(np.array(basis.components), vt[:4]):
        assert abs(abs(component @ reference) - 1.0) < 1e-5
