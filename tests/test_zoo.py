"""The zoo's training data: held out from every benchmark prompt, and the same batches from any
starting point (what makes a resumed run see exactly the batches it had not seen)."""

from itertools import islice

import pytest
import torch

from specserve.cluster.prompts import load_prompts
from specserve.cluster.zoo import batch_stream, recipe, training_conversations
from specserve.replicas.model_store import load_tokenizer_and_config

pytestmark = pytest.mark.reference


@pytest.fixture(scope="module")
def tokenizer():
    return load_tokenizer_and_config()[0]


def test_batches_from_any_start_are_the_continuation(tokenizer):
    batches = batch_stream(tokenizer, seq_len=64, batch=2)
    first_five = list(islice(batches(0), 5))
    assert all(ids.shape == (2, 64) and torch.equal(mask, torch.ones_like(ids)) for ids, mask in first_five)
    assert torch.equal(next(batches(3))[0], first_five[3][0])


def test_training_text_holds_out_the_benchmark_prompts():
    held_out = set(load_prompts("chat", 50)) | set(load_prompts("code", 20))
    seen = [m["content"] for messages in islice(training_conversations(), 2000) for m in messages]
    assert not held_out & set(seen)
    assert any("def " in text for text in seen), "HumanEval code is part of the mix"


def test_unknown_recipe_names_the_known_ones():
    with pytest.raises(ValueError, match="the zoo has: smollm2-draft-2l"):
        recipe("nope")
