"""N nodes on one machine, each with its own network and hostname, and real faults.

    with Testbed(nodes=4) as bed:           # needs root; see missing_privileges()
        p = bed.nodes[1].spawn(["python", "-m", "clusterpulse.agent", ...], log=path)
        bed.partition(bed.nodes[2]); ...; bed.heal(bed.nodes[2])
        bed.kill_node(bed.nodes[3])          # every process of the node, at once

Each node is a network namespace joined to a bridge in the root namespace by a veth
pair; the bridge holds the subnet's first address, so Prometheus, Alertmanager and the
dashboard in the root namespace reach every node at its IP. A node's processes also
share a UTS namespace carrying its hostname. Teardown runs on normal exit, on an
exception, on KeyboardInterrupt and on SIGTERM (turned into KeyboardInterrupt while a
testbed is up); `python -m deploy.testbed cleanup` removes what a killed run left.
"""

from __future__ import annotations

import atexit
import contextlib
import os
import secrets
import shutil
import signal
import subprocess
import threading
import time
from collections.abc import Sequence
from dataclasses import dataclass, field
from pathlib import Path

from deploy.testbed import net
from deploy.testbed.net import TestbedError

# A node is provisioned as the deploy files say a training node should be.
NODE_SYSCTL = Path(__file__).resolve().parents[1] / "sysctl" / "90-clusterpulse-training.conf"


@dataclass
class Node:
    """One node of the testbed. `ip` is reachable from the root namespace and from
    every other node; processes started with `spawn` live in the node's namespaces."""

    index: int
    name: str  # its hostname
    netns: str
    ip: str
    host_veth: str  # the bridge side of its link; faults on the link act here
    bed: Testbed = field(repr=False)
    procs: list[subprocess.Popen] = field(default_factory=list, repr=False)

    def command(self, args: Sequence[str]) -> list[str]:
        """`args` wrapped to run inside this node (network + UTS namespaces). Not
        `ip netns exec`, which remounts /sys and hides /sys/fs/cgroup."""
        return ["nsenter", f"--net={net.NETNS_DIR / self.netns}",
                f"--uts={net.uts_path(self.netns)}", "--", *args]

    def spawn(self, args: Sequence[str], log: Path | None = None, env: dict | None = None,
              cwd: Path | None = None) -> subprocess.Popen:
        """Start a process on this node (its own session), output to `log`."""
        out = open(log, "ab") if log else subprocess.DEVNULL  # noqa: SIM115 - the child owns it
        try:
            p = subprocess.Popen(self.command(args), stdout=out, stderr=subprocess.STDOUT,
                                 stdin=subprocess.DEVNULL, cwd=cwd, start_new_session=True,
                                 env={**os.environ, **(env or {})})
        finally:
            if log:
                out.close()
        self.procs.append(p)
        return p

    def run(self, args: Sequence[str], timeout: float = 60) -> subprocess.CompletedProcess:
        """Run a command on this node to completion and return its output."""
        return subprocess.run(self.command(args), capture_output=True, text=True,
                              timeout=timeout)

    def pids(self) -> list[int]:
        """Every process currently on this node (by network namespace)."""
        return net.netns_pids(self.netns)

    def __hash__(self) -> int:
        return hash(self.netns)


class Testbed:
    """Builds `nodes` nodes on a fresh bridge; tears everything down on close()."""

    __test__ = False  # not a pytest test class despite the name

    def __init__(self, nodes: int = 4, hostnames: Sequence[str] | None = None,
                 prefix: str | None = None) -> None:
        if not 1 <= nodes <= 64:
            raise TestbedError(f"nodes must be in 1..64, got {nodes}")
        if hostnames is not None and len(hostnames) != nodes:
            raise TestbedError(f"{len(hostnames)} hostnames for {nodes} nodes")
        self.prefix = prefix or f"tb{secrets.token_hex(2)}"
        if not net.PREFIX_RE.match(self.prefix):
            raise TestbedError(f"prefix must look like tb + 4 hex digits, got {self.prefix!r}")
        self.size = nodes
        self.hostnames = list(hostnames or [f"node{i}" for i in range(nodes)])
        self.bridge = net.bridge_name(self.prefix)
        self.nodes: list[Node] = []
        self.subnet = None
        self.bridge_ip = ""
        self.sysctl_missing: list[str] = []  # node tuning this kernel lacks (NODE_SYSCTL)
        self._up = False
        self._old_sigterm = None
        self._drops: dict[str, list[tuple[Node, list[str]]]] = {}  # drop_packets' rules

    # -- building ---------------------------------------------------------------------

    def __enter__(self) -> Testbed:
        self.up()
        return self

    def __exit__(self, *exc) -> None:
        self.close()

    def up(self) -> Testbed:
        reason = net.missing_privileges()
        if reason:
            raise TestbedError(reason)
        self._install_sigterm()
        atexit.register(self.close)
        try:
            with net.state_lock():
                self.subnet = net.pick_subnet()
                hosts = list(self.subnet.hosts())
                self.bridge_ip = str(hosts[0])
                net.register({"prefix": self.prefix, "subnet": str(self.subnet),
                              "owner_pid": os.getpid(), "owner_start": net.own_start_time(),
                              "nodes": self.size, "created": time.time()})
                self._up = True
                net.run("ip", "link", "add", self.bridge, "type", "bridge")
                net.run("ip", "addr", "add", f"{self.bridge_ip}/24", "dev", self.bridge)
            net.run("ip", "link", "set", self.bridge, "up")
            for i, hostname in enumerate(self.hostnames):
                self.nodes.append(self._add_node(i, hostname, str(hosts[9 + i])))
        except BaseException:
            self.close()
            raise
        return self

    def _add_node(self, i: int, hostname: str, ip: str) -> Node:
        ns, host_veth = net.names(self.prefix, i)
        net.run("ip", "netns", "add", ns)
        net.run("ip", "link", "add", host_veth, "type", "veth", "peer", "name", "eth0",
                "netns", ns)
        net.run("ip", "link", "set", host_veth, "master", self.bridge, "up")
        net.run("ip", "-n", ns, "addr", "add", f"{ip}/24", "dev", "eth0")
        net.run("ip", "-n", ns, "link", "set", "eth0", "up")
        net.run("ip", "-n", ns, "link", "set", "lo", "up")
        self.sysctl_missing = net.apply_sysctl(ns, net.read_sysctl_conf(NODE_SYSCTL))
        net.make_uts(ns, hostname)
        return Node(i, hostname, ns, ip, host_veth, self)

    # -- faults: real events ------------------------------------------------------------

    def kill_node(self, node: Node) -> list[int]:
        """Node death: every process of the node is stopped, then SIGKILLed, at once."""
        pids = node.pids()
        net.kill_netns(node.netns)
        for p in node.procs:
            with contextlib.suppress(subprocess.TimeoutExpired):
                p.wait(timeout=5)
        return pids

    def partition(self, node: Node) -> None:
        """The node's link goes down: nothing reaches it, it reaches nothing."""
        net.run("ip", "link", "set", node.host_veth, "down")

    def heal(self, node: Node) -> None:
        """The partitioned link comes back up."""
        net.run("ip", "link", "set", node.host_veth, "up")

    def slow_link(self, node: Node, rate: str = "10mbit", burst: str = "32kbit",
                  latency: str = "50ms", side: str = "both") -> None:
        """Token-bucket shaping (tc tbf) of the node's link: `side` "egress" shapes what
        the node sends (its own eth0: the queue its agent reads), "ingress" what reaches
        it (the bridge side, as a switch port toward the node or a peer's egress would:
        a queue no agent sees), "both" the two."""
        if side not in ("both", "ingress", "egress"):
            raise TestbedError(f"side must be both, ingress or egress, got {side!r}")
        for where in ([], ["-n", node.netns]):
            if side != "both" and (side == "egress") != bool(where):
                continue
            dev = "eth0" if where else node.host_veth
            net.run("tc", *where, "qdisc", "replace", "dev", dev, "root", "tbf", "rate", rate,
                    "burst", burst, "latency", latency)

    def fix_link(self, node: Node) -> None:
        """Remove the shaping of `slow_link` (no error if there is none)."""
        for where in ([], ["-n", node.netns]):
            dev = "eth0" if where else node.host_veth
            net.run("tc", *where, "qdisc", "del", "dev", dev, "root", check=False)

    def drop_packets(self, node: Node, probability: float, side: str = "both") -> None:
        """Random loss on the node's link (iptables' statistic match), as a policer or a
        shallow switch buffer drops: `side` "ingress" loses what reaches the node (its
        INPUT), "egress" what it sends, lost where its peers receive it (a drop in its
        own OUTPUT is an error its TCP is told of and sends again, no loss on a wire),
        "both" the two. `fix_drops` removes it; the rules go with the namespaces too."""
        if side not in ("both", "ingress", "egress"):
            raise TestbedError(f"side must be both, ingress or egress, got {side!r}")
        if not 0 < probability < 1:
            raise TestbedError(f"probability must be in (0, 1), got {probability!r}")
        if shutil.which("iptables") is None:
            raise TestbedError("iptables is needed to drop packets")
        rules = []
        if side != "egress":
            rules.append((node, []))
        if side != "ingress":
            rules += [(peer, ["-s", node.ip]) for peer in self.nodes if peer is not node]
        for where, match in rules:
            rule = ["INPUT", *match, "-m", "statistic", "--mode", "random",
                    "--probability", f"{probability:g}", "-j", "DROP"]
            out = where.run(["iptables", "-I", *rule])
            if out.returncode != 0:
                raise TestbedError(f"iptables on {where.name}: {out.stderr.strip()}")
            self._drops.setdefault(node.netns, []).append((where, rule))

    def fix_drops(self, node: Node) -> None:
        """Remove the loss of `drop_packets` (no error if there is none)."""
        for where, rule in self._drops.pop(node.netns, []):
            where.run(["iptables", "-D", *rule])

    def kill_process(self, pid: int, sig: int = signal.SIGKILL) -> None:
        """Signal one process (e.g. SIGKILL an agent, SIGSTOP a rank: a hung rank)."""
        with contextlib.suppress(ProcessLookupError):
            os.kill(pid, sig)

    def find(self, node: Node, *needles: str) -> list[int]:
        """Pids on `node` whose command line contains every needle."""
        out = []
        for pid in node.pids():
            try:
                cmd = Path(f"/proc/{pid}/cmdline").read_bytes().replace(b"\0", b" ").decode()
            except OSError:
                continue
            if all(n in cmd for n in needles):
                out.append(pid)
        return out

    # -- teardown -----------------------------------------------------------------------

    def close(self) -> None:
        """Remove processes, namespaces, veths, bridge. Idempotent."""
        if not self._up:
            self._restore_sigterm()
            return
        try:
            for node in self.nodes:
                for p in node.procs:
                    if p.poll() is None:
                        with contextlib.suppress(ProcessLookupError):
                            os.killpg(p.pid, signal.SIGTERM)
            deadline = time.monotonic() + 5
            for node in self.nodes:
                for p in node.procs:
                    with contextlib.suppress(subprocess.TimeoutExpired):
                        p.wait(timeout=max(0.05, deadline - time.monotonic()))
            net.remove_run(self.prefix)
            for node in self.nodes:
                for p in node.procs:
                    with contextlib.suppress(subprocess.TimeoutExpired):
                        p.wait(timeout=5)
        finally:
            self._up = False
            self._restore_sigterm()
            atexit.unregister(self.close)

    def _install_sigterm(self) -> None:
        """SIGTERM becomes KeyboardInterrupt while the testbed is up, so `with` blocks
        and pytest fixtures tear it down exactly as on Ctrl-C."""
        if threading.current_thread() is not threading.main_thread():
            return
        if signal.getsignal(signal.SIGTERM) is signal.SIG_DFL:
            def on_term(*_):
                raise KeyboardInterrupt("SIGTERM")
            self._old_sigterm = signal.signal(signal.SIGTERM, on_term)

    def _restore_sigterm(self) -> None:
        if self._old_sigterm is not None and threading.current_thread() is threading.main_thread():
            signal.signal(signal.SIGTERM, self._old_sigterm)
            self._old_sigterm = None
