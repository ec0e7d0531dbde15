"""Process group and model wrapping: DDP or FSDP2, gloo on CPU, NCCL on CUDA."""

from __future__ import annotations

import datetime
import os
import socket
import time
from dataclasses import dataclass

import torch
import torch.distributed as dist
from torch import nn


@dataclass(frozen=True)
class DistInfo:
    rank: int
    world: int
    local_rank: int
    device: torch.device
    backend: str
    # How many times the job has been (re)started, agreed by every rank: the attempt
    # number for restart accounting and fault injection (see _generation_store).
    generation: int = 0


def init_distributed(timeout_s: float) -> DistInfo:
    rank = int(os.environ.get("RANK", 0))
    world = int(os.environ.get("WORLD_SIZE", 1))
    local_rank = int(os.environ.get("LOCAL_RANK", 0))
    if torch.cuda.is_available():
        device = torch.device("cuda", local_rank)  # one rank per GPU
        torch.cuda.set_device(device)
        backend = "nccl"
    else:
        device, backend = torch.device("cpu"), "gloo"
    generation = int(os.environ.get("TORCHELASTIC_RESTART_COUNT", 0))
    if world > 1 and not dist.is_initialized():
        timeout = datetime.timedelta(seconds=timeout_s)
        store, generation = _generation_store(rank, world, timeout)
        dist.init_process_group(backend, store=store, rank=rank, world_size=world,
                                timeout=timeout, device_id=device if backend == "nccl" else None)
    return DistInfo(rank, world, local_rank, device, backend, generation)


def _generation_store(rank: int, world: int,
                      timeout: datetime.timedelta) -> tuple[dist.Store, int]:
    """The rendezvous store, under a prefix unique to this generation of the job.

    torchrun keeps one TCPStore across restarts (same MASTER_PORT) and the process
    group's keys are not namespaced per restart. After a rank is killed mid-collective,
    a restarted rank can read its dead peer's address and fail (or hang until the
    collective timeout) in gloo's connectFullMesh: 2 of 2 SIGKILL restarts here, and
    every multi-node hard restart in the end-to-end test.

    TORCHELASTIC_RESTART_COUNT cannot name the generation: an agent that restarts its
    workers for a membership change does not count it, so nodes disagree (and a
    multi-node job's restarts would be miscounted). Instead each
    rank claims the first free slot for its rank number (compare-and-set on the store):
    the n-th process to hold rank r gets generation n, so the ranks of one round agree
    as long as every rank of every earlier round got this far (init is the trainer's
    first step).
    """
    agent_store = os.environ.get("TORCHELASTIC_USE_AGENT_STORE") == "True"
    store = dist.TCPStore(os.environ.get("MASTER_ADDR", "127.0.0.1"),
                          int(os.environ.get("MASTER_PORT", "29500")), world,
                          is_master=(not agent_store and rank == 0), timeout=timeout)
    token = f"{socket.gethostname()}:{os.getpid()}:{time.time_ns()}".encode()
    generation = 0
    while store.compare_set(f"clusterpulse/slot/{generation}/{rank}", "", token) != token:
        generation += 1
    return dist.PrefixStore(f"clusterpulse/generation-{generation}", store), generation


def wrap(model: nn.Module, parallel: str, info: DistInfo) -> nn.Module:
    model = model.to(info.device)
    if info.world == 1:
        return model
    if parallel == "ddp":
        return nn.parallel.DistributedDataParallel(
            model, device_ids=[info.local_rank] if info.device.type == "cuda" else None)
    from torch.distributed.fsdp import fully_shard

    for block in model.blocks:  # shard per transformer block, then the rest at the root
        fully_shard(block)
    fully_shard(model)
    return model
