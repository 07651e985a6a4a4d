"""The router's per-request features: repetition, perplexity, the model input vector, and the
target's prompt perplexity from the prefill (kept rows, no extra forward)."""

import math

import pytest
import torch

from specserve.replicas.target import Target
from specserve.router.features import PromptFeatures, perplexity_from_nll, prompt_features, repeat_rate
from tiny_models import tiny_model


def test_repeat_rate_counts_what_prompt_lookup_would_have_got_right():
    assert repeat_rate(list(range(50))) == 0.0                 # nothing repeats
    assert repeat_rate([1, 2, 3]) == 0.0                       # too short to look anything up
    block = list(range(10))
    assert repeat_rate(block * 4) == pytest.approx(27 / 37)    # each copy after the first, from its 4th token
    # The n-gram recurs but its continuation differs every time: prompt lookup would be wrong.
    assert repeat_rate([7, 8, 9, 1, 7, 8, 9, 2, 7, 8, 9, 3]) == 0.0


def test_perplexity_and_vector():
    assert perplexity_from_nll(0.0, 0) is None
    assert perplexity_from_nll(3 * math.log(4.0), 3) == pytest.approx(4.0)
    f = PromptFeatures(prompt_tokens=100, perplexity=None, repeat_rate=0.25, topics=(0.5, -0.5))
    v = f.vector()
    assert len(v) == len(PromptFeatures.names(2)) and v[0] == 1.0 and v[3] == 1.0   # bias; perplexity missing
    assert v[1] == pytest.approx(math.log(100) / 8) and v[4] == 0.25 and v[5] == 0.0 and v[6:] == (0.5, -0.5)
    measured = PromptFeatures(100, math.e ** 3, 0.0, (), constrained=True).vector(dims=3)
    assert measured[2] == pytest.approx(3 / 5) and measured[3] == 0.0 and measured[6:] == (0.0, 0.0, 0.0)
    assert measured[PromptFeatures.names(3).index("constrained")] == 1.0
    assert set(f.to_dict()) == {"prompt_tokens", "perplexity", "repeat_rate", "topics", "constrained"}
    assert len(prompt_features([1, 2, 3], None, dims=4).topics) == 4
    assert prompt_features([1, 2, 3], None, constrained=True).constrained


def test_prefill_scores_the_prompt_with_the_target_it_runs_anyway():
    model = tiny_model("llama", seed=0)
    prompt = [5, 6, 7, 8, 9, 10, 11, 12, 13, 14, 15, 16]
    with torch.inference_mode():
        logits = model(torch.tensor([prompt])).logits[0].float()
    logp = torch.log_softmax(logits, -1)
    want = -sum(float(logp[i, prompt[i + 1]]) for i in range(len(prompt) - 1))
    # One chunk: its rows predict prompt[1..]; the root (last token) comes as next_token.
    target = Target(model, slots=2)
    done = target.prefill(0, prompt[:-1], 64, prompt[-1], score_rows=64)
    assert (done.fed, done.left, done.scored) == (11, 0, 11)
    assert done.nll == pytest.approx(want, rel=1e-4)
    # In chunks of 4, scoring the last 2 rows of each: the same positions as scoring them all at once.
    target = Target(model, slots=2)
    total, scored, left = 0.0, [], 1
    while left:
        done = target.prefill(1, prompt[:-1], 4, prompt[-1], score_rows=2)
        total, left = total + done.nll, done.left
        scored.append(done.scored)
    assert scored == [2, 2, 2]
    rows = [2, 3, 6, 7, 9, 10]   # the last two rows of chunks [0..3], [4..7], [8..10]
    assert total == pytest.approx(-sum(float(logp[i, prompt[i + 1]]) for i in rows), rel=1e-4)
    # Without the next token the chunk's last row has nothing to score.
    target = Target(model, slots=1)
    assert target.prefill(0, prompt[:-1], 64, None, score_rows=64).scored == 10
