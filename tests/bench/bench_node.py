"""A production GPU node's worst day, with the whole pipeline acting on it (issue #25's
"done when"): healthy jobs' heartbeat age, loss and the actions taken against them, on
a node with a hung job, a flooding user, 8 sockets that never read and 200 veths;
baseline: the same healthy jobs alone on the node, in the same run.

    python -m tests.bench.bench_node [--seconds 40]      # or: make bench-node (root)

Real parts, all on this machine: the agent CLI (sim GPUs, 1 s collection) in a network
namespace of the benchmark's own (`ip netns exec` gives it that namespace's /sys),
Prometheus with the project's rules scraping and evaluating every 5 s as the deploy
files do (--scrape; its scrape timeout is the interval), Alertmanager with the
project's routing, and clusterpulse-remediate with the local cluster's policy
(deploy/local/policy.toml: RankHung -> hard restart, ...) acting on the agent with its
token. Each rank is a process of its job's uid (tests/bench/node_rank.py: what the
instrumentation sends, through the real AgentLink).

The hostile phase adds, before the healthy jobs start:
- 200 veths (100 pairs, one end of each up) in the agent's namespace, as a Kubernetes
  node's pods;
- a hung 8-rank job of another uid: it steps at 5/s, then after 3 s stops in the middle
  of a step (rank 0 before the all-reduce, the others in it), heartbeats going on and
  replies never read; when its ranks are killed it is started again (as torchrun
  does), to hang again;
- uid 65534 flooding junk and valid messages from 4 connections as fast as it can,
  and holding 8 connections that send a heartbeat every 0.1 s and never read.

Healthy jobs (both phases): `healthy-a` (uid 60001, 2 ranks at 10 steps/s) and
`healthy-b` (uid 60002, 2 ranks at 5 steps/s). What is reported, over a measured
window that starts once every part runs: their heartbeat age as the agent exports it
(/metrics read every 0.25 s) and as Prometheus stored it (every sample of its
scrapes, and the scrapes that failed); their messages lost (steps sent against the
agent's steps_total); the messages/s the agent took in; the receive loop's lag (read
the same two ways); every alert Prometheus had pending or firing, and every record of
the agent's and the policy's audit logs that names a healthy run (the budget: none).
The hung job is the policy's positive control: RankHung fires for it and the agent
restarts it; its second hang falls within the policy's rate limit.
"""

from __future__ import annotations

import argparse
import json
import os
import re
import signal
import statistics
import subprocess
import sys
import tempfile
import threading
import time
from pathlib import Path

import requests

from tests.bench.table import Row, render
from tests.support.ports import free_port
from tests.support.procs import (
    REPO,
    RULE_FILES,
    Alertmanager,
    Proc,
    Prometheus,
    start_agent_cli,
    wait_until,
)
from tests.support.ranksock import NEIGHBOURS, SYSTEM_PYTHON

VETH_PAIRS = 100
HEALTHY = [("healthy-a", 60001, 2, 10.0), ("healthy-b", 60002, 2, 5.0)]  # run, uid, ranks, Hz
HUNG = ("hung-job", 60003, 8, 5.0, 3.0)  # run, uid, ranks, Hz, seconds before it hangs
FLOOD_UID = 65534
POLICY = REPO / "deploy" / "local" / "policy.toml"
_SAMPLE = re.compile(r'^(\w+)\{([^}]*)\} (\S+)$')


def _rank(path: str, run: str, uid: int, rank: int, world: int, hz: float,
          hang_after: float | None = None, restarts: int = 0) -> subprocess.Popen:
    args = [SYSTEM_PYTHON, "-m", "tests.bench.node_rank", path, run, str(rank), str(world),
            str(hz), "--restarts", str(restarts)]
    if hang_after is not None:
        args += ["--hang-after", str(hang_after)]
    return subprocess.Popen(args, cwd=REPO, user=uid, group=uid, stdout=subprocess.PIPE,
                            stderr=subprocess.DEVNULL, text=True,
                            env={"PATH": "/usr/bin:/bin", "PYTHONPATH": str(REPO)})


class _HungJob:
    """A job that hangs, started again whenever all its ranks are gone (a restart)."""

    def __init__(self, path: str) -> None:
        self.path, self.attempts, self.procs = path, 0, []
        self._stop = threading.Event()
        self._start()
        self._watch = threading.Thread(target=self._watcher, daemon=True)
        self._watch.start()

    def _start(self) -> None:
        run, uid, ranks, hz, after = HUNG
        self.procs = [_rank(self.path, run, uid, r, ranks, hz, after, self.attempts)
                      for r in range(ranks)]
        self.attempts += 1

    def _watcher(self) -> None:
        while not self._stop.wait(0.5):
            if all(p.poll() is not None for p in self.procs):
                self._start()

    def stop(self) -> None:
        self._stop.set()
        self._watch.join()
        for p in self.procs:
            p.kill()
            p.wait()


def _metrics(port: int, took: list[float] | None = None
             ) -> list[tuple[str, dict[str, str], float]]:
    """The agent's samples; `took` gets the seconds /metrics took to answer."""
    t = time.perf_counter()
    text = requests.get(f"http://127.0.0.1:{port}/metrics", timeout=30).text
    if took is not None:
        took.append(time.perf_counter() - t)
    out = []
    for line in text.splitlines():
        m = _SAMPLE.match(line)
        if m:
            labels = dict(re.findall(r'(\w+)="([^"]*)"', m.group(2)))
            out.append((m.group(1), labels, float(m.group(3))))
    return out


def _healthy(labels: dict[str, str]) -> bool:
    return labels.get("run", "").startswith("healthy-")


def _p99(xs: list[float]) -> float:
    if len(xs) < 2:
        return xs[0] if xs else 0.0
    return statistics.quantiles(xs, n=100, method="inclusive")[98]


def _cpu_s(pid: int) -> float:
    with open(f"/proc/{pid}/stat") as f:
        fields = f.read().rsplit(")", 1)[1].split()
    return (int(fields[11]) + int(fields[12])) / os.sysconf("SC_CLK_TCK")


def _add_veths() -> int:
    cmds = [f"link add vA{i:03d} type veth peer name vB{i:03d}" for i in range(VETH_PAIRS)]
    cmds += [f"link set vA{i:03d} up" for i in range(VETH_PAIRS)]
    subprocess.run(["ip", "-batch", "-"], input="\n".join(cmds) + "\n", text=True,
                   check=True, capture_output=True)
    return sum(1 for n in os.listdir("/sys/class/net") if n.startswith("v"))


def phase(tmp: Path, hostile: bool, seconds: float, scrape: str = "5s") -> dict:
    """One node, its pipeline and its jobs for `seconds` measured; what it showed."""
    tmp.mkdir()
    token = tmp / "token"
    token.write_text("bench-node-token-0123456789abcdef")
    token.chmod(0o600)
    veths = _add_veths() if hostile else 0
    rport = free_port()
    agent, port, telemetry = start_agent_cli(tmp, "node-a", gpus=8, token_file=token,
                                             extra=["--interval", "1"])
    path = telemetry.removeprefix("unix:")
    am = Alertmanager(tmp, f"http://127.0.0.1:{rport}/alertmanager")
    prom = Prometheus(tmp, [f"127.0.0.1:{port}"], rule_files=list(RULE_FILES),
                      alertmanager=f"127.0.0.1:{am.port}", scrape_interval=scrape)
    policy = Proc([sys.executable, "-m", "clusterpulse.dashboard.remediation",
                   "--policy", str(POLICY), "--listen", f"127.0.0.1:{rport}",
                   "--prometheus", prom.url, "--token-file", str(token),
                   "--webhook-token-file", str(am.dir / "webhook-token"),
                   "--audit-log", str(tmp / "policy-audit.jsonl"),
                   "--history", str(tmp / "history.jsonl")], tmp / "policy.log", cwd=REPO)
    wait_until(lambda: requests.get(f"http://127.0.0.1:{rport}/healthz", timeout=1).ok, 20,
               "clusterpulse-remediate")
    flood = hung = None
    healthy: list[subprocess.Popen] = []
    result: dict = {"veths": veths}
    started = time.time()
    try:
        if hostile:
            flood = subprocess.Popen([SYSTEM_PYTHON, "-c", NEIGHBOURS, path,
                                      str(seconds + 60), "8", "4"], user=FLOOD_UID,
                                     stdout=subprocess.PIPE, text=True)
            assert flood.stdout is not None and flood.stdout.readline().strip() == "ready"
            hung = _HungJob(path)
            time.sleep(HUNG[4] + 2)  # it has hung
        for run, uid, ranks, hz in HEALTHY:
            healthy += [_rank(path, run, uid, r, ranks, hz) for r in range(ranks)]
        time.sleep(3)  # every healthy rank is stepping
        load0, cpu0 = os.getloadavg()[0], _cpu_s(agent.p.pid)
        t0 = time.time()
        msgs0 = sum(v for n, _, v in _metrics(port) if n == "clusterpulse_agent_telemetry_"
                    "messages_total")
        ages: list[float] = []
        lags: list[float] = []
        took: list[float] = []
        while time.time() - t0 < seconds:
            for name, labels, v in _metrics(port, took):
                if name == "clusterpulse_trainer_heartbeat_age_seconds" and _healthy(labels):
                    ages.append(v)
                elif name == "clusterpulse_agent_telemetry_receive_lag_seconds":
                    lags.append(v)
            time.sleep(0.25)
        t1 = time.time()
        samples = _metrics(port)
        msgs1 = sum(v for n, _, v in samples if n == "clusterpulse_agent_telemetry_"
                    "messages_total")
        counts = {lb["result"]: v for n, lb, v in samples
                  if n == "clusterpulse_agent_telemetry_messages_total"}
        cpu1, load1 = _cpu_s(agent.p.pid), os.getloadavg()[0]
        for p in healthy:  # each sends its exit event and says what it sent
            p.send_signal(signal.SIGTERM)
        sent = [json.loads(p.communicate(timeout=20)[0].splitlines()[-1]) for p in healthy]
        time.sleep(2)  # the exit events read, and scraped
        got = {(lb["run"], lb["rank"]): v for n, lb, v in _metrics(port)
               if n == "clusterpulse_trainer_steps_total" and _healthy(lb)}
        window = f"{int(t1 - t0)}s"

        def stored(expr: str) -> list[float]:
            return [float(v) for s in prom.query(f"{expr}[{window}]", at=t1)
                    for _, v in s["values"]]

        prom_ages = stored('clusterpulse_trainer_heartbeat_age_seconds{run=~"healthy-.*"}')
        prom_lags = stored("clusterpulse_agent_telemetry_receive_lag_seconds")
        scrapes = stored('up{job="clusterpulse"}')
        scrape_s = stored('scrape_duration_seconds{job="clusterpulse"}')
        alerts = sorted({(s["metric"]["alertname"], s["metric"].get("run", "-"),
                          s["metric"]["alertstate"])
                         for s in prom.query(f"ALERTS[{int(time.time() - started) + 2}s]")})
        records = []
        for log in (tmp / "node-a-audit.jsonl", tmp / "policy-audit.jsonl"):
            if log.exists():
                records += [json.loads(line) for line in log.read_text().splitlines()
                            if line.strip()]
        steps_sent = sum(s["steps_sent"] for s in sent)
        steps_got = sum(got.get((s["run"], str(s["rank"])), 0.0) for s in sent)
        result.update({
            "age_max": max(ages), "age_p99": _p99(ages), "age_samples": len(ages),
            "prom_age_max": max(prom_ages), "prom_age_p99": _p99(prom_ages),
            "prom_age_samples": len(prom_ages),
            "scrapes": len(scrapes), "scrapes_failed": scrapes.count(0.0),
            "scrape_max_s": max(scrape_s), "lag_max": max(lags), "prom_lag_max": max(prom_lags),
            "metrics_max_s": max(took), "metrics_p50_s": statistics.median(took),
            "steps_sent": steps_sent, "steps_got": steps_got,
            "loss_pct": 100.0 * (steps_sent - steps_got) / steps_sent,
            "send_failed": sum(s["send_failed"] for s in sent),
            "msgs_per_s": (msgs1 - msgs0) / (t1 - t0), "counts": counts,
            "agent_cpu_pct": 100.0 * (cpu1 - cpu0) / (t1 - t0),
            "load": [round(load0, 2), round(load1, 2)], "window_s": round(t1 - t0, 1),
            "alerts": alerts,
            "healthy_records": [r for r in records if str(r.get("run", "")).startswith(
                "healthy-") or "healthy-" in json.dumps(r)],
            "hung_records": [r for r in records if r.get("run") == HUNG[0]],
            "hung_attempts": hung.attempts if hung else 0,
        })
        return result
    finally:
        for p in healthy:
            if p.poll() is None:
                p.kill()
                p.wait()
        if hung is not None:
            hung.stop()
        if flood is not None:
            flood.kill()
            flood.wait()
        for part in (policy, prom, am, agent):
            part.stop()


def _inner(out: Path, seconds: float, scrape: str, phases: list[str]) -> None:
    """Inside the benchmark's namespace: the baseline, then the hostile node."""
    subprocess.run(["ip", "link", "set", "lo", "up"], check=True)
    with tempfile.TemporaryDirectory(prefix="bench-node-") as d:
        os.chmod(d, 0o755)
        out.write_text(json.dumps({name: phase(Path(d) / name, name == "hostile", seconds,
                                               scrape) for name in phases}))


def _rows(data: dict, scrape: str) -> list[Row]:
    b, h = data["baseline"], data["hostile"]
    base = "healthy jobs alone"
    what = f"hung 8-rank job + uid {FLOOD_UID} flood + 8 non-reading + {h['veths']} veths"
    at = f"Prometheus's {scrape} scrapes"
    return [
        Row(f"healthy jobs' heartbeat age, max, /metrics every 0.25 s: {what}",
            h["age_max"], "s", b["age_max"], base, "< 3 s"),
        Row("healthy jobs' heartbeat age, p99, /metrics every 0.25 s", h["age_p99"], "s",
            b["age_p99"], base, "< 3 s"),
        Row(f"healthy jobs' heartbeat age, max, {at}", h["prom_age_max"], "s",
            b["prom_age_max"], base, "< 3 s"),
        Row(f"healthy jobs' heartbeat age, p99, {at}", h["prom_age_p99"], "s",
            b["prom_age_p99"], base, "< 3 s"),
        Row("healthy jobs' lost messages", h["loss_pct"], "%", b["loss_pct"], base, "< 1 %"),
        Row("messages/s the agent took in", h["msgs_per_s"], "msg/s", b["msgs_per_s"], base),
        Row("receive loop lag, max, /metrics every 0.25 s", h["lag_max"], "s", b["lag_max"],
            base, "< 3 s"),
        Row(f"receive loop lag, max, {at}", h["prom_lag_max"], "s", b["prom_lag_max"], base,
            "< 3 s"),
        Row("/metrics answer, max", h["metrics_max_s"], "s", b["metrics_max_s"], base),
        Row(f"{at} failed", h["scrapes_failed"], f"of {h['scrapes']}", b["scrapes_failed"],
            base, "0"),
        Row("agent CPU", h["agent_cpu_pct"], "% core", b["agent_cpu_pct"], base),
        Row("alerts naming a healthy job (pending or firing)",
            sum(1 for a in h["alerts"] if a[1].startswith("healthy-")), "alerts",
            sum(1 for a in b["alerts"] if a[1].startswith("healthy-")), base, "0"),
        Row("audit records (agent + policy) naming a healthy job", len(h["healthy_records"]),
            "records", len(b["healthy_records"]), base, "0"),
    ]


def run(seconds: float = 40.0, scrape: str = "5s",
        phases: tuple[str, ...] = ("baseline", "hostile")) -> list[Row]:
    """Both phases in a network namespace of their own (root), removed with its veths."""
    if os.geteuid() != 0:
        raise RuntimeError("bench_node needs root: 200 veths in a network namespace, "
                           "ranks of other uids")
    ns = f"cp-bench-node-{os.getpid()}"
    subprocess.run(["ip", "netns", "add", ns], check=True)
    try:
        with tempfile.TemporaryDirectory() as d:
            out = Path(d) / "result.json"
            subprocess.run(["ip", "netns", "exec", ns, sys.executable, "-m",
                            "tests.bench.bench_node", "--inner", str(out),
                            "--seconds", str(seconds), "--scrape", scrape,
                            "--phases", ",".join(phases)], check=True, cwd=REPO,
                           timeout=4 * seconds + 240,
                           env={**os.environ, "PYTHONPATH": str(REPO)})
            data = json.loads(out.read_text())
    finally:
        subprocess.run(["ip", "netns", "delete", ns], check=False)  # the veths with it
    print(json.dumps(data, indent=1, default=str), file=sys.stderr)
    return _rows(data, scrape) if len(data) == 2 else []


def main() -> int:
    p = argparse.ArgumentParser(description=__doc__,
                                formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--seconds", type=float, default=40.0, help="measured window per phase")
    p.add_argument("--scrape", default="5s",
                   help="Prometheus's scrape and evaluation interval (the deploy files': 5s)")
    p.add_argument("--phases", default="baseline,hostile", help=argparse.SUPPRESS)
    p.add_argument("--inner", type=Path, help=argparse.SUPPRESS)
    a = p.parse_args()
    phases = a.phases.split(",")
    if a.inner is not None:
        _inner(a.inner, a.seconds, a.scrape, phases)
        return 0
    print(render(run(a.seconds, a.scrape, tuple(phases))))
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
