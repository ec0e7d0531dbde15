"""FSDP2's all-gather and reduce-scatter, run as FSDP's defaults run them, each
handed to a timer with the bytes a rank moves in it.

FSDP2 (`fully_shard`, torch >= 2.8) lets a module replace its collectives
(`set_custom_all_gather` / `set_custom_reduce_scatter`); these subclass FSDP's default
ones, so allocation, streams and FSDP's own checks stay exactly as without them, and
only the call is wrapped; the bytes are `ring_bus_bytes` of the gathered output or
of the reduce-scatter's input.
"""

from __future__ import annotations

from collections.abc import Callable
from typing import Any

import torch
import torch.distributed as dist

from clusterpulse.trainer.collectives import ring_bus_bytes

# op name, bus bytes, the collective itself -> its result
Timer = Callable[[str, float, Callable[[], Any]], Any]


def _nbytes(t: torch.Tensor) -> float:
    return float(t.numel() * t.element_size())


def timed_fsdp_comms(timer: Timer) -> tuple[Any, Any] | None:
    """(all-gather, reduce-scatter) comms for `FSDPModule.set_custom_*`, or None where
    this torch has no such hook (FSDP then runs untimed, as before)."""
    try:
        from torch.distributed.fsdp import FSDPModule
        from torch.distributed.fsdp._fully_shard._fsdp_collectives import (
            DefaultAllGather,
            DefaultReduceScatter,
        )
    except ImportError:
        return None
    if not hasattr(FSDPModule, "set_custom_all_gather"):
        return None

    class TimedAllGather(DefaultAllGather):
        def __call__(self, output_tensor: torch.Tensor, input_tensor: torch.Tensor,
                     group: dist.ProcessGroup, async_op: bool = False) -> Any:
            run = super().__call__
            if async_op:  # completes where FSDP waits for it, not here
                return run(output_tensor, input_tensor, group, async_op)
            return timer("all_gather", ring_bus_bytes(_nbytes(output_tensor), group.size()),
                         lambda: run(output_tensor, input_tensor, group, async_op))

    class TimedReduceScatter(DefaultReduceScatter):
        def __call__(self, output_tensor: torch.Tensor, input_tensor: torch.Tensor,
                     group: dist.ProcessGroup, op: Any, async_op: bool = False) -> Any:
            run = super().__call__
            if async_op:
                return run(output_tensor, input_tensor, group, op, async_op)
            return timer("reduce_scatter",
                         ring_bus_bytes(_nbytes(input_tensor), group.size()),
                         lambda: run(output_tensor, input_tensor, group, op, async_op))

    return TimedAllGather(), TimedReduceScatter()
