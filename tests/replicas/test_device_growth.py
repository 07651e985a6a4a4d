"""EAGLE-2's tree grown on the device (``device_growth``) is the host's ``TreeGrowth`` tree: the
same nodes in the same order, the same parents, q and root probabilities, level after level,
whether the budget or the depth ends it."""

import pytest
import torch

from specserve.replicas.drafts.device_growth import DeviceGrowth, level_sizes
from specserve.replicas.drafts.tree_growth import TreeGrowth
from specserve.replicas.step import TreeShape
from tiny_models import DEVICE

VOCAB = 300


@pytest.mark.parametrize("shape", [TreeShape(6, 10, 60), TreeShape(4, 3, 10), TreeShape(3, 10, 24),
                                   TreeShape(2, 4, 40), TreeShape(5, 1, 5), TreeShape(1, 8, 3)], ids=str)
def test_a_tree_grown_on_the_device_is_the_hosts(shape):
    generator = torch.Generator().manual_seed(shape.budget * 7 + shape.depth)
    host, device = TreeGrowth(shape), DeviceGrowth(shape, DEVICE)
    logits = torch.randn(1, VOCAB, generator=generator) * 3   # the root's row
    for level in range(shape.depth):
        if not host.growing:
            break
        first = host.grow(logits)
        assert device.grow(logits.to(DEVICE)) == (first, len(host.tokens) - first)
        if not host.more_levels(level):
            break
        assert device.more_levels
        logits = torch.randn(len(host.frontier), VOCAB, generator=generator) * 3   # the level's rows, scored
    assert not device.more_levels
    want, got = host.proposal(), device.proposal()
    assert (got.tokens, got.parents) == (want.tokens, want.parents)
    assert got.token_probs == pytest.approx(want.token_probs, rel=1e-6)
    assert got.root_probs == pytest.approx(want.root_probs, rel=1e-6)
    assert len(got.tokens) == sum(level_sizes(shape)) == min(shape.budget, shape.depth * shape.top_k)


def test_the_lineage_marks_each_node_and_its_ancestors():
    shape = TreeShape(4, 3, 10)
    device = DeviceGrowth(shape, DEVICE)
    generator = torch.Generator().manual_seed(5)
    rows = 1
    while device.more_levels:
        _, rows = device.grow(torch.randn(rows, VOCAB, generator=generator).to(DEVICE))
    parents = device.proposal().parents
    for i in range(len(parents)):
        want, node = torch.zeros(2 * shape.budget, dtype=torch.bool), i
        while node >= 0:
            want[node] = True
            node = parents[node]
        assert torch.equal(device.lineage[i].cpu(), want), i


def test_level_sizes_and_trees_that_grow_on_the_host():
    assert level_sizes(TreeShape(6, 10, 60)) == [10] * 6
    assert level_sizes(TreeShape(3, 10, 24)) == [10, 10, 4]
    assert level_sizes(TreeShape(4, 4, 2)) == [2]
    for shape in (TreeShape(4, 4, 20, width_decay=True), TreeShape(4, 4, 20, threshold=0.1)):
        assert not DeviceGrowth.grows(shape)
        with pytest.raises(ValueError, match="on the host"):
            DeviceGrowth(shape, DEVICE)
