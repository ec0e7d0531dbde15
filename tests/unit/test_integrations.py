"""The pieces of the framework callbacks that need no framework loop: the data wait a
callback measures between batches and between a step's micro-batches, and reading a
batch's size and a step's loss."""

from __future__ import annotations

import os
import time
from pathlib import Path
from typing import Any

import pytest
import torch

from clusterpulse.integrations.lightning import batch_size, loss_of
from clusterpulse.integrations.steps import OpenStep
from clusterpulse.trainer.instrument import Pulse, _CudaClock


def test_the_wait_between_a_batch_end_and_the_next_arrival_is_the_steps_data_wait():
    with Pulse(run="cb", agent="none", restarts=0, catch_sigterm=False) as pulse:
        pulse.awaiting_input()
        assert pulse.phase == "data"  # a rank hung in its input pipeline shows as such
        time.sleep(0.05)
        pulse.input_arrived()
        assert pulse.phase == "between"
        with pulse.step(1):
            pass
        assert pulse.last["data_wait_seconds"] >= 0.05
        pulse.input_arrived()  # no wait begun (a first batch): nothing counted
        with pulse.step(2):
            pass
        assert pulse.last["data_wait_seconds"] == 0.0


def test_batch_size_and_loss_in_the_forms_lightning_hands_them():
    assert batch_size((torch.zeros(7, 3), torch.zeros(7))) == 7
    assert batch_size({"x": torch.zeros(5, 2)}) == 5
    assert batch_size([torch.tensor(1.0), torch.zeros(4)]) == 4  # a scalar has no batch
    assert batch_size("no tensors") == 0
    loss = torch.tensor(0.5)
    assert loss_of({"loss": loss, "log": 1}) is loss and loss_of(loss) is loss


def test_a_step_opened_and_closed_from_separate_events_reports_its_sections():
    with Pulse(run="cb", agent="none", restarts=0, catch_sigterm=False) as pulse:
        open_step = OpenStep()
        open_step.section("optimizer")  # outside a step: nothing to do
        open_step.begin(pulse, 1, samples=8)
        assert pulse.phase == "forward_backward"
        time.sleep(0.02)
        open_step.section("optimizer")
        assert pulse.phase == "optimizer"
        ctx = open_step.ctx
        open_step.end(torch.tensor(0.25))
        assert open_step.ctx is None and pulse.phase == "between"
        assert ctx.sections["forward_backward"] >= 0.02 and "optimizer" in ctx.sections
        assert pulse.last["step_seconds"] >= 0.02 and pulse.last["loss"] == 0.25
        open_step.end()  # twice (an exception after the step): nothing


class _HostMarksAsDevice(_CudaClock):
    """The arithmetic Pulse does with CUDA events (device time between a step's marks,
    the host's waits between them taken out), on a machine without a GPU: its marks
    are host times."""

    def mark(self) -> float:
        return time.perf_counter()

    def elapsed(self, a: Any, b: Any) -> float | None:
        return b - a


@pytest.mark.parametrize("clock", ["host", "device"])
def test_input_awaited_between_a_steps_micro_batches_is_its_data_wait_not_compute(clock):
    with Pulse(run="cb", agent="none", restarts=0, catch_sigterm=False) as pulse:
        if clock == "device":
            pulse._clock = _HostMarksAsDevice()
        open_step = OpenStep()
        open_step.begin(pulse, 1, samples=4)
        open_step.section("data")  # the first micro-batch trained; the next one awaited
        assert pulse.phase == "data"
        time.sleep(0.05)
        open_step.add(4)
        open_step.section("forward_backward")
        ctx = open_step.ctx
        open_step.end()
        assert ctx.samples == 8
        last = pulse.last
        assert last["data_wait_seconds"] >= 0.05
        # the rank's own time, compute and input, lies within the step's: the wait
        # counted as compute as well was its own time twice (1e-9: float rounding)
        assert last["compute_seconds"] + last["data_wait_seconds"] \
            <= last["step_seconds"] + 1e-9, last


def _saved(path: Path, mtime: float) -> Path:
    torch.save({"global_step": 1}, path)
    os.utime(path, (mtime, mtime))
    return path


def test_lightning_resume_from_takes_the_newest_whole_checkpoint_of_ours_and_lightnings(
        tmp_path: Path):
    """A crash before any graceful restart resumes from Lightning's own last.ckpt (it
    retrained from step 0: resume_from() saw only the graceful file); the graceful
    save wins when newer; a torn file (a crash mid-write) is passed over."""
    import lightning.pytorch as pl
    from lightning.pytorch.callbacks import ModelCheckpoint

    from clusterpulse.integrations.lightning import ClusterPulseCallback

    pulse = ClusterPulseCallback(run="r", checkpoint=tmp_path / "graceful.ckpt", agent=None)
    periodic = ModelCheckpoint(dirpath=tmp_path, save_top_k=0, save_last=True)
    trainer = pl.Trainer(callbacks=[pulse, periodic], logger=False, accelerator="cpu",
                         enable_progress_bar=False, enable_model_summary=False)
    assert pulse.resume_from(trainer) is None  # a first start
    last = _saved(tmp_path / "last.ckpt", 1000)
    assert pulse.resume_from(trainer) == str(last)
    assert pulse.resume_from() is None  # without the Trainer: only the graceful file
    graceful = _saved(tmp_path / "graceful.ckpt", 2000)
    assert pulse.resume_from(trainer) == str(graceful)
    os.utime(last, (3000, 3000))  # Lightning saved again since
    assert pulse.resume_from(trainer) == str(last)
    last.write_bytes(last.read_bytes()[:-100])  # torn: its zip directory never written
    assert pulse.resume_from(trainer) == str(graceful)


def test_hf_resume_from_passes_over_a_checkpoint_folder_a_crash_cut_short(tmp_path: Path):
    """The Trainer writes checkpoint-N in place, its trainer_state.json last: a
    folder without it was picked (get_last_checkpoint) and the run silently began
    again at step 0 with its weights. The newest whole one is taken, by step."""
    from types import SimpleNamespace

    from clusterpulse.integrations.hf import ClusterPulseCallback

    pulse = ClusterPulseCallback(SimpleNamespace(args=SimpleNamespace(output_dir=str(tmp_path))),
                                 run="r", agent=None)
    assert pulse.resume_from() is None
    for step, whole in [(9, True), (10, True), (30, False), (20, True)]:
        folder = tmp_path / f"checkpoint-{step}"
        folder.mkdir()
        (folder / "model.safetensors").write_bytes(b"w")
        if whole:
            (folder / "trainer_state.json").write_text("{}")
    (tmp_path / "runs").mkdir()  # other folders in output_dir are not checkpoints
    assert pulse.resume_from() == str(tmp_path / "checkpoint-20")


def test_lightning_resume_from_looks_in_earlier_logger_versions_only_in_a_restart(
        tmp_path: Path, monkeypatch: pytest.MonkeyPatch):
    """A ModelCheckpoint without dirpath saves under the logger's version folder, a new
    one at each start: a crash resumed from step 0 (a review). In a restart of the job
    the earlier versions' last files count; on a first start (a new experiment) not."""
    import lightning.pytorch as pl
    from lightning.pytorch.callbacks import ModelCheckpoint
    from lightning.pytorch.loggers import CSVLogger

    from clusterpulse.integrations.lightning import ClusterPulseCallback

    before = tmp_path / "lightning_logs" / "version_0" / "checkpoints"
    before.mkdir(parents=True)
    last = _saved(before / "last.ckpt", 1000)
    pulse = ClusterPulseCallback(run="r", checkpoint=tmp_path / "graceful.ckpt", agent=None)
    trainer = pl.Trainer(callbacks=[pulse, ModelCheckpoint(save_last=True)],
                         logger=CSVLogger(tmp_path), default_root_dir=tmp_path,
                         accelerator="cpu", enable_progress_bar=False,
                         enable_model_summary=False)
    monkeypatch.setenv("TORCHELASTIC_RESTART_COUNT", "0")
    assert pulse.resume_from(trainer) is None  # a first start: version_1 is empty
    monkeypatch.setenv("TORCHELASTIC_RESTART_COUNT", "1")  # torchrun restarted it
    assert pulse.resume_from(trainer) == str(last)


class _Batches(torch.utils.data.Dataset):
    def __len__(self) -> int:
        return 12

    def __getitem__(self, i: int) -> torch.Tensor:
        return torch.full((2,), float(i))


def _fit(trainer: Any, model: Any) -> None:
    """Lightning's fit on _Batches (train and validation); the callback's world of one
    is not left to the next test."""
    try:
        loader = torch.utils.data.DataLoader(_Batches(), batch_size=2)
        trainer.fit(model, loader, torch.utils.data.DataLoader(_Batches(), batch_size=2))
    finally:
        if torch.distributed.is_initialized():
            torch.distributed.destroy_process_group()


def test_lightning_never_agrees_or_saves_at_an_epochs_last_batch_or_before_validation(
        tmp_path: Path, monkeypatch: pytest.MonkeyPatch):
    """Lightning 2.6 restores a checkpoint saved at an epoch's last batch as the epoch
    complete, and every later checkpoint of the resumed run says so too: resumed from
    one, a run trained that epoch again (a review, 40 steps where 30 were due). The
    callback runs the boundary (agreement, graceful save) at every other step."""
    import lightning.pytorch as pl

    from clusterpulse.integrations.lightning import ClusterPulseCallback

    class Tiny(pl.LightningModule):
        def __init__(self) -> None:
            super().__init__()
            self.net = torch.nn.Linear(2, 1)

        def training_step(self, batch, batch_idx):
            return self.net(batch).sum()

        def validation_step(self, batch, batch_idx):
            return None

        def configure_optimizers(self):
            return torch.optim.SGD(self.parameters(), lr=0.01)

    steps: list[int] = []
    monkeypatch.setattr(Pulse, "boundary", lambda self, step, save=None: steps.append(step))
    pulse = ClusterPulseCallback(run="r", checkpoint=tmp_path / "graceful.ckpt", agent=None)
    trainer = pl.Trainer(callbacks=[pulse], logger=False, enable_checkpointing=False,
                         accelerator="cpu", devices=1, max_epochs=2, val_check_interval=4,
                         limit_val_batches=1, num_sanity_val_steps=0,
                         enable_progress_bar=False, enable_model_summary=False)
    _fit(trainer, Tiny())
    assert trainer.global_step == 12
    # not 4 or 10 (validation follows), 6 or 12 (each epoch's last)
    assert steps == [1, 2, 3, 5, 7, 8, 9, 11], steps


def test_lightning_validation_is_phase_evaluate_and_training_takes_its_phase_back(
        tmp_path: Path):
    """A validation longer than the steady hang threshold paged as a hang (rank 0
    validating while its peers wait is the root): the callback announces it
    (Pulse.evaluating, the absolute timeout), sanity check included, and the best-model
    save a ModelCheckpoint makes after it (Lightning runs that callback last: closed at
    on_validation_end, the save was the next step's data wait)."""
    import lightning.pytorch as pl
    from lightning.pytorch.callbacks import ModelCheckpoint

    from clusterpulse.integrations.lightning import ClusterPulseCallback

    seen: list[tuple[str, str]] = []
    cb = ClusterPulseCallback(run="r", checkpoint=tmp_path / "graceful.ckpt", agent=None)

    class Tiny(pl.LightningModule):
        def __init__(self) -> None:
            super().__init__()
            self.net = torch.nn.Linear(2, 1)

        def training_step(self, batch, batch_idx):
            assert cb.pulse is not None
            seen.append(("train", cb.pulse.phase))
            return self.net(batch).sum()

        def validation_step(self, batch, batch_idx):
            assert cb.pulse is not None
            seen.append(("validate", cb.pulse.phase))
            self.log("val", self.net(batch).sum())

        def on_save_checkpoint(self, checkpoint):
            assert cb.pulse is not None
            seen.append(("save", cb.pulse.phase))

        def configure_optimizers(self):
            return torch.optim.SGD(self.parameters(), lr=0.01)

    best = ModelCheckpoint(dirpath=tmp_path / "best", monitor="val", save_top_k=1)
    trainer = pl.Trainer(callbacks=[cb, best], logger=False,
                         accelerator="cpu", devices=1, max_steps=6, val_check_interval=3,
                         limit_val_batches=1, num_sanity_val_steps=1,
                         enable_progress_bar=False, enable_model_summary=False)
    _fit(trainer, Tiny())
    validating = [phase for what, phase in seen if what == "validate"]
    assert len(validating) == 3 and set(validating) == {"evaluate"}, seen  # sanity + 2
    assert "evaluate" not in {phase for what, phase in seen if what == "train"}, seen
    saves = [phase for what, phase in seen if what == "save"]
    assert saves and set(saves) == {"evaluate"}, seen


class _Pairs(torch.utils.data.Dataset):
    def __len__(self) -> int:
        return 8

    def __getitem__(self, i: int) -> dict[str, torch.Tensor]:
        return {"x": torch.full((2,), float(i)), "labels": torch.tensor([float(i)])}


class _Regressor(torch.nn.Module):
    """A model the HF Trainer trains (its forward returns the loss in a dict); each
    forward calls `seen(training)` first."""

    def __init__(self, seen: Any) -> None:
        super().__init__()
        self.net = torch.nn.Linear(2, 1)
        self.seen = seen

    def forward(self, x, labels=None):
        self.seen(self.training)
        return {"loss": torch.nn.functional.mse_loss(self.net(x), labels)}


@pytest.mark.parametrize("strategy", ["steps", "epoch", "best", "two eval datasets"])
def test_hf_evaluations_and_saves_are_their_own_phases(tmp_path: Path, strategy: str):
    """An evaluation or a save the HF Trainer runs between steps was the next step's
    data wait, held to the steady hang threshold: one longer than max(15 s, 3 x the p99
    step) paged as a hang. The callback announces both (Pulse.evaluating, Pulse.saving):
    the Trainer's own evaluation at start, each later one, each save (after an
    evaluation too), by steps and by epochs; training steps and their input fetches
    stay out of them, and a step's data wait does not hold their time. A best-model
    save is decided after the evaluation, with no event when it is not made: it is
    not announced (announced in advance, a review found the next fetch in phase
    checkpoint and its data wait lost after every evaluation that was no new best). With
    a dict of eval datasets each one's evaluation ends with an on_evaluate: the phase
    stays evaluate until the last (a review: the second ran in phase checkpoint)."""
    from transformers import Trainer, TrainerCallback, TrainingArguments

    from clusterpulse.integrations.hf import ClusterPulseCallback

    seen: list[tuple[str, str, int]] = []
    data_waits: list[float] = []
    holder: list[ClusterPulseCallback] = []

    def forward(training: bool) -> None:
        pulse = holder[0].pulse
        assert pulse is not None
        if not training:
            time.sleep(0.15)  # an evaluation of 2 batches: 0.3 s, slower than a step
        seen.append(("train" if training else "evaluate", pulse.phase,
                     int(pulse.extra.get("checkpoint_in_progress", 0))))

    class Tiny(_Regressor):
        def state_dict(self, *args, **kwargs):  # the Trainer's save reads it
            pulse = holder[0].pulse
            if pulse is not None:
                seen.append(("save", pulse.phase,
                             int(pulse.extra.get("checkpoint_in_progress", 0))))
            return super().state_dict(*args, **kwargs)

    class Fetched(_Pairs):  # the training input: each fetch's phase
        def __getitem__(self, i: int) -> dict[str, torch.Tensor]:
            pulse = holder[0].pulse if holder else None
            if pulse is not None:
                seen.append(("fetch", pulse.phase,
                             int(pulse.extra.get("checkpoint_in_progress", 0))))
            return super().__getitem__(i)

    two = strategy == "two eval datasets"
    strategy = "steps" if two else strategy
    every = {"steps": {"eval_steps": 2, "save_steps": 2}, "epoch": {},
             "best": {"eval_strategy": "steps", "eval_steps": 2, "metric_for_best_model": "loss",
                      "greater_is_better": True}}[strategy]  # the loss falls: no best after
    args = TrainingArguments(**{"eval_strategy": strategy, **every},  # the first
                             output_dir=str(tmp_path), max_steps=4, per_device_train_batch_size=4,
                             per_device_eval_batch_size=4, save_strategy=strategy,
                             eval_on_start=True, report_to=[], use_cpu=True,
                             logging_strategy="no", disable_tqdm=True)
    trainer = Trainer(model=Tiny(forward), args=args, train_dataset=Fetched(),
                      eval_dataset={"a": _Pairs(), "b": _Pairs()} if two else _Pairs())
    holder.append(ClusterPulseCallback.attach(trainer, run="r", agent=None))

    class DataWaits(TrainerCallback):  # after ours: the steps it has resolved so far
        def on_step_end(self, args, state, control, **kwargs):
            pulse = holder[0].pulse
            assert pulse is not None
            data_waits.append(pulse.last.get("data_wait_seconds", 0.0))

    trainer.add_callback(DataWaits())
    try:
        trainer.train()
    finally:
        if torch.distributed.is_initialized():
            torch.distributed.destroy_process_group()
    evaluations = [(phase, busy) for what, phase, busy in seen if what == "evaluate"]
    saves = [(phase, busy) for what, phase, busy in seen if what == "save"]
    trained = {(phase, busy) for what, phase, busy in seen if what == "train"}
    fetched = {(phase, busy) for what, phase, busy in seen if what == "fetch"}
    # start + each of the 2 evaluations: 2 batches each, of each eval dataset
    assert evaluations == [("evaluate", 0)] * (12 if two else 6), seen
    if strategy == "best":
        assert saves == [("data", 0)], seen  # step 2's, unannounced; none at step 4
    else:
        assert saves == [("checkpoint", 1)] * 2, seen  # steps 2 and 4 (2 epochs of 2 steps)
    assert trained == {("forward_backward", 0)}, seen
    assert fetched == {("data", 0)}, seen
    assert len(data_waits) == 4 and max(data_waits) < 0.3, data_waits  # no evaluation's


@pytest.mark.parametrize("evaluations,saves", [("steps", "best"), ("epoch", "best"),
                                               ("epoch", "steps")])
def test_hf_graceful_restart_where_an_evaluation_is_due_evaluates_saves_and_leaves(
        tmp_path: Path, evaluations: str, saves: str):
    """A restart agreed at step 4, where an evaluation is due (every 2 steps, or at the
    end of the 4-step epoch). The Trainer decides a "best" save after the evaluation
    (is it a new best?) and overwrote the callback's request: no save, no on_save, no
    boundary, and the restart (or a preemption's save) never happened (a review). At
    an epoch's last step the restart left before the epoch's evaluation, which was
    never made, also when a periodic save (every 2 steps) fell there. Now the
    evaluation runs, then the save (one: the periodic one due there was a second full
    save of the step), and the rank leaves; the strategy is the user's again after the
    save."""
    from transformers import Trainer, TrainerCallback, TrainingArguments

    from clusterpulse.integrations.hf import ClusterPulseCallback

    evaluated: list[int] = []
    holder: list[ClusterPulseCallback] = []

    saved: list[int] = []

    class Command(TrainerCallback):  # as the agent delivers one, after step 3
        def on_step_end(self, args, state, control, **kwargs):
            pulse = holder[0].pulse
            if state.global_step == 3 and pulse is not None:
                pulse.commands["cmd-1"] = "checkpoint-restart"

        def on_save(self, args, state, control, **kwargs):  # runs after ours: not at 4
            saved.append(state.global_step)

    every = {"eval_steps": 2} if evaluations == "steps" else {}
    if saves == "steps":
        every["save_steps"] = 2
    args = TrainingArguments(output_dir=str(tmp_path), max_steps=8, per_device_train_batch_size=2,
                             per_device_eval_batch_size=8, eval_strategy=evaluations,
                             save_strategy=saves, metric_for_best_model="loss",
                             greater_is_better=True, report_to=[], use_cpu=True,
                             logging_strategy="no", disable_tqdm=True, **every)
    model = _Regressor(lambda training: training or evaluated.append(len(evaluated)))
    trainer = Trainer(model=model, args=args, train_dataset=_Pairs(), eval_dataset=_Pairs())
    holder.append(ClusterPulseCallback.attach(trainer, run="r", agent=None, consensus_every=2))
    trainer.add_callback(Command())
    try:
        with pytest.raises(SystemExit):
            trainer.train()
    finally:
        if torch.distributed.is_initialized():
            torch.distributed.destroy_process_group()
    assert (tmp_path / "checkpoint-4" / "trainer_state.json").is_file(), list(tmp_path.iterdir())
    # one batch of 8 per evaluation: steps 2 and 4, or the first epoch's end
    assert len(evaluated) == (2 if evaluations == "steps" else 1), evaluated
    assert trainer.args.save_strategy == saves
    assert 4 not in saved, saved  # the restart's save left in ours; none before it


@pytest.mark.parametrize("end", ["max_steps", "early stopping"])
def test_hf_no_restart_where_the_run_ends(tmp_path: Path, end: str):
    """A restart agreed at the run's last step (max_steps, mid-epoch) saved and left
    before the final evaluation, and the resumed run trained a step past max_steps; one
    agreed where a callback stops training after the epoch's evaluation (early
    stopping) left too, and the resumed run trained past the stop (reviews). The run
    just finishes there."""
    from transformers import Trainer, TrainerCallback, TrainingArguments

    from clusterpulse.integrations.hf import ClusterPulseCallback

    evaluated: list[int] = []
    holder: list[ClusterPulseCallback] = []

    stop_at = 4 if end == "early stopping" else None

    class Command(TrainerCallback):
        def on_step_end(self, args, state, control, **kwargs):
            pulse = holder[0].pulse
            if state.global_step == (stop_at or 6) - 1 and pulse is not None:
                pulse.commands["cmd-1"] = "checkpoint-restart"

        def on_evaluate(self, args, state, control, **kwargs):
            if state.global_step == stop_at:
                control.should_training_stop = True  # as EarlyStoppingCallback

    args = TrainingArguments(output_dir=str(tmp_path), max_steps=6, per_device_train_batch_size=2,
                             per_device_eval_batch_size=8, eval_strategy="epoch",
                             save_strategy="no", report_to=[], use_cpu=True,
                             logging_strategy="no", disable_tqdm=True)
    model = _Regressor(lambda training: training or evaluated.append(len(evaluated)))
    trainer = Trainer(model=model, args=args, train_dataset=_Pairs(), eval_dataset=_Pairs())
    holder.append(ClusterPulseCallback.attach(trainer, run="r", agent=None, consensus_every=2))
    trainer.add_callback(Command())
    try:
        trainer.train()  # no SystemExit
    finally:
        if torch.distributed.is_initialized():
            torch.distributed.destroy_process_group()
    if stop_at:
        assert trainer.state.global_step == 4 and len(evaluated) == 1, evaluated
    else:
        assert trainer.state.global_step == 6 and len(evaluated) == 2, evaluated  # 4, 6


def test_hf_a_train_that_failed_in_a_restart_evaluation_leaves_the_next_one_as_the_user_set_it(
        tmp_path: Path):
    """An evaluation that raised between a restart's agreement and its save (save_strategy
    "best", the callback having set it to "steps" for the restart's save) left the
    user's strategy changed: the next train() saved by steps (a review). It is theirs
    again when the next train() begins."""
    from transformers import Trainer, TrainerCallback, TrainingArguments

    from clusterpulse.integrations.hf import ClusterPulseCallback

    holder: list[ClusterPulseCallback] = []

    def forward(training: bool) -> None:
        if not training:
            raise RuntimeError("the evaluation failed")

    class Command(TrainerCallback):
        def on_step_end(self, args, state, control, **kwargs):
            pulse = holder[0].pulse
            if state.global_step == 3 and pulse is not None:
                pulse.commands["cmd-1"] = "checkpoint-restart"

    args = TrainingArguments(output_dir=str(tmp_path), max_steps=8, per_device_train_batch_size=2,
                             per_device_eval_batch_size=8, eval_strategy="epoch",
                             save_strategy="best", metric_for_best_model="loss", report_to=[],
                             use_cpu=True, logging_strategy="no", disable_tqdm=True)
    trainer = Trainer(model=_Regressor(forward), args=args, train_dataset=_Pairs(),
                      eval_dataset=_Pairs())
    holder.append(ClusterPulseCallback.attach(trainer, run="r", agent=None, consensus_every=2))
    trainer.add_callback(Command())
    try:
        with pytest.raises(RuntimeError, match="the evaluation failed"):
            trainer.train()
        assert trainer.args.save_strategy == "steps"  # the restart's, when it raised
        holder[0].on_train_begin(trainer.args, trainer.state, trainer.control)
        assert trainer.args.save_strategy == "best"
    finally:
        if torch.distributed.is_initialized():
            torch.distributed.destroy_process_group()


def test_the_ddp_model_torch_compile_wraps_is_attached(tmp_path: Path):
    """The HF Trainer with torch_compile=True holds compile(DDP) as `model_wrapped`: no
    DDP to an isinstance check, and attach_ddp was never called (a review: no sync wait,
    the slow rank's peers took its time for their compute)."""
    from types import SimpleNamespace

    from torch.nn.parallel import DistributedDataParallel

    from clusterpulse.integrations.hf import ClusterPulseCallback
    from tests.support.worlds import gloo_world_of_one

    with gloo_world_of_one():
        ddp = DistributedDataParallel(torch.nn.Linear(2, 1))
        compiled = torch.compile(ddp, backend="eager")
        callback = ClusterPulseCallback(SimpleNamespace(model_wrapped=compiled), run="r",
                                        agent=None)
        callback.on_train_begin(SimpleNamespace(output_dir=str(tmp_path), eval_on_start=False),
                                None, None)
        pulse = callback.pulse
        assert pulse is not None
        try:
            assert pulse._has_hook
        finally:
            pulse.close()
        from clusterpulse.trainer.instrument import ddp_of  # Lightning's look-up too

        assert ddp_of(compiled) is ddp and ddp_of(ddp) is ddp
        assert ddp_of(torch.compile(ddp.module, backend="eager")) is None


def _hf_trainer(tmp_path: Path, max_steps: int, logging_steps: int | None = None) -> Any:
    from transformers import Trainer, TrainingArguments

    logging = {"logging_strategy": "steps", "logging_steps": logging_steps} \
        if logging_steps else {"logging_strategy": "no"}
    args = TrainingArguments(output_dir=str(tmp_path), max_steps=max_steps,
                             per_device_train_batch_size=2, save_strategy="no", report_to=[],
                             use_cpu=True, disable_tqdm=True, **logging)
    return Trainer(model=_Regressor(lambda training: None), args=args, train_dataset=_Pairs())


def test_hf_a_second_train_reports_through_a_pulse_of_its_own(tmp_path: Path):
    """train() again with the same Trainer (a second stage): the callback kept the Pulse
    the first train() closed, and the second one's steps went nowhere (a review)."""
    from transformers import TrainerCallback

    from clusterpulse.integrations.hf import ClusterPulseCallback

    trainer = _hf_trainer(tmp_path, max_steps=2)
    callback = ClusterPulseCallback.attach(trainer, run="r", agent=None)
    seen: list[tuple[int, str | None]] = []

    class Open(TrainerCallback):  # after ours: the Pulse each step reported through
        def on_step_end(self, args, state, control, **kwargs):
            assert callback.pulse is not None
            seen.append((id(callback.pulse), callback.pulse.outcome))  # None: open

    trainer.add_callback(Open())
    try:
        trainer.train()
        trainer.train()
    finally:
        if torch.distributed.is_initialized():
            torch.distributed.destroy_process_group()
    assert [outcome for _, outcome in seen] == [None] * 4, seen
    assert len({pulse for pulse, _ in seen}) == 2  # one per train()
    assert callback.pulse is not None and callback.pulse.outcome == "finished"


def test_hf_the_loss_the_trainer_logs_is_reported(tmp_path: Path,
                                                    monkeypatch: pytest.MonkeyPatch):
    """No step event carries the loss, and HF jobs never reported one (a review): the
    loss the Trainer logs after a step's end goes with the next step's message."""
    from transformers import TrainerCallback

    from clusterpulse.integrations.hf import ClusterPulseCallback
    from clusterpulse.trainer.telemetry import AgentLink

    sent: list[dict[str, Any]] = []
    monkeypatch.setattr(AgentLink, "send", lambda self, msg, wait_s=0.0: sent.append(msg))
    trainer = _hf_trainer(tmp_path, max_steps=4, logging_steps=1)
    ClusterPulseCallback.attach(trainer, run="r", agent=None)
    logged: list[float] = []

    class Logged(TrainerCallback):
        def on_log(self, args, state, control, logs=None, **kwargs):
            if logs and "loss" in logs:
                logged.append(logs["loss"])

    trainer.add_callback(Logged())
    try:
        trainer.train()
    finally:
        if torch.distributed.is_initialized():
            torch.distributed.destroy_process_group()
    steps = [m for m in sent if m["type"] == "step"]
    assert len(logged) == 4 and [m["step"] for m in steps] == [1, 2, 3, 4]
    assert [m.get("loss") for m in steps] == [None, *logged[:3]], (steps, logged)


def test_lightning_a_second_fit_reports_through_a_pulse_of_its_own(tmp_path: Path):
    """The same callback in two fits (pretraining, then fine-tuning): setup kept the
    Pulse the first fit closed, and the second fit's steps went nowhere (a review)."""
    import lightning.pytorch as pl

    from clusterpulse.integrations.lightning import ClusterPulseCallback

    seen: list[tuple[int, str | None]] = []
    cb = ClusterPulseCallback(run="r", checkpoint=tmp_path / "graceful.ckpt", agent=None)

    class Tiny(pl.LightningModule):
        def __init__(self) -> None:
            super().__init__()
            self.net = torch.nn.Linear(2, 1)

        def training_step(self, batch, batch_idx):
            assert cb.pulse is not None
            seen.append((id(cb.pulse), cb.pulse.outcome))  # None: open
            return self.net(batch).sum()

        def configure_optimizers(self):
            return torch.optim.SGD(self.parameters(), lr=0.01)

    model = Tiny()
    for _ in range(2):
        trainer = pl.Trainer(callbacks=[cb], logger=False, enable_checkpointing=False,
                             accelerator="cpu", devices=1, max_steps=2,
                             limit_val_batches=0, num_sanity_val_steps=0,
                             enable_progress_bar=False, enable_model_summary=False)
        _fit(trainer, model)
    assert [outcome for _, outcome in seen] == [None] * 4, seen
    assert len({pulse for pulse, _ in seen}) == 2  # one per fit
    assert cb.pulse is not None and cb.pulse.outcome == "finished"
