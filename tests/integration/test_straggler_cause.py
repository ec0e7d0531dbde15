"""A straggler's cause against a real Prometheus with the project's rules: a GPU slows
down just after the 15 s per-GPU evidence pass, as the CI run that paged a thermal
straggler as "compute" had it. The alert must fire once, naming the GPU's cause.

The agent is a real one in this process (simulated GPUs, its HTTP server); its ranks'
telemetry is fed as the trainer sends it, so the straggler score is set here and the
test decides the moment the GPU and the rank slow down together.
"""

from __future__ import annotations

import threading
import time

import pytest
import requests

from clusterpulse.agent import protocol
from clusterpulse.agent.audit import AuditLog
from clusterpulse.agent.backends.sim import SimBackend
from clusterpulse.agent.core import Agent
from clusterpulse.agent.faults import Fault
from clusterpulse.agent.ranks import RankRegistry
from clusterpulse.agent.server import make_server
from tests.support.procs import RULE_FILES, Prometheus, wait_until

pytestmark = [pytest.mark.integration, pytest.mark.slow]


def _last_gpu_pass(prom: Prometheus) -> str:
    groups = requests.get(prom.url + "/api/v1/rules", timeout=5).json()["data"]["groups"]
    return next(g["lastEvaluation"] for g in groups if g["name"] == "clusterpulse-gpu-recording")


def test_a_gpu_that_slows_just_after_the_evidence_pass_pages_with_its_cause(tmp_path):
    ranks = RankRegistry()
    backend = SimBackend(gpus=2, node="n1", activity=ranks.activity)
    agent = Agent(backend, "n1", ranks, AuditLog(None), interval_s=0.5)
    agent.start()
    server = make_server(agent, "127.0.0.1", 0, None)
    threading.Thread(target=server.serve_forever, daemon=True).start()
    prom = Prometheus(tmp_path, [f"127.0.0.1:{server.server_port}"], rule_files=list(RULE_FILES))
    score = {0: 1.0, 1: 1.0}
    stop = threading.Event()

    def train() -> None:  # two ranks stepping every 0.25 s, as the trainer reports
        step = 0
        while not stop.wait(0.25):
            step += 1
            for rank in (0, 1):
                agent.handle_datagram(protocol.encode({
                    "type": "step", "run": "r", "rank": rank, "local_rank": rank, "gpu": rank,
                    "world_size": 2, "pid": 100 + rank, "step": step, "step_seconds": 0.25,
                    "compute_seconds": 0.2 * score[rank], "sync_wait_seconds": 0.01,
                    "data_wait_seconds": 0.0, "straggler_score": score[rank],
                    "straggler_flagged": int(score[rank] > 1.1)}), None)

    feeder = threading.Thread(target=train, daemon=True)
    feeder.start()
    try:
        wait_until(lambda: len(prom.query("clusterpulse:rank_straggler_cause")) == 2, 60,
                   "both ranks' cause recorded")
        before = _last_gpu_pass(prom)
        wait_until(lambda: _last_gpu_pass(prom) != before, 30, "a per-GPU evidence pass",
                   interval=0.1)
        # Right after it: the GPU's power brake engages and its rank slows at once.
        backend.inject(Fault(kind="power_brake", gpu=1))
        score[1] = 1.4
        seen: set[tuple[str, str]] = set()

        def firing() -> list[dict]:
            alerts = prom.query('ALERTS{alertname="TrainingStraggler"}')
            seen.update((a["metric"]["alertstate"], a["metric"]["cause"]) for a in alerts)
            return [a for a in alerts if a["metric"]["alertstate"] == "firing"]

        (alert,) = wait_until(firing, 40, "TrainingStraggler firing", interval=0.2)
        time.sleep(2)
        firing()
        assert alert["metric"]["rank"] == "1" and alert["metric"]["gpu"] == "1"
        assert alert["metric"]["cause"] == "power_brake", seen
        assert ("firing", "compute") not in seen, seen
    finally:
        stop.set()
        feeder.join(timeout=5)
        prom.stop()
        server.shutdown()
        agent.stop()
