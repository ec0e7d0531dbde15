"""`clusterpulse-train`: torchrun with restart-safe defaults for the reference trainer
(or any script instrumented with trainer.instrument).

Everything after `--` goes to the trainer (`python -m clusterpulse.trainer --help`), or, with
`--script`, to your script.

What it adds to torchrun, and why:
- `TORCH_DISABLE_SHARE_RDZV_TCP_STORE=1`: a fresh store per rendezvous round, so a
  restart never reads a dead peer's address (pytorch#135712; see trainer.parallel).
- Graceful restarts outside the failure budget: torchrun counts every non-zero worker
  exit as a failure, so graceful checkpoint-restarts used to spend `--max-restarts`.
  Here a rank leaving for a graceful restart writes this launcher's relaunch file
  and exits 0; torchrun ends cleanly and the launcher starts it again (a new
  rendezvous on every node). `--max-restarts` is kept for real failures, the job's
  across relaunches: the next torchrun gets what the failures before it left.
- Warm restarts (trainer/warmstart/): the reference trainer's ranks are forked from
  a server that imported torch and the trainer once, so a restart does not pay every
  rank's ~3.5 s of imports again. `--cold-start` starts each rank as a new
  interpreter, as torchrun does. A `--script` starts cold unless `--preload` names
  what the server may import for it (torch, the script's heavy libraries): what a
  foreign module does at import is unknown here, and a module that touched CUDA at
  import would break every forked rank.
- Leaving an elastic job for a while (the remediation's `evict-node`: a node whose
  link or GPU slows every rank): the ranks checkpoint as for any graceful restart and
  this launcher waits the command's `leave_s`, and then until the job runs without the
  node (its restart may take longer than the leave: the node would take its place in
  the new round again; at most a minute or the leave again, and half the rendezvous
  `join_timeout` in all), before starting torchrun again; the other nodes go on
  without it and take it back when it returns. The ranks refuse the command, and
  nothing restarts, when the job cannot go on without the node: it is at `--nnodes`' minimum,
  the node hosts the rendezvous store, or the job has one node; this launcher tells
  them the first and last two (CANNOT_LEAVE_ENV, MIN_NODES_ENV).
- Hot spares (`--hot-spares`, on every node of a job started on more nodes than its
  `--nnodes` maximum): torch's rendezvous keeps a node it cannot take on its
  redundancy list (no restart while it waits) and lets it into the next round when
  the job loses a node, so the job goes on at full size. A graceful restart ends every
  torchrun, a standby's too (the rendezvous closes, or its store goes with the host's
  torchrun); this launcher starts a standby's torchrun again (see `Standby`) instead
  of ending with it, and a standby exits 0 when the job has ended. torchrun runs with
  its rendezvous fixed for spares (trainer/spares.py).
- Graceful restarts without the imports (`--prewarm-after`): each torchrun that has
  run 20 s has the next one started beside it, held until a relaunch needs it, its
  torch and its forkserver's trainer imported (`Prewarmed`): a new torchrun no longer
  pays them on the restart's critical path, on every node at once.
- Quicker restarts (trainer/torchrun.py): a warm worker's failure log no longer
  imports torch's compiler stack (~1 s of CPU in every torchrun as the job goes down),
  and the rendezvous polls every 0.2 s (up to 51 nodes; torch's 1 s from 256) instead
  of every second while a restart's nodes wait for each other.
- SIGTERM and SIGINT (Ctrl-C) reach torchrun as one SIGTERM each, from here (it runs
  in a process group of its own), and torchrun passes it to the ranks: they
  checkpoint at the next consensus step (a second one, 5 s or more later: at once;
  copies within 5 s are one request, trainer/restart.py); the launcher then exits
  128 + the signal (143, 130).
- One job id for all its torchruns (`CLUSTERPULSE_JOB_ID`, unless the environment
  names one: its rendezvous id and endpoint on several nodes, one drawn per launcher
  on one node): a `--standalone` torchrun draws a new rendezvous id each time, so to
  the checkpoint directory's claim (trainer/dirclaim.py) a relaunch was another job.
- Multi-node rendezvous settings for recovery rather than start-up (RDZV_DEFAULTS):
  torch's c10d rendezvous declares a node dead after 3 missed 5 s keep-alives (15 s)
  and then waits `last_call_timeout` (30 s) for more nodes, so an elastic job that lost
  a node stood still for ~45 s before it could go on without it. Here: keep-alives
  every second, dead after 5 missed (5 s: a node busy for 4 s is not taken for dead),
  last call 5 s. Each is a `--rdzv-conf` setting and yields to one given there (raise
  the interval for jobs of many hundreds of nodes, where every keep-alive rewrites the
  rendezvous state on the store's host).
"""

from __future__ import annotations

import argparse
import contextlib
import json
import math
import os
import re
import signal
import socket
import subprocess
import sys
import tempfile
import threading
import time
import uuid
from dataclasses import dataclass
from pathlib import Path

from clusterpulse.agent.validate import is_digits
from clusterpulse.trainer import spares
from clusterpulse.trainer.config import ConfigError, parse_config
from clusterpulse.trainer.dirclaim import JOB_ID_ENV
from clusterpulse.trainer.restart import (
    ATTEMPTS_BEFORE_ENV,
    CANNOT_LEAVE_ENV,
    LOST_ROUND_WAIT_ENV,
    LOST_ROUND_WAIT_S,
    MIN_NODES_ENV,
    RELAUNCH_FILE_ENV,
    SHARE_STORE_ENV,
    failures_spent,
    leave_path,
    next_attempt_base,
    relaunch_count_path,
    write_atomically,
)
from clusterpulse.trainer.torch_support import (
    UnsupportedTorch,
    rendezvous_keep_alive,
    require_supported,
)
from clusterpulse.trainer.torchrun import GO, HOLD_FD_ENV, RDZV_POLL_ENV, rendezvous_poll_s
from clusterpulse.trainer.warmstart import PRELOAD_OPTION, PRELOAD_PATH_OPTION

TRAINER_MAIN = Path(__file__).resolve().with_name("__main__.py")
SCRIPT_RUNNER = Path(__file__).resolve().with_name("scriptrun.py")
MODULE_NAME = re.compile(r"[A-Za-z_][A-Za-z0-9_]*(\.[A-Za-z_][A-Za-z0-9_]*)*")
STANDBY_RETURN_S = 60.0  # a graceful restart's host is back in seconds; a job's end is for good
ERROR_FILE_ENV = "TORCHELASTIC_ERROR_FILE"  # where torchrun's @record writes its own error
# torchrun's errors that say the rendezvous round ended under a node waiting in it: it
# was closed (the job finished or restarted gracefully), or its store went away with
# the host's torchrun. torch <= 2.13 ends a standby on a closed rendezvous with an
# AttributeError (its agent swallows RendezvousGracefulExitError and returns None).
ROUND_ENDED = ("RendezvousClosedError", "RendezvousConnectionError")
GRACEFUL_EXIT_BUG = "'NoneType' object has no attribute 'is_failed'"
# How long past its sit-out a node back from a leave waits for the job to restart
# without it (or the sit-out's length, if longer): a restart takes seconds, a loaded or
# large one up to a minute; a job not running by then is more likely waiting for this
# node (another one lost, below its minimum), and it rejoins.
RESTART_ALLOWANCE_S = 60.0
# How long a torchrun runs before the launcher starts the next one ahead of its turn
# (Prewarmed): past its own start and its ranks', whose CPU it would compete for.
PREWARM_AFTER_S = 20.0
RDZV_DEFAULTS = {"keep_alive_interval": "1", "keep_alive_max_attempt": "5",
                 "last_call_timeout": "5"}

EXAMPLES = """\
examples:
  clusterpulse-train --nproc 2 -- --preset tiny --steps 60 --ckpt-every 10 --ckpt-dir /tmp/ckpt
  clusterpulse-train --nproc 8 --max-restarts 3 -- --preset 1b --parallel fsdp --async-ckpt \\
      --ckpt-dir /shared/ckpt/run1 --ckpt-every 500
  # two nodes: run on each, with the same rendezvous endpoint
  clusterpulse-train --nnodes 2 --rdzv-endpoint head:29400 --nproc 8 -- --ckpt-dir /shared/ckpt
  # your own instrumented script (see examples/ddp_tutorial.py), restarts warm
  clusterpulse-train --nproc 4 --script examples/ddp_tutorial.py --preload torch -- 10 5
"""


def parse(argv: list[str]) -> tuple[argparse.Namespace, list[str]]:
    if "--" in argv:
        i = argv.index("--")
        ours, trainer_args = argv[:i], argv[i + 1:]
    else:
        ours, trainer_args = argv, []
    p = argparse.ArgumentParser(prog="clusterpulse-train", description=__doc__, epilog=EXAMPLES,
                                formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--nproc", type=int, default=None,
                   help="ranks on this node (default: GPUs, or 2 on CPU)")
    p.add_argument("--nnodes", default="1", help="nodes, or MIN:MAX (default: 1)")
    p.add_argument("--max-restarts", type=int, default=3,
                   help="failure restarts torchrun allows (graceful ones are not counted; "
                   "default: 3)")
    p.add_argument("--rdzv-endpoint", default="",
                   help="HOST:PORT of the c10d rendezvous for multi-node runs")
    p.add_argument("--rdzv-id", default="clusterpulse", help="rendezvous id")
    # Schedulers know node addresses better than hostnames do (deploy/slurm/train.sbatch).
    p.add_argument("--local-addr", default="",
                   help="address this node advertises to its peers (default: its hostname)")
    p.add_argument("--rdzv-host", action=argparse.BooleanOptionalAction, default=None,
                   help="whether this node hosts the rendezvous store (default: guessed "
                   "from the hostname)")
    p.add_argument("--rdzv-conf", action="append", default=[], metavar="KEY=VALUE",
                   help="extra c10d rendezvous settings, e.g. join_timeout=120 "
                   "(repeatable; torchrun's --rdzv-conf)")
    p.add_argument("--hot-spares", action="store_true",
                   help="the job was started on more nodes than --nnodes' maximum: a node "
                   "the rendezvous leaves out stands by, across the job's graceful "
                   "restarts, and takes the place of a node the job loses")
    p.add_argument("--monitor-interval", type=float, default=None,
                   help="seconds between torchrun's worker checks (torchrun's default)")
    p.add_argument("--script", default="",
                   help="run this Python script instead of the reference trainer")
    p.add_argument("--preload", action="append", default=[], metavar="MODULE",
                   help="with --script: start ranks forked from a server that imported "
                   "MODULE once (repeatable; e.g. torch): restarts skip those imports")
    p.add_argument("--prewarm-after", type=float, default=PREWARM_AFTER_S, metavar="S",
                   help="start the next torchrun (its imports, its forkserver's) S seconds "
                   "into each one, held until a graceful restart needs it; 0 turns it off "
                   f"(default: {PREWARM_AFTER_S:g}; costs a held torchrun's memory)")
    p.add_argument("--cold-start", action="store_true",
                   help="start each rank as a new interpreter (torchrun's way), not forked "
                   "from a server that has torch and the trainer imported")
    a = p.parse_args(ours)
    if a.nproc is not None and a.nproc < 1:
        p.error("--nproc must be >= 1")
    if a.max_restarts < 0:
        p.error("--max-restarts must be >= 0")
    if not (math.isfinite(a.prewarm_after) and a.prewarm_after >= 0):
        p.error("--prewarm-after must be a number of seconds >= 0 (0: off)")
    if a.monitor_interval is not None and not (math.isfinite(a.monitor_interval)
                                               and a.monitor_interval > 0):
        p.error("--monitor-interval must be a number of seconds > 0")
    sizes = a.nnodes.split(":")
    if len(sizes) > 2 or not all(is_digits(n) and int(n) > 0 for n in sizes) or \
            int(sizes[0]) > int(sizes[-1]):
        p.error(f"--nnodes {a.nnodes!r}: expected N or MIN:MAX nodes (1 <= MIN <= MAX)")
    for kv in a.rdzv_conf:
        key, sep, _ = kv.partition("=")
        if not sep or not key or "," in kv:
            p.error(f"--rdzv-conf {kv!r}: expected KEY=VALUE (one per flag)")
        if key == "is_host":
            p.error("--rdzv-conf is_host=...: use --rdzv-host / --no-rdzv-host")
    if a.hot_spares and not a.rdzv_endpoint:
        p.error("--hot-spares needs --rdzv-endpoint: spares stand by for a multi-node job")
    if a.rdzv_conf and not a.rdzv_endpoint:
        p.error("--rdzv-conf needs --rdzv-endpoint (a single node runs --standalone)")
    if a.script and not Path(a.script).is_file():
        p.error(f"--script {a.script}: no such file")
    if a.preload and not a.script:
        p.error("--preload is for --script: the reference trainer preloads what it imports")
    if a.preload and a.cold_start:
        p.error("--preload starts ranks warm, --cold-start as new interpreters: pick one")
    for module in a.preload:
        if not MODULE_NAME.fullmatch(module):
            p.error(f"--preload {module!r}: not a module name (e.g. torch, my_pkg.models)")
    return a, trainer_args


def build_command(argv: list[str]) -> list[str]:
    return command(*parse(argv))


def command(a: argparse.Namespace, trainer_args: list[str]) -> list[str]:
    nproc = ranks_per_node(a)
    warm = not a.cold_start and (not a.script or bool(a.preload))
    if warm:
        cmd = [sys.executable, "-m", "clusterpulse.trainer.warmstart",
               *(f"{PRELOAD_OPTION}{m}" for m in a.preload)]
        if a.script:  # a module beside the script can be preloaded, as python S finds it
            cmd.append(f"{PRELOAD_PATH_OPTION}{Path(a.script).resolve().parent}")
    else:  # torchrun with the quicker restart's changes (and the spares' fixes)
        cmd = [sys.executable, "-m", "clusterpulse.trainer.torchrun"]
    cmd += [f"--nproc-per-node={nproc}", f"--max-restarts={a.max_restarts}"]
    if a.monitor_interval is not None:
        cmd.append(f"--monitor-interval={a.monitor_interval}")
    if a.rdzv_endpoint:
        cmd += [f"--nnodes={a.nnodes}", "--rdzv-backend=c10d",
                f"--rdzv-endpoint={a.rdzv_endpoint}", f"--rdzv-id={a.rdzv_id}"]
        given = {kv.partition("=")[0].strip() for kv in a.rdzv_conf}
        rendezvous_keep_alive()  # an older torch ignores the keep-alive: said once
        conf = [*a.rdzv_conf, *(f"{k}={v}" for k, v in RDZV_DEFAULTS.items() if k not in given)]
        if a.rdzv_host is not None:
            conf.insert(0, f"is_host={str(a.rdzv_host).lower()}")
        if conf:
            cmd.append(f"--rdzv-conf={','.join(conf)}")
    else:
        cmd += ["--standalone"]
    if a.local_addr:
        cmd.append(f"--local-addr={a.local_addr}")
    if warm:
        target = ["--run-path", "--start-method=forkserver",
                  *([str(SCRIPT_RUNNER), a.script] if a.script else [str(TRAINER_MAIN)])]
    else:
        target = [a.script] if a.script else ["-m", "clusterpulse.trainer"]
    return [*cmd, *target, *trainer_args]


def hosts_rendezvous(a: argparse.Namespace) -> bool:
    """Whether this node serves the rendezvous store: --rdzv-host, else torch's own
    guess (its c10d rendezvous backend's, from the endpoint's host name)."""
    if a.rdzv_host is not None:
        return bool(a.rdzv_host)
    from torch.distributed.elastic.rendezvous.utils import _matches_machine_hostname

    return _matches_machine_hostname(rendezvous_endpoint(a)[0])


def rendezvous_endpoint(a: argparse.Namespace) -> tuple[str, int]:
    from torch.distributed.elastic.rendezvous.utils import parse_rendezvous_endpoint

    return parse_rendezvous_endpoint(a.rdzv_endpoint, 29400)


@dataclass(frozen=True)
class Rendezvous:
    """A multi-node job's rendezvous and the address this node joins it with: what a
    node back from a leave reads to rejoin only once the job runs without it
    (`_rejoin_when_running`)."""

    endpoint: tuple[str, int]
    run_id: str
    local_addr: str  # --local-addr; torch's node address is the FQDN without it

    @classmethod
    def of(cls, a: argparse.Namespace) -> Rendezvous | None:
        if not a.rdzv_endpoint:
            return None
        return cls(rendezvous_endpoint(a), a.rdzv_id, a.local_addr)


def ranks_per_node(a: argparse.Namespace) -> int:
    """--nproc, else one rank per GPU (2 on a CPU machine)."""
    if a.nproc is not None:
        return a.nproc
    import torch

    return torch.cuda.device_count() or 2


def threads_env(nproc: int) -> dict[str, str]:
    """OMP_NUM_THREADS=1 for several ranks on a node, unless the environment names a
    count: torchrun's own default, set here so that it does not print its four-line
    warning banner on every start (a clean start prints no warnings)."""
    return {"OMP_NUM_THREADS": "1"} if nproc > 1 else {}


def lost_round_env(a: argparse.Namespace) -> dict[str, str]:
    """How long a rank whose round ended while it joined waits for torchrun to stop
    it (trainer/parallel.py): torchrun's monitor must see the other node waiting, on
    both nodes, so at least three of its intervals and a margin, for a slow
    --monitor-interval (or torchrun's own PET_MONITOR_INTERVAL); never under the
    default."""
    interval = a.monitor_interval
    if interval is None:
        try:
            interval = float(os.environ.get("PET_MONITOR_INTERVAL", ""))
        except ValueError:
            return {}
    if not math.isfinite(interval) or interval <= 0:
        return {}
    return {LOST_ROUND_WAIT_ENV: f"{max(LOST_ROUND_WAIT_S, 3 * interval + 10):g}"}


def rendezvous_poll_env(a: argparse.Namespace) -> dict[str, str]:
    """How often torchrun's rendezvous polls, from the job's largest size
    (trainer/torchrun.py): a single node does not rendezvous over the network."""
    if not a.rdzv_endpoint:
        return {}
    nodes = int(a.nnodes.rpartition(":")[2])
    return {RDZV_POLL_ENV: f"{rendezvous_poll_s(nodes):g}"}


def leave_env(a: argparse.Namespace) -> dict[str, str]:
    """What the ranks need to know to refuse a leave this node cannot take
    (trainer.restart.leave_refusal): that it never can, or the job's minimum."""
    if not a.rdzv_endpoint:
        return {CANNOT_LEAVE_ENV: "single_node"}
    if hosts_rendezvous(a):
        return {CANNOT_LEAVE_ENV: "rendezvous_host"}
    return {MIN_NODES_ENV: a.nnodes.split(":")[0]}


def job_id(a: argparse.Namespace) -> str:
    """This job across the torchruns this launcher starts (trainer.dirclaim): a
    `--standalone` torchrun draws a new rendezvous id each time, so a graceful
    relaunch looked like another job to the checkpoint directory's claim. A multi-node
    job's is its rendezvous, the same on every node: `--rdzv-id` (whose default is
    every job's) at `--rdzv-endpoint` (one job's at a time); one the environment names
    wins."""
    return os.environ.get(JOB_ID_ENV) or (
        f"rdzv:{a.rdzv_id}@{a.rdzv_endpoint}" if a.rdzv_endpoint
        else f"launcher:{uuid.uuid4().hex}")


def longest_leave_s(a: argparse.Namespace) -> float:
    """Half the rendezvous join_timeout (torch's default 600 s): should the job fall
    below its minimum while this node sits out (another node lost), the others wait for
    nodes that long before they give up, and this one is back in time."""
    conf = dict(kv.partition("=")[::2] for kv in a.rdzv_conf)
    timeout = next((v for k, v in conf.items() if k.strip() == "join_timeout"), "600")
    try:
        return float(timeout) / 2
    except ValueError:  # torch refuses it too, at its rendezvous
        return 300.0


def _leave_seconds(request: str, longest_s: float) -> float:
    """The seconds the ranks' leave file asks, at most `longest_s` (0 for a malformed
    request, which is ignored)."""
    try:
        return max(0.0, min(float(request.split()[0]), longest_s))
    except (IndexError, ValueError):
        _say(f"ignoring a malformed leave request {request!r}")
        return 0.0


def _sit_out(seconds: float, stop: list[int]) -> None:
    _say(f"leaving the job for {seconds:.0f} s (the other nodes go on without this one), "
         "then rejoining")
    _wait(seconds, stop)


def _say_sitting_out(rdzv: Rendezvous, back: threading.Event, stop: list[int]) -> None:
    """Tell the job's new round, once its store is back, that this node sits it out
    (`spares.announce_sitting_out`), from a thread beside the sit-out, until `back`
    (set once the node rejoins, not when its sit-out ends: a sit-out of a second ends
    before the store's host is back): a standby takes the place before the round's
    last call ends only when a node said so, and the job's own nodes, late ones too,
    get theirs back first."""
    def announce() -> None:
        while not stop and not back.is_set():
            if spares.announce_sitting_out(rdzv.endpoint, rdzv.run_id):
                return
            back.wait(0.2)

    threading.Thread(target=announce, name="sitting-out", daemon=True).start()


def _rejoin_when_running(rdzv: Rendezvous, pid: int, within_s: float, stop: list[int]) -> None:
    """After a leave: wait, at most `within_s`, until the job runs without this node
    (`spares.running_without`: its last torchrun, `pid`, out of a complete round
    nobody waits to get into). A sit-out shorter than the job's restart used to end
    with the new round still forming, and the node took its place in it again."""
    node = (rdzv.local_addr or socket.getfqdn(), pid)
    end = time.monotonic() + within_s
    said = False
    while not stop and time.monotonic() < end:
        if spares.running_without(rdzv.endpoint, rdzv.run_id, node):
            return
        if not said:
            _say(f"the job has not restarted without this node yet: waiting for it (at most "
                 f"{within_s:.0f} s) before rejoining")
            said = True
        _wait(min(1.0, end - time.monotonic()), stop)
    if said and not stop:
        _say("the job did not restart without this node in time: rejoining")


def _join_when_room(rdzv: Rendezvous, within_s: float, gone_after_s: float,
                    stop: list[int]) -> bool:
    """A standby whose round ended: wait, at most `within_s`, until the new round has
    room for it (`spares.room_for_a_standby`); longer, the job is more likely short of
    its minimum without this node (one lost in the restart), and it joins. False when
    the job's store has not answered for `gone_after_s`: the job is over."""
    end = time.monotonic() + within_s
    answered = time.monotonic()
    while not stop and time.monotonic() < end:
        room = spares.room_for_a_standby(rdzv.endpoint, rdzv.run_id)
        if room:
            return True
        if room is not None:
            answered = time.monotonic()
        elif time.monotonic() - answered > gone_after_s:
            return False
        _wait(min(0.2, end - time.monotonic()), stop)
    if not stop:
        _say(f"the job's new round did not form in {within_s:.0f} s: joining it")
    return True


def _wait(seconds: float, stop: list[int]) -> None:
    end = time.monotonic() + seconds
    while not stop and time.monotonic() < end:
        time.sleep(min(0.5, max(0.0, end - time.monotonic())))


@dataclass(frozen=True)
class Standby:
    """How a node of a job with hot spares tells standing by from failing.

    Its torchrun (trainer/spares.py) writes where it last was: on the redundancy list
    (STANDBY), back in a rendezvous after being in the job (REJOINING), or in a round
    (JOINED). One that ended on the redundancy list because the round ended (its
    @record error file names the error: ROUND_ENDED) stood by: the job restarted
    gracefully, or it is over. A node that serves the rendezvous store starts again
    at once (the others need its store); any other node once the store answers again
    (within `return_s`), or exits 0 when it does not. A standby whose new round the
    job's nodes never join within the rendezvous join_timeout (its torchrun ends with
    RendezvousTimeoutError) exits 0: the job is over. Everything else ends the
    launcher with torchrun's code: a node in the job or rejoining it (its workers
    failed, the job's host died under it, another node closed the rendezvous), a
    rendezvous never reached, a join timeout (the job never had its minimum), a bad
    setting."""

    rendezvous: tuple[str, int]
    host: bool
    return_s: float = STANDBY_RETURN_S

    @classmethod
    def of(cls, a: argparse.Namespace) -> Standby | None:
        if not a.hot_spares:
            return None
        return cls(rendezvous_endpoint(a), hosts_rendezvous(a))


def answers(address: tuple[str, int], timeout_s: float = 2.0) -> bool:
    """Whether something accepts connections at `address` (the store says nothing of a
    connection closed before a request)."""
    try:
        with socket.create_connection(address, timeout=timeout_s):
            return True
    except OSError:
        return False


def round_outcome(error_file: Path) -> str | None:
    """"ended" when torchrun's recorded error says the round it waited in ended,
    "timeout" for a join timeout, else None (no error, or another one)."""
    try:
        message = json.loads(error_file.read_text()).get("message", "")
    except (OSError, ValueError, AttributeError):
        return None
    if isinstance(message, dict):
        message = message.get("message", "")
    name = str(message).partition(":")[0].strip()
    if name in ROUND_ENDED or GRACEFUL_EXIT_BUG in str(message):
        return "ended"
    return "timeout" if name == "RendezvousTimeoutError" else None


def _await_rendezvous(address: tuple[str, int], within_s: float, stop: list[int]) -> bool:
    end = time.monotonic() + within_s
    while not stop and time.monotonic() < end:
        if answers(address):
            return True
        time.sleep(0.5)
    return False


def _say(text: str) -> None:
    print(f"clusterpulse-train: {text}", file=sys.stderr, flush=True)


class Prewarmed:
    """The next torchrun, started ahead of its turn: it imports torch, and its
    forkserver the trainer, then waits on a pipe (trainer/torchrun.py,
    held_until_its_turn). A graceful restart ends every torchrun of the job, and each
    node's new one paid those imports again (~5 s of CPU a node, all nodes at once,
    on the restart's critical path); the relaunch now starts one that has them done.
    Closing the pipe (this launcher ending, even killed) ends it unused."""

    def __init__(self, cmd: list[str], env: dict[str, str]) -> None:
        self.cmd = cmd
        read, self._go = os.pipe()
        try:
            self.proc = subprocess.Popen(cmd, env={**env, HOLD_FD_ENV: str(read)},
                                         pass_fds=(read,), process_group=0)
        except BaseException:
            self._close_pipe()
            raise
        finally:
            os.close(read)

    @classmethod
    def start(cls, cmd: list[str], env: dict[str, str]) -> Prewarmed | None:
        """One started ahead, or None (said) where the system cannot start one now:
        the running torchrun goes on, and the relaunch starts a torchrun as before."""
        try:
            return cls(cmd, env)
        except OSError as err:
            _say(f"not starting the next torchrun ahead: {err}")
            return None

    def go(self) -> subprocess.Popen | None:
        """Let it run; None if it is gone (then start a torchrun as before)."""
        try:
            if self.proc.poll() is None:
                os.write(self._go, GO)
                return self.proc
            return None
        except OSError:
            return None
        finally:
            self._close_pipe()

    def close(self) -> None:
        """End it unused, at once: it holds nothing worth keeping (its forkserver, in
        a session of its own, ends when it does)."""
        self._close_pipe()
        if self.proc.poll() is None:
            self.proc.kill()
        self.proc.wait()

    def _close_pipe(self) -> None:
        if self._go >= 0:
            with contextlib.suppress(OSError):
                os.close(self._go)
            self._go = -1


def _budget_at(cmd: list[str]) -> int | None:
    """Where `command` put torchrun's --max-restarts=N: the first such word (a script's
    own arguments come after it, and may hold one too)."""
    return next((i for i, a in enumerate(cmd) if a.startswith("--max-restarts=")), None)


def max_restarts(cmd: list[str]) -> int:
    """torchrun's --max-restarts in `cmd` (its default, 0, where none is)."""
    at = _budget_at(cmd)
    return 0 if at is None else int(cmd[at].split("=", 1)[1])


def budgeted(cmd: list[str], left: int) -> list[str]:
    """`cmd` with torchrun's --max-restarts=`left`, where it has the option."""
    at = _budget_at(cmd)
    return cmd if at is None else [*cmd[:at], f"--max-restarts={left}", *cmd[at + 1:]]


def run(cmd: list[str], env: dict[str, str] | None, longest_leave: float,
        standby: Standby | None = None, rdzv: Rendezvous | None = None,
        prewarm_after: float = PREWARM_AFTER_S) -> int:
    """Run torchrun, relaunching it after each graceful restart (after sitting out what
    a leave asks and, in a multi-node job (`rdzv`), until the job runs without this
    node: at most RESTART_ALLOWANCE_S or the sit-out again, and `longest_leave` s in
    all) and, with hot spares, after each round this node stood by (`Standby`);
    torchrun's exit code. Each torchrun that runs `prewarm_after` s (0: never) has the
    next one started, held (`Prewarmed`)."""
    env = {**(env if env is not None else os.environ), SHARE_STORE_ENV: "1"}
    stop: list[int] = []
    child: subprocess.Popen | None = None
    prewarmed: Prewarmed | None = None

    def forward(signum: int, frame: object) -> None:
        stop.append(signum)
        if child is not None and child.poll() is None:
            # SIGTERM, whatever came: torchrun passes its signal on, and the ranks
            # checkpoint on SIGTERM only (SIGINT would stop them mid-step)
            child.send_signal(signal.SIGTERM)

    old = {s: signal.signal(s, forward) for s in (signal.SIGTERM, signal.SIGINT)}
    try:
        with tempfile.TemporaryDirectory(prefix="clusterpulse-train-") as tmp:
            marker = Path(tmp) / "relaunch"
            leave_file = Path(leave_path(marker))
            error_file = Path(tmp) / "torchrun-error.json"
            rdzv_state = Path(tmp) / "rendezvous"
            join_when_room_file = Path(tmp) / "join-when-room"
            relaunches = 0
            attempts_before = 0  # the first attempt number of the torchrun started next
            # The failure restarts left to the job (--max-restarts): each torchrun was
            # started with the whole budget, so a job that crashed, restarted gracefully
            # and crashed again had it anew after every graceful restart (crash loops
            # with automatic restarts never ended). The next torchrun gets what is left.
            budget = left = max_restarts(cmd)
            stood_by = False
            join_when_room = False  # a standby whose round ended, with the job's store back
            # how long it holds back: under the join timeout (`longest_leave` is half of
            # it), or a job short of its minimum without it timed out first and ended
            hold_s = min(RESTART_ALLOWANCE_S, longest_leave)
            while not stop:
                marker.unlink(missing_ok=True)
                leave_file.unlink(missing_ok=True)
                error_file.unlink(missing_ok=True)
                rdzv_state.unlink(missing_ok=True)
                join_when_room_file.unlink(missing_ok=True)
                env.update({RELAUNCH_FILE_ENV: str(marker),
                            ATTEMPTS_BEFORE_ENV: str(attempts_before)})
                write_atomically(Path(relaunch_count_path(marker)), str(attempts_before))
                if standby is not None:
                    env.update({ERROR_FILE_ENV: str(error_file), spares.HOT_SPARES_ENV: "1",
                                spares.RDZV_STATE_ENV: str(rdzv_state),
                                spares.JOIN_WHEN_ROOM_ENV: str(join_when_room_file)})
                    if join_when_room and standby.host:
                        # its torchrun must start now (the others need its store) and
                        # holds its first join instead (trainer/spares.py, 5.)
                        write_atomically(join_when_room_file, str(hold_s))
                # torchrun in a process group of its own: a signal to the launcher's
                # group (Ctrl-C, `kill -- -PGID`) reaches it once, from here; twice, it
                # stopped waiting for its ranks' SIGTERM checkpoints and left them
                if stop:  # a signal since the loop's test: start nothing more
                    break
                if join_when_room and standby is not None and not standby.host and \
                        rdzv is not None:
                    # its torchrun held ready while the job's own nodes rejoin
                    prewarmed = prewarmed or Prewarmed.start(budgeted(cmd, left), env)
                    joining = _join_when_room(rdzv, hold_s, standby.return_s, stop)
                    if stop:
                        break
                    if not joining:
                        _say("the job's rendezvous is gone (the job ended) while this "
                             "node stood by")
                        return 0
                join_when_room = False
                if prewarmed is not None and prewarmed.cmd != budgeted(cmd, left):
                    _say("the torchrun started ahead has the failure budget from before "
                         "this one's failures: starting another")
                    prewarmed.close()
                    prewarmed = None
                child = prewarmed.go() if prewarmed is not None else None
                prewarmed = None
                if child is not None:
                    _say("torchrun again: one started ahead, its imports done")
                if child is None:
                    child = subprocess.Popen(budgeted(cmd, left), env=env, process_group=0)
                if stop:  # a signal before torchrun existed to be told
                    child.send_signal(signal.SIGTERM)
                try:
                    rc = child.wait(timeout=prewarm_after or None)
                except subprocess.TimeoutExpired:
                    if not stop:
                        prewarmed = Prewarmed.start(budgeted(cmd, left), env)
                    rc = child.wait()
                place = spares.place(rdzv_state)
                if place in (spares.JOINED, spares.REJOINING):
                    stood_by = False  # in the job (again): what follows is the job's
                if stop:
                    break
                if rc == 0 and marker.exists():
                    relaunches += 1
                    attempts_before = next_attempt_base(attempts_before, marker)
                    left = max(0, left - failures_spent(marker))
                    _say(f"graceful restart {relaunches}: relaunching ({left} failure "
                         f"restart(s) left of --max-restarts {budget})")
                    sat_out = _leave_seconds(leave_file.read_text(), longest_leave) \
                        if leave_file.exists() else 0.0
                    if sat_out:
                        back = threading.Event()
                        if standby is not None and rdzv is not None:
                            _say_sitting_out(rdzv, back, stop)
                        _sit_out(sat_out, stop)
                        if rdzv is not None:  # out until the job runs without it
                            _rejoin_when_running(rdzv, child.pid, min(
                                longest_leave - sat_out, max(sat_out, RESTART_ALLOWANCE_S)),
                                stop)
                        back.set()  # into the job's rounds again: none of them sat out
                    continue
                if standby is None:
                    return rc
                outcome = round_outcome(error_file)
                if outcome == "timeout":
                    if stood_by and place is None:  # a new round the job's nodes never joined
                        _say("the job's nodes did not come back: the job ended while this "
                             "node stood by")
                        return 0
                    return rc  # the job never had its minimum
                # stood by until the round ended (the job restarted gracefully, or it is
                # over); or, after standing by, found no rendezvous to wait in
                if outcome != "ended" or not (place == spares.STANDBY or (
                        place is None and stood_by)):
                    return rc
                if not standby.host and not _await_rendezvous(
                        standby.rendezvous, standby.return_s, stop):
                    if stop:
                        break
                    _say("the job's rendezvous is gone (the job ended) while this node "
                         "stood by")
                    return 0
                stood_by = True
                join_when_room = True  # the host in its torchrun, the others here first
                _say("standing by: the job is at its node maximum; this node takes the "
                     "place of one it loses")
            return 128 + stop[0]
    finally:
        if prewarmed is not None:
            prewarmed.close()
        for s, h in old.items():
            signal.signal(s, h)


def main(argv: list[str] | None = None) -> int:
    a, trainer_args = parse(sys.argv[1:] if argv is None else argv)
    try:
        require_supported()  # before any rank starts: one line, not a traceback per rank
        if not a.script:
            # The trainer's own flags, here too: every rank refused a usage error (exit
            # 2), torchrun spent --max-restarts on it and then printed a traceback per
            # failure (a review: the error 4 times, then 5 tracebacks). What needs the
            # world (the batch per rank) is still the ranks' to check.
            parse_config(trainer_args, launcher_env=False)
    except (UnsupportedTorch, ConfigError) as err:
        print(f"clusterpulse-train: error: {err}", file=sys.stderr)
        return 2
    a.nproc = ranks_per_node(a)  # once: torch's GPU count is not asked twice
    # the rendezvous' poll, the thread count and the lost round's wait are the job's
    # unless the environment names them
    env = {**rendezvous_poll_env(a), **threads_env(a.nproc), **lost_round_env(a),
           **os.environ, **leave_env(a),
           JOB_ID_ENV: job_id(a)}
    return run(command(a, trainer_args), env, longest_leave_s(a), Standby.of(a),
               Rendezvous.of(a), a.prewarm_after)


if __name__ == "__main__":
    raise SystemExit(main())
