"""A whole ClusterPulse stack on loopback for end-to-end tests: simulated-node agents
(real CLI processes), Prometheus with the project's rules, Alertmanager with the
project's config delivering to a webhook sink, and multi-node torchrun jobs."""

from __future__ import annotations

import contextlib
import os
import subprocess
import sys
from dataclasses import dataclass, field
from pathlib import Path

import requests

from deploy.local.stack import descendants
from tests.support.ports import free_port
from tests.support.procs import REPO, RULE_FILES, Alertmanager, Proc, Prometheus, start_agent_cli
from tests.support.webhook import WebhookSink

TOKEN = "e2e-token-0123456789abcdef0123"


@dataclass
class Node:
    name: str
    proc: Proc
    port: int
    telemetry: str  # unix:/PATH, what the node's ranks pass as --agent

    @property
    def url(self) -> str:
        return f"http://127.0.0.1:{self.port}"

    def post(self, path: str, body: dict) -> requests.Response:
        return requests.post(self.url + path, json=body, timeout=5,
                             headers={"Authorization": f"Bearer {TOKEN}"})


@dataclass
class Stack:
    tmp: Path
    nodes: list[Node] = field(default_factory=list)
    prom: Prometheus | None = None
    am: Alertmanager | None = None
    sink: WebhookSink | None = None
    jobs: list[subprocess.Popen] = field(default_factory=list)

    @classmethod
    def start(cls, tmp: Path, nodes: int = 2, gpus: int = 4,
              hang_timeout_s: int | None = None, extra_rules: list[Path] | None = None) -> Stack:
        """`hang_timeout_s`: the absolute hang timeout, set as an operator would (the
        `clusterpulse:config_hang_timeout_seconds` rule), instead of its 300 s.
        `extra_rules`: rule files loaded next to the project's (a benchmark's baseline)."""
        s = cls(tmp)
        token = tmp / "token"
        token.write_text(TOKEN)
        token.chmod(0o600)
        for i in range(nodes):
            name = f"node-{'abcdefgh'[i]}"
            proc, port, telemetry = start_agent_cli(tmp, name, gpus=gpus, token_file=token)
            s.nodes.append(Node(name, proc, port, telemetry))
        s.sink = WebhookSink()
        s.am = Alertmanager(tmp, s.sink.url)
        rules = list(RULE_FILES)
        if hang_timeout_s is not None:
            text, default = rules[0].read_text(), (
                "- record: clusterpulse:config_hang_timeout_seconds\n        expr: vector(300)")
            assert default in text, "the hang timeout rule moved"
            rules[0] = tmp / rules[0].name
            rules[0].write_text(text.replace(default, default.replace("300", str(hang_timeout_s))))
        s.prom = Prometheus(tmp, [f"127.0.0.1:{n.port}" for n in s.nodes],
                            rule_files=rules + (extra_rules or []),
                            alertmanager=f"127.0.0.1:{s.am.port}")
        return s

    def start_job(self, run: str, steps: int, ranks_per_node: int = 2,
                  trainer_args: list[str] | None = None) -> list[subprocess.Popen]:
        """One clusterpulse-train per node (c10d rendezvous on loopback, a fresh store per
        round, graceful restarts relaunched outside the failure budget), each rank
        sending telemetry to its node's agent, exactly as on a real two-node cluster.
        Returns the run's launchers (for stop_jobs)."""
        endpoint = f"127.0.0.1:{free_port()}"
        started = []
        for node in self.nodes:
            cmd = [sys.executable, "-m", "clusterpulse.trainer.launch",
                   "--nproc", str(ranks_per_node), "--nnodes", str(len(self.nodes)),
                   "--rdzv-endpoint", endpoint, "--rdzv-id", run, "--max-restarts", "2", "--",
                   "--preset", "tiny", "--steps", str(steps),
                   "--ckpt-dir", str(self.tmp / run), "--run-id", run,
                   "--agent", node.telemetry, *(trainer_args or [])]
            log = open(self.tmp / f"{run}-{node.name}.log", "wb")  # noqa: SIM115
            started.append(subprocess.Popen(
                cmd, cwd=self.tmp, stdout=log, stderr=subprocess.STDOUT, start_new_session=True,
                env={**os.environ, "OMP_NUM_THREADS": "1", "PYTHONPATH": str(REPO)}))
        self.jobs += started
        return started

    def firing(self, alertname: str) -> list[dict]:
        r = requests.get(self.prom.url + "/api/v1/alerts", timeout=5).json()
        return [a for a in r["data"]["alerts"]
                if a["labels"]["alertname"] == alertname and a["state"] == "firing"]

    def hang_evidence(self, run: str, window: str) -> str:
        """Each rank's hang inputs around the first hang alert of `run` in `window`, one
        line per rank and second: what a failed no-page assertion needs to be told
        apart (which phase, how old, against which threshold, how far behind)."""
        alerts = self.prom.query(
            f'ALERTS{{run="{run}",alertname=~"RankHung|JobStalled"}}[{window}]')
        if not alerts:
            return "no hang alert"
        first = min(float(a["values"][0][0]) for a in alerts)
        lines = [f"{a['metric']['alertname']} rank={a['metric'].get('rank', '-')} "
                 f"{a['metric']['alertstate']} from {float(a['values'][0][0]) - first:+.0f}s"
                 for a in alerts]
        series = {
            "phase": f'clusterpulse_trainer_phase{{run="{run}"}} == 1',
            "age": f'clusterpulse_trainer_heartbeat_age_seconds{{run="{run}"}}',
            "threshold": f'clusterpulse:rank_hang_threshold_seconds{{run="{run}"}}',
            "behind": f'clusterpulse:rank_collectives_behind{{run="{run}"}}',
            "alive": f'clusterpulse_trainer_process_alive{{run="{run}"}}',
        }
        for dt in range(-20, 3):
            rows: dict[tuple[str, str], dict[str, str]] = {}
            for name, expr in series.items():
                for r in self.prom.query(expr, at=first + dt):
                    m = r["metric"]
                    row = rows.setdefault((m.get("rank", "?"), m.get("node", "?")), {})
                    row[name] = m["phase"] if name == "phase" else r["value"][1][:6]
            lines += [f"{dt:+d}s rank {k[0]}@{k[1]} " + " ".join(
                f"{n}={v.get(n, '-')}" for n in series) for k, v in sorted(rows.items())]
        return "\n".join(lines)

    def stop_jobs(self, jobs: list[subprocess.Popen] | None = None) -> None:
        """As the local cluster stops: the launchers' groups, then every descendant still
        alive (a hung rank defers SIGTERM and sits in a session of its own, so a
        launcher killed before torchrun reaped it would orphan it). `jobs`: only these
        launchers (one run's, as start_job returned them); default: every job."""
        jobs = list(self.jobs if jobs is None else jobs)
        family = descendants([p.pid for p in jobs if p.poll() is None])
        for p in jobs:
            if p.poll() is None:
                os.killpg(p.pid, 15)
        for p in jobs:
            try:
                p.wait(timeout=20)
            except subprocess.TimeoutExpired:
                os.killpg(p.pid, 9)
                p.wait()
        self.jobs = [p for p in self.jobs if p not in jobs]
        for pid in family:
            with contextlib.suppress(ProcessLookupError):
                os.kill(pid, 9)

    def stop(self) -> None:
        self.stop_jobs()
        for part in (self.prom, self.am):
            if part is not None:
                part.stop()
        if self.sink is not None:
            self.sink.stop()
        for n in self.nodes:
            n.proc.stop()
