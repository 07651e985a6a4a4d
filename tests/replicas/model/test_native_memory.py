"""Freed native memory goes back to the operating system (glibc's malloc_trim), measured on a
heap fragmented the way a replica's is: many mid-sized blocks, every other one freed."""

from __future__ import annotations

import ctypes
import ctypes.util
import sys

import psutil
import pytest
import torch

from specserve.replicas.model_store import bf16_is_fast
from specserve.replicas.model.native_memory import release_free_memory

BLOCK = 64 * 1024      # below glibc's mmap threshold: served from the heap, kept there when freed
BLOCKS = 3000


@pytest.mark.skipif(not sys.platform.startswith("linux") or ctypes.util.find_library("c") is None, reason="glibc only")
def test_a_fragmented_heap_gives_its_free_pages_back():
    libc = ctypes.CDLL(ctypes.util.find_library("c"))
    libc.malloc.restype, libc.malloc.argtypes = ctypes.c_void_p, [ctypes.c_size_t]
    libc.free.argtypes = [ctypes.c_void_p]
    process = psutil.Process()
    blocks = [libc.malloc(BLOCK) for _ in range(BLOCKS)]
    try:
        for block in blocks:
            ctypes.memset(block, 1, BLOCK)          # touched: resident
        for block in blocks[:-1:2]:
            libc.free(block)                        # holes between live blocks: no heap top to shrink
        before = process.memory_info().rss
        assert release_free_memory()
        given_back = before - process.memory_info().rss
        assert given_back > 0.5 * (BLOCKS // 2) * BLOCK, given_back
    finally:
        for block in blocks[1::2]:
            libc.free(block)


KERNEL_PROBE = r"""
import ctypes, json, sys
import torch
from specserve.replicas.model_store import REFERENCE_TARGET, load_causal_lm

class MallInfo2(ctypes.Structure):
    _fields_ = [(n, ctypes.c_size_t) for n in ("arena", "ordblks", "smblks", "hblks", "hblkhd", "usmblks",
                                               "fsmblks", "uordblks", "fordblks", "keepcost")]

libc = ctypes.CDLL(None)
libc.mallinfo2.restype = MallInfo2
torch.set_num_threads(1)
model = load_causal_lm(REFERENCE_TARGET, dtype="bfloat16").model
# Every layer has the same matrix shapes: two layers without the output layer make the same kind of
# new kernels, and keep the probe quick where bfloat16 is emulated.
model.model.layers = model.model.layers[:2]
model.config.num_hidden_layers = 2

def prefill(lengths):
    with torch.no_grad():
        for n in lengths:
            model.model(torch.randint(0, 1000, (1, n)), use_cache=False)
    return libc.mallinfo2().uordblks

first = prefill(range(8, 88))          # 80 new shapes: the caches are full
second = prefill(range(88, 168))       # 80 more new shapes
print(json.dumps({"growth_mb": (second - first) / 2**20}))
"""


@pytest.mark.reference
@pytest.mark.skipif(not sys.platform.startswith("linux"), reason="mallinfo2 is glibc's")
@pytest.mark.skipif(not bf16_is_fast(torch.device("cpu")),
                    reason="without native bfloat16 oneDNN keeps no per-shape bfloat16 kernels to bound")
@pytest.mark.slow
def test_new_shapes_do_not_pile_up_kernels_in_reduced_precision(tmp_path):
    """Each new matrix shape made torch keep ~2.8 MB of oneDNN kernels (bfloat16, CPU), 1024
    shapes per cache by default: a replica's memory crept up with every new prompt length.
    Loading a model bounds the caches, so 80 new shapes after the first 80 keep almost nothing
    (unbounded: ~220 MB)."""
    import json
    import os
    import subprocess

    env = {k: v for k, v in os.environ.items() if k not in ("LRU_CACHE_CAPACITY", "ONEDNN_PRIMITIVE_CACHE_CAPACITY")}
    result = subprocess.run([sys.executable, "-c", KERNEL_PROBE], capture_output=True, text=True, timeout=600, env=env)
    assert result.returncode == 0, result.stderr[-3000:]
    growth = json.loads(result.stdout.strip().splitlines()[-1])["growth_mb"]
    assert growth < 40, f"80 new shapes kept {growth:.0f} MB of native memory"
