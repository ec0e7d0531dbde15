"""The README's main command itself: the local cluster comes up healthy on every URL
it prints, trains, and stops on SIGINT (Ctrl-C) leaving no process behind."""

from __future__ import annotations

import os
import random
import re
import signal
import subprocess
import sys
import time
from pathlib import Path

import pytest
import requests

from clusterpulse.agent.identity import start_time
from deploy.local.stack import descendants, rank_pids
from deploy.testbed import net
from tests.support.procs import REPO, wait_until

pytestmark = [pytest.mark.e2e, pytest.mark.slow]


def processes_mentioning(text: str) -> list[int]:
    pids = []
    for proc in Path("/proc").iterdir():
        if not proc.name.isdigit() or int(proc.name) == os.getpid():
            continue
        try:
            cmdline = (proc / "cmdline").read_bytes().replace(b"\0", b" ").decode()
        except OSError:
            continue
        if text in cmdline:
            pids.append(int(proc.name))
    return pids


def test_local_cluster_starts_healthy_and_stops_clean(tmp_path):
    state = tmp_path / "state"
    # below the kernel's ephemeral ports (32768+), above the other tests' (stack.SERVICE_PORTS)
    base = random.randrange(25000, 30000, 100)
    p = subprocess.Popen([sys.executable, "deploy/local/cluster.py", "--state-dir", str(state),
                          "--base-port", str(base)], cwd=REPO, stdout=subprocess.PIPE,
                         stderr=subprocess.STDOUT, text=True)
    lines = []
    try:
        for line in p.stdout:
            lines.append(line)
            if "Press Ctrl-C to stop." in line:
                break
        out = "".join(lines)
        assert "ClusterPulse local cluster is up:" in out, out
        urls = dict(re.findall(r"^  (agent \d|prometheus|alertmanager|dashboard)\s+(\S+)$",
                               out, re.M))
        assert set(urls) == {"agent 0", "agent 1", "prometheus", "alertmanager", "dashboard"}
        assert requests.get(urls["agent 0"], timeout=5).text.count("clusterpulse_gpu_up{") == 4
        assert requests.get(urls["prometheus"] + "/-/ready", timeout=5).ok
        # Alertmanager's API asks for basic auth: nobody else can post an alert
        assert requests.get(urls["alertmanager"] + "/-/ready", timeout=5).status_code == 401
        am_password = (state / "alertmanager-password").read_text().strip()
        assert requests.get(urls["alertmanager"] + "/-/ready", timeout=5,
                            auth=("clusterpulse", am_password)).ok
        assert requests.get(urls["dashboard"] + "/_stcore/health", timeout=5).ok
        assert re.search(r"operator\s+name 'admin', password '\S+'", out)
        prom = urls["prometheus"]

        def training():
            r = requests.get(prom + "/api/v1/query", timeout=5,
                             params={"query": 'clusterpulse_trainer_step{run="demo"}'}).json()
            return len(r["data"]["result"]) == 4 and min(
                float(s["value"][1]) for s in r["data"]["result"]) > 5
        wait_until(training, 120, "4 ranks of the demo job training, seen by Prometheus")
        assert processes_mentioning(str(state))
        # ranks started warm carry their forkserver's command line, not the state dir:
        # every process of the demo is checked by its place in the tree
        assert len(rank_pids([p.pid])) == 4
        family = {pid: start_time(pid) for pid in descendants([p.pid])}
    finally:
        p.send_signal(signal.SIGINT)
        rest = p.communicate(timeout=60)[0]
    assert p.returncode == 0, "".join(lines) + rest
    assert "no process left behind" in rest
    time.sleep(1)
    assert processes_mentioning(str(state)) == []
    # the same processes (pid and start time), zombies aside: dead, awaiting a reaper
    assert [pid for pid, st in family.items() if st is not None and
            net.process_alive(pid, st)] == []

