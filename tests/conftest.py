import contextlib
import json
import os
import subprocess
import sys
import time
from collections.abc import Callable
from pathlib import Path

# Tests never reach a model hub.
os.environ.setdefault("HF_HUB_OFFLINE", "1")
os.environ.setdefault("TRANSFORMERS_OFFLINE", "1")
# Ray 2.60 reads its authentication mode once, at import; the local cluster runs with tokens.
os.environ.setdefault("RAY_AUTH_MODE", "token")
# tests/ holds shared helpers (tiny_models.py) imported by plain name.
sys.path.insert(0, str(Path(__file__).parent))
# Under pytest-xdist each worker has one core's share: one OpenMP thread in this process (before
# torch starts its pool) and in what it spawns, or the workers' teams stall each other at every barrier.
XDIST_WORKER = "PYTEST_XDIST_WORKER" in os.environ
if XDIST_WORKER:
    os.environ["OMP_NUM_THREADS"] = "1"

import pytest
import torch


E2E_TESTS = Path(__file__).parent / "e2e"


@pytest.hookimpl(tryfirst=True)
def pytest_collection_modifyitems(config, items):
    """Every test under tests/e2e/ starts a real Ray cluster and Serve application: mark it
    ``e2e`` here (before ``-m`` deselects), so ``-m "not e2e"`` leaves the fast tests."""
    for item in items:
        if E2E_TESTS in item.path.parents:
            item.add_marker(pytest.mark.e2e)


# pytest's exit status, kept for ``pytest_unconfigure``.
_exit_status: list[int] = []


@pytest.hookimpl(trylast=True)
def pytest_sessionfinish(session, exitstatus):
    _exit_status.append(int(exitstatus))


@pytest.hookimpl(trylast=True)
def pytest_unconfigure(config):
    """End the test process with pytest's own exit status once everything is reported, without
    the interpreter's finalisation. A full run leaves native state behind it: idle model threads
    each with its own OpenMP team, the C kernels loaded through ctypes, Ray's and gRPC's client
    threads. One clean-clone run of the full suite (619 passed) then died at exit with SIGSEGV
    (status 139), after the summary was printed and every fixture had torn down; the run before
    it, on nearly the same tree, exited 0. Nothing is left to test or report at this point."""
    if _exit_status:
        sys.stdout.flush()
        sys.stderr.flush()
        os._exit(_exit_status[-1])


@pytest.fixture(autouse=True)
def _one_thread_for_tiny_models(request):
    """Tiny models run fastest on one thread; two threads only add OpenMP hand-offs (and, when
    anything else shares the machine, oversubscription stalls). The reference target keeps
    torch's default, except in a pytest-xdist worker."""
    if request.node.get_closest_marker("reference") and not XDIST_WORKER:
        yield
        return
    threads = torch.get_num_threads()
    torch.set_num_threads(1)
    yield
    torch.set_num_threads(threads)


def wait_until(fetch: Callable[[], object], done: Callable[[object], bool] = bool, timeout: float = 60.0,
               interval: float = 0.05):
    """Call ``fetch`` every ``interval`` s until ``done`` says yes to what it returned, or until
    ``timeout`` s have passed; return the last value either way, for the test to assert on (so the
    failure shows what was seen, not only that time ran out)."""
    deadline = time.monotonic() + timeout
    while True:
        value = fetch()
        if done(value) or time.monotonic() >= deadline:
            return value
        time.sleep(interval)


@contextlib.contextmanager
def local_stack(config: dict, home: Path, timeout_s: float = 900, **up_options):
    """``specserve up`` with the Serve ``config`` on free ports: a real local Ray cluster, a real
    redis-server and the application, healthy; ``specserve down`` when the block ends, which stops
    exactly what ``up`` started (``up_options``: the rest of ``up``'s options). Its state file lives in ``home`` (``SPECSERVE_HOME``), which
    stays set while the block runs (the CLI finds the stack through it)."""
    from specserve.cluster import local
    from specserve.cluster.redis_server import free_port

    previous = os.environ.get("SPECSERVE_HOME")
    os.environ["SPECSERVE_HOME"] = str(home)
    try:
        yield local.up(config, http_port=free_port(), grpc_port=free_port(), timeout_s=timeout_s, **up_options)
    finally:
        local.down()
        if previous is None:
            os.environ.pop("SPECSERVE_HOME", None)
        else:
            os.environ["SPECSERVE_HOME"] = previous


def first_layers_draft(engine, folder: Path, layers: int = 2) -> Path:
    """A real-weights draft LM saved to ``folder``: the reference target's first ``layers`` layers
    (with its embeddings, norm and head) and its tokenizer."""
    full = engine.loaded.model
    config = full.config.__class__.from_dict({**full.config.to_dict(), "num_hidden_layers": layers})
    small = type(full)(config).eval()
    small.load_state_dict(full.state_dict(), strict=False)
    small.save_pretrained(folder)
    engine.tokenizer.save_pretrained(folder)
    return folder


def run_without_a_compiler(code: str, tmp_path: Path) -> list[str]:
    """What ``code`` prints, run in a fresh interpreter that finds no C compiler and an empty
    kernel cache (the C kernels' fallback to torch)."""
    env = {**os.environ, "CC": "no-such-compiler", "PATH": str(tmp_path), "SPECSERVE_KERNEL_CACHE": str(tmp_path / "kernels")}
    out = subprocess.run([sys.executable, "-c", code], env=env, capture_output=True, text=True, timeout=120)
    assert out.returncode == 0, out.stderr[-2000:]
    return out.stdout.split()


def stream_chat(url: str, body: dict, headers: dict | None = None, on_first: Callable[[], object] | None = None,
                timeout: float = 300) -> tuple[list[int], dict | None, dict | None]:
    """(token ids, the last chunk's spec, an in-band error) of one streamed chat request;
    ``on_first`` is called when the first token arrives (not just the role chunk)."""
    import httpx

    ids, spec, error = [], None, None
    with httpx.stream("POST", url + "/v1/chat/completions", json={**body, "stream": True}, headers=headers,
                      timeout=timeout) as response:
        assert response.status_code == 200, response.read()
        for line in response.iter_lines():
            if not line.startswith("data: ") or line == "data: [DONE]":
                continue
            chunk = json.loads(line[6:])
            if "error" in chunk:
                error = chunk["error"]
                continue
            choice = chunk["choices"][0] if chunk["choices"] else {}
            ids.extend(choice.get("token_ids", []))
            if ids and on_first is not None:
                on_first()
                on_first = None
            if choice.get("finish_reason"):
                spec = chunk.get("spec")
    return ids, spec, error
