"""The central half of a ClusterPulse deployment on one machine, shared by the loopback
demo (deploy/local/cluster.py) and the multi-node testbed (deploy/testbed/cluster.py):
processes that stop together, Prometheus with the project's rules, Alertmanager with the
project's routing, and the remediation policy receiver.
"""

from __future__ import annotations

import base64
import contextlib
import itertools
import json
import os
import re
import secrets
import shutil
import signal
import socket
import subprocess
import sys
import time
import urllib.request
from collections.abc import Sequence
from dataclasses import dataclass
from pathlib import Path

from clusterpulse.agent.tokens import write_secret
from clusterpulse.trainer.torchrun import port_below_ephemeral

HERE = Path(__file__).resolve().parent
REPO = HERE.parents[1]


class Stack:
    """Processes started in order and stopped in reverse order, all of them. Processes
    started with `watch=False` may die (a fault does that) without failing `check`."""

    def __init__(self, state: Path) -> None:
        self.state = state
        self.procs: list[tuple[str, subprocess.Popen, bool]] = []

    def start(self, name: str, args: Sequence[str], env: dict | None = None,
              watch: bool = True) -> subprocess.Popen:
        log = open(self.state / f"{name}.log", "ab")  # noqa: SIM115 - closed with the process
        try:
            p = subprocess.Popen(list(args), stdout=log, stderr=subprocess.STDOUT, cwd=REPO,
                                 stdin=subprocess.DEVNULL, env={**os.environ, **(env or {})},
                                 start_new_session=True)
        finally:
            log.close()
        self.procs.append((name, p, watch))
        return p

    def check(self) -> str | None:
        for name, p, watch in self.procs:
            if watch and p.poll() is not None:
                return f"{name} exited with code {p.returncode}; see {self.state / name}.log"
        return None

    def stop(self) -> None:
        """SIGTERM each process group, wait, SIGKILL what is left; then SIGKILL every
        descendant still alive (torchrun starts its workers in sessions of their own,
        and a stopped, hung worker outlives a torchrun killed before it could reap it)."""
        family = descendants([p.pid for _, p, _ in self.procs if p.poll() is None])
        for _name, p, _ in reversed(self.procs):
            if p.poll() is None:
                with contextlib.suppress(ProcessLookupError):
                    os.killpg(p.pid, signal.SIGTERM)
        deadline = time.time() + 15
        for _name, p, _ in reversed(self.procs):
            try:
                p.wait(timeout=max(0.1, deadline - time.time()))
            except subprocess.TimeoutExpired:
                with contextlib.suppress(ProcessLookupError):
                    os.killpg(p.pid, signal.SIGKILL)
                p.wait()
        for pid in family:
            with contextlib.suppress(ProcessLookupError):
                os.kill(pid, signal.SIGKILL)


def _children() -> dict[int, list[int]]:
    """Each living process's children (from /proc's parent links)."""
    children: dict[int, list[int]] = {}
    for entry in Path("/proc").iterdir():
        if entry.name.isdigit():
            with contextlib.suppress(OSError, IndexError, ValueError):
                ppid = int((entry / "stat").read_text().rsplit(")", 1)[1].split()[1])
                children.setdefault(ppid, []).append(int(entry.name))
    return children


def descendants(roots: list[int]) -> list[int]:
    """Every living descendant of `roots`."""
    children = _children()
    out, todo = [], list(roots)
    while todo:
        for child in children.get(todo.pop(), []):
            out.append(child)
            todo.append(child)
    return out


def _argv(pid: int) -> list[bytes]:
    try:
        return (Path("/proc") / str(pid) / "cmdline").read_bytes().split(b"\0")
    except OSError:
        return []


def _module(argv: list[bytes]) -> bytes | None:
    """The module a Python command line runs: its first `-m` (torchrun's own command
    line names the trainer module too, after its own)."""
    return next((b for a, b in itertools.pairwise(argv) if a == b"-m"), None)


# torchrun itself, and as clusterpulse-train starts it (trainer/torchrun.py, warmstart/)
TORCHRUNS = {b"torch.distributed.run", b"clusterpulse.trainer.torchrun",
             b"clusterpulse.trainer.warmstart"}


def rank_pids(roots: list[int]) -> list[int]:
    """The training ranks at or under `roots` (launchers, torchruns): the children of
    each torchrun, or, where ranks start warm (trainer/warmstart/), the children of
    its forkserver, whose command line they carry; not the other helpers
    multiprocessing starts for torchrun (the resource tracker)."""
    children = _children()
    tree = [*roots, *descendants(roots)]
    out = []
    for torchrun in (p for p in tree if _module(_argv(p)) in TORCHRUNS):
        for child in children.get(torchrun, []):
            cmd = b" ".join(_argv(child))
            if b"multiprocessing.forkserver" in cmd:
                out += children.get(child, [])
            elif b"from multiprocessing." not in cmd:
                out.append(child)
    return sorted(out)


def duration_s(text: str) -> float:
    """A one-unit Prometheus duration (500ms, 2s, 1m) in seconds."""
    m = re.fullmatch(r"(\d+)(ms|s|m)", text)
    if not m:
        raise ValueError(f"expected a duration such as 500ms, 2s or 1m, got {text!r}")
    return int(m[1]) * {"ms": 0.001, "s": 1.0, "m": 60.0}[m[2]]


# Where free_port looks: below the kernel's ephemeral range (an outgoing connection can
# take an ephemeral port between its choice and its bind; CI lost an agent's start so)
# and below 20000-29999, where the tests give each local cluster its 100-port block.
SERVICE_PORTS = (10000, 19999)


def free_port(kind: int = socket.SOCK_STREAM) -> int:
    """A port free now, for a server about to be told to listen on it: the central
    services of concurrent demo runs, the testbed's, the tests' own."""
    return port_below_ephemeral(kind=kind, span=SERVICE_PORTS)


def wait_http(url: str, timeout: float, auth: tuple[str, str] | None = None) -> bool:
    deadline = time.time() + timeout
    request = urllib.request.Request(url)
    if auth:
        request.add_header("Authorization", "Basic " + base64.b64encode(
            f"{auth[0]}:{auth[1]}".encode()).decode())
    while time.time() < deadline:
        try:
            with urllib.request.urlopen(request, timeout=1) as r:
                if r.status == 200:
                    return True
        except OSError:
            time.sleep(0.3)
    return False


@dataclass
class Central:
    """Where the central services listen (all on loopback in the root namespace)."""

    prometheus: str
    alertmanager: str | None
    remediation: str
    alertmanager_password: Path | None = None  # basic auth, user AM_USER

    def auth(self, name: str) -> tuple[str, str] | None:
        """The credentials a probe of `name` (a key of `urls`) needs."""
        if name == "alertmanager" and self.alertmanager_password:
            return AM_USER, self.alertmanager_password.read_text().strip()
        return None

    def urls(self) -> dict[str, str]:
        out = {"prometheus": self.prometheus}
        if self.alertmanager:
            out["alertmanager"] = self.alertmanager
        return out


def secret_file(path: Path) -> Path:
    """`path`, holding a fresh random token (created 0600) unless it exists already."""
    write_secret(path, secrets.token_hex(32), replace=False)
    return path


# The clients of the agents' control API, each with a token of its own: the agents'
# token file names them (agent/tokens.py), so every record in the audit log names who
# acted. One token for all read `token` on the Audit page for the demo's own faults.
CLIENTS = ("dashboard", "remediation", "fault-player")


def client_tokens(state: Path) -> tuple[Path, dict[str, Path]]:
    """The agents' token file (`PRINCIPAL TOKEN` per client) and each client's own token
    file, under `state`. A client's token is kept across runs; the agents' file is
    rewritten from them each time."""
    own = {client: secret_file(state / f"{client}-token") for client in CLIENTS}
    agents = state / "agent-tokens"
    write_secret(agents, "".join(f"{client} {path.read_text().strip()}\n"
                                 for client, path in own.items()))
    return agents, own


AM_USER = "clusterpulse"


def alertmanager_auth(state: Path) -> tuple[Path, Path]:
    """(Alertmanager's web config, the password file): basic auth on its API, so that
    no local user can post an alert the policy acts on. The password is random per
    state directory (0600); the web config holds only its bcrypt hash, from the shipped
    deploy/alertmanager/web.yml."""
    from clusterpulse.dashboard.auth import bcrypt_hash

    password_file = secret_file(state / "alertmanager-password")
    web = state / "alertmanager-web.yml"
    shipped = (REPO / "deploy" / "alertmanager" / "web.yml").read_text()
    hashed = bcrypt_hash(password_file.read_text().strip())
    web.write_text(shipped.replace("REPLACE-WITH-A-BCRYPT-HASH", f'"{hashed}"'))
    return web, password_file


def telemetry_socket(state: Path, node: str) -> str:
    """Node `node`'s agent socket address (network namespaces share one filesystem, so
    each node has its own path): under the state directory unless that path is too
    long for AF_UNIX (107 bytes)."""
    base = state / "sockets"
    if len(str(base)) > 80:
        base = Path("/tmp") / f"clusterpulse-{os.getuid()}-{state.stat().st_ino}"
    base.mkdir(mode=0o755, parents=True, exist_ok=True)
    return f"unix:{base}/{node}.sock"


def start_central(stack: Stack, state: Path, agents: list[str], token_file: Path,
                  prom_port: int, am_port: int, remediation_port: int,
                  scrape_interval: str = "2s", policy: Path = HERE / "policy.toml",
                  ) -> Central:
    """Prometheus scraping `agents` (HOST:PORT) with the project's rules, Alertmanager
    with the project's routing delivering to the remediation receiver. Raises
    RuntimeError naming what is missing (Debian `prometheus`)."""
    prom_bin, am_bin = shutil.which("prometheus"), shutil.which("prometheus-alertmanager")
    if not prom_bin:
        raise RuntimeError("prometheus is not installed; run scripts/setup.sh")
    # The rule groups' own intervals (15-30 s for the per-GPU ones) are sized for a
    # fleet; a local cluster of a few nodes evaluates everything at its scrape interval,
    # so each fault shows in seconds. Same rules, written without `interval:`.
    rules = []
    for src in sorted((REPO / "deploy" / "prometheus").glob("*rules.yml")):
        rules.append(state / src.name)
        rules[-1].write_text(re.sub(r"(?m)^    interval: \S+\n", "", src.read_text()))
    am_web, am_password = alertmanager_auth(state)
    config = (HERE / "prometheus.yml.tmpl").read_text().format(
        scrape_interval=scrape_interval,
        rule_files="\n".join(f"  - {r}" for r in rules) or "  []",
        alertmanager=f"127.0.0.1:{am_port}",
        am_user=AM_USER, am_password_file=am_password,
        agents=json.dumps(agents), remediation=f"127.0.0.1:{remediation_port}",
    )
    (state / "prometheus.yml").write_text(config)
    stack.start("prometheus", [prom_bin, f"--config.file={state / 'prometheus.yml'}",
                               f"--storage.tsdb.path={state / 'prometheus-data'}",
                               f"--web.listen-address=127.0.0.1:{prom_port}"])
    hook_token_file = secret_file(state / "webhook-token")  # Alertmanager -> remediation
    am_config = state / "alertmanager.yml"  # the project's config, webhook on our port
    am_config.write_text((REPO / "deploy" / "alertmanager" / "alertmanager.yml").read_text()
                         .replace("127.0.0.1:19495", f"127.0.0.1:{remediation_port}")
                         .replace("/etc/prometheus/clusterpulse-webhook-token",
                                  str(hook_token_file)))
    if am_bin:
        stack.start("alertmanager", [am_bin, f"--config.file={am_config}",
                                     f"--storage.path={state / 'alertmanager-data'}",
                                     f"--web.listen-address=127.0.0.1:{am_port}",
                                     f"--web.config.file={am_web}",
                                     "--cluster.listen-address="])
    prometheus = f"http://127.0.0.1:{prom_port}"
    stack.start("remediation", [
        sys.executable, "-m", "clusterpulse.dashboard.remediation", "--policy", str(policy),
        "--listen", f"127.0.0.1:{remediation_port}", "--prometheus", prometheus,
        "--token-file", str(token_file), "--audit-log", str(state / "audit.jsonl"),
        "--webhook-token-file", str(hook_token_file),
        "--history", str(state / "alert-history.jsonl")])
    return Central(prometheus, f"http://127.0.0.1:{am_port}" if am_bin else None,
                   f"http://127.0.0.1:{remediation_port}", am_password)
