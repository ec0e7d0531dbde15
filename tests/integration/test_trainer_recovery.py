"""Real torchrun (gloo, 2-4 ranks): crashes, checkpoint faults and resumption end with
exactly the parameters of a run that never failed."""

from __future__ import annotations

import functools
import json
import shutil
import subprocess
import sys
import time
from collections.abc import Callable, Iterator
from concurrent.futures import Future, ThreadPoolExecutor
from pathlib import Path

import pytest

from tests.conftest import start_agent
from tests.support import torchrun
from tests.support.procs import wait_until
from tests.support.torchrun import RunResult, stop_group

pytestmark = pytest.mark.integration

# Most runs here start warm, as under clusterpulse-train (ranks forked from a server
# that imported torch and the trainer once per torchrun; without the launcher's
# relaunch or its environment: torchrun's shared store, exit 42 restarted by torchrun):
# the module's ~25 runs cost ~40 % less CPU than plain torchrun's, each rank and each
# restarted one importing torch. What differs warm is how a rank exits (os._exit, no
# interpreter shutdown) and how torchrun hears of a crash (its error file): a crash
# restart and a graceful restart of 2 ranks run under plain torchrun too, the README's
# recipe (`cold` below).
run_trainer = functools.partial(torchrun.run_trainer, warm=True)
start_trainer = functools.partial(torchrun.start_trainer, warm=True)

STEPS = 40
CKPT = ["--ckpt-every", "10"]


@pytest.fixture(scope="module")
def side_by_side() -> Iterator[ThreadPoolExecutor]:
    """Where runs of this module's tests depend on no other run, two at a time: a 2-rank
    torchrun alone leaves a core idle for much of its life (torchrun importing, its
    ranks tearing down, a restart's rendezvous). Not more: two test files run at a time
    on 2 cores, and more would only starve the other one."""
    pool = ThreadPoolExecutor(max_workers=2)
    try:
        yield pool
    finally:  # what no test waits for any more (a failure, -x) does not start
        pool.shutdown(wait=True, cancel_futures=True)


def selected(request: pytest.FixtureRequest, test: Callable) -> list[dict]:
    """The parameters of `test`'s items in this session: a fixture that starts their runs
    ahead starts only those (`-k`, a node id) and not the whole family."""
    return [item.callspec.params for item in request.session.items
            if getattr(item, "function", None) is test]


@pytest.fixture(scope="module")
def clean_digest(tmp_path_factory, side_by_side) -> dict[str, str]:
    """The fault-free result for each parallelism, computed once (both side by side)."""
    runs = {parallel: side_by_side.submit(
        run_trainer, tmp_path_factory.mktemp(f"clean-{parallel}") / "ckpt", steps=STEPS,
        args=[*CKPT, "--parallel", parallel]) for parallel in ("ddp", "fsdp")}
    out = {}
    for parallel, run in runs.items():
        r = run.result()
        assert r.returncode == 0, r.log[-3000:]
        assert r.summary["restarts"] == [] and r.summary["steps"] == STEPS
        out[parallel] = r.digest
    return out


@pytest.fixture(scope="module")
def crash_runs(request, tmp_path_factory, side_by_side) -> dict[tuple[str, str, str], Future]:
    """Each selected case of the test below, started ahead, side by side: its run's
    settings are the test's, its own checkpoint directory, no other run's state."""
    return {(c["parallel"], c["mode"], c["start"]): side_by_side.submit(
        torchrun.run_trainer,
        tmp_path_factory.mktemp(f"crash-{c['parallel']}-{c['mode']}") / "ckpt", steps=STEPS,
        max_restarts=2, warm=c["start"] == "warm", args=[
            *CKPT, "--parallel", c["parallel"], "--inject",
            f"crash:rank=1:step=25:mode={c['mode']}"])
        for c in selected(request, test_crash_and_torchrun_restart_ends_with_identical_parameters)}


@pytest.mark.parametrize("parallel,mode,start", [("ddp", "exception", "cold"),
                                                 ("ddp", "sigkill", "warm"),
                                                 ("fsdp", "exit", "warm")])
def test_crash_and_torchrun_restart_ends_with_identical_parameters(crash_runs, clean_digest,
                                                                   parallel, mode, start):
    r = crash_runs[parallel, mode, start].result()  # --inject crash:rank=1:step=25:mode=MODE
    assert r.returncode == 0, r.log[-3000:]
    assert "resumed from step-00000020" in r.log
    assert r.digest == clean_digest[parallel]
    (restart,) = r.summary["restarts"]
    assert restart["cause"] == "failure" and restart["resume_step"] == 20
    assert restart["downtime_seconds"] > 0
    assert 0 < r.summary["goodput"] < 1


@pytest.fixture(scope="module")
def kill_runs(request, tmp_path_factory, side_by_side) -> dict[bool, Future]:
    """As crash_runs, for the test below."""
    return {c["async_ckpt"]: side_by_side.submit(
        run_trainer, tmp_path_factory.mktemp(f"kill-async-{c['async_ckpt']}") / "ckpt",
        steps=STEPS, max_restarts=2, args=[*CKPT, "--inject", "ckpt_kill:step=20"]
        + (["--async-ckpt"] if c["async_ckpt"] else []))
        for c in selected(request, test_kill_during_checkpoint_write_leaves_previous_loadable)}


@pytest.mark.parametrize("async_ckpt", [False, True])
def test_kill_during_checkpoint_write_leaves_previous_loadable(kill_runs, clean_digest,
                                                               async_ckpt):
    r = kill_runs[async_ckpt].result()  # --inject ckpt_kill:step=20 [--async-ckpt]
    assert r.returncode == 0, r.log[-3000:]
    assert "resumed from step-00000010" in r.log  # step 20 was never published
    assert r.digest == clean_digest["ddp"]


def test_corrupted_newest_checkpoint_falls_back_to_the_one_before(tmp_path, clean_digest):
    r = run_trainer(tmp_path / "ckpt", steps=STEPS, max_restarts=2, args=[
        *CKPT, "--inject", "ckpt_corrupt:step=30", "--inject", "crash:rank=0:step=33"])
    assert r.returncode == 0, r.log[-3000:]
    assert "checkpoint step-00000030 is unusable" in r.log and "fails its checksum" in r.log
    assert "resumed from step-00000020" in r.log
    assert r.digest == clean_digest["ddp"]


def test_a_checkpoint_that_fails_to_load_partway_is_set_aside_and_the_job_starts_clean(
        tmp_path, clean_digest):
    """dcp.load copies into the live model and optimizer: one that fails partway leaves
    part of the checkpoint behind, and the fallback "start from step 0" trained on from
    that (the run ended with other parameters than one that never failed). Now the
    unusable checkpoint is set aside (unusable-step-*, kept as evidence) and the ranks
    exit, so the restart starts clean."""
    r = run_trainer(tmp_path / "ckpt", steps=STEPS, max_restarts=2, args=[
        *CKPT, "--inject", "ckpt_unloadable:step=10", "--inject", "crash:rank=1:step=15"])
    assert r.returncode == 0, r.log[-3000:]
    assert "checkpoint step-00000010 verifies but does not load" in r.log
    assert "set aside as unusable-step-00000010" in r.log
    assert (tmp_path / "ckpt" / "unusable-step-00000010").is_dir()
    assert r.digest == clean_digest["ddp"]


def test_unusable_checkpoints_do_not_hold_the_keep_slots(tmp_path, clean_digest):
    """Retention kept the newest `--keep` directories by name: after a resume fell back
    past corrupt newer checkpoints, those held the slots and every fresh checkpoint was
    deleted as soon as it was published, so the next crash started from step 0 again."""
    r = run_trainer(tmp_path / "ckpt", steps=STEPS, max_restarts=2, args=[
        *CKPT, "--keep", "2", "--inject", "ckpt_corrupt:step=20",
        "--inject", "ckpt_corrupt:step=30", "--inject", "crash:rank=0:step=35",
        "--inject", "crash:rank=1:step=15:attempt=1"])
    assert r.returncode == 0, r.log[-3000:]
    resumed = [x["resume_step"] for x in r.summary["restarts"]]
    assert resumed == [0, 10], r.summary["restarts"]  # the second resumes from its own save
    # where falling back ends, said (a review: a run whose every checkpoint was corrupt
    # began again from step 0 after "falling back to an older one" for the oldest too)
    assert "none of the 2 checkpoint(s) in" in r.log, r.log[-3000:]
    assert "is usable: starting from step 0" in r.log
    assert sorted(p.name for p in (tmp_path / "ckpt").glob("unusable-step-*")) == [
        "unusable-step-00000020", "unusable-step-00000030"]
    assert r.digest == clean_digest["ddp"]


@pytest.fixture(scope="module")
def finished_run(tmp_path_factory) -> tuple[Path, RunResult]:
    """One rank, 12 steps, a checkpoint every 5 (steps 5, 10 and the final 12): its
    directory and result. The tests that start a job in that directory start it in a
    copy of their own; the run itself is made once."""
    ckpt = tmp_path_factory.mktemp("finished") / "ckpt"
    return ckpt, run_trainer(ckpt, nproc=1, steps=12, args=["--ckpt-every", "5"])


def test_a_resume_with_another_model_names_it_and_changes_no_checkpoint(tmp_path,
                                                                        finished_run):
    """A run resumed by mistake with another --preset: every checkpoint verified, failed
    to load and was renamed unusable-*, and the corrected run started from step 0 (a
    review: 20 of 20 steps lost). Now: named, exit, nothing moved; then resumed."""
    finished, first = finished_run
    assert first.returncode == 0, first.log[-3000:]
    shutil.copytree(finished, tmp_path / "ckpt")
    before = sorted(p.name for p in (tmp_path / "ckpt").glob("*step-*"))
    wrong = run_trainer(tmp_path / "ckpt", nproc=1, steps=20,
                        args=["--ckpt-every", "5", "--preset", "small"])
    assert wrong.returncode != 0
    assert "step-00000012 in" in wrong.log and "holds another model than this run's" in wrong.log
    assert "parameter(s) of another shape" in wrong.log and "unusable" not in wrong.log
    assert sorted(p.name for p in (tmp_path / "ckpt").glob("*step-*")) == before
    right = run_trainer(tmp_path / "ckpt", nproc=1, steps=15, args=["--ckpt-every", "5"])
    assert right.returncode == 0 and "resumed from step-00000012" in right.log, right.log[-3000:]


def _checkpointing_job(ckpt, log, nproc: int, run: str, steps: int,
                       step_seconds: float) -> subprocess.Popen:
    """A job of `steps` steps padded to `step_seconds` each (a sleep: it lasts that long
    without costing the CPU), checkpointing every 5, once its first checkpoint is
    published."""
    job = start_trainer(ckpt, log, nproc=nproc, steps=steps,
                        args=["--ckpt-every", "5", "--sim-compute-seconds", str(step_seconds),
                              "--run-id", run])
    try:
        wait_until(lambda: any(ckpt.glob("step-*")), 120, f"job {run}'s first checkpoint")
    except BaseException:
        stop_group(job)
        raise
    return job


def test_a_second_job_in_a_running_jobs_checkpoint_directory_is_refused(tmp_path):
    """Two jobs given one --ckpt-dir (a copied batch script, a job submitted twice) wrote
    over each other unseen: the second one's start removed the first one's checkpoint in
    flight, took its newest checkpoint for its own, and both published, pruned and kept
    their accounting in the one directory. Now the second is refused while the first
    runs, naming it, and the first goes on untouched; once the first has ended, a job
    there resumes from its checkpoint as before."""
    ckpt = tmp_path / "ckpt"
    # ~40 s of steps from its first checkpoint, one published every second (a sleep: its
    # length does not grow with the machine's load): the second job's two refused
    # starts (~10 s at a load of 4, CPU-bound) fall within it up to a load of ~15
    first = _checkpointing_job(ckpt, tmp_path / "first.log", 1, "first", steps=200,
                               step_seconds=0.2)
    try:
        # torchrun restarts the refused rank (a failure): its restart refuses at once
        second = run_trainer(ckpt, nproc=1, steps=600, max_restarts=1,
                             args=["--ckpt-every", "5", "--run-id", "second",
                                   "--ckpt-lock-wait", "1"])
        assert first.poll() is None, "the first job ended before the second one started"
        assert second.returncode != 0 and "exitcode  : 2" in second.log, second.log[-3000:]
        assert second.log.count(f"--ckpt-dir {ckpt} is in use by another job (run 'first', "
                                "pid") == 2, second.log[-3000:]
        assert second.log.count("waiting up to 1 s") == 1, second.log[-3000:]
        # one line, not the rank's traceback (torchrun's own follows its exit 2)
        assert "trainer/main.py" not in second.log and "resumed" not in second.log
        assert first.wait(timeout=240) == 0
    finally:
        if first.poll() is None:
            stop_group(first)
    log = (tmp_path / "first.log").read_text()
    assert " failed" not in log, log[-3000:]  # no checkpoint of its lost, none pruned
    state = json.loads((ckpt / "run-state.json").read_text())
    assert state["run"] == "first" and state["last_step"] == 200 and not state["restarts"]
    # the first released its claim as it ended: no waiting for it to go stale
    after = run_trainer(ckpt, nproc=1, steps=205, args=["--ckpt-every", "5",
                                                        "--ckpt-lock-wait", "0"])
    assert after.returncode == 0 and "resumed from step-00000200" in after.log, \
        after.log[-3000:]


def test_a_job_whose_directory_was_taken_over_writes_nothing_more_there(tmp_path):
    """A job whose rank 0 stalled past its claim's 45 s (a hung mount, a partition) can
    find, back, that another job took its --ckpt-dir over: it wrote over that job's
    claim and both wrote there. Now its ranks agree to skip every save (each counted as
    failed, so CheckpointsFailing pages), nothing more is published or accounted there,
    and training goes on to its end, where the job fails: its model is not saved. The
    other job's claim is a node's of another kernel here, written as that node would."""
    ckpt = tmp_path / "ckpt"
    # 10 s of steps: rank 0 reads the claim before each save (5 steps), and the job
    # saves (refused) several times more before its end, if rank 0 sees the claim
    # within ~9 s of its first checkpoint
    job = _checkpointing_job(ckpt, tmp_path / "job.log", 2, "mine", steps=100,
                             step_seconds=0.1)
    try:
        other = {"job": "rdzv:other@head:29400/theirs", "run": "theirs",
                 "host": "gpu-node-17", "pid": 4242, "boot": "another-kernel",
                 "pidns": "pid:[4026531836]", "heartbeat_unix": time.time(),
                 "released": False, "displaced": []}
        (ckpt / "taking-over").write_text(json.dumps(other))
        (ckpt / "taking-over").rename(ckpt / "owner.json")
        log = tmp_path / "job.log"
        wait_until(lambda: "was taken over by another job" in log.read_text(), 60,
                   "the job's rank 0 sees the claim at its next save or heartbeat")
        seen = max(int(p.name[5:]) for p in ckpt.glob("step-*"))
        assert job.wait(timeout=240) == 1, log.read_text()[-3000:]
    finally:
        if job.poll() is None:
            stop_group(job)
    text = log.read_text()
    refused = f"not written: --ckpt-dir {ckpt} was taken over by another job"
    assert text.count(refused) >= 4, text[-3000:]  # both ranks, every save since
    assert text.count(refused) % 2 == 0, text[-3000:]  # the ranks agreed on each
    assert "the final checkpoint (step 100) was not saved" in text, text[-3000:]
    # at most the save in flight as rank 0 saw the claim was published after it
    assert max(int(p.name[5:]) for p in ckpt.glob("step-*")) <= seen + 5 < 100
    assert json.loads((ckpt / "owner.json").read_text()) == other  # not written over
    assert json.loads((ckpt / "run-state.json").read_text())["last_step"] < 100


@pytest.fixture(scope="module")
def failed_write_run(tmp_path_factory) -> tuple[Path, RunResult]:
    """A run whose checkpoint write at step 20 fails, with its telemetry aimed at a port
    nobody listens on: its directory and result. What the two tests below claim of it
    holds of a run with both (neither changes a step: it ends with the clean
    parameters, no restart), so one launch makes them both."""
    ckpt = tmp_path_factory.mktemp("failed-write") / "ckpt"
    return ckpt, run_trainer(ckpt, steps=STEPS, agent="127.0.0.1:9",
                             args=[*CKPT, "--inject", "ckpt_fail:step=20"])


def test_failed_checkpoint_write_does_not_stop_training(failed_write_run, clean_digest):
    ckpt, r = failed_write_run  # --inject ckpt_fail:step=20
    assert r.returncode == 0, r.log[-3000:]
    # once per rank, whole: the exception's type and message, then its traceback
    failed = "checkpoint at step 20 failed: CheckpointError: injected checkpoint write failure"
    assert r.log.count(failed) == 2, r.log[-3000:]
    assert r.log.count("raise CheckpointError(\"injected checkpoint write failure\")") == 2
    assert r.digest == clean_digest["ddp"]
    assert sorted(p.name for p in ckpt.glob("step-*")) == [
        "step-00000010", "step-00000030", "step-00000040"]
    assert r.summary["checkpoint_failures"] == 1 and r.summary["last_checkpoint_step"] == 40


def test_a_run_ends_with_its_final_checkpoint_or_fails_saying_it_has_none(
        tmp_path, finished_run, side_by_side):
    """Review: `--steps 12 --ckpt-every 5` ended with step 10's checkpoint, the last two
    steps' training lost; a run whose every save failed ended "done", exit 0. The last
    step is saved; a final save that fails is exit 1, naming the newest checkpoint.
    A finished run started again trains nothing: its loss was NaN, written into the
    summary as a JSON no strict parser reads."""
    finished, r = finished_run  # --steps 12 --ckpt-every 5
    assert r.returncode == 0, r.log[-3000:]
    assert sorted(p.name for p in finished.glob("step-*"))[-1] == "step-00000012"
    assert r.summary["last_checkpoint_step"] == 12 and r.summary["checkpoint_failures"] == 0
    args = ["--ckpt-every", "5"]
    # rank 0's publish alone fails (its name taken), the other rank's write was done:
    # it went on alone into the end's all-reduce and died of the lost peer
    alone = tmp_path / "alone"
    alone.mkdir()
    (alone / "step-00000012").write_text("in the way")
    ckpt = tmp_path / "ckpt"
    shutil.copytree(finished, ckpt)
    # three runs, each in a directory of its own, side by side
    alone_run = side_by_side.submit(run_trainer, alone, nproc=2, steps=12, args=args)
    failed_run = side_by_side.submit(run_trainer, tmp_path / "full", nproc=1, steps=12,
                                     args=[*args, "--inject", "ckpt_fail:step=12"])
    again = side_by_side.submit(run_trainer, ckpt, nproc=1, steps=12, args=args).result()
    assert again.returncode == 0 and "resumed from step-00000012" in again.log, again.log
    assert json.loads((ckpt / "summary.json").read_text(),
                      parse_constant=lambda c: pytest.fail(f"{c} in the summary")
                      )["final_loss"] is None
    failed = failed_run.result()
    assert failed.returncode != 0, failed.log[-3000:]
    assert "the final checkpoint (step 12) was not saved" in failed.log, failed.log[-3000:]
    assert "the newest in" in failed.log and "is step-00000010" in failed.log
    failed = alone_run.result()
    assert failed.returncode != 0, failed.log[-3000:]
    assert "the final checkpoint (step 12) was not saved" in failed.log, failed.log[-3000:]
    assert "Connection closed by peer" not in failed.log, failed.log[-3000:]


@pytest.mark.slow
@pytest.mark.parametrize("parallel", ["ddp", "fsdp"])
def test_resume_on_a_smaller_world_size(tmp_path, parallel):
    """4 ranks checkpoint at step 20; the job resumes on 2 (a node lost) and finishes on
    the same global batch, so it ends where an uninterrupted 4-rank run ends, to
    floating-point reduction order.

    The 4-rank checkpoint of step 20 is the uninterrupted run's own (checkpoints do not
    change the parameters; nothing in one depends on the step count the run was given):
    one 4-rank torchrun fewer than a separate 20-step run to make it."""
    full = run_trainer(tmp_path / "full", nproc=4, steps=STEPS,
                       args=[*CKPT, "--parallel", parallel])
    assert full.returncode == 0, full.log[-3000:]
    (tmp_path / "ckpt").mkdir()
    shutil.copytree(tmp_path / "full" / "step-00000020", tmp_path / "ckpt" / "step-00000020")
    second = run_trainer(tmp_path / "ckpt", nproc=2, steps=STEPS,
                         args=[*CKPT, "--parallel", parallel])
    assert second.returncode == 0, second.log[-3000:]
    assert "resumed from step-00000020" in second.log
    assert second.summary["world_size"] == 2
    assert second.summary["final_loss"] == pytest.approx(full.summary["final_loss"], abs=2e-3)


def test_trainer_runs_unchanged_without_an_agent(failed_write_run, clean_digest):
    # Telemetry aimed at a port nobody listens on: never blocks, never fails the step.
    _, r = failed_write_run  # --agent 127.0.0.1:9 (and a failed save, not a failed step)
    assert r.returncode == 0, r.log[-3000:]
    assert r.digest == clean_digest["ddp"]


# Two ranks, each reporting to its own node's agent, stepping until they leave.
TWO_NODE_RANK = """
import datetime, json, pathlib, sys, time
import torch.distributed as dist
from clusterpulse.trainer.instrument import Pulse
rank, store, agent, out = int(sys.argv[1]), sys.argv[2], sys.argv[3], pathlib.Path(sys.argv[4])
dist.init_process_group("gloo", init_method=f"file://{store}", rank=rank, world_size=2,
                        timeout=datetime.timedelta(seconds=60))
pulse = Pulse(run="r1", agent=agent, rank=rank, local_rank=0, world_size=2,
              consensus_every=1, catch_sigterm=False)
left = {}
try:
    for step in range(1, 1200):
        with pulse.step(step):
            time.sleep(0.05)
        pulse.boundary(step, save=lambda s: None,
                       before_exit=lambda reason, ids: left.update(reason=reason, ids=ids))
except SystemExit as exit_:
    left["code"] = exit_.code
out.write_text(json.dumps(left))
"""


def test_a_command_one_node_heard_is_recorded_and_acknowledged_by_every_rank(tmp_path):
    """The agreement carried only a flag: a rank whose agent had not delivered the
    command (another node's, or its own a step late) left with no command id, so rank 0
    recorded a restart without its command (CI failed on that) and the rank never
    acknowledged it. Here the command reaches only rank 1's node."""
    a, server_a = start_agent(tmp_path, node="node-a")
    b, server_b = start_agent(tmp_path, node="node-b")
    try:
        procs = [subprocess.Popen(
            [sys.executable, "-c", TWO_NODE_RANK, str(rank), str(tmp_path / "store"),
             agent.telemetry, str(tmp_path / f"rank{rank}.json")],
            stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True)
            for rank, agent in ((0, a), (1, b))]
        wait_until(lambda: a.agent.ranks.of_run("r1") and b.agent.ranks.of_run("r1"), 60,
                   "both ranks registered")
        r = b.post("/v1/runs/r1/actions", {"action": "checkpoint-restart", "reason": "test"})
        assert r.status_code == 202, r.text
        cid = r.json()["id"]
        for p in procs:
            out, _ = p.communicate(timeout=120)
            assert p.returncode == 0, out
        left = [json.loads((tmp_path / f"rank{rank}.json").read_text()) for rank in (0, 1)]
        assert left == [{"reason": "checkpoint-restart", "ids": [cid], "code": 42}] * 2
        def acknowledged() -> list:
            b.agent.collect_once()
            return b.get(f"/v1/commands/{cid}").json()["acknowledged"]

        wait_until(lambda: acknowledged() == [1], 30, "rank 1's acknowledgement")
        assert a.get(f"/v1/commands/{cid}").status_code == 404  # node-a never had it
    finally:
        for server, running in ((server_a, a), (server_b, b)):
            server.shutdown()
            running.agent.stop()


def test_bad_flags_are_named_without_a_traceback_before_torch_is_imported(tmp_path):
    """A bad flag, and --help, answered after torch's import: 2-3 s of CPU in every rank."""
    def trainer(*args: str) -> tuple[subprocess.CompletedProcess, set[str]]:
        r = subprocess.run([sys.executable, "-X", "importtime", "-m", "clusterpulse.trainer",
                            *args], capture_output=True, text=True, cwd=tmp_path, timeout=120)
        return r, {line.rsplit("|", 1)[1].strip() for line in r.stderr.splitlines()
                   if line.startswith("import time:")}

    r, imported = trainer("--inject", "explode:step=1")
    assert r.returncode == 2
    assert "unknown kind 'explode'" in r.stderr and "Traceback" not in r.stderr
    assert "clusterpulse.trainer.config" in imported and "torch" not in imported
    r, imported = trainer("--help")
    assert r.returncode == 0 and "--ckpt-dir" in r.stdout, r.stderr[-3000:]
    assert "torch" not in imported


def test_graceful_checkpoint_restart_command_loses_no_step(tmp_path, clean_digest):
    """Operator -> agent control API -> ranks agree on a step, save, exit 42 -> torchrun
    restarts them -> they resume at that step: zero steps recomputed, same parameters."""
    running, server = start_agent(tmp_path)
    try:
        ckpt = tmp_path / "ckpt"
        # cold: the ranks' exit 42 through the interpreter's shutdown (parallel.py)
        proc = torchrun.start_trainer(ckpt, tmp_path / "trainer.log", steps=STEPS,
                                      max_restarts=2, agent=running.telemetry,
                                      args=[*CKPT, "--sim-compute-seconds", "0.08"])
        wait_until(lambda: any(r["step"] >= 12 for r in running.get("/v1/ranks").json()["ranks"]),
                   120, "ranks past step 12")
        ranks = running.get("/v1/ranks").json()["ranks"]
        assert {r["rank"] for r in ranks} == {0, 1} and {r["run"] for r in ranks} == {"ckpt"}
        r = running.post("/v1/runs/ckpt/actions", {"action": "checkpoint-restart",
                                                   "reason": "test", "requested_by": "ops"})
        assert r.status_code == 202, r.text
        cid = r.json()["id"]
        assert proc.wait(timeout=180) == 0, (tmp_path / "trainer.log").read_text()[-3000:]
        summary = json.loads((ckpt / "summary.json").read_text())
        (restart,) = summary["restarts"]
        assert restart["cause"] == "checkpoint-restart" and restart["command"] == cid
        assert restart["steps_recomputed"] == 0
        assert summary["param_sha256"] == clean_digest["ddp"]
        running.agent.collect_once()
        status = running.get(f"/v1/commands/{cid}").json()
        assert status["state"] == "completed", status
        assert status["acknowledged"] == [0, 1] and status["resumed"] == [0, 1]
        metrics = running.get("/metrics", token=None).text
        labels = '{local_rank="1",node="node-a",rank="1",run="ckpt"}'
        assert f"clusterpulse_trainer_restarts_total{labels} 1.0" in metrics
        assert "clusterpulse_trainer_checkpoint_last_step{" in metrics
        assert "clusterpulse_trainer_sync_wait_seconds{" in metrics
        # the resume record the incident timeline reads: the trainer's own numbers
        rank0 = '{local_rank="0",node="node-a",rank="0",run="ckpt"}'
        assert (f"clusterpulse_trainer_resume_step{rank0} {float(restart['resume_step'])}"
                in metrics), metrics
        assert f"clusterpulse_trainer_resume_steps_recomputed{rank0} 0.0" in metrics
    finally:
        server.shutdown()
        running.agent.stop()


def test_failed_graceful_save_aborts_and_unloadable_checkpoint_falls_back(tmp_path,
                                                                           clean_digest):
    """Under torchrun without clusterpulse-train's relaunch (warm ranks; its shared
    store, 42 for graceful exits):
    - a graceful restart whose checkpoint fails is aborted, said so, and retried at
      the next agreement (no exit with steps lost);
    - a checkpoint that verifies but does not load is skipped, logged and recorded,
      and the job resumes from the one before, ending with the clean parameters."""
    r = run_trainer(tmp_path / "ckpt", steps=STEPS, max_restarts=2, args=[
        *CKPT, "--inject", "graceful:step=10", "--inject", "ckpt_fail:step=10",
        "--inject", "ckpt_unloadable:step=30:attempt=1",
        "--inject", "crash:rank=1:step=33:attempt=1"], timeout=900)  # three attempts
    assert r.returncode == 0, r.log[-3000:]
    assert "checkpoint-restart at step 10 ABORTED" in r.log
    causes = [(x["cause"], x["resume_step"], x["steps_recomputed"])
              for x in r.summary["restarts"]]
    assert causes == [("checkpoint-restart", 15, 0), ("failure", 20, 13)], r.summary
    assert "checkpoint step-00000030 verifies but does not load" in r.log
    (failure,) = r.summary["checkpoint_load_failures"]
    assert failure["checkpoint"] == "step-00000030" and failure["error"]
    assert r.digest == clean_digest["ddp"]
