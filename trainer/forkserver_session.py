"""Imported first by the warm-start forkserver (trainer/warmstart/, SESSION): puts
the server, and so every rank forked from it, in a session of its own.

torchrun starts ranks as new interpreters each in a session of its own, so a signal
to the launcher's process group (Ctrl-C in a terminal, `kill -- -PGID`, a stack's
stop) reaches the launcher and torchrun only, and torchrun passes SIGTERM on to the
ranks once: they checkpoint and exit 143. The forkserver would otherwise sit in the
launcher's group and die of that SIGTERM, and its ranks, whose parent-death signal
torch sets to SIGINT, would stop at once, without their checkpoint.

Only the forkserver imports this module: importing it anywhere else would move that
process out of its session too.

It also adds the directories warmstart was given (a foreign script's own, so that a
module beside the script can be preloaded) to the server's sys.path: the
forkserver starts with Python's default path whatever multiprocessing passes it
(its `sys_path` argument is unused before Python 3.13).
"""

from __future__ import annotations

import contextlib
import json
import os
import sys

from clusterpulse.trainer.warmstart import PRELOAD_PATH_ENV

with contextlib.suppress(OSError):  # already a session or group leader: nothing to do
    os.setsid()

with contextlib.suppress(ValueError):  # a JSON list of directories (warmstart.main)
    _paths = json.loads(os.environ.get(PRELOAD_PATH_ENV, "[]"))
    if isinstance(_paths, list):  # after the libraries: see warmstart
        sys.path.extend(p for p in _paths if isinstance(p, str) and p)
