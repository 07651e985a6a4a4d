"""Keep a replica's native memory flat under load: bounded kernel caches, free pages returned.

Every batch and prompt length is a new matrix shape, and on CPU in reduced precision torch
builds a oneDNN kernel per shape and keeps it: ideep's cache (``LRU_CACHE_CAPACITY``) and
oneDNN's primitive cache (``ONEDNN_PRIMITIVE_CACHE_CAPACITY``), 1024 entries each by default,
so a replica's memory grows with every new prompt length (float32 keeps nothing). Both caches
are bounded at 64 entries, because a kernel is cheap to build next to the forward that uses it
(figures: docs/benchmarks.md §7.2). ``bound_kernel_caches``
sets both before the first kernel is built (the variables are read once; a value already in
the environment wins).

glibc also keeps what torch frees in its arenas, fragmented; ``malloc_trim(0)`` returns every
whole free page of every arena. The replica calls it when it runs out of work, where its few
milliseconds cost no request anything. Elsewhere (macOS, musl) there is nothing to call.
"""

from __future__ import annotations

import ctypes
import ctypes.util
import functools
import os

KERNEL_CACHE_ENTRIES = 64
_KERNEL_CACHES = ("LRU_CACHE_CAPACITY", "ONEDNN_PRIMITIVE_CACHE_CAPACITY")


def bound_kernel_caches(entries: int = KERNEL_CACHE_ENTRIES) -> None:
    """Cap torch's per-shape CPU kernel caches (call before the first forward of the process)."""
    for variable in _KERNEL_CACHES:
        os.environ.setdefault(variable, str(entries))


@functools.cache
def _malloc_trim():
    name = ctypes.util.find_library("c")
    try:
        trim = ctypes.CDLL(name).malloc_trim if name else None
    except (OSError, AttributeError):   # not glibc
        return None
    if trim is not None:
        trim.argtypes, trim.restype = [ctypes.c_size_t], ctypes.c_int
    return trim


def release_free_memory() -> bool:
    """Trim every malloc arena; True when the allocator gave pages back."""
    trim = _malloc_trim()
    return bool(trim(0)) if trim is not None else False
