"""How a rank leaves for a restart: relaunch requests, SIGTERM, exit codes.

Graceful restarts must not consume torchrun's failure budget (`--max-restarts`):
torchrun counts any non-zero exit as a failure. So under `clusterpulse-train` a
rank that leaves for a graceful restart writes the launcher's relaunch file (path in
`$CLUSTERPULSE_RELAUNCH_FILE`, one per node) and exits 0; torchrun sees a finished
job and the launcher starts it again (a new rendezvous, a fresh store), leaving
`--max-restarts` whole for real failures. Under a plain torchrun (no such variable)
the rank exits with RESTART_EXIT_CODE (42) and torchrun restarts it as a failure.

SIGTERM (Slurm `--signal=TERM@N`, Kubernetes preemption, torchrun stopping its
workers) is caught and becomes a request: at the next consensus step every rank
checkpoints and exits with PREEMPTED_EXIT_CODE (143, i.e. "terminated") so that a
requeued job resumes there. A second SIGTERM exits at once.
"""

from __future__ import annotations

import logging
import os
import signal
import threading
from collections.abc import Callable
from pathlib import Path

from clusterpulse.trainer import RESTART_EXIT_CODE

log = logging.getLogger("clusterpulse.trainer.restart")

RELAUNCH_FILE_ENV = "CLUSTERPULSE_RELAUNCH_FILE"


class SigtermCatcher:
    """Turns the first SIGTERM into a flag read at the step boundary."""

    def __init__(self) -> None:
        self.received = False
        self._previous: object = None
        self.installed = False
        # Run at the first SIGTERM, inside the handler: a rank blocked in a collective
        # with a hung peer never reaches the step boundary and is SIGKILLed after the
        # grace period, so what must survive (how far the run got) is written here.
        self.on_first: Callable[[], None] | None = None

    def install(self) -> None:
        if self.installed or threading.current_thread() is not threading.main_thread():
            return  # signal handlers can only be set from the main thread
        self._previous = signal.signal(signal.SIGTERM, self._handle)
        self.installed = True

    def uninstall(self) -> None:
        if self.installed:
            signal.signal(signal.SIGTERM, self._previous or signal.SIG_DFL)
            self.installed = False

    def _handle(self, signum: int, frame: object) -> None:
        if self.received:  # asked twice: no more waiting for a step boundary
            raise SystemExit(128 + signum)
        self.received = True
        if self.on_first is not None:
            try:
                self.on_first()
            except Exception as err:  # never let bookkeeping turn SIGTERM into a crash
                log.warning("on SIGTERM: %s", err)


def request_relaunch() -> int:
    """Arrange a graceful restart; returns the exit code the rank must leave with."""
    path = os.environ.get(RELAUNCH_FILE_ENV)
    if not path:
        return RESTART_EXIT_CODE
    tmp = Path(path + f".{os.getpid()}")
    tmp.write_text("checkpoint-restart\n")
    os.replace(tmp, path)  # every rank of the node may write it: same content, atomic
    return 0
