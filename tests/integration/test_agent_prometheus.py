"""A real Prometheus scrapes the real agent CLI; PromQL sees every core series."""

import shutil
import subprocess

import pytest
import requests

from clusterpulse.agent.exporter import GPU_SERIES
from tests.support.procs import Prometheus, start_agent_cli, wait_until

pytestmark = pytest.mark.integration

CORE_GPU = [
    "clusterpulse_gpu_up", "clusterpulse_gpu_info", "clusterpulse_gpu_clock_event_active",
    "clusterpulse_gpu_ecc_errors_total",
    *[f"clusterpulse_{name}{'_total' if counter else ''}" for _, name, _, counter in GPU_SERIES],
]


def test_prometheus_scrapes_every_core_gpu_metric_for_every_gpu(tmp_path):
    agent, port, _ = start_agent_cli(tmp_path, "node-x", gpus=8)
    prom = Prometheus(tmp_path, [f"127.0.0.1:{port}"])
    try:
        wait_until(lambda: len(prom.query("clusterpulse_gpu_up")) == 8, 30, "8 GPUs scraped")
        for name in CORE_GPU:
            result = prom.query(name)
            gpus = {s["metric"]["gpu"] for s in result}
            assert gpus == {str(i) for i in range(8)}, f"{name}: {gpus}"
            for s in result:
                m = s["metric"]
                assert m["node"] == "node-x" and m["uuid"].startswith("GPU-"), name
        info = prom.query("clusterpulse_gpu_info")[0]["metric"]
        assert info["model"].startswith("NVIDIA") and info["pci_bus_id"]
        assert prom.query('clusterpulse_agent_build_info{backend="sim"}')
        assert prom.query("up{job='clusterpulse'}")[0]["value"][1] == "1"
    finally:
        prom.stop()
        agent.stop()


def test_promtool_check_metrics_finds_nothing(tmp_path):
    agent, port, _ = start_agent_cli(tmp_path, "node-y", gpus=2)
    try:
        text = requests.get(f"http://127.0.0.1:{port}/metrics", timeout=5).text
        promtool = shutil.which("promtool")
        assert promtool, "promtool is not installed (the test command installs it)"
        r = subprocess.run([promtool, "check", "metrics"], input=text, capture_output=True,
                           text=True, timeout=30)
        assert r.returncode == 0 and r.stdout.strip() == "" and r.stderr.strip() == "", r
    finally:
        agent.stop()


def test_agent_cli_rejects_bad_input_with_a_clear_message(tmp_path):
    import sys

    from tests.conftest import _has_nvidia_gpu
    from tests.support.procs import REPO

    def run(*args):
        return subprocess.run([sys.executable, "-m", "clusterpulse.agent", *args],
                              capture_output=True, text=True, cwd=REPO, timeout=60)

    if not _has_nvidia_gpu():
        r = run("--backend", "nvml")
        assert r.returncode == 2 and "NVML could not start" in r.stderr
        assert "Traceback" not in r.stderr
    r = run("--backend", "sim", "--listen", "nowhere")
    assert r.returncode == 2 and "--listen must be HOST:PORT" in r.stderr
    bad = tmp_path / "token"
    bad.write_text("short")
    r = run("--backend", "sim", "--token-file", str(bad))
    assert r.returncode == 2 and "shorter than 16" in r.stderr
    r = run("--backend", "sim", "--scenario", str(tmp_path / "nope.toml"))
    assert r.returncode == 2 and "cannot read scenario" in r.stderr
    r = run("--help")
    assert r.returncode == 0 and "examples:" in r.stdout


def test_fault_observer_counts_only_live_rank_processes(tmp_path):
    """An exited rank's entry stays exported for its grace period; the chaos and demo
    observer must not count it as a process still running (it held recovery back)."""
    from clusterpulse.dashboard.remediation import Policy
    from deploy.testbed.faults import Observer
    from tests.support.ranksock import RankProcess

    agent, port, telemetry = start_agent_cli(tmp_path, "node-z", gpus=2)
    prom = Prometheus(tmp_path, [f"127.0.0.1:{port}"])
    path = telemetry[len("unix:"):]
    step = {"type": "step", "run": "r", "step": 5, "world_size": 2}
    try:
        with RankProcess(path, [{**step, "rank": 0, "local_rank": 0}]) as live:
            gone = RankProcess(path, [{**step, "rank": 1, "local_rank": 1}])
            gone.stop()
            wait_until(lambda: prom.query('clusterpulse_trainer_process_alive{rank="1"} == 0'),
                       30, "rank 1's exit exported")
            assert len(prom.query('clusterpulse_trainer_rank_info{run="r"}')) == 2
            obs = Observer(prom.url, tmp_path / "audit.jsonl", "r", Policy([]))
            assert obs.pids() == {str(live.pid)}
    finally:
        prom.stop()
        agent.stop()
