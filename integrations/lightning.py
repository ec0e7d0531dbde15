"""ClusterPulse for a Lightning job: one Callback, public Lightning API but for one
lookup (`resume_from`: the one `ckpt_path="last"` makes).

    from clusterpulse.integrations.data import ResumableDataLoader
    from clusterpulse.integrations.lightning import ClusterPulseCallback
    from clusterpulse.trainer.parallel import agreed_attempt, init_distributed

    info = init_distributed()                # restart-safe process group, before Lightning
    per_node = int(os.environ.get("LOCAL_WORLD_SIZE", 1))  # devices * num_nodes = world
    pulse = ClusterPulseCallback(run="my-run", checkpoint="ckpts/graceful.ckpt")
    periodic = ModelCheckpoint(dirpath="ckpts", save_top_k=0, save_last=True,
                               every_n_train_steps=500)  # Lightning's own, for crashes
    trainer = pl.Trainer(accelerator="auto", strategy="ddp", devices=per_node,
                         num_nodes=info.world // per_node, callbacks=[pulse, periodic])
    trainer.fit(model, ResumableDataLoader(ds, batch_size=32),
                ckpt_path=pulse.resume_from(trainer))

(the README shows this verbatim as CI runs it, from tests/support/lightning_job.py).

What it maps, and why there: a step is one optimizer step, from the arrival of its
first batch (`on_train_batch_start`) to the `on_train_batch_end` of the batch that
stepped the optimizer (Lightning has counted it in `trainer.global_step` by then);
forward_backward ends where Lightning hands the gradients to the optimizer
(`on_before_optimizer_step`), so DDP's wait for peers (`attach_ddp` on the strategy's
DDP model) falls in it as in the plain recipe; under manual optimization the loss
handed to `manual_backward` is marked (`on_before_backward`), DDP's forward returning
none. The time from one step's end to the
next one's first batch is Lightning fetching input: the step's data wait. With
`accumulate_grad_batches` the step holds all its micro-batches: their samples summed,
their losses too (Lightning divides each by the accumulation: the sum is the loss
whose gradient the step applied), and the fetch of each micro-batch after the first
is in the step's data section, its data wait as well.

After each optimizer step `Pulse.boundary` runs the graceful protocol, saving through
`trainer.save_checkpoint` (a collective: every rank calls it, rank 0 writes),
atomically. Only there: a checkpoint holds no accumulated gradient, while the
loader's position in it is past every micro-batch trained, so one taken after a first
micro-batch lost it for good (the resumed step applied the others alone).
"""

from __future__ import annotations

import os
import zipfile
from pathlib import Path
from typing import Any

import lightning.pytorch as pl
import torch
import torch.distributed as dist
from lightning.pytorch.callbacks import ModelCheckpoint, OnExceptionCheckpoint
from torch.utils._pytree import tree_leaves

from clusterpulse.detection.state import STATE_FILE
from clusterpulse.integrations.steps import OpenStep
from clusterpulse.trainer.instrument import Pulse, ddp_of
from clusterpulse.trainer.parallel import agreed_attempt, init_distributed


def batch_size(batch: Any) -> int:
    """Samples in a batch: the first dimension of its first tensor (0 if none)."""
    for leaf in tree_leaves(batch):
        if hasattr(leaf, "shape") and len(leaf.shape) > 0:
            return int(leaf.shape[0])
    return 0


def loss_of(outputs: Any) -> Any:
    """training_step's loss: the tensor itself, or a dict's "loss" (Lightning's forms)."""
    return outputs.get("loss") if isinstance(outputs, dict) else outputs


def _ends_a_stretch(trainer: pl.Trainer, batch_idx: int) -> bool:
    """Whether Lightning does more after this batch than train the next one: the
    epoch's last batch, or one that validation follows. No agreement and no save there
    (the same on every rank; the next step has them). Lightning 2.6 restores a
    checkpoint saved at an epoch's last batch as the epoch complete, and every later
    checkpoint of the resumed run says its epoch is complete too: resumed from one, it
    trained the epoch again; resumed from one saved before a validation, it skipped
    that validation (two reviews; without ClusterPulse too)."""
    last = trainer.fit_loop.epoch_loop.batch_progress.is_last_batch  # iterable loaders too
    every = trainer.val_check_batch
    validates = trainer.enable_validation and isinstance(every, int) and every > 0 \
        and (batch_idx + 1) % every == 0
    return bool(last) or batch_idx + 1 >= trainer.num_training_batches or validates


class ClusterPulseCallback(pl.Callback):
    """Telemetry, input stalls, compute versus sync wait, and graceful restarts for a
    Lightning fit. `checkpoint`: where a graceful restart saves (and `resume_from()`
    finds it); `agent` and `consensus_every` as for `Pulse`."""

    def __init__(self, run: str, checkpoint: str | os.PathLike[str],
                 agent: str | None = "env", consensus_every: int = 5) -> None:
        self.run, self.agent, self.consensus_every = run, agent, consensus_every
        self.checkpoint = Path(checkpoint)
        self.pulse: Pulse | None = None
        self._step = OpenStep()
        self._losses: list[Any] = []  # the open step's micro-batches' losses
        self._evaluating: Any = None  # Pulse.evaluating() while Lightning validates

    def resume_from(self, trainer: pl.Trainer | None = None) -> str | None:
        """The checkpoint to pass as `fit(ckpt_path=...)`, None on a first start; the
        same on every rank (rank 0's choice: ranks listing a shared folder need not
        see the same files).

        The newest whole file of: the last graceful save, and (given the Trainer) the
        files Lightning's own `ckpt_path="last"` weighs, its ModelCheckpoints' `last`
        files and an OnExceptionCheckpoint's. Without them a crash before any graceful
        restart retrained from step 0 beside Lightning's periodic save; and "last"
        alone would not see the graceful save. A ModelCheckpoint without a `dirpath`
        saves under the logger's version folder, a new one at each start: in a
        restart of the job (attempt > 0) the last files of every version count too
        (a review's crash resumed from step 0), never on a first start, which may be
        a new experiment. Newest by modification time, as Lightning's "last" picks. A
        torch checkpoint is a zip whose directory is written last: a file without one
        is torn (a crash mid-write), passed over.
        """
        candidates = [self.checkpoint]
        restarted = agreed_attempt() > 0  # the job's, not this node's (a spare's is 0)
        for cb in trainer.callbacks if trainer is not None else []:
            if isinstance(cb, ModelCheckpoint):  # the folder as Lightning resolves it
                candidates += map(Path, cb._find_last_checkpoints(trainer))
                if cb.dirpath is None and restarted and trainer.loggers:
                    logger = trainer.loggers[0]
                    versions = Path(logger.save_dir or trainer.default_root_dir) / str(logger.name)
                    candidates += versions.glob("*/checkpoints/last*.ckpt")
            elif isinstance(cb, OnExceptionCheckpoint):
                candidates.append(Path(cb.ckpt_path))
        whole = [p for p in candidates if p.is_file() and zipfile.is_zipfile(p)]
        choice = [str(max(whole, key=lambda p: p.stat().st_mtime)) if whole else None]
        if dist.is_initialized() and dist.get_world_size() > 1:
            dist.broadcast_object_list(choice, src=0)
        return choice[0]

    # -- set-up and end ---------------------------------------------------------------
    def setup(self, trainer: pl.Trainer, pl_module: pl.LightningModule, stage: str) -> None:
        if stage != "fit" or (self.pulse is not None and not self.pulse.closed):
            return  # (a later fit: the last one closed its Pulse)
        info = init_distributed()  # the group Lightning made or found; the agreed attempt
        # the straggler baselines beside the graceful save, as the reference trainer
        # keeps them: a slow GPU's history outlives the job's restarts
        self.pulse = Pulse(run=self.run, agent=self.agent, restarts=info.attempt,
                           consensus_every=self.consensus_every,
                           straggler_state=self.checkpoint.parent / STATE_FILE)

    def on_train_start(self, trainer: pl.Trainer, pl_module: pl.LightningModule) -> None:
        pulse = self._pulse()
        self._validated()  # the sanity check's
        ddp = ddp_of(trainer.strategy.model)
        if ddp is not None:
            pulse.attach_ddp(ddp)
        pulse.awaiting_input()

    def on_train_end(self, trainer: pl.Trainer, pl_module: pl.LightningModule) -> None:
        self._validated()
        self._close("finished")

    def on_exception(self, trainer: pl.Trainer, pl_module: pl.LightningModule,
                     exception: BaseException) -> None:
        self._validated()
        self._close("failed")  # a graceful exit closed it already (close is idempotent)

    # -- validation: phase evaluate, the absolute hang timeout (Pulse.evaluating) --------
    # Open from validation's start to the next training batch (or the fit's end): the
    # best-model save of a ModelCheckpoint, which Lightning runs after every other
    # callback's on_validation_end, belongs to it; closed at on_validation_end it was
    # charged as the next step's data wait, held to the steady hang threshold. The cost:
    # the fetch of the batch after a validation is no data wait either.
    def on_validation_start(self, trainer: pl.Trainer, pl_module: pl.LightningModule) -> None:
        if self.pulse is None or self._evaluating is not None:  # validate() alone: no fit
            return
        self._evaluating = self.pulse.evaluating()
        self._evaluating.__enter__()

    def _validated(self) -> None:
        if self._evaluating is not None:
            self._evaluating.__exit__(None, None, None)
            self._evaluating = None

    # -- a step ---------------------------------------------------------------------------
    def on_train_batch_start(self, trainer: pl.Trainer, pl_module: pl.LightningModule,
                             batch: Any, batch_idx: int) -> None:
        pulse = self._pulse()
        self._validated()  # a validation (and its best-model save) ended before this batch
        if self._step.ctx is None:  # an optimizer step's first micro-batch
            pulse.input_arrived()
            self._step.begin(pulse, trainer.global_step + 1, batch_size(batch))
        else:  # a later micro-batch of the step (gradient accumulation), fetched in
            self._step.add(batch_size(batch))  # the step's data section
            self._step.section("forward_backward")

    def on_before_backward(self, trainer: pl.Trainer, pl_module: pl.LightningModule,
                           loss: Any) -> None:
        # Manual optimization: Lightning prepares DDP's reducer for this loss itself
        # (DDPStrategy.pre_backward), inside training_step, and DDP's forward returns
        # no loss to mark: its backward is marked here (a review: no sync wait, no
        # bytes, the straggler unnamed). Under automatic optimization the forward's
        # output is the loss's source, marked by attach_ddp.
        model = ddp_of(trainer.strategy.model)
        if (self.pulse is not None and not pl_module.automatic_optimization
                and model is not None
                and model.require_backward_grad_sync and torch.is_grad_enabled()):
            self.pulse.backward_reduces(loss)

    def on_before_optimizer_step(self, trainer: pl.Trainer, pl_module: pl.LightningModule,
                                 optimizer: Any) -> None:
        self._step.section("optimizer")

    def on_train_batch_end(self, trainer: pl.Trainer, pl_module: pl.LightningModule,
                           outputs: Any, batch: Any, batch_idx: int) -> None:
        loss = loss_of(outputs)
        if loss is not None:
            self._losses.append(loss.detach() if hasattr(loss, "detach") else loss)
        ctx = self._step.ctx
        if ctx is not None and trainer.global_step < ctx.step:
            # accumulating: no optimizer step yet; the step waits for its next micro-batch
            self._step.section("data")
            return
        self._step.end(self._step_loss(pl_module))
        pulse = self._pulse()
        if not _ends_a_stretch(trainer, batch_idx):
            pulse.boundary(trainer.global_step, save=lambda step: self._save(trainer, step))
        pulse.awaiting_input()

    # -- helpers --------------------------------------------------------------------------
    def _save(self, trainer: pl.Trainer, step: int) -> None:
        """Every rank calls it (Lightning's save is collective); rank 0 writes a
        temporary file and renames it: a crash mid-save never leaves a torn one."""
        tmp = self.checkpoint.with_name(self.checkpoint.name + ".tmp")
        trainer.save_checkpoint(tmp)
        if trainer.is_global_zero:
            os.replace(tmp, self.checkpoint)
            self._pulse().checkpoint_committed(step)

    def _step_loss(self, pl_module: pl.LightningModule) -> Any:
        """The loss of the optimizer step just taken, from its micro-batches' losses
        (None if none): their sum under automatic optimization, where Lightning hands
        each over divided by the accumulation; their mean under manual optimization,
        where it hands over what training_step returned."""
        losses, self._losses = self._losses, []
        if not losses:
            return None
        total = sum(losses[1:], losses[0])
        return total if pl_module.automatic_optimization else total / len(losses)

    def _pulse(self) -> Pulse:
        if self.pulse is None:
            raise RuntimeError("ClusterPulseCallback: the Trainer has not set it up "
                               "(pass it in Trainer(callbacks=[...]) before fit)")
        return self.pulse

    def _close(self, outcome: str) -> None:
        self._step.end()
        self._losses.clear()
        if self.pulse is not None:
            self.pulse.close(outcome)
