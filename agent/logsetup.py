"""One logging setup for every ClusterPulse CLI: logfmt lines, quiet by default."""

from __future__ import annotations

import logging
import sys


def setup_logging(level: str = "warning") -> None:
    logging.basicConfig(
        level=getattr(logging, level.upper(), logging.WARNING),
        stream=sys.stderr,
        format='ts=%(asctime)s level=%(levelname)s logger=%(name)s msg="%(message)s"',
        force=True,
    )
