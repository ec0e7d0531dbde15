"""One logging setup for every ClusterPulse CLI: logfmt lines, quiet by default; and
`Throttle`, which bounds the lines that a flood of one kind of event may write."""

from __future__ import annotations

import logging
import sys
import threading
import time
from collections.abc import Callable

LEVELS = ("debug", "info", "warning", "error", "critical")
ALIASES = {"warn": "warning", "fatal": "critical"}  # the stdlib's own


def setup_logging(level: str = "warning", source: str = "--log-level") -> None:
    """Log at `level` (one of LEVELS or ALIASES, any case). Anything else logs at warning and
    says so, naming `source`: an environment variable is not checked by argparse, and
    `getattr(logging, ...)` took BASIC_FORMAT for a level and raised."""
    name = level.strip().lower()
    name = ALIASES.get(name, name)
    logging.basicConfig(
        level=getattr(logging, name.upper()) if name in LEVELS else logging.WARNING,
        stream=sys.stderr,
        format='ts=%(asctime)s level=%(levelname)s logger=%(name)s msg="%(message)s"',
        force=True,
    )
    if name not in LEVELS:
        logging.getLogger(__name__).warning("%s %r is not a log level (%s): warning",
                                            source, level, ", ".join(LEVELS))


def log_level(text: str) -> str:
    """argparse `type` for --log-level: a level name in any case, or an alias."""
    name = text.strip().lower()
    name = ALIASES.get(name, name)
    if name not in LEVELS:
        raise ValueError(text)
    return name


class Throttle:
    """At most one line per key per `period_s`, each saying how many events it stands
    for. A key's first event is written at once (a single mistake is on record);
    those that follow within the period are only counted, and the next line carries
    them. A flood then costs one line a minute, not one per event (a client that kept
    failing its sign-in wrote 400 audit lines in 223 s). At most `max_keys` keys are
    remembered, whatever keys come."""

    def __init__(self, period_s: float = 60.0, max_keys: int = 10_000,
                 clock: Callable[[], float] = time.monotonic) -> None:
        self.period_s = period_s
        self.max_keys = max_keys
        self.clock = clock
        self._seen: dict[str, tuple[float, int]] = {}  # key -> (last line, since then)
        self._lock = threading.Lock()

    def due(self, key: str) -> int:
        """Count one event of `key`. When its line is due now: how many events the line
        stands for (those since the key's last line, this one included); else 0."""
        now = self.clock()
        with self._lock:
            last, count = self._seen.get(key, (None, 0))
            count += 1
            if last is not None and now - last < self.period_s:
                self._seen[key] = (last, count)
                return 0
            if key not in self._seen and len(self._seen) >= self.max_keys:
                self._seen = {k: v for k, v in self._seen.items()
                              if now - v[0] < self.period_s}
                if len(self._seen) >= self.max_keys:  # bounded whatever keys come
                    self._seen.pop(next(iter(self._seen)))
            self._seen[key] = (now, 0)
        return count
