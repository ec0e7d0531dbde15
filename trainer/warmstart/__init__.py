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
The command runs this package's `__main__`, not a module: see warmstart/__main__.py.

A foreign script (`clusterpulse-train --script S --preload torch ...`) starts warm the
same way, through trainer/scriptrun.py, with the server importing the modules named by
`--preload=MODULE` options given before torchrun's own; without any, the server
imports the reference trainer. The script's directory is on the server's sys.path
too (`--preload-path=DIR`, which the launcher adds; after the libraries), so a module
beside the script can be preloaded.
"""

from __future__ import annotations

import importlib.util
import json
import multiprocessing
import os
import sys
from multiprocessing import forkserver

from clusterpulse.agent.validate import is_digits
from clusterpulse.trainer.torchrun import held_until_its_turn, take_hold
from clusterpulse.trainer.torchrun import prepare as prepare_torchrun

SESSION = "clusterpulse.trainer.forkserver_session"  # first: see that module
TRAINER = "clusterpulse.trainer.main"  # what the reference trainer's ranks import
PRELOAD_OPTION = "--preload="
PRELOAD_PATH_OPTION = "--preload-path="
PRELOAD_PATH_ENV = "CLUSTERPULSE_PRELOAD_PATH"  # read by the server's SESSION module


def take_torchrun_thread_count() -> None:
    """Apply torchrun's OMP_NUM_THREADS to this rank. A rank forked warm has torch's
    intra-op thread count from its server's start, before torchrun set the variable
    for its ranks (on 2 cores, 2 ranks would each compute with 2 threads)."""
    threads = os.environ.get("OMP_NUM_THREADS", "")
    if is_digits(threads) and int(threads) > 0 and "torch" in sys.modules:
        sys.modules["torch"].set_num_threads(int(threads))


def preload(argv: list[str]) -> tuple[list[str], list[str], list[str]]:
    """(modules the server imports, directories it may import them from, torchrun's
    arguments): leading `--preload=MODULE` options name the modules (without any, the
    reference trainer), `--preload-path=DIR` the directories."""
    ours = (PRELOAD_OPTION, PRELOAD_PATH_OPTION)
    n = next((i for i, arg in enumerate(argv) if not arg.startswith(ours)), len(argv))
    extra = [arg.removeprefix(PRELOAD_OPTION) for arg in argv[:n]
             if arg.startswith(PRELOAD_OPTION)]
    paths = [arg.removeprefix(PRELOAD_PATH_OPTION) for arg in argv[:n]
             if arg.startswith(PRELOAD_PATH_OPTION)]
    return [SESSION, *(extra or [TRAINER])], paths, argv[n:]


def main() -> None:
    hold = take_hold()  # before the forkserver starts: it must not inherit it
    modules, paths, sys.argv[1:] = preload(sys.argv[1:])
    # The forkserver ignores the sys.path it is given (Python < 3.13): its session
    # module adds these on its own. Here, for the check below. Appended, not first as
    # `python S` has it: the server only needs to find a sibling module, and a file
    # beside the script named like a library module must not replace it in torch's
    # imports (the rank's scriptrun still puts the directory first for the script).
    sys.path.extend(paths)
    # JSON, not os.pathsep-joined: a directory may have ":" in its name. Always set:
    # never an outer job's.
    os.environ[PRELOAD_PATH_ENV] = json.dumps(paths)
    # The forkserver ignores a preload that fails to import (its ranks would then import
    # on their own, cold, and silently so): make a missing module an error here.
    missing = [m for m in modules if not _importable(m)]
    if missing:
        sys.exit(f"warmstart: cannot import {', '.join(missing)}")
    # Ranks print progress lines that monitors read as they come (torchrun starts new
    # interpreters with `python -u`); the server's environment is theirs.
    os.environ.setdefault("PYTHONUNBUFFERED", "1")
    multiprocessing.set_forkserver_preload(modules)
    forkserver.ensure_running()  # starts importing now, while torchrun meets its peers
    prepare_torchrun()  # the quicker restart's changes, and the spares' (trainer/torchrun.py)
    from torch.distributed.run import main as torchrun

    if held_until_its_turn(hold):  # started ahead of its turn: imports and server ready
        torchrun()


def _importable(module: str) -> bool:
    try:
        return importlib.util.find_spec(module) is not None
    except (ImportError, ValueError):  # a parent package that is not there, a bad name
        return False
