"""The reference training loop: what torchrun runs as `python -m clusterpulse.trainer`."""

from __future__ import annotations

import gc
import hashlib
import json
import logging
import math
import os
import signal
import sys
import threading
import time
from pathlib import Path

import torch

# DDP and FSDP import torch._dynamo when they wrap the model: 0.5 s of CPU in every rank
# at every start and restart. Imported with the reference trainer, it is imported once by
# a warm start's server (trainer/warmstart/), and every rank forked from it has it. Not
# in trainer/parallel.py: Pulse imports that, and a loop without DDP needs no compiler.
import torch._dynamo
import torch.distributed as dist
import torch.nn.functional as F
from torch.distributed.checkpoint.api import CheckpointException
from torch.distributed.checkpoint.state_dict import get_model_state_dict

from clusterpulse.agent.logsetup import setup_logging
from clusterpulse.detection.state import STATE_FILE
from clusterpulse.trainer.checkpoint import (
    MANIFEST,
    AcrossTorchPlanner,
    CheckpointError,
    CheckpointManager,
    Found,
    candidates,
    describe_error,
    iter_valid,
    model_mismatch,
    set_aside,
)
from clusterpulse.trainer.collectives import ring_allreduce_bytes
from clusterpulse.trainer.config import ConfigError, TrainConfig, parse_config
from clusterpulse.trainer.data import SyntheticTokens
from clusterpulse.trainer.dirclaim import DirectoryClaim, DirectoryInUse, job_identity
from clusterpulse.trainer.faults import Faults
from clusterpulse.trainer.flops import mfu
from clusterpulse.trainer.instrument import Pulse
from clusterpulse.trainer.model import PRESETS, build_model
from clusterpulse.trainer.parallel import (
    DistInfo,
    init_distributed,
    local_attempt,
    require_parallel_supported,
    wrap,
)
from clusterpulse.trainer.runstate import ProgressMark, RunState, progress_path
from clusterpulse.trainer.state import TrainState, parameter_digest
from clusterpulse.trainer.torch_support import UnsupportedTorch, require_supported
from clusterpulse.trainer.warmstart import take_torchrun_thread_count

log = logging.getLogger("clusterpulse.trainer")


def _broadcast(obj: object, info: DistInfo) -> object:
    if info.world == 1:
        return obj
    box = [obj]
    dist.broadcast_object_list(box, src=0)
    return box[0]


def _corrupt(path: Path) -> None:
    """Flip bytes in the middle of the largest data file (injected storage corruption)."""
    f = max((p for p in path.rglob("*.distcp")), key=lambda p: p.stat().st_size)
    with open(f, "r+b") as fh:
        fh.seek(f.stat().st_size // 2)
        chunk = fh.read(16)
        fh.seek(f.stat().st_size // 2)
        fh.write(bytes(b ^ 0xFF for b in chunk))


def _make_unloadable(path: Path) -> None:
    """Truncate the largest data file and certify it in the manifest: a torn write
    that passes verification (what a re-read after the fact would have certified)."""
    f = max((p for p in path.rglob("*.distcp")), key=lambda p: p.stat().st_size)
    with open(f, "r+b") as fh:
        fh.truncate(f.stat().st_size // 2)
    manifest = json.loads((path / MANIFEST).read_text())
    manifest["files"][f.name] = hashlib.sha256(f.read_bytes()).hexdigest()
    (path / MANIFEST).write_text(json.dumps(manifest))


class Trainer:
    def __init__(self, cfg: TrainConfig) -> None:
        self.cfg = cfg
        rank = int(os.environ.get("RANK", 0))
        # rank 0 publishes, prunes and keeps the accounting: it claims the directory
        # against another job's rank 0 before it reads or changes anything there
        self.dir_claim = DirectoryClaim(cfg.ckpt_dir, cfg.run_id, job_identity(cfg.run_id))
        if rank == 0:
            restarted = int(os.environ.get("TORCHELASTIC_RESTART_COUNT", 0) or 0) > 0
            self.dir_claim.take(cfg.ckpt_lock_wait_s, restart=restarted)
        try:
            self._start(cfg, rank)
        except BaseException:
            self.dir_claim.release()  # the next start need not wait for it to go stale
            raise

    def _start(self, cfg: TrainConfig, rank: int) -> None:
        self.runstate_path = cfg.ckpt_dir / "run-state.json"
        self.runstate = RunState.load(self.runstate_path) if rank == 0 else RunState()
        early = Faults(cfg.injections, rank, local_attempt())
        if early.init_crash():
            print(f"trainer: injected: rank {rank} exits before joining the process group",
                  file=sys.stderr, flush=True)
            os._exit(1)
        # Telemetry first: a rank stuck from here to its first step (process group,
        # model wrap, loading a checkpoint) is then seen in phase start, not missing.
        self.pulse = Pulse(run=cfg.run_id, agent=cfg.agent, consensus_every=cfg.consensus_every,
                           before_process_group=True,
                           straggler_state=cfg.ckpt_dir / STATE_FILE)
        if early.init_hang():
            print(f"trainer: injected: rank {rank} never joins the process group",
                  file=sys.stderr, flush=True)
            threading.Event().wait()
        try:
            self._build(cfg)
        except BaseException:
            self.pulse.close("failed")  # the agent hears that this rank is gone
            raise

    def _build(self, cfg: TrainConfig) -> None:
        """Join the process group and build the model, data, optimizer and checkpoints."""
        # The attempt number: rank 0's count from the run state, broadcast to all.
        self.info = info = init_distributed(cfg.collective_timeout_s,
                                            attempt=self.runstate.next_attempt(cfg.run_id))
        self.attempt = info.attempt
        self.pulse.joined(restarts=self.attempt)
        self.faults = Faults(cfg.injections, info.rank, self.attempt)
        mc = PRESETS[cfg.preset]
        if cfg.global_batch % info.world:
            raise ConfigError(f"--global-batch {cfg.global_batch} must be divisible by the "
                              f"world size {info.world}")
        self.model = wrap(build_model(cfg.preset, cfg.seed), cfg.parallel, info)
        self.data = SyntheticTokens(cfg.seed, mc.vocab, mc.seq_len, cfg.global_batch)
        if isinstance(self.model, torch.nn.parallel.DistributedDataParallel):
            self._settle_ddp_buckets()
        self.optimizer = torch.optim.AdamW(self.model.parameters(), lr=cfg.lr, weight_decay=0.0)
        warm = max(1, cfg.warmup_steps)
        self.scheduler = torch.optim.lr_scheduler.LambdaLR(
            self.optimizer, lambda s: min(1.0, (s + 1) / warm))
        self.state = TrainState(self.model, self.optimizer, self.scheduler)
        self.param_bytes = sum(p.numel() * p.element_size() for p in self.model.parameters())
        ckpt_group = (dist.new_group(backend="gloo")
                      if cfg.async_ckpt and info.world > 1 else None)
        self.ckpt = CheckpointManager(
            cfg.ckpt_dir, info.rank, keep=cfg.keep, async_save=cfg.async_ckpt, group=ckpt_group,
            before_publish=self._before_publish, after_publish=self._after_publish)
        if isinstance(self.model, torch.nn.parallel.DistributedDataParallel):
            self.pulse.attach_ddp(self.model)
        elif cfg.parallel == "fsdp":
            self.pulse.attach_fsdp(self.model)
        # Steps run the compiled module; checkpoints, digests and hooks keep the model.
        self.forward = torch.compile(self.model) if cfg.compile else self.model
        self._steady: tuple[int, float] | None = None  # (step, time) after the first step
        self.last_ckpt_time = time.monotonic()
        self.sync_bytes = 0.0
        self.host_bytes = 0.0

    def _settle_ddp_buckets(self) -> None:
        """One backward of a zero loss before training, so that every attempt reduces
        every real step with the same bucket layout.

        DDP reduces the first backward in one bucket in parameter order, then rebuilds
        its buckets in gradient-ready order. Left alone, a resumed attempt would reduce
        its first step with the initial layout where an uninterrupted run used the
        rebuilt one; with more than two ranks that changes the summation order of
        gloo's ring (which rank starts each chunk) and the run stops being bit-exact.
        The zero loss leaves parameters, optimizer and RNG untouched.
        """
        x, _ = self.data.shard(0, self.info.rank, self.info.world)
        (self.model(x.to(self.info.device)).sum() * 0.0).backward()
        self.model.zero_grad(set_to_none=True)

    # -- checkpoints -------------------------------------------------------------------
    def _save_runstate(self) -> None:
        if self.dir_claim.lost is None:  # the directory is another's now: its accounting
            self.runstate.save(self.runstate_path)

    def _before_publish(self, step: int) -> None:
        """Rank 0, just before it publishes and prunes: the directory read now, not as
        the last heartbeat (10 s ago) found it."""
        if not self.dir_claim.still_held():  # two writers: this one stops
            lost = self.dir_claim.lost or {}
            raise CheckpointError(f"--ckpt-dir {self.cfg.ckpt_dir} is claimed by run "
                                  f"{lost.get('run')!r} (pid {lost.get('pid')} on "
                                  f"{lost.get('host')}): not published")

    def _after_publish(self, step: int, path: Path) -> None:
        if self.faults.ckpt_corrupt(step):
            _corrupt(path)
            log.warning("injected: corrupted checkpoint %s", path.name)
        if self.faults.ckpt_unloadable(step):
            _make_unloadable(path)
            log.warning("injected: checkpoint %s will verify but not load", path.name)

    def resume(self) -> int:
        """Load the newest checkpoint every rank verified and loaded; fall back past
        any that is corrupt, incomplete, or verifies but does not load."""
        info = self.info
        if info.rank == 0:
            self.ckpt.clean_temporaries()
        if info.world > 1:
            dist.barrier(group=self.pulse.consensus.group)  # no rank looks before cleanup
        import torch.distributed.checkpoint as dcp

        kept: list[str] = []  # unusable checkpoints that could not be set aside (rank 0)

        def unusable(found: Found) -> None:  # every rank is done with it: out of the way
            if info.rank != 0:
                return
            moved = set_aside(found)
            if moved is None:
                kept.append(found.path.name)
            else:
                print(f"trainer: checkpoint {found.path.name} set aside as {moved.name}",
                      flush=True)

        partly_loaded = False
        present = len(candidates(self.cfg.ckpt_dir))
        shapes = {k: tuple(v.shape) for k, v in get_model_state_dict(self.model).items()}
        for found in iter_valid(self.cfg.ckpt_dir, info.rank, info.world, self.pulse.all_ranks,
                                unusable):
            other = model_mismatch(found.path, shapes)  # the same answer on every rank
            if other is not None:
                if info.rank == 0:
                    print(f"trainer: error: {found.path.name} in {self.cfg.ckpt_dir} holds "
                          f"another model than this run's: {other}. Were its settings "
                          "(--preset) different? Nothing was changed: resume with the "
                          "settings that wrote it, or use another --ckpt-dir",
                          file=sys.stderr, flush=True)
                raise SystemExit(2)
            planner = AcrossTorchPlanner()
            try:
                dcp.load({"app": self.state}, checkpoint_id=str(found.path), planner=planner)
                error = ""
                if planner.skipped and info.rank == 0:
                    print(f"trainer: {found.path.name} holds no value for "
                          f"{len(planner.skipped)} setting(s) this torch keeps "
                          f"({', '.join(planner.skipped[:3])}"
                          f"{', ...' if len(planner.skipped) > 3 else ''}): written by "
                          "another torch; they keep this run's values", flush=True)
            except (Exception, CheckpointException) as err:  # any rank's failure: go back
                error = describe_error(err)
            if self.pulse.all_ranks(not error):
                break
            partly_loaded = True
            print(f"trainer: checkpoint {found.path.name} verifies but does not load "
                  f"({error or 'on another rank'}); falling back to an older one", flush=True)
            self.pulse.event("checkpoint_failed", step=found.step)
            if info.rank == 0:
                self.runstate.load_failures.append({"checkpoint": found.path.name,
                                                    "error": error[:500],
                                                    "unix": time.time()})
            if info.world > 1:
                dist.barrier(group=self.pulse.consensus.group)  # nobody still reads it
            unusable(found)
        else:
            if partly_loaded:
                # dcp.load copies into the live model and optimizer: one that failed
                # partway left part of a checkpoint in them. Training from "step 0" on
                # that is neither the checkpoint nor a fresh start; the next attempt is
                # a fresh start (the unusable checkpoints are out of its way).
                if info.rank == 0:
                    print("trainer: error: no checkpoint loaded and a failed load may have "
                          "left part of one in the model; exiting so that the restart "
                          "starts clean" + (f" (but {', '.join(kept)} could not be set "
                          "aside: move it out of the checkpoint directory, or every "
                          "restart fails the same way)" if kept else ""),
                          file=sys.stderr, flush=True)
                    # this attempt's number is used: the next one gets the next number
                    self.runstate.attempts = max(self.runstate.attempts, self.attempt + 1)
                    self._save_runstate()
                raise SystemExit(1)
            if present and info.rank == 0:
                # each was named above as "falling back to an older one", the oldest
                # too: say where that ends (a review: the run silently began again)
                print(f"trainer: none of the {present} checkpoint(s) in "
                      f"{self.cfg.ckpt_dir} is usable: starting from step 0", flush=True)
            elif self.attempt > 0 and info.rank == 0:
                log.warning("restart %d found no valid checkpoint: starting from step 0",
                            self.attempt)
            return 0
        self.ckpt.resumed_from(self.state.step, found.path)
        if info.rank == 0:
            # the world size tells an elastic job's rounds apart: one that went on
            # smaller, and the one that took its lost node's place back
            print(f"trainer: resumed from {found.path.name} (step {self.state.step}, "
                  f"attempt {self.attempt}, {info.world} ranks)", flush=True)
        return self.state.step

    def save(self, step: int, raise_errors: bool = False) -> None:
        self.state.step = step
        with self.pulse.saving():  # phase checkpoint, its own timeout
            self._save(step, raise_errors)
        self.last_ckpt_time = time.monotonic()

    def _save(self, step: int, raise_errors: bool) -> None:
        try:
            # a directory another job took over from this one: no rank writes there (its
            # temporary directories have that job's names), every rank agrees
            held = self.dir_claim.still_held() if self.info.rank == 0 else True
            if not self.pulse.all_ranks(held):
                raise self.ckpt.refuse(step, f"--ckpt-dir {self.cfg.ckpt_dir} was taken over "
                                       "by another job: see rank 0's log")
            if delay := self.faults.ckpt_delay(step):
                time.sleep(delay)  # storage this slow blocks the step like a long write
            if self.faults.ckpt_hang(step):
                log.warning("injected: rank %d hangs in the checkpoint of step %d",
                            self.info.rank, step)
                while True:  # alive, in phase checkpoint; its peers wait in DCP's gather
                    time.sleep(1)
            self.ckpt.save(step, {"app": self.state}, fail=self.faults.ckpt_fail(step),
                           kill_midway=self.faults.ckpt_kill(step))
            self.pulse.event("checkpoint_committed" if not self.cfg.async_ckpt
                             else "checkpoint_started", step=step,
                             checkpoint_blocking_seconds=self.ckpt.last_blocking_seconds)
        except CheckpointError:
            self.pulse.extra["checkpoint_failures_total"] = self.ckpt.failures
            self.pulse.event("checkpoint_failed", step=step)
            if raise_errors:
                raise

    # -- one step ----------------------------------------------------------------------
    def train_step(self, step: int) -> torch.Tensor:
        """Run step `step` (1-based); returns the loss as a tensor (reading it would
        synchronize a CUDA device every step: only progress lines and the end do)."""
        cfg, info, pulse = self.cfg, self.info, self.pulse
        with pulse.step(step) as s:
            with s.section("data"):
                x, y = self.data.shard(step - 1, info.rank, info.world)
                x, y = x.to(info.device), y.to(info.device)
                delay = self.faults.data_delay(step)
                if delay:
                    time.sleep(delay)
            with s.section("forward_backward"):
                t0 = time.perf_counter()
                with torch.autocast(info.device.type, dtype=torch.bfloat16,
                                    enabled=cfg.dtype == "bf16"):
                    logits = self.forward(x)
                    loss = F.cross_entropy(logits.reshape(-1, logits.shape[-1]),
                                           y.reshape(-1))
                own = (time.perf_counter() - t0) * 3  # forward + backward ~ 3x forward
                # Simulated GPU work and slowdowns stretch the rank's own compute, before
                # backward so that DDP's bucket timing sees it as compute, not waiting.
                target = max(own, cfg.simulated_compute_s(x.shape[0]))
                target *= self.faults.slow_factor(step) * pulse.slowdown
                if target > own:
                    time.sleep(target - own)
                if cfg.parallel == "fsdp":
                    pulse.sync_probe()
                loss.backward()
                if cfg.parallel == "fsdp":
                    pulse.sync_probe()
            with s.section("optimizer"):
                self.optimizer.step()
                self.scheduler.step()
                self.optimizer.zero_grad(set_to_none=True)
            s.loss = loss.detach()
            s.samples = x.shape[0]
            s.tokens = x.numel()
        self.sync_bytes += ring_allreduce_bytes(self.param_bytes, info.world)
        self.host_bytes += x.numel() * 8
        pulse.extra.update(sync_bytes_total=self.sync_bytes, host_bytes_total=self.host_bytes,
                           memory_bytes=float(self.param_bytes * 4),
                           # async writes fail in DCP's thread: counted at the next step
                           checkpoint_failures_total=self.ckpt.failures)
        if self.ckpt.committed_step is not None:
            pulse.extra.update(checkpoint_step=self.ckpt.committed_step,
                               checkpoint_blocking_seconds=self.ckpt.last_blocking_seconds)
        # No time before a first commit, nor for a resumed checkpoint whose manifest
        # cannot be read: 0 read as a checkpoint 56 years old (CheckpointStale at every
        # restart)
        if self.ckpt.committed_unix is not None:
            pulse.extra["checkpoint_timestamp_seconds"] = self.ckpt.committed_unix
        return s.loss

    def _inject_process_faults(self, step: int) -> None:
        if self.faults.hang_at(step):
            log.warning("injected: rank %d hangs at step %d", self.info.rank, step)
            while True:  # alive, silent, holding its peers in the next collective
                time.sleep(1)
        mode = self.faults.crash_at(step)
        if mode == "exception":
            raise RuntimeError(f"injected crash on rank {self.info.rank} at step {step}")
        if mode == "exit":
            os._exit(1)
        if mode == "sigkill":
            os.kill(os.getpid(), signal.SIGKILL)

    # -- the run -----------------------------------------------------------------------
    def run(self) -> int:
        cfg, info = self.cfg, self.info
        start = self.resume()
        if info.rank == 0:
            self.runstate.begin_attempt(cfg.run_id, self.attempt, start,
                                        membership_change=info.membership_change)
            self._save_runstate()
            last = self.runstate.restarts[-1] if self.runstate.restarts else None
            if self.attempt > 0 and last and last["attempt"] == self.attempt:
                # the resume record, sent with every message of this process: incidents
                # read where the run resumed from here, not from sampled step series
                self.pulse.extra.update(
                    resume_step=last["resume_step"],
                    resume_steps_recomputed=last["steps_recomputed"],
                    resume_timestamp_seconds=round(last["restart_unix"], 3))
            self.pulse.sigterm.on_first = self._save_runstate
        # SIGTERM (preemption, torchrun stopping the workers) is caught by Pulse and
        # handled at the next consensus step; if peers are gone, that collective fails
        # and rank 0 still records how far the run got before it goes.
        mark = ProgressMark(progress_path(self.runstate_path)) if info.rank == 0 else None
        try:
            return self._loop(start, mark)
        except BaseException:
            if info.rank == 0:
                self._save_runstate()
            raise
        finally:
            if mark is not None:
                mark.close()

    def _loop(self, start: int, mark: ProgressMark | None) -> int:
        """`mark` (rank 0 only) records each step's progress where a SIGKILL keeps it."""
        cfg = self.cfg
        t_run, first = time.time(), True
        loss = torch.tensor(float("nan"))
        for step in range(start + 1, cfg.steps + 1):
            loss = self.train_step(step)
            if first:  # throughput is timed from here: the first step compiles, warms up
                self._sync_device()
                self._steady = (step, time.perf_counter())
            wall = self.pulse.last.get("step_seconds", 0.0)
            if mark is not None:
                if first:  # the restart's downtime, kept whatever ends this attempt
                    self.runstate.first_step_done(wall)
                    self._save_runstate()
                self.runstate.step_done(step, wall)
                self.pulse.extra["goodput_ratio"] = round(self.runstate.goodput(), 4)
                if self.dir_claim.lost is None:
                    mark.write(self.runstate)  # survives a SIGKILL; see trainer.runstate
                else:  # the directory is another job's now: its straggler history too
                    self.pulse.consensus.state_path = None
                if cfg.log_every and step % cfg.log_every == 0:
                    print(f"trainer: step {step}/{cfg.steps} loss {float(loss):.4f} "
                          f"step {wall * 1e3:.1f} ms", flush=True)
            first = False
            self._inject_process_faults(step)
            due_time = (cfg.ckpt_every_seconds > 0
                        and time.monotonic() - self.last_ckpt_time >= cfg.ckpt_every_seconds)
            if self.faults.graceful_at(step):  # as if the agent had delivered a command
                self.pulse.commands[f"injected-{self.attempt}-{step}"] = "checkpoint-restart"
            # Leaves (SystemExit) for a checkpoint-restart or after SIGTERM.
            self.pulse.boundary(step, save=self._save_to_leave, want_checkpoint=due_time,
                                before_exit=self._before_exit)
            if step == cfg.steps and (cfg.ckpt_every or cfg.ckpt_every_seconds):
                # the trained model is the run's result: `--steps 25 --ckpt-every 10`
                # ended with step 20's, and every save failing still ended "done", exit 0
                why: CheckpointError | None = None
                try:
                    self._save_to_leave(step)
                except CheckpointError as err:
                    why = err
                # every rank's word: rank 0's publish can fail where the others' writes
                # were done (a full disk at the manifest), and they went on alone
                if not self.pulse.all_ranks(why is None):
                    return self._final_save_failed(
                        step, why or CheckpointError("it failed on another rank"))
            elif (cfg.ckpt_every and step % cfg.ckpt_every == 0) or self.pulse.checkpoint_agreed:
                self.save(step)
        tokens_per_s = self._tokens_per_second(cfg.steps)
        self.ckpt.wait()
        return self._finish(loss, time.time() - t_run, tokens_per_s)

    def _final_save_failed(self, step: int, err: CheckpointError) -> int:
        """The run trained to its end but its model is not saved: exit 1, naming the
        newest checkpoint there is (a restart resumes from it and trains to the end
        again, as after any failure)."""
        if self.info.rank == 0:
            self._save_runstate()
            newest = max(candidates(self.cfg.ckpt_dir), key=lambda f: f.step, default=None)
            print(f"trainer: error: the final checkpoint (step {step}) was not saved: {err}"
                  f"{self.ckpt.space_hint()}; the newest in {self.cfg.ckpt_dir} is "
                  f"{newest.path.name if newest else 'none'}", file=sys.stderr, flush=True)
        return 1

    def _sync_device(self) -> None:
        if self.info.device.type == "cuda":
            torch.cuda.synchronize(self.info.device)

    def _tokens_per_second(self, last_step: int) -> float | None:
        """Tokens all ranks trained per second in this attempt, from the end of its first
        step (compilation and warm-up) to the end of `last_step`, checkpoints and
        step-boundary exchanges included; None when there is no such span."""
        if self._steady is None or last_step <= self._steady[0]:
            return None
        self._sync_device()
        first, t0 = self._steady
        tokens = (last_step - first) * self.cfg.global_batch * PRESETS[self.cfg.preset].seq_len
        return tokens / max(time.perf_counter() - t0, 1e-9)

    def _save_to_leave(self, step: int) -> None:
        """The checkpoint a restart leaves with: raises unless it is committed."""
        if self.ckpt.committed_step != step:
            self.save(step, raise_errors=True)
        self.ckpt.wait()
        if self.ckpt.committed_step != step:
            raise CheckpointError(f"the checkpoint of step {step} was not committed")

    def _before_exit(self, reason: str, command_ids: list[str]) -> None:
        """Every rank saved: record why the ranks leave, for the next attempt."""
        if self.info.rank == 0:
            self.runstate.checkpoint_blocking_seconds += self.ckpt.blocking_seconds_total
            self.runstate.pending_exit = reason
            self.runstate.pending_command = ",".join(command_ids)
            self._save_runstate()

    def _mfu(self, tokens_per_s: float | None) -> float | None:
        """Model FLOPs utilisation (trainer.flops) of a bf16 run on a GPU whose peak is
        known; None otherwise (the peaks are bf16 ones)."""
        if tokens_per_s is None or self.cfg.dtype != "bf16" or self.info.device.type != "cuda":
            return None
        share = mfu(tokens_per_s, PRESETS[self.cfg.preset], self.info.world,
                    torch.cuda.get_device_name(self.info.device))
        return None if share is None else round(share, 4)

    def _finish(self, loss: torch.Tensor, wall: float,
                tokens_per_s: float | None = None) -> int:
        info = self.info
        final_loss = torch.tensor([float(loss)], dtype=torch.float64, device=info.device
                                  if info.backend == "nccl" else "cpu")
        if info.world > 1:
            dist.all_reduce(final_loss)
            final_loss /= info.world
        digest = parameter_digest(self.model)
        if info.rank == 0:
            rs = self.runstate
            rs.checkpoint_blocking_seconds += self.ckpt.blocking_seconds_total
            self._save_runstate()
            total_wall = time.time() - rs.started_unix
            recomputed = sum(r["steps_recomputed"] for r in rs.restarts)
            lost = sum(r.get("downtime_seconds", 0.0) for r in rs.restarts)
            summary = {
                "run": self.cfg.run_id, "steps": self.cfg.steps, "world_size": info.world,
                # None where no step ran (a finished run started again): NaN is no JSON
                "parallel": self.cfg.parallel, "final_loss": _finite(final_loss.item()),
                "intra_op_threads": torch.get_num_threads(),  # rank 0's
                "param_sha256": digest, "restarts": rs.restarts,
                "steps_recomputed": recomputed, "checkpoint_load_failures": rs.load_failures,
                "time_lost_to_restarts_seconds": round(lost, 3),
                "checkpoint_blocking_seconds": round(rs.checkpoint_blocking_seconds, 4),
                "goodput": round(rs.goodput(), 4),
                "wall_seconds": round(total_wall, 3),
                "consensus_seconds": round(self.pulse.consensus.seconds, 4),
                "consensus_exchanges": self.pulse.consensus.exchanges,
                "dtype": self.cfg.dtype, "compile": self.cfg.compile,
                "tokens_per_second": None if tokens_per_s is None else round(tokens_per_s, 1),
                "mfu": self._mfu(tokens_per_s),
                # this attempt's failed saves (rank 0's), and the checkpoint it ends with
                "checkpoint_failures": self.ckpt.failures,
                "last_checkpoint_step": self.ckpt.committed_step,
            }
            if self.cfg.summary_json:
                try:
                    self.cfg.summary_json.parent.mkdir(parents=True, exist_ok=True)
                    self.cfg.summary_json.write_text(json.dumps(summary, indent=2))
                except OSError as err:  # the run is done: say so, and that this is lost
                    print(f"trainer: error: cannot write the run summary "
                          f"{self.cfg.summary_json}: {err.strerror or err}", file=sys.stderr,
                          flush=True)
            shown = "-" if summary["final_loss"] is None else f"{summary['final_loss']:.4f}"
            print(f"trainer: done: {self.cfg.steps} steps, loss {shown}, "
                  f"params {digest[:16]}, restarts {len(rs.restarts)}, "
                  f"goodput {summary['goodput']:.2f}", flush=True)
        if info.world > 1:
            # Leave together: a rank that tears gloo down while a peer still has an
            # operation in flight can make that peer abort (SIGABRT) after a clean run.
            dist.barrier()
        return 0


def _finite(value: float) -> float | None:
    return value if math.isfinite(value) else None


def _exit_status(code: object) -> int:
    """What the interpreter would make of SystemExit(code): None is 0, an int itself,
    anything else is printed and is 1."""
    if code is None:
        return 0
    if isinstance(code, int):
        return code
    print(code, file=sys.stderr)
    return 1


def main(argv: list[str] | None = None) -> int:
    setup_logging(os.environ.get("CLUSTERPULSE_LOG_LEVEL", "warning"), "CLUSTERPULSE_LOG_LEVEL")
    take_torchrun_thread_count()  # a rank forked warm has its server's count
    try:
        cfg = parse_config(argv)
        require_supported()
        require_parallel_supported(cfg.parallel)
        trainer = Trainer(cfg)
    except (ConfigError, UnsupportedTorch, DirectoryInUse) as err:
        print(f"trainer: error: {err}", file=sys.stderr)
        return 2
    except OSError as err:  # e.g. --ckpt-dir not writable: named, not a traceback
        print(f"trainer: error: {err.strerror or err}"
              f"{f': {err.filename}' if err.filename else ''}", file=sys.stderr)
        return 2
    outcome = "failed"
    try:
        rc = trainer.run()
        outcome = "finished" if rc == 0 else "failed"
    except SystemExit as leave:  # a restart or preemption leaves from the loop
        rc = _exit_status(leave.code)
    finally:
        trainer.pulse.close(outcome)  # no-op if a restart already closed it
        trainer.dir_claim.release()
        if dist.is_initialized():
            dist.destroy_process_group()
    # Free the model and its DDP reducer now, while Python is whole: left to interpreter
    # finalization, their C++ destructors (gloo's worker threads) ran while Python was
    # half torn down, and a rank that had finished could abort there ("terminate called
    # without an active exception"). The process group itself outlives them
    # (Pulse.close: hold_process_groups_until_exit).
    del trainer
    gc.collect()
    return rc
