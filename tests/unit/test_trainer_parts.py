"""Trainer parts that need no process group: fault specs, checkpoint publishing and
fallback, straggler scoring, telemetry sending with no agent."""

from __future__ import annotations

import json
import os
import re
import signal
import socket
import subprocess
import sys
import threading
import time
import types
from collections.abc import Callable
from pathlib import Path
from typing import Any

import pytest
import torch
import torch.distributed.checkpoint as dcp

from clusterpulse.trainer.checkpoint import (
    CheckpointManager,
    dcp_files,
    find_latest_valid,
    iter_valid,
    verify,
)
from clusterpulse.trainer.config import ConfigError, parse_config
from clusterpulse.trainer.consensus import Consensus
from clusterpulse.trainer.data import SyntheticTokens
from clusterpulse.trainer.faults import Faults, InjectError, parse_injection
from clusterpulse.trainer.instrument import Pulse
from clusterpulse.trainer.restart import LOST_ROUND_WAIT_ENV
from clusterpulse.trainer.runstate import ProgressMark, RunState, progress_path
from clusterpulse.trainer.telemetry import AgentLink, parse_agent_addr
from clusterpulse.trainer.torch_support import fsdp_on_cpu, rendezvous_keep_alive
from tests.support.ports import free_port
from tests.support.procs import REPO, wait_until
from tests.support.worlds import gloo_world_of_one, late_peer, late_rebuild, run_ranks

# The rendezvous handlers below beat every second where torch takes the setting (2.7+);
# on the oldest supported torch they keep torch's own 5 s.
KEEP_ALIVE = {"keep_alive_interval": 1} if rendezvous_keep_alive() else {}


def test_injection_specs():
    i = parse_injection("crash:rank=1:step=35:mode=sigkill")
    assert (i.kind, i.rank, i.step, i.mode, i.attempt) == ("crash", 1, 35, "sigkill", 0)
    faults = Faults([i, parse_injection("slow:rank=1:step=10:factor=2")], rank=1, attempt=0)
    assert faults.crash_at(35) == "sigkill" and faults.crash_at(34) is None
    assert faults.slow_factor(9) == 1.0 and faults.slow_factor(50) == 2.0
    assert Faults([i], rank=1, attempt=1).crash_at(35) is None  # not again after restart
    assert Faults([i], rank=0, attempt=0).crash_at(35) is None
    h = parse_injection("ckpt_hang:rank=1:step=40")  # blocks in the save, before DCP's
    assert (h.kind, h.rank, h.step) == ("ckpt_hang", 1, 40)
    assert Faults([h], rank=1, attempt=0).ckpt_hang(40)
    assert not Faults([h], rank=1, attempt=0).ckpt_hang(20)
    assert not Faults([h], rank=0, attempt=0).ckpt_hang(40)  # its peers wait for it


@pytest.mark.parametrize("spec,msg", [
    ("boom:step=1", "unknown kind 'boom'"),
    ("crash:rank", "is not key=value"),
    ("crash:step=x", "invalid literal"),
    ("crash:step=3:mode=gentle", "mode must be one of"),
    ("slow:step=3:factor=0.5", "factor >= 1"),
    ("hang:step=3:colour=red", "unknown keys colour"),
    ("ckpt_hang:step=40", "ckpt_hang needs rank=N"),  # every rank: a slow store
])
def test_bad_injection_specs_are_named(spec, msg):
    with pytest.raises(InjectError, match=msg):
        parse_injection(spec)


def _state(value: float) -> dict:
    return {"w": torch.full((64,), value), "step": torch.tensor(int(value))}


def test_checkpoints_publish_atomically_prune_and_fall_back(tmp_path):
    mgr = CheckpointManager(tmp_path, rank=0, keep=2)
    for step in (10, 20, 30):
        mgr.save(step, _state(step))
    assert sorted(p.name for p in tmp_path.iterdir()) == ["step-00000020", "step-00000030"]
    manifest = json.loads((tmp_path / "step-00000030" / "manifest.json").read_text())
    assert manifest["step"] == 30 and manifest["files_from"] == "dcp-metadata"
    # the manifest lists what DCP's metadata lists (plus the metadata itself), with the
    # checksums each writer computed for its own files
    assert set(manifest["files"]) == {*dcp_files(tmp_path / "step-00000030"), ".metadata"}
    own = json.loads((tmp_path / "step-00000030" / "checksums-rank0.json").read_text())
    assert own["files"] and all(manifest["files"][k] == v for k, v in own["files"].items())
    assert find_latest_valid(tmp_path).step == 30
    # An interrupted write leaves only a temporary directory: never loaded, then cleaned.
    (tmp_path / ".tmp-step-00000040").mkdir()
    assert find_latest_valid(tmp_path).step == 30
    mgr.clean_temporaries()
    assert not (tmp_path / ".tmp-step-00000040").exists()
    # Corrupt the newest: resume falls back to the one before, and loads it.
    data = next((tmp_path / "step-00000030").glob("*.distcp"))
    data.write_bytes(data.read_bytes()[:-8] + b"garbage!")
    assert "fails its checksum" in verify(tmp_path / "step-00000030")
    # verified in parallel: each of 2 ranks hashes its half; only one half holds the
    # bad file, and agreeing on both halves finds it
    halves = [verify(tmp_path / "step-00000030", rank=r, world=2) for r in (0, 1)]
    assert sorted(h is None for h in halves) == [False, True]
    found = find_latest_valid(tmp_path)
    assert found.step == 20
    loaded = _state(0)
    dcp.load(loaded, checkpoint_id=str(found.path))
    assert torch.equal(loaded["w"], torch.full((64,), 20.0))
    # A file that cannot be read (EIO, a stale NFS handle) makes the checkpoint
    # unusable; it used to raise, and every restart crashed on the same file.
    data = next((tmp_path / "step-00000020").glob("*.distcp"))
    saved = data.read_bytes()
    data.unlink()
    data.symlink_to("/proc/self/mem")  # reading it fails with EIO
    assert f"file {data.name} unreadable" in verify(tmp_path / "step-00000020")
    # ... and is not set aside for it (the error may pass); a broken one is
    set_aside: list[int] = []
    assert list(iter_valid(tmp_path, unusable=lambda f: set_aside.append(f.step))) == []
    assert set_aside == [30]  # its checksum fails; 20 was only unreadable
    data.unlink()
    data.write_bytes(saved)
    (tmp_path / "step-00000020" / "manifest.json").unlink()
    assert verify(tmp_path / "step-00000020") == "no manifest (incomplete write)"
    assert find_latest_valid(tmp_path) is None


def test_async_checkpoint_returns_before_the_write_and_publishes_later(tmp_path):
    """The save call returns while the write is still running (the loop is not
    blocked by it), and the checkpoint is published only once the write is done."""
    release = threading.Event()
    publishers: list[threading.Thread] = []

    def hold(step: int) -> None:
        publishers.append(threading.current_thread())
        release.wait(60)

    mgr = CheckpointManager(tmp_path, rank=0, async_save=True, before_publish=hold)
    mgr.save(5, _state(5))
    # a write that finished before save() attached its callback published inside save(),
    # on the caller's thread: on a clean machine save() waited here 60 s (CI, 2026-12-06)
    assert mgr.in_flight and mgr.committed_step is None  # write not yet published
    assert find_latest_valid(tmp_path) is None
    release.set()
    mgr.wait()
    assert mgr.committed_step == 5 and not mgr.in_flight
    assert find_latest_valid(tmp_path).step == 5
    assert publishers and threading.current_thread() not in publishers


def test_an_async_checkpoint_is_published_where_no_thread_can_be_started(tmp_path,
                                                                           monkeypatch):
    """A review found that a publish thread that could not start (a pids limit) left
    the save in flight for good: the next save() waited forever in wait()."""
    start = threading.Thread.start

    def refuse(thread: threading.Thread) -> None:
        if thread.name.startswith("checkpoint-publish"):
            raise RuntimeError("can't start new thread")
        start(thread)

    monkeypatch.setattr(threading.Thread, "start", refuse)
    mgr = CheckpointManager(tmp_path, rank=0, async_save=True)
    mgr.save(5, _state(5))
    waiter = threading.Thread(target=mgr.wait, daemon=True)
    start(waiter)
    waiter.join(30)
    assert not waiter.is_alive() and mgr.committed_step == 5 and not mgr.in_flight
    assert find_latest_valid(tmp_path).step == 5


def test_failed_write_keeps_the_previous_checkpoint(tmp_path):
    from clusterpulse.trainer.checkpoint import CheckpointError

    mgr = CheckpointManager(tmp_path, rank=0)
    mgr.save(10, _state(10))
    with pytest.raises(CheckpointError):
        mgr.save(20, _state(20), fail=True)
    assert mgr.committed_step == 10 and mgr.failures == 1
    assert find_latest_valid(tmp_path).step == 10
    assert not list(tmp_path.glob(".tmp-*"))


def test_a_world_of_one_agrees_its_flags_and_runs_no_straggler_scorer():
    """Alone, a rank has no peers: its scores were always 1, at ~0.3 ms of the training
    thread a exchange (issue #26: host time per step). The flags still count."""
    c = Consensus(every=3, warmup_windows=1)
    for _ in range(6):  # past the warm-up and the scorer's 10-step window
        for x in (0.2, 0.2, 0.9):
            c.record(x)
        restart, ckpt, scores, preempt = c.exchange(True, world=1, want_checkpoint=True)
        assert restart and ckpt and scores is None and not preempt
    assert c.scorer is None and c.last is None and c.exchanges == 6
    assert c.exchange(False, world=1, want_preempt=True)[3] is True


def test_pulse_sends_step_telemetry_and_never_blocks_without_agent():
    rx = socket.socket(socket.AF_INET, socket.SOCK_DGRAM)
    rx.bind(("127.0.0.1", 0))
    rx.settimeout(2)
    pulse = Pulse(run="unit", agent=rx.getsockname(), rank=0, local_rank=0, world_size=1)
    assert json.loads(rx.recv(8192))["event"] == "start"
    with pulse.step(1) as s:
        with s.section("data"):
            pass
        s.loss = torch.tensor(2.5)
        s.samples, s.tokens = 4, 128
    msg = json.loads(rx.recv(8192))
    if msg["type"] == "heartbeat":  # the first section beats: nothing was sent for > 1 s
        assert msg["step"] == 1
        msg = json.loads(rx.recv(8192))
    assert msg["type"] == "step" and msg["step"] == 1 and msg["loss"] == 2.5
    assert msg["tokens_total"] == 128 and msg["step_seconds"] >= msg["compute_seconds"] >= 0
    # No agent listening: sends are dropped silently, steps go on.
    silent = Pulse(run="unit", agent=("127.0.0.1", 9), rank=0, world_size=1)
    for step in range(1, 50):
        with silent.step(step):
            pass
    assert silent.link.sent + silent.link.failed >= 50


def test_agent_address_parsing():
    assert parse_agent_addr("none") is None and parse_agent_addr("") is None
    assert parse_agent_addr("127.0.0.1:9401") == ("127.0.0.1", 9401)
    with pytest.raises(ValueError, match="HOST:PORT"):
        parse_agent_addr("localhost")
    AgentLink(None).send({"type": "heartbeat"})  # telemetry off: a no-op


def test_launcher_builds_the_torchrun_command():
    from clusterpulse import trainer
    from clusterpulse.trainer import warmstart
    from clusterpulse.trainer.launch import build_command

    # the reference trainer starts warm: ranks forked from a server with the imports done
    cmd = build_command(["--nproc", "2", "--max-restarts", "1", "--", "--steps", "5"])
    main_py = str(Path(trainer.__file__).resolve().with_name("__main__.py"))  # the trainer's
    assert cmd[1:] == ["-m", "clusterpulse.trainer.warmstart", "--nproc-per-node=2",
                       "--max-restarts=1", "--standalone", "--run-path",
                       "--start-method=forkserver", main_py, "--steps", "5"]
    # the server leaves the launcher's process group before anything else is imported,
    # then imports the trainer; or, for a script, what --preload named
    assert warmstart.preload(["--nproc-per-node=2"]) == (
        ["clusterpulse.trainer.forkserver_session", "clusterpulse.trainer.main"], [],
        ["--nproc-per-node=2"])
    assert warmstart.preload(["--preload=torch", "--preload-path=/job", "--preload=numpy",
                              "--nproc-per-node=2"]) == (
        ["clusterpulse.trainer.forkserver_session", "torch", "numpy"], ["/job"],
        ["--nproc-per-node=2"])
    cmd = build_command(["--nproc", "2", "--cold-start", "--max-restarts", "1", "--", "--steps",
                         "5"])
    assert cmd[1:] == ["-m", "clusterpulse.trainer.torchrun", "--nproc-per-node=2",
                       "--max-restarts=1",
                       "--standalone", "-m", "clusterpulse.trainer", "--steps", "5"]
    cmd = build_command(["--nproc", "2", "--script", "examples/ddp_tutorial.py", "--", "3"])
    # foreign code: new interpreters, torchrun's way (with its quicker restart)
    assert cmd[1:3] == ["-m", "clusterpulse.trainer.torchrun"]
    assert cmd[-2:] == ["examples/ddp_tutorial.py", "3"]
    # ... unless the caller names what the server may import for it
    cmd = build_command(["--nproc", "2", "--max-restarts", "1", "--script",
                         "examples/ddp_tutorial.py", "--preload", "torch", "--", "3"])
    runner = str(Path(trainer.__file__).resolve().with_name("scriptrun.py"))
    assert cmd[1:] == ["-m", "clusterpulse.trainer.warmstart", "--preload=torch",
                       f"--preload-path={Path('examples').resolve()}", "--nproc-per-node=2",
                       "--max-restarts=1", "--standalone", "--run-path",
                       "--start-method=forkserver", runner, "examples/ddp_tutorial.py", "3"]
    cmd = build_command(["--nproc", "8", "--nnodes", "2", "--rdzv-endpoint", "head:29400"])
    assert "--rdzv-backend=c10d" in cmd and "--rdzv-endpoint=head:29400" in cmd
    cmd = build_command(["--nnodes", "2", "--rdzv-endpoint", "head:29400", "--no-rdzv-host",
                         "--rdzv-conf", "join_timeout=120", "--rdzv-conf", "last_call_timeout=5"])
    assert "--rdzv-conf=is_host=false,join_timeout=120,last_call_timeout=5," \
        "keep_alive_interval=1,keep_alive_max_attempt=5" in cmd
    # recovery-minded defaults (a dead node noticed in 5 s, not 15), each yielding to
    # the caller's own setting
    (conf,) = [c for c in build_command(["--nnodes", "2:4", "--rdzv-endpoint", "h:1"])
               if c.startswith("--rdzv-conf=")]
    assert sorted(conf.removeprefix("--rdzv-conf=").split(",")) == [
        "keep_alive_interval=1", "keep_alive_max_attempt=5", "last_call_timeout=5"]
    (conf,) = [c for c in build_command(["--nnodes", "2:4", "--rdzv-endpoint", "h:1",
                                         "--rdzv-conf", "keep_alive_interval =3"])
               if c.startswith("--rdzv-conf=")]
    assert "keep_alive_interval=1" not in conf  # torch strips the key: so is it here


def test_launcher_names_a_bad_rendezvous_setting(capsys):
    from clusterpulse.trainer.launch import build_command

    for argv, says in [
            (["--rdzv-endpoint", "h:1", "--rdzv-conf", "join_timeout"], "expected KEY=VALUE"),
            (["--rdzv-endpoint", "h:1", "--rdzv-conf", "is_host=1"], "use --rdzv-host"),
            (["--rdzv-conf", "join_timeout=5"], "needs --rdzv-endpoint"),
            (["--preload", "torch"], "--preload is for --script"),
            (["--script", "README.md", "--preload", "torch", "--cold-start"], "pick one"),
            (["--script", "README.md", "--preload", "torch; rm"], "not a module name")]:
        with pytest.raises(SystemExit) as exit_:
            build_command(argv)
        assert exit_.value.code == 2
        assert says in capsys.readouterr().err


@pytest.mark.parametrize("flags, says", [
    (["--steps", "-5"], "clusterpulse-train: error: --steps, --global-batch"),
    (["--preset", "nope"], "argument --preset: invalid choice: 'nope'"),
    (["--ckpt-dir", "README.md"], "--ckpt-dir README.md exists and is not a directory")])
def test_the_launcher_refuses_a_bad_trainer_flag_before_any_rank_starts(flags, says):
    """Every rank refused a usage error (exit 2), torchrun restarted them --max-restarts
    times and then printed its failure report: the error 4 times, then 5 tracebacks (a
    review). The launcher checks the flags first, without importing torch."""
    probe = ("import sys\n"
             "from clusterpulse.trainer import launch\n"
             "try:\n"
             f"    rc = launch.main(['--nproc', '1', '--max-restarts', '3', '--', *{flags!r}])\n"
             "except SystemExit as leave:\n"
             "    rc = leave.code\n"
             "print(rc, 'torch' in sys.modules)\n")
    r = subprocess.run([sys.executable, "-c", probe], cwd=REPO, capture_output=True, text=True,
                       timeout=60)
    assert r.stdout.split() == ["2", "False"], (r.stdout, r.stderr)
    assert r.stderr.count(says) == 1 and "Traceback" not in r.stderr, r.stderr


def test_the_launchers_check_leaves_torchruns_variables_to_the_ranks(monkeypatch):
    """torchrun sets RANK and its kin for every rank: a scheduler's own RANK=node-a in
    the launcher's environment is no error there (a review: clusterpulse-train refused
    a launch that used to work); a rank still refuses one that is not a number."""
    monkeypatch.setenv("RANK", "node-a")
    assert parse_config(["--steps", "1"], launcher_env=False).steps == 1
    with pytest.raises(ConfigError, match=r"\$RANK must be a whole number"):
        parse_config(["--steps", "1"])


@pytest.mark.parametrize("run", ["my run/1", "", "x" * 129, "run\n"])
def test_run_ids_the_agent_would_drop_are_refused_at_construction(run):
    with pytest.raises(ValueError, match="not accepted by the agent"):
        Pulse(run=run, agent=None)


def test_section_names_the_agent_would_drop_are_refused():
    pulse = Pulse(run="unit", agent=None, world_size=1, catch_sigterm=False)
    with (pulse.step(1) as s, pytest.raises(ValueError, match="section 'forward' is not one"),
          s.section("forward")):
        pass
    pulse.close()


def test_pulse_honours_clusterpulse_agent(monkeypatch):
    rx = socket.socket(socket.AF_INET, socket.SOCK_DGRAM)
    rx.bind(("127.0.0.1", 0))
    rx.settimeout(5)
    monkeypatch.setenv("CLUSTERPULSE_AGENT", f"127.0.0.1:{rx.getsockname()[1]}")
    with Pulse(run="env-run", rank=0, world_size=1, catch_sigterm=False) as pulse:
        assert pulse.link.addr == rx.getsockname()
        assert json.loads(rx.recv(8192))["event"] == "start"
    monkeypatch.setenv("CLUSTERPULSE_AGENT", "none")
    assert Pulse(run="off", world_size=1, catch_sigterm=False).link.addr is None
    monkeypatch.setenv("CLUSTERPULSE_AGENT", "localhost")
    with pytest.raises(ValueError, match="HOST:PORT"):
        Pulse(run="bad", world_size=1, catch_sigterm=False)


def test_data_stalls_count_as_data_wait_and_close_reports_the_outcome():
    """A slow input pipeline shows as data wait, not compute; the context manager
    stops (joins) the heartbeat thread and tells the agent the rank finished."""
    rx = socket.socket(socket.AF_INET, socket.SOCK_DGRAM)
    rx.bind(("127.0.0.1", 0))
    rx.settimeout(5)

    def slow_loader():
        for i in range(2):
            time.sleep(0.2)
            yield i

    with Pulse(run="unit", agent=rx.getsockname(), rank=0, world_size=1,
               catch_sigterm=False) as pulse:
        for step, _batch in enumerate(pulse.data(slow_loader()), start=1):
            with pulse.step(step) as s, s.section("forward_backward"):
                pass
            assert pulse.last["data_wait_seconds"] >= 0.2
            assert pulse.last["compute_seconds"] < pulse.last["data_wait_seconds"]
            assert pulse.last["step_seconds"] >= pulse.last["data_wait_seconds"]
        beat = pulse._beat
    assert not beat.is_alive() and pulse.outcome == "finished"
    msgs = []
    while True:
        m = json.loads(rx.recv(8192))
        msgs.append(m)
        if m.get("event") == "exit":
            break
    assert msgs[-1]["outcome"] == "finished"
    assert [m["step"] for m in msgs if m["type"] == "step"] == [1, 2]


def test_checkpoint_committed_feeds_the_checkpoint_age():
    pulse = Pulse(run="unit", agent=None, world_size=1, catch_sigterm=False)
    pulse.checkpoint_committed(40, timestamp=1234.5)
    assert pulse.extra["checkpoint_step"] == 40
    assert pulse.extra["checkpoint_timestamp_seconds"] == 1234.5
    pulse.close()


def test_a_failed_save_aborts_a_graceful_restart_and_training_goes_on(capsys):
    pulse = Pulse(run="unit", agent=None, world_size=1, consensus_every=1,
                  catch_sigterm=False)
    pulse.commands["c1"] = "checkpoint-restart"

    def failing_save(step):
        raise OSError("disk full")

    pulse.boundary(3, save=failing_save)  # returns: no exit with steps lost
    assert "checkpoint-restart at step 3 ABORTED" in capsys.readouterr().out
    assert pulse.commands == {"c1": "checkpoint-restart"}  # not acknowledged: resent
    saved = []
    with pytest.raises(SystemExit) as exit_:
        pulse.boundary(4, save=saved.append)
    assert saved == [4] and exit_.value.code == 42 and pulse.outcome == "checkpoint-restart"
    assert "c1" in pulse._acks


def test_acknowledgements_ride_on_every_later_message_up_to_the_exit():
    """CI finding: a rank's one acknowledgement datagram was lost under load, and it
    saved and exited before another step message could repeat it."""
    rx = socket.socket(socket.AF_INET, socket.SOCK_DGRAM)
    rx.bind(("127.0.0.1", 0))
    rx.settimeout(5)
    pulse = Pulse(run="unit", agent=rx.getsockname(), rank=0, world_size=1,
                  consensus_every=1, catch_sigterm=False)
    pulse.commands["c1"] = "checkpoint-restart"
    with pytest.raises(SystemExit):
        pulse.boundary(4, save=lambda step: None)
    pulse.close("checkpoint-restart")
    msgs = []
    while not msgs or msgs[-1].get("event") != "exit":
        msgs.append(json.loads(rx.recv(8192)))
    events = {m["event"]: m for m in msgs if m["type"] == "event"}
    assert events["restart_requested"]["acks"] == ["c1"]
    assert events["exit"]["acks"] == ["c1"] and events["exit"]["outcome"] == "checkpoint-restart"


def test_run_progress_survives_sigkill_between_state_saves(tmp_path):
    """CI finding: rank 0, blocked behind a hung peer, was SIGKILLed; the run state
    (rewritten only when cheap) said step 53 where it had reached 59, so the restart
    reported 13 steps recomputed instead of 19."""
    import subprocess
    import sys

    state_path = tmp_path / "run-state.json"
    child = f"""
import os, signal, sys
from pathlib import Path
from clusterpulse.trainer.runstate import ProgressMark, RunState, progress_path
path = Path({str(state_path)!r})
rs = RunState()
rs.begin_attempt("r", 0, 0)
rs.save(path)
mark = ProgressMark(progress_path(path))
for step in range(1, 60):
    rs.step_done(step, 0.1)
    mark.write(rs)
    if step == 53:
        rs.save(path)
os.kill(os.getpid(), signal.SIGKILL)
"""
    r = subprocess.run([sys.executable, "-c", child], timeout=60)
    assert r.returncode == -9
    state = RunState.load(state_path)
    assert state.last_step == 59 and abs(state.productive_seconds - 5.9) < 1e-6
    state.begin_attempt("r", 1, 40)
    assert state.restarts[-1]["steps_recomputed"] == 19
    # Attempt 1 re-runs steps 41..50 and is SIGKILLed: the furthest step stays 59, the
    # time of the last step is attempt 1's (the next restart's downtime starts there).
    before = state.last_step_unix
    state.save(state_path)
    again = ProgressMark(progress_path(state_path))
    for step in range(41, 51):
        state.step_done(step, 0.1)
        again.write(state)
    again.close()
    killed = RunState.load(state_path)
    assert killed.last_step == 59 and killed.last_step_unix > before
    # A mark left by another run in the same directory is not this run's progress.
    fresh = RunState()
    fresh.begin_attempt("other", 0, 0)
    fresh.save(state_path)
    assert RunState.load(state_path).last_step == 0
    # A truncated mark is ignored, never an error.
    progress_path(state_path).write_bytes(b"\x01\x02")
    assert RunState.load(state_path).last_step == 0


def test_sigterm_becomes_a_checkpoint_then_exit_143():
    import os
    import signal

    pulse = Pulse(run="unit", agent=None, world_size=1, consensus_every=2)
    try:
        os.kill(os.getpid(), signal.SIGTERM)
        time.sleep(0.1)
        assert pulse.sigterm.received
        saved = []
        pulse.boundary(1, save=saved.append)  # not a consensus step: keeps going
        with pytest.raises(SystemExit) as exit_:
            pulse.boundary(2, save=saved.append)
        assert saved == [2] and exit_.value.code == 143 and pulse.outcome == "preempted"
    finally:
        pulse.close()
    assert signal.getsignal(signal.SIGTERM) is not pulse.sigterm._handle


def test_copies_of_one_sigterm_are_one_request_and_a_later_one_exits_at_once():
    """A scheduler signals every process of the job and torchrun passes its own copy
    on: a rank gets two or three SIGTERMs within milliseconds. The second was taken for
    an operator's "stop now" and every rank left without the preemption's checkpoint
    (tests/integration/test_restart_safety.py, every-process). A SIGTERM
    SIGTERM_REPEAT_S after the first is that request."""
    from clusterpulse.trainer.restart import SIGTERM_REPEAT_S, SigtermCatcher

    ran = []
    catcher = SigtermCatcher()
    catcher.on_first = lambda: ran.append(1)
    catcher._handle(15, None)
    catcher._handle(15, None)  # torchrun's copy
    catcher._handle(15, None)  # and its second, from its interrupted shutdown
    assert catcher.received and ran == [1]
    assert catcher.arrived_at is not None
    catcher.arrived_at -= SIGTERM_REPEAT_S
    with pytest.raises(SystemExit) as leave:
        catcher._handle(15, None)
    assert leave.value.code == 143


def test_a_copy_handled_late_is_judged_by_when_it_arrived():
    """Review: the window was measured to when Python ran the handler, which a rank in a
    long native call (a backward, a collective) runs seconds after the signal came: a
    copy that arrived 50 ms after the first was taken for a second request and the rank
    left without the checkpoint; and a second request arriving 7 s after a first that
    was handled late was taken for a copy. Real signals, a real wake-up thread, a
    6 s native call (C's system(), which Python does not interrupt for a handler)
    standing in for the rank's work."""
    import os
    import signal
    import subprocess

    from clusterpulse.trainer.restart import SIGTERM_REPEAT_S, SigtermCatcher

    catcher = SigtermCatcher()
    catcher.install()
    try:
        os.kill(os.getpid(), signal.SIGTERM)
        time.sleep(0.1)
        assert catcher.received
        # the copy arrives 50 ms in, while this thread is in native code
        copy = subprocess.Popen(["sh", "-c", f"sleep 0.05; kill -TERM {os.getpid()}"])
        assert os.system(f"sleep {SIGTERM_REPEAT_S + 1:g}") == 0
        copy.wait()
        time.sleep(0.1)  # handled here, 6 s after the first: still a copy
        assert catcher.installed
    finally:
        catcher.uninstall()
    late = SigtermCatcher()
    late.install()
    try:
        first = subprocess.Popen(["sh", "-c", f"sleep 0.1; kill -TERM {os.getpid()}"])
        assert os.system(f"sleep {SIGTERM_REPEAT_S + 1:g}") == 0  # handled late
        first.wait()
        time.sleep(0.1)
        assert late.received
        with pytest.raises(SystemExit):  # the second request, 6 s after the first came
            os.kill(os.getpid(), signal.SIGTERM)
            time.sleep(0.5)
    finally:
        late.uninstall()


def test_a_sigterm_leaves_a_stuck_rank_only_where_waiting_cannot_help(monkeypatch):
    """Stuck (Pulse.stuck_after_sigterm): in a step (the handler never run: native
    code) or in the boundary's agreement since SIGTERM, past the steady hang threshold
    (5 s, or 10 usual steps); never before a first step, while saving or starting,
    between steps or reading input, nor for a catcher another one replaced."""
    from clusterpulse.trainer.restart import SigtermCatcher

    monkeypatch.setattr(Pulse, "_give_up_if_stuck", lambda self: None)  # not this process
    pulse = Pulse(run="unit", agent=None, world_size=1)
    try:
        now = time.monotonic()
        pulse.phase, pulse._phase_since = "step", now - 60
        assert pulse.stuck_after_sigterm() is None  # no SIGTERM
        pulse.sigterm.arrived_at = now - 6
        assert pulse.stuck_after_sigterm() is None  # no step yet: no usual step time
        pulse._recent_steps.extend([0.1] * 5)
        assert "phase step for 6 s" in (pulse.stuck_after_sigterm() or "")
        pulse.sigterm.arrived_at = now - 4
        assert pulse.stuck_after_sigterm() is None  # within the 5 s floor
        pulse.sigterm.arrived_at = now - 6
        pulse._phase_since = now - 1  # the phase changed since: it moves
        assert pulse.stuck_after_sigterm() is None
        pulse._phase_since = now - 60
        pulse._recent_steps.extend([1.0] * 20)  # 1 s steps: 10 s allowed
        assert pulse.stuck_after_sigterm() is None
        pulse.sigterm.arrived_at = now - 11
        assert "(10 s allowed)" in (pulse.stuck_after_sigterm() or "")
        for phase in ("forward_backward", "optimizer"):  # a step's sections
            pulse.phase = phase
            assert pulse.stuck_after_sigterm() is not None, phase
        for phase in ("checkpoint", "start", "between", "data"):
            pulse.phase = phase
            assert pulse.stuck_after_sigterm() is None, phase
        pulse.sigterm.received = True  # the handler ran: the main thread runs Python
        for phase in ("step", "forward_backward"):
            pulse.phase = phase
            assert pulse.stuck_after_sigterm() is None, phase
        pulse.phase = "sync"  # ... but waits in the boundary's agreement
        assert pulse.stuck_after_sigterm() is not None
        newer = SigtermCatcher()  # a newer catcher took SIGTERM over: not this one's
        newer.install()
        try:
            assert pulse.stuck_after_sigterm() is None
        finally:
            newer.uninstall()
        assert pulse.stuck_after_sigterm() is not None
    finally:
        pulse.sigterm.received = False
        pulse.close()


def test_the_sigterm_watcher_hears_only_its_own_process_and_restores_the_wakeup_fd():
    """The wake-up descriptor is process-wide: a catcher forwards to the one before it
    (an event loop's) and puts it back; a catcher replaced by a newer one, or a forked
    child's SIGTERM, does not count as this process's SIGTERM."""
    import signal as sig

    from clusterpulse.trainer.restart import SigtermCatcher

    loop_read, loop_write = os.pipe()  # an event loop's descriptor
    os.set_blocking(loop_write, False)
    os.set_blocking(loop_read, False)
    sig.set_wakeup_fd(loop_write)
    older, newer = SigtermCatcher(), SigtermCatcher()
    try:
        older.install()
        newer.install()
        os.kill(os.getpid(), sig.SIGTERM)
        wait_until(lambda: newer.received and newer.arrived_at is not None, 10, "SIGTERM")
        time.sleep(0.3)
        assert older.arrived_at is None and not older.received
        assert os.read(loop_read, 64) == bytes([sig.SIGTERM])  # forwarded, once
        newer.arrived_at, newer.received = None, False
        child = os.fork()
        if child == 0:  # the child's SIGTERM is its own
            os.kill(os.getpid(), sig.SIGTERM)
            os._exit(0)
        os.waitpid(child, 0)
        time.sleep(0.3)
        assert newer.arrived_at is None
        newer.uninstall()
        older.uninstall()
        assert sig.set_wakeup_fd(-1) == loop_write  # put back as it was
    finally:
        newer.uninstall()
        older.uninstall()
        sig.set_wakeup_fd(-1)
        os.close(loop_read)
        os.close(loop_write)


STUCK_RANK = """\
import sys
import torch
import torch.distributed as dist
from clusterpulse.trainer.instrument import Pulse
dist.init_process_group("gloo")
pulse = Pulse(run="stuck", agent=None, consensus_every=5)
t = torch.ones(1000)
step = 0
while True:
    step += 1
    with pulse.step(step) as ctx, ctx.section("forward_backward"):  # as the trainer's
        dist.all_reduce(t)
    pulse.boundary(step, save=lambda s: print(f"saved {s}", flush=True))
    if step == 20:
        print("stepping", flush=True)
"""


def test_a_rank_blocked_on_a_peer_leaves_on_sigterm_without_the_boundary(tmp_path):
    """A peer stopped (as one cut off the network: its sockets stay open) blocks the
    other rank in the step's all-reduce; torchrun restarting the job around it sends
    SIGTERM, which the rank used to keep for a checkpoint at a boundary it never
    reached (the job waited out torchrun's 30 s close timeout, or the cut). Now it
    leaves, 143, saying why."""
    port = free_port()
    env = {**os.environ, "PYTHONPATH": str(REPO), "MASTER_ADDR": "127.0.0.1",
           "MASTER_PORT": str(port), "WORLD_SIZE": "2"}
    ranks = [subprocess.Popen([sys.executable, "-c", STUCK_RANK],
                              env={**env, "RANK": str(r), "LOCAL_RANK": "0"},
                              stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True)
             for r in range(2)]
    try:
        assert ranks[0].stdout.readline().strip() == "stepping"
        ranks[1].send_signal(signal.SIGSTOP)
        time.sleep(1)  # rank 0 is in the next all-reduce, waiting for rank 1
        ranks[0].send_signal(signal.SIGTERM)
        try:
            code = ranks[0].wait(timeout=60)  # ~5-6 s expected; blocked for good before
        except subprocess.TimeoutExpired:
            pytest.fail("rank 0 stayed blocked in the all-reduce after SIGTERM")
        err = ranks[0].stderr.read()
        assert code == 143, err
        # in the step's all-reduce, or in the agreement if stopped between the two
        assert "leaves without a checkpoint" in err, err
        assert re.search(r"in phase (forward_backward|sync) for \d+ s since SIGTERM", err), err
        assert "saved" not in ranks[0].stdout.read()
    finally:
        for r in ranks:
            r.send_signal(signal.SIGCONT)
            r.kill()
            r.wait()


RANK_TEARING_DOWN = """\
import datetime, gc, os, sys
import torch
import torch.distributed as dist
from torch import nn
from clusterpulse.trainer.instrument import Pulse
rank, world = int(os.environ["RANK"]), int(os.environ["WORLD_SIZE"])
torch.set_num_threads(1)
store = dist.TCPStore("127.0.0.1", int(os.environ["MASTER_PORT"]), world,
                      is_master=rank == 0, timeout=datetime.timedelta(seconds=60))
for start in range(int(sys.argv[1])):  # a loop's graceful leave, as Pulse.boundary's
    dist.init_process_group("gloo", store=dist.PrefixStore(f"start-{start}", store),
                            rank=rank, world_size=world)
    pulse = Pulse(run="teardown", agent=None)
    model = nn.parallel.DistributedDataParallel(nn.Linear(64, 64))
    model(torch.randn(4, 64)).sum().backward()
    every = [None] * world
    dist.all_gather_object(every, (rank, ["command"] * 8))  # as agree_on_commands
    dist.barrier()
    pulse.close("checkpoint-restart")
    dist.destroy_process_group()
    del model  # the caller's frames, unwinding from the SystemExit
    gc.collect()
    print(f"left {start}", flush=True)
print("left", flush=True)
"""
STALL_S = 90  # no rank takes this long for one start-and-leave: it hung


@pytest.mark.slow
def test_a_rank_leaving_after_the_barrier_frees_ddp_without_hanging(tmp_path):
    """Four gloo ranks, each leaving as Pulse.boundary leaves (barrier, close, destroy)
    and then freeing its DDP model, 40 times. With the reducer dropping the process
    group last, a rank hung in gloo's destructor within the first few (every run
    tried); it hung a 2-node job's graceful restart in CI
    (parallel.hold_process_groups_until_exit)."""
    port = free_port()
    env = {**os.environ, "PYTHONPATH": str(REPO), "MASTER_PORT": str(port),
           "WORLD_SIZE": "4", "OMP_NUM_THREADS": "1"}
    logs = [tmp_path / f"rank{r}.log" for r in range(4)]
    outs = [log.open("w") for log in logs]
    ranks = [subprocess.Popen([sys.executable, "-c", RANK_TEARING_DOWN, "40"],
                              env={**env, "RANK": str(r)}, stdout=out,
                              stderr=subprocess.STDOUT) for r, out in enumerate(outs)]
    # A hang is a rank that stops going on, told apart from a slow machine (the
    # oldest torch's run at nice 5 beside the suite, load 16: all 40 starts took
    # longer than a fixed 180 s, though every rank went on): each start-and-leave,
    # and the exit after the last, must come within STALL_S of the one before.
    last = [(0, time.monotonic())] * 4
    backstop = time.monotonic() + 40 * STALL_S  # a rank that says something forever
    try:
        while any(r.poll() is None for r in ranks):
            assert time.monotonic() < backstop, [log.read_text()[-200:] for log in logs]
            for i, (r, log) in enumerate(zip(ranks, logs, strict=True)):
                size = log.stat().st_size
                if r.poll() is not None or size != last[i][0]:
                    last[i] = (size, time.monotonic())
                elif time.monotonic() - last[i][1] > STALL_S:
                    pytest.fail(f"rank {i} hung tearing its process group down: nothing "
                                f"for {STALL_S} s after {log.read_text()[-200:]!r}")
            time.sleep(0.5)
    finally:
        for r, out in zip(ranks, outs, strict=True):
            r.kill()
            r.wait()
            out.close()
    outputs = [log.read_text() for log in logs]
    assert [r.returncode for r in ranks] == [0] * 4, outputs
    # every start left, and then the rank (a warning at exit may follow)
    assert all(re.search(r"^left 39\nleft$", out, re.M) for out in outputs), outputs


JOINING_RANK = """\
import signal, sys
from clusterpulse.trainer.parallel import init_distributed
if sys.argv[1] == "catching":  # a handler before the group (a Pulse's, the loop's own)
    signal.signal(signal.SIGTERM, lambda *_: print("caught", flush=True))
init_distributed(timeout_s=float(sys.argv[2]))
"""


@pytest.mark.slow
def test_a_rank_whose_round_ends_while_it_joins_waits_for_its_torchrun(tmp_path):
    """A node's rank joining the process group when the round's store closes (another
    node's torchrun restarting the round: a rank there died at init) waits for its own
    torchrun's SIGTERM instead of failing: it failed first on a loaded machine, and one
    rank's crash spent a failure restart of every node (test_restart_safety's dead-rank
    test, [2, 2] restarts started ahead where [2, 3]). SIGTERM ends it even where a
    handler was installed before (a sleep goes on through a Python handler). Without
    a SIGTERM it fails after its wait; a one-node job (its torchrun restarts every
    rank for any failure), a rank without torchrun and a store that only timed out
    fail at once. Each rank here is rank 1 of 2, its round's store hosted by this test,
    which closes it once the rank waits in it (all but the timeout's)."""
    waiting = "waiting up to"
    multi = {"LOCAL_WORLD_SIZE": "1"}
    cases = {  # name: (environment, handler, init timeout)
        "signalled": ({**multi, LOST_ROUND_WAIT_ENV: "300"}, "catching", 120),
        # long enough to be seen waiting by a test starved on a loaded machine (5 s was
        # over before the test at nice 19 read the line)
        "alone": ({**multi, LOST_ROUND_WAIT_ENV: "15"}, "none", 120),
        "one node": ({"LOCAL_WORLD_SIZE": "2"}, "none", 120),
        "no torchrun": ({**multi, "TORCHELASTIC_RUN_ID": None}, "none", 120),
        "timeout": (multi, "none", 10),
    }
    stores, ranks, logs = {}, {}, {}
    try:
        for name, (extra, handler, timeout) in cases.items():
            stores[name] = torch.distributed.TCPStore("127.0.0.1", 0, is_master=True,
                                                      wait_for_workers=False)
            env = {**os.environ, "PYTHONPATH": str(REPO), "MASTER_ADDR": "127.0.0.1",
                   "MASTER_PORT": str(stores[name].port), "WORLD_SIZE": "2", "RANK": "1",
                   "LOCAL_RANK": "0", "TORCHELASTIC_RUN_ID": "lost", "OMP_NUM_THREADS": "1",
                   **extra}
            env = {k: v for k, v in env.items() if v is not None}
            logs[name] = tmp_path / f"{name}.log"
            with logs[name].open("w") as out:
                ranks[name] = subprocess.Popen(
                    [sys.executable, "-c", JOINING_RANK, handler, str(timeout)], env=env,
                    stdout=out, stderr=subprocess.STDOUT)
        # each rank has written its address and waits for rank 0's: end every round
        for name in cases:
            wait_until(lambda s=stores[name]: s.num_keys() > 1, 120, f"rank {name} joining")
        kept = stores.pop("timeout")  # only the others' stores close
        stores.clear()  # the only references: their servers close
        ended = time.monotonic()
        wait_until(lambda: waiting in logs["signalled"].read_text(), 60, "the rank waiting")
        assert ranks["signalled"].poll() is None, logs["signalled"].read_text()[-2000:]
        ranks["signalled"].terminate()  # as torchrun stops its workers for the new round
        assert ranks["signalled"].wait(timeout=60) == -signal.SIGTERM
        assert "caught" not in logs["signalled"].read_text()
        for name in ("one node", "no torchrun", "timeout"):
            ranks[name].wait(timeout=120)
            out = logs[name].read_text()
            assert ranks[name].returncode != 0 and waiting not in out, (name, out[-2000:])
        for name in ("one node", "no torchrun"):
            assert "DistNetworkError" in logs[name].read_text(), name
        wait_until(lambda: "waiting up to 15 s" in logs["alone"].read_text(), 60,
                   "the other rank waiting")
        assert ranks["alone"].poll() is None, logs["alone"].read_text()[-2000:]  # it waits
        ranks["alone"].wait(timeout=120)
        out = logs["alone"].read_text()
        assert ranks["alone"].returncode != 0 and "no restart came in 15 s" in out, out[-2000:]
        assert out.strip().splitlines()[-1].startswith("torch.distributed.DistNetworkError")
        assert time.monotonic() - ended >= 15  # not before its wait was over
        del kept
    finally:
        stores.clear()
        for p in ranks.values():
            p.kill()
            p.wait()


def test_the_lost_rounds_wait_is_sigterms_default_and_never_replaces_inits_error(
        monkeypatch):
    """In process: the wait's length from the environment (a malformed or infinite
    value is the default: `inf` overflowed the sleep), NCCL's report of a closed store
    (a DistBackendError) counts as a lost round and its other errors do not, SIGTERM
    has its default action during the wait and the handler before it after, and
    whatever goes wrong in the wait, init's own error is the one raised."""
    from clusterpulse.trainer import parallel

    for raw, want in (("", 15.0), ("0", 0.0), ("4.5", 4.5), ("-1", 15.0), ("x", 15.0),
                      ("inf", 15.0), ("nan", 15.0)):
        monkeypatch.setenv(LOST_ROUND_WAIT_ENV, raw)
        assert parallel.lost_round_wait_s() == want, raw
    dist_ = torch.distributed
    assert parallel._round_lost(dist_.DistBackendError(
        "[../c10d/TCPStore.cpp] recvValue failed: Connection was likely closed"))
    assert not parallel._round_lost(dist_.DistBackendError("NCCL error: unhandled cuda error"))
    assert not parallel._round_lost(dist_.DistStoreError("Socket Timeout"))

    monkeypatch.setenv(LOST_ROUND_WAIT_ENV, "7")
    monkeypatch.setenv("TORCHELASTIC_RUN_ID", "lost")
    monkeypatch.setenv("LOCAL_WORLD_SIZE", "1")
    during = []
    # parallel's own view of the time module: another thread's sleep stays a sleep
    monkeypatch.setattr(parallel, "time", types.SimpleNamespace(
        sleep=lambda s: during.append((s, signal.getsignal(signal.SIGTERM)))))

    def mine(*_: object) -> None:
        pass

    before = signal.signal(signal.SIGTERM, mine)
    try:
        parallel._await_the_rounds_restart(dist_.DistNetworkError("got 0 bytes"), 1, 2)
        assert during == [(7.0, signal.SIG_DFL)] and signal.getsignal(signal.SIGTERM) is mine
    finally:
        signal.signal(signal.SIGTERM, before)

    def broken(*_: object) -> None:
        raise RuntimeError("the wait broke")

    def lost(*_: object, **__: object) -> None:
        raise dist_.DistNetworkError("Failed to recv, got 0 bytes")

    monkeypatch.setattr(parallel, "_await_the_rounds_restart", broken)
    monkeypatch.setattr(parallel.dist, "is_initialized", lambda: False)
    monkeypatch.setattr(parallel.dist, "init_process_group", lost)
    monkeypatch.setenv("WORLD_SIZE", "2")
    monkeypatch.setenv("RANK", "1")
    with pytest.raises(dist_.DistNetworkError, match="got 0 bytes"):
        parallel.init_distributed(timeout_s=5)


def test_attach_ddp_adds_no_python_comm_hook(tmp_path):
    """Regression guard for the exit-time abort: a Python DDP comm hook runs Python
    callbacks on gloo's threads; attach_ddp must time buckets without one."""
    import datetime

    import torch.distributed as dist

    dist.init_process_group("gloo", init_method=f"file://{tmp_path / 'store'}", rank=0,
                            world_size=1, timeout=datetime.timedelta(seconds=60))
    try:
        model = torch.nn.parallel.DistributedDataParallel(torch.nn.Linear(8, 8))
        pulse = Pulse(run="unit", agent=None, world_size=1, catch_sigterm=False)
        pulse.attach_ddp(model)
        assert model._comm_hooks == [] and model.logger is not None
        with pulse.step(1) as s, s.section("forward_backward"):
            model(torch.ones(2, 8)).sum().backward()
            assert len(pulse._ddp_passes) == 1  # the rank's own work done, DDP's all-reduce
        assert len(pulse._pending) == 0 and pulse.last["sync_wait_seconds"] >= 0
        assert pulse.collectives.entered == pulse.collectives.completed == 1
        # one rank reduces nothing: no all-reduce traffic is claimed
        assert "comm_seconds" not in pulse.last and "comm_bytes" not in pulse.last
        # gradient accumulation: a backward under no_sync() reduces nothing, is not marked
        with pulse.step(2) as s, s.section("forward_backward"), model.no_sync():
            model(torch.ones(2, 8)).sum().backward()
            assert pulse._ddp_passes == []
        assert pulse.collectives.entered == 1  # no all-reduce entered
        # this forward rebuilt DDP's buckets (a collective: timed), the next does not
        assert model._has_rebuilt_buckets and len(pulse._fwd_waits) == 1
        with pulse.step(3) as s, s.section("forward_backward"), model.no_sync():
            model(torch.ones(2, 8)).sum().backward()
        assert pulse._ddp_passes == pulse._fwd_waits == []
        assert pulse.last["sync_wait_seconds"] == 0
        pulse.close()
    finally:
        dist.destroy_process_group()


def _python_calls_in_backward(pulse: Pulse, model: torch.nn.Module, step: int) -> int:
    """Python functions entered while a syncing step's backward runs (autograd, DDP's
    reducer and the engine are C++: whatever Python runs there is a hook)."""
    x = torch.ones(2, 8)
    calls = 0

    def count(_frame, event, _arg):
        nonlocal calls
        calls += event == "call"

    with pulse.step(step) as s, s.section("forward_backward"):
        loss = model(x).sum()
        sys.setprofile(count)
        try:
            loss.backward()
        finally:
            sys.setprofile(None)
    return calls


def test_attach_ddp_costs_the_same_python_calls_whatever_the_parameter_count(tmp_path):
    """Issue #26: a hook per parameter called into Python once per parameter every
    backward (~150 at 125m, thousands at 7B): x1.074 step time at 125m on an H200.
    The marks must cost a constant number of Python calls per step; and stay right
    under gradient accumulation (no_sync), unused parameters and a changed order."""
    import datetime

    import torch.distributed as dist
    from torch import nn

    dist.init_process_group("gloo", init_method=f"file://{tmp_path / 'store'}", rank=0,
                            world_size=1, timeout=datetime.timedelta(seconds=60))
    pulse = Pulse(run="unit", agent=None, world_size=1, catch_sigterm=False)
    try:
        calls = {}
        for layers in (5, 500):  # 10 and 1,000 parameters (weight and bias each)
            model = nn.parallel.DistributedDataParallel(
                nn.Sequential(*(nn.Linear(8, 8) for _ in range(layers))))
            assert len(list(model.parameters())) == 2 * layers
            pulse.attach_ddp(model)
            _python_calls_in_backward(pulse, model, 1)  # DDP rebuilds its buckets
            calls[layers] = _python_calls_in_backward(pulse, model, 2)
            assert pulse.last["sync_wait_seconds"] >= 0
            pulse.close()
            pulse = Pulse(run="unit", agent=None, world_size=1, catch_sigterm=False)
        assert calls[500] == calls[5], calls

        class Branches(nn.Module):  # one branch unused per step, the order changes
            def __init__(self) -> None:
                super().__init__()
                self.a, self.b = nn.Linear(8, 8), nn.Linear(8, 8)

            def forward(self, x: torch.Tensor, first: str = "a") -> torch.Tensor:
                return getattr(self, first)(x) * 2

        model = nn.parallel.DistributedDataParallel(Branches(), find_unused_parameters=True)
        pulse.attach_ddp(model)
        for step, first in enumerate("abab", start=1):
            with pulse.step(step) as s, s.section("forward_backward"):
                with model.no_sync():  # accumulate: reduced in the next, syncing pass
                    model(torch.ones(2, 8), first).sum().backward()
                assert pulse._ddp_passes == []
                model(torch.ones(2, 8), first).sum().backward()
                assert len(pulse._ddp_passes) == 1, step  # the syncing pass, once
                assert None not in pulse._ddp_passes[0]  # its window, its wait

        class TwoHeads(nn.Module):  # the loss uses the second output alone
            def __init__(self) -> None:
                super().__init__()
                self.a, self.b = nn.Linear(8, 8), nn.Linear(8, 8)

            def forward(self, x: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
                return self.a(x), self.b(x)

        model = nn.parallel.DistributedDataParallel(TwoHeads(), find_unused_parameters=True)
        pulse.attach_ddp(model)
        with pulse.step(5) as s, s.section("forward_backward"):
            model(torch.ones(2, 8))[1].sum().backward()
            assert len(pulse._ddp_passes) == 1
    finally:
        pulse.close()
        dist.destroy_process_group()


LATE_PEER_S = 0.1  # how long each of DDP's all-reduces waits for a late peer


def test_every_backward_that_ddp_reduces_is_timed_where_ddp_reduces():
    """Review of #31: attach_ddp assumed one syncing backward per step. With two (a
    loop that accumulates gradients without no_sync(), two forward/backward passes
    per step) the first pass's wait for its all-reduce was counted as compute and its
    all-reduce stayed entered, never completed (the heartbeats said the rank was in an
    all-reduce forever). And whether a backward reduces was read when it ran, while
    DDP decides in the forward: a forward outside no_sync() with its backward inside
    (DDP reduces, as its docs warn) was not timed at all; a forward inside with its
    backward outside (nothing reduced) was marked as an all-reduce."""
    from torch import nn

    with gloo_world_of_one():
        model = nn.parallel.DistributedDataParallel(nn.Linear(8, 8))
        model.register_comm_hook(None, late_peer(LATE_PEER_S))
        pulse = Pulse(run="unit", agent=None, world_size=1, catch_sigterm=False)
        x = torch.ones(2, 8)
        try:
            pulse.attach_ddp(model)
            with pulse.step(1) as s, s.section("forward_backward"):
                model(x).sum().backward()
                model(x).sum().backward()  # both reduce: two waits for the peer
            assert pulse.last["sync_wait_seconds"] >= 2 * LATE_PEER_S, pulse.last
            assert pulse.last["compute_seconds"] < LATE_PEER_S, pulse.last
            assert pulse.collectives.fields()["collective"] == ""  # none left in flight
            with pulse.step(2) as s, s.section("forward_backward"):
                with model.no_sync():  # accumulated, then reduced in the next pass
                    model(x).sum().backward()
                model(x).sum().backward()
            assert LATE_PEER_S <= pulse.last["sync_wait_seconds"] < 1.5 * LATE_PEER_S
            with pulse.step(3) as s, s.section("forward_backward"):
                out = model(x).sum()
                with model.no_sync():  # too late: DDP prepared to reduce in forward
                    out.backward()
            assert pulse.last["sync_wait_seconds"] >= LATE_PEER_S, pulse.last
            assert pulse.last["compute_seconds"] < LATE_PEER_S, pulse.last
            with pulse.step(4) as s, s.section("forward_backward"):
                with model.no_sync():
                    out = model(x).sum()
                out.backward()  # nothing to reduce: prepared without it in forward
            assert pulse.last["sync_wait_seconds"] == 0, pulse.last
            assert pulse.collectives.entered == pulse.collectives.completed
        finally:
            pulse.close()



def _a_late_peers_wait_is_sync_wait(model: Callable[[], torch.nn.Module],
                                    loss: Callable[[Any], torch.Tensor],
                                    find_unused: tuple[bool, ...] = (False,)) -> None:
    """Two steps of `model` under DDP with a peer LATE_PEER_S late to each all-reduce:
    each backward marked once, the wait sync wait, the rank's own time compute."""
    with gloo_world_of_one():
        for unused in find_unused:
            ddp = torch.nn.parallel.DistributedDataParallel(model(),
                                                            find_unused_parameters=unused)
            ddp.register_comm_hook(None, late_peer(LATE_PEER_S))
            pulse = Pulse(run="unit", agent=None, world_size=1, catch_sigterm=False)
            try:
                pulse.attach_ddp(ddp)
                for step in (1, 2):
                    with pulse.step(step) as s, s.section("forward_backward"):
                        loss(ddp(torch.ones(2, 8))).backward()
                        assert len(pulse._ddp_passes) == 1, (unused, step)
                    assert pulse.last["sync_wait_seconds"] >= LATE_PEER_S, pulse.last
                    assert pulse.last["compute_seconds"] < LATE_PEER_S, pulse.last
                assert pulse.collectives.entered == pulse.collectives.completed == 2
            finally:
                pulse.close()


def test_a_dataclass_output_of_the_ddp_model_is_timed_like_a_tensor():
    """A review: Pulse found a forward's output tensors with pytree's tree_leaves, which
    takes a dataclass (DDP takes one) for a leaf: no tensor was hooked, the backward
    was not marked, and the wait for the late peer counted as compute. Found as DDP
    finds them now: lists, tuples, dicts and dataclasses, nested."""
    import dataclasses

    from torch import nn

    @dataclasses.dataclass
    class Out:
        logits: torch.Tensor
        extra: dict[str, tuple[torch.Tensor, ...]]

    class Model(nn.Module):
        def __init__(self) -> None:
            super().__init__()
            self.a, self.b = nn.Linear(8, 8), nn.Linear(8, 8)

        def forward(self, x: torch.Tensor) -> Out:
            return Out(self.a(x), {"aux": (self.b(x),)})

    _a_late_peers_wait_is_sync_wait(
        Model, lambda out: out.logits.sum() + out.extra["aux"][0].sum(), (False, True))


def test_an_output_class_registered_with_pytree_is_timed_like_a_tensor():
    """DDP opens a forward's output with pytree too (its _DDPSink), so a class
    registered with pytree is an output it handles; `_find_tensors` alone does not open
    it (a review of the dataclass fix: 0 tensors found where pytree finds 2)."""
    from torch import nn
    from torch.utils._pytree import register_pytree_node

    class Out:
        def __init__(self, logits: torch.Tensor, aux: torch.Tensor) -> None:
            self.logits, self.aux = logits, aux

    register_pytree_node(Out, lambda o: ([o.logits, o.aux], None),
                         lambda xs, _ctx: Out(*xs))

    class Model(nn.Module):
        def __init__(self) -> None:
            super().__init__()
            self.a, self.b = nn.Linear(8, 8), nn.Linear(8, 8)

        def forward(self, x: torch.Tensor) -> Out:
            return Out(self.a(x), self.b(x))

    _a_late_peers_wait_is_sync_wait(Model, lambda out: out.logits.sum() + out.aux.sum())


def test_a_backward_inside_the_forward_that_a_framework_prepared_is_marked_when_told():
    """Lightning's manual optimization: `manual_backward` runs inside training_step,
    inside DDP's forward, after Lightning prepared DDP's reducer for that loss itself,
    and DDP's forward returns no loss. attach_ddp marks the backward of a forward's
    output, so this one went unmarked: the wait for a late peer was compute, no bytes
    (a review). `backward_reduces(loss)`, which the Lightning callback calls from
    on_before_backward, marks it. Lightning's own steps, as its DDP strategy takes them."""
    told: list[bool] = []

    class TrainingStep(torch.nn.Module):  # what Lightning's DDP wrapper runs
        def __init__(self) -> None:
            super().__init__()
            self.lin = torch.nn.Linear(4, 4)

        def forward(self, x: torch.Tensor) -> None:
            loss = self.lin(x).sum()
            model.reducer._rebuild_buckets()  # lightning's prepare_for_backward
            model.reducer.prepare_for_backward([])
            if told[-1]:
                pulse.backward_reduces(loss)
            loss.backward()
            model.require_backward_grad_sync = False  # its on_after_inner_forward

    with gloo_world_of_one():
        pulse = Pulse(run="unit", agent=None, world_size=1, catch_sigterm=False)
        model = torch.nn.parallel.DistributedDataParallel(TrainingStep())
        model.register_comm_hook(None, late_peer(LATE_PEER_S))
        pulse.attach_ddp(model)
        seen, marked = [], []
        for step, tell in enumerate((False, True, True), 1):
            told.append(tell)
            with pulse.step(step) as s, s.section("forward_backward"):
                model(torch.ones(2, 4))
                model.require_backward_grad_sync = True  # its on_after_outer_forward
                marked.append(len(pulse._ddp_passes))  # the backward's all-reduce timed
            seen.append(dict(pulse.last))
        pulse.close()
    assert marked == [0, 1, 1]
    assert seen[0]["compute_seconds"] >= LATE_PEER_S, seen[0]
    for v in seen[1:]:
        assert v["sync_wait_seconds"] >= LATE_PEER_S and v["compute_seconds"] < LATE_PEER_S, v


FSDP_WORKER = """
import json, sys, time
from pathlib import Path
import torch
import torch.distributed as dist
from torch import nn
from torch.distributed.fsdp import fully_shard
from clusterpulse.trainer.instrument import Pulse
rank, world, store, out = int(sys.argv[1]), int(sys.argv[2]), sys.argv[3], sys.argv[4]
dist.init_process_group("gloo", init_method=f"file://{store}", rank=rank, world_size=world)
torch.manual_seed(0)
layers = [nn.Linear(32, 32) for _ in range(4)]
if rank == 1:  # slow in every layer, as a slow GPU is
    for layer in layers:
        layer.register_forward_pre_hook(lambda *_: time.sleep(0.02))
model = nn.Sequential(*layers)
for layer in layers:
    fully_shard(layer)
fully_shard(model)
pulse = Pulse(run="fsdp", agent=None, rank=rank, world_size=world, catch_sigterm=False)
timed = pulse.attach_fsdp(model)
seen = []
for step in range(1, 31):
    with pulse.step(step) as s, s.section("forward_backward"):
        model(torch.ones(4, 32)).sum().backward()
    pulse.boundary(step)
    seen.append(dict(pulse.last))
Path(f"{out}.{rank}").write_text(json.dumps({"timed": timed, "last": seen[-10:],
                                             "scores": pulse.straggler_scores}))
pulse.close()
dist.destroy_process_group()
"""


@pytest.mark.skipif(not fsdp_on_cpu(), reason="FSDP2 on CPU needs torch >= 2.7")
def test_the_wait_in_fsdps_collectives_on_the_host_clock_is_sync_wait(tmp_path):
    """A review: FSDP2 on CPU (gloo blocks the host in each all-gather and
    reduce-scatter), a peer 80 ms slower in every layer: the healthy rank's wait in
    FSDP's collectives (timed by attach_fsdp) was counted as its compute, and the
    straggler scored 1.27 for ~1.9x. Two real ranks."""
    out = tmp_path / "fsdp"
    run_ranks(FSDP_WORKER, 2, tmp_path, str(out))
    healthy, slow = (json.loads(Path(f"{out}.{r}").read_text()) for r in range(2))
    assert healthy["timed"] == slow["timed"] == 5
    for v in healthy["last"]:
        assert v["sync_wait_seconds"] >= 0.06 and v["compute_seconds"] < 0.04, v
    assert healthy["scores"] == slow["scores"] and healthy["scores"][1] > 1.5, healthy


@pytest.mark.parametrize("static_graph, rebuilds_in", [(False, 2), (True, 3)])
def test_the_wait_in_ddps_bucket_rebuild_is_sync_wait_without_buffers(static_graph,
                                                                      rebuilds_in):
    """A review: DDP rebuilds its buckets once, in the forward of the second step (the
    third with static_graph), a collective that waits for a late peer; Pulse bracketed
    DDP's pre-forward only where it broadcasts buffers, so for a model without any
    that wait was compute (rank 0 read 0.3 s compute, no sync wait, in that step
    alone). And once rebuilt, such a model's pre-forward gets no marks."""
    from torch import nn

    with gloo_world_of_one():
        model = nn.parallel.DistributedDataParallel(
            nn.Sequential(nn.Linear(8, 8), nn.Linear(8, 8)), static_graph=static_graph)
        assert not model.will_sync_module_buffers()
        late_rebuild(model, LATE_PEER_S)
        pulse = Pulse(run="unit", agent=None, world_size=1, catch_sigterm=False)
        try:
            pulse.attach_ddp(model)
            for step in range(1, 5):
                with pulse.step(step) as s, s.section("forward_backward"):
                    model(torch.ones(2, 8)).sum().backward()
                assert model._has_rebuilt_buckets == (step >= rebuilds_in), step
                if step == rebuilds_in:
                    assert pulse.last["sync_wait_seconds"] >= LATE_PEER_S, pulse.last
                    assert pulse.last["compute_seconds"] < LATE_PEER_S, pulse.last
                else:
                    assert pulse.last["compute_seconds"] < LATE_PEER_S, pulse.last
                    assert pulse.last["sync_wait_seconds"] < LATE_PEER_S, pulse.last
            assert pulse._fwd_waits == []  # rebuilt: the pre-forward is not bracketed
        finally:
            pulse.close()

def test_attach_ddp_leaves_no_reference_cycle_through_the_model(tmp_path):
    """The exit-time abort ("terminate called without an active exception", only in
    runs with attach_ddp): each parameter's hook held the DDP model, a cycle through
    tensors that not even the garbage collector frees, so the model, its reducer and
    the process group it holds were destroyed at interpreter finalization, in C++
    (gloo's threads) while Python was half gone. Dropping the model must free it by
    reference counting alone, and close() must take the hooks off the parameters."""
    import datetime
    import gc
    import weakref

    import torch.distributed as dist

    dist.init_process_group("gloo", init_method=f"file://{tmp_path / 'store'}", rank=0,
                            world_size=1, timeout=datetime.timedelta(seconds=60))
    # The first DDP model of a process imports torch._dynamo from its __init__, and that
    # import leaves a cycle through the __init__ frame (so the model) that only the
    # collector frees: torch's, once per process; this test ran alone, it failed on it.
    import torch._dynamo

    gc.collect()
    gc.disable()
    pulse = Pulse(run="unit", agent=None, world_size=1, catch_sigterm=False)
    try:
        model = torch.nn.parallel.DistributedDataParallel(torch.nn.Linear(8, 8))
        pulse.attach_ddp(model)
        with pulse.step(1) as s, s.section("forward_backward"):
            model(torch.ones(2, 8)).sum().backward()
            assert len(pulse._ddp_passes) == 1  # the hooks ran
        inner, ref = model.module, weakref.ref(model)
        del model
        assert ref() is None, "the hooks keep the DDP model alive"
        assert len(inner._forward_pre_hooks) == 1  # the end of DDP's pre-forward
        pulse.close()
        assert not inner._forward_pre_hooks
    finally:
        pulse.close()
        gc.enable()
        dist.destroy_process_group()


def test_a_pulse_started_before_the_process_group_completes_its_set_up_when_joined():
    """Started first so that a rank stuck in init is seen; until joined() it claims no
    restart count (the agent keeps the rank's previous one: a requeued run's counter
    never dips to 0 and back) and leaves SIGTERM to end the rank (nothing to save)."""
    import signal

    rx = socket.socket(socket.AF_INET, socket.SOCK_DGRAM)
    rx.bind(("127.0.0.1", 0))
    rx.settimeout(2)
    before = signal.getsignal(signal.SIGTERM)
    pulse = Pulse(run="unit", agent=rx.getsockname(), rank=0, world_size=1,
                  before_process_group=True)
    try:
        start = json.loads(rx.recv(8192))
        assert start["event"] == "start" and "restarts" not in start
        assert signal.getsignal(signal.SIGTERM) is before
        pulse.joined(restarts=3)
        assert signal.getsignal(signal.SIGTERM) is not before  # graceful preemption now
        pulse.event("probe")
        while (m := json.loads(rx.recv(8192))).get("event") != "probe":
            pass
        assert m["restarts"] == 3
    finally:
        pulse.close()
    assert signal.getsignal(signal.SIGTERM) is before


def test_a_restart_leaving_main_keeps_the_interpreters_exit_status(capsys):
    """main() catches the SystemExit a restart or preemption raises (to free the model
    before exit) and must return what the interpreter would have made of it."""
    from clusterpulse.trainer.main import _exit_status

    assert [_exit_status(c) for c in (None, 0, 42, 143)] == [0, 0, 42, 143]
    assert _exit_status("cannot go on") == 1
    assert capsys.readouterr().err == "cannot go on\n"


def test_simulated_compute_follows_the_ranks_share_of_the_global_batch():
    # A global batch of 12 on 4 nodes, elastic down to 3 (the chaos job's shape).
    cfg = parse_config(["--global-batch", "12", "--sim-sample-seconds", "0.025"])
    data = SyntheticTokens(cfg.seed, vocab=64, seq_len=16, global_batch=cfg.global_batch)
    on_four = cfg.simulated_compute_s(data.shard(0, 0, 4)[0].shape[0])
    on_three = cfg.simulated_compute_s(data.shard(0, 0, 3)[0].shape[0])
    assert on_four == pytest.approx(0.075) and on_three == pytest.approx(0.1)
    # The fixed pad stays what it was: the same for every world size.
    fixed = parse_config(["--sim-compute-seconds", "0.1"])
    assert fixed.simulated_compute_s(3) == fixed.simulated_compute_s(4) == 0.1
    with pytest.raises(ConfigError, match="--sim-sample-seconds"):
        parse_config(["--sim-sample-seconds", "-1"])


def test_the_launcher_sits_a_leave_out_and_tells_its_ranks_when_it_cannot(tmp_path):
    from clusterpulse.trainer.launch import leave_env, longest_leave_s, parse

    # the rank side for real: the first attempt leaves for 1.2 s, the relaunch finishes
    child = [sys.executable, "-c", "import os, time\nfrom clusterpulse.trainer.restart import "
             "request_relaunch\nif os.environ['CLUSTERPULSE_ATTEMPTS_BEFORE'] == '0':\n"
             "    code = request_relaunch(1.2)\n    print('left', time.monotonic(), flush=True)"
             "\n    raise SystemExit(code)\nprint('back', time.monotonic(), flush=True)\n"]
    env = {**os.environ, "PYTHONPATH": str(REPO)}
    r = subprocess.run([sys.executable, "-c", "import sys\nfrom clusterpulse.trainer.launch "
                        "import run\nsys.exit(run(sys.argv[1:], None, 60))", *child],
                       env=env, capture_output=True, text=True, timeout=120)
    assert r.returncode == 0, r.stderr
    times = dict(line.split() for line in r.stdout.splitlines())
    assert float(times["back"]) - float(times["left"]) >= 1.2  # sat out before relaunching
    assert "leaving the job for 1 s" in r.stderr
    # SIGTERM while it sits out (a preemption, a stop): it ends at once, 128 + 15
    err = tmp_path / "err"
    with open(err, "w") as fh:
        p = subprocess.Popen([sys.executable, "-c", "import sys\nfrom clusterpulse.trainer."
                              "launch import run\nsys.exit(run(sys.argv[1:], None, 600))",
                              *(arg.replace("1.2", "600") for arg in child)],
                             env=env, stdout=subprocess.DEVNULL, stderr=fh)
    try:
        wait_until(lambda: "leaving the job for 600 s" in err.read_text(), 60, "the sit-out")
        p.send_signal(signal.SIGTERM)
        assert p.wait(timeout=30) == 143
    finally:
        p.kill()
    # what the ranks are told: a node that can never leave, or the job's minimum
    for argv, told in [
            (["--nnodes", "2:4", "--rdzv-endpoint", "head:1", "--no-rdzv-host"],
             {"CLUSTERPULSE_MIN_NODES": "2"}),
            (["--nnodes", "4", "--rdzv-endpoint", "head:1", "--no-rdzv-host"],
             {"CLUSTERPULSE_MIN_NODES": "4"}),
            (["--nnodes", "2:4", "--rdzv-endpoint", "head:1", "--rdzv-host"],
             {"CLUSTERPULSE_CANNOT_LEAVE": "rendezvous_host"}),
            (["--nnodes", "2:4", "--rdzv-endpoint", "localhost:1"],  # torch's own guess
             {"CLUSTERPULSE_CANNOT_LEAVE": "rendezvous_host"}),
            ([], {"CLUSTERPULSE_CANNOT_LEAVE": "single_node"})]:
        assert leave_env(parse(argv)[0]) == told, argv
    # at most half the rendezvous join_timeout: the others wait that long for nodes
    assert longest_leave_s(parse([])[0]) == 300
    assert longest_leave_s(parse(["--rdzv-endpoint", "h:1", "--rdzv-conf",
                                  "join_timeout=120"])[0]) == 60


STANDBY_CHILD = """\
import json, os, socket, sys, time
count_file, plan, port = sys.argv[1], sys.argv[2].split(","), int(sys.argv[3])
n = int(open(count_file).read()) if os.path.exists(count_file) else 0
open(count_file, "w").write(str(n + 1))
with open(count_file + ".told", "a") as fh:  # told to hold its first join (spares, 5.)
    fh.write("1" if os.path.exists(os.environ["CLUSTERPULSE_JOIN_WHEN_ROOM_FILE"]) else "0")
place, error, rc = plan[min(n, len(plan) - 1)].split("|")
if place.endswith("+graceful"):  # the ranks left for a graceful restart
    open(os.environ["CLUSTERPULSE_RELAUNCH_FILE"], "w").write("")
    place = place.removesuffix("+graceful")
if place != "-":  # where the rendezvous left this node (trainer/spares.py)
    open(os.environ["CLUSTERPULSE_RDZV_STATE_FILE"], "w").write(place)
if error:  # torchrun's @record error file
    message = error if ":" in error else error + ": as torchrun says it"
    with open(os.environ["TORCHELASTIC_ERROR_FILE"], "w") as fh:
        json.dump({"message": {"message": message, "extraInfo": {}}}, fh)
time.sleep(0.5)
sys.exit(int(rc))
"""
ENDED = "standby|RendezvousClosedError|1"
GRACEFUL_BUG = "standby|AttributeError: 'NoneType' object has no attribute 'is_failed'|1"


@pytest.mark.parametrize("host,plan,rendezvous_up,rc,runs,says", [
    # a standby whose round ended (the job restarted gracefully; or its store went with
    # the host's torchrun; or torch <= 2.13's closed-rendezvous exit) starts again, then
    # is taken into the job, whose workers finish
    (False, f"{ENDED},joined||0", True, 0, 2, "standing by"),
    (False, "standby|RendezvousConnectionError|1,joined||0", True, 0, 2, "standing by"),
    (False, f"{GRACEFUL_BUG},joined||0", True, 0, 2, "standing by"),
    # a standby whose rendezvous does not come back: the job ended, nothing failed
    (False, ENDED, False, 0, 1, "rendezvous is gone"),
    # a node in the job, or back in a rendezvous from it, when the host's store went or
    # another node closed the rendezvous: the job's failure, no relaunch
    (False, "joined|RendezvousConnectionError|1", True, 1, 1, ""),
    (False, "rejoining|RendezvousConnectionError|1", True, 1, 1, ""),
    (False, "rejoining|RendezvousClosedError|1", True, 1, 1, ""),
    # a join timeout (the job never had its minimum), a bad setting, a store never
    # reached: torchrun's failure as it is
    (False, "-|RendezvousTimeoutError|1", True, 1, 1, ""),
    (False, "-|ValueError|1", True, 1, 1, ""),
    (False, "-|RendezvousConnectionError|1", False, 1, 1, ""),
    # the node serving the store stood by: at once again (the others need its store);
    # when they do not come back the job is over
    (True, f"{ENDED},-|RendezvousTimeoutError|1", False, 0, 2, "did not come back"),
    # a standby that found the host's new store after the job ended: nobody came
    (False, f"{ENDED},-|RendezvousTimeoutError|1", True, 0, 2, "did not come back"),
    (True, f"{ENDED},joined||0", False, 0, 2, "standing by"),
    (True, "-|RendezvousTimeoutError|1", False, 1, 1, ""),
    # ... but once back in the job, a later join timeout is the job's failure again
    (True, f"{ENDED},joined+graceful||0,-|RendezvousTimeoutError|1", False, 1, 3,
     "standing by"),
])
def test_a_standby_node_outlives_the_rounds_it_stood_by(tmp_path, capsys, host, plan,
                                                        rendezvous_up, rc, runs, says):
    """Hot spares: a node beyond the job's --nnodes maximum waits in torch's
    rendezvous; every graceful restart of the job ends its torchrun with an error. It
    used to end the spare's launcher: the job lost its spare at its first
    checkpoint-restart. A node in the job, a join timeout, a bad setting still end it."""
    from clusterpulse.trainer.launch import Standby, run

    port = free_port()
    listening = socket.create_server(("127.0.0.1", port)) if rendezvous_up else None
    count = tmp_path / "count"
    try:
        got = run([sys.executable, "-c", STANDBY_CHILD, str(count), plan, str(port)],
                  {**os.environ, "PYTHONPATH": str(REPO)}, 60,
                  Standby(("127.0.0.1", port), host=host, return_s=1.5))
    finally:
        if listening is not None:
            listening.close()
    assert (got, int(count.read_text())) == (rc, runs)
    # the host's torchrun after a round it stood by holds its own first join; any other
    # node's waits in the launcher, started only once there is room
    steps = plan.split(",")
    assert (tmp_path / "count.told").read_text() == "".join(
        "1" if host and i and steps[i - 1].startswith("standby|") else "0"
        for i in range(runs))
    err = capsys.readouterr().err
    assert says in err
    if not says:
        assert "standing by" not in err and "rendezvous is gone" not in err


@pytest.mark.parametrize(("env", "unix", "refused"), [
    ({}, True, "no_launcher"),
    ({"CLUSTERPULSE_RELAUNCH_FILE": "/x", "CLUSTERPULSE_CANNOT_LEAVE": "rendezvous_host"},
     True, "rendezvous_host"),
    ({"CLUSTERPULSE_RELAUNCH_FILE": "/x", "CLUSTERPULSE_MIN_NODES": "3",
      "GROUP_WORLD_SIZE": "3"}, True, "min_nodes"),
    ({"CLUSTERPULSE_RELAUNCH_FILE": "/x", "CLUSTERPULSE_MIN_NODES": "3",
      "GROUP_WORLD_SIZE": "4"}, False, "udp"),
    ({"CLUSTERPULSE_RELAUNCH_FILE": "/x", "CLUSTERPULSE_MIN_NODES": "3",
      "GROUP_WORLD_SIZE": "4"}, True, None)])
def test_a_rank_knows_when_its_node_cannot_leave(monkeypatch, env, unix, refused):
    from clusterpulse.trainer.restart import leave_refusal

    for key in ("CLUSTERPULSE_RELAUNCH_FILE", "CLUSTERPULSE_CANNOT_LEAVE",
                "CLUSTERPULSE_MIN_NODES", "GROUP_WORLD_SIZE"):
        monkeypatch.delenv(key, raising=False)
    for key, value in env.items():
        monkeypatch.setenv(key, value)
    assert leave_refusal(unix) == refused


def test_a_rank_waits_for_its_own_sigterm_or_times_out():
    """A rank leaving for a peer's SIGTERM waits for its own (SigtermCatcher.wait): it
    must return as soon as the signal comes, caught (not killed by it), and give up
    at its timeout."""
    from clusterpulse.trainer.restart import SigtermCatcher

    before = signal.getsignal(signal.SIGTERM)
    catcher = SigtermCatcher()
    catcher.install()  # before the signal is sent: no window where it would kill pytest
    try:
        assert catcher.wait(0.2) is False
        threading.Timer(0.3, os.kill, (os.getpid(), signal.SIGTERM)).start()
        t0 = time.monotonic()
        assert catcher.wait(30) is True
        assert time.monotonic() - t0 < 20  # woke at the signal, far before the timeout
    finally:
        catcher.uninstall()
    assert signal.getsignal(signal.SIGTERM) is before
    assert SigtermCatcher().wait(5) is False  # not installed: nothing to wait for


def test_a_run_state_the_disk_refuses_is_reported_not_raised(tmp_path, caplog):
    """A full disk under the checkpoints: the saves failed as designed and training
    went on, then the run state's write at the end raised and turned the finished run
    into a crash (rc 1, no summary, and a restart that trained again)."""
    from clusterpulse.trainer.runstate import RunState

    path = tmp_path / "run-state.json"
    (tmp_path / "run-state.tmp").mkdir()  # its temporary cannot be written, even by root
    assert RunState(run="r").save(path) is False
    assert "cannot write the run state" in caplog.text
    (tmp_path / "run-state.tmp").rmdir()
    assert RunState(run="r").save(path) is True and json.loads(path.read_text())["run"] == "r"


@pytest.mark.parametrize(("text", "kept"), [
    ('[1]', {}),
    ('{"run": "r", "started_unix": 5, "attempts": "x"}', {"run": "r", "started_unix": 5}),
    ('{"run": "r", "last_step": 7.5, "restarts": [1], "productive_seconds": NaN}',
     {"run": "r"}),
    ('{"run": "r", "attempts": true, "pending_exit": 3, "last_step": 9}',
     {"run": "r", "last_step": 9}),
    ("[" * 100_000, {}),
    ('{"run": "r", "restarts": [{}, {"attempt": 1, "resume_step": 4, "steps_recomputed": 2,'
     ' "fault_unix": 10, "restart_unix": 12.5, "cause": "failure"}]}',
     {"run": "r", "restarts": [{"attempt": 1, "resume_step": 4, "steps_recomputed": 2,
                                "fault_unix": 10, "restart_unix": 12.5,
                                "cause": "failure"}]}),
])
def test_a_damaged_run_state_keeps_what_it_can_and_says_what_it_dropped(
        tmp_path, caplog, text, kept):
    """Found by a review: run-state.json holding `[1]` (AttributeError) or a string
    where a count belongs (TypeError at `attempt > 0`) crashed rank 0 at start, before
    training, at every restart. A field of the wrong type is left at its default with
    a warning; the rest is kept."""
    path = tmp_path / "run-state.json"
    path.write_text(text)
    state = RunState.load(path)
    fresh = RunState()
    for name in RunState.__dataclass_fields__:
        assert getattr(state, name) == kept.get(name, getattr(fresh, name)), name
    assert "run state" in caplog.text
    state.begin_attempt("r", state.next_attempt("r"), 0)  # what rank 0 does next
    sum(r["steps_recomputed"] for r in state.restarts)  # what the summary reads


@pytest.mark.parametrize("value", ["tcp://10.96.0.5:29500", ""])
def test_a_master_port_the_trainer_does_not_read_is_not_checked(monkeypatch, value):
    """Kubernetes' service links set MASTER_PORT=tcp://IP:PORT for a Service named
    `master`; a run without torchrun never reads it (a review found the check refused
    such a pod's run)."""
    monkeypatch.setenv("MASTER_PORT", value)
    monkeypatch.setenv("RANK", "0")
    parse_config([])
    monkeypatch.setenv("RANK", "\u00b2")  # isdigit(), and int() refuses it
    with pytest.raises(ConfigError, match="RANK must be a whole number"):
        parse_config([])


@pytest.mark.parametrize(("argv", "env", "why"), [
    (["--collective-timeout", "nan"], {}, "--collective-timeout must be a number"),
    (["--collective-timeout", "0"], {}, "--collective-timeout must be a number"),
    (["--lr", "nan"], {}, "--lr must be a number"),
    (["--seed", "20000000000000"], {}, "--seed must be 0..4294967295"),
    (["--seed", "-1"], {}, "--seed must be 0..4294967295"),
    (["--ckpt-dir", "{file}"], {}, "exists and is not a directory"),
    ([], {"RANK": "zero"}, "$RANK must be a whole number"),
    ([], {"LOCAL_WORLD_SIZE": "-1"}, "$LOCAL_WORLD_SIZE must be a whole number"),
])
def test_a_bad_setting_is_named_before_the_trainer_starts(tmp_path, monkeypatch, argv, env,
                                                          why):
    """Found by a review: each of these ended in a traceback (NaN in timedelta, mkdir
    on a file, int('zero'), a seed past 64 bits once multiplied)."""
    (tmp_path / "file").write_text("x")
    for name, value in env.items():
        monkeypatch.setenv(name, value)
    with pytest.raises(ConfigError) as err:
        parse_config([a.format(file=tmp_path / "file") for a in argv])
    assert why in str(err.value)


def test_a_checkpoint_folder_that_cannot_be_made_is_one_line(tmp_path):
    (tmp_path / "file").write_text("x")
    r = subprocess.run([sys.executable, "-m", "clusterpulse.trainer", "--preset", "tiny",
                        "--steps", "2", "--agent", "none", "--ckpt-dir",
                        str(tmp_path / "file" / "ckpt")], cwd=REPO, capture_output=True,
                       text=True, timeout=300)  # 120 s: too short under CI's load
    assert r.returncode == 2, r.stderr
    assert r.stderr.splitlines()[-1] == \
        f"trainer: error: Not a directory: {tmp_path / 'file' / 'ckpt'}", r.stderr
    assert "Traceback" not in r.stderr


@pytest.mark.parametrize(("left_as", "cause"), [
    ("preempted", "membership"), ("", "failure"), ("checkpoint-restart", "checkpoint-restart")])
def test_a_membership_change_is_told_only_from_ranks_that_left_for_a_sigterm(left_as, cause):
    """torchrun restarts a healthy node's workers without counting a failure both for a
    node that joins and while another node's failure is being restarted: the failure
    (the ranks never agreed to leave) must not be recorded as a membership change, nor
    a graceful command's restart."""
    from clusterpulse.trainer.runstate import RunState

    rs = RunState()
    rs.begin_attempt("r", 0, 0)
    rs.pending_exit = left_as
    rs.begin_attempt("r", 1, 0, membership_change=True)
    assert rs.restarts[-1]["cause"] == cause


def test_a_node_waiting_for_a_full_round_restarts_no_one(tmp_path, monkeypatch):
    """torch's c10d rendezvous, for real on a loopback store: after a restart the node
    a full round left out stayed on its wait list; the members restarted to take it in,
    for ever (a restart every ~10 s on the testbed with a spare), and at its join
    timeout it closed the rendezvous for the whole job. With the fixes
    (trainer/spares.py) it moves to the redundancy list (no deadline there) and writes
    that it stands by; until it has, a full round counts nobody waiting, while one
    below its maximum still does. A torchrun outside the round that ends does not
    close the rendezvous for the job. A member the round dropped counts itself as
    waiting: it has to rejoin."""
    import datetime
    import threading

    from torch.distributed.elastic.rendezvous.api import RendezvousGracefulExitError
    from torch.distributed.elastic.rendezvous.c10d_rendezvous_backend import (
        C10dRendezvousBackend,
    )
    from torch.distributed.elastic.rendezvous.dynamic_rendezvous import (
        DynamicRendezvousHandler,
    )

    from clusterpulse.trainer import spares

    store = torch.distributed.TCPStore("127.0.0.1", 0, is_master=True,
                                       timeout=datetime.timedelta(seconds=10))

    def handler(addr: str) -> DynamicRendezvousHandler:
        return DynamicRendezvousHandler.from_backend(
            "spares", store, C10dRendezvousBackend(store, "spares"), min_nodes=1,
            max_nodes=1, local_addr=addr, **KEEP_ALIVE)

    place = tmp_path / "place"
    monkeypatch.setenv(spares.RDZV_STATE_ENV, str(place))
    spares.install()
    member, spare = handler("127.0.0.1"), handler("127.0.0.2")
    member.next_rendezvous()  # the round is complete: one node, its maximum
    assert spares.place(place) == spares.JOINED
    holder = member._state_holder
    holder.state.wait_list.add(spare._this_node)  # left out of the round, waiting
    holder.state.last_heartbeats[spare._this_node] = datetime.datetime.now(datetime.UTC)
    holder.mark_dirty()
    holder.sync()
    assert member.num_nodes_waiting() == 0  # a full round takes no one
    late = handler("127.0.0.3")
    late.shutdown()  # a torchrun outside the round ending (a store error) closes nothing
    holder.sync()
    assert not holder.state.closed
    ended: list[BaseException] = []

    def stand_by() -> None:
        try:
            spare.next_rendezvous()
        except BaseException as err:
            ended.append(err)

    t = threading.Thread(target=stand_by, daemon=True)
    t.start()
    wait_until(lambda: spares.place(place) == spares.STANDBY, 30, "the spare standing by")

    def on_the_redundancy_list() -> bool:
        holder.sync()
        return spare._this_node in holder.state.redundancy_list

    wait_until(on_the_redundancy_list, 30, "the spare on the redundancy list")
    assert spare._this_node not in holder.state.wait_list
    member.set_closed()  # the job ends: the standby's wait ends with it
    t.join(timeout=30)
    assert len(ended) == 1 and isinstance(ended[0], RendezvousGracefulExitError), ended
    with member._heartbeat_lock:  # its keep-alive thread syncs the state too
        holder.sync()
        holder.state.complete = False  # a round not full: a node waits for room
        holder.state.wait_list.add(spare._this_node)
        holder.mark_dirty()
        holder.sync()
    assert member.num_nodes_waiting() == 1
    with member._heartbeat_lock:
        holder.state.complete = True
        holder.state.wait_list.clear()
        holder.mark_dirty()
        holder.sync()
    assert member.num_nodes_waiting() == 0
    # dropped from the running round (a late keep-alive): its workers still train
    with member._heartbeat_lock:
        del holder.state.participants[member._this_node]
        holder.mark_dirty()
        holder.sync()
    assert member.num_nodes_waiting() == 0
    # the job went on without the member (cut off, dropped as dead, the others in a
    # new round): nobody waits, yet it must rejoin, or its ranks wait for ever
    with member._heartbeat_lock:
        holder.state.round += 1
        holder.mark_dirty()
        holder.sync()
    assert member.num_nodes_waiting() == 1


def test_a_node_back_from_a_leave_rejoins_only_once_the_job_runs_without_it():
    """What the launcher reads after a leave (spares.running_without), from torch's
    own rendezvous state on a real store: the round must be complete, without the
    node's last torchrun, and nobody (a spare) on its wait list."""
    import datetime
    import socket

    from torch.distributed.elastic.rendezvous.c10d_rendezvous_backend import (
        C10dRendezvousBackend,
    )
    from torch.distributed.elastic.rendezvous.dynamic_rendezvous import (
        DynamicRendezvousHandler,
    )

    from clusterpulse.trainer import spares

    with socket.socket() as s:  # a port nothing listens on: the store's host is down
        s.bind(("127.0.0.1", 0))
        down = s.getsockname()
    assert not spares.running_without(down, "back", ("127.0.0.2", 1))
    store = torch.distributed.TCPStore("127.0.0.1", 0, is_master=True,
                                       timeout=datetime.timedelta(seconds=10))
    endpoint = ("127.0.0.1", store.port)
    assert not spares.running_without(endpoint, "back", ("127.0.0.2", 1))  # no state yet
    member = DynamicRendezvousHandler.from_backend(
        "back", store, C10dRendezvousBackend(store, "back"), min_nodes=1, max_nodes=2,
        local_addr="127.0.0.1", **KEEP_ALIVE)
    assert not spares.running_without(endpoint, "back", ("127.0.0.2", 1))  # no round yet
    holder = member._state_holder
    with member._heartbeat_lock:
        holder.sync()
        holder.state.participants[member._this_node] = 0
        holder.state.complete = True
        holder.mark_dirty()
        holder.sync()
    me = member._this_node
    assert not spares.running_without(endpoint, "back", (me.addr, me.pid))  # still in it
    assert spares.running_without(endpoint, "back", ("127.0.0.2", me.pid))
    with member._heartbeat_lock:  # a spare waits to get in: it goes first
        holder.state.wait_list.add(type(me)("127.0.0.3", 7, 0))
        holder.mark_dirty()
        holder.sync()
    assert not spares.running_without(endpoint, "back", ("127.0.0.2", me.pid))
    member.set_closed()  # the job is over: nothing to wait for
    assert spares.running_without(endpoint, "back", ("127.0.0.2", me.pid))
    # closed with the node in it: the round it left, its own torchrun closed on exit
    assert not spares.running_without(endpoint, "back", (me.addr, me.pid))
    store.set("torch.rendezvous.back", "not a state")  # another torch's: rejoin as torch would
    assert spares.running_without(endpoint, "back", ("127.0.0.2", me.pid))


def test_an_evicted_node_of_a_job_with_spares_counts_itself_out_of_the_new_round(tmp_path):
    """The launcher of a node evicted from a job with hot spares (a 1 s leave) counts
    itself in the new round's store as sitting it out (spares.announce_sitting_out):
    the place a standby takes before the last call ends (spares.room_in); without the
    count the standby leaves the job's late nodes their places. A 1 s sit-out ends
    before the new round exists, so the count is said until the node rejoins (it
    rejoins once the job runs without it), not only while it sits out (review)."""
    from datetime import UTC, datetime, timedelta

    from clusterpulse.trainer import spares

    store, member = _rendezvous_member("out")
    node = type(member._this_node)
    key = spares.SITTING_OUT_KEY.format(run_id="out", round=0)
    child = ("import os, sys\nfrom clusterpulse.trainer.restart import request_relaunch\n"
             "if os.environ['CLUSTERPULSE_ATTEMPTS_BEFORE'] == '0':\n"
             "    sys.exit(request_relaunch(1))\nsys.exit(0)\n")
    launcher = ("import sys\nfrom clusterpulse.trainer.launch import Rendezvous, Standby, run"
                f"\nsys.exit(run(sys.argv[1:], None, 60, Standby(('127.0.0.1', {store.port}), "
                f"host=False, return_s=5), Rendezvous(('127.0.0.1', {store.port}), 'out', "
                "'127.0.0.1'), prewarm_after=0))")
    with open(tmp_path / "err", "w") as err:
        p = subprocess.Popen([sys.executable, "-c", launcher, sys.executable, "-c", child],
                             env={**os.environ, "PYTHONPATH": str(REPO)},
                             stdout=subprocess.DEVNULL, stderr=err)
    try:
        # past the sit-out, its launcher has read the store (torch imported: under load
        # that alone took longer than this test's waits, CI 2026-12-07) and found no
        # round yet: nothing counted
        wait_until(lambda: p.poll() is not None or "has not restarted without this node "
                   "yet" in (tmp_path / "err").read_text(), 240, "the launcher's first read")
        assert p.poll() is None, (tmp_path / "err").read_text()
        assert not store.check([key])
        _write_state(member, lambda s: (  # the new round forms, without the node
            s.participants.update({node("10.0.0.1", 1, 0): 0, node("10.0.0.2", 1, 0): 1}),
            setattr(s, "deadline", datetime.now(UTC) + timedelta(seconds=5))))
        wait_until(lambda: store.check([key]), 30, "the node counted as sitting out")
        assert int(store.get(key)) == 1
        assert p.poll() is None  # still out: the job does not run without it yet
        _write_state(member, lambda s: setattr(s, "complete", True))
        assert p.wait(timeout=60) == 0, (tmp_path / "err").read_text()
    finally:
        p.kill()
    assert int(store.get(key)) == 1  # once


def _rendezvous_member(run_id: str, port: int = 0, min_nodes: int = 2, max_nodes: int = 3):
    """A real store (this process's, or a client of the one at `port`) and a torch
    rendezvous handler on it, whose state a test writes."""
    import datetime

    from torch.distributed.elastic.rendezvous.c10d_rendezvous_backend import (
        C10dRendezvousBackend,
    )
    from torch.distributed.elastic.rendezvous.dynamic_rendezvous import (
        DynamicRendezvousHandler,
    )

    store = torch.distributed.TCPStore("127.0.0.1", port, is_master=not port,
                                       timeout=datetime.timedelta(seconds=10))
    member = DynamicRendezvousHandler.from_backend(
        run_id, store, C10dRendezvousBackend(store, run_id), min_nodes=min_nodes,
        max_nodes=max_nodes, local_addr="127.0.0.1", **KEEP_ALIVE)
    return store, member


def _write_state(member, change: Callable[[object], None]) -> None:
    holder = member._state_holder
    with member._heartbeat_lock:
        holder.sync()
        change(holder.state)
        holder.mark_dirty()
        holder.sync()


def test_a_standby_joins_a_new_round_once_the_jobs_own_nodes_had_their_places():
    """What a standby whose round ended reads (spares.room_for_a_standby), from torch's
    rendezvous state on a real store: a full or complete round takes it (to stand by
    again, or as a late node); a round at its minimum only near its last call's end
    and only when a node said it sits the round out (an evicted node's launcher:
    spares.announce_sitting_out); a closed round is the old one. It used to join at
    once and, as quick as the job's nodes, took one's place; then, near the last
    call's end, it took the place of a job node 3 s late (CI, loaded)."""
    from datetime import UTC, datetime, timedelta

    from clusterpulse.trainer import spares

    with socket.socket() as s:  # a port nothing listens on: the store's host restarts
        s.bind(("127.0.0.1", 0))
        down = s.getsockname()
    assert spares.room_for_a_standby(down, "room", 2.0) is None
    store, member = _rendezvous_member("room")
    endpoint = ("127.0.0.1", store.port)
    assert spares.room_for_a_standby(endpoint, "room", 2.0) is False  # no state yet
    assert not spares.announce_sitting_out(endpoint, "room")  # no round to sit out yet
    node = type(member._this_node)

    def join(addr: str):
        return lambda state: state.participants.__setitem__(node(addr, 1, 0), 0)

    _write_state(member, join("10.0.0.1"))  # one node back, below the minimum
    assert spares.room_for_a_standby(endpoint, "room", 2.0) is False
    _write_state(member, join("10.0.0.2"))
    _write_state(member, lambda s: setattr(s, "deadline", datetime.now(UTC) + timedelta(seconds=5)))
    assert spares.room_for_a_standby(endpoint, "room", 2.0) is False  # the third may come
    _write_state(member, lambda s: setattr(s, "deadline", datetime.now(UTC) + timedelta(seconds=1)))
    assert spares.room_for_a_standby(endpoint, "room", 2.0) is False  # a job node late
    assert spares.announce_sitting_out(endpoint, "room")  # an evicted one's launcher
    assert spares.room_for_a_standby(endpoint, "room", 2.0) is True  # a place left free
    _write_state(member, lambda s: setattr(s, "round", s.round + 1))  # a later round
    assert spares.room_for_a_standby(endpoint, "room", 2.0) is False  # nobody sits it out
    _write_state(member, lambda s: setattr(s, "deadline", None))
    _write_state(member, lambda s: setattr(s, "complete", True))
    assert spares.room_for_a_standby(endpoint, "room", 2.0) is True
    member.set_closed()  # the round that ended, its host not restarted yet
    assert spares.room_for_a_standby(endpoint, "room", 2.0) is False
    assert not spares.announce_sitting_out(endpoint, "room")  # nor sat out
    store.set("torch.rendezvous.room", "not a state")  # another torch's: join, as torch would
    assert spares.room_for_a_standby(endpoint, "room", 2.0) is True



def test_a_standby_hosting_the_store_holds_its_first_join_until_the_round_has_room(
        tmp_path, monkeypatch):
    """The standby that serves the rendezvous store starts its torchrun at once after a
    graceful restart (the others need its store), and was first into the new round: it
    took a job node's place (CI). Told by its launcher (spares.JOIN_WHEN_ROOM_ENV's
    file), its first join waits until the job's nodes have the round, then stands by."""
    from torch.distributed.elastic.rendezvous.api import RendezvousGracefulExitError

    from clusterpulse.trainer import spares

    monkeypatch.setenv(spares.RDZV_STATE_ENV, str(tmp_path / "place"))
    told = tmp_path / "join-when-room"
    told.write_text("60")
    monkeypatch.setenv(spares.JOIN_WHEN_ROOM_ENV, str(told))
    spares.install()
    store, host = _rendezvous_member("held", min_nodes=2, max_nodes=3)
    members = [_rendezvous_member("held", port=store.port)[1] for _ in range(3)]
    ended: dict[object, BaseException | None] = {}

    def join(handler) -> None:  # type: ignore[no-untyped-def]
        try:
            handler.next_rendezvous()
            ended[handler] = None
        except BaseException as err:
            ended[handler] = err

    threads = [threading.Thread(target=join, args=(host,), daemon=True)]
    threads[0].start()
    wait_until(lambda: not told.exists(), 30, "the standby took its launcher's word")
    time.sleep(1)  # it would be first into the round, on torch's first come, first served
    assert host._this_node not in host._state_holder.state.participants
    threads += [threading.Thread(target=join, args=(m,), daemon=True) for m in members]
    for t in threads[1:]:
        t.start()
    wait_until(lambda: all(m in ended for m in members), 60, "the job's nodes in the round")
    assert all(ended[m] is None for m in members), ended

    def standing_by() -> bool:
        with members[0]._heartbeat_lock:  # its keep-alive thread syncs the state too
            members[0]._state_holder.sync()
            return host._this_node in members[0]._state_holder.state.redundancy_list

    wait_until(standing_by, 30, "the standby on the redundancy list")
    state = members[0]._state_holder.state
    assert set(state.participants) == {m._this_node for m in members}
    members[0].set_closed()  # the job ends: the standby's wait ends with it
    threads[0].join(timeout=30)
    assert isinstance(ended.get(host), RendezvousGracefulExitError), ended


HELD_STANDBY_CHILD = """\
import os, sys
from clusterpulse.trainer.torchrun import held_until_its_turn, take_hold
if not held_until_its_turn(take_hold()):
    sys.exit(0)
count_file, plan = sys.argv[1], sys.argv[2].split(",")
n = int(open(count_file).read()) if os.path.exists(count_file) else 0
open(count_file, "w").write(str(n + 1))
place, error, rc = plan[min(n, len(plan) - 1)].split("|")
open(os.environ["CLUSTERPULSE_RDZV_STATE_FILE"], "w").write(place)
if error:
    with open(os.environ["TORCHELASTIC_ERROR_FILE"], "w") as fh:
        fh.write('{"message": {"message": "%s: as torchrun says it"}}' % error)
sys.exit(int(rc))
"""


STORE_HOST = """\
import datetime, sys, time
import torch.distributed as dist
store = dist.TCPStore("127.0.0.1", int(sys.argv[1]), is_master=True,
                      timeout=datetime.timedelta(seconds=30))
print("up", flush=True)
time.sleep(600)
"""


def _store_host() -> tuple[int, subprocess.Popen]:
    """A process holding a TCPStore on a free port, and the port. Another test's process
    can take the port between `free_port` and the bind (EADDRINUSE in a fresh machine's
    run): then it is tried on another."""
    for _ in range(3):
        port = free_port()
        host = subprocess.Popen([sys.executable, "-c", STORE_HOST, str(port)],
                                stdout=subprocess.PIPE, text=True)
        if host.stdout.readline().strip() == "up":
            return port, host
        host.wait(timeout=30)
    raise AssertionError("no TCPStore came up on three free ports")


@pytest.mark.parametrize("store_back", [True, False])
def test_a_standby_whose_round_ended_waits_held_for_the_jobs_nodes(tmp_path, capsys,
                                                                   store_back):
    """After a graceful restart of the job, the standby's next torchrun is started and
    held (its imports done) until the new round has room for it; then it is let go.
    A store that stops answering for good: the job ended, the launcher exits 0 and the
    held torchrun ends unused."""
    from clusterpulse.trainer.launch import Rendezvous, Standby, run

    port, host = _store_host()
    try:
        _store, member = _rendezvous_member("held", port)
        endpoint = ("127.0.0.1", port)
        count = tmp_path / "count"
        seen: list[str] = []

        def the_job_restarts() -> None:
            wait_until(lambda: count.exists(), 120, "the standby's first torchrun")
            time.sleep(1.5)  # the launcher waits: nothing started
            seen.append(count.read_text())
            if store_back:
                _write_state(member, lambda s: setattr(s, "complete", True))
            else:
                host.kill()  # the job ended: its store's host is gone for good

        job = threading.Thread(target=the_job_restarts)
        job.start()
        try:
            got = run([sys.executable, "-c", HELD_STANDBY_CHILD, str(count),
                       "standby|RendezvousClosedError|1,joined||0"],
                      {**os.environ, "PYTHONPATH": str(REPO)}, 60,
                      Standby(endpoint, host=False, return_s=3.0),
                      Rendezvous(endpoint, "held", "127.0.0.1"))
        finally:
            job.join()
    finally:
        host.kill()
        host.wait()
    err = capsys.readouterr().err
    assert got == 0 and seen == ["1"]
    if store_back:
        assert count.read_text() == "2" and "standing by" in err
    else:
        assert count.read_text() == "1" and "rendezvous is gone" in err


BASELINES_WORKER = """
import json, os, sys
from pathlib import Path
import torch.distributed as dist
from clusterpulse.trainer.consensus import Consensus
rank, world, store, path = int(sys.argv[1]), int(sys.argv[2]), sys.argv[3], Path(sys.argv[4])
dist.init_process_group("gloo", init_method=f"file://{store}", rank=rank, world_size=world)
me, seen = f"host-a/GPU-{rank}", {}
first = Consensus(every=5, state_path=path, identity=me, save_every=2)
for i in range(40):  # 200 steps: past the scorer's warm-up
    for _ in range(5):
        first.record(0.1)
    scores = first.exchange(False, world)[2]
    if i == 0:
        seen["warm-up"] = scores
seen["scores"] = scores
dist.barrier()
saved = json.loads(path.read_text())["gpus"]
seen["saved"] = saved
second = Consensus(every=5, state_path=path, identity=me)
for _ in range(5):
    second.record(0.1)
second.exchange(False, world)
seen["keys"] = second.scorer.keys
seen["kept"] = second.scorer.state()[me] == saved[me]  # not yet relearnt
dist.barrier()
if rank == 0:
    path.write_text("{not json")
dist.barrier()
third = Consensus(every=5, state_path=path, identity=me)
third.record(0.1)
third.exchange(False, world)  # a warning, and a fresh scorer
seen["afresh"] = third.scorer.state()
Path(f"{path}.{rank}").write_text(json.dumps(seen))
os._exit(0)  # gloo not torn down: tests/support/worlds.run_ranks
"""


def test_straggler_baselines_are_kept_per_gpu_across_starts(tmp_path):
    """A restart (also the policy's own, for a slow GPU) relearnt every baseline, and
    the slow GPU became normal: the baselines are saved per hardware identity and the
    next start reads them (unreadable state: learn afresh, never fail). Two real ranks:
    a world of one has no peers and no scorer."""
    path = tmp_path / "straggler-state.json"
    run_ranks(BASELINES_WORKER, 2, tmp_path, str(path))
    for rank in range(2):
        seen = json.loads(Path(f"{path}.{rank}").read_text())
        assert seen["warm-up"] is None and seen["scores"] == [1.0, 1.0]
        assert sorted(seen["saved"]) == ["host-a/GPU-0", "host-a/GPU-1"]
        assert all(set(v) == {"b", "v", "bc", "vc"} for v in seen["saved"].values())
        assert seen["keys"] == ["host-a/GPU-0", "host-a/GPU-1"] and seen["kept"]
        assert seen["afresh"] == {}


def test_a_users_forward_pre_hook_on_the_model_is_its_own_work_not_ddps_broadcast():
    """attach_ddp times from DDP's forward to the wrapped model's first pre-hook as
    DDP's buffer broadcast (sync wait). A pre-hook the user registered on the model
    before attaching ran inside that window: its work counted as waiting for peers
    (a slow rank's work there hid it). Ours now runs first."""
    from tests.support.worlds import gloo_world_of_one

    with gloo_world_of_one():
        inner = torch.nn.Sequential(torch.nn.Linear(8, 8), torch.nn.BatchNorm1d(8))
        inner.register_forward_pre_hook(lambda _m, _a: time.sleep(0.2))  # the user's
        model = torch.nn.parallel.DistributedDataParallel(inner)  # buffers: broadcast
        assert model.will_sync_module_buffers()
        pulse = Pulse(run="unit", agent=None, world_size=1, catch_sigterm=False)
        pulse.attach_ddp(model)
        with pulse.step(1) as s, s.section("forward_backward"):
            model(torch.ones(4, 8)).sum().backward()
        assert pulse.last["sync_wait_seconds"] < 0.1, pulse.last
        assert pulse.last["compute_seconds"] >= 0.2, pulse.last
        pulse.close()


def test_a_resumed_run_reports_when_its_checkpoint_was_committed(tmp_path):
    """A resumed process knew its checkpoint's step but not its time and sent 0: every
    restart paged CheckpointStale ("last checkpoint is 20794d old") and the Run page
    said "saved 1796654189 s ago". The time comes from the checkpoint's manifest: not
    the resume (a review: CheckpointsFailing reads a change of it as a commit, and a
    resume hid saves that kept failing); CheckpointStale counts from the resume too."""
    from clusterpulse.trainer.checkpoint import MANIFEST, step_dir
    from clusterpulse.trainer.main import Trainer

    argv = ["--preset", "tiny", "--ckpt-dir", str(tmp_path), "--agent", "none",
            "--run-id", "resume-ts", "--log-every", "0"]
    with gloo_world_of_one():
        first = Trainer(parse_config([*argv, "--steps", "2", "--ckpt-every", "2"]))
        try:
            assert first.run() == 0
        finally:
            first.pulse.close()
            first.dir_claim.release()
        manifest = step_dir(tmp_path, 2) / MANIFEST
        doc = json.loads(manifest.read_text())
        doc["created_unix"] = 1_700_000_000.5  # committed long ago: not "now", not 0
        manifest.write_text(json.dumps(doc))
        again = Trainer(parse_config([*argv, "--steps", "3"]))
        try:
            assert again.resume() == 2
            again.train_step(3)
            assert again.pulse.extra["checkpoint_step"] == 2
            assert again.pulse.extra["checkpoint_timestamp_seconds"] == 1_700_000_000.5
        finally:
            again.pulse.close()
            again.dir_claim.release()
