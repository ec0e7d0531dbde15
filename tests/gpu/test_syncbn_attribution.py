"""On a machine with two or more NVIDIA GPUs: the real `nn.SyncBatchNorm` under NCCL.
A rank slower before the norm is found alone; its peer's wait in SyncBatchNorm's
all-gather (forward) is sync wait, timed by CUDA events around the wrapped
`torch.distributed` call, not its compute (issue #31; on CPU the same is tested with
a batch-statistics all-reduce, since SyncBatchNorm raises on CPU input:
tests/integration/test_attribution.py).

Two ranks of NCCL need two GPUs (NCCL refuses two ranks of one communicator on one
device), so on a single-GPU machine this skips."""

import pytest
import torch

from tests.support.buffers_job import DELAY_S, WORK_S, run_ranks

pytestmark = [
    pytest.mark.gpu,
    pytest.mark.skipif(torch.cuda.device_count() < 2,
                       reason="SyncBatchNorm under NCCL needs 2 ranks on 2 GPUs (NCCL "
                              "refuses two ranks on one device); this machine has "
                              f"{torch.cuda.device_count()}"),
]

RANKS, SLOW, STEPS = 2, 1, 30


def test_a_wait_in_syncbatchnorm_is_sync_wait_not_compute(tmp_path):
    figures = run_ranks(tmp_path, "syncbn", RANKS, SLOW, STEPS)
    slow, peer = figures[SLOW], figures[1 - SLOW]
    assert slow["compute_seconds"] > WORK_S + 0.7 * DELAY_S, figures
    assert slow["straggler_score"] > 1.5, figures
    assert peer["compute_seconds"] < WORK_S + 0.3 * DELAY_S, figures
    assert peer["sync_wait_seconds"] > 0.6 * DELAY_S, figures
    assert peer["straggler_score"] < 1.15, figures
