"""deploy/systemd/clusterpulse-egress on a "Prometheus host" (a network namespace of
its own, reaching an agent over a veth, as a remote host does): an agent counts a
remote peer by its address, so another user there spent that address's TLS handshake
budget and Prometheus's scrapes were closed unread. With the script's filter, the
host's kernel drops every new connection to the agents' port but those of processes
holding the allowed group (and root), at the source, and any forwarded through the
host (a container behind its address), and the scrapes are answered: a flood from
`nobody` and one from another service of the `prometheus` user (a review drove
Debian's blackbox exporter, which runs as `prometheus`, to flood the agent) alike."""

from __future__ import annotations

import os
import shutil
import subprocess
import tempfile
import time
from collections.abc import Iterator
from pathlib import Path

import pytest

from clusterpulse.agent.httpsafe import tls_context
from clusterpulse.agent.server import make_server, serve_in_thread
from clusterpulse.agent.tokens import Tokens
from tests.unit.test_control_tls import HELLOS, cert  # noqa: F401  (cert: a fixture)

pytestmark = pytest.mark.integration
REPO = Path(__file__).resolve().parents[2]
EGRESS = REPO / "deploy" / "systemd" / "clusterpulse-egress"
SCRAPER = "prometheus"  # Debian's Prometheus user (scripts/setup.sh installs it)
GROUP = "64123"  # the allowed group, by number: no group need be made on this host

# Prometheus: n HTTPS scrapes, one every 0.1 s; prints how many were answered 200.
SCRAPES = """
import http.client, ssl, sys, time
host, port, n = sys.argv[1], int(sys.argv[2]), int(sys.argv[3])
ctx = ssl.create_default_context()
ctx.check_hostname, ctx.verify_mode = False, ssl.CERT_NONE
ok = 0
for _ in range(n):
    try:
        c = http.client.HTTPSConnection(host, port, context=ctx, timeout=10)
        c.request("GET", "/metrics")
        ok += c.getresponse().status == 200
        c.close()
    except OSError:
        pass
    time.sleep(0.1)
print(ok, flush=True)
"""


def _ip(*args: str) -> None:
    subprocess.run(["ip", *args], check=True, capture_output=True, timeout=30)


@pytest.fixture
def prometheus_host() -> Iterator[tuple[str, str, str]]:
    """(netns, the container namespace behind it, the agent host's address on the veth
    between them). The container reaches the agent through the Prometheus host,
    masqueraded as its address (Docker's bridge networking)."""
    if os.geteuid() != 0:
        pytest.fail("this test makes a network namespace and plays other users: run as root")
    for tool in ("ip", "iptables", "setpriv"):
        if shutil.which(tool) is None:
            pytest.fail(f"{tool} is missing (scripts/setup.sh installs it)")
    pid, n = os.getpid(), os.getpid() % 200 + 20
    ns, ctr = f"cp-prom-{pid}", f"cp-ctr-{pid}"
    host_if, ns_if, ctr_if, bridge_if = f"cpe{pid}h", f"cpe{pid}n", f"cpe{pid}c", f"cpe{pid}b"
    agent_addr, prom_addr = f"10.252.{n}.1", f"10.252.{n}.2"
    _ip("netns", "add", ns)
    _ip("netns", "add", ctr)
    try:
        _ip("link", "add", host_if, "type", "veth", "peer", "name", ns_if)
        _ip("link", "set", ns_if, "netns", ns)
        _ip("addr", "add", f"{agent_addr}/30", "dev", host_if)
        _ip("link", "set", host_if, "up")
        _ip("-n", ns, "link", "add", bridge_if, "type", "veth", "peer", "name", ctr_if)
        _ip("-n", ns, "link", "set", ctr_if, "netns", ctr)
        for args in (["addr", "add", f"{prom_addr}/30", "dev", ns_if],
                     ["addr", "add", f"172.31.{n}.1/24", "dev", bridge_if],
                     ["link", "set", ns_if, "up"], ["link", "set", bridge_if, "up"],
                     ["link", "set", "lo", "up"]):
            _ip("-n", ns, *args)
        for args in (["addr", "add", f"172.31.{n}.2/24", "dev", ctr_if],
                     ["link", "set", ctr_if, "up"], ["link", "set", "lo", "up"],
                     ["route", "add", "default", "via", f"172.31.{n}.1"]):
            _ip("-n", ctr, *args)
        for cmd in (["sysctl", "-qw", "net.ipv4.ip_forward=1"],
                    ["iptables", "-t", "nat", "-A", "POSTROUTING", "-o", ns_if,
                     "-j", "MASQUERADE"],
                    ["iptables", "-I", "FORWARD", "-j", "ACCEPT"]):  # Docker's, on top
            subprocess.run(["ip", "netns", "exec", ns, *cmd], check=True, timeout=30)
        yield ns, ctr, agent_addr
    finally:
        subprocess.run(["ip", "link", "del", host_if], capture_output=True, timeout=30)
        for name in (ns, ctr):
            subprocess.run(["ip", "netns", "del", name], capture_output=True, timeout=30)


def _connects(ns: str, agent: str, port: int) -> bool:
    """Whether root in `ns` gets a TCP connection to the agent within 2 s."""
    probe = ("import socket, sys\ntry:\n socket.create_connection((sys.argv[1], "
             "int(sys.argv[2])), timeout=2).close(); print('yes')\nexcept OSError:\n"
             " print('no')")
    out = subprocess.run(["ip", "netns", "exec", ns, "/usr/bin/python3", "-c", probe, agent,
                          str(port)], capture_output=True, text=True, timeout=30)
    return out.stdout.strip() == "yes"


def _egress(ns: str, env: dict, *args: str) -> subprocess.CompletedProcess[str]:
    return subprocess.run(["ip", "netns", "exec", ns, str(EGRESS), *args], env=env,
                          capture_output=True, text=True, timeout=60)


def _raw_rules(ns: str) -> str:
    return subprocess.run(["ip", "netns", "exec", ns, "iptables", "-t", "raw", "-S"],
                          capture_output=True, text=True, check=True).stdout


def _as(ns: str, user: str, script: str, *args: object,
        groups: str | None = None) -> subprocess.Popen:
    """`script` as `user` in the namespace, with supplementary `groups` or none."""
    group = "nogroup" if user == "nobody" else user
    extra = [f"--groups={groups}"] if groups else ["--clear-groups"]
    return subprocess.Popen(["ip", "netns", "exec", ns, "setpriv", f"--reuid={user}",
                             f"--regid={group}", *extra, "/usr/bin/python3",
                             "-c", script, *map(str, args)],
                            stdout=subprocess.PIPE, text=True)


def _scrapes_answered_under_a_flood(ns: str, agent: str, port: int, flooder: str,
                                    n: int = 10) -> int:
    """Prometheus's n scrapes (its user, the allowed group) while `flooder` (a user
    without the group) sends ClientHellos as fast as it can."""
    flood = _as(ns, flooder, HELLOS, agent, port, 200)
    try:
        assert flood.stdout.readline().strip() == "started"
        time.sleep(1.0)
        scrapes = _as(ns, SCRAPER, SCRAPES, agent, port, n, groups=GROUP)
        out, _ = scrapes.communicate(timeout=180)
        return int(out.strip())
    finally:
        flood.kill()
        flood.wait()


def test_only_the_allowed_users_of_the_prometheus_host_reach_the_agents(
        prometheus_host, sim_agent, cert):  # noqa: F811
    ns, ctr, agent_addr = prometheus_host
    server = make_server(sim_agent.agent, agent_addr, 0, Tokens.single("t" * 24),
                         tls=tls_context(*cert))
    serve_in_thread(server)
    port = server.server_port
    env = {**os.environ, "AGENT_PORT": str(port), "ALLOW_GROUP": GROUP}
    try:
        # without the filter: one address, one budget; Prometheus's hellos lose
        answered = _scrapes_answered_under_a_flood(ns, agent_addr, port, "nobody")
        assert answered < 10 and server.refused_handshakes > 0, answered
        assert _connects(ctr, agent_addr, port)  # a container, through the host
        started = _egress(ns, env, "start")
        assert started.returncode == 0, started.stderr
        refused = server.refused_handshakes
        # another user, and another service of Prometheus's own user: neither gets here
        for flooder in ("nobody", SCRAPER):
            assert _scrapes_answered_under_a_flood(ns, agent_addr, port, flooder) == 10
            assert server.refused_handshakes == refused, flooder
        # nor a container behind the host, though an ACCEPT tops the filter table's
        # FORWARD (Docker moves its own there at each start: a review got through)
        assert not _connects(ctr, agent_addr, port)
        assert _egress(ns, env, "check").returncode == 0
        # a second start, on another port, replaces the rules in one transaction
        moved = {**env, "AGENT_PORT": str(port + 1)}
        assert _egress(ns, moved, "start").returncode == 0
        hooks = [r for r in _raw_rules(ns).splitlines() if "--dport" in r]
        assert [h.split()[1] for h in hooks] == ["PREROUTING", "OUTPUT"], hooks  # once each
        assert all(f"--dport {port + 1} " in h and "SYN" in h for h in hooks), hooks
        assert _egress(ns, env, "start").returncode == 0
        # a flush (a hand iptables-restore): `check` says so, of a hook or of the chain
        for flush, says in [("CLUSTERPULSE-EGRESS", "chain"), ("OUTPUT", "OUTPUT rule")]:
            subprocess.run(["ip", "netns", "exec", ns, "iptables", "-t", "raw", "-F", flush],
                           check=True)
            checked = _egress(ns, env, "check")
            assert checked.returncode == 1 and says in checked.stderr, checked.stderr
        # stop takes the filter away again, whole
        assert _egress(ns, env, "stop").returncode == 0
        assert "CLUSTERPULSE" not in _raw_rules(ns) and "clusterpulse" not in _raw_rules(ns)
        assert _connects(ctr, agent_addr, port)
    finally:
        _egress(ns, env, "stop")
        server.shutdown()


def test_bad_settings_are_named_in_one_line_and_nothing_is_changed(prometheus_host):
    ns = prometheus_host[0]
    for settings, says in [({"ALLOW_GROUP": "no-such-group"}, "no-such-group"),
                           ({"AGENT_PORT": "94x7"}, "94x7"), ({"AGENT_PORT": "70000"}, "70000"),
                           ({"AGENT_PORT": "0"}, "not '0'"), ({"AGENT_PORT": "010"}, "010")]:
        out = _egress(ns, {**os.environ, **settings}, "start")
        assert out.returncode == 2 and says in out.stderr and "Traceback" not in out.stderr
        assert out.stderr.count("\n") == 1, out.stderr  # one line
    # `check` from an unprivileged monitoring job: it cannot read the rules, and says so
    with tempfile.TemporaryDirectory() as readable:  # where nobody may read the script
        script = Path(readable) / "clusterpulse-egress"  # (a checkout under /root is not)
        shutil.copy(EGRESS, script)
        Path(readable).chmod(0o755)
        out = subprocess.run(["ip", "netns", "exec", ns, "setpriv", "--reuid=nobody",
                              "--regid=nogroup", "--clear-groups", str(script), "check"],
                             env={**os.environ, "ALLOW_GROUP": GROUP}, capture_output=True,
                             text=True, timeout=60)
    assert out.returncode == 2 and "needs root" in out.stderr, out.stderr
    assert "CLUSTERPULSE" not in _raw_rules(ns)


def test_on_iptables_legacy_too(prometheus_host, tmp_path):
    """Hosts on the legacy backend: its restore holds the xtables lock from its first
    line, and a rule listing read inside the pipe hung both forever (a review)."""
    import socket

    ns, _ctr, agent_addr = prometheus_host
    legacy = tmp_path / "legacy"
    legacy.mkdir()
    for name in ("iptables", "ip6tables", "iptables-restore", "ip6tables-restore"):
        (legacy / name).symlink_to("/usr/sbin/xtables-legacy-multi")
    listener = socket.create_server((agent_addr, 0))  # the kernel completes handshakes
    port = listener.getsockname()[1]
    env = {**os.environ, "PATH": f"{legacy}:{os.environ['PATH']}", "AGENT_PORT": str(port),
           "ALLOW_GROUP": GROUP}
    probe = ("import socket, sys\ntry:\n socket.create_connection((sys.argv[1], "
             "int(sys.argv[2])), timeout=2).close(); print('yes')\nexcept OSError:\n"
             " print('no')")

    def nobody_connects() -> bool:
        p = _as(ns, "nobody", probe, agent_addr, port)
        return p.communicate(timeout=30)[0].strip() == "yes"

    try:
        assert nobody_connects()
        for step in ("start", "check"):
            out = _egress(ns, env, step)
            assert out.returncode == 0, (step, out.stderr)
        assert not nobody_connects()
        assert _egress(ns, env, "stop").returncode == 0
        assert nobody_connects()
    finally:
        _egress(ns, env, "stop")
        listener.close()
