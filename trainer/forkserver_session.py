"""Imported first by the warm-start forkserver (trainer/warmstart.py, SESSION): puts
the server, and so every rank forked from it, in a session of its own.

torchrun starts ranks as new interpreters each in a session of its own, so a signal
to the launcher's process group (Ctrl-C in a terminal, `kill -- -PGID`, a stack's
stop) reaches the launcher and torchrun only, and torchrun passes SIGTERM on to the
ranks once: they checkpoint and exit 143. The forkserver would otherwise sit in the
launcher's group and die of that SIGTERM, and its ranks, whose parent-death signal
torch sets to SIGINT, would stop at once, without their checkpoint.

Only the forkserver imports this module: importing it anywhere else would move that
process out of its session too.
"""

from __future__ import annotations

import contextlib
import os

with contextlib.suppress(OSError):  # already a session or group leader: nothing to do
    os.setsid()
