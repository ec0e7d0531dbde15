"""The cluster page over 128 simulated nodes x 8 GPUs (1,024 GPUs) in a real
Prometheus: render time, PromQL queries per refresh, and Prometheus load with 1 vs
10 viewers, side by side with the same page without the shared cache."""

from __future__ import annotations

import os
import subprocess
import sys
import tempfile
import time
from pathlib import Path

import requests
from streamlit.testing.v1 import AppTest

from tests.bench.table import Row
from tests.support.pages import kpis
from tests.support.ports import free_port
from tests.support.procs import REPO, RULE_FILES, Prometheus, wait_until

NODES, GPUS = 128, 8


def _prom_queries(prom: Prometheus) -> float:
    """Query requests Prometheus has served, from its own /metrics (not a query)."""
    text = requests.get(prom.url + "/metrics", timeout=5).text
    return sum(float(line.rsplit(" ", 1)[1]) for line in text.splitlines()
               if line.startswith("prometheus_http_requests_total{")
               and ('handler="/api/v1/query"' in line or 'handler="/api/v1/query_range"' in line))


def _view(at_path: str) -> tuple[float, AppTest]:
    at = AppTest.from_file(at_path, default_timeout=120)
    t0 = time.perf_counter()
    at.run()
    assert not at.exception, at.exception
    return time.perf_counter() - t0, at


def run() -> list[Row]:
    from clusterpulse.dashboard import data

    fleet = subprocess.Popen([sys.executable, "-m", "tests.bench.fleet", str(NODES), str(GPUS)],
                             cwd=REPO, stdin=subprocess.PIPE, stdout=subprocess.PIPE, text=True)
    targets = fleet.stdout.readline().split()
    with tempfile.TemporaryDirectory() as tmp:
        rules = list(RULE_FILES)
        prom = Prometheus(Path(tmp), targets, rule_files=rules, scrape_interval="5s")
        try:
            wait_until(lambda: len(prom.query("clusterpulse_gpu_up")) == NODES * GPUS, 120,
                       "1,024 GPUs scraped")
            os.environ["CLUSTERPULSE_PROMETHEUS_URL"] = prom.url
            os.environ["CLUSTERPULSE_ALERTMANAGER_URL"] = f"http://127.0.0.1:{free_port()}"
            app = str(REPO / "dashboard" / "app.py")
            data.cluster.clear()
            cold, at = _view(app)
            metrics = kpis(at)
            assert metrics["Healthy GPUs"] == f"{NODES * GPUS} / {NODES * GPUS}", metrics
            queries = data.cluster(prom.url, os.environ["CLUSTERPULSE_ALERTMANAGER_URL"],
                                   "utilization").value["queries"]
            warm, _ = _view(app)
            load = {}
            for shared in (True, False):
                for viewers in (1, 10):
                    data.cluster.clear()
                    before = _prom_queries(prom)
                    for _ in range(viewers):
                        if not shared:
                            data.cluster.clear()  # every viewer fetches for itself
                        _view(app)
                    load[(shared, viewers)] = _prom_queries(prom) - before
        finally:
            prom.stop()
            fleet.stdin.close()
            fleet.wait()
    return [
        Row("cluster page, 1,024 GPUs: render, cold cache", cold, "s", budget="< 2 s"),
        Row("cluster page, 1,024 GPUs: render, shared cache", warm, "s", baseline=cold,
            baseline_name="cold cache"),
        Row("PromQL queries per refresh (+1 Alertmanager call)", queries, "queries"),
        Row("Prometheus queries, 1 viewer", load[(True, 1)], "queries",
            baseline=load[(False, 1)], baseline_name="no shared cache"),
        Row("Prometheus queries, 10 viewers in one refresh", load[(True, 10)], "queries",
            baseline=load[(False, 10)], baseline_name="no shared cache"),
    ]
