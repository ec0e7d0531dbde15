"""clusterpulse.integrations.lightning on a real Lightning job (tests/support/
lightning_job.py: a tiny model built in code, 2 ranks, gloo) under clusterpulse-train
with a real agent, its ranks started warm (`--preload lightning.pytorch`): a compute
straggler and a data straggler flagged on the right rank with the right figures, a
crash before any graceful restart (resumed from Lightning's own ModelCheckpoint) and a
graceful checkpoint-restart; after each resume every rank trains exactly
the batches an uninterrupted run trains at that step (none replayed, none lost),
loading none of the batches it skips."""

from __future__ import annotations

import re
from pathlib import Path

import pytest
from torch.utils.data import DistributedSampler

from clusterpulse.detection import state as straggler_state
from clusterpulse.detection.state import STATE_FILE
from tests.support.framework_faults import (
    assert_last_resume_loaded_only_its_batches,
    run_through_faults,
)
from tests.support.procs import REPO

pytestmark = [pytest.mark.integration, pytest.mark.slow]

JOB = REPO / "tests" / "support" / "lightning_job.py"
BATCHES, BATCH_SIZE, WORLD = 400, 4, 2  # per rank per epoch; one epoch


def _expected_index(rank: int, step: int) -> int:
    """The first sample of a step's batch on a rank in an uninterrupted run: Lightning
    deals the training set with a shuffling DistributedSampler (seed 0, epoch 0)."""
    if rank not in _ORDER:
        sampler = DistributedSampler(range(BATCHES * BATCH_SIZE * WORLD), num_replicas=WORLD,
                                     rank=rank, shuffle=True, seed=0)
        sampler.set_epoch(0)
        _ORDER[rank] = list(sampler)
    return _ORDER[rank][(step - 1) * BATCH_SIZE]


_ORDER: dict[int, list[int]] = {}


def test_lightning_job_through_stragglers_graceful_restart_and_crash(tmp_path: Path):
    text = run_through_faults(tmp_path, JOB, [
        "--epochs", "1", "--batches", str(BATCHES), "--batch-size", str(BATCH_SIZE),
        "--checkpoints", str(tmp_path / "ckpts"), "--step-seconds", "0.05"],
        "lightning.pytorch", "lit")
    assert f"done: {BATCHES} steps" in text
    assert "not resumable" not in text  # Lightning found the loader's position
    # each resume started right after the checkpoint's step, on the batch due there
    trained = [(int(r), int(s), int(i)) for r, s, i in
               re.findall(r"trained rank=(\d) step=(\d+) idx=(\d+)", text)]
    assert trained and all(i == _expected_index(r, s) for r, s, i in trained), \
        [t for t in trained if t[2] != _expected_index(t[0], t[1])][:5]
    assert text.count("resuming from") == 2, text[-3000:]
    # the crash came before any graceful restart: Lightning's own last.ckpt (it had
    # retrained from step 0); the graceful restart: its newer save
    resumed = re.findall(r"resuming from (\S+) at step", text)
    assert [Path(f).name for f in resumed] == ["last.ckpt", "graceful.ckpt"], resumed
    for m in re.finditer(r"resuming from \S+ at step (\d+)", text):  # rank 0's next step
        first = re.search(r"trained rank=0 step=(\d+)", text[m.end():])
        assert first and int(first[1]) == int(m[1]) + 1, (m[0], first and first[0])
    assert_last_resume_loaded_only_its_batches(text, int(m[1]), BATCHES, BATCH_SIZE)
    last = {}
    for r, s, _ in trained:
        last[r] = s
    assert last == {0: BATCHES, 1: BATCHES}
    # the straggler baselines of both GPUs outlive the job's restarts (rank 0 writes
    # them beside the checkpoints; each start reads them)
    assert len(straggler_state.load(tmp_path / "ckpts" / STATE_FILE)) == WORLD
