"""The agent's NIC selection against a real kernel's crowded network namespace: 200
veths (a Kubernetes node's pods), bridges (cni0, docker0), a tun and a VXLAN (flannel.1),
one veth shaped with tbf as another setup on the host shapes its own.
The unit tests read a tree written by hand; here /sys and `tc` are the kernel's, in a
namespace of the test's own (`ip netns exec` mounts that namespace's /sys)."""

from __future__ import annotations

import json
import os
import subprocess
import sys

import pytest

from tests.support.procs import REPO

pytestmark = pytest.mark.cluster

PAIRS = 100  # 200 veths

READ = """
import json, sys
from pathlib import Path
from clusterpulse.agent.links import NicCounters, NicSelection, QueueCounters
select = NicSelection(tuple(sys.argv[1:]), Path("/sys"))
print(json.dumps({"ports": sorted(p.device for p in NicCounters(Path("/sys"), select).ports()),
                  "queues": sorted(QueueCounters(select).queues())}))
"""


@pytest.fixture(scope="module")
def crowded_ns():
    name = f"cp-nics-{os.getpid()}"
    subprocess.run(["ip", "netns", "add", name], check=True)
    try:
        cmds = [f"link add vA{i:03d} type veth peer name vB{i:03d}" for i in range(PAIRS)]
        cmds += ["link add cni0 type bridge", "link add docker0 type bridge",
                 "tuntap add dev tun0 mode tun",
                 "link add flannel.1 type vxlan id 1 dstport 8472"]
        cmds += [f"link set vA{i:03d} up" for i in range(PAIRS)]
        cmds += ["link set cni0 up", "link set docker0 up"]
        subprocess.run(["ip", "-n", name, "-batch", "-"], input="\n".join(cmds) + "\n",
                       text=True, check=True, capture_output=True)
        subprocess.run(["tc", "-n", name, "qdisc", "add", "dev", "vA000", "root", "tbf",
                        "rate", "1mbit", "burst", "32kbit", "latency", "400ms"], check=True)
        yield name
    finally:
        subprocess.run(["ip", "netns", "delete", name], check=False)


def read_in(ns: str, *named: str) -> dict[str, list[str]]:
    p = subprocess.run(["ip", "netns", "exec", ns, sys.executable, "-c", READ, *named],
                       capture_output=True, text=True, timeout=60, cwd=REPO,
                       env={**os.environ, "PYTHONPATH": str(REPO)})
    assert p.returncode == 0, p.stderr
    return json.loads(p.stdout)


def test_a_crowded_namespace_has_no_link_of_the_node_by_default(crowded_ns):
    listed = subprocess.run(["ip", "-n", crowded_ns, "-o", "link"], capture_output=True,
                            text=True, check=True).stdout.count("\n")
    assert listed >= 2 * PAIRS + 5  # the kernel made them all
    got = read_in(crowded_ns)
    assert got == {"ports": [], "queues": []}  # not one veth, bridge or tunnel


def test_a_named_veth_is_read_with_its_shaped_queue(crowded_ns):
    """A testbed node whose only link is a veth names it with --nic."""
    got = read_in(crowded_ns, "vA000", "flannel.*")
    assert got["ports"] == ["flannel.1", "vA000"]
    assert got["queues"] == ["vA000"]  # its tbf root qdisc, read by the real tc
