import pytest
import torch

from specserve.replicas.sampling import NonFiniteScores, SamplingParams, logits_to_probs, sample


def test_greedy_is_one_hot_on_argmax():
    probs = logits_to_probs(torch.tensor([[0.1, 3.0, 2.9], [5.0, 0.0, 0.0]]), SamplingParams())
    assert probs.tolist() == [[0.0, 1.0, 0.0], [1.0, 0.0, 0.0]]


def test_temperature_one_is_softmax():
    logits = torch.tensor([1.0, 2.0, 3.0])
    torch.testing.assert_close(logits_to_probs(logits, SamplingParams(temperature=1.0)), logits.softmax(-1))


def test_top_k_keeps_k_largest():
    probs = logits_to_probs(torch.tensor([1.0, 4.0, 3.0, 2.0]), SamplingParams(temperature=1.0, top_k=2))
    assert probs[0] == 0 and probs[3] == 0
    # the survivors keep their relative odds: e^4 / e^3
    assert torch.isclose(probs[1] / probs[2], torch.tensor(2.718281828), rtol=1e-5)


def test_top_p_keeps_the_smallest_set_reaching_p():
    # probabilities 0.5, 0.3, 0.2: top_p=0.6 needs the first two (0.5 < 0.6 <= 0.8).
    logits = torch.tensor([0.5, 0.3, 0.2]).log()
    probs = logits_to_probs(logits, SamplingParams(temperature=1.0, top_p=0.6))
    torch.testing.assert_close(probs, torch.tensor([0.625, 0.375, 0.0]))


def test_top_p_always_keeps_the_top_token():
    probs = logits_to_probs(torch.tensor([9.0, 0.0, 0.0]), SamplingParams(temperature=1.0, top_p=0.01))
    assert probs.tolist() == [1.0, 0.0, 0.0]


@pytest.mark.parametrize("kwargs", [{"temperature": -1.0}, {"top_p": 0.0}, {"top_p": 1.5}, {"top_k": -2}])
def test_bad_parameters_are_refused(kwargs):
    with pytest.raises(ValueError, match=next(iter(kwargs))):
        SamplingParams(**kwargs)


# Temperatures the API admits (0 < T <= 2) down to float64's smallest subnormal: in float32
# 1e-45 is subnormal and 5e-324 is 0, and dividing raw logits by them overflows to ±inf / NaN.
TINY_TEMPERATURES = [1e-30, 1e-45, 1e-300, 5e-324]


@pytest.mark.parametrize("temperature", TINY_TEMPERATURES)
def test_a_tiny_temperature_samples_the_limit_not_nan(temperature):
    logits = torch.tensor([[1.0, 3.0, 2.0, -5.0], [4.0, 4.0, 0.0, 1.0]])
    probs = logits_to_probs(logits, SamplingParams(temperature=temperature, top_p=0.9, top_k=3))
    # As T -> 0 softmax(l / T) puts all mass on the maxima, shared equally between tied ones.
    assert probs.tolist() == [[0.0, 1.0, 0.0, 0.0], [0.5, 0.5, 0.0, 0.0]]
    assert sample(probs[0], torch.Generator().manual_seed(0)) == 1


@pytest.mark.parametrize("bad", [float("nan"), float("inf")])
def test_non_finite_logits_are_refused_not_sampled(bad):
    logits = torch.tensor([0.0, bad, 1.0])
    with pytest.raises(NonFiniteScores):
        logits_to_probs(logits, SamplingParams(temperature=0.7))


@pytest.mark.parametrize("probs", [[0.5, float("nan"), 0.5], [0.0, 0.0, 0.0], [1.5, -0.5, 0.0]])
def test_sample_refuses_what_is_not_a_distribution(probs):
    with pytest.raises(NonFiniteScores):
        sample(torch.tensor(probs), torch.Generator().manual_seed(0))


def test_a_top_p_below_float32s_smallest_keeps_the_top_token():
    # 1e-50 is 0 in float32: "mass before a token >= top_p" would drop even the first one.
    probs = logits_to_probs(torch.tensor([2.0, 1.0, 0.0]), SamplingParams(temperature=1.0, top_p=1e-50))
    assert probs.tolist() == [1.0, 0.0, 0.0]
