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


@pytest.fixture(autouse=True)
def _healthcheck_state(tmp_path_factory, monkeypatch) -> None:
    """clusterpulse-healthcheck keeps the XIDs it judged in /var/lib/clusterpulse by
    default (healthstate): each test's checks, and the processes they start, keep them
    in a directory of their own instead of the machine's."""
    monkeypatch.setenv("CLUSTERPULSE_HEALTHCHECK_STATE",
                       str(tmp_path_factory.mktemp("healthcheck") / "healthcheck.json"))


def _has_nvidia_gpu() -> bool:
    smi = shutil.which("nvidia-smi")
    if not smi:
        return False
    try:
        return subprocess.run([smi, "-L"], capture_output=True, timeout=20).returncode == 0
    except (OSError, subprocess.TimeoutExpired):
        return False


def _file_order(items: list[pytest.Item]) -> dict[str, tuple[bool, bool, int]]:
    """Each test file's place in the run: files with a test marked slow first, then the
    other files that start processes, then the unit files, each by its number of tests,
    most first. scripts/test.sh runs two files at a time (xdist's --dist loadfile, its
    own reordering off): xdist's order, by number of tests alone, left the one-test
    files for last, the demo's ~200 s among them, and one worker idle beside it."""
    files: dict[str, list[pytest.Item]] = {}
    for item in items:
        files.setdefault(item.nodeid.split("::", 1)[0], []).append(item)
    return {f: (not any(i.get_closest_marker("slow") for i in its),
                f.startswith("tests/unit/"), -len(its)) for f, its in files.items()}


def pytest_collection_modifyitems(config, items):
    order = _file_order(items)
    items.sort(key=lambda item: order[item.nodeid.split("::", 1)[0]])  # stable: in-file order kept
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
