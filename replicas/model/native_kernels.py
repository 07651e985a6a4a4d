"""Small C kernels (``replicas/model/kernels/*.c``), compiled once per machine and loaded with ctypes.

Each source is built with the C compiler found on PATH (``cc``, or ``$CC``) as
``cc -O3 -march=native -fopenmp`` into ``~/.cache/specserve/kernels`` (``SPECSERVE_KERNEL_CACHE``
to change it), named by the source's hash and the CPU's flags, since it is built for the CPU it
runs on. Without a compiler ``load`` returns None (logged once per kernel) and callers keep
torch's path: the kernels are an optimisation, never a requirement.
"""

from __future__ import annotations

import ctypes
import hashlib
import logging
import os
import platform
import shutil
import subprocess
import tempfile
import threading
from pathlib import Path

logger = logging.getLogger("ray.serve")

SOURCES = Path(__file__).with_name("kernels")
CACHE_DIR = Path(os.environ.get("SPECSERVE_KERNEL_CACHE", Path.home() / ".cache" / "specserve" / "kernels")).expanduser()

_lock = threading.Lock()
_loaded: dict[str, ctypes.CDLL | None] = {}


def _cpu_flags() -> str:
    try:
        for line in Path("/proc/cpuinfo").read_text().splitlines():
            if line.startswith("flags"):
                return line
    except OSError:
        pass
    return platform.processor()


def _build(name: str, signatures: dict[str, list]) -> ctypes.CDLL:
    source_path = SOURCES / f"{name}.c"
    # The headers it may include count too: a changed header must rebuild every kernel.
    source = source_path.read_bytes() + b"".join(h.read_bytes() for h in sorted(SOURCES.glob("*.h")))
    key = hashlib.sha256(source + _cpu_flags().encode() + platform.machine().encode()).hexdigest()[:16]
    path = CACHE_DIR / f"{name}-{key}.so"
    if not path.exists():
        compiler = shutil.which(os.environ.get("CC", "cc")) or shutil.which("gcc")
        if compiler is None:
            raise RuntimeError("no C compiler (cc or gcc) on PATH")
        CACHE_DIR.mkdir(parents=True, exist_ok=True)
        # Built beside the target and renamed: replicas starting together never load half a file.
        with tempfile.TemporaryDirectory(dir=CACHE_DIR) as tmp:
            partial = Path(tmp) / path.name
            subprocess.run([compiler, "-O3", "-march=native", "-fopenmp", "-shared", "-fPIC", "-o", str(partial),
                            str(source_path)], check=True, capture_output=True, timeout=120)
            os.replace(partial, path)
    library = ctypes.CDLL(str(path))
    for function, argtypes in signatures.items():
        getattr(library, function).argtypes = argtypes
    return library


def load(name: str, signatures: dict[str, list], what: str) -> ctypes.CDLL | None:
    """``kernels/<name>.c`` compiled for this machine, its functions typed by ``signatures``;
    None where it cannot be built (``what`` names the torch path kept, for the warning)."""
    if name not in _loaded:
        with _lock:
            if name not in _loaded:
                try:
                    _loaded[name] = _build(name, signatures)
                except (OSError, RuntimeError, subprocess.SubprocessError) as err:
                    detail = (getattr(err, "stderr", b"") or b"").decode(errors="replace")[:500]
                    logger.warning("the C kernel %s is not available (%s: %s %s); %s", name, type(err).__name__,
                                   err, detail, what)
                    _loaded[name] = None
    return _loaded[name]
