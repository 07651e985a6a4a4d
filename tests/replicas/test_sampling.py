import pytest
import torch

from specserve.replicas.sampling import SamplingParams, logits_to_probs


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
