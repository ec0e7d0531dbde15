"""Restart accounting that survives restarts: rank 0 keeps run-state.json beside the
checkpoints. From it the run summary reports restarts and their causes, steps
recomputed, time lost, and goodput over the whole run, not just the last attempt.

How far the run got must survive a SIGKILL of rank 0 (a hard restart of ranks blocked
behind a hung peer never returns to Python to save). Rewriting the JSON every step
costs a file, a write and a rename; under load that is milliseconds, so it used to be
done only when cheap and the recorded step lagged by up to a second of steps. Instead
a `ProgressMark` beside it is overwritten in place every step with one 32-byte pwrite
(microseconds), and `RunState.load` takes the furthest of the two.
"""

from __future__ import annotations

import json
import logging
import os
import struct
import time
from dataclasses import asdict, dataclass, field
from pathlib import Path

from clusterpulse.agent.validate import is_number

log = logging.getLogger(__name__)


@dataclass
class RunState:
    run: str = ""
    started_unix: float = 0.0
    last_step: int = 0  # furthest step completed by any attempt
    last_step_unix: float = 0.0
    productive_seconds: float = 0.0  # step time of steps completed for the first time
    checkpoint_blocking_seconds: float = 0.0
    pending_exit: str = ""  # "checkpoint-restart", "preempted": why the ranks left
    pending_command: str = ""
    attempts: int = 0  # attempts begun (reached the process group); the next one's number
    restarts: list[dict] = field(default_factory=list)
    load_failures: list[dict] = field(default_factory=list)  # checkpoints that did not load

    @classmethod
    def load(cls, path: Path) -> RunState:
        """What `path` holds; a field whose value has the wrong type (a damaged or
        hand-edited file) is left at its default with a warning naming it, the others
        kept: a bad field crashed rank 0 at start ('>' between str and int)."""
        try:
            data = json.loads(path.read_text())
        except (FileNotFoundError, NotADirectoryError):  # a new run
            return cls()
        except (OSError, ValueError, RecursionError) as err:
            log.warning("run state %s is unreadable (%s): its accounting starts afresh",
                        path, getattr(err, "strerror", None) or type(err).__name__)
            return cls()
        if not isinstance(data, dict):
            log.warning("run state %s is not a JSON object: its accounting starts afresh",
                        path)
            return cls()
        defaults = cls()
        kept = {k: v for k, v in data.items()
                if k in cls.__dataclass_fields__ and _fits(v, getattr(defaults, k))}
        bad = sorted(k for k in data if k in cls.__dataclass_fields__ and k not in kept)
        if "restarts" in kept and not all(map(_restart_fits, kept["restarts"])):
            kept["restarts"] = [r for r in kept["restarts"] if _restart_fits(r)]
            bad.append("restarts (some entries)")
        if bad:
            log.warning("run state %s: %s of the wrong type, left at the default", path,
                        ", ".join(bad))
        state = cls(**kept)
        mark = ProgressMark.read(progress_path(path))
        if mark is not None and mark.started_unix == state.started_unix:
            # each field on its own: an attempt re-running old steps moves the time of
            # its last step, not the furthest step
            state.last_step = max(state.last_step, mark.step)
            state.last_step_unix = max(state.last_step_unix, mark.step_unix)
            state.productive_seconds = max(state.productive_seconds, mark.productive_seconds)
        return state

    def save(self, path: Path) -> bool:
        """Write it (atomically); False when the disk refuses (full, read-only): the
        accounting is never a reason to stop training or to fail a finished run."""
        tmp = path.with_suffix(".tmp")
        try:
            tmp.write_text(json.dumps(asdict(self), indent=1))
            os.replace(tmp, path)
        except OSError as err:
            log.warning("cannot write the run state %s: %s", path, err.strerror or err)
            return False
        return True

    def next_attempt(self, run: str) -> int:
        """Rank 0's proposal for the attempt number (all ranks adopt rank 0's)."""
        return self.attempts if self.started_unix and self.run == run else 0

    def begin_attempt(self, run: str, attempt: int, resume_step: int,
                      membership_change: bool = False) -> None:
        """Record how the previous attempt ended, as seen from the new one: its ranks'
        own word (checkpoint-restart, preempted), a membership change (torchrun's SIGTERM
        for a joining node, which the ranks took for a preemption), or a failure."""
        now = time.time()
        if not self.started_unix or self.run != run:
            self.__init__(run=run, started_unix=now)  # a new run in this directory
        self.attempts = max(self.attempts, attempt + 1)
        if attempt > 0:
            # torchrun restarts a node's workers without counting a failure for a node
            # that joins, but also on a healthy node while another node's failure is
            # being restarted: a membership change only if the ranks left together for
            # a SIGTERM (they agreed on "preempted"); never over a failure or a command
            cause = self.pending_exit or "failure"
            if membership_change and cause == "preempted":
                cause = "membership"
            self.restarts.append({
                "attempt": attempt, "cause": cause, "command": self.pending_command,
                "resume_step": resume_step, "last_step_before": self.last_step,
                "steps_recomputed": max(0, self.last_step - resume_step),
                "fault_unix": self.last_step_unix, "restart_unix": now,
            })
        self.pending_exit = self.pending_command = ""

    def first_step_done(self, step_seconds: float) -> None:
        """Close the downtime of the latest restart: fault -> first resumed step."""
        if self.restarts and "downtime_seconds" not in self.restarts[-1]:
            r = self.restarts[-1]
            r["downtime_seconds"] = round(time.time() - r["fault_unix"], 3)
            r["first_step_seconds"] = round(step_seconds, 4)

    def goodput(self) -> float:
        wall = time.time() - self.started_unix
        return self.productive_seconds / wall if wall > 0 else 0.0

    def step_done(self, step: int, step_seconds: float) -> None:
        if step > self.last_step:
            self.productive_seconds += step_seconds
            self.last_step = step
        self.last_step_unix = time.time()


def _fits(value: object, default: object) -> bool:
    """Whether `value` has the type of the field whose default is `default`."""
    if isinstance(value, bool) or isinstance(default, bool):
        return type(value) is type(default)
    if isinstance(default, float):
        return is_number(value)
    if isinstance(default, list):
        return isinstance(value, list) and all(isinstance(x, dict) for x in value)
    return type(value) is type(default)


# What the summary and the resume record read of each restart (begin_attempt writes
# them), with a value of each one's type.
_RESTART_FIELDS = {"attempt": 0, "resume_step": 0, "steps_recomputed": 0,
                   "fault_unix": 0.0, "restart_unix": 0.0}


def _restart_fits(entry: dict) -> bool:
    return all(k in entry and _fits(entry[k], v) for k, v in _RESTART_FIELDS.items())


def progress_path(state_path: Path) -> Path:
    return state_path.with_suffix(".progress")


@dataclass(frozen=True)
class Progress:
    step: int
    step_unix: float
    productive_seconds: float
    started_unix: float  # which run it belongs to (the state's started_unix)


class ProgressMark:
    """The furthest step of a run, overwritten in place: one pwrite of a fixed record
    at offset 0, which a SIGKILL cannot leave half-written (the syscall completes or
    never starts). Not synced to disk: it guards against process death, not power loss."""

    RECORD = struct.Struct("<qddd")

    def __init__(self, path: Path) -> None:
        # A full disk or a failing mount loses the mark, not the run (it crashed rank 0
        # at its first step): the steps recomputed after a crash are then counted from
        # the last run-state save. Warned once.
        self.path, self._fd, self._warned = path, -1, False
        try:
            self._fd = os.open(path, os.O_RDWR | os.O_CREAT, 0o644)
        except OSError as err:
            self._warn(err)

    def write(self, state: RunState) -> None:
        if self._fd < 0:
            return
        try:
            os.pwrite(self._fd, self.RECORD.pack(state.last_step, state.last_step_unix,
                                                 state.productive_seconds,
                                                 state.started_unix), 0)
        except OSError as err:
            self._warn(err)

    def _warn(self, err: OSError) -> None:
        if not self._warned:
            self._warned = True
            log.warning("progress mark %s not kept (%s): steps lost to a crash are counted "
                        "from the last run-state save", self.path, err.strerror or err)

    def close(self) -> None:
        if self._fd >= 0:
            os.close(self._fd)
            self._fd = -1

    @classmethod
    def read(cls, path: Path) -> Progress | None:
        try:
            data = path.read_bytes()[:cls.RECORD.size]
        except OSError:
            return None
        if len(data) != cls.RECORD.size:
            return None
        return Progress(*cls.RECORD.unpack(data))
