"""A user's training script in a warm rank (trainer/warmstart/), run the way
`python SCRIPT ARGS...` runs it, where torchrun's own `--run-path` differs:

- the script's directory comes first on `sys.path`, so that its sibling modules import
  (the PyTorch examples import their `datautils.py`); `--run-path` keeps the server's;
- when it ends, its non-daemon threads are joined and then its atexit handlers run, as
  at an interpreter's exit: a rank forked from the server leaves with `os._exit`,
  which skips both, and loggers and experiment trackers flush there;
- torch computes with torchrun's OMP_NUM_THREADS, not the server's thread count
  (other libraries the server imported, numpy's BLAS, keep the server's);
- multiprocessing starts processes the platform's way (fork on Linux before Python
  3.14), not the server's forkserver: a DataLoader's workers failed to start through
  it ("too many fds").

    torchrun --run-path --start-method forkserver .../scriptrun.py SCRIPT ARGS...

(`clusterpulse-train --script SCRIPT --preload MODULE` builds that command.)
"""

from __future__ import annotations

import atexit
import multiprocessing
import os
import runpy
import sys
import threading

from clusterpulse.trainer.warmstart import take_torchrun_thread_count


def main() -> None:
    if len(sys.argv) < 2:
        sys.exit("usage: scriptrun.py SCRIPT [ARGS...]")
    script = sys.argv[1]
    sys.argv = sys.argv[1:]
    sys.path.insert(0, os.path.dirname(os.path.realpath(script)))  # as python does
    take_torchrun_thread_count()
    multiprocessing.set_start_method(None, force=True)  # the platform's default again
    try:
        runpy.run_path(script, run_name="__main__")
    finally:
        for thread in threading.enumerate():
            if thread is not threading.current_thread() and not thread.daemon:
                thread.join()
        atexit._run_exitfuncs()


if __name__ == "__main__":
    main()
