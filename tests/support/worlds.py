"""A real gloo process group of one in the test process: the instrumentation's
distributed paths (hooks, wrapped collectives, sync probes) without a second rank,
and a peer that is late to DDP's all-reduce without one."""

from __future__ import annotations

import contextlib
import tempfile
import time
from collections.abc import Callable, Iterator
from pathlib import Path

import torch
import torch.distributed as dist


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
