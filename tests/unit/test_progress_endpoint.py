"""/metrics/progress: hang detection's evidence alone, for a 1 s scrape beside the 5 s
one (docs/detection.md, Hang latency). It must carry every series the hang rules read,
the same values as /metrics, nothing else (a 1 s scrape of every GPU series is what
it avoids), and ages as of the request, not of the last collection cycle."""

from __future__ import annotations

import itertools
import time

import requests
from prometheus_client.parser import text_string_to_metric_families

from clusterpulse.agent.exporter import PROGRESS_FAMILIES
from tests.support.ranksock import RankProcess

HEARTBEAT = {"type": "heartbeat", "run": "r1", "rank": 0, "local_rank": 0, "gpu": 0,
             "world_size": 2, "phase": "sync", "collective": "all_reduce",
             "collectives_entered_total": 7, "collectives_completed_total": 6}


def _samples(url: str) -> dict[tuple, float]:
    body = requests.get(url, timeout=5).text
    return {(s.name, tuple(sorted(s.labels.items()))): s.value
            for fam in text_string_to_metric_families(body) for s in fam.samples}


def test_progress_carries_the_hang_evidence_and_nothing_else(sim_agent):
    with RankProcess(sim_agent.socket_path,
                     [{"type": "step", "run": "r1", "rank": 0, "local_rank": 0, "gpu": 0,
                       "world_size": 2, "step": 3, "step_seconds": 0.1}, HEARTBEAT]):
        progress = _samples(sim_agent.url + "/metrics/progress")
        names = {name for name, _ in progress}
        assert names == set(PROGRESS_FAMILIES), names  # the hang rules' every input
        full = _samples(sim_agent.url + "/metrics")
        assert any(name == "clusterpulse_gpu_up" for name, _ in full)
        for key, value in progress.items():
            if key[0] not in ("clusterpulse_trainer_heartbeat_age_seconds",  # they grow
                              "clusterpulse_agent_telemetry_receive_lag_seconds"):
                assert full[key] == value, key
        by_name = {name: (dict(labels), v) for (name, labels), v in progress.items()}
        assert by_name["clusterpulse_trainer_collectives_entered_total"][1] == 7
        labels, seq = by_name["clusterpulse_trainer_blocked_collective"]
        assert (labels["op"], seq) == ("all_reduce", 7)  # waits in its 7th collective
        assert by_name["clusterpulse_trainer_process_alive"][1] == 1


def test_progress_ages_are_as_of_the_request(sim_agent):
    """/metrics renders once a collection cycle or second; this path at each request,
    so a 1 s scrape never reads an age a second old."""
    with RankProcess(sim_agent.socket_path, [HEARTBEAT]):
        key = ("clusterpulse_trainer_heartbeat_age_seconds",)
        ages = []
        for _ in range(4):
            (age,) = [v for (n, _), v in _samples(sim_agent.url + "/metrics/progress").items()
                      if (n,) == key]
            ages.append(age)
            time.sleep(0.15)
        assert all(b > a for a, b in itertools.pairwise(ages)), ages
