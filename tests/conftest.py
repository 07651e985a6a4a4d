import os
import sys
from pathlib import Path

# Tests never reach a model hub.
os.environ.setdefault("HF_HUB_OFFLINE", "1")
os.environ.setdefault("TRANSFORMERS_OFFLINE", "1")
# Ray 2.60 reads its authentication mode once, at import; the local cluster runs with tokens.
os.environ.setdefault("RAY_AUTH_MODE", "token")
# tests/ holds shared helpers (tiny_models.py) imported by plain name.
sys.path.insert(0, str(Path(__file__).parent))

import pytest
import torch


@pytest.fixture(autouse=True)
def _one_thread_for_tiny_models(request):
    """Tiny models run fastest on one thread; two threads only add OpenMP hand-offs (and, when
    anything else shares the machine, oversubscription stalls). The reference target keeps
    torch's default."""
    if request.node.get_closest_marker("reference"):
        yield
        return
    threads = torch.get_num_threads()
    torch.set_num_threads(1)
    yield
    torch.set_num_threads(threads)
