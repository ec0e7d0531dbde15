"""A clean start prints no warnings: the README's warm `--script` start, as an operator
runs it (no OMP_NUM_THREADS, Python's default warning filters), to its end.

Found: every start printed runpy's RuntimeWarning "'clusterpulse.trainer.warmstart'
found in sys.modules ... prior to execution" once per rank (multiprocessing ran the
launcher's main module again in each warm rank, which had already imported it), and
torchrun's four-line OMP_NUM_THREADS banner."""

from __future__ import annotations

import os
import re
import subprocess
import sys

import pytest

from tests.support.procs import REPO

pytestmark = pytest.mark.integration
# Python's warnings ("...: RuntimeWarning: ...") and torch's logged ones ("W1204 17:36...")
WARNING = re.compile(r"\w+Warning\b|^W\d{4} ", re.M)


def test_warm_script_start_prints_no_warnings(tmp_path):
    env = {k: v for k, v in os.environ.items()
           if k not in ("OMP_NUM_THREADS", "PYTHONWARNINGS")}
    env.update({"PYTHONPATH": str(REPO), "CLUSTERPULSE_AGENT": "none"})
    r = subprocess.run([sys.executable, "-m", "clusterpulse.trainer.launch", "--nproc", "2",
                        "--script", str(REPO / "examples/ddp_tutorial.py"),
                        "--preload", "torch", "--", "1", "1"],
                       capture_output=True, text=True, timeout=600, cwd=tmp_path, env=env)
    assert r.returncode == 0 and "done: " in r.stdout, r.stdout[-2000:] + r.stderr[-2000:]
    assert not WARNING.search(r.stderr), r.stderr
