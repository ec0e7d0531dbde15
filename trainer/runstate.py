"""Restart accounting that survives restarts: rank 0 keeps run-state.json beside the
checkpoints. From it the run summary reports restarts and their causes, steps
recomputed, time lost, and goodput over the whole run, not just the last attempt.
"""

from __future__ import annotations

import json
import os
import time
from dataclasses import asdict, dataclass, field
from pathlib import Path


@dataclass
class RunState:
    run: str = ""
    started_unix: float = 0.0
    last_step: int = 0  # furthest step completed by any attempt
    last_step_unix: float = 0.0
    productive_seconds: float = 0.0  # step time of steps completed for the first time
    checkpoint_blocking_seconds: float = 0.0
    pending_exit: str = ""  # "checkpoint-restart" when ranks left on purpose
    pending_command: str = ""
    attempts: int = 0  # attempts begun (reached the process group); the next one's number
    restarts: list[dict] = field(default_factory=list)
    load_failures: list[dict] = field(default_factory=list)  # checkpoints that did not load

    @classmethod
    def load(cls, path: Path) -> RunState:
        try:
            data = json.loads(path.read_text())
            return cls(**{k: v for k, v in data.items() if k in cls.__dataclass_fields__})
        except (OSError, ValueError, TypeError):
            return cls()

    def save(self, path: Path) -> None:
        tmp = path.with_suffix(".tmp")
        tmp.write_text(json.dumps(asdict(self), indent=1))
        os.replace(tmp, path)

    def next_attempt(self, run: str) -> int:
        """Rank 0's proposal for the attempt number (all ranks adopt rank 0's)."""
        return self.attempts if self.started_unix and self.run == run else 0

    def begin_attempt(self, run: str, attempt: int, resume_step: int) -> None:
        """Record how the previous attempt ended, as seen from the new one."""
        now = time.time()
        if not self.started_unix or self.run != run:
            self.__init__(run=run, started_unix=now)  # a new run in this directory
        self.attempts = max(self.attempts, attempt + 1)
        if attempt > 0:
            cause = self.pending_exit or "failure"
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
