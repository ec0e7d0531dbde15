"""On a machine with an NVIDIA GPU: the trainer as GPU users run it, bf16 autocast and
torch.compile, reports its throughput and MFU in the run summary."""

import pytest

from tests.support.torchrun import run_trainer

pytestmark = pytest.mark.gpu


def test_a_bf16_compiled_run_reports_tokens_per_second_and_mfu(tmp_path):
    r = run_trainer(tmp_path / "ckpt", nproc=1, steps=30, timeout=300,
                    args=["--preset", "small", "--dtype", "bf16", "--compile",
                          "--global-batch", "32"])
    assert r.returncode == 0, r.log[-3000:]
    s = r.summary
    assert (s["dtype"], s["compile"]) == ("bf16", True)
    assert s["tokens_per_second"] > 0
    assert s["mfu"] is not None and 0 < s["mfu"] < 1, s  # the GPU's peak is in the table
