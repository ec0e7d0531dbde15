"""A clean start prints no warnings: the README's warm `--script` start, as an operator
runs it (no OMP_NUM_THREADS, Python's default warning filters), to its end; and its
ranks meet on a port no other process is handed.

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

from clusterpulse.trainer.torchrun import NOT_STORE_PORTS, PORT_RANGE, store_port_range
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


# A rank that says the port its process group met on.
SAYS_ITS_PORT = """\
import os
from clusterpulse.trainer.parallel import init_distributed

info = init_distributed()
print(f"rank {info.rank} port {os.environ['MASTER_PORT']}", flush=True)
"""


@pytest.mark.parametrize("cold", [False, True], ids=["warm", "cold"])
def test_one_nodes_ranks_meet_on_a_port_no_other_process_is_handed(tmp_path, cold):
    """Each rendezvous round's fresh store is on a port torch found free and rank 0
    binds later: drawn from the kernel's ephemeral range, which any process's outgoing
    connection or bind(0) takes from, it was taken in between on a clean Debian machine
    with the other tests beside it (EADDRINUSE, the tutorial test). Now it is below
    that range, where only a bind to that very number can take it."""
    script = tmp_path / "says_its_port.py"
    script.write_text(SAYS_ITS_PORT)
    env = {**os.environ, "PYTHONPATH": str(REPO), "CLUSTERPULSE_AGENT": "none",
           "OMP_NUM_THREADS": "1"}
    span = store_port_range()
    if span is None:  # said, not silent: this host gives no such range
        pytest.skip(f"no ports below this host's ephemeral range ({PORT_RANGE})")
    r = subprocess.run([sys.executable, "-m", "clusterpulse.trainer.launch", "--nproc", "2",
                        *(["--cold-start"] if cold else ["--preload", "torch"]),
                        "--script", str(script)],
                       capture_output=True, text=True, timeout=300, cwd=tmp_path, env=env)
    assert r.returncode == 0, r.stdout[-2000:] + r.stderr[-2000:]
    # every round's (a rank of this script can abort at its exit, "terminate called
    # without an active exception", ~1 run in 8 before this change too: torchrun starts
    # a second round)
    ports = [int(p) for p in re.findall(r"rank \d+ port (\d+)", r.stdout)]
    low = int(PORT_RANGE.read_text().split()[0])
    assert ports and all(span[0] <= p <= span[1] < low for p in ports), (ports, span, low)
    assert not any(a <= p <= b for p in ports for a, b in NOT_STORE_PORTS), ports
