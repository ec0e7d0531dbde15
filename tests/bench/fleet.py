"""A simulated fleet for the dashboard benchmark: N nodes x G simulated GPUs, each node
its own agent and HTTP server (its own scrape target) in this one process."""

from __future__ import annotations

import sys
import threading

from clusterpulse.agent.audit import AuditLog
from clusterpulse.agent.backends.sim import SimBackend
from clusterpulse.agent.core import Agent
from clusterpulse.agent.ranks import RankRegistry
from clusterpulse.agent.server import make_server


def main(nodes: int, gpus: int) -> None:
    servers = []
    agents = []
    for i in range(nodes):
        ranks = RankRegistry()
        agent = Agent(SimBackend(gpus=gpus, node=f"n{i:03d}", activity=ranks.activity),
                      f"n{i:03d}", ranks, AuditLog(None), interval_s=5)
        agent.start()
        server = make_server(agent, "127.0.0.1", 0, None)
        threading.Thread(target=server.serve_forever, daemon=True).start()
        servers.append(server)
        agents.append(agent)
    print(" ".join(f"127.0.0.1:{s.server_port}" for s in servers), flush=True)
    sys.stdin.read()


if __name__ == "__main__":
    main(int(sys.argv[1]), int(sys.argv[2]))
