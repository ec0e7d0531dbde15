"""The bytes of DDP's gradient all-reduces as Pulse reports them, in two real gloo
ranks (tests/support/ddp_bytes_job.py): they were one model's bytes per backward,
whichever models it reduced, and fp32's under torch's fp16 compression hook, so the
achieved bandwidth read 2x to 500x off."""

from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path

import pytest

from clusterpulse.trainer.collectives import ring_allreduce_bytes

pytestmark = pytest.mark.integration

JOB = Path(__file__).resolve().parents[1] / "support" / "ddp_bytes_job.py"


def test_comm_bytes_count_every_reduced_model_and_a_compressed_wire(tmp_path):
    result = tmp_path / "bytes.json"
    run = subprocess.run(
        [sys.executable, "-m", "torch.distributed.run", "--standalone",
         "--nproc-per-node=2", "--monitor-interval=0.2", str(JOB), str(result)],
        capture_output=True, text=True, timeout=180, cwd=tmp_path,
        env={**os.environ, "OMP_NUM_THREADS": "1", "PYTHONPATH": str(JOB.parents[2])})
    assert run.returncode == 0, run.stdout[-2000:] + run.stderr[-3000:]
    got = json.loads(result.read_text())
    gen, disc = 64 * 64 + 64, 64 + 1  # parameters of the two Linear layers
    assert got == {
        "generator_and_discriminator": ring_allreduce_bytes(4 * (gen + disc), 2),
        "discriminator": ring_allreduce_bytes(4 * disc, 2),
        "fp16_compressed": ring_allreduce_bytes(2 * gen, 2)}
