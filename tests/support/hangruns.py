"""Two ranks of one run driven over the agent's telemetry socket, that can hang: rank 1
stops stepping (alive, heartbeating, stuck in its compute) while rank 0 enters the next
collective and waits there, the hang RankHung names. Used by the hang-latency benchmark
(tests/bench/bench_hang_engines.py) and the shipped-scrape test."""

from __future__ import annotations

import socket
import time

from clusterpulse.agent import protocol

STEP_S = 0.2


class Run:
    """Two ranks of one run, each on its own connection to the agent (their sender is
    this process: alive)."""

    def __init__(self, path: str, name: str) -> None:
        self.name, self.step = name, 0
        self.hang, self.last_step_at = False, 0.0
        self.socks = []
        for _ in range(2):
            s = socket.socket(socket.AF_UNIX, socket.SOCK_SEQPACKET)
            s.connect(path)
            self.socks.append(s)

    def _send(self, rank: int, msg: dict) -> None:
        self.socks[rank].send(protocol.encode({
            "v": protocol.VERSION, "run": self.name, "rank": rank, "local_rank": rank,
            "gpu": rank, "world_size": 2, **msg}))

    def tick(self) -> None:
        """One step of both ranks; once hung, rank 0 waits in the collective rank 1
        never entered, both still heartbeating."""
        if not self.hang:
            self.step += 1
            for r in range(2):
                self._send(r, {"type": "step", "step": self.step, "step_seconds": STEP_S,
                               "compute_seconds": 0.15, "sync_wait_seconds": 0.03,
                               "data_wait_seconds": 0.01,
                               "collectives_entered_total": 2.0 * self.step,
                               "collectives_completed_total": 2.0 * self.step,
                               "straggler_score": 1.0, "straggler_flagged": 0.0})
                self._send(r, {"type": "heartbeat", "step": self.step,
                               "phase": "forward_backward", "phase_seconds": 0.1,
                               "collectives_entered_total": 2.0 * self.step,
                               "collectives_completed_total": 2.0 * self.step})
            self.last_step_at = time.time()
            return
        waited = time.time() - self.last_step_at
        self._send(0, {"type": "heartbeat", "step": self.step, "phase": "sync",
                       "phase_seconds": waited, "collective": "all_reduce",
                       "collectives_entered_total": 2.0 * self.step + 1,
                       "collectives_completed_total": 2.0 * self.step})
        self._send(1, {"type": "heartbeat", "step": self.step, "phase": "forward_backward",
                       "phase_seconds": waited,
                       "collectives_entered_total": 2.0 * self.step,
                       "collectives_completed_total": 2.0 * self.step})


def firing_runs(alerts: list[dict]) -> set[str]:
    return {a["labels"].get("run") for a in alerts
            if a["labels"].get("alertname", a.get("name")) == "RankHung"
            and a.get("state") == "firing"}
