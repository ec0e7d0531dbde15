"""A stuck NVML call must be visible: /metrics keeps answering (the scrape never
waits on NVML) while the age of the last successful collection grows."""

from __future__ import annotations

import threading

from prometheus_client.parser import text_string_to_metric_families

from clusterpulse.agent.audit import AuditLog
from clusterpulse.agent.backends.nvml import NvmlBackend
from clusterpulse.agent.core import Agent
from clusterpulse.agent.ranks import RankRegistry
from clusterpulse.agent.server import make_server, serve_in_thread
from tests.fakes.fake_pynvml import FakeNvml
from tests.support.procs import wait_until


def _scrape(url: str) -> dict[str, float]:
    import requests

    body = requests.get(url + "/metrics", timeout=5).text
    return {f"{s.name}{{{s.labels.get('gpu', '')}}}": s.value
            for fam in text_string_to_metric_families(body) for s in fam.samples}


def test_collection_age_grows_while_nvml_is_stuck_and_metrics_keep_serving(tmp_path):
    fake = FakeNvml(gpus=2)
    agent = Agent(NvmlBackend(nvml=fake), "node-s", RankRegistry(), AuditLog(None),
                  interval_s=0.1)
    server = make_server(agent, "127.0.0.1", 0, None)
    agent.start()
    serve_in_thread(server)
    url = f"http://127.0.0.1:{server.server_port}"
    fake.stuck = threading.Event()
    try:
        first = _scrape(url)
        assert first["clusterpulse_gpu_up{0}"] == 1.0
        # Collection is now blocked inside NVML; the age must pass several intervals
        # while every scrape still answers with the last known GPU data.
        later = wait_until(
            lambda: (m := _scrape(url))["clusterpulse_agent_collection_age_seconds{}"] > 2.0
            and m, 60, "collection age growing past 2 s")
        assert later["clusterpulse_gpu_up{0}"] == 1.0
        fake.stuck.set()
        wait_until(lambda: _scrape(url)["clusterpulse_agent_collection_age_seconds{}"] < 1.0,
                   60, "collection age back to fresh once NVML answers")
    finally:
        fake.stuck.set()
        server.shutdown()
        agent.stop()
