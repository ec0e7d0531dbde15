"""The one-command local cluster: everything ClusterPulse needs, on this machine.

Starts simulated nodes (an agent each, 4 simulated GPUs), Prometheus and Alertmanager
with the project's rules and config, the remediation policy receiver, a torchrun
training job across the nodes (one torchrun per node, c10d rendezvous, --max-restarts)
and the dashboard; prints the URLs and an operator password. Nodes share loopback by
default; with --testbed (root) each node is a network namespace with its own IP and
hostname (deploy/testbed/). A fault scenario (deploy/local/scenario.toml) then plays
in order: each fault is printed when it is injected, followed by the alert that
detected it, the remediation action and the first step after recovery; the next fault
waits for that. Ctrl-C (or SIGTERM) stops every process it started, in reverse order,
and waits for them: nothing is left behind.
"""

from __future__ import annotations

import argparse
import contextlib
import json
import math
import os
import secrets
import shutil
import signal
import socket
import subprocess
import sys
import time
import urllib.request
from pathlib import Path

HERE = Path(__file__).resolve().parent
REPO = HERE.parents[1]
if str(REPO) not in sys.path:  # run as a script: deploy.* imports from the repository root
    sys.path.insert(0, str(REPO))

from clusterpulse.agent.tokens import write_secret  # noqa: E402
from clusterpulse.dashboard.remediation import Policy, PolicyError  # noqa: E402
from deploy.local.stack import (  # noqa: E402
    AM_USER,
    Stack,
    client_tokens,
    duration_s,
    rank_pids,
    start_central,
    telemetry_socket,
    wait_http,
)
from deploy.testbed import scenario as scenario_mod  # noqa: E402
from deploy.testbed.faults import Observer  # noqa: E402

EXAMPLES = """\
examples:
  scripts/demo.sh                      # two simulated nodes on loopback, faults in order
  scripts/demo.sh --scenario none      # the same without injected faults
  sudo scripts/demo.sh --testbed --nodes 4   # four nodes, each its own network namespace
  scripts/demo.sh --state-dir /tmp/cp  # keep logs, data and checkpoints there
  scripts/demo.sh --scenario my.toml --policy my-policy.toml   # your faults and policy
"""
RUN = "demo"


def operator_password(state: Path) -> str:
    """A fresh random operator password per start; only its hash is written."""
    from clusterpulse.dashboard.auth import hash_password

    password = secrets.token_urlsafe(12)
    path = state / "operators.toml"
    write_secret(path, f'[operators]\nadmin = "{hash_password(password)}"\n')
    return password


def trainer_args(args: argparse.Namespace, state: Path) -> list[str]:
    """The job's trainer flags; the global batch divides every world size it may have
    (the testbed job is elastic: it continues on one node fewer after a node death).
    Simulated GPUs take 150 ms per step with every rank in, as a cost per sequence, so
    that on one node fewer the larger share of the global batch takes longer."""
    worlds = [args.nodes * args.ranks_per_node, max(1, args.nodes - 1) * args.ranks_per_node]
    batch = math.lcm(*worlds)
    per_sequence = 0.15 * worlds[0] / batch
    return ["--preset", "tiny", "--steps", str(args.steps), "--run-id", RUN,
            "--global-batch", str(batch),
            "--ckpt-dir", str(state / "checkpoints"), "--ckpt-every", "50", "--async-ckpt",
            *(["--sim-sample-seconds", f"{per_sequence:.6f}"] if args.backend == "sim" else []),
            "--log-every", "100"]


def start_job(stack: Stack, args: argparse.Namespace, state: Path, port: int) -> None:
    """One clusterpulse-train (torchrun with a fresh store per round, graceful restarts
    relaunched) per simulated node, rendezvous over c10d on loopback: a real multi-node
    job whose ranks report to their own node's agent."""
    for i in range(args.nodes):
        cmd = [sys.executable, "-m", "clusterpulse.trainer.launch",
               "--nproc", str(args.ranks_per_node), "--nnodes", str(args.nodes),
               "--rdzv-endpoint", f"127.0.0.1:{port + 97}", "--rdzv-id", RUN,
               "--max-restarts", "100", "--", *trainer_args(args, state),
               "--agent", telemetry_socket(state, f"node-{i}")]
        stack.start(f"trainer-node-{i}", cmd, env={"OMP_NUM_THREADS": "1",
                                                    "PYTHONPATH": str(REPO)})


class LocalTarget:
    """The fault player's view of the loopback demo (deploy/testbed/faults.py)."""

    def __init__(self, stack: Stack, names: list[str], ports: list[int], token: str,
                 agent_cmds: list[list[str]]) -> None:
        self.stack, self.names, self.ports = stack, names, ports
        self.token, self.agent_cmds = token, agent_cmds

    def node_name(self, node: int) -> str:
        return self.names[node]

    def gpu_fault(self, node: int, kind: str, gpu: int, **fields) -> dict:
        req = urllib.request.Request(
            f"http://127.0.0.1:{self.ports[node]}/v1/faults", method="POST",
            data=json.dumps({"kind": kind, "gpu": gpu, **fields}).encode(),
            headers={"Authorization": f"Bearer {self.token}", "Content-Type": "application/json"})
        with urllib.request.urlopen(req, timeout=10) as r:
            return json.load(r)

    def _proc(self, name: str) -> subprocess.Popen | None:
        return next((p for n, p, _ in reversed(self.stack.procs) if n == name), None)

    def rank_pids(self, node: int) -> list[int]:
        """The trainer ranks under that node's launcher (launcher -> torchrun -> ranks)."""
        parent = self._proc(f"trainer-node-{node}")
        return [] if parent is None else rank_pids([parent.pid])

    def signal_pid(self, pid: int, sig: int) -> None:
        with contextlib.suppress(ProcessLookupError):
            os.kill(pid, sig)

    def kill_agent(self, node: int) -> None:
        p = self._proc(f"agent-{self.names[node]}")
        if p is not None:
            self.signal_pid(p.pid, signal.SIGKILL)
            p.wait()

    def start_agent(self, node: int) -> None:
        self.stack.start(f"agent-{self.names[node]}", self.agent_cmds[node], watch=False)


def count_gpus() -> int:
    smi = shutil.which("nvidia-smi")
    if not smi:
        return 0
    try:
        out = subprocess.run([smi, "-L"], capture_output=True, text=True, timeout=20)
    except (OSError, subprocess.TimeoutExpired):
        return 0
    return out.stdout.count("GPU ") if out.returncode == 0 else 0


def parse_args(argv: list[str] | None) -> argparse.Namespace:
    p = argparse.ArgumentParser(prog="scripts/demo.sh", description=__doc__, epilog=EXAMPLES,
                                formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--state-dir", type=Path, default=REPO / ".run",
                   help="logs, Prometheus data, audit logs (default: .run/)")
    p.add_argument("--nodes", type=int, default=None,
                   help="simulated nodes (default: 2 on loopback, 4 with --testbed)")
    p.add_argument("--testbed", action="store_true",
                   help="each node in its own network namespace with its own IP and hostname "
                   "(needs root; see docs/testbed.md). Default: all nodes on loopback")
    p.add_argument("--gpus-per-node", type=int, default=4, help="default: 4")
    p.add_argument("--scenario", default=str(HERE / "scenario.toml"),
                   help="TOML file of faults played in order (deploy/testbed/scenario.py), "
                   "or 'none'")
    p.add_argument("--policy", type=Path, default=HERE / "policy.toml",
                   help="remediation policy (default: deploy/local/policy.toml)")
    p.add_argument("--scrape-interval", default="2s",
                   help="Prometheus scrape, e.g. 500ms, 2s, 1m (default: 2s)")
    p.add_argument("--base-port", type=int, default=19400,
                   help="first port; the stack uses a few after it (default: 19400)")
    p.add_argument("--duration", type=float, default=0,
                   help="stop after this many seconds (default: run until Ctrl-C)")
    p.add_argument("--ranks-per-node", type=int, default=None,
                   help="default: 2 on loopback, 1 with --testbed")
    p.add_argument("--steps", type=int, default=100000, help="training steps (default: 100000)")
    p.add_argument("--no-job", action="store_true", help="start no training job")
    p.add_argument("--backend", choices=["auto", "sim", "nvml"], default="auto",
                   help="auto: real GPUs through NVML (one node, NCCL) when nvidia-smi finds "
                   "any, else simulated nodes")
    p.add_argument("--no-dashboard", action="store_true", help="start no dashboard")
    args = p.parse_args(argv)
    if args.nodes is None:
        args.nodes = 4 if args.testbed else 2
    if args.ranks_per_node is None:
        args.ranks_per_node = 1 if args.testbed else 2
    if not 1 <= args.nodes <= 32 or not 1 <= args.ranks_per_node <= 16:
        p.error("--nodes must be in 1..32 and --ranks-per-node in 1..16")
    try:
        duration_s(args.scrape_interval)
    except ValueError as err:
        p.error(f"--scrape-interval: {err}")
    return args


def start_loopback(args: argparse.Namespace, stack: Stack, state: Path,
                   ) -> tuple[dict[str, str], LocalTarget, list[str], str]:
    """Agents on loopback ports, the central stack, the job: the demo without root."""
    token_file, clients = client_tokens(state)
    port = args.base_port
    names, ports, cmds = [], [], []
    for i in range(args.nodes):
        node = f"sim-node-{i}" if args.backend == "sim" else socket.gethostname()
        http = port + 2 * i
        cmd = [sys.executable, "-m", "clusterpulse.agent", "--backend", args.backend,
               "--node", node,
               "--gpus", str(args.gpus_per_node), "--listen", f"127.0.0.1:{http}",
               "--telemetry", telemetry_socket(state, f"node-{i}"),
               "--token-file", str(token_file),
               "--audit-log", str(state / "audit.jsonl")]
        if args.backend == "sim":  # simulated nodes on loopback have no NIC of their own:
            cmd += ["--sysfs", "none", "--no-queues"]  # the host's is not theirs
        stack.start(f"agent-{node}", cmd, watch=False)  # a fault may kill it
        names.append(node)
        ports.append(http)
        cmds.append(cmd)
    central = start_central(stack, state, [f"127.0.0.1:{p}" for p in ports],
                            clients["remediation"],
                            port + 90, port + 93, port + 95, scrape_interval=args.scrape_interval,
                            policy=args.policy)
    urls = {f"agent {i}": f"http://127.0.0.1:{p}/metrics" for i, p in enumerate(ports)}
    urls.update(central.urls())
    if not args.no_job:
        start_job(stack, args, state, port)
    target = LocalTarget(stack, names, ports, clients["fault-player"].read_text().strip(),
                         cmds)
    return urls, target, names, central.prometheus


def start_testbed(args: argparse.Namespace, state: Path, exits: contextlib.ExitStack,
                  ) -> tuple[dict[str, str], object, list[str], str, Stack]:
    """Nodes as network namespaces (deploy/testbed), an agent on each node's IP, the
    central stack in the root namespace, one torchrun per node."""
    from deploy.testbed import Testbed, TestbedError, missing_privileges
    from deploy.testbed.cluster import ClusterTarget, TestbedCluster

    reason = missing_privileges()
    if reason:
        raise TestbedError(f"--testbed: {reason}")
    bed = exits.enter_context(Testbed(nodes=args.nodes))
    cl = TestbedCluster(bed, state, gpus=args.gpus_per_node,
                        scrape_interval=args.scrape_interval, policy=args.policy)
    exits.callback(cl.stop)
    port = args.base_port
    cl.start(prom_port=port + 90, am_port=port + 93, remediation_port=port + 95)
    if not args.no_job:
        cl.start_job(RUN, trainer_args(args, state), ranks_per_node=args.ranks_per_node,
                     min_nodes=max(1, args.nodes - 1) if args.nodes > 1 else None, max_restarts=100)
    urls = {f"agent {n.name}": cl.agent_url(n) + "/metrics" for n in bed.nodes}
    assert cl.central is not None
    urls.update(cl.central.urls())
    return urls, ClusterTarget(cl, RUN), [n.name for n in bed.nodes], cl.central.prometheus, \
        cl.stack


def main(argv: list[str] | None = None) -> int:
    args = parse_args(argv)
    gpus = count_gpus() if args.backend != "sim" and not args.testbed else 0
    if args.backend == "nvml" and not gpus:
        print("demo: --backend nvml but nvidia-smi finds no GPU (or --testbed, which "
              "simulates its GPUs)", file=sys.stderr)
        return 2
    if gpus:  # this machine's real GPUs: one node, one rank per GPU, NCCL chosen by torch
        args.backend, args.nodes, args.ranks_per_node, args.gpus_per_node = "nvml", 1, gpus, gpus
    else:
        args.backend = "sim"
    if not shutil.which("prometheus"):
        print("demo: prometheus is not installed; run scripts/setup.sh", file=sys.stderr)
        return 2
    if args.base_port + 97 > 65535:
        print("demo: --base-port too high", file=sys.stderr)
        return 2
    try:  # the receiver would refuse a bad policy; say so before starting anything
        policy = Policy.load(args.policy)
    except PolicyError as err:
        print(f"demo: {err}", file=sys.stderr)
        return 2
    faults = []
    if args.scenario != "none" and not args.no_job:
        try:
            faults = scenario_mod.load(Path(args.scenario), args.nodes, args.gpus_per_node,
                                       args.testbed)
        except scenario_mod.ScenarioError as err:
            print(f"demo: {err}", file=sys.stderr)
            return 2
        if args.backend == "nvml":  # real GPUs: only the faults that need no simulation
            faults = [f for f in faults if not f[1].kind.startswith("gpu_")]
    state: Path = args.state_dir.resolve()
    state.mkdir(parents=True, exist_ok=True, mode=0o700)
    owner = state.stat()
    if owner.st_uid != os.geteuid() or owner.st_mode & 0o022:
        # its secrets and audit log would be another user's to plant or swap
        print(f"demo: --state-dir {state} must be yours and writable by you alone "
              f"(owner uid {owner.st_uid}, mode {owner.st_mode & 0o777:o}); pick another",
              file=sys.stderr)
        return 2
    port = args.base_port
    stopping = False

    def on_signal(*_):
        nonlocal stopping
        stopping = True

    signal.signal(signal.SIGINT, on_signal)
    signal.signal(signal.SIGTERM, on_signal)
    exits = contextlib.ExitStack()
    stack = Stack(state)
    exits.callback(stack.stop)
    driver = None
    try:
        try:
            if args.testbed:
                urls, target, names, prometheus, stack = start_testbed(args, state, exits)
            else:
                urls, target, names, prometheus = start_loopback(args, stack, state)
        except (RuntimeError, OSError) as err:
            print(f"demo: {err}", file=sys.stderr)
            return 2
        password = None
        if not args.no_dashboard:
            password = operator_password(state)
            stack.start("dashboard", [
                sys.executable, "-m", "clusterpulse.dashboard.cli", "--prometheus", prometheus,
                "--alertmanager", f"http://127.0.0.1:{port + 93}", "--port", str(port + 80),
                "--token-file", str(state / "dashboard-token"), "--operators-file",
                str(state / "operators.toml"), "--audit-log", str(state / "audit.jsonl"),
                "--alertmanager-password-file", str(state / "alertmanager-password")])
            urls["dashboard"] = f"http://127.0.0.1:{port + 80}"
        for name, url in urls.items():
            probe = {"dashboard": url + "/_stcore/health"}.get(
                name, url.replace("/metrics", "/healthz") if "agent" in name else url + "/-/ready")
            auth = ((AM_USER, (state / "alertmanager-password").read_text().strip())
                    if name == "alertmanager" else None)
            if not wait_http(probe, 90, auth):
                print(f"demo: {name} did not come up; see logs in {state}", file=sys.stderr)
                return 1
        print("ClusterPulse local cluster is up:")
        print("  nodes        " + ("testbed: a network namespace per node, own IP and hostname"
                                   if args.testbed else "loopback (add --testbed, as root, for "
                                   "a network namespace per node)"))
        for name, url in urls.items():
            print(f"  {name:12s} {url}")
            if name == "alertmanager":
                print(f"  {'':12s} (basic auth: user '{AM_USER}', password in "
                      f"{state / 'alertmanager-password'})")
        if password:
            print(f"  operator     name 'admin', password '{password}' (hash in "
                  f"{state / 'operators.toml'})")
        if not args.no_job:
            print(f"  job          run '{RUN}', {args.nodes} node(s) x {args.ranks_per_node} "
                  f"ranks ({args.backend})")
            print("  faults       " + ("none" if not faults else "played in order, each after "
                                       "the previous one recovered:"))
            for i, (after, f) in enumerate(faults, 1):
                print(f"    {i}. {f.describe(names)} ({after:.0f} s after the previous)")
        print(f"  logs         {state}\nPress Ctrl-C to stop.", flush=True)
        if faults:
            observer = Observer(prometheus, state / "audit.jsonl", RUN, policy,
                                # a step read is up to a scrape and an agent's 1 s old
                                sample_lag_s=duration_s(args.scrape_interval) + 1)
            driver = scenario_mod.Driver(faults, target, observer, names,
                                         lambda line: print(line, flush=True),
                                         action_gap_s=policy.window_s)
            driver.start()
        started = time.time()
        while not stopping:
            problem = stack.check()
            if problem:
                print(f"demo: {problem}", file=sys.stderr)
                return 1
            if args.duration and time.time() - started >= args.duration:
                break
            time.sleep(0.5)
        return 0
    finally:
        print("demo: stopping ...", flush=True)
        if driver is not None:
            driver.stop_event.set()
            driver.join(timeout=15)
        exits.close()
        print("demo: stopped, no process left behind.", flush=True)


if __name__ == "__main__":
    raise SystemExit(main())
