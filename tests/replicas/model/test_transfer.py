"""Host values reach the device with their values and dtype, and on CUDA without the host
waiting for the work queued there."""

import pytest
import torch

from device_reads import reads
from specserve.replicas.model.transfer import copy_in, sent
from tiny_models import DEVICE


def test_sent_values_arrive_with_their_dtype():
    assert sent([3, 1, 2], DEVICE, torch.long).tolist() == [3, 1, 2]
    assert sent([3, 1, 2], DEVICE, torch.long).dtype == torch.long
    host = torch.tensor([[0.5, -1.0], [2.0, 4.0]])
    out = sent(host, DEVICE)
    assert out.device.type == DEVICE.type and torch.equal(out.cpu(), host)
    assert sent(host > 0, DEVICE).dtype == torch.bool


def test_copy_in_fills_a_device_tensor_and_a_view_of_one():
    destination = torch.zeros(3, 4, dtype=torch.long, device=DEVICE)
    copy_in(destination, torch.arange(12).view(3, 4))
    copy_in(destination[:, 1:3], torch.full((3, 2), -1))   # a strided view
    want = torch.arange(12).view(3, 4)
    want[:, 1:3] = -1
    assert torch.equal(destination.cpu(), want)


def test_an_expanded_host_tensor_is_sent_and_copied_in():
    """A stride-0 view (``expand``) has fewer elements in memory than it shows: pinning it as it
    is laid out cannot hold it."""
    rows = torch.arange(3)[:, None].expand(3, 4)
    assert torch.equal(sent(rows, DEVICE).cpu(), rows)
    destination = torch.zeros(3, 4, dtype=torch.long, device=DEVICE)
    copy_in(destination, rows)
    assert torch.equal(destination.cpu(), rows)


@pytest.mark.skipif(not torch.cuda.is_available(), reason="a wait for the device is seen on CUDA only")
def test_nothing_waits_for_the_device():
    busy = torch.randn(2048, 2048, device="cuda")
    destination = torch.zeros(64, dtype=torch.long, device="cuda")

    def queued_then_sent():
        nonlocal busy
        for _ in range(4):
            busy = busy @ busy / 2048   # work queued ahead of the copies
        copy_in(destination, torch.arange(64))
        return sent(list(range(64)), torch.device("cuda"), torch.long)

    out, waits = reads(queued_then_sent, "cuda")
    assert waits == 0
    assert out.tolist() == destination.tolist() == list(range(64))
