"""Restarts a real job can rely on (issue 12), with real torchrun agents on loopback:
two clusterpulse-train "nodes" x 2 ranks with a c10d rendezvous.

One launch carries the whole story, checked at the end:
- rank 1 dies before joining the process group (like a CUDA error at set_device):
  with the old compare-and-set generation slots the next rounds disagreed and
  wedged in gloo's connectFullMesh until --max-restarts ran out; now every round
  has a fresh store and the job goes on;
- three graceful checkpoint-restarts, then a SIGKILLed rank, under --max-restarts 2:
  torchrun used to count each graceful exit (42) as a failure, so five restarts
  would have been needed; now the graceful ones are relaunched outside the budget;
- with 4 ranks (a reduction order that could matter) the job ends bit-exactly where
  an uninterrupted 4-rank run ends.
"""

from __future__ import annotations

import contextlib
import json
import os
import signal
import subprocess
import sys
from pathlib import Path

import pytest

from clusterpulse.trainer.checkpoint import find_latest_valid
from deploy.local.stack import descendants, rank_pids
from tests.conftest import start_agent
from tests.support.ports import free_port
from tests.support.procs import REPO, wait_for_text, wait_until
from tests.support.torchrun import launcher_cmd, start_logged, stop_group

pytestmark = [pytest.mark.integration, pytest.mark.slow]

STEPS = 40
BASE = ["--preset", "tiny", "--steps", str(STEPS), "--ckpt-every", "10", "--agent", "none",
        "--collective-timeout", "120"]


def _start(tmp_path, name: str, nnodes: int, extra: list[str], max_restarts: int,
           prewarm_after: float | None = None) -> list[subprocess.Popen]:
    ckpt = tmp_path / name
    args = [*BASE, "--ckpt-dir", str(ckpt), "--summary-json", str(ckpt / "summary.json"),
            *extra]
    port = free_port()
    return [start_logged(launcher_cmd(4 // nnodes, max_restarts, args, nnodes=nnodes,
                                      rdzv_port=port, prewarm_after=prewarm_after),
                         tmp_path / f"{name}-{i}.log", tmp_path)
            for i in range(nnodes)]


def _finish(tmp_path, name: str, procs: list[subprocess.Popen]) -> tuple:
    try:
        codes = [p.wait(timeout=900) for p in procs]
    finally:
        for p in procs:
            stop_group(p)
    logs = [(tmp_path / f"{name}-{i}.log").read_text(errors="replace")
            for i in range(len(procs))]
    summary_path = tmp_path / name / "summary.json"
    summary = json.loads(summary_path.read_text()) if summary_path.exists() else None
    return codes, logs, summary


def _launchers(logs: list[str]) -> str:
    """Each node's story, as its launcher and torchrun told it: which attempt failed
    where, which relaunch took a torchrun started ahead (a traceback's tail showed none
    of it when a count was off)."""
    told = ("clusterpulse-train:", "injected", "Restarting", "restart", "FAILED", "exitcode")
    return "\n\n".join(f"node log {i}:\n" + "\n".join(
        line for line in log.splitlines() if any(t in line for t in told))[-6000:]
        for i, log in enumerate(logs))


def test_dead_rank_before_init_and_graceful_restarts_outside_the_failure_budget(tmp_path):
    """Also the relaunches' torchruns started ahead (held with their imports done:
    --prewarm-after) count the attempts as the ranks agree them: the injections below
    fire in the attempt they name."""
    fault_procs = _start(tmp_path, "faults", 2, [
        "--inject", "init_crash:rank=1",
        "--inject", "graceful:step=8",
        "--inject", "graceful:step=18:attempt=1",
        "--inject", "graceful:step=27:attempt=2",
        "--inject", "crash:rank=2:step=33:mode=sigkill:attempt=3",
    ], max_restarts=2, prewarm_after=0.5)
    # The uninterrupted reference run is independent of the faulted one: they run side
    # by side (own checkpoints, own rendezvous port) instead of one after the other.
    # The reference starts once the faulted run trains (its first checkpoint): its
    # start-up then overlaps the faulted run's restarts, which wait on each other more
    # than they compute, rather than competing with the faulted run's own start-up and
    # the death of rank 1 at init.
    try:
        wait_until(lambda: find_latest_valid(tmp_path / "faults") is not None, 300,
                   "the faulted run's first checkpoint")
    except BaseException:
        for p in fault_procs:
            stop_group(p)
        raise
    try:
        clean_procs = _start(tmp_path, "clean", 1, [], max_restarts=0)
    except BaseException:
        for p in fault_procs:
            stop_group(p)
        raise
    try:
        codes, logs, summary = _finish(tmp_path, "faults", fault_procs)
    finally:
        clean_codes, clean_logs, clean = _finish(tmp_path, "clean", clean_procs)
    assert codes == [0, 0], "\n\n".join(x[-4000:] for x in logs)
    # the three relaunches took over torchruns started ahead, but the first of the node
    # whose torchrun spent a failure restart after that one had started (its budget)
    # (which node holds rank 1 is the rendezvous' choice)
    ahead = "torchrun again: one started ahead, its imports done"
    spent, other = sorted(logs, key=lambda log: log.count(ahead))
    assert [spent.count(ahead), other.count(ahead)] == [2, 3], _launchers(logs)
    assert spent.count("has the failure budget from before this one's failures") == 1, \
        _launchers(logs)
    everything = "\n".join(logs)
    assert "injected: rank 1 exits before joining the process group" in everything
    # every relaunch and restart is this job's to the checkpoint directory's claim
    assert "waiting up to" not in everything and "in use by another job" not in everything
    # each node's launcher relaunched its torchrun 3 times; the rank that died before
    # joining spent one of its node's 2 (torchrun's budget is each node's own: the
    # other node's torchrun restarted its workers for the new round, spending none)
    third = "graceful restart 3: relaunching ({} failure restart(s) left of --max-restarts 2)"
    assert [third.format(1) in spent, third.format(2) in other] == [True, True], \
        _launchers(logs)
    causes = [(r["cause"], r["resume_step"], r["steps_recomputed"]) for r in summary["restarts"]]
    assert causes == [("checkpoint-restart", 10, 0), ("checkpoint-restart", 20, 0),
                      ("checkpoint-restart", 30, 0), ("failure", 30, 3)], summary["restarts"]
    assert summary["world_size"] == 4

    assert clean_codes == [0], clean_logs[0][-4000:]
    assert clean["restarts"] == []
    assert summary["param_sha256"] == clean["param_sha256"]


def test_a_node_joining_spends_no_failure_restart_on_a_node_slow_to_notice(tmp_path):
    """A node joining an elastic job makes every torchrun agent restart its workers
    with SIGTERM, each when its monitor loop notices. The ranks agree to leave at the
    first SIGTERM any of them sees; a rank that then exited before its own agent had
    noticed was a failed worker to that agent: a failure restart spent (here, with
    --max-restarts 0, the job ended on that node). Node0's agent looks every 6 s, so
    node1's notices first almost always (the ranks leave ~1 s after its SIGTERM)."""
    ckpt = tmp_path / "ckpt"
    # Node2 starts once the 2-node round has closed (its first checkpoint) and joins
    # after its launcher's imports: paced by the CPU, while the steps were paced by a
    # sleep. 250 steps (~15 s) ran out before it joined on a machine loaded as CI's
    # are (2026-12-07: the job ended, node2 waited out the 600 s). Now the 2-node
    # round's data is slow (0.5 s a step from step 10, in attempt 0 only: the first
    # round), which leaves node2 two minutes to join; the 3-node round runs at speed.
    # A SIGTERM mostly lands in that wait, which goes on to its end: the ranks agree
    # every step, so they leave within ~0.6 s of it and their checkpoint, mostly before
    # node0's agent (every 6 s) has noticed the new node: what this test is about.
    args = [*BASE[:3], "250", *BASE[4:], "--ckpt-dir", str(ckpt), "--global-batch", "6",
            "--sim-compute-seconds", "0.05", "--consensus-every", "1",
            "--inject", "data_slow:step=10:seconds=0.5:attempt=0",
            "--summary-json", str(ckpt / "summary.json")]
    port = free_port()
    nodes = [launcher_cmd(1, 0, args, nnodes="2:3", rdzv_port=port, monitor_interval=every)
             for every in (6.0, 0.2, 0.2)]
    procs = [start_logged(cmd, tmp_path / f"node{i}.log", tmp_path)
             for i, cmd in enumerate(nodes[:2])]
    try:
        wait_until(lambda: find_latest_valid(ckpt) is not None, 240,
                   "the 2-node job's first checkpoint")
        procs.append(start_logged(nodes[2], tmp_path / "node2.log", tmp_path))
        codes = [p.wait(timeout=600) for p in procs]
    finally:
        for p in procs:
            stop_group(p)
    logs = [(tmp_path / f"node{i}.log").read_text(errors="replace") for i in range(3)]
    assert codes == [0, 0, 0], "\n\n".join(log[-3000:] for log in logs)
    summary = json.loads((ckpt / "summary.json").read_text())
    assert summary["steps"] == 250 and summary["world_size"] == 3, summary
    # torchrun's restart for the joining node, told from a preemption (both SIGTERM)
    assert [r["cause"] for r in summary["restarts"]] == ["membership"], summary["restarts"]


def test_two_nodes_evicted_at_once_take_the_job_no_lower_than_its_minimum(tmp_path):
    """Each node accepts its own eviction alone (the job can lose one node), but two
    at the same restart took a 3-node job with a 2-node minimum down to one node: the
    others waited the whole sit-out for them. Now the ranks settle it when they agree:
    the lowest node ranks that fit leave, the others restart with the job and their
    commands fail saying why. Commands sent straight to two nodes' agents, as
    `clusterpulse-ctl evict` with two nodes does."""
    leave_s = 300  # the longest the launcher allows: the job must not wait for it
    ckpt = tmp_path / "ckpt"
    agents = [start_agent(tmp_path, node=f"node{i}") for i in range(3)]
    port = free_port()
    procs = []
    try:
        for i, (running, _) in enumerate(agents):
            args = [*BASE[:3], "100000", "--ckpt-every", "20", "--agent", running.telemetry,
                    "--run-id", "ev2", *BASE[8:], "--ckpt-dir", str(ckpt), "--global-batch",
                    "6", "--sim-compute-seconds", "0.05"]
            cmd = launcher_cmd(1, 0, args, nnodes="2:3", rdzv_port=port, rdzv_host=i == 0)
            procs.append(start_logged(cmd, tmp_path / f"node{i}.log", tmp_path))
        wait_until(lambda: all(r.agent.ranks.of_run("ev2") for r, _ in agents), 240,
                   "a rank of the job on each of the 3 nodes")
        wait_until(lambda: (found := find_latest_valid(ckpt)) is not None and found.step >= 20,
                   240, "the 3-node job past step 20")
        ids = {}
        for i in (1, 2):
            r = agents[i][0].post("/v1/runs/ev2/actions", {
                "action": "checkpoint-restart", "reason": "test", "leave_s": leave_s})
            assert r.status_code == 202, r.text
            ids[i] = r.json()["id"]
        logs = [tmp_path / f"node{i}.log" for i in range(3)]
        wait_until(lambda: any("leaving the job for" in p.read_text(errors="replace")
                               for p in logs), 180, "a node leaving the job")
        left_at = find_latest_valid(ckpt).step
        # the job goes on without it, long before the sit-out ends
        wait_until(lambda: find_latest_valid(ckpt).step >= left_at + 40, leave_s / 2,
                   "the job stepping on 2 nodes")
        # which one goes is the rendezvous's numbering (on loopback: torchrun's pid)
        leaving = [i for i in (1, 2)
                   if "leaving the job for" in logs[i].read_text(errors="replace")]
        assert len(leaving) == 1, [p.read_text(errors="replace")[-2000:] for p in logs]
        (gone,), (stayed,) = leaving, {1, 2} - set(leaving)
        def state(i: int) -> dict:
            agents[i][0].agent.collect_once()
            return agents[i][0].get(f"/v1/commands/{ids[i]}").json()
        wait_until(lambda: state(stayed)["state"] == "failed", 60, "the command that gave way")
        # why: the ranks said so, or (they never heard it before the agreement) they came
        # back without having acknowledged it
        detail = state(stayed)["detail"]
        assert "other nodes leave" in detail or "sitting out" in detail, detail
        assert state(gone)["state"] == "delivered", state(gone)  # sits out, then returns
    finally:
        for p in procs:
            stop_group(p)
        for running, server in agents:
            server.shutdown()
            running.agent.stop()


@pytest.mark.parametrize(("cold", "sig", "every_process"),
                         [(False, signal.SIGTERM, False), (True, signal.SIGTERM, False),
                          (False, signal.SIGINT, False), (False, signal.SIGTERM, True)],
                         ids=["warm-sigterm", "cold-sigterm", "warm-ctrl-c", "every-process"])
def test_a_signal_to_the_launchers_process_group_checkpoints_then_exits(tmp_path, cold, sig,
                                                                        every_process):
    """`kill -- -PGID` of clusterpulse-train (a supervisor's stop) or Ctrl-C: the ranks
    save at their next agreement and the launcher exits 128 + the signal. Warm ranks
    used to share the launcher's group with their forkserver, which died of SIGTERM and
    took them down (torch sets their parent-death signal) before any save; torchrun,
    signalled by the group and again by the launcher, stopped waiting for the save; and
    Ctrl-C reached the ranks as SIGINT, which stops them mid-step.

    Every process of the job signalled, each in its own process group or not (Slurm's
    cgroup kill, systemd's KillMode=control-group, a pod's deletion): each rank gets the
    scheduler's SIGTERM and torchrun's copies, within milliseconds. The second copy was
    taken for an operator's "now" and the ranks left without the checkpoint."""
    ckpt, log = tmp_path / "ckpt", tmp_path / "job.log"
    args = [*BASE[:2], "--steps", "100000", "--ckpt-every", "100000", "--agent", "none",
            "--sim-compute-seconds", "0.02", "--log-every", "10", "--ckpt-dir", str(ckpt)]
    p = start_logged(launcher_cmd(2, 0, args, cold_start=cold), log, tmp_path)
    try:
        # no retry for a port race: a round's store is on a port below the kernel's
        # ephemeral range (test_clean_start.py)
        wait_for_text(log, "step 20/", 180, "training")
        assert len(rank_pids([p.pid])) == 2
        # The launcher supervises torchrun and never needs torch: it imported it for two
        # names (1.3 s of CPU and ~300 MB in each clusterpulse-train of a job on one node).
        assert "libtorch" not in Path(f"/proc/{p.pid}/maps").read_text(), "it loaded torch"
        if every_process:
            for pid in [p.pid, *descendants([p.pid])]:
                with contextlib.suppress(ProcessLookupError):
                    os.kill(pid, sig)
        else:
            os.killpg(p.pid, sig)
        assert p.wait(timeout=120) == 128 + sig, log.read_text(errors="replace")[-3000:]
    finally:
        stop_group(p)
    found = find_latest_valid(ckpt)  # no periodic checkpoint is ever due: it is the SIGTERM's
    assert found is not None and found.step >= 20, log.read_text(errors="replace")[-3000:]


def test_graceful_restarts_do_not_renew_the_failure_budget(tmp_path):
    """Review: each torchrun the launcher started after a graceful restart had the whole
    --max-restarts again, so a job that crashed, restarted gracefully and crashed again
    went on past its budget (with automatic graceful restarts, a crash loop without
    end). The next torchrun gets what the failures left: here the second crash ends
    the job."""
    ckpt = tmp_path / "ckpt"
    cmd = launcher_cmd(1, 1, [*BASE[:2], "--steps", "30", "--ckpt-every", "5", "--agent",
                              "none", "--ckpt-dir", str(ckpt),
                              "--inject", "crash:step=7:attempt=0",
                              "--inject", "graceful:step=12:attempt=1",
                              "--inject", "crash:step=17:attempt=2"])
    r = subprocess.run(cmd, cwd=tmp_path, capture_output=True, text=True, timeout=600,
                       env={**os.environ, "PYTHONPATH": str(REPO)})
    log = r.stdout + r.stderr
    assert r.returncode != 0, log[-4000:]
    assert "graceful restart 1: relaunching (0 failure restart(s) left of --max-restarts 1)" \
        in log, log[-4000:]
    state = json.loads((ckpt / "run-state.json").read_text())
    assert [x["cause"] for x in state["restarts"]] == ["failure", "checkpoint-restart"]
    assert state["last_step"] < 30


@pytest.mark.skipif((os.cpu_count() or 1) < 2, reason="needs 2 cores to tell 1 thread from all")
def test_warm_ranks_take_torchruns_thread_count(tmp_path):
    """torchrun sets OMP_NUM_THREADS=1 for ranks sharing a node when it is unset; a warm
    rank's OpenMP read its forkserver's environment before that (a rank on 2 cores
    computed with 2 threads, its peer too)."""
    ckpt = tmp_path / "ckpt"
    env = {k: v for k, v in os.environ.items() if k != "OMP_NUM_THREADS"}
    env["PYTHONPATH"] = str(REPO)
    cmd = launcher_cmd(2, 0, [*BASE, "--ckpt-dir", str(ckpt), "--summary-json",
                              str(ckpt / "summary.json")])
    r = subprocess.run(cmd, env=env, cwd=tmp_path, capture_output=True, text=True, timeout=600)
    assert r.returncode == 0, r.stdout[-3000:] + r.stderr[-3000:]
    assert json.loads((ckpt / "summary.json").read_text())["intra_op_threads"] == 1


FOREIGN = '''\
import atexit, json, multiprocessing, os, sys
import torch
import helper  # a sibling module: the script's directory is on sys.path
VALUE = helper.VALUE

out, rank = os.environ["OUT"], os.environ["RANK"]
atexit.register(lambda: open(os.path.join(out, f"atexit-{rank}"), "w").write("ran"))
if __name__ == "__main__":
    parent = open(f"/proc/{os.getppid()}/cmdline", "rb").read().decode(errors="replace")
    json.dump({"argv": sys.argv, "threads": torch.get_num_threads(), "value": VALUE,
               "helper_imported_here": helper.PID == os.getpid(),
               "parent": parent, "start_method": multiprocessing.get_start_method()},
              open(os.path.join(out, f"rank-{rank}.json"), "w"))
'''


@pytest.mark.skipif((os.cpu_count() or 1) < 2, reason="needs 2 cores to tell 1 thread from all")
def test_a_preloaded_foreign_script_runs_warm_as_python_would_run_it(tmp_path):
    """`--script S --preload torch --preload helper` (a module beside S): ranks forked
    from the server, which imported both, and yet the script sees what `python S`
    gives it: its directory on sys.path, its argv, its atexit
    handlers run, torchrun's thread count (OMP_NUM_THREADS unset: 1 per rank), and the
    platform's multiprocessing start method (a DataLoader's workers failed to start
    through the server's forkserver)."""
    job = tmp_path / "job:v1"  # ":" is also os.pathsep: the path is not split on it
    job.mkdir()
    script = job / "train.py"
    script.write_text(FOREIGN)
    (job / "helper.py").write_text("import os\nVALUE, PID = 42, os.getpid()\n")
    out = tmp_path / "out"
    out.mkdir()
    env = {k: v for k, v in os.environ.items() if k != "OMP_NUM_THREADS"}
    env.update(PYTHONPATH=str(REPO), OUT=str(out))
    # run from elsewhere: the server must find the script's sibling on its own
    cmd = launcher_cmd(2, 0, ["--epochs", "3"], script=str(script), preload=["torch", "helper"])
    r = subprocess.run(cmd, env=env, cwd=tmp_path, capture_output=True, text=True, timeout=600)
    assert r.returncode == 0, r.stdout[-3000:] + r.stderr[-3000:]
    platform_default = subprocess.run(
        [sys.executable, "-c", "import multiprocessing; print(multiprocessing.get_start_method())"],
        capture_output=True, text=True, check=True).stdout.strip()
    for rank in (0, 1):
        seen = json.loads((out / f"rank-{rank}.json").read_text())
        assert "forkserver" in seen["parent"], seen  # warm: a fork of the server
        assert seen["argv"] == [str(script), "--epochs", "3"]
        assert seen["value"] == 42 and seen["threads"] == 1
        assert seen["helper_imported_here"] is False  # preloaded: imported by the server
        assert seen["start_method"] == platform_default
        assert (out / f"atexit-{rank}").read_text() == "ran"
