"""clusterpulse.integrations.hf on a real transformers Trainer job (tests/support/
hf_job.py: a 1-layer GPT-2 built from a config in code, its forward taking **kwargs as
a stock model's does, so the Trainer gathers the batch's token count across ranks
between steps; 2 ranks, gloo) under
clusterpulse-train with a real agent, its ranks started warm (`--preload
transformers.trainer`): a compute straggler and a data straggler flagged on the right
rank, a graceful checkpoint-restart through the Trainer's own checkpoint, and a crash;
every resume starts at the step after its checkpoint, trains the batches the first
attempt trained at those steps without loading the skipped ones, and the epoch ends
having trained every sample once."""

from __future__ import annotations

import re
from pathlib import Path

import pytest

from clusterpulse.detection import state as straggler_state
from clusterpulse.detection.state import STATE_FILE
from tests.support.framework_faults import (
    assert_last_resume_loaded_only_its_batches,
    run_through_faults,
)
from tests.support.procs import REPO

pytestmark = [pytest.mark.integration, pytest.mark.slow]

JOB = REPO / "tests" / "support" / "hf_job.py"
BATCHES, BATCH_SIZE, WORLD = 400, 4, 2  # per rank; one epoch
LABELS = 8  # label tokens per sample (the job's; its wrapper is not a known causal LM,
# so the Trainer does not take the shifted first one off)


def test_hf_trainer_job_through_stragglers_graceful_restart_and_crash(tmp_path: Path):
    text = run_through_faults(tmp_path, JOB, [
        "--batches", str(BATCHES), "--batch-size", str(BATCH_SIZE),
        "--output-dir", str(tmp_path / "out"), "--step-seconds", "0.05"],
        "transformers.trainer", "hf")
    assert f"done: {BATCHES} steps" in text
    assert text.count("resuming from") == 2, text[-3000:]
    # (rank, step) -> the samples, for every time a step was trained (a crash replays
    # the steps since the checkpoint: they must get the same samples again)
    seen: dict[tuple[int, int], list[str]] = {}
    for r, s, idx in re.findall(r"trained rank=(\d) step=(\d+) idx=([\d,]+)", text):
        seen.setdefault((int(r), int(s)), []).append(idx)
    # the model's **kwargs got the Trainer's count of label tokens over every rank:
    # the all_gather between steps that a data straggler's peers wait in ran each step
    items = set(re.findall(r"trained rank=\d step=\d+ idx=[\d,]+ items=(-?\d+)", text))
    assert items == {str(BATCH_SIZE * LABELS * WORLD)}, items
    assert all(len(set(v)) == 1 for v in seen.values()), \
        {k: v for k, v in seen.items() if len(set(v)) > 1}
    assert sorted(seen) == [(r, s) for r in range(WORLD) for s in range(1, BATCHES + 1)]
    every = sorted(int(i) for v in seen.values() for i in v[0].split(","))
    assert every == list(range(BATCHES * BATCH_SIZE * WORLD))  # each sample once
    for m in re.finditer(r"resuming from \S*checkpoint-(\d+)", text):  # rank 0's next step
        first = re.search(r"trained rank=0 step=(\d+)", text[m.end():])
        assert first and int(first[1]) == int(m[1]) + 1, (m[0], first and first[0])
    assert_last_resume_loaded_only_its_batches(text, int(m[1]), BATCHES, BATCH_SIZE)
    # the straggler baselines of both GPUs outlive the job's restarts (rank 0 writes
    # them beside the checkpoints; each start reads them)
    assert len(straggler_state.load(tmp_path / "out" / STATE_FILE)) == WORLD
