"""On a machine with an NVIDIA GPU: the trainer's async checkpoints on CUDA, on the
machine's own torch (issue #26: on torch 2.11 every async save after the first failed
with `KeyError: <class 'type'>`, and a crash then resumed from the first one)."""

import pytest

from tests.support.torchrun import run_trainer

pytestmark = pytest.mark.gpu


def test_async_checkpoints_in_a_row_on_cuda_then_a_crash_resumes_from_the_last(tmp_path):
    r = run_trainer(tmp_path / "ckpt", nproc=1, steps=40, max_restarts=1, timeout=300,
                    args=["--preset", "small", "--dtype", "bf16", "--ckpt-every", "10",
                          "--async-ckpt", "--inject", "crash:rank=0:step=35"])
    assert r.returncode == 0, r.log[-3000:]
    assert "checkpoint at step" not in r.log, r.log[-3000:]  # no save failed (logged so)
    assert "resumed from step-00000030" in r.log, r.log[-3000:]  # saves 10, 20, 30 held
    assert [x["resume_step"] for x in r.summary["restarts"]] == [30]
