"""Imported first by the warm-start forkserver (trainer/warmstart/, SESSION): puts
the server, and so every rank forked from it, in a session of its own.

torchrun starts ranks as new interpreters each in a session of its own, so a signal
to the launcher's process group (Ctrl-C in a terminal, `kill -- -PGID`, a stack's
stop) reaches the launcher and torchrun only, and torchrun passes SIGTERM on to the
ranks once: they checkpoint and exit 143. The forkserver would otherwise sit in the
launcher's group and die of that SIGTERM, and its ranks, whose parent-death signal
torch sets to SIGINT, would stop at once, without their checkpoint. For the same
reason it ignores SIGTERM sent to it alone (below).

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
import signal
import sys

from clusterpulse.trainer.warmstart import PRELOAD_PATH_ENV

with contextlib.suppress(OSError):  # already a session or group leader: nothing to do
    os.setsid()

# A scheduler signals every process of the job, whatever its session (Slurm's cgroup
# kill, systemd's KillMode=control-group, a pod's deletion): the server died of that
# SIGTERM too, and took its ranks down before their checkpoint. It ignores SIGTERM (it
# ends when torchrun does: multiprocessing closes its pipe), and each rank forked from
# it gets SIGTERM's default back at once, until its Pulse catches it.
signal.signal(signal.SIGTERM, signal.SIG_IGN)
os.register_at_fork(after_in_child=lambda: signal.signal(signal.SIGTERM, signal.SIG_DFL))

with contextlib.suppress(ValueError):  # a JSON list of directories (warmstart.main)
    _paths = json.loads(os.environ.get(PRELOAD_PATH_ENV, "[]"))
    if isinstance(_paths, list):  # after the libraries: see warmstart
        sys.path.extend(p for p in _paths if isinstance(p, str) and p)
