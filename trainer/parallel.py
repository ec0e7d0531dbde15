"""Process group and model wrapping: DDP or FSDP2, gloo on CPU, NCCL on CUDA.

`init_distributed` is the restart-safe process-group init any loop can use.

Why it needs care: torchrun's c10d rendezvous shares ONE TCPStore across all
rendezvous rounds by default, and the process group's keys are not namespaced per
round (pytorch#135712). After a restart a rank can read a dead peer's address from
the previous round and fail in gloo's `connectFullMesh` (or NCCL's init). torch's
own answer is `TORCH_DISABLE_SHARE_RDZV_TCP_STORE=1` on the torchrun agent: every
rendezvous round then hands the workers a fresh port, and worker rank 0 hosts a
fresh store for that round only, so nothing of an earlier round can be read.
`clusterpulse-train` sets it. Under a plain torchrun that shares its store:
- one node: the store is namespaced by `TORCHELASTIC_RESTART_COUNT`, which is exact
  there (one agent counts every restart of every local worker);
- several nodes: the agents' counts can differ (a node that joins late starts at 0),
  so no per-rank scheme can be correct; init refuses with a clear error instead of
  wedging the job.

The attempt number (restart accounting, fault injection) is not taken from any one
node's counter: every rank proposes its node's and every rank takes the highest over
the new process group (one all-reduce), so every rank of a round holds the same number
by construction, and it never goes back: a node's count only grows, and a node that
has not seen the job's restarts (a hot spare, a relaunched launcher) proposes less.
Rank 0's alone went back to 0 when a spare became rank 0 (a review), and the agent,
which waits for a higher number to call a restart's ranks resumed, never did. In the same
collective the ranks learn whether torchrun started them again for a membership
change (`restarted_for_membership`), which the ranks cannot tell from a preemption
when it happens: both are a SIGTERM.
"""

from __future__ import annotations

import atexit
import contextlib
import datetime
import math
import os
import signal
import sys
import threading
import time
from dataclasses import dataclass
from pathlib import Path

import torch
import torch.distributed as dist
from torch import nn

from clusterpulse.trainer.restart import (
    ATTEMPTS_BEFORE_ENV,
    LOST_ROUND_WAIT_ENV,
    LOST_ROUND_WAIT_S,
    RELAUNCH_FILE_ENV,
    SHARE_STORE_ENV,
    relaunch_count_path,
    write_atomically,
)
from clusterpulse.trainer.torch_support import UnsupportedTorch, fsdp_on_cpu


class DistInitError(RuntimeError):
    """The launcher's set-up cannot give a restart-safe process group."""


@dataclass(frozen=True)
class DistInfo:
    rank: int
    world: int
    local_rank: int
    device: torch.device
    backend: str
    # The attempt number, identical on every rank of a round (the highest proposal).
    attempt: int = 0
    # torchrun started some node's workers again without counting a failure or a
    # relaunch (a node joined, or another node's failure is being restarted: the run
    # state tells the two apart by how the ranks left).
    membership_change: bool = False

    @property
    def generation(self) -> int:  # the old name, kept for callers of the first API
        return self.attempt


def rank_and_world() -> tuple[int, int]:
    """This process's rank and world size: the process group's once it exists, else
    torchrun's environment (RANK, WORLD_SIZE; 0 and 1 without a launcher).

    A group made with an explicit rank and world size (mp.spawn's
    `init_process_group(rank=r, world_size=n)`, PyTorch's own DDP tutorial) leaves
    the environment empty: read there, every rank said it was rank 0 of a world of one,
    its telemetry overwrote its peers' and no straggler could be scored."""
    if dist.is_available() and dist.is_initialized():
        return dist.get_rank(), dist.get_world_size()
    return int(os.environ.get("RANK", 0)), int(os.environ.get("WORLD_SIZE", 1))


def local_attempt() -> int:
    """This node's own count of (re)starts: the attempts before this torchrun plus its
    failure restarts. Only a proposal: ranks agree on the highest."""
    return attempts_before() + int(os.environ.get("TORCHELASTIC_RESTART_COUNT", 0) or 0)


def attempts_before() -> int:
    """Attempts before this node's torchrun (restart.next_attempt_base): what
    clusterpulse-train wrote beside its relaunch file before it started this torchrun
    (one started ahead of its turn, its forkserver and so its warm ranks have an
    environment older than the count: trainer/launch.py, Prewarmed), else
    ATTEMPTS_BEFORE_ENV."""
    relaunch_file = os.environ.get(RELAUNCH_FILE_ENV)
    if relaunch_file:
        with contextlib.suppress(OSError, ValueError):
            return int(Path(relaunch_count_path(relaunch_file)).read_text())
    return int(os.environ.get(ATTEMPTS_BEFORE_ENV, 0) or 0)


def restarted_for_membership() -> bool:
    """True when this node's torchrun started its workers again without counting a
    failure and without a relaunch: what it does when a node joins the job (it
    SIGTERMs the workers and starts a new round). Local rank 0 keeps the counts it
    started with in the launcher's directory (clusterpulse-train: one per launcher
    process, so a requeued job's new launcher starts afresh); under a plain torchrun
    there is none and the answer is False."""
    relaunch_file = os.environ.get(RELAUNCH_FILE_ENV)
    if not relaunch_file or os.environ.get("LOCAL_RANK", "0") != "0":
        return False
    path = Path(f"{relaunch_file}.round")
    counts = f"{attempts_before()}:{os.environ.get('TORCHELASTIC_RESTART_COUNT', 0)}\n"
    try:
        before = path.read_text()
    except OSError:
        before = ""
    with contextlib.suppress(OSError):  # accounting only: never a reason not to train
        path.write_text(counts)
    return before == counts


def _device_and_backend(local_rank: int) -> tuple[torch.device, str]:
    if torch.cuda.is_available():
        device = torch.device("cuda", local_rank)  # one rank per GPU
        torch.cuda.set_device(device)
        return device, "nccl"
    return torch.device("cpu"), "gloo"


def _shared_store_prefixed(world: int, rank: int,
                           timeout: datetime.timedelta) -> dist.Store:
    """torchrun's shared store, namespaced by the restart count (single node only)."""
    local_world = int(os.environ.get("LOCAL_WORLD_SIZE", world))
    if local_world != world:
        raise DistInitError(
            "torchrun shares one rendezvous store across restarts and this job spans "
            f"several nodes ({world} ranks, {local_world} here): restarts could reuse a "
            f"dead peer's address. Set {SHARE_STORE_ENV}=1 in torchrun's environment "
            "(clusterpulse-train does) so that each rendezvous round gets a fresh store.")
    store = dist.TCPStore(os.environ.get("MASTER_ADDR", "127.0.0.1"),
                          int(os.environ.get("MASTER_PORT", "29500")), world,
                          is_master=False, timeout=timeout)
    restarts = int(os.environ.get("TORCHELASTIC_RESTART_COUNT", 0) or 0)
    return dist.PrefixStore(f"clusterpulse/restart-{restarts}", store)


# Backend errors (NCCL's unique-id exchange) that say the round's store went away
_STORE_GONE = ("got 0 bytes", "connection was likely closed", "connection reset",
               "broken pipe")


def lost_round_wait_s() -> float:
    """How long a rank whose round ended while it joined waits for its torchrun to stop
    it: LOST_ROUND_WAIT_ENV (clusterpulse-train sets it from torchrun's monitor
    interval: `launch.lost_round_env`), else LOST_ROUND_WAIT_S; a value that is not a
    finite number of seconds >= 0 (`inf` overflowed the sleep) is the default."""
    raw = os.environ.get(LOST_ROUND_WAIT_ENV, "")
    try:
        seconds = float(raw) if raw else LOST_ROUND_WAIT_S
    except ValueError:
        return LOST_ROUND_WAIT_S
    return seconds if math.isfinite(seconds) and seconds >= 0 else LOST_ROUND_WAIT_S


def _round_lost(err: Exception) -> bool:
    """Whether joining failed because the round's store went away: gloo's store reads
    raise DistNetworkError; NCCL's exchange of its unique id reports the same store
    error as a DistBackendError."""
    if isinstance(err, dist.DistNetworkError):
        return True
    text = str(err).lower()
    return isinstance(err, dist.DistBackendError) and any(s in text for s in _STORE_GONE)


def _await_the_rounds_restart(err: Exception, rank: int, world: int) -> None:
    """A rank of a multi-node job whose round's store closed while it joined the
    process group: the round is over, most often because another node's torchrun is
    restarting it (a rank there died at init). This node's torchrun stops its workers
    for the new round when its monitor sees that node waiting, a membership restart
    that spends nothing; a rank that failed first spent one of this node's failure
    restarts too (on a loaded machine a 2-node test saw one rank's crash spend one on
    both nodes). So wait, at most `lost_round_wait_s()`, for torchrun's SIGTERM, with
    SIGTERM's default action (nothing is owed a checkpoint before the group exists; a
    handler the loop installed earlier would let the sleep go on); then the caller
    raises the error. Where nothing restarts the round (the other node's torchrun gave
    up, its host is gone) the rank fails that much later. One node (its torchrun
    restarts every local rank for any failure) fails at once. Nothing here may replace
    the caller's error (the caller suppresses what this raises)."""
    wait_s = lost_round_wait_s()
    local_world = int(os.environ.get("LOCAL_WORLD_SIZE", world))
    if ("TORCHELASTIC_RUN_ID" not in os.environ or wait_s == 0 or local_world == world
            or not _round_lost(err)):
        return
    why = (str(err).strip().splitlines() or [type(err).__name__])[0]
    print(f"trainer: rank {rank}: the round ended while it joined the process group "
          f"({why}); waiting up to {wait_s:g} s for torchrun to restart it",
          file=sys.stderr, flush=True)
    main = threading.current_thread() is threading.main_thread()
    before = signal.signal(signal.SIGTERM, signal.SIG_DFL) if main else None
    try:
        time.sleep(wait_s)
    finally:
        if main:  # a handler installed from C reads back as None
            signal.signal(signal.SIGTERM, before if before is not None else signal.SIG_DFL)
    print(f"trainer: rank {rank}: no restart came in {wait_s:g} s: failing (torchrun "
          "counts it against --max-restarts)", file=sys.stderr, flush=True)


def init_distributed(timeout_s: float = 600.0, attempt: int | None = None) -> DistInfo:
    """Join this round's process group (restart-safe) and agree on the attempt number.

    `attempt` is this rank's proposal (default: `local_attempt()`); every rank gets
    the highest. Safe to call when the process group already exists (its rank and world
    size are then the group's: `rank_and_world`).

    A world of one gets a process group too (of size one): code written for torchrun
    (DistributedSampler, DDP, DCP, `dist.get_rank()`) needs one, and the recipe tried
    on a one-GPU workstation failed in DistributedSampler without it. Run without a
    launcher (no MASTER_ADDR), that group's store is in this process.

    A rank of a multi-node torchrun job whose round's store closes while it joins
    waits up to `lost_round_wait_s()` (15 s; CLUSTERPULSE_LOST_ROUND_WAIT_S, 0: not at
    all) for torchrun to stop it before it raises: `_await_the_rounds_restart`.
    """
    rank, world = rank_and_world()
    local_rank = int(os.environ.get("LOCAL_RANK", 0))
    device, backend = _device_and_backend(local_rank)
    if not dist.is_initialized():
        timeout = datetime.timedelta(seconds=timeout_s)
        kwargs: dict = {"timeout": timeout, "device_id": device if backend == "nccl" else None}
        if os.environ.get("TORCHELASTIC_USE_AGENT_STORE") == "True":
            kwargs.update(store=_shared_store_prefixed(world, rank, timeout), rank=rank,
                          world_size=world)
        elif world == 1 and "MASTER_ADDR" not in os.environ:  # plain `python script.py`
            kwargs.update(store=dist.HashStore(), rank=0, world_size=1)
        try:
            dist.init_process_group(backend, **kwargs)  # env:// : this round's own store
        except dist.DistError as err:
            with contextlib.suppress(Exception):  # the error raised is init's, always
                _await_the_rounds_restart(err, rank, world)
            raise
    done = _agreed() if attempt is None else None
    if done is not None:  # this process agreed already (a framework's setup asks again)
        return DistInfo(rank, world, local_rank, device, backend, *done)
    proposal = attempt
    if proposal is None:  # past every attempt this node has seen agreed
        proposal = max(local_attempt(), last_agreed_attempt() + 1)
    agreed, membership = proposal, restarted_for_membership()
    if world > 1:  # the highest proposal, and whether any node rejoined
        box = torch.tensor([proposal, int(membership)], dtype=torch.int64, device=device)
        dist.all_reduce(box, op=dist.ReduceOp.MAX)
        agreed, membership = (int(v) for v in box.tolist())  # once per start, not per step
    if attempt is None:
        _AGREED[os.getpid()] = (dist.group.WORLD, agreed, bool(membership))
        record_agreed_attempt(agreed)
    return DistInfo(rank, world, local_rank, device, backend, agreed, bool(membership))


# pid -> (its process group, agreed attempt, membership change): one agreement per
# process and group, however often init_distributed is called (a second call read
# back its own round file: "membership")
_AGREED: dict[int, tuple[object, int, bool]] = {}


def _agreed() -> tuple[int, bool] | None:
    done = _AGREED.get(os.getpid())
    if done is None or not dist.is_initialized() or done[0] is not dist.group.WORLD:
        return None
    return done[1], done[2]


def agreed_attempt() -> int:
    """This process's agreed attempt (init_distributed), else its node's own count."""
    done = _agreed()
    return done[0] if done is not None else local_attempt()


def last_agreed_attempt() -> int:
    """The last attempt this node's ranks agreed on under this launcher (-1: none).
    torchrun counts a restart only on the node whose workers failed, and a node that
    rejoins counts none: the highest node count repeated a number when failures
    alternated between nodes (a review: 0, 1, 1, 2, 2). A new round proposes past it."""
    relaunch_file = os.environ.get(RELAUNCH_FILE_ENV)
    if relaunch_file:
        with contextlib.suppress(OSError, ValueError):
            return int(Path(f"{relaunch_file}.agreed").read_text())
    return -1


def record_agreed_attempt(agreed: int) -> None:
    relaunch_file = os.environ.get(RELAUNCH_FILE_ENV)
    if relaunch_file:
        with contextlib.suppress(OSError):  # accounting only: never a reason not to train
            write_atomically(Path(f"{relaunch_file}.agreed"), str(agreed))


_HELD_UNTIL_EXIT: list[dist.ProcessGroup] = []


def hold_process_groups_until_exit() -> None:
    """Hold the default process group until Python's exit handlers run (Pulse.close
    calls this), so that the model wrapped around it is freed first.

    DDP's reducer (a C++ object) holds the group too. Freed last by the reducer, the
    group is destroyed with the GIL held, and gloo's destructor waits for its worker
    threads. A worker thread still releasing the work of the last barrier needs the GIL
    to free that work's tensors (an all_gather_object's): the rank hung at exit, alive,
    so torchrun never saw it finish and the other nodes' torchruns waited in their exit
    barrier (seen on a loaded machine, in 2 of 10 runs of a 2-node job's graceful
    restarts). A loop's model is freed after its Pulse closed: the reference trainer's
    in main(), a foreign loop's as Pulse.boundary's SystemExit unwinds its frames.
    Dropped from Python at exit, torch's binding releases the GIL while the group shuts
    down (torch issue 56297). A rank forked warm leaves with os._exit and never frees
    it; a process that makes process groups again keeps each one until it exits."""
    if not dist.is_initialized():
        return
    group = dist.group.WORLD
    if not _HELD_UNTIL_EXIT:
        atexit.register(_HELD_UNTIL_EXIT.clear)
    if all(group is not held for held in _HELD_UNTIL_EXIT):
        _HELD_UNTIL_EXIT.append(group)


def require_parallel_supported(parallel: str) -> None:
    """Before any process group: FSDP2 on CPU needs a torch that runs it (2.7+); every
    rank would otherwise fail in its first all-gather, and torchrun restart them."""
    if parallel == "fsdp" and not torch.cuda.is_available() and not fsdp_on_cpu():
        raise UnsupportedTorch(f"FSDP on CPU needs torch >= 2.7 (this is {torch.__version__}): "
                               "use --parallel ddp, or run on GPUs")


def wrap(model: nn.Module, parallel: str, info: DistInfo) -> nn.Module:
    """DDP or FSDP2 over the default group, at any world size: one rank runs the same
    code (and the same instrumentation) as many."""
    model = model.to(info.device)
    if parallel == "ddp":
        return nn.parallel.DistributedDataParallel(
            model, device_ids=[info.local_rank] if info.device.type == "cuda" else None)
    from torch.distributed.fsdp import fully_shard

    for block in model.blocks:  # shard per transformer block, then the rest at the root
        fully_shard(block)
    fully_shard(model)
    return model
