"""How a rank leaves for a restart: relaunch requests, SIGTERM, exit codes.

Graceful restarts must not consume torchrun's failure budget (`--max-restarts`):
torchrun counts any non-zero exit as a failure. So under `clusterpulse-train` a
rank that leaves for a graceful restart writes the launcher's relaunch file (path in
`$CLUSTERPULSE_RELAUNCH_FILE`, one per node) and exits 0; torchrun sees a finished
job and the launcher starts it again (a new rendezvous, a fresh store), leaving
`--max-restarts` whole for real failures. Under a plain torchrun (no such variable)
the rank exits with RESTART_EXIT_CODE (42) and torchrun restarts it as a failure.

A graceful restart can also take this node out of the job for a while (the remediation
action `evict-node`: a node whose link or GPU slows every rank): the command carries
`leave_s`, and the node's ranks also write `<relaunch file>.leave` with the seconds;
the launcher then waits that long before it starts torchrun again, while the other
nodes' launchers go on at once with one node fewer (an elastic job), and the node
rejoins at the end. The leave file is separate from the relaunch file because the
ranks of the nodes that were not asked (they agreed to restart because a peer did)
write the relaunch file too. Whether the node may leave at all is decided when the
command arrives, before anything restarts (`leave_refusal`): the launcher tells its
ranks what it knows (CANNOT_LEAVE_ENV, MIN_NODES_ENV), torchrun how many nodes the
job has now (GROUP_WORLD_SIZE). Nodes asked at the same time (two congested links,
`clusterpulse-ctl evict` of two nodes) are settled when the ranks agree on the
restart (`nodes_that_leave`): as many leave as the job can lose.

SIGTERM (Slurm `--signal=TERM@N`, Kubernetes preemption, torchrun stopping its
workers) is caught and becomes a request: at the next consensus step every rank
checkpoints and exits with PREEMPTED_EXIT_CODE (143, i.e. "terminated") so that a
requeued job resumes there. A second SIGTERM that arrives SIGTERM_REPEAT_S after the
first exits at once (copies of one arrive together). A rank that SIGTERM finds
blocked in a collective (a peer cut off) leaves without the checkpoint once it has been
stuck past the steady hang threshold (instrument.Pulse.stuck_after_sigterm).

A rank that agreed to leave for a *peer's* SIGTERM waits a little for its own
(`SigtermCatcher.wait`) before it exits. When a node (re)joins an elastic job, every node's
torchrun agent restarts its workers with SIGTERM, each when its own monitor loop
notices the waiting node; a rank that exited 143 before its agent noticed was a
failed worker to that agent: one of `--max-restarts` spent on every rejoin, and with
`--max-restarts 0` the job ended on that node. Under Slurm or Kubernetes every rank
gets the signal anyway, within milliseconds.
"""

from __future__ import annotations

import contextlib
import logging
import os
import signal
import socket
import threading
import time
from collections.abc import Callable
from pathlib import Path

from clusterpulse.agent.protocol import LEAVE_REFUSALS
from clusterpulse.agent.validate import is_digits
from clusterpulse.trainer import RESTART_EXIT_CODE

log = logging.getLogger("clusterpulse.trainer.restart")

RELAUNCH_FILE_ENV = "CLUSTERPULSE_RELAUNCH_FILE"
CANNOT_LEAVE_ENV = "CLUSTERPULSE_CANNOT_LEAVE"  # a LEAVE_REFUSALS key, from the launcher
MIN_NODES_ENV = "CLUSTERPULSE_MIN_NODES"  # the launcher's --nnodes minimum
# Set by the launcher for the ranks, read by trainer/parallel.py. Here, not there: the
# launcher is a supervisor that needs torch only where torch must answer (the GPU count
# without --nproc, a multi-node rendezvous endpoint), and importing parallel.py imported
# it in every clusterpulse-train (1.3 s of CPU, ~300 MB).
# A fresh store each rendezvous round (pytorch#135712; parallel's check says why).
SHARE_STORE_ENV = "TORCH_DISABLE_SHARE_RDZV_TCP_STORE"
# Seconds a rank whose round ended while it joined the process group waits for its
# torchrun to stop it (trainer/parallel.py, `lost_round_wait_s`; 0: fail at once)
LOST_ROUND_WAIT_ENV = "CLUSTERPULSE_LOST_ROUND_WAIT_S"
LOST_ROUND_WAIT_S = 15.0  # unless LOST_ROUND_WAIT_ENV says
# attempts before this torchrun: its graceful relaunches and earlier torchruns' failure
# restarts (clusterpulse-train)
ATTEMPTS_BEFORE_ENV = "CLUSTERPULSE_ATTEMPTS_BEFORE"


# Copies of one SIGTERM arrive within milliseconds: a scheduler signals every process
# of the job (Slurm's cgroup kill, systemd's KillMode=control-group, a pod's deletion)
# and torchrun passes its own copy on to the ranks, twice when a copy of its own
# interrupts its shutdown. Taken for an operator's second "stop now", they made every
# rank leave without the preemption's checkpoint. A SIGTERM this long after the first
# is that second request.
SIGTERM_REPEAT_S = 5.0
# The wake-up thread sees the first SIGTERM too, up to a GIL switch (5 ms) after the
# handler ran: within this of the first, it is the first's.
SIGTERM_ECHO_S = 0.02


class SigtermCatcher:
    """Turns the first SIGTERM into a flag read at the step boundary.

    Python runs a signal's handler in the main thread between bytecodes: a rank blocked
    in a collective (a peer cut off the network) does not run it until the collective
    returns. `arrived_at` is set at once all the same, by a thread woken through
    Python's signal wake-up descriptor (written from the C-level handler), so that the
    rank's heartbeat thread can tell a SIGTERM waiting on a stuck collective
    (Pulse.stuck_after_sigterm). Only while this catcher's handler is the one installed
    (a catcher replaced by a newer one, never uninstalled, ignores what it hears); a
    forked child gets no wake-up descriptor (its signals are its own)."""

    def __init__(self) -> None:
        self.received = False
        self.arrived_at: float | None = None  # monotonic, from the wake-up thread
        self.last_arrival = 0.0  # monotonic: the latest SIGTERM the wake-up thread saw
        self._taken = 0.0  # the latest of those the handler has judged
        self._previous: object = None
        self._previous_wakeup = -1
        self._wakeup_write = -1
        self.installed = False
        # Run at the first SIGTERM, inside the handler, or from the heartbeat thread
        # before a stuck rank leaves (so not always on the main thread): a rank blocked
        # in a collective with a hung peer never reaches the step boundary, so what
        # must survive (how far the run got) is written here.
        self.on_first: Callable[[], None] | None = None
        self._first_lock = threading.Lock()
        self._first_ran = False

    def install(self) -> None:
        if self.installed or threading.current_thread() is not threading.main_thread():
            return  # signal handlers can only be set from the main thread
        self._previous = signal.signal(signal.SIGTERM, self._handle)
        self.installed = True
        _reset_wakeup_in_forked_children()
        read, write = os.pipe()
        os.set_blocking(write, False)  # the C handler must never block on it
        try:
            previous = signal.set_wakeup_fd(write, warn_on_full_buffer=False)
            # a copy to forward to: the owner (an event loop) may close its own
            forward = os.dup(previous) if previous >= 0 else -1
        except (ValueError, OSError) as err:  # SIGTERM still works; only stuck ranks wait
            log.warning("no signal wake-up descriptor: %s", err)
            os.close(read)
            os.close(write)
            return
        self._previous_wakeup, self._wakeup_write = previous, write
        threading.Thread(target=self._watch, args=(read, forward),
                         name="sigterm-watch", daemon=True).start()

    def uninstall(self) -> None:
        if self.installed:
            signal.signal(signal.SIGTERM, self._previous or signal.SIG_DFL)
            self.installed = False
        if self._wakeup_write < 0:
            return
        try:
            current = signal.set_wakeup_fd(-1)
        except ValueError:  # not the main thread: left in place
            return
        if current == self._wakeup_write:
            with contextlib.suppress(ValueError, OSError):  # the previous one is gone
                signal.set_wakeup_fd(self._previous_wakeup, warn_on_full_buffer=False)
        else:  # set by someone after this catcher: theirs stays
            with contextlib.suppress(ValueError, OSError):
                signal.set_wakeup_fd(current)
        os.close(self._wakeup_write)  # the watcher reads the end and stops
        self._wakeup_write = -1

    def is_current(self) -> bool:
        """Whether SIGTERM is handled by this catcher now."""
        return self.installed and signal.getsignal(signal.SIGTERM) == self._handle

    def _watch(self, read: int, forward: int) -> None:
        """Note SIGTERM's arrival; pass every signal number on to (a copy of) the
        descriptor that was there before (an event loop's), which would miss them."""
        with contextlib.suppress(OSError):
            while data := os.read(read, 64):
                if forward >= 0:
                    with contextlib.suppress(OSError):
                        os.write(forward, data)
                if signal.SIGTERM in data and self.is_current():
                    now = time.monotonic()
                    if self.arrived_at is None:
                        self.arrived_at = now
                    elif now - self.arrived_at > SIGTERM_ECHO_S:  # not the first's own
                        self.last_arrival = now
        os.close(read)
        if forward >= 0:
            os.close(forward)

    def run_on_first(self, wait_s: float = 5.0) -> None:
        """`on_first`, once, whichever comes first: the handler, or a stuck rank
        giving up from another thread (which waits, at most `wait_s`, for one the
        handler is running to finish)."""
        if not self._first_lock.acquire(timeout=wait_s):
            return
        try:
            if self._first_ran or self.on_first is None:
                return
            self._first_ran = True
            self.on_first()
        except Exception as err:  # never let bookkeeping turn SIGTERM into a crash
            log.warning("on SIGTERM: %s", err)
        finally:
            self._first_lock.release()

    def wait(self, timeout_s: float) -> bool:
        """Wait up to `timeout_s` for the SIGTERM; True if it came. Only where the
        catcher is installed (main thread): elsewhere nothing would see it arrive."""
        deadline = time.monotonic() + timeout_s
        while self.installed and not self.received and time.monotonic() < deadline:
            time.sleep(0.05)  # a signal ends the sleep; the handler runs between them
        return self.received

    def _handle(self, signum: int, frame: object) -> None:
        # When the signal arrived, not when Python runs this (between bytecodes: a rank
        # in a long native call runs it seconds later, and a copy that came 50 ms after
        # the first was taken for a second request): the wake-up thread stamps each
        # arrival after the first; one it has not stamped yet is now.
        now = time.monotonic()
        if self.received:
            stamp = self.last_arrival if self.last_arrival > self._taken else 0.0
            self._taken = max(self._taken, stamp)
            arrival = stamp or now
            first = self.arrived_at if self.arrived_at is not None else arrival
            if arrival - first >= SIGTERM_REPEAT_S:
                raise SystemExit(128 + signum)  # asked again: no more waiting
            return  # a copy of the first (see SIGTERM_REPEAT_S)
        self.received = True
        if self.arrived_at is None:
            self.arrived_at = now
        self._taken = self.last_arrival  # stamped so far: this request's copies
        self.run_on_first()


PEER_SIGTERM_WAIT_S = 10.0  # torchrun notices a waiting node within --monitor-interval
# How long after SIGTERM a rank may stay in one phase of a step (not a checkpoint, not
# its start) before it leaves without reaching the step boundary: 10 usual steps' time,
# at least the alert rules' config_hang_floor_seconds, as their steady hang threshold is
# for steps up to 1.1 s (longer steps are paged sooner there, within 3x their p99).
STUCK_AFTER_SIGTERM_FLOOR_S = 5.0
STUCK_AFTER_SIGTERM_STEPS = 10


_fork_hook: list[bool] = []


def _reset_wakeup_in_forked_children() -> None:
    """A forked child (a data loader's worker) inherits the wake-up descriptor: its own
    SIGTERM would reach the parent's watcher as the parent's."""
    if not _fork_hook:
        _fork_hook.append(True)
        os.register_at_fork(after_in_child=_no_wakeup)


def _no_wakeup() -> None:
    with contextlib.suppress(ValueError, OSError):
        signal.set_wakeup_fd(-1)


def leave_refusal(over_unix_socket: bool) -> str | None:
    """Why this rank's node cannot sit a restart out (a LEAVE_REFUSALS key), or None.
    A command over UDP is never trusted that far: anyone who can send a datagram from
    the agent's address could park the node."""
    if not over_unix_socket:
        return "udp"
    if not os.environ.get(RELAUNCH_FILE_ENV):
        return "no_launcher"
    if os.environ.get(CANNOT_LEAVE_ENV) in LEAVE_REFUSALS:
        return os.environ[CANNOT_LEAVE_ENV]
    nodes = int(os.environ.get("GROUP_WORLD_SIZE", 1) or 1)  # torchrun: nodes this round
    minimum = min_nodes()
    if minimum is None or nodes - 1 < minimum:
        return "min_nodes"
    return None


def nodes_that_leave(wanted: dict[int, float], minimum: int | None) -> dict[int, float]:
    """Of the nodes whose ranks accepted a leave for the same restart (node rank ->
    seconds), those that go, given the job's minimum node count (None: unknown, none
    goes). Each node accepted its own alone (`leave_refusal`: the job can lose one
    node), but two at once could take it below its minimum, where the others wait the
    whole sit-out for them. The lowest node ranks go: the rendezvous's numbering, the
    same on every rank, so every rank gets the same answer from the same gathered
    facts (which node stays is otherwise arbitrary)."""
    nodes = int(os.environ.get("GROUP_WORLD_SIZE", 1) or 1)  # torchrun: nodes this round
    room = 0 if minimum is None else max(0, nodes - minimum)
    return dict(sorted(wanted.items())[:room])


def min_nodes() -> int | None:
    """The job's minimum node count, where the launcher said it (not on a node that may
    never leave: the rendezvous host, a single node)."""
    value = os.environ.get(MIN_NODES_ENV, "")
    return int(value) if is_digits(value) else None


def request_relaunch(leave_s: float = 0.0, attempt: int | None = None) -> int:
    """Arrange a graceful restart (this node sitting out `leave_s` seconds first, which
    `leave_refusal` allowed); returns the exit code the rank must leave with.
    `attempt`: the attempt number the ranks agreed on and now leave (the launcher
    numbers the next one after it, `next_attempt_base`)."""
    path = os.environ.get(RELAUNCH_FILE_ENV)
    if not path:
        return RESTART_EXIT_CODE
    if leave_s > 0:
        write_atomically(Path(leave_path(path)), f"{leave_s:g}\n")
    # every rank of the node may write it: same content (the agreed attempt, and this
    # node's torchrun's failure restarts: the launcher's budget, `failures_spent`), atomic
    left = "" if attempt is None else f" {attempt}"
    spent = os.environ.get("TORCHELASTIC_RESTART_COUNT", "")
    spent = f" {spent}" if left and spent.isdigit() else ""
    write_atomically(Path(path), f"checkpoint-restart{left}{spent}\n")
    return 0


def next_attempt_base(base: int, relaunch_file: str | Path) -> int:
    """The attempts before the torchrun a graceful relaunch starts: past the attempt
    its ranks left (`request_relaunch`), which counts the failure restarts of the
    torchrun that ends, and at least one past `base`. Counting graceful relaunches
    alone numbered a relaunch after a failure restart the same as the attempt before
    it (1 + 0 = 0 + 1): the agent never saw the ranks resume, and a graceful restart
    after a crash never completed."""
    try:
        words = Path(relaunch_file).read_text().split()
        left = int(words[1]) if len(words) > 1 else -1
    except (OSError, ValueError):
        left = -1  # an older rank's request, or none readable: count this relaunch
    return max(base + 1, left + 1)


def failures_spent(relaunch_file: str | Path) -> int:
    """The failure restarts the torchrun whose ranks wrote `relaunch_file` made
    (torchrun's TORCHELASTIC_RESTART_COUNT: failures only, not a node joining); 0 where
    an older rank's request does not say."""
    try:
        words = Path(relaunch_file).read_text().split()
        return int(words[2]) if len(words) > 2 else 0
    except (OSError, ValueError):
        return 0


def clear_relaunch_request() -> None:
    """At a rank's start (local rank 0): a request an earlier attempt of this torchrun
    wrote before it failed (a peer died after the agreement) must not make this
    attempt's end relaunch, or sit out, by mistake. Requests are only written after
    every rank of an attempt has started, at an agreement."""
    path = os.environ.get(RELAUNCH_FILE_ENV)
    if path:
        for p in (Path(path), Path(leave_path(path))):
            p.unlink(missing_ok=True)


def leave_path(relaunch_file: str | Path) -> str:
    return f"{relaunch_file}.leave"


def relaunch_count_path(relaunch_file: str | Path) -> str:
    """Where clusterpulse-train writes how many attempts came before the torchrun it
    starts (a file: a torchrun started ahead of its turn has an older environment
    than the count)."""
    return f"{relaunch_file}.count"


def write_atomically(path: Path, text: str) -> None:
    """Write `text` whole or not at all: the launcher reads these files while ranks
    (or torchrun) may be writing them, and a checkpoint directory's claim is read and
    written from several nodes (the temporary name holds the host as well as the pid,
    and is removed when the write fails)."""
    tmp = path.with_name(f".{path.name}.{socket.gethostname()}.{os.getpid()}")
    try:
        tmp.write_text(text)
        os.replace(tmp, path)
    except OSError:
        with contextlib.suppress(OSError):
            tmp.unlink()
        raise
