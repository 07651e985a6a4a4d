"""A Prometheus server that scrapes the Ray cluster's metrics, for ``specserve up --prometheus``.

Ray writes the address of every node's metrics agent to a service-discovery file in its temp
folder (``prom_metrics_service_discovery.json``, updated as nodes join and leave); Prometheus
reads it through ``file_sd_configs``, so every node's metrics, specserve's own
(``ray_specserve_*``) among them, are scraped without a list of hosts. The binary is
``prometheus`` on PATH (Debian's package). Ray's dashboard is pointed at it with
``RAY_PROMETHEUS_HOST`` when ``specserve up`` starts Ray, and the Grafana dashboard in
``deploy/grafana/`` reads exactly these series.
"""

from __future__ import annotations

import shutil
import subprocess
import time
from dataclasses import dataclass
from pathlib import Path

import httpx
import yaml

from specserve.cluster.processes import stop_pid
from specserve.cluster.redis_server import free_port

SERVICE_DISCOVERY_FILE = "prom_metrics_service_discovery.json"   # in Ray's temp folder, on the head node
SCRAPE_INTERVAL_S = 5.0


def prometheus_binary() -> str:
    found = shutil.which("prometheus")
    if found:
        return found
    raise FileNotFoundError("no prometheus binary: install Debian's prometheus package (`apt-get install prometheus`) "
                            "or run a Prometheus of your own with Ray's service-discovery file "
                            f"(<ray temp dir>/{SERVICE_DISCOVERY_FILE})")


def scrape_config(service_discovery: Path, interval_s: float = SCRAPE_INTERVAL_S) -> dict:
    """Prometheus's configuration: Ray's nodes, found through Ray's service-discovery file."""
    return {
        "global": {"scrape_interval": f"{interval_s:g}s", "evaluation_interval": f"{interval_s:g}s"},
        "scrape_configs": [{"job_name": "ray", "file_sd_configs": [{"files": [str(service_discovery)]}]}],
    }


@dataclass
class PrometheusServer:
    url: str
    pid: int

    @classmethod
    def start(cls, work_dir: Path, service_discovery: Path, port: int | None = None,
              interval_s: float = SCRAPE_INTERVAL_S, timeout_s: float = 60.0) -> "PrometheusServer":
        port = port or free_port()
        work_dir.mkdir(parents=True, exist_ok=True)
        config = work_dir / "prometheus.yml"
        config.write_text(yaml.safe_dump(scrape_config(service_discovery, interval_s)))
        log = work_dir / f"prometheus-{port}.log"
        with open(log, "ab") as out:   # the child keeps its own handle
            proc = subprocess.Popen(
                [prometheus_binary(), f"--config.file={config}", f"--storage.tsdb.path={work_dir / 'prometheus-data'}",
                 "--storage.tsdb.retention.time=2d", f"--web.listen-address=127.0.0.1:{port}"],
                stdout=out, stderr=subprocess.STDOUT, start_new_session=True,   # outlives the CLI that started it
            )
        server = cls(url=f"http://127.0.0.1:{port}", pid=proc.pid)
        deadline = time.monotonic() + timeout_s
        while not server.ready():
            if proc.poll() is not None or time.monotonic() > deadline:
                server.stop()
                raise RuntimeError(f"prometheus did not start on port {port}; see {log}")
            time.sleep(0.1)
        return server

    def ready(self) -> bool:
        try:
            return httpx.get(self.url + "/-/ready", timeout=2.0).status_code == 200
        except httpx.HTTPError:
            return False

    def query(self, promql: str, timeout_s: float = 10.0) -> list[dict]:
        """An instant query's result vector (``/api/v1/query``); raises on a query Prometheus refuses."""
        response = httpx.get(self.url + "/api/v1/query", params={"query": promql}, timeout=timeout_s)
        body = response.json()
        if body.get("status") != "success":
            raise ValueError(f"prometheus refused {promql!r}: {body.get('error')}")
        return body["data"]["result"]

    def stop(self, timeout_s: float = 10.0) -> None:
        stop_pid(self.pid, timeout_s)
