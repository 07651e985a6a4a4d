"""KVSession: tree forwards equal sequential decoding, and cache surgery equals recompute."""

import pytest
import torch

from specserve.replicas.kv_session import TREE_NODE, KVSession
from tiny_models import ARCHITECTURES, tiny_model

PROMPT = [3, 17, 42, 8, 8, 61, 5]


def sequential_logits(model, tokens: list[int]) -> torch.Tensor:
    """Last-position logits of a fresh, cache-free forward: the ground truth."""
    with torch.inference_mode():
        return model(torch.tensor([tokens])).logits[0, -1]


@pytest.mark.parametrize("arch", ARCHITECTURES)
def test_tree_logits_equal_each_path_decoded_alone(arch):
    model = tiny_model(arch, seed=0)
    session = KVSession(model)
    session.extend(PROMPT, logits_rows=1)
    # root children 10, 11; 10 -> 12 -> 13; 11 -> 14
    tokens, parents = [10, 11, 12, 13, 14], [-1, -1, 0, 2, 1]
    logits = session.extend_tree(tokens, parents)
    assert session.tokens[len(PROMPT):] == [TREE_NODE] * 5
    for i in range(len(tokens)):
        path, node = [], i
        while node >= 0:
            path.insert(0, tokens[node])
            node = parents[node]
        torch.testing.assert_close(logits[i], sequential_logits(model, PROMPT + path), atol=1e-4, rtol=1e-4)


@pytest.mark.parametrize("arch", ARCHITECTURES)
def test_keep_compacts_to_a_path_that_decodes_on_correctly(arch):
    model = tiny_model(arch, seed=0)
    session = KVSession(model)
    session.extend(PROMPT, logits_rows=1)
    tokens, parents = [10, 11, 12, 13, 14], [-1, -1, 0, 2, 1]
    session.extend_tree(tokens, parents)
    base = len(PROMPT)
    session.keep(list(range(base)) + [base + 1, base + 4], PROMPT + [11, 14])   # path 11 -> 14
    nxt = session.extend([20], logits_rows=1)[-1]
    torch.testing.assert_close(nxt, sequential_logits(model, PROMPT + [11, 14, 20]), atol=1e-4, rtol=1e-4)


def test_sync_rolls_back_to_the_common_prefix_and_rebuilds_the_rest():
    model = tiny_model("llama", seed=0)
    session = KVSession(model)
    session.extend(PROMPT + [1, 2, 3], logits_rows=1)
    missing = session.sync(PROMPT + [1, 9])
    assert missing == [9] and session.tokens == PROMPT + [1]
    assert session.cache.get_seq_length() == len(PROMPT) + 1
    logits = session.extend(missing, logits_rows=1)[-1]
    torch.testing.assert_close(logits, sequential_logits(model, PROMPT + [1, 9]), atol=1e-4, rtol=1e-4)


def test_a_fresh_session_rebuilds_from_tokens_alone():
    # What a replica without the request's cache does: everything is "missing".
    session = KVSession(tiny_model("qwen2", seed=0))
    assert session.sync(PROMPT) == PROMPT


def test_crop_to_zero_resets():
    session = KVSession(tiny_model("llama", seed=0))
    session.extend(PROMPT, logits_rows=1)
    session.crop(0)
    assert session.tokens == [] and session.cache.get_seq_length() == 0


def test_preallocated_cache_grows_past_its_capacity():
    from specserve.replicas.kv_cache import preallocated_cache

    model = tiny_model("llama", seed=0)
    session = KVSession(model)
    session.cache = preallocated_cache(model.config, capacity=4)
    tokens = PROMPT + [1, 2, 3, 4, 5, 6]
    for tok in tokens[:-1]:       # one token at a time: several doublings
        session.extend([tok], logits_rows=1)
    session.crop(5)               # and a rollback past a growth point
    logits = session.extend(tokens[5:], logits_rows=1)[-1]
    assert session.cache.layers[0].capacity >= len(tokens)
    torch.testing.assert_close(logits, sequential_logits(model, tokens), atol=1e-4, rtol=1e-4)
