"""A real gloo process group of one in the test process: the instrumentation's
distributed paths (hooks, wrapped collectives, sync probes) without a second rank,
and a peer that is late to DDP's all-reduce without one; and a world of several ranks,
each a process of its own, for what only exists with peers (the straggler scorer)."""

from __future__ import annotations

import contextlib
import os
import subprocess
import sys
import tempfile
import time
from collections.abc import Callable, Iterator
from pathlib import Path
from typing import Any

import torch
import torch.distributed as dist

from tests.support.procs import REPO


@contextlib.contextmanager
def gloo_world_of_one() -> Iterator[Path]:
    """The group for the block; yields a scratch directory that lives as long."""
    with tempfile.TemporaryDirectory() as tmp:
        dist.init_process_group("gloo", init_method=f"file://{tmp}/store", rank=0,
                                world_size=1)
        try:
            yield Path(tmp)
        finally:
            dist.destroy_process_group()


def late_peer(seconds: float) -> Callable[..., torch.futures.Future]:
    """A DDP comm hook (`ddp_model.register_comm_hook(None, late_peer(s))`) for a peer
    `seconds` late to each all-reduce: DDP waits for its future where it waits for its
    peers (its end-of-backward callback), and only in a backward that it reduces. The
    future completes in an engine callback the hook queues, which the engine runs once
    the rank's own work is done (after attach_ddp's callback, queued as backward began)
    and before DDP's (queued after the last bucket's hook): the rank waits exactly that
    long per bucket, however loaded the machine (a small model has one bucket)."""
    engine = torch.autograd.Variable._execution_engine

    def hook(_state, bucket):  # unannotated: DDP refuses a hook annotated otherwise
        # than with its own types, and postponed annotations are strings
        fut: torch.futures.Future = torch.futures.Future()

        def peer_arrives() -> None:
            time.sleep(seconds)
            fut.set_result(bucket.buffer())

        engine.queue_callback(peer_arrives)
        return fut

    return hook


class _LateRebuild:
    """DDP's reducer, but for its bucket rebuild (late_rebuild)."""

    def __init__(self, reducer: Any, seconds: float) -> None:
        self._reducer, self._seconds = reducer, seconds

    def _rebuild_buckets(self) -> bool:
        rebuilt = self._reducer._rebuild_buckets()
        if rebuilt:  # the broadcast of the new bucket order waits for the peer
            time.sleep(self._seconds)
        return rebuilt

    def __getattr__(self, name: str) -> Any:
        return getattr(self._reducer, name)


def late_rebuild(ddp_model: torch.nn.parallel.DistributedDataParallel,
                 seconds: float) -> None:
    """A peer `seconds` late to DDP's bucket rebuild (once: in the first forward with
    gradients after the first backward DDP reduced, after the second with
    static_graph; it broadcasts the bucket order, waiting for every peer): the rank
    waits that long inside DDP's pre-forward, in the forward where DDP rebuilds and in
    no other. DDP's Python calls its reducer through the model's
    `reducer` attribute, which this wraps; the C++ side keeps the reducer itself."""
    ddp_model.reducer = _LateRebuild(ddp_model.reducer, seconds)


def run_ranks(script: str, world: int, scratch: Path, *args: str,
              timeout: float = 300) -> None:
    """Runs `script` (Python source) as `world` ranks, each a process of its own
    (subprocesses, not multiprocessing's spawn: that re-runs the parent's __main__,
    which in a test worker may be another test's script). Each gets argv: rank, world,
    a file store for init_process_group in `scratch`, then `args`; the ranks start
    together (a process start costs seconds). Asserts that every rank exited 0.

    A script ends with os._exit(0) once its results are written, its process group
    not torn down: on torch 2.6 gloo's destructor, run with the GIL held, waits for a
    worker thread that needs the GIL to free the last collective's tensors; the scorer
    scripts' last all_gather is milliseconds before their end, and they hung there,
    destroyed at once or held until the interpreter's exit (a fresh machine's run)."""
    env = {**os.environ, "GLOO_SOCKET_IFNAME": "lo", "OMP_NUM_THREADS": "1",
           "PYTHONPATH": str(REPO)}
    ranks = [subprocess.Popen([sys.executable, "-c", script, str(r), str(world),
                               str(scratch / "store"), *args], env=env, cwd=REPO,
                              stderr=subprocess.PIPE, text=True) for r in range(world)]
    try:
        errors = [r.communicate(timeout=timeout)[1] for r in ranks]
    finally:
        for r in ranks:
            r.kill()
    assert [r.returncode for r in ranks] == [0] * world, errors
