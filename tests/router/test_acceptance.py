"""The per-draft acceptance models: online ridge (LinUCB's statistics) and the least-squares
baseline of "A Drop-in Solution for On-the-Fly Adaptation of Speculative Decoding in Large
Language Models" (§5)."""

import json

import numpy as np
import pytest
from sklearn.linear_model import Ridge

from specserve.router.acceptance import LinearAcceptance


def test_online_updates_equal_the_least_squares_fit_of_everything_seen():
    rng = np.random.default_rng(0)
    xs = [np.r_[1.0, rng.uniform(-1, 1, 3)] for _ in range(200)]
    truth = np.array([0.5, 0.2, -0.1, 0.05])
    alphas = [float(x @ truth) for x in xs]
    online = LinearAcceptance(4, ridge=1e-6)
    for x, a in zip(xs, alphas):
        online.update(x, a)
    assert np.allclose(online.weights, truth, atol=1e-4)
    batch = Ridge(alpha=1e-6, fit_intercept=False).fit(np.array(xs), np.array(alphas))   # scikit-learn's fit
    assert np.allclose(online.weights, batch.coef_)


def test_prediction_is_clipped_to_a_rate():
    for alphas, clipped in (([0.9, 2.0], 0.95), ([0.1, -1.0], 0.0)):
        model = LinearAcceptance(2, ridge=1e-3, alpha_max=0.95)
        for x, alpha in zip(([1.0, 0.0], [1.0, 1.0]), alphas):
            model.update(x, alpha)
        assert model.predict([1.0, 1.0]) == clipped


def test_width_shrinks_where_observed_and_stays_wide_elsewhere():
    model = LinearAcceptance(3)
    seen, unseen = [1.0, 1.0, 0.0], [1.0, 0.0, 1.0]
    before = model.width(seen)
    for _ in range(50):
        model.update(seen, 0.6)
    assert model.width(seen) < before / 5
    assert model.width(unseen) > 3 * model.width(seen)
    assert model.predict(seen) == pytest.approx(0.6, abs=0.02)


def test_weights_scale_an_observation():
    light, heavy = LinearAcceptance(2), LinearAcceptance(2)
    light.update([1.0, 0.0], 0.8, weight=0.1)
    heavy.update([1.0, 0.0], 0.8, weight=1.0)
    assert light.predict([1.0, 0.0]) < heavy.predict([1.0, 0.0])
    light.update([1.0, 0.0], 0.8, weight=0.0)   # no weight: no observation
    assert light.observations == pytest.approx(0.1)


def test_two_replicas_merge_to_the_model_of_all_observations():
    a, b, both = LinearAcceptance(2), LinearAcceptance(2), LinearAcceptance(2)
    for x, alpha in [([1.0, 0.2], 0.3), ([1.0, 0.9], 0.7)]:
        a.update(x, alpha)
        both.update(x, alpha)
    for x, alpha in [([1.0, 0.5], 0.5), ([1.0, 0.1], 0.2)]:
        b.update(x, alpha)
        both.update(x, alpha)
    merged = a.merged(b)
    assert np.allclose(merged.A, both.A) and np.allclose(merged.b, both.b)
    assert merged.observations == 4


def test_json_round_trip_and_checks():
    model = LinearAcceptance(3, ridge=0.5)
    model.update([1.0, 0.3, -0.2], 0.4)
    again = LinearAcceptance.from_dict(json.loads(json.dumps(model.to_dict())))
    assert again.predict([1.0, 0.1, 0.1]) == pytest.approx(model.predict([1.0, 0.1, 0.1]))
    assert again.width([1.0, 0.1, 0.1]) == pytest.approx(model.width([1.0, 0.1, 0.1]))
    bad = model.to_dict() | {"b": [0.0, 0.0]}
    with pytest.raises(ValueError, match="features"):
        LinearAcceptance.from_dict(bad)
    with pytest.raises(ValueError, match="length 2"):
        model.predict([1.0, 0.0])


def test_the_ridge_pulls_towards_the_prior_not_towards_zero():
    """Unobserved, a draft is predicted α₀; two unlucky prompts (α 0.2) move it towards them
    without pinning it near 0, so LinUCB's bonus can still bring it back (towards 0 it read 0.1)."""
    x = [1.0, 0.4, 0.7]
    cold = LinearAcceptance(3, prior_alpha=0.5)
    assert cold.predict(x) == 0.5 and cold.predict([1.0, 0.0, 0.0]) == 0.5
    towards_zero, towards_prior = LinearAcceptance(3), LinearAcceptance(3, prior_alpha=0.5)
    for model in (towards_zero, towards_prior):
        for _ in range(2):
            model.update(x, 0.2)
    assert towards_zero.predict(x) < 0.2 < towards_prior.predict(x) < 0.5
    for _ in range(200):   # with data, the prior fades
        towards_prior.update(x, 0.2)
    assert towards_prior.predict(x) == pytest.approx(0.2, abs=0.01)
    again = LinearAcceptance.from_dict(json.loads(json.dumps(towards_prior.to_dict())))
    assert again.predict(x) == pytest.approx(towards_prior.predict(x))
    legacy = {k: v for k, v in towards_zero.to_dict().items() if k != "prior_alpha"}   # published before the prior
    assert LinearAcceptance.from_dict(legacy).predict(x) == pytest.approx(towards_zero.predict(x))
    with pytest.raises(ValueError, match="prior"):
        towards_zero.merged(towards_prior)
