"""A job's checkpoints survive a torch upgrade or downgrade of its image: written by the
newest torch this project tests and resumed by the oldest it supports, and back
(through the trainer, one rank each). Both directions lost every checkpoint: the
scheduler's and AdamW's settings differ between the two (`app.sched.verbose`,
`app.optim.param_groups.0.decoupled_weight_decay`), the load failed on that missing
key, each checkpoint was set aside as unusable and the job started from step 0.

It runs in the oldest-torch suite (scripts/test-oldest-torch.sh), which has both
interpreters: this one and the main venv's."""

from __future__ import annotations

import os
import subprocess
import sys
from pathlib import Path

import pytest

from clusterpulse.trainer.torch_support import OLDEST, installed, release

pytestmark = pytest.mark.integration

REPO = Path(__file__).resolve().parents[2]
NEWEST = REPO / ".venv" / "bin" / "python"


def _train(python: Path | str, ckpt: Path, steps: int) -> subprocess.CompletedProcess:
    return subprocess.run(
        [str(python), "-m", "torch.distributed.run", "--standalone", "--nproc-per-node=1",
         "--monitor-interval=0.2", "-m", "clusterpulse.trainer", "--preset", "tiny",
         "--steps", str(steps), "--ckpt-dir", str(ckpt), "--ckpt-every", "5",
         "--agent", "none"],
        capture_output=True, text=True, timeout=240, cwd=ckpt.parent,
        env={**os.environ, "OMP_NUM_THREADS": "1", "PYTHONPATH": str(REPO)})


@pytest.mark.skipif(release(installed()) != OLDEST,
                    reason="runs on the oldest torch (scripts/test-oldest-torch.sh), against "
                           "the main venv's torch")
@pytest.mark.parametrize("writer", ["newest", "oldest"])
def test_a_checkpoint_resumes_on_the_other_torch(tmp_path, writer):
    assert NEWEST.exists(), f"{NEWEST}: the main venv (scripts/test.sh builds it first)"
    first, second = (NEWEST, sys.executable) if writer == "newest" else (sys.executable, NEWEST)
    wrote = _train(first, tmp_path / "ckpt", 10)
    assert wrote.returncode == 0, (wrote.stdout + wrote.stderr)[-3000:]
    resumed = _train(second, tmp_path / "ckpt", 15)
    log = resumed.stdout + resumed.stderr
    assert resumed.returncode == 0, log[-3000:]
    assert "resumed from step-00000010" in log and "unusable" not in log, log[-3000:]
    assert "written by another torch; they keep this run's values" in log, log[-3000:]
