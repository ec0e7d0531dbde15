"""A fleet of N nodes x G GPUs, a training rank on every GPU, served from one process
tree: for the fleet benchmark (up to 16,384 GPUs) and the sharded-scrape test.

One real simulated agent, with G ranks that have sent it the telemetry a training loop
sends (steps, loss, straggler score, checkpoints, collectives, heartbeats), renders its
/metrics once; every node then serves that exposition with its own node name, GPU UUIDs
and global rank numbers, the ranks grouped into runs of `run_nodes` nodes. Running
2,048 live agents would take the shared benchmark machine's CPU from the very thing
being measured (the scrapers, the store, the rules, the dashboard); the series, labels
and sizes are the agent's own. The values do not change from one scrape to the next
(what that leaves out: docs/benchmarks.md).

Each node has its own address, as agents on real nodes do: node i listens on
`node_address(i)` (127.100.x.y: all of 127.0.0.0/8 is the loopback interface on Linux),
every node on the same port, /metrics and /metrics/progress. A scraper that shards
targets by `__address__` (deploy/victoriametrics/vmagent.yml) then spreads them as it
would spread real nodes.
Bodies are gzipped once (scrapers ask for gzip), served by asyncio with HTTP keep-alive
from several processes sharing each socket (SO_REUSEPORT). Prints the node count when
ready; stops when stdin closes.

    python -m tests.bench.fleet_static NODES GPUS PORT [RUN_NODES]
"""

from __future__ import annotations

import asyncio
import gzip
import os
import re
import resource
import signal
import sys
import time

from prometheus_client import CollectorRegistry, generate_latest

from clusterpulse.agent import protocol
from clusterpulse.agent.audit import AuditLog
from clusterpulse.agent.backends.sim import SimBackend
from clusterpulse.agent.core import Agent
from clusterpulse.agent.exporter import AgentCollector, ProgressCollector
from clusterpulse.agent.identity import Sender, start_time
from clusterpulse.agent.ranks import RankRegistry

TEMPLATE_NODE, TEMPLATE_RUN = "TEMPLATENODE", "TEMPLATERUN"
WORKERS = 2  # the benchmark machine has 2 cores; scrapes are ~0.1 ms of work each
STEPS = 12   # steps each template rank reports (the agent's step-interval p99 needs some)
_RANK = re.compile(rb'(?<=[{,])rank="(\d+)"')  # not local_rank


def node_address(i: int) -> str:
    """Node i's loopback address: 250 nodes per /24, from 127.100.0.1."""
    return f"127.100.{i // 250}.{i % 250 + 1}"


def _step(rank: int, step: int, world: int) -> dict:
    """One step's telemetry as the trainer's instrumentation sends it (trainer/instrument.py
    and its straggler scorer, checkpointing and collective counting)."""
    now = time.time()
    return {"v": protocol.VERSION, "type": "step", "run": TEMPLATE_RUN, "rank": rank,
            "local_rank": rank, "gpu": rank, "world_size": world, "step": step,
            "step_seconds": 0.41 + 0.001 * rank, "compute_seconds": 0.33 + 0.002 * rank,
            "sync_wait_seconds": 0.06, "data_wait_seconds": 0.004, "comm_seconds": 0.05,
            "comm_bytes": 2.5e8, "loss": 2.1 - 0.01 * step,
            "samples_total": 8.0 * step, "tokens_total": 32768.0 * step,
            "straggler_score": 1.0 + 0.003 * rank, "straggler_self_score": 1.0,
            "straggler_flagged": 0.0, "memory_bytes": 6.0e10,
            "checkpoint_step": 0.0, "checkpoint_timestamp_seconds": now - 60,
            "checkpoint_blocking_seconds": 0.8, "checkpoint_in_progress": 0.0,
            "checkpoint_failures_total": 0.0, "goodput_ratio": 0.97,
            "collectives_entered_total": 40.0 * step, "collectives_completed_total": 40.0 * step}


def template(gpus: int, world: int) -> dict[bytes, str]:
    """One node's exposition by path (/metrics, and /metrics/progress, the ranks'
    progress alone, as the agent serves it): G simulated GPUs, a rank on each that has
    made STEPS steps and sent a heartbeat. The ranks' sender is this process, as the
    kernel names it, so that the agent exports them as alive (a real rank's socket is
    verified the same way)."""
    clock = [time.monotonic()]  # steps 0.41 s apart, as _step reports them
    ranks = RankRegistry(clock=lambda: clock[0])
    agent = Agent(SimBackend(gpus=gpus, node=TEMPLATE_NODE, activity=ranks.activity),
                  TEMPLATE_NODE, ranks, AuditLog(None), interval_s=5)
    me = Sender(pid=os.getpid(), uid=os.getuid(), gid=os.getgid(),
                start_time=start_time(os.getpid()) or 0, verified=True)
    def heartbeat(r: int, step: int) -> None:
        agent.handle_datagram(protocol.encode({
            "v": protocol.VERSION, "type": "heartbeat", "run": TEMPLATE_RUN, "rank": r,
            "step": step, "phase": "forward_backward", "phase_seconds": 0.2,
            "collectives_entered_total": 40.0 * step,
            "collectives_completed_total": 40.0 * step}), None, me)

    for r in range(gpus):
        heartbeat(r, 0)  # past start-up: the agent measures step intervals from here
    for step in range(1, STEPS + 1):
        for r in range(gpus):
            agent.handle_datagram(protocol.encode(_step(r, step, world)), None, me)
        clock[0] += 0.41
    for r in range(gpus):
        heartbeat(r, STEPS)
    clock[0] -= 0.2  # the last step ended 0.2 s ago (its heartbeat age)
    agent.collect_once()
    out = {}
    for path, collector in ((b"/metrics", AgentCollector(agent)),
                            (b"/metrics/progress", ProgressCollector(agent))):
        registry = CollectorRegistry(auto_describe=False)
        registry.register(collector)
        out[path] = generate_latest(registry).decode()
    return out


def pages(nodes: int, gpus: int, run_nodes: int) -> dict[str, dict[bytes, bytes]]:
    """Each node's gzipped pages (by path) by its address: node i is `nNNNN`, its GPUs'
    UUIDs carry its number, its ranks are i*G.. of run `job-NNN` (runs of `run_nodes`
    nodes; rank numbers count within the run)."""
    texts = {path: text.encode() for path, text in template(gpus, run_nodes * gpus).items()}
    out: dict[str, dict[bytes, bytes]] = {}
    for i in range(nodes):
        base = (i % run_nodes) * gpus
        for path, text in texts.items():
            body = (text.replace(TEMPLATE_NODE.encode(), f"n{i:04d}".encode())
                    .replace(b'uuid="GPU-', f'uuid="GPU-{i:04d}-'.encode())
                    .replace(TEMPLATE_RUN.encode(), f"job-{i // run_nodes:03d}".encode()))
            body = _RANK.sub(lambda m, b=base: b'rank="%d"' % (b + int(m.group(1))), body)
            out.setdefault(node_address(i), {})[path] = gzip.compress(body, 1)
    return out


async def serve(port: int, bodies: dict[str, dict[bytes, bytes]], ready: int) -> None:
    async def handle(reader: asyncio.StreamReader, writer: asyncio.StreamWriter) -> None:
        paths = bodies.get(writer.get_extra_info("sockname")[0], {})
        try:
            while True:
                head = await reader.readuntil(b"\r\n\r\n")
                body = paths.get(head.split(b" ", 2)[1].split(b"?", 1)[0])
                if body is None:
                    writer.write(b"HTTP/1.1 404 Not Found\r\nContent-Length: 0\r\n\r\n")
                else:
                    writer.write(b"HTTP/1.1 200 OK\r\nContent-Type: text/plain; version=0.0.4"
                                 b"\r\nContent-Encoding: gzip\r\nContent-Length: "
                                 + str(len(body)).encode() + b"\r\n\r\n" + body)
                await writer.drain()
        except (asyncio.IncompleteReadError, asyncio.LimitOverrunError, ConnectionError,
                IndexError):
            pass
        finally:
            writer.close()

    server = await asyncio.start_server(handle, list(bodies), port, reuse_port=True,
                                        backlog=256)
    os.write(ready, b"1")
    os.close(ready)
    async with server:
        await server.serve_forever()


def main(nodes: int, gpus: int, port: int, run_nodes: int) -> None:
    # One listening socket per node and worker: 2,048 nodes need more than the usual 1,024.
    soft, hard = resource.getrlimit(resource.RLIMIT_NOFILE)
    want = WORKERS * nodes + 4096
    if soft < want:
        resource.setrlimit(resource.RLIMIT_NOFILE, (min(want, hard), hard))
    bodies = pages(nodes, gpus, run_nodes)
    children = []
    ready_r, ready_w = os.pipe()
    for _ in range(WORKERS):
        pid = os.fork()
        if pid == 0:
            os.setsid()
            sys.stdin.close()
            os.close(ready_r)
            asyncio.run(serve(port, bodies, ready_w))
            os._exit(0)
        children.append(pid)
    os.close(ready_w)
    started = b""
    while len(started) < WORKERS:  # every worker listens on every address
        got = os.read(ready_r, WORKERS)
        if not got:
            raise SystemExit("a fleet worker failed to start")
        started += got
    print(len(bodies), flush=True)
    try:
        sys.stdin.read()
    finally:
        for pid in children:
            os.kill(pid, signal.SIGTERM)
        for pid in children:
            os.waitpid(pid, 0)


if __name__ == "__main__":
    main(int(sys.argv[1]), int(sys.argv[2]), int(sys.argv[3]),
         int(sys.argv[4]) if len(sys.argv) > 4 else 128)
