"""The reference trainer as a GPU user runs it (issue #26 item 7): `--dtype bf16`
(autocast), `--compile`, and its throughput in the run summary. On CPU here; on CUDA
with MFU in tests/gpu/test_trainer_bf16.py."""

from __future__ import annotations

import pytest
import torch

from clusterpulse.trainer.config import parse_config
from tests.support.torchrun import run_trainer


def test_dtype_and_compile_flags():
    cfg = parse_config(["--dtype", "bf16", "--compile", "--ckpt-dir", "ckpt"])
    assert (cfg.dtype, cfg.compile) == ("bf16", True)
    assert (parse_config(["--ckpt-dir", "ckpt"]).dtype, parse_config([]).compile) == \
        ("fp32", False)


def test_a_bad_dtype_is_a_one_line_usage_error(capsys):
    with pytest.raises(SystemExit) as leave:
        parse_config(["--dtype", "fp8"])
    assert leave.value.code == 2
    err = capsys.readouterr().err
    assert "argument --dtype: invalid choice: 'fp8'" in err and "Traceback" not in err


def test_bf16_trains_in_bf16_and_the_summary_says_how_fast(tmp_path):
    bf16 = run_trainer(tmp_path / "bf16", nproc=1, steps=4, args=["--dtype", "bf16"])
    assert bf16.returncode == 0, bf16.log[-3000:]
    s = bf16.summary
    assert (s["dtype"], s["compile"]) == ("bf16", False)
    assert s["tokens_per_second"] > 0  # steps 2-4: 3 x 8 sequences x 32 tokens
    # MFU needs a GPU with a known peak (the H200 of tests/gpu/device_check.sh has one)
    assert (s["mfu"] is None) == (not torch.cuda.is_available())
    fp32 = run_trainer(tmp_path / "fp32", nproc=1, steps=4)
    assert fp32.returncode == 0, fp32.log[-3000:]
    assert fp32.summary["dtype"] == "fp32"
    assert fp32.digest != bf16.digest  # the forward really ran in bf16
