"""On a machine with NVIDIA GPUs: the trainer on CUDA with NCCL (picked by itself),
crash and restart ending with the fault-free parameters, as on CPU with gloo."""

import pytest
import torch

from tests.support.torchrun import run_trainer

pytestmark = pytest.mark.gpu


@pytest.mark.parametrize("parallel", ["ddp", "fsdp"])
def test_crash_restart_on_cuda_with_nccl_is_bit_identical(tmp_path, parallel):
    nproc = min(2, torch.cuda.device_count())
    args = ["--ckpt-every", "10", "--parallel", parallel, "--preset", "small"]
    clean = run_trainer(tmp_path / "clean", nproc=nproc, steps=40, args=args)
    assert clean.returncode == 0, clean.log[-3000:]
    crashed = run_trainer(tmp_path / "crash", nproc=nproc, steps=40, max_restarts=2,
                          args=[*args, "--inject", f"crash:rank={nproc - 1}:step=25"])
    assert crashed.returncode == 0, crashed.log[-3000:]
    assert "resumed from step-00000020" in crashed.log
    assert crashed.digest == clean.digest
