"""KVSession: tree forwards equal sequential decoding, and cache surgery equals recompute."""

import pytest
import torch
from transformers import AutoModelForCausalLM, Qwen2Config

from specserve.replicas.model.kv_session import TREE_NODE, KVSession
from tiny_models import ARCHITECTURES, tiny_config, tiny_model

PROMPT = [3, 17, 42, 8, 8, 61, 5]


def sequential_logits(model, tokens: list[int]) -> torch.Tensor:
    """Last-position logits of a fresh, cache-free forward: the ground truth."""
    with torch.inference_mode():
        return model(torch.tensor([tokens], device=model.device)).logits[0, -1]


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
    from specserve.replicas.model.kv_cache import preallocated_cache

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


def decoder_layers(model) -> torch.nn.ModuleList:
    base = model.base_model
    return base.layers if hasattr(base, "layers") else base.h   # llama, qwen2 / gpt2


def fail_once_before(layer: torch.nn.Module) -> None:
    """The next forward raises on reaching ``layer``: the decoder layers before it have appended
    to the cache, the rest have not (what an out-of-memory in a late layer leaves)."""
    def hook(module, args):
        handle.remove()
        raise RuntimeError("injected failure")
    handle = layer.register_forward_pre_hook(hook)


def feed(session: KVSession, how: str, tokens: list[int]) -> None:
    if how == "extend":
        session.extend(tokens, logits_rows=1)
    else:   # a tree of one chain: same cache writes through the tree-attention path
        session.extend_tree(tokens, list(range(-1, len(tokens) - 1)))


# Before the last decoder layer the cache is left ragged (the next call crashes, or worse);
# before the output layer every layer holds 3 orphaned positions and the next call would
# silently attend to them.
FAIL_AT = {"last layer": lambda model: decoder_layers(model)[-1], "lm head": lambda model: model.lm_head}


@pytest.mark.parametrize("fail_at", FAIL_AT)
@pytest.mark.parametrize("how", ["extend", "extend_tree"])
@pytest.mark.parametrize("arch", ARCHITECTURES)
def test_a_forward_that_fails_midway_leaves_the_cache_as_it_was(arch, how, fail_at):
    model = tiny_model(arch, seed=0)
    session = KVSession(model)
    session.extend(PROMPT, logits_rows=1)
    fail_once_before(FAIL_AT[fail_at](model))
    with pytest.raises(RuntimeError, match="injected failure"):
        feed(session, how, [1, 2, 3])
    assert session.tokens == PROMPT
    assert [layer.get_seq_length() for layer in session.cache.layers] == [len(PROMPT)] * len(session.cache.layers)
    fresh = KVSession(model)
    fresh.extend(PROMPT, logits_rows=1)
    torch.testing.assert_close(session.extend([20, 21], logits_rows=2), fresh.extend([20, 21], logits_rows=2))


def test_a_failed_forward_on_layers_that_cannot_crop_resets_the_session():
    # A sliding-window layer cannot drop positions it may or may not have appended: the session
    # starts over, and sync() then rebuilds the whole context, as on a replica without the cache.
    config = Qwen2Config(**{**tiny_config("qwen2").to_dict(), "use_sliding_window": True, "sliding_window": 4,
                            "layer_types": ["full_attention", "sliding_attention"]})
    torch.manual_seed(0)
    model = AutoModelForCausalLM.from_config(config, dtype=torch.float32).eval()
    session = KVSession(model)
    session.extend(PROMPT, logits_rows=1)
    fail_once_before(decoder_layers(model)[-1])
    with pytest.raises(RuntimeError, match="injected failure"):
        session.extend([1, 2, 3], logits_rows=1)
    assert session.tokens == [] and session.cache.get_seq_length() == 0
    missing = session.sync(PROMPT + [20])
    assert missing == PROMPT + [20]
    torch.testing.assert_close(session.extend(missing, logits_rows=1)[-1], sequential_logits(model, PROMPT + [20]),
                               atol=1e-4, rtol=1e-4)
