"""torchrun whose ranks start warm: forked from a server that has already imported
torch and the trainer.

Every restart (a crashed or killed rank, a node lost from an elastic job, a node
coming back) starts all ranks of the job again, and each new interpreter first paid
for its imports: torch, torch.distributed and DCP take ~3.5 s of CPU per rank, the
largest part of a crash restart on the testbed (4 ranks on 2 cores: 10.1 s from the
crash to the first resumed step, 4.4 s started warm). torchrun can start ranks through
multiprocessing instead of as new interpreters (`--run-path` with `--start-method
forkserver`); this module is torchrun with the forkserver told to import the trainer
once, as torchrun starts (in parallel with its rendezvous), so that each rank it
starts later, the first ones and those of every restart, is a fork of a process that
has the imports done.

Forking is safe here because nothing the server imports touches CUDA at import time
(the ranks initialise CUDA after the fork, on their own device), and the threads a
library may start at import (an OpenBLAS pool) are not carried into a fork. What the
server read from its environment at import, such as OpenMP's thread count, predates
torchrun's per-rank settings: the trainer applies OMP_NUM_THREADS itself at start.
A rank started this way carries the server's command line, not the trainer's:
`deploy.local.stack.rank_pids` finds ranks by their place in the process tree.

    python -m clusterpulse.trainer.warmstart <torchrun options> --run-path \\
        --start-method forkserver .../clusterpulse/trainer/__main__.py <trainer options>

(`clusterpulse-train` builds that command; `--cold-start` there is plain torchrun.)
"""

from __future__ import annotations

import importlib.util
import multiprocessing
import os
import sys
from multiprocessing import forkserver

# The session first (trainer/forkserver_session.py), then what every rank imports.
PRELOAD = ["clusterpulse.trainer.forkserver_session", "clusterpulse.trainer.main"]


def main() -> None:
    # The forkserver ignores a preload that fails to import (its ranks would then import
    # on their own, cold, and silently so): make a missing module an error here.
    missing = [m for m in PRELOAD if importlib.util.find_spec(m) is None]
    if missing:
        sys.exit(f"warmstart: cannot import {', '.join(missing)}")
    # Ranks print progress lines that monitors read as they come (torchrun starts new
    # interpreters with `python -u`); the server's environment is theirs.
    os.environ.setdefault("PYTHONUNBUFFERED", "1")
    multiprocessing.set_forkserver_preload(PRELOAD)
    forkserver.ensure_running()  # starts importing now, while torchrun meets its peers
    from torch.distributed.run import main as torchrun

    torchrun()


if __name__ == "__main__":
    main()
