"""ClusterPulse for a Lightning job: one Callback, public Lightning API only.

    from clusterpulse.integrations.data import ResumableDataLoader
    from clusterpulse.integrations.lightning import ClusterPulseCallback
    from clusterpulse.trainer.parallel import init_distributed

    info = init_distributed()                # restart-safe process group, before Lightning
    per_node = int(os.environ.get("LOCAL_WORLD_SIZE", 1))  # devices * num_nodes = world
    pulse = ClusterPulseCallback(run="my-run", checkpoint="last.ckpt")
    trainer = pl.Trainer(accelerator="auto", strategy="ddp", devices=per_node,
                         num_nodes=info.world // per_node, callbacks=[pulse])
    trainer.fit(model, ResumableDataLoader(ds, batch_size=32), ckpt_path=pulse.resume_from())

(the README shows this verbatim as CI runs it, from tests/support/lightning_job.py).

What it maps, and why there: a step is one training batch, from its arrival
(`on_train_batch_start`) to `on_train_batch_end`; forward_backward ends where Lightning
hands the gradients to the optimizer (`on_before_optimizer_step`), so DDP's wait for
peers (`attach_ddp` on the strategy's DDP model) falls in it as in the plain recipe. The
time from one batch's end to the next's start is Lightning fetching input: the step's
data wait. After each batch `Pulse.boundary` runs the graceful protocol, saving through
`trainer.save_checkpoint` (a collective: every rank calls it, rank 0 writes), atomically.
Assumes one optimizer step per batch (no gradient accumulation).
"""

from __future__ import annotations

import os
from pathlib import Path
from typing import Any

import lightning.pytorch as pl
from torch.nn.parallel import DistributedDataParallel
from torch.utils._pytree import tree_leaves

from clusterpulse.integrations.steps import OpenStep
from clusterpulse.trainer.instrument import Pulse
from clusterpulse.trainer.parallel import init_distributed


def batch_size(batch: Any) -> int:
    """Samples in a batch: the first dimension of its first tensor (0 if none)."""
    for leaf in tree_leaves(batch):
        if hasattr(leaf, "shape") and len(leaf.shape) > 0:
            return int(leaf.shape[0])
    return 0


def loss_of(outputs: Any) -> Any:
    """training_step's loss: the tensor itself, or a dict's "loss" (Lightning's forms)."""
    return outputs.get("loss") if isinstance(outputs, dict) else outputs


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

    def resume_from(self) -> str | None:
        """The checkpoint to pass as `fit(ckpt_path=...)`: the last graceful (or
        crash-time) save, or None on a first start."""
        return str(self.checkpoint) if self.checkpoint.exists() else None

    # -- set-up and end ---------------------------------------------------------------
    def setup(self, trainer: pl.Trainer, pl_module: pl.LightningModule, stage: str) -> None:
        if stage != "fit" or self.pulse is not None:
            return
        info = init_distributed()  # the group Lightning made or found; the agreed attempt
        self.pulse = Pulse(run=self.run, agent=self.agent, restarts=info.attempt,
                           consensus_every=self.consensus_every)

    def on_train_start(self, trainer: pl.Trainer, pl_module: pl.LightningModule) -> None:
        pulse = self._pulse()
        if isinstance(trainer.strategy.model, DistributedDataParallel):
            pulse.attach_ddp(trainer.strategy.model)
        pulse.awaiting_input()

    def on_train_end(self, trainer: pl.Trainer, pl_module: pl.LightningModule) -> None:
        self._close("finished")

    def on_exception(self, trainer: pl.Trainer, pl_module: pl.LightningModule,
                     exception: BaseException) -> None:
        self._close("failed")  # a graceful exit closed it already (close is idempotent)

    # -- a step ---------------------------------------------------------------------------
    def on_train_batch_start(self, trainer: pl.Trainer, pl_module: pl.LightningModule,
                             batch: Any, batch_idx: int) -> None:
        pulse = self._pulse()
        pulse.input_arrived()
        self._step.begin(pulse, trainer.global_step + 1, batch_size(batch))

    def on_before_optimizer_step(self, trainer: pl.Trainer, pl_module: pl.LightningModule,
                                 optimizer: Any) -> None:
        self._step.section("optimizer")

    def on_train_batch_end(self, trainer: pl.Trainer, pl_module: pl.LightningModule,
                           outputs: Any, batch: Any, batch_idx: int) -> None:
        self._step.end(loss_of(outputs))
        pulse = self._pulse()
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

    def _pulse(self) -> Pulse:
        if self.pulse is None:
            raise RuntimeError("ClusterPulseCallback: the Trainer has not set it up "
                               "(pass it in Trainer(callbacks=[...]) before fit)")
        return self.pulse

    def _close(self, outcome: str) -> None:
        self._step.end()
        if self.pulse is not None:
            self.pulse.close(outcome)
