"""A draft as its own Ray Serve deployment: a ``DraftServer`` behind a Serve handle.

Kept apart from ``draft_server.py`` so that the in-process engine, the tests and the benchmarks
build draft servers without importing Ray.
"""

from ray import serve

from specserve.replicas.draft_server import DraftServer

# Half a CPU: a draft replica waits on its target's steps most of the time; a GPU deployment asks
# for its device in the Serve config's ``ray_actor_options``.
DraftDeployment = serve.deployment(
    ray_actor_options={"num_cpus": 0.5}, max_ongoing_requests=64, health_check_period_s=10
)(DraftServer)
