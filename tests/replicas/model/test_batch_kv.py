"""The batched KV slots' moves: compacting a slot to the positions a tree verify accepted."""

import torch

from specserve.replicas.target import Target
from tiny_models import tiny_model


def test_keep_compacts_a_slot_to_its_accepted_positions_and_touches_nothing_else():
    target = Target(tiny_model("llama", seed=0), slots=2)
    target.prefill(0, list(range(3, 23)), chunk=64)
    target.prefill(1, list(range(3, 23)), chunk=64)
    kv = target.kv
    with torch.inference_mode():   # the buffers are inference tensors
        for layer in kv.cache.layers:
            for buf in layer.buffers:
                buf.copy_(torch.arange(buf.numel(), dtype=buf.dtype).view(buf.shape))
    before = [[buf.clone() for buf in layer.buffers] for layer in kv.cache.layers]
    positions = list(range(12)) + [12, 15, 17]   # the context, then a path that leaves the first nodes
    kv.keep(0, positions, list(range(15)))
    for layer, old in zip(kv.cache.layers, before):
        for buf, was in zip(layer.buffers, old):
            assert torch.equal(buf[0, :, :15], was[0][:, positions])
            assert torch.equal(buf[0, :, 15:], was[0, :, 15:])
            assert torch.equal(buf[1], was[1])
    assert kv.tokens[0] == list(range(15))
    kv.keep(1, list(range(14)), list(range(14)))   # everything in place: nothing moves
    for layer, old in zip(kv.cache.layers, before):
        for buf, was in zip(layer.buffers, old):
            assert torch.equal(buf[1], was[1])
