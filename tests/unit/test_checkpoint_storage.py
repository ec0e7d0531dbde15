"""Checkpoints on storage and settings the happy path does not meet: another model's
checkpoints in the directory, an unreadable newer checkpoint, a rank that cannot write
its checksums (a full disk), a read-only directory, a progress mark that cannot be
kept. Each lost checkpoints, stalled the job or crashed a rank."""

from __future__ import annotations

import errno
import logging
import time
from pathlib import Path

import pytest
import torch
from torch import nn
from torch.distributed.checkpoint.state_dict import get_model_state_dict

from clusterpulse.trainer.checkpoint import (
    CheckpointError,
    CheckpointManager,
    describe_error,
    model_mismatch,
    step_dir,
)
from clusterpulse.trainer.runstate import ProgressMark, RunState
from clusterpulse.trainer.state import TrainState


def _train_state(width: int) -> TrainState:
    model = nn.Sequential(nn.Linear(8, width), nn.Linear(width, 2))
    opt = torch.optim.AdamW(model.parameters())
    return TrainState(model, opt, torch.optim.lr_scheduler.LambdaLR(opt, lambda s: 1.0))


def _shapes(state: TrainState) -> dict[str, tuple[int, ...]]:
    return {k: tuple(v.shape) for k, v in get_model_state_dict(state.model).items()}


def test_a_checkpoint_of_another_model_is_named_not_blamed(tmp_path):
    """The run resumed with another --preset: every checkpoint verified, failed to load
    and was renamed unusable-*, and the corrected run started from step 0. The
    difference is named before any load (nothing is moved)."""
    mgr = CheckpointManager(tmp_path, rank=0)
    mgr.save(5, {"app": _train_state(16)})
    path = step_dir(tmp_path, 5)
    assert model_mismatch(path, _shapes(_train_state(16))) is None
    other = model_mismatch(path, _shapes(_train_state(32)))
    assert other == "3 parameter(s) of another shape (0.bias: [16] there, [32] here)"
    deeper = nn.Sequential(nn.Linear(8, 16), nn.Linear(16, 2), nn.Linear(2, 2))
    assert model_mismatch(path, {k: tuple(v.shape) for k, v in deeper.state_dict().items()}
                          ) == "2 of this model's parameters not there (2.bias, ...)"
    assert model_mismatch(tmp_path / "nothing-here", _shapes(_train_state(16))) is None


def test_the_cause_of_a_failed_load_or_save_is_the_ranks_own_error():
    from torch.distributed.checkpoint.api import CheckpointException

    inner = RuntimeError("size mismatch for 0.weight\nmore lines")
    err = CheckpointException("ranks:dict_keys([0])", {0: (inner, None)})
    assert describe_error(err) == "RuntimeError: size mismatch for 0.weight"
    assert describe_error(OSError(errno.ENOSPC, "No space left on device")) == \
        "OSError: [Errno 28] No space left on device"


def test_a_newer_checkpoint_the_run_skipped_holds_no_slot(tmp_path):
    """An unreadable step-90 left from an earlier timeline (the resume skipped it): with
    --keep 1 every fresh checkpoint was deleted as it was published, and the next crash
    restarted from step 0."""
    stale = step_dir(tmp_path, 90)
    stale.mkdir()
    mgr = CheckpointManager(tmp_path, rank=0, keep=1)
    for step in (20, 30):
        mgr.save(step, {"w": torch.full((4,), float(step))})
    assert sorted(p.name for p in tmp_path.iterdir() if p.name.startswith("step-")) == [
        "step-00000030", "step-00000090"]


def test_a_rank_that_cannot_write_its_checksums_fails_the_save_at_once(tmp_path, monkeypatch):
    """A full disk after the data was written: rank 1's checksums failed, and rank 0
    waited the publish timeout (300 s) with every rank behind it, at every save."""
    tmp = tmp_path / ".tmp-step-00000010"
    tmp.mkdir()
    writer = CheckpointManager(tmp_path, rank=1)

    def full_disk(_tmp: Path) -> None:
        raise OSError(errno.ENOSPC, "No space left on device")

    monkeypatch.setattr(writer, "_write_sums_file", full_disk)
    with pytest.raises(OSError):
        writer._write_own_sums(tmp)
    publisher = CheckpointManager(tmp_path, rank=0)
    publisher.publish_timeout_s = 60.0
    with pytest.raises(CheckpointError, match=r"a rank could not write its checksums "
                                              r"\(checksums-rank1.failed"):
        publisher._gather_sums(tmp, ["__1_0.distcp"])


def test_a_checkpoint_directory_that_cannot_be_written_is_named_at_the_start():
    """A read-only directory (a snapshot, a ro mount) let the run resume and then die at
    its first write with a traceback, in a crash loop. /proc/self: a directory no one
    can create a file in, root included."""
    with pytest.raises(OSError, match="--ckpt-dir is not writable") as err:
        CheckpointManager(Path("/proc/self"), rank=0)
    assert err.value.filename == "/proc/self"


def test_a_full_disk_at_the_start_does_not_stop_the_run(tmp_path, monkeypatch, caplog):
    """Only a refusal that lasts (read-only, no permission) stops the start: out of
    inodes, the test write failed with ENOSPC and the run, which resumed and trained
    before (its saves failing and counted), no longer started (a review)."""
    def full(self: Path, *args: object, **kwargs: object) -> None:
        raise OSError(errno.ENOSPC, "No space left on device", str(self))

    monkeypatch.setattr(Path, "touch", full)
    with caplog.at_level(logging.WARNING, logger="clusterpulse.trainer.checkpoint"):
        CheckpointManager(tmp_path, rank=0)
    assert any("a test write failed (No space left on device)" in r.getMessage()
               for r in caplog.records)


def test_a_progress_mark_that_cannot_be_kept_loses_the_mark_not_the_run(tmp_path, caplog):
    """On a full disk the mark's write raised in rank 0's loop at its first step."""
    with caplog.at_level(logging.WARNING, logger="clusterpulse.trainer.runstate"):
        mark = ProgressMark(tmp_path / "no-such-dir" / "run-state.progress")
        state = RunState()
        state.last_step, state.last_step_unix = 3, time.time()
        mark.write(state)
        mark.write(state)
        mark.close()
    warned = [r.getMessage() for r in caplog.records if "progress mark" in r.getMessage()]
    assert len(warned) == 1 and "not kept" in warned[0]
