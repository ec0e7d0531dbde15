"""The testbed itself: nodes talk over the bridge, have their own hostnames, faults are
real kernel events, and nothing is left behind however a run ends."""

from __future__ import annotations

import os
import shutil
import signal
import subprocess
import sys
import tempfile
from pathlib import Path

import pytest

from deploy.testbed import Testbed, net
from tests.support.procs import REPO, wait_until

pytestmark = pytest.mark.cluster

SERVER = """
import socket, sys
s = socket.socket(); s.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
s.bind(("0.0.0.0", int(sys.argv[1]))); s.listen()
print("listening", flush=True)
while True:
    c, addr = s.accept()
    n = 0
    while chunk := c.recv(65536):
        n += len(chunk)
    c.sendall(f"{addr[0]} {n}".encode()); c.close()
"""

CLIENT = """
import socket, sys, time
host, port, size = sys.argv[1], int(sys.argv[2]), int(sys.argv[3])
t = time.monotonic()
c = socket.create_connection((host, port), timeout=float(sys.argv[4]))
c.sendall(b"x" * size); c.shutdown(socket.SHUT_WR)
reply = c.recv(100).decode()
print(reply, time.monotonic() - t)
"""


def leftovers(prefix: str) -> list[str]:
    """Anything of run `prefix` still on the machine."""
    found = [n for n in net.list_netns() if n.startswith(prefix)]
    found += [link for link in net.list_links() if link.startswith(prefix)]
    if net.STATE_DIR.is_dir():
        found += [p.name for p in net.STATE_DIR.glob(f"{prefix}*")]
    return found


def send(node, host: str, port: int, size: int, timeout: float = 5) -> tuple[int, str, float]:
    r = node.run([sys.executable, "-c", CLIENT, host, str(port), str(size), str(timeout)],
                 timeout=120)
    if r.returncode:
        return r.returncode, r.stderr.strip().splitlines()[-1], 0.0
    peer, received, seconds = r.stdout.split()
    assert int(received) == size
    return 0, peer, float(seconds)


@pytest.fixture(scope="module")
def server(bed: Testbed, tmp_path_factory) -> int:
    """A byte-counting TCP server on node1 that answers with the peer's address."""
    port = 5301
    log = tmp_path_factory.mktemp("srv") / "server.log"
    bed.nodes[1].spawn([sys.executable, "-c", SERVER, str(port)], log=log)
    wait_until(lambda: "listening" in log.read_text(), 20, "server on node1")
    return port


def test_nodes_reach_each_other_over_the_bridge_not_loopback(bed, server):
    n0, n1 = bed.nodes[0], bed.nodes[1]
    rc, peer, _ = send(n0, n1.ip, server, 1000)
    assert rc == 0 and peer == n0.ip  # the server saw node0's own address: over the bridge
    # node0's loopback is its own: nothing of node1 listens there
    rc, err, _ = send(n0, "127.0.0.1", server, 10)
    assert rc != 0 and "Connection refused" in err
    # the root namespace (Prometheus, the dashboard) reaches node IPs via the bridge
    rc, peer, _ = send_from_root(n1.ip, server)
    assert rc == 0 and peer == bed.bridge_ip


def send_from_root(host: str, port: int) -> tuple[int, str, float]:
    r = subprocess.run([sys.executable, "-c", CLIENT, host, str(port), "10", "5"],
                       capture_output=True, text=True, timeout=60)
    if r.returncode:
        return r.returncode, r.stderr, 0.0
    peer, _, seconds = r.stdout.split()
    return 0, peer, float(seconds)


def test_each_node_has_its_own_hostname(bed):
    names = [n.run(["hostname"]).stdout.strip() for n in bed.nodes]
    assert names == [n.name for n in bed.nodes] == ["node0", "node1", "node2"]
    assert os.uname().nodename not in names  # the root namespace keeps its own


def test_nodes_carry_the_shipped_node_tuning():
    """Each node gets deploy/sysctl's settings in its own network namespace (the TCP
    backoff cap that decides how fast a job resumes after a partition); the machine's
    own namespace keeps its values."""
    from deploy.testbed.bed import NODE_SYSCTL

    settings = net.read_sysctl_conf(NODE_SYSCTL)
    assert "net.ipv4.tcp_rto_max_ms" in settings
    paths = {k: Path("/proc/sys") / k.replace(".", "/") for k in settings}
    root_before = {k: p.read_text() for k, p in paths.items() if p.exists()}
    with Testbed(nodes=2) as two:
        assert two.sysctl_missing == [k for k in settings if k not in root_before]
        if not root_before:
            pytest.skip(f"this kernel ({os.uname().release}) has none of {sorted(settings)}")
        for key in root_before:
            assert [n.run(["cat", str(paths[key])]).stdout.strip() for n in two.nodes] == \
                [settings[key]] * 2
        assert {k: paths[k].read_text() for k in root_before} == root_before


def test_a_sysctl_file_with_a_bad_line_is_named(tmp_path):
    conf = tmp_path / "bad.conf"
    conf.write_text("# comment\n-net.ipv4.tcp_retries2 = 15\nnet.ipv4.tcp_rto_max_ms 5000\n")
    with pytest.raises(net.TestbedError, match=r"bad.conf:3: expected KEY = VALUE"):
        net.read_sysctl_conf(conf)
    conf.write_text("# comment\n\n-net.ipv4.tcp_retries2 = 15\n")
    assert net.read_sysctl_conf(conf) == {"net.ipv4.tcp_retries2": "15"}
    with pytest.raises(net.TestbedError, match=r"vm\.swappiness: not per network namespace"):
        net.apply_sysctl("tb0000-node0", {"vm.swappiness": "10"})


def test_partition_cuts_the_link_and_heal_restores_it(bed, server):
    n0, n1, n2 = bed.nodes
    bed.partition(n0)
    try:
        rc, _, _ = send(n0, n1.ip, server, 10, timeout=2)
        assert rc != 0, "a partitioned node still reached its peer"
        assert send(n2, n1.ip, server, 10)[0] == 0  # the others still talk
    finally:
        bed.heal(n0)
    wait_until(lambda: send(n0, n1.ip, server, 10, timeout=2)[0] == 0, 30, "link healed")


def test_slow_link_throttles_throughput(bed, server):
    """Same bytes over a link shaped to 100 Mbit/s, then to 1/10 of that: the slow one
    takes many times longer (ratio with a wide margin, not a timing)."""
    n2, n1 = bed.nodes[2], bed.nodes[1]
    size = 2_000_000
    try:
        bed.slow_link(n2, rate="100mbit", burst="64kb", latency="400ms")
        rc, _, fast = send(n2, n1.ip, server, size, timeout=30)
        assert rc == 0
        bed.slow_link(n2, rate="10mbit", burst="64kb", latency="400ms")
        rc, _, slow = send(n2, n1.ip, server, size, timeout=60)
        assert rc == 0
    finally:
        bed.fix_link(n2)
    assert slow > 3 * fast, f"1/10 rate took {slow:.2f}s vs {fast:.2f}s"
    out = subprocess.run(["tc", "qdisc", "show", "dev", n2.host_veth], capture_output=True,
                         text=True).stdout
    assert "tbf" not in out  # fix_link removed the shaping


def test_node_death_kills_every_process_of_the_node_at_once(bed, tmp_path):
    node = bed.nodes[2]
    # a process tree that escapes its session: the child calls setsid()
    tree = ("import os, subprocess, sys, time\n"
            "subprocess.Popen([sys.executable, '-c', 'import os,time; os.setsid(); "
            "time.sleep(600)'])\ntime.sleep(600)\n")
    node.spawn([sys.executable, "-c", tree])
    wait_until(lambda: len(bed.find(node, "time.sleep(600)")) >= 2, 20, "process tree")
    killed = bed.kill_node(node)
    assert len(killed) >= 2
    assert node.pids() == []
    assert all(not Path(f"/proc/{p}").exists() or _zombie(p) for p in killed)


def _zombie(pid: int) -> bool:
    try:
        return Path(f"/proc/{pid}/stat").read_text().rsplit(")", 1)[1].split()[0] == "Z"
    except OSError:
        return True


def test_teardown_leaves_nothing_after_an_exception():
    with pytest.raises(RuntimeError), Testbed(nodes=2) as tb:
        prefix = tb.prefix
        tb.nodes[0].spawn(["sleep", "600"])
        assert leftovers(prefix)
        raise RuntimeError("a failing test")
    assert leftovers(prefix) == []


def _up_subprocess(tmp_path: Path) -> tuple[subprocess.Popen, str]:
    log = tmp_path / "up.log"
    p = subprocess.Popen([sys.executable, "-m", "deploy.testbed", "up", "--nodes", "2"],
                         cwd=REPO, stdout=open(log, "wb"), stderr=subprocess.STDOUT)  # noqa: SIM115
    line = wait_until(lambda: "Ctrl-C" in log.read_text() and log.read_text(), 30,
                      "testbed up")
    return p, line.split()[1].rstrip(":")


@pytest.mark.parametrize("sig", [signal.SIGTERM, signal.SIGINT])
def test_teardown_on_sigterm_and_ctrl_c(tmp_path, sig):
    p, prefix = _up_subprocess(tmp_path)
    assert len([n for n in net.list_netns() if n.startswith(prefix)]) == 2
    p.send_signal(sig)
    assert p.wait(timeout=90) == 0, (tmp_path / "up.log").read_text()
    assert leftovers(prefix) == []


def test_cleanup_removes_what_a_killed_run_left(tmp_path):
    p, prefix = _up_subprocess(tmp_path)
    p.kill()  # no teardown at all
    p.wait()
    assert leftovers(prefix)
    out = subprocess.run([sys.executable, "-m", "deploy.testbed", "cleanup"], cwd=REPO,
                         capture_output=True, text=True, timeout=60)
    assert out.returncode == 0, out.stderr
    assert prefix in out.stdout
    assert leftovers(prefix) == []


def test_two_runs_never_collide():
    with Testbed(nodes=1) as a, Testbed(nodes=1) as b:
        assert a.prefix != b.prefix and a.subnet != b.subnet
        assert send_ping(a, b) != 0  # separate bridges, separate subnets


def send_ping(a: Testbed, b: Testbed) -> int:
    r = a.nodes[0].run([sys.executable, "-c", CLIENT, b.nodes[0].ip, "9", "1", "1"])
    return r.returncode


def test_without_root_a_clear_error(tmp_path):
    """Run as `nobody`: the CLI says what privilege is missing and exits 2, no traceback."""
    if os.geteuid() != 0:
        pytest.skip("needs root to drop to nobody")
    # `nobody` must be able to read the code: a clone under a 0700 home (a fresh
    # machine's /root) is not, and Python said "No module named deploy" instead.
    with tempfile.TemporaryDirectory() as tree:
        os.chmod(tree, 0o755)
        shutil.copytree(REPO / "deploy", Path(tree) / "deploy",
                        ignore=shutil.ignore_patterns("__pycache__"))
        for path in Path(tree).rglob("*"):  # whatever the umask the clone was made with
            path.chmod(0o755 if path.is_dir() else 0o644)
        p = subprocess.run(["setpriv", "--reuid=nobody", "--regid=nogroup", "--clear-groups",
                            "/usr/bin/python3", "-m", "deploy.testbed", "up"], cwd=tree,
                           capture_output=True, text=True, timeout=60,
                           env={"PATH": os.environ["PATH"], "PYTHONPATH": tree})
    assert p.returncode == 2, p.stderr
    assert "needs root" in p.stderr and "Traceback" not in p.stderr
