"""The blocking collectives the model or the loop runs inside a step, and the loop's
while it awaits input between steps, timed as sync wait; every blocking collective of
the loop's thread, in any phase, counted.

A rank whose model runs a collective in forward or backward (SyncBatchNorm gathers its
batch statistics in forward and all-reduces in backward; a layer or the loop
all-reduces its batch statistics) waits there for a late peer, and
that wait fell inside forward_backward: counted as the rank's compute, the waiting,
healthy rank paged as the straggler. The same in the optimizer section: clipping's norm
all-reduce on a sharded model (FSDP1's `clip_grad_norm_`), a check across ranks that the
gradients are finite, a metric all-reduced after backward. DDP's gradient all-reduce and
its buffer broadcast are timed by `Pulse.attach_ddp`; everything else has no hook to
time it by.

Between steps, likewise: a framework may run a collective while the rank awaits its
next batch (the HF Trainer, for a model whose forward takes `**kwargs` as every stock
one's does, all-gathers the batch's label-token count across ranks before each step).
A rank waits there for the peer still loading its batch; counted as that rank's data
wait, every rank looked input-bound and the data straggler did not stand out (#31).

So, as DeepSpeed's comms logger does, the blocking collectives of `torch.distributed`
(`COLLECTIVES`) are replaced by wrappers, once per process, when a Pulse is made in a
distributed run. While a step is open, a wrapper hands its call to the step's timer
(`Pulse._collective_in_step`: two clock marks, so on CUDA the stream's wait for NCCL is
seen; only on the loop's thread or in its backward, and only in the step's own phases:
in a checkpoint section of the step it is counted, its time the checkpoint's; in its
data section, between micro-batches, it is timed on the host clock the section is
measured by and taken out of its data wait);
while the Pulse awaits input (`awaiting_input` .. `input_arrived`, or `Pulse.data`) it
hands it there too, timed on the host clock the data wait is measured by, taken out of
the data wait and added to the next step's sync wait (the loop's thread only);
otherwise it calls the original after a compile check and one attribute check, and a
step without collectives of its own makes no call here at all. Callers look the
function up on `torch.distributed` when they call it (SyncBatchNorm does, and
`dist.all_reduce(...)` does), so they get the wrapper; a name bound earlier with
`from torch.distributed import all_reduce` keeps the original and is not seen.

Counted, not timed, in every other phase (a checkpoint's, the optimizer's, between a
step's end and the wait for input): a hang is named by the collectives each rank
has entered (trainer/collectives.py), and the ranks that wait for a rank held up in a
checkpoint save wait inside DCP's own collectives (its planning gather_object and
scatter_object_list, the write results' gather, the metadata's broadcast_object_list,
a barrier), which DCP calls as `dist.<name>` on the saving thread. Uncounted, the
waiting ranks were no further on than the rank holding them, and no root could be told
(JobStalled after the absolute timeout, naming no rank). Counted too: the rendezvous
agreement after init, a restart's own all_reduce and barrier, the user's `dist.*`
calls. Only on the thread the Pulse was made on (its loop's): a background
checkpoint's writer thread runs its collectives at times of its own and would put the
ranks' counts out of step; only the outermost call (a wrapped function that calls
another is one wait: a per-thread depth); and never ClusterPulse's own, which count
themselves (`untimed()`).

Not seen either: collectives with `async_op=True` (they complete where the caller
waits on the work, which is not known here: left uncounted; ZeroRedundancyOptimizer's
parameter broadcast in `step()` is one, so a wait there is still compute), collectives
issued from
C++ (DDP's own, timed by attach_ddp; NCCL calls of a custom extension), and those under
`torch.compile` (the compiled graph runs functional collectives; the wrapper steps
aside while dynamo traces, so the graph is the same as without it). ClusterPulse's own
collectives (a sync probe, FSDP's timed collectives) run `untimed()`: they are timed by
their own marks, and counting them here too would count their wait twice.
"""

from __future__ import annotations

import contextlib
import functools
import inspect
import threading
from collections.abc import Callable, Iterator
from typing import TYPE_CHECKING, Any, Protocol

import torch
import torch.distributed as dist

if TYPE_CHECKING:
    from clusterpulse.trainer.collectives import CollectiveLog

# The blocking entry points a model or a loop calls, each with the name its heartbeat
# gives while a rank waits in it: the agent accepts only its protocol's few families
# (agent.protocol.COLLECTIVES) and drops a heartbeat naming any other, the very one
# that shows a rank hung there. The names this torch lacks are skipped
# (all_gather_single and reduce_scatter_single are the newer spellings that
# SyncBatchNorm and FSDP call on recent torch).
COLLECTIVES = {
    "all_reduce": "all_reduce", "reduce": "all_reduce",
    "all_gather": "all_gather", "all_gather_into_tensor": "all_gather",
    "all_gather_single": "all_gather", "gather": "all_gather",
    "reduce_scatter": "reduce_scatter", "reduce_scatter_tensor": "reduce_scatter",
    "reduce_scatter_single": "reduce_scatter",
    "broadcast": "broadcast", "scatter": "broadcast",
    "all_to_all": "all_to_all", "all_to_all_single": "all_to_all",
    "barrier": "barrier", "monitored_barrier": "barrier",
    # The object collectives a checkpoint's planning runs (DCP's _DistWrapper calls
    # them as dist.<name>, on the caller's thread for a blocking save), and a loop's
    # own: pickled objects over a tensor collective of the same family.
    "all_gather_object": "all_gather", "gather_object": "all_gather",
    "broadcast_object_list": "broadcast", "scatter_object_list": "broadcast",
}


class StepTimer(Protocol):
    """What a wrapper hands a collective to (Pulse)."""

    def _collective_in_step(self, op: str, call: Callable[..., Any], args: tuple[Any, ...],
                            kwargs: dict[str, Any]) -> Any: ...


class _State:
    """`timer`: set while a step is open (by the step itself, an attribute store: no
    call on the step's path) and while a Pulse awaits input (`awaiting_input`, the
    same store), None otherwise and while a timed collective runs (a collective it
    calls in turn is part of it). `log` and `thread`:
    the Pulse's collective counts and the thread its loop runs on, set while a Pulse
    is open (the latest one made), None otherwise."""

    __slots__ = ("log", "thread", "timer")

    def __init__(self) -> None:
        self.timer: StepTimer | None = None
        self.log: CollectiveLog | None = None
        self.thread: int | None = None


state = _State()
# Per thread: > 0 inside a counted collective or ClusterPulse's own (untimed()): a
# wrapped function called from there is part of that one wait, not another.
_depth = threading.local()
originals: dict[str, Callable[..., Any]] = {}  # name -> torch's own function
_install_lock = threading.Lock()


def _async_index(fn: Callable[..., Any]) -> int | None:
    """The position of `async_op` among `fn`'s parameters (None: it has none)."""
    try:
        names = list(inspect.signature(fn).parameters)
    except (TypeError, ValueError):
        return None
    return names.index("async_op") if "async_op" in names else None


def _wrap(name: str, original: Callable[..., Any]) -> Callable[..., Any]:
    at = _async_index(original)
    family = COLLECTIVES[name]

    @functools.wraps(original)
    def collective(*args: Any, **kwargs: Any) -> Any:
        # First the compile check, so that dynamo, tracing through this, never reads
        # `state` (a guard on it would recompile the graph whenever a section opened)
        # and sees torch's own function, which it maps to a functional collective.
        if torch.compiler.is_compiling():
            return original(*args, **kwargs)
        timer = state.timer
        if timer is None and state.log is None:  # no Pulse open
            return original(*args, **kwargs)
        if kwargs.get("async_op") or (at is not None and len(args) > at and args[at]):
            return original(*args, **kwargs)  # completes where its work is waited on
        if getattr(_depth, "n", 0):  # inside a counted collective, or one of ours
            return original(*args, **kwargs)
        if timer is not None:
            return timer._collective_in_step(family, original, args, kwargs)
        return counted(family, original, args, kwargs)

    return collective


def counted(op: str, call: Callable[..., Any], args: tuple[Any, ...],
            kwargs: dict[str, Any]) -> Any:
    """Run a blocking collective counted as entered and completed, untimed, when it is
    called on the loop's thread of an open Pulse (any phase: a checkpoint's, a
    rendezvous barrier, the user's own). Another thread's (a background checkpoint
    writer's) run at times of their own, and would put the ranks' counts out of step."""
    log = state.log
    if log is None or threading.get_ident() != state.thread:
        return call(*args, **kwargs)
    seq = log.enter(op)
    _depth.n = getattr(_depth, "n", 0) + 1
    try:
        return call(*args, **kwargs)
    finally:
        _depth.n -= 1
        log.complete(seq)


def attach(log: CollectiveLog, thread: int) -> None:
    """Count the loop thread's collectives in `log` (a Pulse, when made)."""
    state.log, state.thread = log, thread


def detach(log: CollectiveLog) -> None:
    """Stop counting in `log` (its Pulse closed), unless a later Pulse took over."""
    if state.log is log:
        state.log = state.thread = None


def install() -> None:
    """Replace `torch.distributed`'s blocking collectives by timing wrappers, once per
    process (idempotent; `originals` keeps torch's own functions)."""
    if not dist.is_available():
        return
    with _install_lock:
        for name in COLLECTIVES:
            fn = getattr(dist, name, None)
            if fn is None or name in originals:
                continue
            originals[name] = fn
            setattr(dist, name, _wrap(name, fn))


@contextlib.contextmanager
def untimed() -> Iterator[None]:
    """Run ClusterPulse's own collectives unseen by the wrappers: they are timed by
    their own marks and counted by their own `track` (a sync probe, FSDP's timed
    collectives, the consensus exchange); counting them here too would count their
    wait twice."""
    timer, state.timer = state.timer, None
    _depth.n = getattr(_depth, "n", 0) + 1
    try:
        yield
    finally:
        _depth.n -= 1
        state.timer = timer
