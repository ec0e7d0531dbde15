"""A fleet of N nodes x G GPUs behind one port, for the 16,384-GPU benchmark.

One real simulated agent renders its /metrics once; every node `nNNNN` then serves that
exposition with its own node name (and GPU UUIDs) at `/nNNNN/metrics`. Running 2,048
live agents would take the shared benchmark machine's CPU from the very thing being
measured (Prometheus and the dashboard); the series, labels and sizes are the agent's
own. Bodies are gzipped once (Prometheus asks for gzip), served by asyncio with HTTP
keep-alive from several processes sharing the port (SO_REUSEPORT). Prints the node
count when ready; stops when stdin closes.

    python -m tests.bench.fleet_static NODES GPUS PORT
"""

from __future__ import annotations

import asyncio
import gzip
import os
import signal
import sys

from prometheus_client import CollectorRegistry, generate_latest

from clusterpulse.agent.audit import AuditLog
from clusterpulse.agent.backends.sim import SimBackend
from clusterpulse.agent.core import Agent
from clusterpulse.agent.exporter import AgentCollector
from clusterpulse.agent.ranks import RankRegistry

TEMPLATE_NODE = "TEMPLATENODE"
WORKERS = 4


def template(gpus: int) -> str:
    ranks = RankRegistry()
    agent = Agent(SimBackend(gpus=gpus, node=TEMPLATE_NODE, activity=ranks.activity),
                  TEMPLATE_NODE, ranks, AuditLog(None), interval_s=5)
    agent.collect_once()
    registry = CollectorRegistry(auto_describe=False)
    registry.register(AgentCollector(agent))
    return generate_latest(registry).decode()


def pages(nodes: int, gpus: int) -> dict[bytes, bytes]:
    text = template(gpus)
    return {f"/n{i:04d}/metrics".encode(): gzip.compress(
        text.replace(TEMPLATE_NODE, f"n{i:04d}").replace('uuid="GPU-', f'uuid="GPU-{i:04d}-')
        .encode(), 1) for i in range(nodes)}


async def serve(port: int, bodies: dict[bytes, bytes]) -> None:
    async def handle(reader: asyncio.StreamReader, writer: asyncio.StreamWriter) -> None:
        try:
            while True:
                head = await reader.readuntil(b"\r\n\r\n")
                path = head.split(b" ", 2)[1]
                body = bodies.get(path)
                if body is None:
                    writer.write(b"HTTP/1.1 404 Not Found\r\nContent-Length: 0\r\n\r\n")
                else:
                    writer.write(b"HTTP/1.1 200 OK\r\nContent-Type: text/plain; version=0.0.4"
                                 b"\r\nContent-Encoding: gzip\r\nContent-Length: "
                                 + str(len(body)).encode() + b"\r\n\r\n" + body)
                await writer.drain()
        except (asyncio.IncompleteReadError, ConnectionError, IndexError):
            pass
        finally:
            writer.close()

    server = await asyncio.start_server(handle, "127.0.0.1", port, reuse_port=True,
                                        backlog=4096)
    async with server:
        await server.serve_forever()


def main(nodes: int, gpus: int, port: int) -> None:
    bodies = pages(nodes, gpus)
    children = []
    for _ in range(WORKERS):
        pid = os.fork()
        if pid == 0:
            os.setsid()
            sys.stdin.close()
            asyncio.run(serve(port, bodies))
            os._exit(0)
        children.append(pid)
    print(len(bodies), flush=True)
    try:
        sys.stdin.read()
    finally:
        for pid in children:
            os.kill(pid, signal.SIGTERM)
        for pid in children:
            os.waitpid(pid, 0)


if __name__ == "__main__":
    main(int(sys.argv[1]), int(sys.argv[2]), int(sys.argv[3]))
