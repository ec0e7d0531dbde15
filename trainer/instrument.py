"""Instrumentation for any training loop: step/section timing, heartbeats, events,
per-rank compute versus sync-wait, input stalls, and the restart protocol.

    info = init_distributed()                    # restart-safe (trainer.parallel)
    with Pulse(run="my-run") as pulse:           # agent: $CLUSTERPULSE_AGENT or its default
        pulse.attach_ddp(ddp_model)              # compute/sync split from DDP buckets
        for x, y in pulse.data(loader):          # time waiting for input is measured
            step += 1
            with pulse.step(step) as s:
                with s.section("forward_backward"):
                    loss = loss_fn(ddp_model(x), y); loss.backward()
                with s.section("optimizer"):
                    opt.step(); opt.zero_grad()
                s.loss = loss
            pulse.boundary(step, save=save_checkpoint)   # may leave for a restart

`boundary` is the whole graceful protocol in one call (see its docstring); the
complete, tested example is examples/ddp_tutorial.py.

Why the split matters: in synchronous training every rank's step takes as long as the
slowest rank's, so step time cannot name the straggler. With DDP an autograd callback
stamps the moment every gradient is computed (the rank's own work is done; DDP has
launched its last bucket's all-reduce) while DDP runs its normal C++ all-reduce; the
time from there to the all-reduce's end (a second callback, run after DDP's own has
waited for it) is waiting for peers, in every backward DDP reduces (gradient
accumulation without `no_sync()`, two passes a step: each), and so is the time in
DDP's broadcast of the model's buffers before each forward and in its one rebuild of
its buckets there, in the second step (a late peer is waited for there too), and so
is the time in any other blocking collective the model or the loop runs in the step
(`collective_timing`): in forward_backward (SyncBatchNorm's statistics, a
`dist.all_reduce` of the batch's figures), in the optimizer (clipping's norm on a
sharded model, a check across ranks that the gradients are finite) or
outside any section, or in a data section between micro-batches; not in a checkpoint
section (its own figure), and not DTensor's functional collectives nor `async_op=True`
ones. So is one the loop runs while it awaits input between steps (the HF Trainer's
gather of a batch's token count: counted as input, the ranks waiting there for a
slow-input peer looked input-bound and that peer did not stand out). From the start of
such a backward to its all-reduce's end DDP's all-reduces run: the gradient
bytes each rank moves over those windows is the step's achieved bus bandwidth (a lower
bound: the window also holds backward compute the all-reduces overlap), the figure that
falls for every rank together when a link on the ring is slow. A few Python calls per
step, whatever the model's size. Without DDP (e.g. FSDP)
`sync_probe()` times a one-element all-reduce at a chosen point: the straggler
arrives last and waits ~0, the others wait for it. With FSDP2, `attach_fsdp` times
each all-gather and reduce-scatter (FSDP's own, through its custom-collective hook)
and counts the bytes each rank moves in them: the same collective time and bandwidth.

On CUDA the host runs ahead of the device, so every mark is a CUDA event recorded at
the same points and read once it has completed (a step or more later); the loss is
copied to pinned host memory without blocking and read then too. Nothing in a step
synchronizes the device.
"""

from __future__ import annotations

import contextlib
import logging
import math
import operator
import os
import signal
import statistics
import sys
import threading
import time
import weakref
from collections import deque
from collections.abc import Callable, Iterable, Iterator
from pathlib import Path
from types import TracebackType
from typing import Any

import torch
import torch.distributed as dist
from torch.distributed.checkpoint.api import CheckpointException

from clusterpulse.agent import protocol
from clusterpulse.trainer import PREEMPTED_EXIT_CODE, collective_timing
from clusterpulse.trainer.collectives import CollectiveLog, ring_allreduce_bytes
from clusterpulse.trainer.consensus import Consensus, hardware_identity
from clusterpulse.trainer.parallel import hold_process_groups_until_exit, rank_and_world
from clusterpulse.trainer.restart import (
    PEER_SIGTERM_WAIT_S,
    STUCK_AFTER_SIGTERM_FLOOR_S,
    STUCK_AFTER_SIGTERM_STEPS,
    SigtermCatcher,
    clear_relaunch_request,
    leave_refusal,
    min_nodes,
    nodes_that_leave,
    request_relaunch,
)
from clusterpulse.trainer.telemetry import AgentAddr, AgentLink, parse_agent_addr
from clusterpulse.trainer.torch_support import (
    ddp_output_tensors,
    ddp_rebuild_flag,
    require_supported,
)

log = logging.getLogger("clusterpulse.trainer.instrument")
HEARTBEAT_EVERY_S = 1.0
EVENT_SEND_WAIT_S = 0.2  # at most this long per event while the agent's queue is full
AGENT_ENV = "CLUSTERPULSE_AGENT"
# How long a SIGTERM may wait for a loop that never asks about it (`_sigterm_as_usual`)
# before it is handed to the handler before Pulse's: longer than a protocol loop's
# first ask takes (it may ask every few steps), well inside Kubernetes' 30 s grace.
UNASKED_SIGTERM_S = 20.0
DEFAULT_AGENT = protocol.DEFAULT_TELEMETRY
# Section names are heartbeat phases; the agent drops phases it does not know, so a
# loop may only use the protocol's own (minus the ones Pulse sets itself; "evaluate"
# through Pulse.evaluating(), between steps).
SECTIONS = frozenset(protocol.PHASES - {"start", "sync", "between", "evaluate"})
# Where a rank waits for its peers inside a step (a collective, a device sync); "step"
# is a step outside any section. Not "data" (input) nor "checkpoint" (its own timeout).
IN_STEP_PHASES = frozenset({"step", "forward_backward", "optimizer"})
_EXACT_AS_FLOAT32 = frozenset({torch.float32, torch.bfloat16, torch.float16})
# DDP comm hooks of torch's that all-reduce gradients as fp16/bf16 (default_hooks)
_COMPRESS_HOOKS = frozenset({"fp16_compress_hook", "bf16_compress_hook"})


def _step_number(step: object) -> int:
    """A whole step number from an int-like (numpy integer, integer tensor) or a whole
    float (torch's Adam keeps its `step` as a float tensor: tensor(7.))."""
    if not isinstance(step, bool | str | bytes):
        try:
            return operator.index(step)  # type: ignore[arg-type]
        except TypeError:
            try:
                number = float(step)  # type: ignore[arg-type]
            except (TypeError, ValueError, RuntimeError):
                number = math.nan
            if number.is_integer():
                return int(number)
    raise TypeError(f"pulse.step(n): n must be a whole step number, not "
                    f"{_describe(step)}")


def _describe(value: object) -> str:
    """A value's type, and a tensor's shape: what a warning about a wrong one says."""
    if isinstance(value, torch.Tensor):
        return f"a tensor of shape {tuple(value.shape)}"
    return f"{type(value).__name__} {value!r}"[:120]


def ddp_of(model: object) -> torch.nn.parallel.DistributedDataParallel | None:
    """The DDP model that `model` is, or that it compiles (torch.compile's wrapper keeps
    the module it compiled as `_orig_mod`: the HF Trainer with torch_compile=True holds
    compile(DDP), which was no DDP to an isinstance check, and attach_ddp was never
    called); None for any other model. What a framework's callback attaches."""
    inner = getattr(model, "_orig_mod", model)
    return inner if isinstance(inner, torch.nn.parallel.DistributedDataParallel) else None


def _local_attempt() -> int:
    from clusterpulse.trainer.parallel import local_attempt

    return local_attempt()


def _cpu_group() -> dist.ProcessGroup | None:
    """The group consensus runs on: a gloo side group under NCCL (no device sync), the
    default group (None) under gloo or before the process group exists."""
    if dist.is_initialized() and dist.get_backend() != "gloo":
        return dist.new_group(backend="gloo")
    return None


def resolve_agent(agent: AgentAddr | None) -> AgentAddr | None:
    """"env" -> $CLUSTERPULSE_AGENT (or the agent's default socket); "unix:/PATH",
    "HOST:PORT" and "none" parsed; a parsed address passes through."""
    if agent == "env":
        agent = os.environ.get(AGENT_ENV) or DEFAULT_AGENT
    if isinstance(agent, str) and not agent.startswith("/"):  # "/path": parsed already
        return parse_agent_addr(agent)
    return agent


class _HostClock:
    """Wall-clock marks for CPU training."""

    def mark(self) -> float:
        return time.perf_counter()

    def elapsed(self, a: Any, b: Any) -> float | None:
        return b - a


class _CudaClock:
    """CUDA events: recorded without synchronizing, read once they have completed."""

    def mark(self) -> torch.cuda.Event:
        e = torch.cuda.Event(enable_timing=True)
        e.record()
        return e

    def elapsed(self, a: Any, b: Any) -> float | None:
        if not b.query():  # not executed yet: report on a later step
            return None
        return a.elapsed_time(b) / 1000.0


class StepContext:
    def __init__(self, pulse: Pulse, step: int) -> None:
        self.pulse = pulse
        self.step = step
        self.loss: float | torch.Tensor | None = None
        self.samples = 0
        self.tokens = 0
        self.sections: dict[str, float] = {}
        self._extra_wait = 0.0
        # perf_counter at the step's start, and the wait before it: for input, and for
        # peers in a collective run while awaiting input (`fetch_sync`: not input)
        self.t0 = 0.0
        self.fetch = 0.0
        self.fetch_sync = 0.0
        # input awaited inside the step (`data()` / `awaiting_input()` in it): host
        # seconds, and the clock marks around each wait (on CUDA the device's idle time
        # in it, which is what the step's device time holds of it)
        self.step_fetch = 0.0
        self.input_marks: list[tuple[Any, Any]] | None = None
        # host seconds in blocking collectives inside the step's data section (a wait
        # for peers between micro-batches: sync wait, not input)
        self.data_sync = 0.0
        self.start_mark: Any = None
        self.loss_buffer: torch.Tensor | None = None  # pinned host copy (CUDA), reused

    def section(self, name: str) -> _Section:
        if name not in SECTIONS:
            raise ValueError(f"section {name!r} is not one the agent accepts; use one of "
                             f"{', '.join(sorted(SECTIONS))}")
        return _Section(self, name)


class _Section:
    """`with s.section(name):` as a plain class, not a generator-based context
    manager: it runs twice per section every step, and a generator's set-up and
    teardown cost more host time than the timing it does."""

    __slots__ = ("ctx", "name", "t0")

    def __init__(self, ctx: StepContext, name: str) -> None:
        self.ctx, self.name, self.t0 = ctx, name, 0.0

    def __enter__(self) -> None:
        self.t0 = time.perf_counter()
        self.ctx.pulse._enter(self.name)

    def __exit__(self, *_exc: object) -> None:
        ctx, name = self.ctx, self.name
        ctx.sections[name] = ctx.sections.get(name, 0.0) + time.perf_counter() - self.t0
        ctx.pulse._enter("step")


class _Step:
    """`with pulse.step(n) as s:` (see Pulse.step): a plain class for the same reason
    as _Section. An exception in the step leaves it unrecorded, as before."""

    __slots__ = ("ctx", "pulse")

    def __init__(self, pulse: Pulse, ctx: StepContext) -> None:
        self.pulse, self.ctx = pulse, ctx

    def __enter__(self) -> StepContext:
        self.pulse._begin_step(self.ctx)
        return self.ctx

    def __exit__(self, kind: type[BaseException] | None, *_exc: object) -> None:
        collective_timing.state.timer = None  # between steps collectives are counted only
        pulse = self.pulse
        pulse._open_step = pulse._step_input_since = None
        if kind is None:
            pulse._end_step(self.ctx)
        else:
            # out of the step: a loop that catches the error and recovers (reloads a
            # checkpoint) was still "forward_backward" to the agent, held to the hang
            # threshold of a step
            pulse._enter("between")


class _BetweenSteps:
    """`with pulse.evaluating():` and `with pulse.saving():` (see those): work between
    steps in a phase of its own timeout. What the loop was doing is put back after,
    whatever the work raised: the phase, and a wait for input begun before it (a
    framework validates or saves between a step's end and the next fetch), which
    resumes without the work's time; what an evaluation's own loader waited is no
    training step's data wait."""

    __slots__ = ("fetch", "input_since", "open_step", "phase", "previous", "pulse", "t0",
                 "timer")

    def __init__(self, pulse: Pulse, phase: str) -> None:
        self.pulse, self.phase, self.previous = pulse, phase, ""
        self.input_since: float | None = None
        self.fetch, self.timer, self.t0 = (0.0, 0.0), None, 0.0
        self.open_step: tuple[StepContext | None, float | None, Any] = (None, None, None)

    def __enter__(self) -> None:
        p = self.pulse
        if self.phase in protocol.LATER_PHASES:
            # whether the agent knows the phase: its replies say (read now, not at the
            # next consensus step: a first evaluation, a sanity check, comes before any)
            p._read_replies()
        self.previous, self.input_since = p.phase, p._input_since
        # the data wait pending for the next training step is set aside: a step run
        # inside the evaluation takes only its own, and what the evaluation waited is none
        self.fetch, self.timer = (p._fetch_wait, p._fetch_sync), collective_timing.state.timer
        p._fetch_wait = p._fetch_sync = 0.0
        p._input_since, collective_timing.state.timer = None, None
        # inside an open step the work is no part of it: its loader's waits are not
        # the step's data, and its phase stays its own
        self.open_step = (p._open_step, p._step_input_since, p._step_input_mark)
        p._open_step = p._step_input_since = None
        self.t0 = time.perf_counter()
        if self.phase == "checkpoint":
            p._saves += 1
            p.extra["checkpoint_in_progress"] = 1  # told with the phase, at once
        p._enter(self.phase)
        if self.phase == "evaluate":
            p._evaluations += 1  # last: nothing above left it counted if it raised

    def __exit__(self, *_exc: object) -> None:
        p = self.pulse
        if self.phase == "evaluate":
            p._evaluations -= 1
        else:
            p._saves -= 1
            p.extra["checkpoint_in_progress"] = int(p._saves > 0)  # an outer save goes on
        p._fetch_wait, p._fetch_sync = self.fetch
        p._input_since = None if self.input_since is None else \
            self.input_since + time.perf_counter() - self.t0
        collective_timing.state.timer = self.timer
        p._open_step, p._step_input_since, p._step_input_mark = self.open_step
        p._enter(self.previous)


class Pulse:
    """One per rank. `agent`: "env" ($CLUSTERPULSE_AGENT, else the agent's default
    socket), "unix:/PATH", "HOST:PORT", a parsed address, or None/"none" for timing
    without an agent."""

    def __init__(self, run: str, agent: AgentAddr | None = "env",
                 rank: int | None = None, local_rank: int | None = None,
                 world_size: int | None = None, gpu: int | None = None,
                 restarts: int | None = None, consensus_every: int = 5,
                 group: dist.ProcessGroup | None = None, catch_sigterm: bool = True,
                 before_process_group: bool = False,
                 straggler_state: str | os.PathLike[str] | None = None,
                 peer_group: str | None = None) -> None:
        require_supported()  # UnsupportedTorch names the versions, before anything runs
        env = os.environ
        self.run = protocol.check_run_id(run)
        if consensus_every < 1:
            raise ValueError(f"consensus_every must be >= 1, got {consensus_every}")
        group_rank, group_world = rank_and_world()
        self.rank = group_rank if rank is None else rank
        self.local_rank = int(env.get("LOCAL_RANK", 0)) if local_rank is None else local_rank
        self.world_size = group_world if world_size is None else world_size
        self.gpu = self.local_rank if gpu is None else gpu
        # Started before the process group (see joined()): the agreed attempt number is
        # not known yet, and SIGTERM must still end a rank stuck in init.
        self._joined = not before_process_group
        if restarts is None and self._joined:
            restarts = _local_attempt()
        self.restarts = restarts
        self._catch_sigterm = catch_sigterm
        if self.local_rank == 0:
            clear_relaunch_request()  # one an earlier, failed attempt left
        self.link = AgentLink(resolve_agent(agent))
        self.slowdown = 1.0  # simulated GPU slowdown, from the agent's replies
        self.commands: dict[str, str] = {}  # id -> action, heard but not yet acted on
        self._leave_s: dict[str, float] = {}  # id -> how long this node sits the restart out
        self._acks: list[str] = []
        self._clock: _HostClock | _CudaClock = (
            _CudaClock() if torch.cuda.is_available() and torch.cuda.is_initialized()
            else _HostClock())
        self._on_cuda = isinstance(self._clock, _CudaClock)
        self._loop_thread = threading.get_ident()  # where the steps run
        self._step_stream: Any = None  # CUDA: the stream the step's marks are on
        # each backward of the step that DDP reduced: (it began, the rank's own work
        # done, DDP's all-reduce done, the bytes it reduced); the open one's first two
        # marks
        self._ddp_passes: list[tuple[Any, Any, Any, float]] = []
        self._backward_start: Any = None
        self._own_work_done: Any = None
        self._backward_open = False  # a syncing backward is running, its callback queued
        self._fwd_start: Any = None  # DDP's forward entered, its pre-forward not yet done
        # DDP's pre-forward, and the blocking collectives of the step (_collective_in_step)
        self._fwd_waits: list[tuple[Any, Any]] = []
        self._has_hook = False
        self._hooks: list[Any] = []  # removed at close: the model outlives no Pulse
        # attach_ddp's mark of a backward's start, for backward_reduces
        self._ddp_backward_starts: Callable[[torch.Tensor], None] | None = None
        # bytes each rank moves in the running backward's all-reduces: of every model
        # attached whose output it reaches (`_pass_models`, by id)
        self._pass_bytes = 0.0
        self._pass_models: set[int] = set()
        self._comm_marks: list[tuple[Any, Any, float]] = []  # FSDP: (start, end, bytes)
        self._pending: list[tuple[StepContext, Any, Any, float, list, list, list]] = []
        self._probes: list[tuple[Any, Any]] = []
        self._fetch_wait = 0.0
        self._fetch_sync = 0.0  # in collectives while awaiting input: waits for peers
        self._evaluations = 0  # open `evaluating()` blocks: between steps is "evaluate"
        self._saves = 0  # open `saving()` blocks: checkpoint_in_progress while any
        # the later phases (protocol.LATER_PHASES) the agent's replies say it knows
        self._agent_phases: frozenset[str] = frozenset()
        self._input_since: float | None = None  # awaiting_input() began, not yet arrived
        # the step between its `with` and its end, and a wait for input begun inside it
        # (a micro-batch of gradient accumulation fetched from `data()` in the step)
        self._open_step: StepContext | None = None
        self._step_input_since: float | None = None
        self._step_input_mark: Any = None
        self._loss_buffers: list[torch.Tensor] = []  # pinned, free for a loss copy (CUDA)
        self._warned_loss = False
        self._resolved = 0  # steps resolved: replies are read every consensus interval
        self.last: dict[str, float] = {}  # the last step's figures (also sent to the agent)
        self._recent_steps: deque[float] = deque(maxlen=20)  # wall seconds, for stuck
        self.extra: dict[str, float] = {}  # fields added to every message (e.g. checkpoint)
        self.straggler_scores: list[float] | None = None
        self.checkpoint_agreed = False
        self.preempt_agreed = False
        self.consensus = Consensus(every=consensus_every, group=group if group is not None
                                   or not self._joined else _cpu_group())
        # ranks doing the same work (a pipeline stage), scored against each other; the
        # same on every rank that shares it, given on every rank or on none
        self.consensus.peer_group = peer_group or ""
        if straggler_state is not None:  # a GPU's straggler history outlives the job's starts
            self.consensus.state_path = Path(straggler_state)
            self.consensus.identity = hardware_identity(self.gpu)
        self.sigterm = SigtermCatcher()
        if catch_sigterm and self._joined:
            self.sigterm.install()
        # whether the loop runs the restart protocol (`restart_requested`, `boundary`):
        # a SIGTERM it never asks about goes back to the handler before Pulse's
        # (`_sigterm_as_usual`)
        self._asked = False
        self.collectives = CollectiveLog()  # sequence numbers: who a hang waits for
        self._ddp_seq: int | None = None  # DDP's gradient all-reduce now in flight
        self._samples = 0
        self._tokens = 0
        self.identity: dict[str, Any] = {
            "run": run, "rank": self.rank, "local_rank": self.local_rank,
            "world_size": self.world_size, "pid": os.getpid(), "gpu": self.gpu}
        if self.restarts is not None:  # unknown until joined(): the agent keeps its count
            self.identity["restarts"] = self.restarts
        self.phase, self._phase_since, self._step = "start", time.monotonic(), 0
        self._closed = threading.Event()
        self.outcome: str | None = None
        if self.world_size > 1 or (dist.is_available() and dist.is_initialized()):
            collective_timing.install()  # once per process
            # every blocking collective this loop's thread runs is counted, in any phase
            collective_timing.attach(self.collectives, self._loop_thread)
        self.link.send({"type": "event", "event": "start", **self.identity})
        self._beat = threading.Thread(target=self._heartbeat_loop, name="pulse-heartbeat",
                                      daemon=True)
        self._beat.start()

    def joined(self, restarts: int | None = None) -> None:
        """Finish the set-up of a Pulse made with `before_process_group=True` (the
        reference trainer starts it first, so that a rank stuck in init or loading is
        seen in phase `start` rather than not at all): consensus on a CPU group, CUDA
        events now that the device is initialized, `restarts` (the attempt number all
        ranks agreed on; until now the agent kept the rank's previous count, so a
        requeued run's counter never dips), and the SIGTERM catcher (until now SIGTERM
        ended the rank as usual: there was nothing to checkpoint)."""
        if self._joined:
            return
        self._joined = True
        if self.consensus.group is None:
            self.consensus.group = _cpu_group()
        if isinstance(self._clock, _HostClock) and torch.cuda.is_available() \
                and torch.cuda.is_initialized():
            self._clock = _CudaClock()
            self._on_cuda = True
        self.restarts = self.identity["restarts"] = (
            _local_attempt() if restarts is None else restarts)
        if self._catch_sigterm:
            self.sigterm.install()

    @property
    def closed(self) -> bool:
        """Whether `close()` ran (a framework's next fit needs a Pulse of its own)."""
        return self._closed.is_set()

    # -- context manager -------------------------------------------------------------------
    def __enter__(self) -> Pulse:
        return self

    def __exit__(self, kind: type[BaseException] | None, err: BaseException | None,
                 tb: TracebackType | None) -> None:
        self.close("finished" if kind is None else "failed")

    # -- compute / sync split ------------------------------------------------------------
    def attach_ddp(self, ddp_model: torch.nn.parallel.DistributedDataParallel) -> None:
        """Mark when the rank's own backward work is done, and time DDP's collectives
        in the forward; DDP's own C++ all-reduce is kept. A constant number of Python
        calls per step, whatever the model's size.

        Backward: the output of a forward that DDP prepared to reduce gets a gradient
        hook (the first node of the backward) that queues an autograd engine callback.
        The engine runs its callbacks once every gradient is computed, in the order
        queued, and then those they queue: this one before DDP's own, which DDP queues
        when its last bucket is ready and which waits for the all-reduces. So the
        callback marks the rank's own work done (DDP has launched every bucket's
        all-reduce) and queues a second, which runs after DDP's has waited: from the
        one mark to the other the rank waits for its peers. The output hook opens the
        all-reduce window (buckets launch as their gradients become ready, from then
        on); with the bytes DDP reduces, a ring all-reduce over DDP's group moves
        `ring_allreduce_bytes` of them per rank in it. A hook per parameter gave the
        same marks at one Python call per parameter per backward (thousands at 7B);
        these hold whatever the gradient order, unused parameters included.

        Every backward that DDP reduces is marked so, however many a step has: a loop
        that accumulates gradients without `no_sync()`, or runs two forward/backward
        passes a step (SAM), reduces in each. (The wait used to run from the step's
        last such mark to the end of forward_backward: an earlier pass's wait was
        compute, and its all-reduce stayed entered for good.) Whether a backward
        reduces is DDP's decision in the forward (`no_sync()` around the forward: it
        prepares its reducer or not), so it is read there: a forward outside
        `no_sync()` whose backward runs inside it still reduces, as DDP's docs warn.
        Backward passes that reduce nothing (gradient accumulation's under
        `no_sync()`) are not marked. No Python DDP comm hook: its futures run Python
        callbacks on gloo's threads, which can abort the process at interpreter exit
        ("terminate called without an active exception").

        Forward: DDP broadcasts the model's buffers from rank 0 before every forward
        (broadcast_buffers=True, its default: a causal mask, BatchNorm statistics, a
        rotary cache are buffers), and rebuilds its buckets there once (a collective
        too: in the second step's forward, the third's with static_graph, unless
        find_unused_parameters without it). A rank whose peer is late waits there,
        inside forward_backward: counted as compute, it paged the waiting rank as the
        straggler. A pre-hook on DDP and one on the wrapped module bracket that
        pre-forward where DDP broadcasts, and in each forward until DDP has rebuilt its
        buckets (the ones before the rebuild too: their pre-forward work, the rank's
        own, is small and the same on every rank): it is sync wait. Once rebuilt, a
        model without buffers costs no mark there.

        The output's tensors are found as DDP finds them (lists, tuples, dicts,
        dataclasses and classes registered with pytree, nested): a dataclass output
        (DDP takes one) was no tensor to pytree, and its backward was not marked.
        """
        params = [p for p in ddp_model.parameters() if p.requires_grad]
        group = getattr(ddp_model, "process_group", None)
        ranks = group.size() if group is not None else self.world_size
        full = ring_allreduce_bytes(sum(p.numel() * p.element_size() for p in params), ranks)
        # torch's stock compression hooks reduce 2-byte gradients: half of fp32's bytes
        half = ring_allreduce_bytes(sum(p.numel() * min(p.element_size(), 2) for p in params),
                                    ranks)
        model_ref, key = weakref.ref(ddp_model), id(ddp_model)

        def wire_bytes() -> float:
            """Read at each backward: a hook may be registered after attach_ddp."""
            model = model_ref()
            hooks = getattr(model, "_comm_hooks", None) or ()
            return half if any(getattr(h, "__name__", "") in _COMPRESS_HOOKS
                               for h, _ in hooks) else full
        # The hooks live on the model and hold no reference to it (DDP's forward hook
        # is handed it): one back would be a cycle through tensors that the garbage
        # collector cannot free, so the DDP model, its reducer and process group lived
        # until interpreter finalization, where their C++ destructors (gloo's threads)
        # run while Python is half torn down.
        engine = torch.autograd.Variable._execution_engine
        output_tensors = ddp_output_tensors()
        rebuild_known = ddp_rebuild_flag(ddp_model)

        def all_reduced() -> None:
            self._ddp_passes.append(
                (self._backward_start, self._own_work_done, self._clock.mark(),
                 self._pass_bytes))
            if self._ddp_seq is not None:
                self.collectives.complete(self._ddp_seq)
                self._ddp_seq = None

        def own_work_done() -> None:
            self._backward_open = False
            self._own_work_done = self._clock.mark()
            # DDP has launched every bucket: this rank has entered the gradient
            # all-reduce; it completes once DDP's callback, queued before this one's,
            # has waited for it
            self._ddp_seq = self.collectives.enter("all_reduce")
            engine.queue_callback(all_reduced)

        def backward_starts(_grad: torch.Tensor) -> None:
            if self._backward_open:
                # another output of a forward: one mark per backward; another model's
                # (a GAN's generator under its discriminator) adds its bytes
                if key not in self._pass_models:
                    self._pass_models.add(key)
                    self._pass_bytes += wire_bytes()
                return
            self._pass_models, self._pass_bytes = {key}, wire_bytes()
            self._backward_open = True
            self._backward_start = self._clock.mark()
            engine.queue_callback(own_work_done)

        def forward_called(module: Any, _args: Any) -> None:
            # only where DDP waits for peers: its other pre-forward work is the rank's
            # own. It broadcasts the buffers, and rebuilds its buckets in one forward
            # with gradients, unless it finds unused parameters without static_graph
            # (DDP's conditions); once rebuilt, attribute reads and no call.
            sync = getattr(module, "will_sync_module_buffers", None)
            waits = sync is None or sync() or (
                rebuild_known and not module._has_rebuilt_buckets
                and (module.static_graph or not module.find_unused_parameters)
                and torch.is_grad_enabled())
            self._fwd_start = self._clock.mark() if waits else None

        def ddp_work_done(_module: Any, _args: Any) -> None:
            if self._fwd_start is not None:  # not the inner module called on its own
                self._fwd_waits.append((self._fwd_start, self._clock.mark()))
                self._fwd_start = None

        def forward_done(module: Any, _args: Any, output: Any) -> None:
            # DDP's own condition for preparing its reducer in this forward: the
            # backward of this output reduces exactly then
            if not (torch.is_grad_enabled() and module.require_backward_grad_sync):
                return
            for t in output_tensors(output):  # each: the loss may use any of them
                if isinstance(t, torch.Tensor) and t.requires_grad:
                    t.register_hook(backward_starts)

        # Under torch.compile (of the DDP model: its hooks are traced; of the wrapped
        # module: its pre-hook runs as a frame of its own) dynamo traced these: a graph
        # break at each clock mark, and a guard on the mark's value that recompiled as
        # it changed. Run eagerly instead: a clock mark is a side effect at run time,
        # never a graph's op (~0.3 us a call, tests/unit/test_pulse_compile.py).
        eager = torch.compiler.disable
        self._ddp_backward_starts = backward_starts
        self._hooks += [ddp_model.register_forward_pre_hook(eager(forward_called)),
                        # first of the model's pre-hooks: the user's own (registered
                        # before this) are the rank's work, not DDP's broadcast
                        ddp_model.module.register_forward_pre_hook(eager(ddp_work_done),
                                                                   prepend=True),
                        ddp_model.register_forward_hook(eager(forward_done))]
        self._has_hook = True

    def backward_reduces(self, loss: torch.Tensor) -> None:
        """The backward of `loss` reduces the attached DDP model's gradients though the
        model's forward did not return it: a framework that prepares DDP's reducer for
        a loss itself (Lightning's manual optimization: `manual_backward` inside
        training_step, inside DDP's forward, which returns no loss). attach_ddp marks
        the backward of a forward's outputs; this one went unmarked, and a healthy
        rank's wait there for its slow peer was its compute (a review: no sync wait, no
        bytes, the straggler unnamed). Call it just before that backward; nothing
        without attach_ddp or for a loss that needs no gradient."""
        hook = self._ddp_backward_starts
        if hook is not None and isinstance(loss, torch.Tensor) and loss.requires_grad:
            loss.register_hook(hook)

    def sync_probe(self, group: dist.ProcessGroup | None = None) -> None:
        """Time a one-element all-reduce here, to its completion: the wait for the
        slowest peer (device events on CUDA, read later)."""
        if not dist.is_initialized() or self.world_size < 2:
            return
        t = torch.zeros(1, device="cuda" if isinstance(self._clock, _CudaClock) else "cpu")
        previous = self.phase
        self._enter("sync")
        a = self._clock.mark()
        with self.collectives.track("all_reduce"), collective_timing.untimed():
            dist.all_reduce(t, group=group)
        self._probes.append((a, self._clock.mark()))
        self._enter(previous)

    def attach_fsdp(self, model: torch.nn.Module) -> int:
        """Time every all-gather and reduce-scatter of the FSDP2 (`fully_shard`)
        modules in `model`; returns how many modules are timed (0: no FSDP2 module, or
        a torch without FSDP's custom-collective hook, >= 2.8).

        Each collective runs as FSDP's default one would, between two marks on the
        stream FSDP issues it on (CUDA events; on CPU the host blocks in it), and is
        counted as entered and completed (the sequence numbers that name a hang's root).
        A rank moves (n-1)/n of each gathered buffer and of each reduce-scatter's input
        (nccl-tests' bus bytes), summed over the step with the collectives' time:
        per-rank collective time and achieved bandwidth. Call it after `fully_shard`
        and after any `set_custom_*` or symmetric-memory setting of your own (those
        replace these). Collectives that FSDP issues asynchronously (`unshard(async_op=
        True)`, prefetch by hand) are neither timed nor counted: their completion is
        only known where the caller waits.
        """
        from clusterpulse.trainer.fsdp_comms import timed_fsdp_comms

        comms = timed_fsdp_comms(self._timed_collective)
        if comms is None:
            return 0
        from torch.distributed.fsdp import FSDPModule

        gather, scatter = comms
        modules = [m for m in model.modules() if isinstance(m, FSDPModule)]
        for m in modules:
            m.set_custom_all_gather(gather)
            m.set_custom_reduce_scatter(scatter)
        return len(modules)

    def _timed_collective(self, op: str, bus_bytes: float, call: Callable[[], Any]) -> Any:
        """Run a blocking collective between two clock marks and count it (FSDP)."""
        with self.collectives.track(op), collective_timing.untimed():
            a = self._clock.mark()
            result = call()
            self._comm_marks.append((a, self._clock.mark(), bus_bytes))
        return result

    def _collective_in_step(self, op: str, call: Callable[..., Any], args: tuple[Any, ...],
                            kwargs: dict[str, Any]) -> Any:
        """A blocking collective the model or the loop runs in a step (through
        `collective_timing`'s wrappers): in forward_backward (SyncBatchNorm's
        statistics, a loop's `dist.all_reduce`), in the optimizer (clipping's norm on a
        sharded model, a check across ranks that the gradients are finite, a metric)
        or outside any section. The rank waits there for its slowest peer: sync wait,
        exactly as DDP's buffer broadcast, and counted as entered and completed (a hang
        there names the rank not in it). In the optimizer it was counted as compute,
        and a healthy rank that waited there for a slow peer paged as the straggler.

        Or one the loop's thread runs while awaiting input, between steps (the HF
        Trainer gathers the batch's token count across ranks there for a model whose
        forward takes `**kwargs`): a wait for the peers still loading their batch. As
        input wait every rank looked input-bound and the slow-input rank no slower
        than its peers (issue #31), so it is taken out of the data wait and is the next
        step's sync wait, on the host clock the data wait is measured by (on CUDA the
        device's wait in it falls before the step's first mark).

        Or one in the step's data section, between its micro-batches (Lightning
        broadcasts its SIGTERM flag after every batch): a wait for a peer, taken out of
        the section's data wait, on the host clock the section is measured by.

        Not timed in a checkpoint section: a figure of its own, and a collective there
        is part of it. Left to the marks that
        already hold it: inside DDP's pre-forward (its interval is timed whole). Left
        untimed: calls from another thread than the loop's, outside a backward (a
        background checkpoint's: they overlap the step's own work), and on CUDA calls
        on another stream than the step's (FSDP1's unshard stream): overlapping the
        compute, subtracting them would take it away. Those on the loop's thread are
        still counted, as in any phase (`collective_timing.counted`)."""
        since = self._input_since
        if since is not None and threading.get_ident() == self._loop_thread:
            with self.collectives.track(op), collective_timing.untimed():
                a = time.perf_counter()
                result = call(*args, **kwargs)
                waited = time.perf_counter() - a
            self._input_since = since + waited  # not input: the data wait resumes after
            self._fetch_sync += waited
            return result
        ctx = self._open_step
        if (self.phase == "data" and ctx is not None and self._step_input_since is None
                and threading.get_ident() == self._loop_thread):
            # between a step's micro-batches (its data section): Lightning broadcasts
            # its SIGTERM flag after every batch, and a healthy rank waited there for
            # its slow peer as input (a review: data wait 0.10 s a step against 0.002
            # s of fetching, the straggler's score halved)
            with self.collectives.track(op), collective_timing.untimed():
                a = time.perf_counter()
                result = call(*args, **kwargs)
                ctx.data_sync += time.perf_counter() - a
            return result
        if (self.phase not in IN_STEP_PHASES or self._fwd_start is not None
                or (threading.get_ident() != self._loop_thread
                    and torch._C._current_graph_task_id() == -1)
                or (self._step_stream is not None
                    and torch.cuda.current_stream() != self._step_stream)):
            return collective_timing.counted(op, call, args, kwargs)  # loop thread only
        with self.collectives.track(op), collective_timing.untimed():
            a = self._clock.mark()
            result = call(*args, **kwargs)
            self._fwd_waits.append((a, self._clock.mark()))
        return result

    # -- input ---------------------------------------------------------------------------
    def data(self, iterable: Iterable[Any]) -> Iterator[Any]:
        """Yield from `iterable`, timing each fetch: that wait is the next step's data
        wait (a slow input pipeline shows as data-loading, not as compute)."""
        it = iter(iterable)
        while True:
            self.awaiting_input()
            try:
                item = next(it)
            except BaseException as err:
                if self._open_step is not None:  # in a step: no wait goes on
                    if self._step_input_since is not None:  # (its data section's goes on)
                        self._step_input_since = None
                        self._enter("step")
                    if isinstance(err, StopIteration):
                        return
                    raise
                if not isinstance(err, StopIteration):
                    raise
                self._input_since = None
                collective_timing.state.timer = None
                self._enter("between")
                return
            self.input_arrived()
            yield item

    def awaiting_input(self) -> None:
        """The rank waits for its next batch from now on (phase data) until
        `input_arrived()`. For loops a framework drives (clusterpulse.integrations),
        where a callback sees a batch arrive but cannot wrap the loader in `data()`.
        A blocking collective the loop runs meanwhile is handed to
        `_collective_in_step` (an attribute store, nothing on a step without one): its
        time is a wait for peers, not for input.

        Inside a step (the next micro-batch of gradient accumulation) the wait is that
        step's data section, as `s.section("data")`: it was counted twice (in the step's
        compute and as the next step's data wait), and its arrival stopped the timing
        of the step's collectives, so a wait for a late peer after it was compute.
        Inside the step's own data section (`s.section("data")` around the fetch) that
        section times the wait: timed here too, it was counted twice."""
        if self._open_step is not None:
            if self.phase == "data":  # the step's data section (no other wait is open)
                return
            self._step_input_since = time.perf_counter()
            self._step_input_mark = self._clock.mark()
            self._enter("data")
            return
        self._enter("data")
        self._input_since = time.perf_counter()
        collective_timing.state.timer = self

    def input_arrived(self) -> None:
        """The batch awaited since `awaiting_input()` is here: that wait is the next
        step's data wait. Without a wait begun, nothing is counted."""
        since = self._step_input_since
        if since is not None:  # inside the step: its own
            ctx = self._open_step
            if ctx is not None:
                ctx.step_fetch += time.perf_counter() - since
                marks = (self._step_input_mark, self._clock.mark())
                if ctx.input_marks is None:
                    ctx.input_marks = [marks]
                else:
                    ctx.input_marks.append(marks)
            self._step_input_since = None
            self._enter("step")
            return
        if self._input_since is None:
            return
        self._fetch_wait += time.perf_counter() - self._input_since
        self._input_since = None
        collective_timing.state.timer = None
        self._enter("between")

    # -- steps ---------------------------------------------------------------------------
    def step(self, step: int) -> _Step:
        """`with pulse.step(n) as s:` around one training step (see the module's
        docstring). `n` is any whole number from 0 to 2**53 (protocol.MAX_STEP: the
        samples seen, say), a numpy integer or a 0-d integer tensor (an optimizer's
        saved step) included: sent as it was, a numpy step failed every message to the
        agent and stopped the heartbeats for good. One beyond is refused here: the agent
        would drop every message that carries it, and the rank go silent."""
        n = step if step.__class__ is int else _step_number(step)
        if not 0 <= n <= protocol.MAX_STEP:
            raise ValueError(f"pulse.step(n): n must be from 0 to 2**53, not {n}")
        return _Step(self, StepContext(self, n))

    def evaluating(self) -> _BetweenSteps:
        """`with pulse.evaluating():` around an evaluation between steps. Its time has no
        step-time reference: it is held to the absolute hang timeout (300 s by default),
        as a checkpoint save is, not to the steady threshold (max(15 s, 3 x the p99
        step)), which paged every evaluation longer than that as a hang, and rank 0
        evaluating alone while its peers wait in the next all-reduce as its root. The
        cost: a rank that hangs while it evaluates is named after that timeout."""
        return _BetweenSteps(self, "evaluate")

    def saving(self) -> _BetweenSteps:
        """`with pulse.saving():` around a checkpoint save between steps: phase
        checkpoint, held to the absolute hang timeout while no peer waits for this rank
        (a sharded save every rank writes: minutes on shared storage for a large
        model), and to the steady threshold once one does (a rank writing alone while
        its peers wait in a collective looks like one hung in a save). Unannounced, a
        save was held to the steady threshold from its start. Inside a step,
        `s.section("checkpoint")` is the step's own save."""
        return _BetweenSteps(self, "checkpoint")

    def _begin_step(self, ctx: StepContext) -> None:
        if not self._asked and self.sigterm.received:
            self._sigterm_as_usual()
        fetch, self._fetch_wait = self._fetch_wait, 0.0
        if fetch:
            ctx.sections["data"] = fetch
        ctx.fetch = fetch
        if self._fetch_sync:  # in a collective while awaiting input: in the step's wall
            ctx.fetch_sync, self._fetch_sync = self._fetch_sync, 0.0
            ctx.fetch += ctx.fetch_sync
        self._enter("step")
        self._open_step = ctx
        self._backward_open = False
        # fresh lists only where the last step left marks (the pending step keeps its
        # own copies): most steps leave most of them empty; a backward between steps
        # is none of this step's
        if self._ddp_passes:
            self._ddp_passes = []
        if self._fwd_waits:
            self._fwd_waits = []
        if self._probes:
            self._probes = []
        if self._comm_marks:
            self._comm_marks = []
        ctx.t0 = time.perf_counter()
        ctx.start_mark = self._clock.mark()
        if self._on_cuda:
            self._step_stream = torch.cuda.current_stream()
        # a blocking collective in the step waits for peers, in whatever section: an
        # attribute store, no call on the step's path (`_collective_in_step`)
        collective_timing.state.timer = self

    def _end_step(self, ctx: StepContext) -> None:
        step, fetch, start_mark = ctx.step, ctx.fetch, ctx.start_mark
        loss = ctx.loss
        if isinstance(loss, torch.Tensor) and loss.device.type == "cuda":
            # enqueue the copy before the end mark: readable once that mark completes;
            # into a pinned buffer that an earlier step's resolve gave back (pinning
            # host memory every step costs more host time than the rest of the step's
            # bookkeeping)
            host = self._loss_buffers.pop() if self._loss_buffers \
                else torch.empty((), dtype=torch.float32, pin_memory=True)
            try:
                host.copy_(loss.detach().float().reshape(()), non_blocking=True)
                ctx.loss = ctx.loss_buffer = host
            except RuntimeError:  # more than one number: not reported (not the step)
                self._loss_buffers.append(host)
                ctx.loss = self._no_loss(loss)
        end_mark = self._clock.mark()
        wall = time.perf_counter() - ctx.t0 + fetch
        passes = self._ddp_passes
        if passes:  # the pending step keeps them
            self._ddp_passes = []
        self._pending.append((ctx, start_mark, end_mark, wall, passes,
                              self._probes + self._fwd_waits, self._comm_marks))
        self._comm_marks = []
        self._step = step
        self._enter("between")
        self._resolve()

    def _sigterm_as_usual(self) -> None:
        """A SIGTERM that the loop has not asked about for UNASKED_SIGTERM_S (it never
        called `boundary` nor `restart_requested`) goes back to the handler that was
        there before Pulse's (by default: the process ends), and is raised again for
        it: caught for a boundary that never came, a telemetry-only loop trained on to
        its end through a preemption's signal (a review). Not at once: a loop that runs
        the protocol may ask only every few steps, or skip its first step's (a resumed
        Lightning fit at a validation batch), and a review found such loops killed
        without their save when it was handed back at the second step. Only while
        Pulse's catcher is SIGTERM's handler: one the loop (or its framework) installed
        after Pulse is theirs, and stays."""
        if threading.current_thread() is not threading.main_thread():
            return  # handlers are set from the main thread only (so was this catcher)
        if not self.sigterm.is_current():
            return
        arrived = self.sigterm.arrived_at
        if arrived is not None and time.monotonic() - arrived < UNASKED_SIGTERM_S:
            return
        self._hand_back()

    def _hand_back(self) -> None:
        """SIGTERM to the handler before Pulse's, and the held one raised for it: Pulse
        forgets it (acted on after the hand-back too, a later ask agreed a preemption)."""
        self.sigterm.uninstall()
        self._catch_sigterm = False
        self.sigterm.received = False
        signal.raise_signal(signal.SIGTERM)

    def _resolve(self) -> None:
        """Turn finished steps' marks into figures and send them (CUDA: a step late)."""
        clock = self._clock
        while self._pending:
            ctx, start, end, wall, passes, probes, comm_marks = self._pending[0]
            total = clock.elapsed(start, end)
            if total is None:
                return
            data = ctx.sections.get("data", 0.0) - ctx.data_sync
            ckpt = ctx.sections.get("checkpoint", 0.0)
            # sync probes, DDP's pre-forward and the step's blocking collectives: waits
            # outside the backward
            probe_wait = sum(clock.elapsed(a, b) or 0.0 for a, b in probes) if probes \
                else 0.0
            comm, comm_bytes = None, 0.0
            if comm_marks:  # FSDP's timed collectives, each on its own stream (CUDA)
                times = [clock.elapsed(a, b) for a, b, _ in comm_marks]
                if None in times:
                    return  # one still runs on its stream: report on a later step
                comm = sum(t for t in times if t is not None)
                comm_bytes = sum(n for _, _, n in comm_marks)
            sync_wait = probe_wait + ctx.data_sync
            if comm is not None and isinstance(clock, _HostClock):
                # On the host clock (CPU, gloo) the rank blocks in each of FSDP's
                # all-gathers and reduce-scatters: waiting for its peers and the wire,
                # never its compute (a review: a healthy rank's 0.10 s there a step was
                # compute, and its slow peer scored 1.27 for 1.9x). On CUDA they run on
                # FSDP's streams, overlapping the compute; the part the compute stream
                # waits for is still in its device time (docs/trainer.md).
                sync_wait += comm
            if passes:
                # each backward DDP reduced, on one clock: the rank's own work done ->
                # the all-reduce done is sync wait; the window, from the backward's
                # start, and the bytes are each all-reduce's
                comm = probe_wait  # DDP's buffer broadcast: a collective too
                for began, done, reduced, _ in passes:
                    sync_wait += clock.elapsed(done, reduced) or 0.0
                    comm += clock.elapsed(began, reduced) or 0.0
                comm_bytes = sum(nbytes for *_, nbytes in passes)
            self._pending.pop(0)
            if isinstance(clock, _CudaClock):
                # device time of the step, less the host's waits between its marks, as
                # the checkpoint's: input awaited in a data section of the step
                # (gradient accumulation's next micro-batch) is data wait; counted as
                # compute as well, it was the rank's own time twice. The input awaited
                # before the step is outside the marks and comes on top.
                # Input fetched from `data()` inside the step: the device's idle time
                # between the marks around each fetch (a fetch overlapping queued work,
                # nanoGPT's prefetch, idles the device for its remainder only)
                in_step_input = data - (ctx.fetch - ctx.fetch_sync)
                for a, b in ctx.input_marks or ():
                    in_step_input += clock.elapsed(a, b) or 0.0
                compute = max(0.0, total - sync_wait - ckpt - in_step_input)
            else:
                compute = max(0.0, wall - data - ctx.step_fetch - ctx.fetch_sync - sync_wait
                              - ckpt - ctx._extra_wait)
            data += ctx.step_fetch
            sync_wait += ctx.fetch_sync  # in collectives while awaiting input (host)
            loss = ctx.loss
            if isinstance(loss, torch.Tensor):
                # CPU or completed pinned copy; a float32, bf16 or fp16 value is exact as
                # a Python float without the detach and cast (two dispatches fewer)
                try:
                    loss = float(loss.item() if loss.dtype in _EXACT_AS_FLOAT32
                                 else loss.detach().float().item())
                except RuntimeError:  # more than one number ("cannot be converted")
                    loss = self._no_loss(loss)
                if ctx.loss_buffer is not None:  # read: free for a later step's copy
                    self._loss_buffers.append(ctx.loss_buffer)
                    ctx.loss_buffer = None
            elif loss is not None and loss.__class__ is not float:
                try:  # a numpy scalar: not JSON, and failed the step's message
                    loss = float(loss)
                except (TypeError, ValueError):
                    loss = self._no_loss(loss)
            self._recent_steps.append(wall)
            self.last = {"step_seconds": wall, "compute_seconds": compute,
                         "sync_wait_seconds": sync_wait, "data_wait_seconds": data}
            if comm and comm_bytes:
                self.last.update(comm_seconds=comm, comm_bytes=comm_bytes)
            msg = {"type": "step", **self.identity, "step": ctx.step, **self.last}
            if loss is not None and -protocol.MAX_NUMBER <= loss <= protocol.MAX_NUMBER:
                # not NaN (no comparison holds), an infinity nor past the protocol's
                # bound (a diverged or overflowed loss): the agent refused the step's
                # whole message for one
                msg["loss"] = loss
                self.last["loss"] = loss
            self._samples += ctx.samples
            self._tokens += ctx.tokens
            self.consensus.record(compute + data)  # own time: slow input is slowness too
            msg["samples_total"], msg["tokens_total"] = self._samples, self._tokens
            msg.update(self.extra)
            self.link.send(self._with_acks(msg))
            self._resolved += 1
            if self._resolved % self.consensus.every == 0:
                # Not every step: the agent's replies (commands, a simulated slowdown)
                # are acted on at the consensus boundary, which reads them first itself;
                # reading each step cost receive calls and JSON decoding per step.
                self._read_replies()

    def _enter(self, phase: str) -> None:
        if self._evaluations and phase in ("between", "data"):
            phase = "evaluate"  # the evaluation's own loader or steps: still evaluating
        entering = phase != self.phase and phase in protocol.OWN_TIMEOUT_PHASES
        self.phase, self._phase_since = phase, time.monotonic()
        if entering and not self._closed.is_set():
            # Saving a checkpoint has its own timeout; the next heartbeat can be a second
            # away, and one dropped or late on a loaded machine left the agent holding
            # a saving rank to the steady hang threshold of the phase it saw last.
            self._send_heartbeat(wait_s=EVENT_SEND_WAIT_S)

    def _no_loss(self, loss: object) -> None:
        """A loss that is not one number is not reported (warned about once): raising,
        it lost the step's figures and stopped the loop."""
        if not self._warned_loss:
            self._warned_loss = True
            log.warning("s.loss must be one number (a float, or a tensor of one element); "
                        "got %s: the loss is not reported", _describe(loss))

    def _send_heartbeat(self, wait_s: float = 0.0) -> None:
        phase, since = self.phase, self._phase_since
        told = "forward_backward" if phase == "step" else phase
        if told in protocol.LATER_PHASES and told not in self._agent_phases:
            told = "between"  # an older agent would drop the heartbeat as malformed
        self.link.send(self._with_acks({
            "type": "heartbeat", **self.identity, "step": self._step, "phase": told,
            "phase_seconds": round(time.monotonic() - since, 3),
            **self.collectives.fields(), **dict(self.extra)}), wait_s=wait_s)

    def _heartbeat_loop(self) -> None:
        """Tell the agent every second that the process lives and what it is doing.

        Heartbeats do not count as progress (the agent ages ranks by their last step):
        a hung rank stays alive and visible in its phase while its progress age grows,
        and its peers show as waiting in "sync".
        """
        while not self._closed.wait(HEARTBEAT_EVERY_S):
            self._send_heartbeat()
            self._give_up_if_stuck()

    def stuck_after_sigterm(self) -> str | None:
        """Why this rank should leave now rather than at the step boundary, or None.

        SIGTERM asks for a checkpoint at the next boundary. A rank blocked in a
        collective whose peer is cut off never gets there: torchrun restarting the job
        around the lost node (its keep-alive lapsed, a spare took its place) waited its
        30 s close timeout, and on the testbed the job stood until the link came back.
        Stuck: in a step (IN_STEP_PHASES: the reference trainer's ranks wait in
        forward_backward), or in the boundary's agreement (phase sync), since SIGTERM
        for longer than the steady hang threshold (STUCK_AFTER_SIGTERM_*: 5 s, or 10
        usual steps), in a step with Python's handler never run (the main thread is in
        native code: the gradient all-reduce, a device sync). Never before a first step
        (no usual step time: a first step may set up communicators), while saving or
        starting (their own timeouts), or between steps (the caller's evaluation, or
        its peers waiting for it in a barrier) or reading input."""
        arrived = self.sigterm.arrived_at
        phase, since = self.phase, self._phase_since
        if (arrived is None or phase not in IN_STEP_PHASES | {"sync"}
                or not self._recent_steps or self._closed.is_set()
                or not self.sigterm.is_current()):
            return None
        if phase != "sync" and self.sigterm.received:
            return None  # the handler ran: this rank is in Python, and gets there
        usual = statistics.median(self._recent_steps)
        allowed = max(STUCK_AFTER_SIGTERM_FLOOR_S, STUCK_AFTER_SIGTERM_STEPS * usual)
        stuck = time.monotonic() - max(arrived, since)
        if stuck <= allowed:
            return None
        return (f"in phase {phase} for {stuck:.0f} s since SIGTERM ({allowed:.0f} s "
                f"allowed): a peer gone from a collective?")

    def _give_up_if_stuck(self) -> None:
        if self.stuck_after_sigterm() is None:
            return
        self.sigterm.run_on_first()  # the caller's bookkeeping (how far the run got)
        why = self.stuck_after_sigterm()  # still: the collective may have returned since
        if why is None:
            return
        print(f"clusterpulse: rank {self.rank} leaves without a checkpoint, exit code "
              f"{PREEMPTED_EXIT_CODE}: {why}", file=sys.stderr, flush=True)
        with contextlib.suppress(Exception):
            self.event("exit", outcome="preempted")
        with contextlib.suppress(Exception):
            sys.stdout.flush()  # block-buffered under torchrun; os._exit drops it
        os._exit(PREEMPTED_EXIT_CODE)  # the main thread cannot be reached: the process

    def _with_acks(self, msg: dict[str, Any]) -> dict[str, Any]:
        """Every message after an acknowledgement repeats it: a message can be dropped
        (the agent's queue full, the agent restarting, UDP), and a rank that saves and
        exits right after acknowledging sends few more."""
        if self._acks:
            msg["acks"] = self._acks[:16]
        return msg

    def _read_replies(self) -> None:
        for reply in self.link.poll():
            phases = reply.get("phases")  # every reply of a current agent lists them
            self._agent_phases = frozenset(p for p in phases if isinstance(p, str)) \
                if isinstance(phases, list) else frozenset()
            if isinstance(reply.get("slowdown"), int | float):
                self.slowdown = max(1.0, min(float(reply["slowdown"]), 20.0))
            for cmd in reply.get("commands", []) or []:
                if (isinstance(cmd, dict) and isinstance(cmd.get("id"), str)
                        and cmd["id"] not in self._acks):
                    leave = cmd.get("leave_s")
                    if leave is not None:  # take this node out of the job for a while
                        if (not isinstance(leave, int | float) or isinstance(leave, bool)
                                or not 0 < leave <= protocol.MAX_LEAVE_S):
                            continue
                        why = leave_refusal(isinstance(self.link.addr, str))
                        if why:  # say so now; nothing restarts for a leave that cannot be
                            self.event("leave_refused", command=cmd["id"], reason=why)
                            continue
                        self._leave_s[cmd["id"]] = float(leave)
                    self.commands.setdefault(cmd["id"], str(cmd.get("action")))

    # -- agreement -----------------------------------------------------------------------
    def restart_requested(self, step: int, want_checkpoint: bool = False) -> bool:
        """Collective every `consensus_every` steps: True on every rank if any rank
        heard a restart command or SIGTERM (then `preempt_agreed` says which). Also
        refreshes this rank's straggler score, and sets `checkpoint_agreed` if any
        rank asked for a (time-based) checkpoint. Prefer `boundary`, which also acts.
        A loop that never calls either after its first step gets SIGTERM back as usual
        (`_sigterm_as_usual`)."""
        self._asked = True
        self.checkpoint_agreed = False
        if not self.consensus.due(step):
            return False
        if not self._joined and dist.is_initialized():
            raise RuntimeError("Pulse(before_process_group=True): call pulse.joined() once "
                               "the process group exists (its consensus group is set there)")
        self._resolve()
        self._read_replies()
        want = any(a == "checkpoint-restart" for a in self.commands.values())
        self._enter("sync")
        with self.collectives.track("all_gather"), collective_timing.untimed():
            restart, self.checkpoint_agreed, scores, self.preempt_agreed = \
                self.consensus.exchange(want, self.world_size, want_checkpoint,
                                        want_preempt=self.sigterm.received)
        self._enter("between")
        if scores is not None:
            self.straggler_scores = scores
            self.extra["straggler_score"] = round(scores[self.rank], 4)
            last = self.consensus.last
            if last is not None:  # against its own history, and the decision
                self.extra["straggler_self_score"] = round(float(last.self_[self.rank]), 4)
                self.extra["straggler_flagged"] = int(bool(last.flagged[self.rank]))
                if last.recurring is not None and last.recurring_cost is not None:
                    # short slowness recurring over 400 steps: what it costs the job
                    # while flagged so, else 0 (detection.scoring, recur_window)
                    self.extra["straggler_recurring"] = round(
                        float(last.recurring_cost[self.rank]), 4) \
                        if last.recurring[self.rank] else 0
        return restart or self.preempt_agreed

    def boundary(self, step: int, save: Callable[[int], None] | None = None,
                 want_checkpoint: bool = False,
                 before_exit: Callable[[str, list[str]], None] | None = None) -> None:
        """Call after every step, on every rank. Every `consensus_every` steps the
        ranks agree (one small CPU collective); when a `checkpoint-restart` command or
        SIGTERM reached any rank they all, at this same step:

        1. call `save(step)` (your checkpoint; raise if it fails);
        2. check that every rank's save succeeded. If one failed, the restart is
           aborted, logged and reported, and training goes on (the agent resends the
           command, escalating to a hard restart at its deadline); after SIGTERM
           they leave anyway, since the grace period is running out;
        3. acknowledge the command to the agent, pass a barrier (nobody leaves while
           a peer is still writing), close this Pulse, destroy the process group;
        4. raise SystemExit: 0 with a relaunch request under clusterpulse-train (the
           failure budget is untouched), 42 under a plain torchrun, 143 after SIGTERM.

        `before_exit(reason, command_ids)` runs between 2 and 3 (e.g. bookkeeping).
        """
        if not self.restart_requested(step, want_checkpoint):
            return
        reason = "preempted" if self.preempt_agreed else "checkpoint-restart"
        ok = True
        # From the save until this rank leaves (the agreement, the acknowledgement, the
        # barrier that waits for the slowest writer) the restart's own protocol runs in
        # phase checkpoint, held to the checkpoint's timeout: in a training phase it was
        # held to the steady floor (5 s), and a loaded machine's slow writer paged.
        self._enter("checkpoint")
        if save is not None:
            try:
                save(step)
            except (Exception, CheckpointException) as err:  # DCP's is a BaseException
                ok = False
                log.error("checkpoint for %s at step %d failed: %s", reason, step, err)
            self._enter("checkpoint")  # the caller's save may have left it
        if not self.all_ranks(ok):
            self.event("checkpoint_failed", step=step)
            if reason == "checkpoint-restart":
                self._enter("between")
                print(f"clusterpulse: checkpoint-restart at step {step} ABORTED: the "
                      "checkpoint failed on at least one rank; training goes on from here",
                      flush=True)
                return
            print(f"clusterpulse: preempted at step {step} and the checkpoint failed: "
                  "leaving without one", flush=True)
        heard = sorted(i for i, a in self.commands.items() if a == "checkpoint-restart")
        ids, leave = self.agree_on_commands(heard) if reason == "checkpoint-restart" \
            else (heard, 0.0)
        if ids and reason == "checkpoint-restart":  # this agent's own last: acks keep 16
            self.ack([i for i in ids if i not in heard] + [i for i in heard if i in ids])
        if before_exit is not None:
            before_exit(reason, ids)
        code = PREEMPTED_EXIT_CODE if reason == "preempted" else \
            request_relaunch(leave, self.restarts)
        if self.rank == 0:
            print(f"clusterpulse: {reason} at step {step}: checkpoint saved, leaving with "
                  f"exit code {code}", flush=True)
        if dist.is_initialized() and self.world_size > 1:
            dist.barrier(group=self.consensus.group)
        if reason == "preempted" and not self.sigterm.received and self.world_size > 1:
            # a peer's SIGTERM: ours comes if torchrun is restarting the workers for a
            # node that joins; leaving first would count as a failure (restart.py).
            # Before close(), which takes the catcher off: caught, not killed by it.
            self.sigterm.wait(PEER_SIGTERM_WAIT_S)
        self.close(reason)
        if dist.is_initialized():
            dist.destroy_process_group()
        raise SystemExit(code)

    def agree_on_commands(self, heard: list[str]) -> tuple[list[str], float]:
        """The restart commands any rank heard, and how long this node sits the restart
        out (collective, CPU group, only when the ranks leave).

        The ids: one rank's agent may deliver a command a step before another's, and
        the agreement carries only a flag, so a rank that had not heard it yet left
        without its id: rank 0 recorded a restart with no command, and the command
        missed that rank's acknowledgement. The leave: it applies only to the nodes
        whose agents were asked (evict-node reaches one node), and only to as many of
        them as the job can lose (`nodes_that_leave`); a node that gives way says so."""
        mine = {i: s for i, s in self._leave_s.items() if i in heard}  # leaves heard here
        if not dist.is_initialized() or self.world_size < 2:
            return heard, max(mine.values(), default=0.0)
        node = int(os.environ.get("GROUP_RANK", 0) or 0)  # torchrun: this node's rank
        every: list[tuple[int, list[str], dict[str, float], int | None] | None] = \
            [None] * self.world_size
        dist.all_gather_object(every, (node, heard, mine, min_nodes()),
                               group=self.consensus.group)
        facts = [f for f in every if f is not None]
        wanted: dict[int, float] = {}
        for n, _, leaves, _ in facts:
            if leaves:
                wanted[n] = max(wanted.get(n, 0.0), *leaves.values())
        # the strictest minimum any node knows (the rendezvous host's ranks know none)
        minimum = max((m for *_, m in facts if m is not None), default=None)
        leaving = nodes_that_leave(wanted, minimum)
        # a node that gives way: its leave is not carried out, nor acknowledged (the
        # agent fails the command when the ranks come back, even if this event is lost)
        refused = {i for n, _, leaves, _ in facts if n not in leaving for i in leaves}
        for cid in sorted(refused & set(mine)):
            self.event("leave_refused", command=cid, reason="others_leaving")
        ids = sorted({i for _, h, _, _ in facts for i in h} - refused)
        return ids, leaving.get(node, 0.0)

    def all_ranks(self, ok: bool) -> bool:
        """True on every rank iff `ok` on every rank (collective, CPU group)."""
        if not dist.is_initialized() or self.world_size < 2:
            return ok
        t = torch.tensor([1 if ok else 0], dtype=torch.int32)
        dist.all_reduce(t, op=dist.ReduceOp.MIN, group=self.consensus.group)
        return bool(t.item())

    # -- events --------------------------------------------------------------------------
    def event(self, name: str, **fields: Any) -> None:
        """Events are rare and each matters: sent with a short wait if the agent's
        queue is full, where samples are simply dropped."""
        self.link.send(self._with_acks({"type": "event", "event": name, **self.identity,
                                        **fields}), wait_s=EVENT_SEND_WAIT_S)

    def checkpoint_committed(self, step: int, timestamp: float | None = None,
                             blocking_seconds: float | None = None) -> None:
        """Report a committed checkpoint: feeds the last-checkpoint step and time
        (the CheckpointStale alert ages the time, not the step)."""
        self.extra["checkpoint_step"] = step
        self.extra["checkpoint_timestamp_seconds"] = time.time() if timestamp is None \
            else timestamp
        fields: dict[str, Any] = {"step": step}
        if blocking_seconds is not None:
            self.extra["checkpoint_blocking_seconds"] = blocking_seconds
            fields["checkpoint_blocking_seconds"] = blocking_seconds
        self.event("checkpoint_committed", **fields)

    def ack(self, command_ids: list[str]) -> None:
        """Acknowledge commands now and in the next messages (one can be dropped)."""
        self._acks = list(dict.fromkeys(self._acks + command_ids))[-16:]
        for cid in command_ids:
            self.commands.pop(cid, None)
            self._leave_s.pop(cid, None)
        self.event("restart_requested")

    def close(self, outcome: str = "finished") -> None:
        """Stop the heartbeat thread (joined: no thread outlives the loop) and tell the
        agent how the rank ended: finished, failed, checkpoint-restart or preempted.
        The process group is held until Python's exit handlers (the loop's DDP model,
        freed after this, must not be its last owner: parallel.hold_process_groups_
        until_exit). Idempotent."""
        if self._closed.is_set():
            return
        self.outcome = outcome
        self._closed.set()
        collective_timing.detach(self.collectives)
        if collective_timing.state.timer is self:  # closed awaiting input (a Trainer's end)
            collective_timing.state.timer = None
        hold_process_groups_until_exit()
        if self._beat.is_alive() and self._beat is not threading.current_thread():
            self._beat.join(timeout=5)
        for hook in self._hooks:
            hook.remove()
        self._hooks.clear()
        # a SIGTERM the loop never asked about, held as it ended (within the wait of
        # `_sigterm_as_usual`): the handler before Pulse's gets it now, once the agent
        # has the exit (a review: it was lost, and the rank read "finished")
        pass_on = (not self._asked and self.sigterm.received and self.sigterm.is_current()
                   and threading.current_thread() is threading.main_thread())
        self.sigterm.uninstall()
        self.sigterm.on_first = None  # the caller's bookkeeping (it may hold the trainer)
        self.event("exit", outcome=outcome)
        self.link.close()
        if pass_on:
            self.sigterm.received = False
            signal.raise_signal(signal.SIGTERM)
