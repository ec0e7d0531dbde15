"""ClusterPulse for a Hugging Face `transformers.Trainer` job: one TrainerCallback.

    from clusterpulse.integrations.hf import ClusterPulseCallback
    from clusterpulse.trainer.parallel import init_distributed

    init_distributed()                    # restart-safe process group, before the Trainer
    trainer = Trainer(model=model, args=args, train_dataset=ds)
    pulse = ClusterPulseCallback.attach(trainer, run="my-run")
    trainer.train(resume_from_checkpoint=pulse.resume_from())

What it maps, and why there: a step is one optimizer step, from `on_step_begin` (its
batches are here) to `on_step_end`; forward_backward ends at `on_pre_optimizer_step`,
so DDP's wait for peers (`attach_ddp` on the Trainer's DDP model, the reason `attach`
takes the Trainer: no callback event carries it) falls in it as in the plain recipe.
From one step's end to the next one's begin the Trainer fetches input: the data wait.
With `gradient_accumulation_steps` the Trainer fetches all of a step's micro-batches
there, then calls `on_step_begin` once, `on_substep_end` after each micro-batch but
the last, and `on_step_end` after the optimizer step: the events bracket the whole
optimizer step already. Its samples are counted per micro-batch trained (the
Trainer's batch size, `state.train_batch_size`), not as the batch size times the
accumulation: the epoch's last step has fewer micro-batches when they do not divide
the epoch. (No event carries a batch: a short last batch of an epoch, with one
process and no `dataloader_drop_last`, counts as a whole one.) The loss is the one the
Trainer logs (`on_log`, every `logging_steps`, after a step's end): it goes with the
next step's message; no step event carries the step's own.
For a model whose forward takes `**kwargs` (every stock one) it also all-gathers the
batch's label-token count there (`num_items_in_batch`), where a rank waits for a peer
still loading its batch: Pulse times a collective run while awaiting input as sync
wait, not data wait, so the data straggler stands out and its peers are not
input-bound.

Evaluations and saves the Trainer runs between steps are announced (`Pulse.evaluating`,
`Pulse.saving`: the absolute hang timeout, not the steady one, which paged every
evaluation or save longer than max(15 s, 3 x the p99 step) as a hang, the busy rank as
the root its peers wait for). No event comes before either; the Trainer decides both
in its DefaultFlowCallback's `on_step_end`, which runs before ours (a callback added
to a Trainer comes after its defaults), so ours reads `control.should_evaluate` and
`control.should_save` there (`eval_on_start`: at `on_train_begin`). An evaluation
started otherwise (a callback that asks for one after ours, `predict()` from a
callback) is announced at its first prediction step. Not announced: a save that a
callback after ours asks for, and a best-model save (`save_strategy="best"`, decided
after the evaluation, with no event when it is not made); an evaluation that a
callback after ours cancels leaves the phase open until the next step begins (its
fetch is then no data wait).

A graceful restart saves through the Trainer's own checkpoint (the one
`resume_from_checkpoint` reads, where it positions the data by skipping batch
indices, never reading the skipped samples): when the ranks agree to restart at a
step's end the callback asks the Trainer to save (`control.should_save`), and once
every rank has saved (`on_save`) `Pulse.boundary` finishes the protocol at that step.
An evaluation due there runs first and is kept: at an epoch's last step with
evaluations by epoch, the save is asked for at `on_epoch_end`, after which the Trainer
evaluates, and stands for a periodic save due at that step's end (asked for at the
step's end, the restart left before it, and that epoch was never evaluated); with
`save_strategy="best"` the Trainer decides the save after the evaluation (is it a new
best?) and dropped the restart's (no save, no `on_save`, no restart): the callback
sets the strategy to "steps" until `on_save`. No restart at the run's last step, nor
where a callback stopped training (early stopping): the run ends there (a resumed one
trained past its end). With an IterableDataset the Trainer knows no epoch length: an
epoch's evaluation is then made by the resumed run.
"""

from __future__ import annotations

import os
import re
from typing import Any

import torch.distributed as dist
from transformers import Trainer, TrainerCallback, TrainerControl, TrainerState
from transformers import TrainingArguments as Args
from transformers.trainer import TRAINER_STATE_NAME
from transformers.trainer_utils import PREFIX_CHECKPOINT_DIR, SaveStrategy

from clusterpulse.detection.state import STATE_FILE
from clusterpulse.integrations.steps import OpenStep
from clusterpulse.trainer.instrument import Pulse, ddp_of
from clusterpulse.trainer.parallel import init_distributed


class ClusterPulseCallback(TrainerCallback):
    """Telemetry, input stalls, compute versus sync wait, and graceful restarts for a
    Trainer; `agent` and `consensus_every` as for `Pulse`. Use `attach`."""

    def __init__(self, trainer: Trainer, run: str, agent: str | None = "env",
                 consensus_every: int = 5) -> None:
        self.trainer, self.run, self.agent = trainer, run, agent
        self.consensus_every = consensus_every
        self.pulse: Pulse | None = None
        self._step = OpenStep()
        self._restart_at: int | None = None  # agreed: leave once this step is saved
        self._best_strategy: Any = None  # args.save_strategy set aside for the restart
        self._after_epoch = False  # the restart's save waits for the epoch's evaluation
        self._training = False  # from on_train_begin to on_train_end
        self._between: Any = None  # an open Pulse.evaluating() or Pulse.saving()
        self._evaluations_due = 0  # on_evaluate events before that evaluation is over
        self._loss: float | None = None  # the last loss the Trainer logged, not yet sent

    @classmethod
    def attach(cls, trainer: Trainer, run: str, agent: str | None = "env",
               consensus_every: int = 5) -> ClusterPulseCallback:
        """Make one for `trainer` and add it to the Trainer's callbacks."""
        callback = cls(trainer, run, agent, consensus_every)
        trainer.add_callback(callback)
        return callback

    def resume_from(self) -> str | None:
        """The checkpoint to pass as `train(resume_from_checkpoint=...)`: the newest
        whole one in the Trainer's output_dir (its periodic saves and the graceful
        ones alike), or None on a first start.

        Whole: the Trainer writes a checkpoint folder in place and its state file
        last; a folder a crash cut short has none, and resuming from it silently
        started again at step 0 with its weights (`get_last_checkpoint` picks it)."""
        out = self.trainer.args.output_dir
        steps = {} if not out or not os.path.isdir(out) else {
            int(m[1]): os.path.join(out, m[0]) for name in os.listdir(out)
            if (m := re.fullmatch(rf"{PREFIX_CHECKPOINT_DIR}-(\d+)", name))}
        choice = [next((steps[s] for s in sorted(steps, reverse=True)
                        if os.path.isfile(os.path.join(steps[s], TRAINER_STATE_NAME))), None)]
        if dist.is_initialized() and dist.get_world_size() > 1:  # one answer: rank 0's
            dist.broadcast_object_list(choice, src=0)  # (a shared folder's listings
        return choice[0]  # may differ between ranks)

    # -- set-up and end ---------------------------------------------------------------
    def on_train_begin(self, args: Args, state: TrainerState, control: TrainerControl,
                       **kwargs: Any) -> None:
        self._forget_restart(args)  # one a failed train() left agreed
        if self.pulse is None or self.pulse.closed:  # a later train(): the last one closed it
            info = init_distributed()  # the Trainer's group (or ours); the agreed attempt
            # the straggler baselines beside the checkpoints, as the reference trainer
            # keeps them: a slow GPU's history outlives the job's restarts
            self.pulse = Pulse(run=self.run, agent=self.agent, restarts=info.attempt,
                               consensus_every=self.consensus_every,
                               straggler_state=os.path.join(args.output_dir, STATE_FILE)
                               if args.output_dir else None)
            ddp = ddp_of(self.trainer.model_wrapped)  # compiled or not (torch_compile)
            if ddp is not None:
                self.pulse.attach_ddp(ddp)
        self._loss = None
        self._training = True
        self._step.discard()  # one a failed train() left open
        self.pulse.awaiting_input()
        self._enter_between(evaluate=args.eval_on_start, save=False)  # runs right after

    def on_train_end(self, args: Args, state: TrainerState, control: TrainerControl,
                     **kwargs: Any) -> None:
        self._leave_between()
        self._training = False
        self._step.end()
        if self.pulse is not None:
            self.pulse.close("finished")

    # -- a step ---------------------------------------------------------------------------
    def on_step_begin(self, args: Args, state: TrainerState, control: TrainerControl,
                      **kwargs: Any) -> None:
        pulse = self._pulse()
        self._leave_between()  # whatever ran after the last step is over
        pulse.input_arrived()
        self._step.begin(pulse, state.global_step + 1, samples=0)  # counted as trained

    def on_substep_end(self, args: Args, state: TrainerState, control: TrainerControl,
                       **kwargs: Any) -> None:
        self._step.add(_batch_size(args, state))  # a micro-batch that stepped no optimizer

    def on_pre_optimizer_step(self, args: Args, state: TrainerState, control: TrainerControl,
                              **kwargs: Any) -> None:
        self._step.section("optimizer")

    def on_step_end(self, args: Args, state: TrainerState, control: TrainerControl,
                    **kwargs: Any) -> None:
        self._step.add(_batch_size(args, state))  # the step's last micro-batch
        self._step.end(self._loss)  # the loss logged since the last step's end, if any
        self._loss = None
        pulse = self._pulse()
        # Not at the last step: the run ends there anyway, and a resumed one trained a
        # step past max_steps (a review)
        if state.global_step < state.max_steps and pulse.restart_requested(state.global_step):
            # the Trainer saves right after this event (or after the epoch's
            # evaluation: on_epoch_end asks); on_save then leaves
            self._restart_at = state.global_step
            self._after_epoch = args.eval_strategy == "epoch" \
                and float(state.epoch or 0).is_integer()
            if not self._after_epoch:
                self._save_for_restart(args, control)
            else:  # one save, the restart's, after the evaluation: a periodic one due
                control.should_save = False  # now was a second full save of this step
        else:
            pulse.awaiting_input()
        # what the Trainer runs next, decided by its DefaultFlowCallback before us
        self._enter_between(evaluate=control.should_evaluate, save=control.should_save)

    def on_epoch_end(self, args: Args, state: TrainerState, control: TrainerControl,
                     **kwargs: Any) -> None:
        # the "epoch" strategies: decided as at a step's end, run after this event
        if self._after_epoch:  # the restart's save, after the epoch's evaluation
            self._after_epoch = False
            self._save_for_restart(args, control)
        self._enter_between(evaluate=control.should_evaluate, save=control.should_save)

    def on_log(self, args: Args, state: TrainerState, control: TrainerControl,
               logs: dict[str, Any] | None = None, **kwargs: Any) -> None:
        # No step event carries the loss: the Trainer logs it (the mean since its last
        # log, every `logging_steps`) after a step's end, and it goes with the next
        # step's message (the agent keeps the last one). Pulse leaves out one that is
        # not finite.
        loss = (logs or {}).get("loss")
        if isinstance(loss, int | float) and not isinstance(loss, bool):
            self._loss = float(loss)

    # -- evaluations and saves between steps ------------------------------------------------
    def on_prediction_step(self, args: Args, state: TrainerState, control: TrainerControl,
                           **kwargs: Any) -> None:
        if self._training and self._between is None:  # not announced at the step's end
            self._enter_between(evaluate=True, save=False)
            self._evaluations_due = 1  # this dataset's; a later one opens its own

    def on_evaluate(self, args: Args, state: TrainerState, control: TrainerControl,
                    **kwargs: Any) -> None:
        self._evaluations_due = max(self._evaluations_due - 1, 0)
        if self._evaluations_due:
            return  # an eval_dataset dict: each dataset's evaluation ends with this event
        self._leave_between()
        if self._training:  # the Trainer saves next if it decided to (a best-model
            # save is decided after this event, with no event if it is not: unannounced)
            self._enter_between(evaluate=False, save=control.should_save)

    def on_predict(self, args: Args, state: TrainerState, control: TrainerControl,
                   metrics: Any = None, **kwargs: Any) -> None:
        self._leave_between()  # a predict() run mid-training (opened at its first step)

    def on_save(self, args: Args, state: TrainerState, control: TrainerControl,
                **kwargs: Any) -> None:
        self._leave_between()
        if self._best_strategy is not None:  # the restart's save is made
            args.save_strategy, self._best_strategy = self._best_strategy, None
        pulse = self._pulse()
        if state.is_world_process_zero:
            pulse.checkpoint_committed(state.global_step)
        if self._restart_at is not None and control.should_training_stop:
            self._restart_at = None  # the run ends here (early stopping): no restart
        if self._restart_at is None or self._after_epoch:
            return  # (a save before the epoch's evaluation: the restart's comes after)
        # Every rank saved (the Trainer's save is collective): agree again at the same
        # step (the command or SIGTERM still stands), acknowledge, barrier, exit.
        pulse.boundary(self._restart_at, save=lambda step: None)
        self._restart_at = None  # the agreement did not hold (a checkpoint failed)
        pulse.awaiting_input()

    # -- helpers --------------------------------------------------------------------------
    def _save_for_restart(self, args: Args, control: TrainerControl) -> None:
        """Ask the Trainer to save now, for the agreed restart. With a best-model
        strategy it would decide that save again after an evaluation due with it and
        drop it: the strategy is "steps" until the save is made (on_save)."""
        control.should_save = True
        if args.save_strategy == SaveStrategy.BEST:
            self._best_strategy, args.save_strategy = args.save_strategy, SaveStrategy.STEPS

    def _forget_restart(self, args: Args) -> None:
        """No restart pending, and the user's save strategy back."""
        if self._best_strategy is not None:
            args.save_strategy, self._best_strategy = self._best_strategy, None
        self._restart_at, self._after_epoch = None, False

    def _enter_between(self, evaluate: bool, save: bool) -> None:
        """Announce an evaluation (else a save) the Trainer runs before the next step."""
        self._leave_between()
        if evaluate or save:
            pulse = self._pulse()
            self._between = pulse.evaluating() if evaluate else pulse.saving()
            self._between.__enter__()
        if evaluate:
            datasets = self.trainer.eval_dataset
            self._evaluations_due = len(datasets) if isinstance(datasets, dict) else 1

    def _leave_between(self) -> None:
        self._evaluations_due = 0
        if self._between is not None:
            self._between.__exit__(None, None, None)
            self._between = None

    def _pulse(self) -> Pulse:
        if self.pulse is None:
            raise RuntimeError("ClusterPulseCallback: the Trainer has not begun training "
                               "(add it with ClusterPulseCallback.attach(trainer, ...))")
        return self.pulse


def _batch_size(args: Args, state: TrainerState) -> int:
    """Samples in one of this process's batches: the Trainer's own (`auto_find_batch_
    size` may have lowered it), else the arguments' (per device, times the GPUs one
    process drives with DataParallel)."""
    return state.train_batch_size or args.train_batch_size
