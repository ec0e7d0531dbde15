"""tests/bench/bench_gpu.py runs on a GPU machine only now and then: its CPU path runs
here on the tiny preset for a few steps (seconds), so that it cannot rot in between."""

from __future__ import annotations

import math

import pytest
import torch

from tests.bench import bench_gpu
from tests.bench.table import render


def test_the_cpu_path_takes_every_figure_it_can_and_names_the_rest():
    rows = bench_gpu.collect(bench_gpu.Options(
        device=torch.device("cpu"), presets=["tiny"], ckpt_presets=["tiny"], compile=False,
        blocks=2, steps=2, batch=4))
    table = render(rows)
    assert "NVML collection: skipped (no GPU)" in table
    assert "FAILED" not in table, table
    figures = {r.what.split(" (")[0]: r for r in rows if not math.isnan(r.ours)}
    assert {"step time instrumented", "paired difference instrumented - bare",
            "tokens/s, instrumented", "checkpoint blocking, async"} <= set(figures), table
    step = figures["step time instrumented"]
    assert step.ours > 0 and step.baseline and step.baseline > 0
    assert figures["checkpoint blocking, async"].baseline > 0  # the sync save, measured


def test_bad_arguments_are_one_line_errors(capsys):
    with pytest.raises(SystemExit) as leave:
        bench_gpu.main(["--cpu", "--blocks", "1"])
    assert leave.value.code == 2
    assert "--blocks must be >= 2" in capsys.readouterr().err


def test_a_part_past_the_time_budget_is_a_row_saying_so():
    rows = bench_gpu.collect(bench_gpu.Options(
        device=torch.device("cpu"), presets=["tiny"], ckpt_presets=[], compile=False,
        blocks=2, steps=1, batch=2, budget_s=0))
    assert any("overhead tiny, eager: skipped (time budget" in r.what for r in rows), rows
