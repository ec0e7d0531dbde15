"""End to end on loopback: real agents, Prometheus with the project's rules,
Alertmanager with the project's config, and a two-node torchrun job. Faults go in
the way they happen; alerts must come out naming the right rank, node and cause."""

from __future__ import annotations

import contextlib
import json
import os
import signal
import time

import pytest

from clusterpulse.agent.audit import AuditLog
from clusterpulse.dashboard.actions import request_action
from clusterpulse.dashboard.promclient import PrometheusClient
from deploy.local.stack import descendants
from tests.support.procs import wait_until
from tests.support.stack import TOKEN, Stack

pytestmark = [pytest.mark.integration, pytest.mark.slow]


@pytest.fixture(scope="module")
def stack(tmp_path_factory):
    s = Stack.start(tmp_path_factory.mktemp("stack"))
    yield s
    s.stop()


def _kill_hung_jobs(stack: Stack) -> None:
    """Where Stack.stop_jobs ends for a job with a rank hung alive, without its 20 s
    wait per launcher: the hung rank defers SIGTERM to a checkpoint at the next
    agreement, which never comes, and its peers wait for it inside a collective, so
    torchrun never sees them exit and every process of the job is SIGKILLed in the end
    anyway (two such teardowns took 20 s and 32 s). The family is read first: once
    the launchers die their torchruns are no longer their descendants."""
    family = descendants([p.pid for p in stack.jobs if p.poll() is None])
    for p in stack.jobs:
        if p.poll() is None:
            with contextlib.suppress(ProcessLookupError):
                os.killpg(p.pid, signal.SIGKILL)
    for pid in family:
        with contextlib.suppress(ProcessLookupError):
            os.kill(pid, signal.SIGKILL)
    stack.stop_jobs()  # reaps the launchers (and kills anything started since)


def _rank_node(stack: Stack, run: str, rank: int) -> tuple[str, str]:
    info = stack.prom.query(f'clusterpulse_trainer_rank_info{{run="{run}",rank="{rank}"}}')
    return info[0]["metric"]["node"], info[0]["metric"]["local_rank"]


def test_stragglers_are_named_with_their_cause_and_reach_the_webhook(stack):
    """Rank 3 is slowed in software (cause: compute); then, in a second run, GPU 1 of
    node-a overheats, thermal-throttles, and its rank is named with cause
    thermal_throttling."""
    strag = stack.start_job("strag", steps=3000, trainer_args=[
        "--sim-compute-seconds", "0.1", "--inject", "slow:rank=3:step=1:factor=1.8"])
    try:
        wait_until(lambda: len(stack.prom.query('clusterpulse_trainer_step{run="strag"}')) == 4,
                   90, "4 ranks reporting")
        alerts = wait_until(lambda: stack.firing("TrainingStraggler"), 90,
                            "straggler alert for rank 3")
        (a,) = alerts
        node3, _ = _rank_node(stack, "strag", 3)
        assert a["labels"]["rank"] == "3" and a["labels"]["node"] == node3
        assert a["labels"]["cause"] == "compute" and a["labels"]["run"] == "strag"

        # A second run, all ranks busy (no software straggler they all wait for), so
        # a GPU that loses its cooling heats up and throttles as it would under load.
        # It starts while the first run's page is delivered and the run stops (its
        # imports and rendezvous overlap both); the first run is gone before the GPU
        # overheats.
        stack.start_job("thermal", steps=3000, trainer_args=["--sim-compute-seconds", "0.1"])
        wait_until(lambda: any(x["labels"].get("alertname") == "TrainingStraggler"
                               for x in stack.sink.alerts()), 30, "webhook delivery")
        stack.stop_jobs(strag)
        wait_until(lambda: len(stack.prom.query(
            'clusterpulse_trainer_step{run="thermal"}')) == 4, 90, "4 ranks of run thermal")
        hot_node = stack.nodes[0]
        hot = next(r["metric"] for r in stack.prom.query(
            f'clusterpulse_trainer_rank_info{{run="thermal",node="{hot_node.name}",'
            'local_rank="1"}'))
        assert hot_node.post("/v1/faults", {"kind": "overheat", "gpu": 1}).status_code == 200

        def thermal():
            return [x for x in stack.firing("TrainingStraggler")
                    if x["labels"]["run"] == "thermal" and x["labels"]["rank"] == hot["rank"]]
        (t,) = wait_until(thermal, 150, "thermal straggler alert")
        assert t["labels"]["cause"] == "thermal_throttling"
        assert t["labels"]["node"] == hot_node.name
        assert t["labels"]["gpu"] == "1"
        assert "thermal_throttling" in t["annotations"]["summary"]
    finally:
        # The stack outlives this test: a GPU left hot would slow the next runs' rank on
        # it, a real straggler in tests that assert no page (CI once saw 1.38x). Its
        # cooling is restored first, so that it cools while the run stops. Cooled: no
        # thermal clock-event reason active in the agent's own series (scraped every
        # second), the reasons the simulated GPU slows its ranks for; their record
        # clusterpulse:gpu_thermal_throttled is evaluated only every 15 s.
        hot_node = stack.nodes[0]
        try:
            assert hot_node.post("/v1/faults", {"kind": "recover", "gpu": 1}).status_code == 200
        finally:  # no run of this test may outlive it, whatever the agent answered
            stack.stop_jobs()
        wait_until(lambda: stack.prom.query(
            f'max(clusterpulse_gpu_clock_event_active{{node="{hot_node.name}",gpu="1",'
            'reason=~"sw_thermal_slowdown|hw_thermal_slowdown"}) == 0'),
            120, f"GPU 1 of {hot_node.name} cooled below its slowdown temperature")


def test_hung_rank_is_named_within_15_seconds_and_a_hard_restart_recovers(stack):
    stack.start_job("hang", steps=3000, trainer_args=[
        "--sim-compute-seconds", "0.1", "--ckpt-every", "20", "--inject", "hang:rank=2:step=60"])
    try:
        wait_until(lambda: stack.prom.query('clusterpulse_trainer_step{run="hang",rank="2"}'),
                   90, "rank 2 reporting")
        (a,) = wait_until(lambda: stack.firing("RankHung"), 120, "RankHung")
        fired_at = time.time()
        node2, _ = _rank_node(stack, "hang", 2)
        assert a["labels"]["rank"] == "2" and a["labels"]["node"] == node2
        # The agent's age of rank 2 at detection is the time since it last completed a step.
        age = float(stack.prom.query(
            'clusterpulse_trainer_heartbeat_age_seconds{run="hang",rank="2"}')[0]["value"][1])
        latency = age - (time.time() - fired_at)
        print(f"hang detection latency: {latency:.1f} s")
        assert latency <= 15
        alive = stack.prom.query('clusterpulse_trainer_process_alive{run="hang",rank="2"}')
        assert alive[0]["value"][1] == "1"
        # The operator's (or policy's) answer: a hard restart through every node's agent.
        results = request_action(PrometheusClient(stack.prom.url), "hang", "restart",
                                 "e2e: rank 2 hung", "e2e", TOKEN, AuditLog(None))
        assert [r.ok for r in results] == [True, True], results

        def resumed():
            steps = stack.prom.query('clusterpulse_trainer_step{run="hang"}')
            restarts = stack.prom.query('clusterpulse_trainer_restarts_total{run="hang"}')
            return (len(steps) == 4 and all(float(s["value"][1]) > 70 for s in steps)
                    and all(r["value"][1] == "1" for r in restarts))
        wait_until(resumed, 180, "all ranks past step 70 after the hard restart")
        state = json.loads((stack.tmp / "hang" / "run-state.json").read_text())
        (restart,) = state["restarts"]
        # Resumed from the last checkpoint (40), losing at most one checkpoint interval
        # (the design's budget for a hard restart). Exactly how far past step 55 the
        # others got before the kill depends on where in step 60 the hang caught them.
        assert restart["resume_step"] == 40 and 15 <= restart["steps_recomputed"] <= 20
    finally:
        stack.stop_jobs()


def test_a_long_checkpoint_a_restart_and_a_clean_finish_never_page(stack):
    """Routine operations of a real 4-rank job: a checkpoint that blocks every rank
    12 s (slow storage; the steady hang threshold is 5 s here), a graceful
    checkpoint-restart whose new ranks load the checkpoint in phase start, and a clean
    finish whose ranks' heartbeat ages then grow for ever. Each used to page (JobStalled
    during the save, RankHung while loading, JobStalled for 5 minutes after the end)."""
    start = time.time()
    stack.start_job("calm", steps=120, trainer_args=[
        "--sim-compute-seconds", "0.05", "--ckpt-every", "40",
        "--inject", "ckpt_slow:step=40:seconds=12", "--inject", "graceful:step=80"])
    try:
        codes = [p.wait(timeout=300) for p in stack.jobs]
        assert codes == [0, 0], codes
        state = json.loads((stack.tmp / "calm" / "run-state.json").read_text())
        assert [r["cause"] for r in state["restarts"]] == ["checkpoint-restart"], state
        time.sleep(8)  # ages grow after the finish: JobStalled used to fire within 5 s
        window = f"{int(time.time() - start) + 5}s"
        # The job did stop long enough to page: 12 s in the checkpoint, against 5 s.
        aged = stack.prom.query(
            'max(max_over_time((clusterpulse_trainer_heartbeat_age_seconds{run="calm"} and on '
            '(run, rank, node, local_rank) clusterpulse_trainer_phase{phase="checkpoint"} == 1)'
            f'[{window}:1s]))')
        assert aged and float(aged[0]["value"][1]) >= 10, aged
        threshold = stack.prom.query(
            f'max_over_time(clusterpulse:run_hang_threshold_seconds{{run="calm"}}[{window}])')
        assert threshold and float(threshold[0]["value"][1]) < 10, threshold
        paged = stack.prom.query(
            f'max_over_time(ALERTS{{run="calm",alertname=~"RankHung|JobStalled"}}[{window}])')
        assert paged == [], stack.hang_evidence("calm", window)  # not even pending
        assert not [a for a in stack.sink.alerts() if a["labels"].get("run") == "calm"]
    finally:
        stack.stop_jobs()


def test_a_rank_stuck_in_init_pages_the_job_after_the_absolute_timeout(tmp_path):
    """Rank 1 never joins the process group; the other 3 wait for it in init. No rank
    has a step time or a collective count, so no root can be told: JobStalled pages
    the job once every rank is past the absolute timeout (10 s here, set as an operator
    sets it), and RankHung pages no one. Ranks used to send nothing before the process
    group and the model existed: an init hang showed no rank at all."""
    s = Stack.start(tmp_path, hang_timeout_s=10)
    start = time.time()
    try:
        s.start_job("init", steps=100, trainer_args=["--inject", "init_hang:rank=1"])
        wait_until(lambda: len(s.prom.query(
            'clusterpulse_trainer_phase{run="init",phase="start"} == 1')) == 4, 90,
            "4 ranks in phase start")
        (a,) = wait_until(lambda: s.firing("JobStalled"), 90, "JobStalled")
        assert a["labels"]["run"] == "init"
        wait_until(lambda: any(x["labels"].get("alertname") == "JobStalled"
                               for x in s.sink.alerts()), 30, "the page delivered")
        window = f"{int(time.time() - start) + 5}s"
        assert s.prom.query(f'max_over_time(ALERTS{{alertname="RankHung"}}[{window}])') == []
    finally:
        # A rank stuck in init is hung alive and its peers wait for it in init: SIGTERM
        # would end them (their Pulse catches it only once joined), but torchrun takes
        # seconds to stop them; this private stack ends with the test.
        _kill_hung_jobs(s)
        s.stop()


def test_a_hang_at_a_non_consensus_step_pages_only_the_hung_rank(stack):
    """Rank 1 stops after step 62 (consensus runs every 5 steps): its peers block in
    the DDP all-reduce of step 63, inside backward, in phase forward_backward. One
    page, for rank 1; the waiters are evidence (blocked in all_reduce), and JobStalled
    is held back by Alertmanager's inhibition because the root is known."""
    stack.start_job("hang2", steps=3000, trainer_args=[
        "--sim-compute-seconds", "0.1", "--inject", "hang:rank=1:step=62"])
    try:
        (a,) = wait_until(lambda: stack.firing("RankHung"), 150, "RankHung for rank 1")
        node1, _ = _rank_node(stack, "hang2", 1)
        assert a["labels"]["rank"] == "1" and a["labels"]["node"] == node1
        assert "root of the hang" in a["annotations"]["description"]
        # Every rank is now past the hang threshold: the job is stalled as a whole...
        wait_until(lambda: stack.firing("JobStalled"), 60, "JobStalled (to be inhibited)")
        # ...and still only the root is paged, while the waiters are shown waiting.
        assert [x["labels"]["rank"] for x in stack.firing("RankHung")] == ["1"]
        phases = {r["metric"]["rank"]: r["metric"]["phase"] for r in stack.prom.query(
            'clusterpulse_trainer_phase{run="hang2"} == 1')}
        assert phases["0"] == phases["2"] == phases["3"] == "forward_backward", phases
        blocked = {r["metric"]["rank"]: r["metric"]["op"] for r in stack.prom.query(
            'clusterpulse_trainer_blocked_collective{run="hang2"}')}
        assert blocked == {"0": "all_reduce", "2": "all_reduce", "3": "all_reduce"}, blocked
        behind = {r["metric"]["rank"]: float(r["value"][1]) for r in stack.prom.query(
            'clusterpulse:rank_collectives_behind{run="hang2"}')}
        assert behind["1"] > 0 and behind["0"] == behind["2"] == behind["3"] == 0, behind

        def am_state() -> dict[str, str]:
            return {a["labels"]["alertname"] + a["labels"].get("rank", ""): a["status"]["state"]
                    for a in stack.am.alerts() if a["labels"].get("run") == "hang2"}
        st = wait_until(lambda: (s := am_state()).get("JobStalled") == "suppressed" and s, 60,
                        "JobStalled suppressed by RankHung in Alertmanager")
        assert st["RankHung1"] == "active"
        assert {k for k in st if k.startswith("RankHung")} == {"RankHung1"}
    finally:
        _kill_hung_jobs(stack)


def test_a_rank_blocked_in_a_checkpoint_save_is_named_as_fast_as_any_hang(stack):
    """Rank 1 blocks, alive, in the checkpoint save of step 40 before DCP's first
    collective (ckpt_hang: a write stuck on storage); the 3 others wait for it inside
    DCP's plan gather, in phase checkpoint too. That phase has the 300 s absolute
    timeout, and DCP's collectives went uncounted: nothing named rank 1 for 300 s, then
    JobStalled named no rank. Counted, the waiters are one collective ahead, and rank 1
    is paged, alone, once they have waited past the steady threshold (5 s here)."""
    run = "ckhang"
    start = time.time()
    stack.start_job(run, steps=3000, trainer_args=[
        "--sim-compute-seconds", "0.1", "--ckpt-every", "40",
        "--inject", "ckpt_hang:rank=1:step=40"])
    try:
        def mine(alertname: str) -> list[dict]:  # an earlier test's run may still fire
            return [x for x in stack.firing(alertname) if x["labels"].get("run") == run]

        (a,) = wait_until(lambda: mine("RankHung"), 180, "RankHung for rank 1")
        fired_at = time.time()
        node1, _ = _rank_node(stack, run, 1)
        assert a["labels"]["rank"] == "1" and a["labels"]["node"] == node1
        assert a["labels"]["run"] == run
        # Rank 1's age is the time since its last step (40): the hang's start.
        age = float(stack.prom.query(
            f'clusterpulse_trainer_heartbeat_age_seconds{{run="{run}",rank="1"}}')[0]["value"][1])
        latency = age - (time.time() - fired_at)
        # The run's pace as the hang threshold reads it: the p99 of the ranks' intervals
        # between steps, as their agents saw them (the steps before the save).
        paces = stack.prom.query(
            f'clusterpulse_trainer_step_interval_p99_seconds{{run="{run}"}}')
        assert len(paces) == 4, paces  # each rank's agent counted its steps
        p99 = float(stack.prom.query(
            f'clusterpulse:run_step_interval_p99_seconds{{run="{run}"}}')[0]["value"][1])
        bound = max(15.0, 3 * p99)
        print(f"checkpoint hang detection latency: {latency:.1f} s "
              f"(bound max(15 s, 3 x p99 step interval {p99:.2f} s) = {bound:.1f} s)")
        assert latency <= 60  # generous: the machine is shared; the figure is reported
        phases = {r["metric"]["rank"]: r["metric"]["phase"] for r in stack.prom.query(
            f'clusterpulse_trainer_phase{{run="{run}"}} == 1')}
        assert set(phases.values()) == {"checkpoint"}, phases
        blocked = {r["metric"]["rank"]: r["metric"]["op"] for r in stack.prom.query(
            f'clusterpulse_trainer_blocked_collective{{run="{run}"}}')}
        assert set(blocked) == {"0", "2", "3"}, blocked  # inside DCP's collective
        assert a["annotations"]["description"].endswith("3 rank(s) wait for it.")
        time.sleep(5)  # the waiters are never paged, not even pending
        window = f"{int(time.time() - start) + 5}s"
        others = stack.prom.query(
            f'max_over_time(ALERTS{{run="{run}",alertname="RankHung",rank!="1"}}[{window}])')
        assert others == [], stack.hang_evidence(run, window)
        assert [x["labels"]["rank"] for x in mine("RankHung")] == ["1"]
        assert mine("JobStalled") == []  # within the checkpoint's 300 s
    finally:
        _kill_hung_jobs(stack)


def test_lost_gpu_and_dead_agent(stack):
    node_a, node_b = stack.nodes
    assert node_a.post("/v1/faults", {"kind": "gpu_lost", "gpu": 3}).status_code == 200
    (g,) = wait_until(lambda: stack.firing("GpuDown"), 30, "GpuDown")
    assert g["labels"]["node"] == "node-a" and g["labels"]["gpu"] == "3"
    # the reason is in the text, not a label: as a label its change to "missing" at
    # NVML's re-initialisation resolved the alert and paged again
    assert "reason" not in g["labels"] and "(gpu_is_lost)" in g["annotations"]["summary"]
    wait_until(lambda: any(x["labels"].get("alertname") == "GpuDown"
                           for x in stack.sink.alerts()), 30, "GpuDown delivered")
    node_b.proc.p.kill()
    killed_at = time.time()
    (d,) = wait_until(lambda: stack.firing("NodeAgentDown"), 30, "NodeAgentDown")
    assert d["labels"]["node"] == "node-b"
    print(f"node down detection: {time.time() - killed_at:.1f} s (scrape interval 1 s)")
