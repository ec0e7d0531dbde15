"""One logging setup for every ClusterPulse CLI: logfmt lines, quiet by default."""

from __future__ import annotations

import logging
import sys

LEVELS = ("debug", "info", "warning", "error", "critical")


def setup_logging(level: str = "warning", source: str = "--log-level") -> None:
    """Log at `level` (one of LEVELS, any case). Anything else logs at warning and
    says so, naming `source`: an environment variable is not checked by argparse, and
    `getattr(logging, ...)` took BASIC_FORMAT for a level and raised."""
    name = level.strip().lower()
    logging.basicConfig(
        level=getattr(logging, name.upper()) if name in LEVELS else logging.WARNING,
        stream=sys.stderr,
        format='ts=%(asctime)s level=%(levelname)s logger=%(name)s msg="%(message)s"',
        force=True,
    )
    if name not in LEVELS:
        logging.getLogger(__name__).warning("%s %r is not a log level (%s): warning",
                                            source, level, ", ".join(LEVELS))
