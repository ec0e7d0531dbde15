"""Real processes for integration tests: agents, Prometheus, Alertmanager on loopback."""

from __future__ import annotations

import json
import shutil
import subprocess
import sys
import time
from collections.abc import Callable
from pathlib import Path
from types import ModuleType

from tests.support.ports import free_port

REPO = Path(__file__).resolve().parents[2]
# The project's Prometheus rules, as every real Prometheus in the tests loads them.
RULE_FILES = (REPO / "deploy" / "prometheus" / "clusterpulse.rules.yml",
              REPO / "deploy" / "prometheus" / "alerts.rules.yml")


def _http() -> ModuleType:
    """requests, imported when a process is first queried: tests/gpu import REPO from
    here on the GPU machine, whose python has torch and pytest but no requests."""
    import requests

    return requests


def wait_until(check: Callable[[], object], timeout: float, what: str, interval: float = 0.2):
    """Poll `check` until it returns something truthy; fail naming `what`."""
    deadline = time.monotonic() + timeout
    last_err: Exception | None = None
    while time.monotonic() < deadline:
        try:
            result = check()
            if result:
                return result
        except Exception as err:
            last_err = err
        time.sleep(interval)
    raise AssertionError(f"timed out after {timeout}s waiting for {what}; last error: {last_err}")


def wait_for_text(path: Path, text: str, timeout: float, what: str) -> None:
    """Wait until the log at `path` says `text`; on a timeout the failure shows the
    log's end (a cold-started job that never reached step 20 on a clean machine left
    only "timed out waiting for training" to go on)."""
    try:
        wait_until(lambda: text in path.read_text(errors="replace"), timeout, what)
    except AssertionError as err:
        tail = path.read_text(errors="replace")[-3000:] if path.exists() else "(no log)"
        raise AssertionError(f"{err}\n--- the end of {path} ---\n{tail}") from None


class Proc:
    def __init__(self, args: list[str], log: Path, **kw) -> None:
        self.args = args
        self.log_path = log
        self._log = open(log, "ab")  # noqa: SIM115 - lives as long as the process
        self.p = subprocess.Popen(args, stdout=self._log, stderr=subprocess.STDOUT, **kw)

    def stop(self) -> None:
        if self.p.poll() is None:
            self.p.terminate()
            try:
                self.p.wait(timeout=10)
            except subprocess.TimeoutExpired:
                self.p.kill()
                self.p.wait()
        self._log.close()

    def output(self) -> str:
        return self.log_path.read_text(errors="replace")

    def wait_ready(self, url: str, timeout: float, what: str) -> None:
        """Poll `url` until it answers 2xx. A process that exits first fails at once,
        and either failure shows the end of its log: CI once reported only "connection
        refused" for an agent that had died at start."""
        def ready() -> object:
            if self.p.poll() is not None:
                return "exited"
            return _http().get(url, timeout=1).ok

        try:
            exited = wait_until(ready, timeout, what) == "exited"
        except AssertionError as err:
            raise AssertionError(f"{err}\n--- the end of {self.log_path} ---\n"
                                 f"{self.output()[-3000:]}") from None
        if exited:
            raise AssertionError(f"{what}: the process exited ({self.p.returncode}) first"
                                 f"\n--- the end of {self.log_path} ---\n"
                                 f"{self.output()[-3000:]}")


def start_agent_cli(tmp: Path, node: str, gpus: int = 4, token_file: Path | None = None,
                    extra: list[str] | None = None,
                    module: str = "clusterpulse.agent") -> tuple[Proc, int, str]:
    """An agent process; returns it, its HTTP port and its telemetry address
    (unix:/PATH, what ranks pass as --agent). `module`: what `python -m` runs, e.g.
    tests.fakes.nvml_agent for the agent over the fake NVML."""
    from tests.conftest import socket_path

    port, telemetry = free_port(), f"unix:{socket_path(node)}"
    args = [sys.executable, "-m", module, "--backend", "sim", "--node", node,
            "--gpus", str(gpus), "--listen", f"127.0.0.1:{port}",
            "--telemetry", telemetry, "--interval", "0.5",
            "--audit-log", str(tmp / f"{node}-audit.jsonl")]
    if token_file:
        args += ["--token-file", str(token_file)]
    proc = Proc(args + (extra or []), tmp / f"agent-{node}.log", cwd=REPO)
    proc.wait_ready(f"http://127.0.0.1:{port}/healthz", 20, f"agent {node} healthz")
    return proc, port, telemetry


class Prometheus:
    """A real Prometheus on loopback. `shipped`: with deploy/prometheus/prometheus.example.yml
    as shipped (its intervals and jobs: the agent at 5 s, the ranks' progress at 1 s),
    only its targets, rule files and Alertmanager replaced; otherwise one job at
    `scrape_interval`."""

    def __init__(self, tmp: Path, targets: list[str], rule_files: list[Path] | None = None,
                 alertmanager: str | None = None, scrape_interval: str = "1s",
                 shipped: bool = False, labels: dict[str, dict[str, str]] | None = None,
                 metric_relabel: list[dict] | None = None) -> None:
        binary = shutil.which("prometheus")
        assert binary, "prometheus is not installed (the test command installs it)"
        self.port = free_port()
        self.url = f"http://127.0.0.1:{self.port}"
        self.dir = tmp / f"prom-{self.port}"
        self.dir.mkdir()
        if shipped:
            self._write_shipped(targets, rule_files or [], alertmanager)
        else:
            self._write(targets, rule_files, alertmanager, scrape_interval, labels or {},
                        metric_relabel or [])
        self.args = [binary, f"--config.file={self.dir / 'prometheus.yml'}",
                     f"--storage.tsdb.path={self.dir / 'data'}",
                     f"--web.listen-address=127.0.0.1:{self.port}", "--web.enable-lifecycle"]
        self.start()

    def _write_shipped(self, targets: list[str], rule_files: list[Path],
                       alertmanager: str | None) -> None:
        import yaml

        cfg = yaml.safe_load((REPO / "deploy" / "prometheus" / "prometheus.example.yml")
                             .read_text())
        cfg["rule_files"] = [str(p) for p in rule_files]
        if alertmanager:
            cfg["alerting"] = {"alertmanagers": [{"static_configs": [
                {"targets": [alertmanager]}]}]}
        else:
            del cfg["alerting"]
        cfg["scrape_configs"] = [job for job in cfg["scrape_configs"]
                                 if job["job_name"] != "remediation"]
        for job in cfg["scrape_configs"]:
            job["static_configs"] = [{"targets": targets}]
        (self.dir / "prometheus.yml").write_text(yaml.safe_dump(cfg))

    def _write(self, targets: list[str], rule_files: list[Path] | None,
               alertmanager: str | None, scrape_interval: str,
               labels: dict[str, dict[str, str]], metric_relabel: list[dict]) -> None:
        """`labels`: target -> the labels its static_config gives it (target labels, as an
        operator's scrape configuration or service discovery sets them);
        `metric_relabel`: the job's metric_relabel_configs."""
        lines = [
            "global:", f"  scrape_interval: {scrape_interval}",
            f"  evaluation_interval: {scrape_interval}",
        ]
        if rule_files:
            lines += ["rule_files:"] + [f"  - {p}" for p in rule_files]
        if alertmanager:
            lines += ["alerting:", "  alertmanagers:", "    - static_configs:",
                      f"        - targets: ['{alertmanager}']"]
        lines += ["scrape_configs:", "  - job_name: clusterpulse", "    static_configs:"]
        plain = [t for t in targets if t not in labels]
        lines += [f"      - targets: {plain!r}"] if plain or not labels else []
        lines += [f"      - {{targets: ['{t}'], labels: {json.dumps(labels[t])}}}"
                  for t in targets if t in labels]
        if metric_relabel:
            lines += [f"    metric_relabel_configs: {json.dumps(metric_relabel)}"]
        (self.dir / "prometheus.yml").write_text("\n".join(lines) + "\n")

    def start(self) -> None:
        """(Re)start on the same port and data: an outage the dashboard must survive."""
        self.proc = Proc(self.args, self.dir / "prometheus.log")
        self.proc.wait_ready(self.url + "/-/ready", 30, "prometheus ready")

    def query(self, promql: str, at: float | None = None) -> list[dict]:
        """An instant query, now or at unix time `at`."""
        params = {"query": promql} if at is None else {"query": promql, "time": at}
        r = _http().get(self.url + "/api/v1/query", params=params, timeout=5)
        r.raise_for_status()
        return r.json()["data"]["result"]

    def stop(self) -> None:
        self.proc.stop()


class Alertmanager:
    """A real Alertmanager on loopback, with the project's config (or `config`), webhook
    URLs pointed at `webhook_url`."""

    def __init__(self, tmp: Path, webhook_url: str, config: str | None = None) -> None:
        binary = shutil.which("prometheus-alertmanager") or shutil.which("alertmanager")
        assert binary, "prometheus-alertmanager is not installed (the test command installs it)"
        self.port = free_port()
        self.url = f"http://127.0.0.1:{self.port}"
        self.dir = tmp / f"am-{self.port}"
        self.dir.mkdir()
        config = config or (REPO / "deploy" / "alertmanager" / "alertmanager.yml").read_text()
        config = config.replace("http://127.0.0.1:19495/alertmanager", webhook_url)
        config = config.replace("http://127.0.0.1:19496/page", webhook_url + "?oncall=1")
        # the remediation webhook's credentials, as clusterpulse-remediate would check them
        self.webhook_token = "test-webhook-token-0123456789"
        token_file = self.dir / "webhook-token"
        token_file.write_text(self.webhook_token)
        token_file.chmod(0o600)
        config = config.replace("/etc/prometheus/clusterpulse-webhook-token", str(token_file))
        (self.dir / "alertmanager.yml").write_text(config)
        self.proc = Proc([binary, f"--config.file={self.dir / 'alertmanager.yml'}",
                          f"--storage.path={self.dir / 'data'}",
                          f"--web.listen-address=127.0.0.1:{self.port}",
                          "--cluster.listen-address="], self.dir / "alertmanager.log")
        self.proc.wait_ready(self.url + "/-/ready", 30, "alertmanager ready")

    def alerts(self) -> list[dict]:
        r = _http().get(self.url + "/api/v2/alerts", timeout=5)
        r.raise_for_status()
        return r.json()

    def stop(self) -> None:
        self.proc.stop()
