"""Instrumentation for any training loop: step/section timing, heartbeats, events,
per-rank compute versus sync-wait, and restart commands from the node agent.

    pulse = Pulse(run="my-run")              # identity from torchrun's environment
    pulse = Pulse(run="my-run", agent=None)  # or: no agent, timing only
    pulse.attach_ddp(ddp_model)              # compute/sync split from DDP bucket timing
    for step, batch in enumerate(loader, 1):
        with pulse.step(step) as s:
            with s.section("data"):
                batch = to_device(batch)
            with s.section("forward_backward"):
                loss = model(batch).loss
                loss.backward()
            with s.section("optimizer"):
                opt.step(); opt.zero_grad()
            s.loss = loss
        if pulse.restart_requested(step):     # all ranks agree; see trainer.restart
            save_checkpoint(step); raise SystemExit(RESTART_EXIT_CODE)

Why the split matters: in synchronous training every rank's step takes as long as the
slowest rank's, so step time cannot name the straggler. With DDP a communication
hook stamps the moment each gradient bucket is ready (the rank's own work is done
up to there) before handing it to the normal all-reduce; the time from the last
bucket ready to the end of backward is waiting for peers. Without DDP (e.g. FSDP)
`sync_probe()` times a one-element all-reduce at a chosen point: the straggler
arrives last and waits ~0, the others wait for it.

On CUDA the host runs ahead of the device, so timestamps are CUDA events recorded at
the same points and read one step later (no device synchronize per step).
"""

from __future__ import annotations

import contextlib
import os
import threading
import time
from collections.abc import Iterator
from typing import Any

import torch
import torch.distributed as dist

from trainer.collectives import CollectiveLog
from trainer.consensus import Consensus
from trainer.telemetry import AgentLink

HEARTBEAT_EVERY_S = 1.0


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

    @contextlib.contextmanager
    def section(self, name: str) -> Iterator[None]:
        t0 = time.perf_counter()
        self.pulse._enter(name)
        try:
            yield
        finally:
            self.sections[name] = self.sections.get(name, 0.0) + time.perf_counter() - t0
            self.pulse._enter("step")


class Pulse:
    def __init__(self, run: str, agent: tuple[str, int] | None = ("127.0.0.1", 9401),
                 rank: int | None = None, local_rank: int | None = None,
                 world_size: int | None = None, gpu: int | None = None,
                 restarts: int | None = None, consensus_every: int = 5,
                 group: dist.ProcessGroup | None = None) -> None:
        env = os.environ
        self.run = run
        self.rank = int(env.get("RANK", 0)) if rank is None else rank
        self.local_rank = int(env.get("LOCAL_RANK", 0)) if local_rank is None else local_rank
        self.world_size = int(env.get("WORLD_SIZE", 1)) if world_size is None else world_size
        self.gpu = self.local_rank if gpu is None else gpu
        self.restarts = (int(env.get("TORCHELASTIC_RESTART_COUNT", 0))
                         if restarts is None else restarts)
        self.link = AgentLink(agent)
        self.slowdown = 1.0  # simulated GPU slowdown, from the agent's replies
        self.commands: dict[str, str] = {}  # id -> action, heard but not yet acted on
        self._acks: list[str] = []
        self._clock: _HostClock | _CudaClock = (
            _CudaClock() if torch.cuda.is_available() and torch.cuda.is_initialized()
            else _HostClock())
        self._bucket_marks: list[Any] = []
        self._has_hook = False
        self._pending: list[tuple[StepContext, Any, Any, Any, float]] = []
        self._probe_wait = 0.0
        self.last: dict[str, float] = {}  # the last step's figures (also sent to the agent)
        self.extra: dict[str, float] = {}  # fields added to every message (e.g. checkpoint)
        self.straggler_scores: list[float] | None = None
        self.checkpoint_agreed = False
        self.consensus = Consensus(every=consensus_every, group=group)
        self.collectives = CollectiveLog()  # sequence numbers: who a hang waits for
        self._samples = 0
        self._tokens = 0
        self.identity = {"run": run, "rank": self.rank, "local_rank": self.local_rank,
                         "world_size": self.world_size, "pid": os.getpid(), "gpu": self.gpu,
                         "restarts": self.restarts}
        self.phase, self._phase_since, self._step = "start", time.monotonic(), 0
        self._closed = threading.Event()
        self.link.send({"type": "event", "event": "start", **self.identity})
        self._beat = threading.Thread(target=self._heartbeat_loop, name="pulse-heartbeat",
                                      daemon=True)
        self._beat.start()

    # -- compute / sync split ------------------------------------------------------------
    def attach_ddp(self, ddp_model: torch.nn.parallel.DistributedDataParallel) -> None:
        """Stamp bucket-ready times, then run DDP's normal all-reduce."""
        from torch.distributed.algorithms.ddp_comm_hooks.default_hooks import allreduce_hook

        def hook(state, bucket):  # unannotated: DDP checks real annotation objects
            self._bucket_marks.append(self._clock.mark())
            return self.collectives.track_future("all_reduce", allreduce_hook(state, bucket))

        ddp_model.register_comm_hook(None, hook)
        self._has_hook = True

    def sync_probe(self, group: dist.ProcessGroup | None = None) -> None:
        """Time a one-element all-reduce here: the wait for the slowest peer."""
        if not dist.is_initialized() or self.world_size < 2:
            return
        t = torch.zeros(1, device="cuda" if isinstance(self._clock, _CudaClock) else "cpu")
        t0 = time.perf_counter()
        previous = self.phase
        self._enter("sync")
        with self.collectives.track("all_reduce"):
            dist.all_reduce(t, group=group)
        self._probe_wait += time.perf_counter() - t0
        self._enter(previous)

    # -- steps ---------------------------------------------------------------------------
    @contextlib.contextmanager
    def step(self, step: int) -> Iterator[StepContext]:
        ctx = StepContext(self, step)
        self._enter("step")
        self._bucket_marks = []
        self._probe_wait = 0.0
        t0 = time.perf_counter()
        start_mark = self._clock.mark()
        yield ctx
        end_mark = self._clock.mark()
        wall = time.perf_counter() - t0
        last_bucket = self._bucket_marks[-1] if self._bucket_marks else None
        self._pending.append((ctx, start_mark, last_bucket, end_mark, wall))
        self._step = step
        self._enter("between")
        self._resolve()

    def _resolve(self) -> None:
        """Turn finished steps' marks into figures and send them (CUDA: a step late)."""
        while self._pending:
            ctx, start, last_bucket, end, wall = self._pending[0]
            sync_wait = self._probe_wait
            if last_bucket is not None:
                tail = self._clock.elapsed(last_bucket, end)
                if tail is None:
                    return
                # the tail after the last bucket also holds the optimizer step and
                # anything after backward: only the part inside forward_backward waits.
                after_fb = ctx.sections.get("optimizer", 0.0) + ctx.sections.get("checkpoint", 0.0)
                sync_wait = max(0.0, tail - after_fb)
            elif self._clock.elapsed(start, end) is None:
                return
            self._pending.pop(0)
            data = ctx.sections.get("data", 0.0)
            ckpt = ctx.sections.get("checkpoint", 0.0)
            compute = max(0.0, wall - data - sync_wait - ckpt - ctx._extra_wait)
            loss = ctx.loss
            if isinstance(loss, torch.Tensor):
                loss = float(loss.detach().float().item())
            self.last = {"step_seconds": wall, "compute_seconds": compute,
                         "sync_wait_seconds": sync_wait, "data_wait_seconds": data}
            msg = {"type": "step", **self.identity, "step": ctx.step, **self.last}
            if loss is not None and loss == loss:
                msg["loss"] = loss
            self._samples += ctx.samples
            self._tokens += ctx.tokens
            self.consensus.record(compute + data)  # own time: slow input is slowness too
            msg["samples_total"], msg["tokens_total"] = self._samples, self._tokens
            msg.update(self.extra)
            if self._acks:
                msg["acks"] = self._acks[:16]
            self.link.send(msg)
            self._read_replies()

    def _enter(self, phase: str) -> None:
        self.phase, self._phase_since = phase, time.monotonic()

    def _heartbeat_loop(self) -> None:
        """Tell the agent every second that the process lives and what it is doing.

        Heartbeats do not count as progress (the agent ages ranks by their last step):
        a hung rank stays alive and visible in its phase while its progress age grows,
        and its peers show as waiting in "sync".
        """
        while not self._closed.wait(HEARTBEAT_EVERY_S):
            phase, since = self.phase, self._phase_since
            self.link.send({"type": "heartbeat", **self.identity, "step": self._step,
                            "phase": "forward_backward" if phase == "step" else phase,
                            "phase_seconds": round(time.monotonic() - since, 3),
                            **self.collectives.fields(), **self.extra})

    def _read_replies(self) -> None:
        for reply in self.link.poll():
            if isinstance(reply.get("slowdown"), int | float):
                self.slowdown = max(1.0, min(float(reply["slowdown"]), 20.0))
            for cmd in reply.get("commands", []) or []:
                if isinstance(cmd, dict) and isinstance(cmd.get("id"), str):
                    self.commands.setdefault(cmd["id"], str(cmd.get("action")))

    def restart_requested(self, step: int, want_checkpoint: bool = False) -> bool:
        """Collective every `consensus_every` steps: True on every rank if any rank
        heard a restart command. Also refreshes this rank's straggler score, and
        sets `checkpoint_agreed` if any rank asked for a (time-based) checkpoint."""
        self.checkpoint_agreed = False
        if not self.consensus.due(step):
            return False
        self._read_replies()
        want = any(a == "checkpoint-restart" for a in self.commands.values())
        self._enter("sync")
        with self.collectives.track("all_gather"):
            restart, self.checkpoint_agreed, scores = self.consensus.exchange(
                want, self.world_size, want_checkpoint)
        self._enter("between")
        if scores is not None:
            self.straggler_scores = scores
            self.extra["straggler_score"] = round(scores[self.rank], 4)
            last = self.consensus.last
            if last is not None:  # against its own history, and the decision
                self.extra["straggler_self_score"] = round(float(last.self_[self.rank]), 4)
                self.extra["straggler_flagged"] = int(bool(last.flagged[self.rank]))
        return restart

    # -- events --------------------------------------------------------------------------
    def event(self, name: str, **fields: Any) -> None:
        self.link.send({"type": "event", "event": name, **self.identity, **fields})

    def ack(self, command_ids: list[str]) -> None:
        """Acknowledge commands now and in the next messages (datagrams can be lost)."""
        self._acks = list(dict.fromkeys(self._acks + command_ids))[-16:]
        self.event("restart_requested", acks=self._acks)

    def close(self) -> None:
        self._closed.set()
        self.event("exit")
        self.link.close()
