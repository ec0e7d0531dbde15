"""A real gloo process group of one in the test process: the instrumentation's
distributed paths (hooks, wrapped collectives, sync probes) without a second rank."""

from __future__ import annotations

import contextlib
import tempfile
from collections.abc import Iterator
from pathlib import Path

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
