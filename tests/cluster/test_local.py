"""``specserve up`` / ``down`` from a process that keeps running afterwards (the test suite, a
notebook, ``bench soak`` against its own stack): leaving the cluster leaves nothing behind that
calls Ray again."""

from __future__ import annotations

import time

import pytest

from conftest import local_stack
from specserve.cluster.serve_config import app_serve_config, local_serve_config

pytestmark = [pytest.mark.reference, pytest.mark.slow, pytest.mark.e2e]

# Serve's handles push autoscaling metrics every 10 s (RAY_SERVE_HANDLE_AUTOSCALING_METRIC_PUSH_INTERVAL_S).
METRICS_PUSH_S = 10.0


def test_down_leaves_no_handle_that_starts_a_new_ray_cluster(tmp_path):
    """A deployment handle's router pushes metrics from a background thread; left running after
    ``down``, its next Ray call auto-started a fresh local cluster inside this process, which the
    next ``up`` joined (with too few CPUs for its replicas) and whose ``ray stop`` killed the
    process (the suite died mid-run with exit 1)."""
    import ray
    from ray import serve

    args = {**local_serve_config()["applications"][0]["args"], "dtype": "float32",
            "drafts": [{"name": "prompt-lookup"}]}
    with local_stack(app_serve_config(args), tmp_path / "home") as state:
        handle = serve.get_deployment_handle("target", state.app_name)
        assert handle.load.remote().result(timeout_s=120)["running"] == 0
    assert not ray.is_initialized()
    time.sleep(2.5 * METRICS_PUSH_S)
    assert not ray.is_initialized(), "something called Ray after down and started a new cluster in this process"
