"""One logging setup for every ClusterPulse CLI: logfmt lines, quiet by default."""

from __future__ import annotations

import logging
import sys

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
