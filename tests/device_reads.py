"""How often a call reads from its device, where each read makes the host wait for the device:
on CUDA the synchronisations torch's sync debug mode reports; elsewhere the reads a GPU would
wait on, counted (``tolist``, ``item``, ``bool``, ``int``, ``float`` of a tensor)."""

from __future__ import annotations

import warnings
from collections.abc import Callable
from typing import Any

import pytest
import torch

READS = ("tolist", "item", "__bool__", "__int__", "__float__")


def reads(run: Callable[[], Any], device: torch.device | str) -> tuple[Any, int]:
    """``run()``'s result and the reads it made from ``device``'s tensors (every tensor's, off CUDA)."""
    if torch.device(device).type == "cuda":
        torch.cuda.synchronize()
        torch.cuda.set_sync_debug_mode("warn")
        try:
            with warnings.catch_warnings(record=True) as seen:
                warnings.simplefilter("always")
                out = run()
        finally:
            torch.cuda.set_sync_debug_mode(0)
        return out, len([w for w in seen if "synchroniz" in str(w.message)])
    counted = [0]
    with pytest.MonkeyPatch.context() as patch:
        for name in READS:
            def read(self, *args, _read=getattr(torch.Tensor, name), **kwargs):
                counted[0] += 1
                return _read(self, *args, **kwargs)
            patch.setattr(torch.Tensor, name, read)
        out = run()
    return out, counted[0]
