"""Host values sent to the device without waiting for it.

A copy to a GPU from ordinary (pageable) host memory waits for the work queued on the device
before it starts, so a step that sends a few indices midway waits for its own forward. From
page-locked (pinned) memory the copy is queued behind that work instead, and the host goes on.
torch keeps a pinned block alive until the copies queued from it are done. Off CUDA these are
plain copies.
"""

from __future__ import annotations

import torch


def sent(values, device: torch.device, dtype: torch.dtype | None = None) -> torch.Tensor:
    """``values`` (a list, or a tensor on the host) as a tensor on ``device``."""
    host = values if isinstance(values, torch.Tensor) else torch.tensor(values, dtype=dtype)
    if torch.device(device).type != "cuda":
        return host.to(device)
    # Contiguous first: pinning keeps a tensor's strides, and an expanded one (stride 0) cannot be
    # copied into pinned memory laid out like it.
    return host.contiguous().pin_memory().to(device, non_blocking=True)


def copy_in(destination: torch.Tensor, host: torch.Tensor) -> None:
    """``destination.copy_(host)`` for a tensor on the host."""
    if destination.device.type != "cuda":
        destination.copy_(host)
    else:
        destination.copy_(host.contiguous().pin_memory(), non_blocking=True)
