"""clusterpulse-detect replay: a recorded trace in, one JSON line per flag out, with
the cause; bad traces get a clear error, never a traceback."""

from __future__ import annotations

import csv
import json
import subprocess
import sys
from pathlib import Path

import numpy as np

from clusterpulse.detection.causes import attribute

RANKS, STEPS = 16, 200


def write_trace(path: Path, slow_rank: int | None = None, kind: str = "compute") -> None:
    rng = np.random.default_rng(3)
    with path.open("w", newline="") as f:
        w = csv.writer(f)
        w.writerow(["run", "step", "rank", "node", "step_seconds", "compute_seconds",
                    "data_seconds", "sync_seconds", "comm_seconds", "comm_bytes",
                    "clock_ratio"])
        for step in range(1, STEPS + 1):
            own = 0.1 * np.exp(rng.normal(0, 0.03, RANKS))
            data = np.full(RANKS, 0.005)
            comm = np.full(RANKS, 0.01)
            if slow_rank is not None and step > 120:
                if kind == "compute":
                    own[slow_rank] *= 1.3
                elif kind == "data_loading":
                    data[slow_rank] += 0.03
                    own[slow_rank] += 0.03
                elif kind == "communication":
                    comm[slow_rank] *= 4
                    own[slow_rank] += 0.03
            total = own.max() + 0.002
            for r in range(RANKS):
                w.writerow(["r1", step, r, f"n{r // 8}", f"{total:.5f}",
                            f"{own[r] - data[r]:.5f}", f"{data[r]:.5f}",
                            f"{total - own[r]:.5f}", f"{comm[r]:.5f}", "1e8", "0.95"])


def detect(*args: str) -> subprocess.CompletedProcess:
    return subprocess.run([sys.executable, "-m", "clusterpulse.detection.cli", *args],
                          capture_output=True, text=True, timeout=120)


def test_replay_prints_each_flag_with_rank_node_step_and_cause(tmp_path):
    for kind, rank in (("compute", 11), ("data_loading", 3), ("communication", 9)):
        trace = tmp_path / f"{kind}.csv"
        write_trace(trace, rank, kind)
        r = detect("replay", str(trace))
        assert r.returncode == 0, r.stderr
        flags = [json.loads(line) for line in r.stdout.splitlines()]
        assert [(f["rank"], f["cause"]) for f in flags] == [(rank, kind)], (kind, flags)
        assert flags[0]["node"] == f"n{rank // 8}" and 120 < flags[0]["step"] <= 140


def test_a_clean_trace_prints_nothing(tmp_path):
    trace = tmp_path / "clean.csv"
    write_trace(trace)
    r = detect("replay", str(trace))
    assert r.returncode == 0 and r.stdout == "", r.stdout + r.stderr


def test_bad_traces_get_a_clear_error(tmp_path):
    r = detect("replay", str(tmp_path / "nope.csv"))
    assert r.returncode == 2 and "no such file" in r.stderr and "Traceback" not in r.stderr
    r = detect("replay", str(tmp_path))  # found in review: said "no such file"
    assert r.returncode == 2 and r.stderr == (f"clusterpulse-detect: error: {tmp_path}: is a "
                                              "directory; name a trace file in it\n"), r.stderr
    bad = tmp_path / "bad.csv"
    bad.write_text("run,step,rank\nr,1,0\n")
    r = detect("replay", str(bad))
    assert r.returncode == 2 and "missing column(s) node, step_seconds" in r.stderr
    bad.write_text("run,step,rank,node,step_seconds,compute_seconds,data_seconds,sync_seconds\n"
                   "r,1,0,n,fast,1,0,0\n")
    r = detect("replay", str(bad))
    assert r.returncode == 2 and "line 2: step_seconds='fast' is not a number" in r.stderr


def test_rows_a_trace_cannot_hold_are_named_by_line(tmp_path, capsys):
    """Found by a review: step=inf was OverflowError, a field over csv's size limit a
    csv.Error, binary bytes a UnicodeDecodeError without the file; a fractional rank
    was silently truncated onto another rank."""
    from clusterpulse.detection.cli import main

    head = "run,step,rank,node,step_seconds,compute_seconds,data_seconds,sync_seconds\n"
    bad = tmp_path / "bad.csv"
    for body, why in (("r,inf,0,n,1,1,0,0\n", "line 2: step='inf' is not a whole number"),
                      ("r,1,0,n,1,1,0,0\nr,2,0.5,n,1,1,0,0\n",
                       "line 3: rank='0.5' is not a whole number"),
                      ("r,1,nan,n,1,1,0,0\n", "line 2: rank='nan' is not a whole number"),
                      (f"r,1,0,{'x' * 200_000},1,1,0,0\n", "line 2: not a CSV trace"),
                      (b"r,1,0,n,1,1,0,0\nr,\xff\xfe,0,n,1,1,0,0\n",
                       "bad.csv: not a CSV trace (not UTF-8 text)")):
        bad.write_bytes(head.encode() + (body if isinstance(body, bytes) else body.encode()))
        assert main(["replay", str(bad)]) == 2
        err = capsys.readouterr().err
        assert err.startswith("clusterpulse-detect: error: ") and why in err, err
        assert err.count("\n") == 1, err


def test_help_has_examples():
    r = detect("replay", "--help")
    assert r.returncode == 0 and "examples:" in r.stdout
    assert "clusterpulse-detect replay" in r.stdout


def test_cause_chain_ignores_power_cap_alone_and_uses_clocks():
    peers = {"own_seconds": 0.1, "data_seconds": 0.0}
    slow = {"own_seconds": 0.13, "data_seconds": 0.0}
    assert attribute({**slow, "clock_ratio": 0.9}, peers) == "compute"
    assert attribute({**slow, "clock_ratio": 0.6}, peers) == "slow_clocks"
    assert attribute({**slow, "thermal": 1, "clock_ratio": 0.6}, peers) == "thermal_throttling"
    assert attribute({**slow, "xid_recent": 1}, peers) == "gpu_errors"


def test_an_idle_gpus_low_clocks_are_not_slow_clocks():
    """Issue #27: a GPU lowers its clocks when it idles (NVML's reason gpu_idle): a rank
    starved of input, or waiting on a slow link, has an idle GPU with low clocks, and the
    chain called it slow_clocks before its real cause. A busy GPU's low clocks still are."""
    peers = {"own_seconds": 0.1, "data_seconds": 0.0}
    starved = {"own_seconds": 0.13, "data_seconds": 0.03, "clock_ratio": 0.2}
    assert attribute({**starved, "gpu_idle": 1}, peers) == "data_loading"
    assert attribute({**starved, "utilization": 0.05}, peers) == "data_loading"
    slow = {"own_seconds": 0.13, "data_seconds": 0.0, "clock_ratio": 0.45}
    assert attribute({**slow, "utilization": 0.05}, peers) == "compute"
    assert attribute({**slow, "gpu_idle": 0, "utilization": 0.98}, peers) == "slow_clocks"
    assert attribute({**slow, "gpu_idle": 1, "hw_slowdown": 1}, peers) == "slow_clocks"
