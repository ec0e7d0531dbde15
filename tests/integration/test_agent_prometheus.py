"""A real Prometheus scrapes the real agent CLI; PromQL sees every core series."""

import subprocess
import time

import pytest
import requests

from clusterpulse.agent.exporter import GPU_SERIES
from tests.support.procs import Prometheus, start_agent_cli, wait_until
from tests.support.promtool import metrics_are_clean

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
        metrics_are_clean(text)
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
    observer must not count it as a process still running (it held recovery back), nor
    its last step as the run's (after an elastic restart renumbered the ranks, it hid
    where the job resumed from: a node death "recomputed 0 steps", 18 in the logs)."""
    from clusterpulse.dashboard.remediation import Policy
    from deploy.testbed.faults import Observer
    from tests.support.ranksock import RankProcess

    agent, port, telemetry = start_agent_cli(tmp_path, "node-z", gpus=2)
    prom = Prometheus(tmp_path, [f"127.0.0.1:{port}"])
    path = telemetry[len("unix:"):]
    step = {"type": "step", "run": "r", "step": 5, "world_size": 2}
    try:
        with RankProcess(path, [{**step, "rank": 0, "local_rank": 0}]) as live:
            gone = RankProcess(path, [{**step, "rank": 1, "local_rank": 1, "step": 9}])
            gone.stop()
            wait_until(lambda: prom.query('clusterpulse_trainer_process_alive{rank="1"} == 0'),
                       30, "rank 1's exit exported")
            assert len(prom.query('clusterpulse_trainer_rank_info{run="r"}')) == 2
            obs = Observer(prom.url, tmp_path / "audit.jsonl", "r", Policy([]))
            assert obs.pids() == {str(live.pid)}
            assert obs.step() == 5
    finally:
        prom.stop()
        agent.stop()


def test_fault_observer_does_not_take_the_steps_before_a_stall_for_recovery(tmp_path):
    """A partition stalls the job; polled right after the fault, the steps of the second
    before it used to read as "stepping again" (the chaos run reported a partition
    recovered in 0.01 s). Recovery is judged from samples taken after the fault, and
    comes only when the job steps again after the stall."""
    from clusterpulse.agent import protocol
    from clusterpulse.dashboard.remediation import Policy
    from deploy.testbed.faults import Fault, Observer, Outcome
    from tests.support.ranksock import connect

    agent, port, telemetry = start_agent_cli(tmp_path, "node-p", gpus=1)
    prom = Prometheus(tmp_path, [f"127.0.0.1:{port}"])
    sock = connect(telemetry[len("unix:"):])
    step = 0

    def advance(seconds: float) -> None:
        nonlocal step
        end = time.time() + seconds
        while time.time() < end:
            step += 1
            sock.send(protocol.encode({"type": "step", "run": "p", "rank": 0, "local_rank": 0,
                                       "world_size": 1, "step": step}))
            time.sleep(0.1)

    obs = Observer(prom.url, tmp_path / "audit.jsonl", "p", Policy([]))
    try:
        deadline = time.time() + 30
        while obs.step() is None and time.time() < deadline:
            advance(0.5)  # until Prometheus has the run's steps
        advance(2.5)  # stepping right up to the fault
        o = Outcome(Fault("partition", 0, seconds=30, at=time.time()))
        stalled_at = step
        for _ in range(12):  # polled as the chaos loop does, from right after the fault
            obs.update(o, "node-p")
            assert o.recovered_at is None, "recovered before the stall was even detected"
            time.sleep(0.25)
        o.detected_at = o.fault.at + 1  # NodeAgentDown (the rules are not loaded here)
        time.sleep(3)  # the stall, seen for seconds after the detection
        obs.update(o, "node-p")
        assert o.recovered_at is None, "recovered while the job is stalled"
        advance(3)
        wait_until(lambda: (obs.update(o, "node-p"), o.recovered_at)[1], 30, "recovery seen")
        assert o.recovered_at > o.fault.at + 3
        # same process, nothing recomputed: it went on from the last step Prometheus
        # had before the fault (how far that lags the rank's own step is the scrape's
        # timing: 11 steps on a loaded machine failed a bound of 10)
        assert o.recomputed == 0 and 0 < o.step_at_fault <= o.resumed_from <= stalled_at
    finally:
        sock.close()
        prom.stop()
        agent.stop()
