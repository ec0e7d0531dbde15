"""torchrun as clusterpulse-train runs it (trainer/torchrun.py): a failure's log line
without torch's compiler imports, and the rendezvous polled as often as the job's size
allows, on torch's own rendezvous and store."""

from __future__ import annotations

import datetime
import logging
import os
import re
import subprocess
import sys
import time

import pytest
import torch
from torch.distributed.elastic.rendezvous import dynamic_rendezvous as dr
from torch.distributed.elastic.rendezvous.c10d_rendezvous_backend import C10dRendezvousBackend

from clusterpulse.trainer import torchrun
from clusterpulse.trainer.launch import Prewarmed, lost_round_env, parse, rendezvous_poll_env
from clusterpulse.trainer.parallel import attempts_before, local_attempt
from clusterpulse.trainer.restart import (
    ATTEMPTS_BEFORE_ENV,
    LOST_ROUND_WAIT_ENV,
    LOST_ROUND_WAIT_S,
    RELAUNCH_FILE_ENV,
    next_attempt_base,
    relaunch_count_path,
    request_relaunch,
)
from tests.support.procs import REPO

FAILURE_LOG = """\
import sys
from clusterpulse.trainer import torchrun
import torch.distributed.run  # what the torchrun process has imported when a worker fails
from torch.distributed.elastic.utils.logging import get_logger
if sys.argv[1] == "fixed":
    torchrun.prepare()
log = get_logger("torch.distributed.elastic.multiprocessing.api")
try:
    raise RuntimeError("Connection closed by peer")
except RuntimeError:
    log.exception("failed (exitcode: 1) local_rank: 0")
print("dynamo imported:", "torch._dynamo" in sys.modules)
"""


def _log_a_failure(mode: str) -> subprocess.CompletedProcess:
    return subprocess.run([sys.executable, "-c", FAILURE_LOG, mode], cwd=REPO, text=True,
                          capture_output=True, timeout=120,
                          env={"PATH": "/usr/bin:/bin", "PYTHONPATH": str(REPO)})


def test_a_workers_failure_is_logged_with_its_traceback_without_importing_the_compiler():
    """torch's log formatter imports torch._dynamo (sympy, ~1 s of CPU) the first time
    it formats a traceback: every torchrun of a job paid it as the job went down."""
    torchs = _log_a_failure("torch")
    assert torchs.returncode == 0, torchs.stderr
    if "dynamo imported: False" in torchs.stdout:
        pytest.skip("this torch's log formatter no longer imports torch._dynamo: "
                    "render_tracebacks_plainly has nothing left to fix")
    ours = _log_a_failure("fixed")
    assert "dynamo imported: False" in ours.stdout, ours.stderr
    for run in (torchs, ours):  # the same line: torch's prefix, message, traceback
        lines = run.stderr.splitlines()
        assert lines[0].startswith("E") and lines[0].endswith(
            "failed (exitcode: 1) local_rank: 0"), run.stderr
        assert "Traceback (most recent call last):" in run.stderr
        assert "RuntimeError: Connection closed by peer" in run.stderr
    assert len(ours.stderr.splitlines()) == len(torchs.stderr.splitlines())


def test_the_poll_setting_is_read_with_care():
    assert torchrun.poll_interval("0.2") == 0.2
    assert torchrun.poll_interval("2") == 2.0  # slower than torch's, for a very large job
    assert torchrun.poll_interval("0.001") == torchrun.MIN_POLL_S  # would spin
    for torchs in ("", "soon", "0", "-1", "nan", "inf", "1"):
        assert torchrun.poll_interval(torchs) is None


def test_the_rendezvous_poll_follows_the_jobs_size():
    assert torchrun.rendezvous_poll_s(1) == torchrun.rendezvous_poll_s(51) == 0.2
    assert torchrun.rendezvous_poll_s(128) == 0.5
    assert torchrun.rendezvous_poll_s(256) == torchrun.rendezvous_poll_s(4096) == 1.0
    # the launcher sets it from --nnodes' maximum, for a multi-node job only
    assert rendezvous_poll_env(parse(["--nnodes", "3:4", "--rdzv-endpoint", "h:1"])[0]) == {
        torchrun.RDZV_POLL_ENV: "0.2"}
    assert rendezvous_poll_env(parse(["--nnodes", "2:128", "--rdzv-endpoint", "h:1"])[0]) == {
        torchrun.RDZV_POLL_ENV: "0.5"}
    assert rendezvous_poll_env(parse([])[0]) == {}


def test_a_rank_whose_round_ended_waits_three_monitor_intervals_and_more(monkeypatch):
    """The wait of a rank whose round ended while it joined (trainer/parallel.py)
    outlasts torchrun's monitor on both nodes: a 6 s interval (a test's) is 28 s, not
    the 15 s default, which a short interval keeps; without the option, the default.
    Only a multi-node job reads it, so a one-node job's environment carries it too."""
    assert lost_round_env(parse(["--monitor-interval", "6"])[0]) == {LOST_ROUND_WAIT_ENV: "28"}
    assert lost_round_env(parse(["--monitor-interval", "0.2"])[0]) == {
        LOST_ROUND_WAIT_ENV: f"{LOST_ROUND_WAIT_S:g}"}
    assert lost_round_env(parse([])[0]) == {}
    # torchrun's own setting, where the launcher is given none
    monkeypatch.setenv("PET_MONITOR_INTERVAL", "10")
    assert lost_round_env(parse([])[0]) == {LOST_ROUND_WAIT_ENV: "40"}
    monkeypatch.setenv("PET_MONITOR_INTERVAL", "soon")
    assert lost_round_env(parse([])[0]) == {}


@pytest.fixture
def torch_rendezvous(monkeypatch):
    """torch's rendezvous parts as they were, after the test."""
    monkeypatch.setattr(dr, "_delay", dr._delay)
    monkeypatch.setattr(dr._BackendRendezvousStateHolder, "__init__",
                        dr._BackendRendezvousStateHolder.__init__)


def test_a_waiting_node_reads_the_rendezvous_every_poll(torch_rendezvous, monkeypatch):
    """A node waiting in torch's rendezvous re-read the state at most once a second
    (a read within a second served the last one again): a restart's nodes each saw
    the old round empty and the new one complete up to a second late."""
    store = torch.distributed.TCPStore("127.0.0.1", 0, is_master=True,
                                       timeout=datetime.timedelta(seconds=10))

    def two_nodes() -> tuple[dr.DynamicRendezvousHandler, dr.DynamicRendezvousHandler]:
        run = f"poll-{time.monotonic_ns()}"
        return tuple(dr.DynamicRendezvousHandler.from_backend(  # type: ignore[return-value]
            run, store, C10dRendezvousBackend(store, run), min_nodes=2, max_nodes=2,
            local_addr=f"127.0.0.{i}") for i in (1, 2))

    def sees_the_other_within(seconds: float) -> bool:
        waiting, other = two_nodes()
        waiting._state_holder.sync()  # read: nobody in the round yet
        other._state_holder.state.participants[other._this_node] = 0
        other._state_holder.mark_dirty()
        other._state_holder.sync()  # written to the store
        time.sleep(seconds)
        waiting._state_holder.sync()
        return other._this_node in waiting._state_holder.state.participants

    assert not sees_the_other_within(0.3)  # torch's: its own copy, for a second
    torchrun.poll_rendezvous_every(0.5)
    torchrun.poll_rendezvous_every(0.2)  # the last call wins: it wraps torch's, not ours
    assert sees_the_other_within(0.3)
    assert all(h._state_holder._cache_duration == 0.2 for h in two_nodes())

    slept: list[float] = []
    monkeypatch.setattr(time, "sleep", slept.append)
    dr._delay(seconds=1)  # the poll's wait, as torch calls it
    dr._delay(seconds=(0.05, 0.05))  # the first round's skew (a range): left as it is
    assert slept == [0.2, 0.05]


def _held_torchrun(out) -> Prewarmed:
    """`torchrun --help` started ahead, its output in `out` (through a shell's exec:
    the pipe's descriptor goes with it)."""
    cmd = ["/bin/sh", "-c", 'exec "$0" -m clusterpulse.trainer.torchrun --help > "$1" 2>&1',
           sys.executable, str(out)]
    return Prewarmed(cmd, {"PATH": "/usr/bin:/bin", "PYTHONPATH": str(REPO)})


def test_a_torchrun_started_ahead_runs_only_when_told(tmp_path):
    """Prewarmed (a graceful relaunch's next torchrun, started ahead with its imports
    done): it runs torchrun when told, and ends without running it when the launcher
    closes the pipe (the launcher ended, or needed no relaunch)."""
    held = _held_torchrun(tmp_path / "held")
    told_nothing = _held_torchrun(tmp_path / "told-nothing")  # started together: one wait
    time.sleep(1)
    assert held.proc.poll() is None and told_nothing.proc.poll() is None  # held, not run
    proc = held.go()
    assert proc is held.proc and proc.wait(timeout=120) == 0
    assert "usage:" in (tmp_path / "held").read_text()  # torchrun ran: its --help

    told_nothing._close_pipe()  # the launcher gone (even killed): the pipe closes
    assert told_nothing.proc.wait(timeout=120) == 0  # it ends quietly, torchrun not run
    assert "usage:" not in (tmp_path / "told-nothing").read_text()

    unused = _held_torchrun(tmp_path / "unused")
    unused.close()  # ended at once, whether still importing or held
    assert unused.proc.returncode is not None
    out = tmp_path / "unused"  # none at all if the shell was killed before its redirect
    assert not out.exists() or "usage:" not in out.read_text()
    assert unused.go() is None  # gone: the launcher starts a torchrun as before


def test_the_relaunch_count_comes_from_the_launchers_file(tmp_path, monkeypatch):
    """A torchrun started ahead (and its forkserver, and so its ranks) carries the
    environment of its start, one relaunch behind: the count is read from the file
    the launcher writes before each torchrun takes over."""
    marker = tmp_path / "relaunch"
    monkeypatch.setenv(RELAUNCH_FILE_ENV, str(marker))
    monkeypatch.setenv(ATTEMPTS_BEFORE_ENV, "1")
    assert attempts_before() == 1  # no file (an older launcher): the environment
    (tmp_path / relaunch_count_path(marker)).write_text("2")
    assert attempts_before() == 2
    monkeypatch.delenv(RELAUNCH_FILE_ENV)
    assert attempts_before() == 1


def test_a_graceful_relaunch_after_a_failure_restart_gets_a_new_attempt_number(
        tmp_path, monkeypatch):
    """A crash (torchrun's failure restart: attempt 0 + 1) then a graceful restart: the
    relaunched torchrun numbered its ranks 1 + 0, the attempt they had left, so the
    agent never saw them resume and the graceful command never completed. The ranks
    write the attempt they leave; the next torchrun starts past it."""
    marker = tmp_path / "relaunch"
    monkeypatch.setenv(RELAUNCH_FILE_ENV, str(marker))
    monkeypatch.setenv("TORCHELASTIC_RESTART_COUNT", "1")  # after one failure restart
    assert local_attempt() == 1
    assert request_relaunch(0.0, local_attempt()) == 0
    assert next_attempt_base(0, marker) == 2
    (tmp_path / relaunch_count_path(marker)).write_text("2")  # the launcher's
    monkeypatch.setenv("TORCHELASTIC_RESTART_COUNT", "0")  # the new torchrun
    assert local_attempt() == 2
    marker.write_text("checkpoint-restart\n")  # a rank that did not say (no Pulse)
    assert next_attempt_base(2, marker) == 3
    marker.unlink()
    assert next_attempt_base(3, marker) == 4


AGREE = """
import os
from clusterpulse.trainer.parallel import init_distributed
rank = int(os.environ["RANK"])
info = init_distributed(attempt={0: 0, 1: 3}[rank])  # a spare as rank 0: it saw none
print(f"rank={rank} attempt={info.attempt}", flush=True)
os._exit(0)  # no teardown: gloo torn down at exit may abort a rank (-6)
"""


def test_every_rank_takes_the_highest_attempt_proposed(tmp_path):
    """A hot spare (or a relaunched launcher) that became rank 0 proposed 0 while the
    job's other node had counted 3 attempts: taking rank 0's number sent the attempt
    back to 0 (a review), and the agent, waiting for a higher number to call a
    restart's ranks resumed, never did."""
    script = tmp_path / "agree.py"
    script.write_text(AGREE)
    out = subprocess.run([sys.executable, "-m", "torch.distributed.run", "--standalone",
                          "--nproc-per-node=2", str(script)], capture_output=True, text=True,
                         timeout=120, env={**os.environ, "OMP_NUM_THREADS": "1"})
    assert out.returncode == 0, out.stderr[-3000:]
    assert sorted(re.findall(r"rank=\d attempt=\d+", out.stdout)) == \
        ["rank=0 attempt=3", "rank=1 attempt=3"], out.stdout


ROUNDS = """
import os
from clusterpulse.trainer.parallel import init_distributed
first, again = init_distributed(), init_distributed()  # a framework's setup asks again
assert (again.attempt, again.membership_change) == (first.attempt, first.membership_change)
print(f"rank={os.environ['RANK']} attempt={first.attempt}", flush=True)
os._exit(0)  # no teardown: gloo torn down at exit may abort a rank (-6)
"""


def test_a_round_no_node_counted_still_gets_a_new_attempt_number(tmp_path):
    """torchrun counts a restart only on the node whose workers failed, and a node
    that rejoins counts none: the highest node count repeated a number when failures
    alternated between nodes (a review: 0, 1, 1, 2, 2), so the agent never saw those
    ranks resume. Each round proposes past the last attempt its node saw agreed."""
    script = tmp_path / "rounds.py"
    script.write_text(ROUNDS)
    env = {**os.environ, "OMP_NUM_THREADS": "1", RELAUNCH_FILE_ENV: str(tmp_path / "relaunch")}
    seen = []
    for _ in range(2):  # two rounds, no counter moved (TORCHELASTIC_RESTART_COUNT 0)
        out = subprocess.run([sys.executable, "-m", "torch.distributed.run", "--standalone",
                              "--nproc-per-node=2", str(script)], capture_output=True,
                             text=True, timeout=120, env=env)
        assert out.returncode == 0, out.stderr[-3000:]
        seen.append(sorted(re.findall(r"rank=\d attempt=\d+", out.stdout)))
    assert seen == [["rank=0 attempt=0", "rank=1 attempt=0"],
                    ["rank=0 attempt=1", "rank=1 attempt=1"]], seen


def test_a_rounds_store_port_range_avoids_ephemeral_nodeports_and_can_be_set(
        tmp_path, monkeypatch, caplog):
    """Where a round's store may listen (trainer/torchrun.py, 3.): below the kernel's
    ephemeral range and Kubernetes' NodePorts, or what the operator sets; nothing where
    the ephemeral range starts below it, and a port the kernel gives then."""
    from clusterpulse.trainer import torchrun as tr

    monkeypatch.delenv(tr.STORE_PORTS_ENV, raising=False)
    ranges = tmp_path / "ip_local_port_range"
    monkeypatch.setattr(tr, "PORT_RANGE", ranges)
    ranges.write_text("32768\t60999\n")
    assert tr.store_port_range() == (10000, 29999)
    ranges.write_text("20000\t60999\n")
    assert tr.store_port_range() == (10000, 19999)
    ranges.write_text("1024\t65535\n")
    assert tr.store_port_range() is None
    with caplog.at_level(logging.INFO, logger=tr.__name__):
        assert tr.port_below_ephemeral() >= 1024  # the kernel's choice, said
    assert "CLUSTERPULSE_STORE_PORTS=LOW-HIGH" in caplog.text
    monkeypatch.setenv(tr.STORE_PORTS_ENV, "41000-41009")
    assert tr.store_port_range() == (41000, 41009)
    assert 41000 <= tr.port_below_ephemeral() <= 41009
    monkeypatch.setenv(tr.STORE_PORTS_ENV, "41000")
    with caplog.at_level(logging.WARNING, logger=tr.__name__):
        assert tr.store_port_range() is None  # the default, from a range file starting at 1024
    assert "is not LOW-HIGH" in caplog.text
    ranges.unlink()
    monkeypatch.delenv(tr.STORE_PORTS_ENV)
    assert tr.store_port_range() is None
    monkeypatch.setenv(tr.STORE_PORTS_ENV, "19400-19497")  # all of them the demo's: none
    assert tr.port_below_ephemeral() not in range(19400, 19498)


@pytest.mark.parametrize("value", ["nan", "inf", "0", "-1"])
def test_a_monitor_interval_torchrun_cannot_use_is_a_usage_error(value, capsys):
    """Passed to torchrun unchecked: NaN reached its monitor loop's sleep."""
    with pytest.raises(SystemExit) as exit_:
        parse([f"--monitor-interval={value}"])
    assert exit_.value.code == 2
    assert "--monitor-interval must be a number of seconds > 0" in capsys.readouterr().err


@pytest.mark.parametrize("value", ["\u00b2", "-1", "two", ""])
def test_a_thread_count_int_cannot_read_leaves_torchs_own(value, monkeypatch):
    """OMP_NUM_THREADS='²' passed isdigit() and every rank died in int() at start."""
    import torch

    from clusterpulse.trainer.warmstart import take_torchrun_thread_count

    monkeypatch.setenv("OMP_NUM_THREADS", value)
    before = torch.get_num_threads()
    take_torchrun_thread_count()
    assert torch.get_num_threads() == before


WRAP_AFTER_THE_SERVERS_IMPORTS = """
import importlib, sys, tempfile
import torch
import torch.distributed as dist
import torch.distributed.checkpoint  # Pulse's checkpoints: torch 2.6's imports the compiler
by_torch = "torch._dynamo" in sys.modules
import clusterpulse.trainer.instrument  # Pulse, for any loop: it needs no compiler
assert by_torch or "torch._dynamo" not in sys.modules, "Pulse imported torch._dynamo"
from clusterpulse.trainer.warmstart import TRAINER
importlib.import_module(TRAINER)  # what a warm start's server imports before it forks
before = set(sys.modules)
with tempfile.TemporaryDirectory() as tmp:
    dist.init_process_group("gloo", init_method=f"file://{tmp}/store", rank=0, world_size=1)
    from clusterpulse.trainer.parallel import DistInfo, wrap
    wrap(torch.nn.Linear(4, 4), "ddp", DistInfo(0, 1, 0, torch.device("cpu"), "gloo"))
    dist.destroy_process_group()
print(sorted(m for m in set(sys.modules) - before if m.startswith("torch._dynamo")))
"""


def test_a_warm_rank_imports_nothing_of_torchs_compiler_when_it_wraps_its_model():
    """DDP imports torch._dynamo as it wraps the model: 0.5 s of CPU in every rank at
    every start and restart. The server of a warm start (trainer/warmstart/) imports it
    once, and each rank forked from it finds it imported; Pulse alone does not import
    it (a loop without DDP needs no compiler), unless torch's own DCP does (torch 2.6).
    In a new interpreter: the test process has imported it already."""
    out = subprocess.run([sys.executable, "-c", WRAP_AFTER_THE_SERVERS_IMPORTS], cwd=REPO,
                         capture_output=True, text=True, timeout=120,
                         env={**os.environ, "OMP_NUM_THREADS": "1"})
    assert out.returncode == 0, out.stderr[-3000:]
    assert out.stdout.strip().splitlines()[-1] == "[]", out.stdout
