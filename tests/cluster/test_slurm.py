"""A real Slurm on the testbed (munged, slurmctld on the bridge, one slurmd per node
namespace) running deploy/slurm/train.sbatch: the job with its agents on every node,
preemption with a checkpoint and a requeue that resumes, and a failing GPU that drains
its node (health check) and moves the job to the remaining nodes (drain-node).

One Slurm for the module; nodes run a "service" agent on :9400 (as the systemd unit
would), which the HealthCheckProgram reads."""

from __future__ import annotations

import json
import os
import shutil
import socket
import sys
from pathlib import Path

import pytest
import requests
from prometheus_client.parser import text_string_to_metric_families

from clusterpulse.agent.audit import AuditLog
from clusterpulse.dashboard.promclient import PrometheusClient
from clusterpulse.dashboard.remediation import Policy, Remediator
from clusterpulse.trainer.checkpoint import find_latest_valid
from clusterpulse.trainer.torchrun import PORT_RANGE
from deploy.testbed.slurm import SlurmCluster, unavailable
from tests.support.procs import REPO, wait_until
from tests.support.promstub import AlertsPrometheus

pytestmark = [pytest.mark.cluster, pytest.mark.slow]
TOKEN = "slurm-testbed-token-0123456789"
SBATCH = REPO / "deploy/slurm/train.sbatch"
VENV = Path(sys.executable).parent.parent
LONG_JOB = "--preset tiny --steps 400 --ckpt-every 10 --log-every 5 --sim-compute-seconds 0.1"
DONE = ("COMPLETED", "FAILED", "CANCELLED", "TIMEOUT", "NODE_FAIL", "OUT_OF_MEMORY")
HEALTH_INTERVAL = 5  # s: slurm.conf HealthCheckInterval


@pytest.fixture(scope="module")
def slurm(bed, tmp_path_factory):
    reason = unavailable()
    if reason:
        pytest.skip(f"Slurm unavailable: {reason}")
    run: Path = tmp_path_factory.mktemp("slurm")
    token = run / "token"
    token.write_text(TOKEN)
    token.chmod(0o600)
    for n in bed.nodes:
        n.spawn([sys.executable, "-m", "clusterpulse.agent", "--backend", "sim", "--gpus", "2",
                 "--node", n.name, "--listen", "0.0.0.0:9400", "--telemetry",
                 "127.0.0.1:9401", "--interval", "0.5", "--token-file", str(token)],
                log=run / f"service-agent-{n.name}.log", cwd=REPO)
    for n in bed.nodes:
        wait_until(lambda n=n: requests.get(f"http://{n.ip}:9400/healthz", timeout=2).ok,
                   60, f"service agent on {n.name}")
    cluster = SlurmCluster.on_testbed(bed, run / "slurm",
                                      health_check_agent="http://127.0.0.1:9400",
                                      health_interval=HEALTH_INTERVAL, kill_wait=30)
    yield cluster
    cluster.stop()


@pytest.fixture(autouse=True)
def no_job_left(slurm):
    """A failed test must not leave its job holding nodes the next test needs."""
    yield
    slurm.run("scancel", "--partition=main", check=False)
    wait_until(lambda: not slurm.run("squeue", "-h", check=False).strip(), 120,
               "the queue to empty")


def submit(slurm: SlurmCluster, name: str, nodes: int, train_args: str,
           **env: str) -> tuple[str, Path, Path]:
    out, ckpt = slurm.run_dir / f"{name}.out", slurm.run_dir / f"ckpt-{name}"
    # The job inherits the test's environment (sbatch --export=ALL) plus these.
    job_env = {"VENV": str(VENV), "CKPT": str(ckpt), "NPROC": "1", "TRAIN_ARGS": train_args,
               "AGENT_ARGS": "--backend sim --gpus 2 --interval 0.5",
               "CLUSTERPULSE_AGENT_TOKEN_FILE": "/nonexistent", **env}
    job = slurm.sbatch(SBATCH, f"--nodes={nodes}", f"--job-name={name}", f"--output={out}",
                       f"--chdir={slurm.run_dir}", env=job_env)
    return job, out, ckpt


def wait_state(slurm: SlurmCluster, job: str, states: tuple[str, ...], timeout: float,
               out: Path) -> dict:
    try:
        return wait_until(lambda: (j := slurm.job(job)).get("JobState") in states and j,
                          timeout, f"job {job} in {states}", interval=1)
    except AssertionError as err:
        text = out.read_text(errors="replace")[-3000:] if out.exists() else "(no output)"
        raise AssertionError(f"{err}\njob: {slurm.job(job)}\noutput:\n{text}") from None


def resumed_step(slurm: SlurmCluster, job: str, out: Path) -> int:
    """The step the requeued run resumed from, once it has trained past it."""
    def check() -> int | None:
        lines = out.read_text(errors="replace").splitlines()
        at = [i for i, line in enumerate(lines) if "trainer: resumed from" in line]
        if at and any(line.startswith("trainer: step ") for line in lines[at[-1]:]):
            return int(lines[at[-1]].split("(step ")[1].split(",")[0])
        return None

    try:
        return wait_until(check, 300, f"job {job} to resume and train on", interval=1)
    except AssertionError as err:
        raise AssertionError(f"{err}\n{out.read_text(errors='replace')[-3000:]}") from None


def _samples(ip: str, port: int, name: str) -> list[dict[str, str]]:
    text = requests.get(f"http://{ip}:{port}/metrics", timeout=2).text
    return [s.labels for f in text_string_to_metric_families(text) for s in f.samples
            if s.name == name]


def gpu_processes(ip: str, port: int) -> list[dict[str, str]]:
    return _samples(ip, port, "clusterpulse_gpu_process_info")


def rank_pids(ip: str, port: int) -> set[str]:
    return {r["pid"] for r in _samples(ip, port, "clusterpulse_trainer_rank_info")}


def port_open(ip: str, port: int) -> bool:
    with socket.socket() as s:
        s.settimeout(1)
        return s.connect_ex((ip, port)) == 0


def test_slurmctld_listens_on_a_port_no_outgoing_connection_is_handed(slurm):
    """slurmctld binds its port on every address after the testbed chose it; a port from
    the kernel's ephemeral range could go to any outgoing connection meanwhile (CI lost
    every Slurm test to "Address already in use" so)."""
    ephemeral_low = int(PORT_RANGE.read_text().split()[0])
    assert slurm.ctl_port < ephemeral_low, (slurm.ctl_port, ephemeral_low)
    assert f"SlurmctldPort={slurm.ctl_port}" in slurm.conf.read_text()


def test_sbatch_runs_agent_step_and_torchrun_on_every_node(slurm, bed):
    # Another user made the socket directories this job's agents used to take (job ids
    # are sequential): `mkdir -p` took them, the agents refused them, and the job ran
    # unmonitored. The job's directory is now named with a nonce.
    config = slurm.run("scontrol", "show", "config")
    next_id = int(config.split("NEXT_JOB_ID", 1)[1].split("=", 1)[1].split()[0])
    squatted = [Path(f"/tmp/clusterpulse-{next_id}-{n.name}") for n in bed.nodes]
    for d in squatted:  # (a machine that ran Slurm before may hold one: the same)
        d.mkdir(exist_ok=True)
        d.chmod(0o755)
        os.chown(d, 65534, 65534)
    try:
        job, out, ckpt = submit(slurm, "basic", 2, "--preset tiny --steps 20 "
                                "--ckpt-every 10 --sim-compute-seconds 0.1", AGENT_PORT="9410")
        assert job == str(next_id)
        _runs_agent_step_and_torchrun_on_every_node(slurm, bed, job, out, ckpt)
    finally:
        for d in squatted:
            shutil.rmtree(d, ignore_errors=True)


def _runs_agent_step_and_torchrun_on_every_node(slurm, bed, job: str, out: Path,
                                               ckpt: Path) -> None:
    info = wait_state(slurm, job, ("RUNNING",), 120, out)
    nodes = {n.name: n for n in bed.nodes}
    allocated = slurm.hostnames(info["NodeList"])
    assert len(allocated) == 2
    # The job's own agent (its step, port 9410) on each node sees that node's rank.
    for name in allocated:
        wait_until(lambda name=name: f'run="basic-{job}"' in requests.get(
            f"http://{nodes[name].ip}:9410/metrics", timeout=2).text, 120,
            f"rank of the job reported by the agent step on {name}")
        # Every process on a GPU is attributed to its user and Slurm job, read from the
        # kernel (/proc/PID/status, /proc/PID/cgroup): the simulator lists the rank's
        # process as a driver would, the cgroup slurmstepd put it in is real.
        procs = wait_until(lambda name=name: gpu_processes(nodes[name].ip, 9410), 60,
                           f"the rank's process on a GPU of {name}")
        ranks = rank_pids(nodes[name].ip, 9410)
        assert {p["pid"] for p in procs} == ranks, (procs, ranks)
        # proctrack/linuxproc (no writable cgroups on the machine) puts no job in a cgroup
        in_job = job if slurm.proctrack == "cgroup" else ""
        assert all(p["slurm_job"] == in_job and p["uid"] == "0" and p["user"] == "root"
                   for p in procs), procs
    info = wait_state(slurm, job, DONE, 240, out)
    text = out.read_text()
    assert info["JobState"] == "COMPLETED", text[-3000:]
    summary = json.loads((ckpt / "summary.json").read_text())
    assert summary["world_size"] == 2 and summary["steps"] == 20
    # Slurm tracked the agent as a step and ended it with the job: nothing leaks.
    for name in allocated:
        assert not port_open(nodes[name].ip, 9410), f"agent step outlived the job on {name}"
        assert not bed.find(nodes[name], "--listen", "0.0.0.0:9410")


def test_usr1_before_time_limit_requeues_and_resumes_from_checkpoint(slurm):
    job, out, ckpt = submit(slurm, "preempt", 2, LONG_JOB, CLUSTERPULSE_AGENT_SERVICE="1")
    wait_state(slurm, job, ("RUNNING",), 120, out)
    wait_until(lambda: (f := find_latest_valid(ckpt)) and f.step >= 20, 420,
               "a checkpoint at step >= 20")
    before = find_latest_valid(ckpt).step
    # What --signal=B:USR1@120 delivers 120 s before the time limit, sent now.
    slurm.run("scancel", "--batch", "--signal=USR1", job)
    wait_until(lambda: int(slurm.job(job).get("Restarts", "0")) >= 1, 120, "the requeue")
    step = resumed_step(slurm, job, out)
    # Resumed past the last periodic checkpoint: the ranks saved on SIGTERM, within the
    # KillWait grace (no step done before the signal is recomputed).
    assert step > before >= 20
    assert "USR1: time limit or preemption near, requeueing" in out.read_text()
    # Proven; the remaining steps would only cost CI time, and so would a graceful
    # cancel's SIGTERM checkpoint (up to KillWait): SIGKILL the steps and the script.
    slurm.run("scancel", "--signal=KILL", job)
    wait_state(slurm, job, DONE, 120, out)


def test_failing_gpu_drains_node_and_requeued_job_runs_on_the_rest(slurm, bed, monkeypatch):
    nodes = {n.name: n for n in bed.nodes}
    job, out, ckpt = submit(slurm, "drain", 2, LONG_JOB, CLUSTERPULSE_AGENT_SERVICE="1")
    info = wait_state(slurm, job, ("RUNNING",), 180, out)
    first = slurm.hostnames(info["NodeList"])
    wait_until(lambda: (f := find_latest_valid(ckpt)) and f.step >= 10, 420,
               "a checkpoint at step >= 10")
    bad = nodes[first[1]]
    r = requests.post(f"http://{bad.ip}:9400/v1/faults", json={"kind": "gpu_lost", "gpu": 1},
                      headers={"Authorization": f"Bearer {TOKEN}"}, timeout=5)
    assert r.status_code == 200, r.text
    # slurmd's HealthCheckProgram (clusterpulse-healthcheck --drain) drains the node.
    wait_until(lambda: "drain" in slurm.run("sinfo", "-h", "-n", bad.name, "-o", "%T"), 90,
               f"{bad.name} drained by its health check")
    assert slurm.node_reason(bad.name).startswith("clusterpulse: GPU 1 down")
    # The alert's remediation (deploy/slurm/policy.toml: GpuDown -> drain-node, requeue).
    audit = AuditLog(slurm.run_dir / "audit.jsonl")
    policy = Policy.load(REPO / "deploy/slurm/policy.toml")
    # The receiver re-checks in Prometheus that the alert fires before it acts; this
    # testbed runs no Prometheus (the rules are tested in tests/integration): a stand-in
    # that has GpuDown firing for the bad node's GPU 1 and nothing else.
    prom = AlertsPrometheus(lambda q: 'alertname="GpuDown"' in q and f'node="{bad.name}"' in q)
    rem = Remediator(policy, PrometheusClient(prom.url), None, audit)
    monkeypatch.setenv("SLURM_CONF", str(slurm.conf))  # as the receiver's service has
    try:
        (d,) = rem.handle({"alerts": [{"status": "firing", "labels": {
            "alertname": "GpuDown", "node": bad.name, "gpu": "1"}}]})
    finally:
        prom.close()
    assert d["outcome"] == "already_drained" and d["detail"] == f"requeued jobs {job}", d
    (rec,) = [r for r in audit.read() if r["action"] == "drain-node"]
    assert rec["node"] == bad.name and rec["who"] == "policy" and job in rec["detail"]
    # Requeued, it runs on the two remaining nodes and resumes from its checkpoint.
    wait_until(lambda: int(slurm.job(job).get("Restarts", "0")) >= 1, 60, "the requeue")
    info = wait_state(slurm, job, ("RUNNING", *DONE), 180, out)
    assert bad.name not in slurm.hostnames(info["NodeList"])
    assert resumed_step(slurm, job, out) >= 10
    slurm.run("scancel", "--signal=KILL", job)  # as the USR1 test's: nothing left to see
    wait_state(slurm, job, DONE, 120, out)
    # It stays drained: XID 79 is counted since the driver loaded, and only a GPU reset
    # (or a reboot) clears it, as on real hardware.


def test_health_check_leaves_a_node_whose_agent_is_gone_and_resumes_one_it_drained(slurm, bed):
    node = next(n for n in bed.nodes
                if slurm.node_states().get(n.name, "").rstrip("*") == "idle")

    def service_agent(log: str) -> None:
        node.spawn([sys.executable, "-m", "clusterpulse.agent", "--backend", "sim", "--gpus",
                    "2", "--node", node.name, "--listen", "0.0.0.0:9400", "--telemetry",
                    "127.0.0.1:9401", "--interval", "0.5",
                    "--token-file", str(slurm.run_dir.parent / "token")],
                   log=slurm.run_dir / f"service-agent-{node.name}-{log}.log", cwd=REPO)
        wait_until(lambda: requests.get(f"http://{node.ip}:9400/healthz", timeout=2).ok, 60,
                   f"service agent on {node.name}")

    def kill_agent() -> None:
        """SIGKILL the node's service agent; return once two health checks of the node
        have run since (the first after the kill may have begun before it: not
        counted), each of them unknown (exit 2)."""
        (pid,) = bed.find(node, "-m", "clusterpulse.agent", "0.0.0.0:9400")
        start = len(slurm.health_checks(node.name)) + 1
        bed.kill_process(pid)
        ran = wait_until(lambda: (c := slurm.health_checks(node.name)[start:])[1:] and c,
                         12 * HEALTH_INTERVAL, f"two health checks of {node.name}")
        assert set(ran) == {2}, ran

    # No agent (an agent rollout, or the agent run only as a job step): unknown, and a
    # monitoring hiccup drains nothing over two whole HealthCheckIntervals.
    kill_agent()
    assert slurm.node_states().get(node.name, "").rstrip("*") == "idle"
    assert slurm.node_reason(node.name) in ("", "none")  # sinfo %E: none when unset
    # A real problem drains it; the agent gone again is still unknown and changes
    # nothing; a healthy agent back resumes it (NHC-style; its own reason only).
    service_agent("2")
    r = requests.post(f"http://{node.ip}:9400/v1/faults", json={"kind": "gpu_lost", "gpu": 0},
                      headers={"Authorization": f"Bearer {TOKEN}"}, timeout=5)
    assert r.status_code == 200, r.text
    wait_until(lambda: "drain" in slurm.run("sinfo", "-h", "-n", node.name, "-o", "%T"), 90,
               f"{node.name} drained by its health check")
    assert slurm.node_reason(node.name).startswith("clusterpulse: GPU 0 down")
    kill_agent()
    assert slurm.node_reason(node.name).startswith("clusterpulse: GPU 0 down")
    service_agent("3")  # a fresh simulated node: every GPU answers
    wait_until(lambda: slurm.node_states().get(node.name, "").rstrip("*") == "idle", 120,
               f"{node.name} resumed by its health check")
    # A critical XID drains it; an operator resumes it (the GPU reset, say): the check
    # no longer drains it for that XID (any count above zero did, for good: the agent
    # keeps XID totals across restarts and reboots), and drains it for a new one.
    def xid_63() -> None:
        r = requests.post(f"http://{node.ip}:9400/v1/faults", timeout=5,
                          json={"kind": "xid", "gpu": 1, "code": 63},
                          headers={"Authorization": f"Bearer {TOKEN}"})
        assert r.status_code == 200, r.text

    xid_63()
    wait_until(lambda: "drain" in slurm.run("sinfo", "-h", "-n", node.name, "-o", "%T"), 90,
               f"{node.name} drained for the XID")
    assert slurm.node_reason(node.name).startswith("clusterpulse: GPU 1 XID 63 x1")
    slurm.run("scontrol", "update", f"NodeName={node.name}", "State=RESUME")
    # Three checks: the exit status is decided before the detached child asks Slurm
    # (slurmd ignores it), so the first one after the resume may still say 1.
    start = len(slurm.health_checks(node.name))
    ran = wait_until(lambda: (c := slurm.health_checks(node.name)[start:])[2:] and c,
                     15 * HEALTH_INTERVAL, f"three health checks of {node.name}")
    assert ran[-1] == 0, ran
    assert slurm.node_states().get(node.name, "").rstrip("*") == "idle"
    xid_63()
    wait_until(lambda: "drain" in slurm.run("sinfo", "-h", "-n", node.name, "-o", "%T"), 90,
               f"{node.name} drained for the new XID")
    assert slurm.node_reason(node.name).startswith("clusterpulse: GPU 1 XID 63 x1")
    slurm.run("scontrol", "update", f"NodeName={node.name}", "State=RESUME")
