"""A fleet of N nodes x G GPUs behind one port, for the 16,384-GPU benchmark.

One real simulated agent renders its /metrics once; every node `nNNNN` then serves that
exposition with its own node name (and GPU UUIDs) at `/nNNNN/metrics`. Running 2,048
live agents would take the shared benchmark machine's CPU from the very thing being
measured (Prometheus and the dashboard); the series, labels and sizes are the agent's
own. Prints the node count when ready; stops when stdin closes.

    python -m tests.bench.fleet_static NODES GPUS PORT
"""

from __future__ import annotations

import sys
import threading
from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer

from prometheus_client import CollectorRegistry, generate_latest

from agent.audit import AuditLog
from agent.backends.sim import SimBackend
from agent.core import Agent
from agent.exporter import AgentCollector
from agent.ranks import RankRegistry

TEMPLATE_NODE = "TEMPLATENODE"


def template(gpus: int) -> str:
    ranks = RankRegistry()
    agent = Agent(SimBackend(gpus=gpus, node=TEMPLATE_NODE, activity=ranks.activity),
                  TEMPLATE_NODE, ranks, AuditLog(None), interval_s=5)
    agent.collect_once()
    registry = CollectorRegistry(auto_describe=False)
    registry.register(AgentCollector(agent))
    return generate_latest(registry).decode()


def main(nodes: int, gpus: int, port: int) -> None:
    text = template(gpus)
    pages = {f"/n{i:04d}/metrics": text.replace(TEMPLATE_NODE, f"n{i:04d}")
             .replace('uuid="GPU-', f'uuid="GPU-{i:04d}-').encode() for i in range(nodes)}

    class Handler(BaseHTTPRequestHandler):
        def do_GET(self) -> None:
            body = pages.get(self.path)
            if body is None:
                self.send_error(404)
                return
            self.send_response(200)
            self.send_header("Content-Type", "text/plain; version=0.0.4")
            self.send_header("Content-Length", str(len(body)))
            self.end_headers()
            self.wfile.write(body)

        def log_message(self, *args) -> None:
            pass

    server = ThreadingHTTPServer(("127.0.0.1", port), Handler)
    server.daemon_threads = True
    threading.Thread(target=server.serve_forever, daemon=True).start()
    print(len(pages), flush=True)
    sys.stdin.read()
    server.shutdown()


if __name__ == "__main__":
    main(int(sys.argv[1]), int(sys.argv[2]), int(sys.argv[3]))
