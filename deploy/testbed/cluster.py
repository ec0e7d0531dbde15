"""ClusterPulse on the testbed: an agent per node, the central stack in the root
namespace, multi-node torchrun jobs, and the faults of the chaos list.

    with Testbed(nodes=3) as bed, TestbedCluster(bed, state_dir) as cl:
        cl.start_job("r1", ["--steps", "400", "--ckpt-every", "20"], min_nodes=2)
        cl.kill_node(bed.nodes[2])          # -> NodeAgentDown, job restarts on 2 nodes

Each node's agent serves /metrics and the control API on NODE_IP:9477, which
Prometheus (root namespace) scrapes over the bridge; ranks send telemetry to the
node's own Unix socket, `telemetry_address(node)` (the namespaces share one
filesystem, so each node has its own path), passed explicitly to the agent
(`--telemetry`) and to the ranks (`--agent`). The kernel names each sender to the
agent, so hard restarts signal only verified ranks.
One torchrun per node, c10d rendezvous hosted by the first node of the job (the one
faults spare), every torchrun advertising its node IP (`--local-addr`) and gloo bound
to the node's eth0: nothing crosses nodes over loopback.
"""

from __future__ import annotations

import contextlib
import json
import math
import signal
import subprocess
import sys
import time
import urllib.error
import urllib.parse
import urllib.request
from collections.abc import Sequence
from dataclasses import dataclass, field
from pathlib import Path

from deploy.local.stack import (
    REPO,
    Central,
    Stack,
    client_tokens,
    free_port,
    rank_pids,
    start_central,
    telemetry_socket,
    wait_http,
)
from deploy.testbed.bed import Node, Testbed
from deploy.testbed.faults import live_ranks
from deploy.testbed.net import TestbedError

AGENT_PORT = 9477
RDZV_PORT = 29400


@dataclass
class Job:
    run: str
    nodes: list[Node]
    rdzv: str
    ckpt_dir: Path
    nnodes: str = "1"
    args: list[str] = field(default_factory=list)
    ranks_per_node: int = 1
    max_restarts: int = 20
    spares: int = 0
    join_timeout: int = 120
    env: dict = field(default_factory=dict)
    procs: dict[str, object] = field(default_factory=dict)


class TestbedCluster:
    """Agents on every node of `bed`, Prometheus + Alertmanager + remediation in the
    root namespace, jobs on demand. `stop()` (or the `with` block) ends all of it."""

    __test__ = False

    def __init__(self, bed: Testbed, state: Path, gpus: int = 4, scrape_interval: str = "1s",
                 agent_interval: float = 0.5, policy: Path | None = None,
                 scenarios: dict[int, Path] | None = None) -> None:
        self.bed = bed
        self.state = state
        self.gpus = gpus
        self.scrape_interval = scrape_interval
        self.agent_interval = agent_interval
        self.policy = policy or REPO / "deploy" / "local" / "policy.toml"
        self.scenarios = scenarios or {}
        self.stack = Stack(state)
        self.token = ""  # the fault player's (the testbed's own calls), set by start()
        self.token_file = state / "agent-tokens"
        self.central: Central | None = None
        self.jobs: dict[str, Job] = {}
        self.started_at = time.time()

    # -- lifecycle ----------------------------------------------------------------------

    def __enter__(self) -> TestbedCluster:
        try:
            return self.start()
        except BaseException:
            self.stop()
            raise

    def __exit__(self, *exc) -> None:
        self.stop()

    def start(self, prom_port: int = 0, am_port: int = 0,
              remediation_port: int = 0) -> TestbedCluster:
        self.state.mkdir(parents=True, exist_ok=True)
        self.token_file, clients = client_tokens(self.state)
        self.token = clients["fault-player"].read_text().strip()
        for node in self.bed.nodes:
            self.start_agent(node)
        self.central = start_central(
            self.stack, self.state, [self.agent_target(n) for n in self.bed.nodes],
            clients["remediation"], prom_port or free_port(), am_port or free_port(),
            remediation_port or free_port(), scrape_interval=self.scrape_interval,
            policy=self.policy)
        for node in self.bed.nodes:
            if not wait_http(self.agent_url(node) + "/healthz", 60):
                raise TestbedError(f"agent on {node.name} did not come up; see "
                                   f"{self.state / ('agent-' + node.name)}.log")
        for name, url in self.central.urls().items():
            if not wait_http(url + "/-/ready", 60, self.central.auth(name)):
                raise TestbedError(f"{name} did not come up; see {self.state}/{name}.log")
        return self

    def stop(self) -> None:
        self.stack.stop()

    # -- agents -------------------------------------------------------------------------

    def telemetry_address(self, node: Node) -> str:
        """Where the node's ranks send telemetry and its agent receives it."""
        return telemetry_socket(self.state, node.name)

    def agent_target(self, node: Node) -> str:
        return f"{node.ip}:{AGENT_PORT}"

    def agent_url(self, node: Node) -> str:
        return f"http://{self.agent_target(node)}"

    def start_agent(self, node: Node) -> None:
        """(Re)start the node's agent, e.g. after a `kill_agent` or a node death."""
        extra = ["--scenario", str(self.scenarios[node.index])] if node.index in \
            self.scenarios else []
        self.stack.start(f"agent-{node.name}", node.command([
            sys.executable, "-m", "clusterpulse.agent", "--backend", "sim", "--node", node.name,
            "--gpus", str(self.gpus), "--listen", self.agent_target(node),
            "--telemetry", self.telemetry_address(node), "--interval", str(self.agent_interval),
            "--token-file", str(self.token_file),
            # /sys is the host's in a node (nsenter keeps the mount namespace): its NICs
            # are not the node's. The node's link is eth0, its queue read over netlink.
            "--sysfs", "none", "--nic", "eth0",
            "--audit-log", str(self.state / f"audit-{node.name}.jsonl"), *extra]), watch=False)

    def agent_pids(self, node: Node) -> list[int]:
        return self.bed.find(node, "-m clusterpulse.agent")

    # -- jobs -----------------------------------------------------------------------------

    def start_job(self, run: str, trainer_args: Sequence[str], nodes: Sequence[Node] | None = None,
                  ranks_per_node: int = 1, min_nodes: int | None = None,
                  max_restarts: int = 20, env: dict | None = None, spares: int = 0,
                  join_timeout: int = 120) -> Job:
        """One torchrun per node; the first node hosts the c10d rendezvous. With
        `min_nodes` below the node count the job is elastic (`--nnodes MIN:MAX`): it
        restarts on the nodes that remain when one dies. With `spares`, MAX is that many
        below the node count: the nodes the rendezvous cannot take stand by (torch's
        redundancy list) and one takes a lost node's place at the next restart."""
        nodes = list(nodes or self.bed.nodes)
        size = len(nodes) - spares
        if not 0 <= spares < len(nodes) or (spares and not min_nodes):
            raise ValueError("spares need an elastic job (min_nodes) and a node to run on")
        nnodes = f"{min_nodes}:{size}" if min_nodes else str(size)
        host = nodes[0]
        rdzv = f"{host.ip}:{RDZV_PORT}"
        job = Job(run, nodes, rdzv, self.state / f"ckpt-{run}", nnodes=nnodes,
                  args=list(trainer_args), ranks_per_node=ranks_per_node,
                  max_restarts=max_restarts, spares=spares, join_timeout=join_timeout,
                  env=dict(env or {}))
        for node in nodes:
            self.start_node(job, node)
        self.jobs[run] = job
        return job

    def run_job(self, run: str, trainer_args: Sequence[str], ranks_per_node: int = 1,
                max_restarts: int = 2, timeout_s: float = 1200) -> dict:
        """Run a (non-elastic) job on every node to its end; its run summary (rank 0
        writes it, wherever the rendezvous placed rank 0). Raises TestbedError naming
        the node and its log tail if a node's launcher fails or the job overruns."""
        summary = self.state / f"{run}-summary.json"
        job = self.start_job(run, [*trainer_args, "--summary-json", str(summary)],
                             ranks_per_node=ranks_per_node, max_restarts=max_restarts)
        deadline = time.time() + timeout_s
        for name, p in job.procs.items():
            try:
                rc = p.wait(timeout=max(1.0, deadline - time.time()))  # type: ignore[attr-defined]
            except subprocess.TimeoutExpired:
                rc = None
            if rc != 0:
                log = self.state / f"{run}-{name}.log"
                tail = log.read_text(errors="replace")[-2000:] if log.exists() else ""
                raise TestbedError(f"job {run} on {name}: "
                                   f"{'timed out' if rc is None else f'exit {rc}'}\n{tail}")
        return json.loads(summary.read_text())

    def start_node(self, job: Job, node: Node) -> None:
        """Start (or, after a node death, restart) the job's torchrun on `node`; an
        elastic job takes a returning node in at its next rendezvous."""
        host = job.nodes[0]
        # clusterpulse-train: a fresh store per round, graceful restarts relaunched
        cmd = [sys.executable, "-m", "clusterpulse.trainer.launch",
               "--nproc", str(job.ranks_per_node), "--nnodes", job.nnodes,
               "--rdzv-endpoint", job.rdzv, "--rdzv-id", job.run,
               f"--local-addr={node.ip}", "--monitor-interval=0.5",
               "--rdzv-host" if node is host else "--no-rdzv-host",
               "--rdzv-conf", f"join_timeout={job.join_timeout}",
               *(["--hot-spares"] if job.spares else []),
               "--max-restarts", str(job.max_restarts), "--",
               "--run-id", job.run, "--ckpt-dir", str(job.ckpt_dir),
               "--agent", self.telemetry_address(node), *job.args]
        job.procs[node.name] = self.stack.start(
            f"{job.run}-{node.name}", node.command(cmd), watch=False,
            env={"OMP_NUM_THREADS": "1", "PYTHONPATH": str(REPO), "GLOO_SOCKET_IFNAME": "eth0",
                 "LOGLEVEL": "WARNING", **job.env})

    def rank_pids(self, node: Node, run: str) -> list[int]:
        """The trainer rank processes of `run` on `node` (under its launcher)."""
        return rank_pids(self.bed.find(node, "-m clusterpulse.trainer.launch",
                                       f"--rdzv-id {run} "))

    # -- faults (the chaos list) -------------------------------------------------------

    def kill_node(self, node: Node) -> list[int]:
        return self.bed.kill_node(node)

    def kill_agent(self, node: Node) -> list[int]:
        pids = self.agent_pids(node)
        for pid in pids:
            self.bed.kill_process(pid, signal.SIGKILL)
        return pids

    def hang_rank(self, node: Node, run: str) -> int:
        """A hung rank: the process lives but makes no progress (SIGSTOP)."""
        pid = self.rank_pids(node, run)[0]
        self.bed.kill_process(pid, signal.SIGSTOP)
        return pid

    def crash_rank(self, node: Node, run: str) -> int:
        pid = self.rank_pids(node, run)[0]
        self.bed.kill_process(pid, signal.SIGKILL)
        return pid

    def gpu_fault(self, node: Node, kind: str, gpu: int, **fields) -> dict:
        """A simulated-GPU fault through the node agent's control API (agent/faults.py)."""
        return self._call(self.agent_url(node) + "/v1/faults", {"kind": kind, "gpu": gpu,
                                                               **fields})

    # -- reading what happened -------------------------------------------------------

    def query(self, promql: str) -> list[dict]:
        assert self.central is not None
        url = self.central.prometheus + "/api/v1/query?" + urllib.parse.urlencode(
            {"query": promql})
        with urllib.request.urlopen(url, timeout=10) as r:
            return json.load(r)["data"]["result"]

    def step_seconds(self, run: str, window_s: float) -> float:
        """The run's mean step time over the last `window_s` seconds (the average of its
        live ranks); NaN if Prometheus has no number for it for 10 s (an empty or NaN
        answer now and then: asked again)."""
        series = live_ranks("clusterpulse_trainer_step_seconds", run)
        query = f'avg(avg_over_time(({series})[{max(2, int(window_s))}s:1s]))'
        deadline = time.monotonic() + 10
        while True:
            r = self.query(query)
            value = float(r[0]["value"][1]) if r else float("nan")
            if not math.isnan(value) or time.monotonic() > deadline:
                return value
            time.sleep(0.5)

    def job_nodes(self, run: str) -> list[str]:
        """The nodes with a rank process of `run` now (from the process trees)."""
        return sorted(n.name for n in self.bed.nodes if self.rank_pids(n, run))

    def alerts(self, name: str | None = None, state: str = "firing") -> list[dict]:
        """Alerts Prometheus evaluates now (optionally one name) in `state`."""
        assert self.central is not None
        with urllib.request.urlopen(self.central.prometheus + "/api/v1/alerts", timeout=10) as r:
            alerts = json.load(r)["data"]["alerts"]
        return [a for a in alerts if a["state"] == state
                and (name is None or a["labels"]["alertname"] == name)]

    def audit(self) -> list[dict]:
        """Every entry of the central audit log (remediation decisions and actions)."""
        path = self.state / "audit.jsonl"
        if not path.exists():
            return []
        out = []
        for line in path.read_text().splitlines():
            with contextlib.suppress(ValueError):
                out.append(json.loads(line))
        return out

    def agent_command(self, node: Node, command: str) -> dict:
        """A command's state at the node's agent (pending, delivered, completed...)."""
        return self._call(f"{self.agent_url(node)}/v1/commands/{command}", None)

    def _call(self, url: str, body: dict | None) -> dict:
        """POST `body` to the agent's control API, or GET without one."""
        req = urllib.request.Request(url, data=None if body is None else json.dumps(body).encode(),
                                     method="GET" if body is None else "POST",
                                     headers={"Authorization": f"Bearer {self.token}",
                                              "Content-Type": "application/json"})
        try:
            with urllib.request.urlopen(req, timeout=10) as r:
                return json.load(r)
        except urllib.error.HTTPError as err:
            raise TestbedError(f"{url}: {err.code} {err.read().decode(errors='replace')}") \
                from None


class ClusterTarget:
    """The fault player's view of a TestbedCluster (deploy/testbed/faults.py): nodes by
    index, one run. A dead node comes back (agent and torchrun restarted) on `undo`."""

    def __init__(self, cluster: TestbedCluster, run: str, slow_rate: str = "4mbit") -> None:
        self.cl, self.run, self.slow_rate = cluster, run, slow_rate

    def _node(self, i: int) -> Node:
        return self.cl.bed.nodes[i]

    def node_name(self, node: int) -> str:
        return self._node(node).name

    def gpu_fault(self, node: int, kind: str, gpu: int, **fields) -> dict:
        return self.cl.gpu_fault(self._node(node), kind, gpu, **fields)

    def rank_pids(self, node: int) -> list[int]:
        return self.cl.rank_pids(self._node(node), self.run)

    def signal_pid(self, pid: int, sig: int) -> None:
        self.cl.bed.kill_process(pid, sig)

    def kill_agent(self, node: int) -> None:
        self.cl.kill_agent(self._node(node))

    def start_agent(self, node: int) -> None:
        self.cl.start_agent(self._node(node))

    def node_death(self, node: int, seconds: float) -> None:
        self.cl.kill_node(self._node(node))

    def undo_node_death(self, node: int) -> None:
        n = self._node(node)
        self.cl.start_agent(n)
        job = self.cl.jobs.get(self.run)
        if job is not None and n in job.nodes:
            self.cl.start_node(job, n)

    def partition(self, node: int, seconds: float) -> None:
        self.cl.bed.partition(self._node(node))

    def undo_partition(self, node: int) -> None:
        self.cl.bed.heal(self._node(node))

    def slow_link(self, node: int, seconds: float) -> None:
        self.cl.bed.slow_link(self._node(node), rate=self.slow_rate, burst="32kb",
                              latency="500ms")

    def undo_slow_link(self, node: int) -> None:
        self.cl.bed.fix_link(self._node(node))
