"""A clean start prints no warnings: the README's warm `--script` start, as an operator
runs it (no OMP_NUM_THREADS, Python's default warning filters), to its end; and on one
node it cannot lose a race for its port.

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


# A rank that says which process listens on the port its process group met on.
WHO_HOLDS_THE_PORT = """\
import os
from pathlib import Path
from clusterpulse.trainer.parallel import init_distributed

info = init_distributed()
port = int(os.environ["MASTER_PORT"])
inodes = set()
for table in ("/proc/net/tcp", "/proc/net/tcp6"):
    for line in Path(table).read_text().splitlines()[1:]:
        f = line.split()
        if int(f[1].rsplit(":", 1)[1], 16) == port and f[3] == "0A":  # LISTEN
            inodes.add(f"socket:[{f[9]}]")
owners = set()
for fd_dir in Path("/proc").glob("[0-9]*/fd"):
    try:
        if any(os.readlink(fd) in inodes for fd in fd_dir.iterdir()):
            owners.add(int(fd_dir.parent.name))
    except OSError:
        continue
print(f"rank {info.rank} pid {os.getpid()} owners {sorted(owners)}", flush=True)
"""


def test_one_node_ranks_meet_on_a_port_their_launcher_already_holds(tmp_path):
    """On one node the ranks' process group meets on the store torchrun's agent bound
    (port 0: the kernel's choice, held before any rank starts), not on a port the agent
    found free, closed, and handed to rank 0 to bind: another process that took it in
    between failed the launch with EADDRINUSE (the tutorial test on a clean Debian
    machine, the other tests' processes beside it). Several nodes still get a fresh
    store per round (pytorch#135712; tests/cluster)."""
    script = tmp_path / "who_holds_the_port.py"
    script.write_text(WHO_HOLDS_THE_PORT)
    env = {**os.environ, "PYTHONPATH": str(REPO), "CLUSTERPULSE_AGENT": "none",
           "OMP_NUM_THREADS": "1"}
    r = subprocess.run([sys.executable, "-m", "clusterpulse.trainer.launch", "--nproc", "2",
                        "--cold-start", "--script", str(script)],
                       capture_output=True, text=True, timeout=300, cwd=tmp_path, env=env)
    assert r.returncode == 0, r.stdout[-2000:] + r.stderr[-2000:]
    got = {int(rank): (int(pid), owners) for rank, pid, owners in
           re.findall(r"rank (\d+) pid (\d+) owners \[([\d, ]*)\]", r.stdout)}
    assert sorted(got) == [0, 1], r.stdout
    holders = {int(x) for x in got[0][1].split(",") if x.strip()}
    ranks = {pid for pid, _ in got.values()}
    assert len(holders) == 1 and not holders & ranks, (holders, ranks)
