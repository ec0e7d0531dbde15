"""The one-command local cluster: everything ClusterPulse needs, on this machine.

Starts two simulated nodes (an agent each, 4 simulated GPUs), Prometheus and
Alertmanager with the project's rules and config, the remediation policy receiver,
a torchrun training job across both nodes (c10d rendezvous on loopback, one torchrun
per node, --max-restarts), and the dashboard; prints the URLs and an operator
password. A fault scenario plays on node 0 (thermal straggler, GPU lost) and a hang
is injected into the job, so detection and recovery happen in front of you.
Ctrl-C (or SIGTERM) stops every process it started, in reverse order, and waits for
them: nothing is left behind.
"""

from __future__ import annotations

import argparse
import contextlib
import json
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

EXAMPLES = """\
examples:
  scripts/demo.sh                      # two simulated nodes, Prometheus, Alertmanager
  scripts/demo.sh --scenario none      # the same without injected faults
  scripts/demo.sh --state-dir /tmp/cp  # keep logs, data and checkpoints there
"""


class Stack:
    """Processes started in order and stopped in reverse order, all of them."""

    def __init__(self, state: Path) -> None:
        self.state = state
        self.procs: list[tuple[str, subprocess.Popen]] = []

    def start(self, name: str, args: list[str], env: dict | None = None) -> subprocess.Popen:
        log = open(self.state / f"{name}.log", "ab")  # noqa: SIM115 - closed with the process
        p = subprocess.Popen(args, stdout=log, stderr=subprocess.STDOUT, cwd=REPO,
                             env={**os.environ, **(env or {})}, start_new_session=True)
        self.procs.append((name, p))
        return p

    def check(self) -> str | None:
        for name, p in self.procs:
            if p.poll() is not None:
                return f"{name} exited with code {p.returncode}; see {self.state / name}.log"
        return None

    def stop(self) -> None:
        for _name, p in reversed(self.procs):
            if p.poll() is None:
                with contextlib.suppress(ProcessLookupError):
                    os.killpg(p.pid, signal.SIGTERM)
        deadline = time.time() + 15
        for _name, p in reversed(self.procs):
            try:
                p.wait(timeout=max(0.1, deadline - time.time()))
            except subprocess.TimeoutExpired:
                os.killpg(p.pid, signal.SIGKILL)
                p.wait()


def operator_password(state: Path) -> str:
    """A fresh random operator password per start; only its hash is written."""
    from dashboard.auth import hash_password

    password = secrets.token_urlsafe(12)
    path = state / "operators.toml"
    path.write_text(f'[operators]\nadmin = "{hash_password(password)}"\n')
    path.chmod(0o600)
    return password


def telemetry_socket(state: Path, node: int) -> str:
    """Each simulated node's own agent socket (the namespaces share one filesystem);
    under the state directory unless that path is too long for AF_UNIX (107 bytes)."""
    base = state / "sockets"
    if len(str(base)) > 90:
        base = Path("/tmp") / f"clusterpulse-{os.getuid()}-{state.stat().st_ino}"
    base.mkdir(mode=0o755, parents=True, exist_ok=True)
    return f"unix:{base}/node-{node}.sock"


def start_job(stack: Stack, args: argparse.Namespace, state: Path, port: int) -> None:
    """One torchrun per simulated node, rendezvous over c10d on loopback: a real
    multi-node job whose ranks report to their own node's agent."""
    from trainer.launch import build_command

    for i in range(args.nodes):
        inject = [] if args.scenario == "none" else ["--inject", "hang:rank=1:step=1500"]
        cmd = build_command([
            "--nproc", str(args.ranks_per_node), "--nnodes", str(args.nodes),
            "--rdzv-endpoint", f"127.0.0.1:{port + 97}", "--rdzv-id", "demo",
            "--max-restarts", "100", "--",
            "--preset", "tiny", "--steps", str(args.steps), "--run-id", "demo",
            "--ckpt-dir", str(state / "checkpoints"), "--ckpt-every", "50", "--async-ckpt",
            *(["--sim-compute-seconds", "0.15"] if args.backend == "sim" else []),
            "--agent", telemetry_socket(state, i),
            "--log-every", "100", *inject])
        stack.start(f"trainer-node-{i}", cmd, env={"OMP_NUM_THREADS": "1",
                                                    "PYTHONPATH": str(REPO)})


def count_gpus() -> int:
    smi = shutil.which("nvidia-smi")
    if not smi:
        return 0
    try:
        out = subprocess.run([smi, "-L"], capture_output=True, text=True, timeout=20)
    except (OSError, subprocess.TimeoutExpired):
        return 0
    return out.stdout.count("GPU ") if out.returncode == 0 else 0


def wait_http(url: str, timeout: float) -> bool:
    deadline = time.time() + timeout
    while time.time() < deadline:
        try:
            with urllib.request.urlopen(url, timeout=1) as r:
                if r.status == 200:
                    return True
        except OSError:
            time.sleep(0.3)
    return False


def parse_args(argv: list[str] | None) -> argparse.Namespace:
    p = argparse.ArgumentParser(prog="scripts/demo.sh", description=__doc__, epilog=EXAMPLES,
                                formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--state-dir", type=Path, default=REPO / ".run",
                   help="logs, Prometheus data, audit logs (default: .run/)")
    p.add_argument("--nodes", type=int, default=2, help="simulated nodes (default: 2)")
    p.add_argument("--gpus-per-node", type=int, default=4, help="default: 4")
    p.add_argument("--scenario", default=str(HERE / "scenario.toml"),
                   help="TOML fault scenario for node 0's agent, or 'none'")
    p.add_argument("--base-port", type=int, default=19400,
                   help="first port; the stack uses a few after it (default: 19400)")
    p.add_argument("--duration", type=float, default=0,
                   help="stop after this many seconds (default: run until Ctrl-C)")
    p.add_argument("--ranks-per-node", type=int, default=2, help="default: 2")
    p.add_argument("--steps", type=int, default=100000, help="training steps (default: 100000)")
    p.add_argument("--no-job", action="store_true", help="start no training job")
    p.add_argument("--backend", choices=["auto", "sim", "nvml"], default="auto",
                   help="auto: real GPUs through NVML (one node, NCCL) when nvidia-smi finds "
                   "any, else simulated nodes")
    p.add_argument("--no-dashboard", action="store_true", help="start no dashboard")
    return p.parse_args(argv)


def main(argv: list[str] | None = None) -> int:
    args = parse_args(argv)
    gpus = count_gpus() if args.backend != "sim" else 0
    if args.backend == "nvml" and not gpus:
        print("demo: --backend nvml but nvidia-smi finds no GPU", file=sys.stderr)
        return 2
    if gpus:  # this machine's real GPUs: one node, one rank per GPU, NCCL chosen by torch
        args.backend, args.nodes, args.ranks_per_node, args.gpus_per_node = "nvml", 1, gpus, gpus
    else:
        args.backend = "sim"
    state: Path = args.state_dir.resolve()
    state.mkdir(parents=True, exist_ok=True)
    token_file = state / "agent-token"
    hook_token_file = state / "webhook-token"  # Alertmanager -> remediation receiver
    for f in (token_file, hook_token_file):
        if not f.exists():
            f.write_text(secrets.token_hex(32))
            f.chmod(0o600)
    prom_bin, am_bin = shutil.which("prometheus"), shutil.which("prometheus-alertmanager")
    if not prom_bin:
        print("demo: prometheus is not installed; run scripts/setup.sh", file=sys.stderr)
        return 2
    port = args.base_port
    prom_port, am_port, agent_ports = port + 90, port + 93, []
    if port + 97 > 65535:
        print("demo: --base-port too high", file=sys.stderr)
        return 2
    stack = Stack(state)
    stopping = False

    def on_signal(*_):
        nonlocal stopping
        stopping = True

    signal.signal(signal.SIGINT, on_signal)
    signal.signal(signal.SIGTERM, on_signal)
    try:
        for i in range(args.nodes):
            node = f"sim-node-{i}" if args.backend == "sim" else socket.gethostname()
            http = port + 2 * i
            agent_ports.append(http)
            extra = []
            if i == 0 and args.scenario != "none" and args.backend == "sim":
                extra = ["--scenario", args.scenario]
            stack.start(f"agent-{node}", [
                sys.executable, "-m", "agent", "--backend", args.backend, "--node", node,
                "--gpus", str(args.gpus_per_node), "--listen", f"127.0.0.1:{http}",
                "--telemetry", telemetry_socket(state, i), "--token-file", str(token_file),
                "--audit-log", str(state / "audit.jsonl"), *extra])
        rules = sorted((REPO / "deploy" / "prometheus").glob("*rules.yml"))
        config = (HERE / "prometheus.yml.tmpl").read_text().format(
            scrape_interval="2s",
            rule_files="\n".join(f"  - {r}" for r in rules) or "  []",
            alertmanager=f"127.0.0.1:{am_port}",
            agents=json.dumps([f"127.0.0.1:{p}" for p in agent_ports]),
        )
        (state / "prometheus.yml").write_text(config)
        stack.start("prometheus", [prom_bin, f"--config.file={state / 'prometheus.yml'}",
                                   f"--storage.tsdb.path={state / 'prometheus-data'}",
                                   f"--web.listen-address=127.0.0.1:{prom_port}"])
        remediation_port = port + 95
        am_config = state / "alertmanager.yml"  # the project's config, webhook on our port
        am_config.write_text((REPO / "deploy" / "alertmanager" / "alertmanager.yml").read_text()
                             .replace("127.0.0.1:19495", f"127.0.0.1:{remediation_port}")
                             .replace("/etc/clusterpulse/webhook-token", str(hook_token_file)))
        if am_bin:
            stack.start("alertmanager", [am_bin, f"--config.file={am_config}",
                                         f"--storage.path={state / 'alertmanager-data'}",
                                         f"--web.listen-address=127.0.0.1:{am_port}",
                                         "--cluster.listen-address="])
        urls = {f"agent {i}": f"http://127.0.0.1:{p}/metrics" for i, p in enumerate(agent_ports)}
        urls["prometheus"] = f"http://127.0.0.1:{prom_port}"
        if am_bin:
            urls["alertmanager"] = f"http://127.0.0.1:{am_port}"
        stack.start("remediation", [
            sys.executable, "-m", "dashboard.remediation", "--policy", str(HERE / "policy.toml"),
            "--listen", f"127.0.0.1:{remediation_port}", "--prometheus", urls["prometheus"],
            "--token-file", str(token_file), "--audit-log", str(state / "audit.jsonl"),
            "--webhook-token-file", str(hook_token_file),
            "--history", str(state / "alert-history.jsonl")])
        if not args.no_job:
            start_job(stack, args, state, port)
        password = None
        if not args.no_dashboard:
            password = operator_password(state)
            stack.start("dashboard", [
                sys.executable, "-m", "dashboard.cli", "--prometheus", urls["prometheus"],
                "--alertmanager", f"http://127.0.0.1:{am_port}", "--port", str(port + 80),
                "--token-file", str(token_file), "--operators-file",
                str(state / "operators.toml"), "--audit-log", str(state / "audit.jsonl")])
            urls["dashboard"] = f"http://127.0.0.1:{port + 80}"
        for name, url in urls.items():
            probe = {"dashboard": url + "/_stcore/health"}.get(
                name, url.replace("/metrics", "/healthz") if "agent" in name else url + "/-/ready")
            if not wait_http(probe, 60):
                print(f"demo: {name} did not come up; see logs in {state}", file=sys.stderr)
                return 1
        print("ClusterPulse local cluster is up:")
        for name, url in urls.items():
            print(f"  {name:12s} {url}")
        if password:
            print(f"  operator     name 'admin', password '{password}' (hash in "
                  f"{state / 'operators.toml'})")
        if not args.no_job:
            faults = ("none" if args.scenario == "none" else "rank 1 hangs at step 1500" + (
                ", GPU 1 of sim-node-0 overheats at 60 s, GPU 3 is lost at 240 s"
                if args.backend == "sim" else ""))
            print(f"  job          run 'demo', {args.nodes} node(s) x {args.ranks_per_node} "
                  f"ranks ({args.backend}); faults: {faults}")
        print(f"  logs         {state}\nPress Ctrl-C to stop.", flush=True)
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
        stack.stop()
        print("demo: stopped, no process left behind.", flush=True)


if __name__ == "__main__":
    raise SystemExit(main())
