"""Shared fixtures: an in-process agent on loopback, with its HTTP server and its Unix
telemetry socket (in a short private directory: socket paths are limited to 107 bytes)."""

from __future__ import annotations

import atexit
import os
import shutil
import subprocess
import tempfile
from collections.abc import Iterator
from dataclasses import dataclass
from pathlib import Path
from typing import TYPE_CHECKING

import pytest

from clusterpulse.agent.audit import AuditLog
from clusterpulse.agent.backends.sim import SimBackend
from clusterpulse.agent.core import Agent
from clusterpulse.agent.ranks import RankRegistry
from clusterpulse.agent.server import make_server, serve_in_thread

if TYPE_CHECKING:  # imported where used: the GPU machine's python has no requests
    import requests

TOKEN = "test-token-0123456789abcdef"


def _has_nvidia_gpu() -> bool:
    smi = shutil.which("nvidia-smi")
    if not smi:
        return False
    try:
        return subprocess.run([smi, "-L"], capture_output=True, timeout=20).returncode == 0
    except (OSError, subprocess.TimeoutExpired):
        return False


def _long_files_first(items: list) -> None:
    """Order the files so that those of a few long tests start first, each file's tests
    in their own order. The test command runs two files at a time (pytest-xdist --dist
    loadfile --no-loadscope-reorder, scripts/test.sh) and hands the files out in this
    order as a worker frees up. xdist's own order, most tests first, left the files of
    one long test for last (the demo's faults, ~160 s; the testbed's eviction, 80 s):
    one worker ran them while the other had nothing left, ~3 minutes of the suite on a
    clean Debian, where the suite then ran past its 30 minutes. Now the files with a
    slow test go first (most slow tests first), then those that start real processes,
    then the rest, the many short files filling in at the end. The browser tests are not
    among the first: started beside the oldest torch's venv build (a CUDA build
    unpacked in the background), the Alerts page's table once never drew there."""
    files: dict[str, list] = {}
    for item in items:
        files.setdefault(item.nodeid.split("::", 1)[0], []).append(item)

    def cost(entry: tuple[int, tuple[str, list]]) -> tuple[int, int, int, int]:
        index, (_, of) = entry
        slow = sum(1 for item in of if item.get_closest_marker("slow"))
        browser = any(item.get_closest_marker("e2e") for item in of)
        procs = any(item.get_closest_marker(m) for item in of
                    for m in ("integration", "e2e", "cluster"))
        return (0 if slow and not browser else 1 if procs else 2), -slow, -len(of), index

    items[:] = [item for _, (_, of) in sorted(enumerate(files.items()), key=cost)
                for item in of]


def pytest_collection_modifyitems(config, items):
    _long_files_first(items)
    if _has_nvidia_gpu():
        return
    skip = pytest.mark.skip(reason="needs an NVIDIA GPU and driver (nvidia-smi -L failed)")
    for item in items:
        if "gpu" in item.keywords:
            item.add_marker(skip)


@dataclass
class RunningAgent:
    agent: Agent
    url: str
    telemetry: str  # what ranks pass as --agent: unix:/PATH
    token: str
    audit_path: Path

    @property
    def socket_path(self) -> str:
        return self.telemetry[len("unix:"):]

    def get(self, path: str, token: str | None = TOKEN, **kw) -> requests.Response:
        headers = {"Authorization": f"Bearer {token}"} if token else {}
        import requests

        return requests.get(self.url + path, headers=headers, timeout=5, **kw)

    def post(self, path: str, body: dict, token: str | None = TOKEN) -> requests.Response:
        headers = {"Authorization": f"Bearer {token}"} if token else {}
        import requests

        return requests.post(self.url + path, json=body, headers=headers, timeout=5)


def socket_path(name: str) -> str:
    """A telemetry socket path short enough for AF_UNIX, in a directory others may
    traverse (tests that drop privileges send from another uid)."""
    d = tempfile.mkdtemp(prefix="cp-", dir="/tmp")
    os.chmod(d, 0o755)
    atexit.register(shutil.rmtree, d, True)  # after the session: agents may still run
    return f"{d}/{name}.sock"


def start_agent(tmp_path: Path, gpus: int = 4, token: str | None = TOKEN,
                node: str = "node-a", interval_s: float = 0.2) -> tuple[RunningAgent, object]:
    ranks = RankRegistry(grace_s=60)
    backend = SimBackend(gpus=gpus, node=node, activity=ranks.activity)
    audit_path = tmp_path / f"{node}-audit.jsonl"
    agent = Agent(backend, node, ranks, AuditLog(audit_path), interval_s=interval_s,
                  telemetry_addr=socket_path(node))
    server = make_server(agent, "127.0.0.1", 0, token)
    agent.start()
    serve_in_thread(server)
    running = RunningAgent(agent, f"http://127.0.0.1:{server.server_port}",
                           agent.telemetry_address or "", token or "", audit_path)
    return running, server


@pytest.fixture
def sim_agent(tmp_path) -> Iterator[RunningAgent]:
    running, server = start_agent(tmp_path)
    yield running
    server.shutdown()
    running.agent.stop()
