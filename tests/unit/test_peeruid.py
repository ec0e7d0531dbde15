"""agent/peeruid.py against the real kernel: the user behind a TCP connection from this
host, whatever source address it picks, and its subordinate uids as the same user."""

from __future__ import annotations

import os
import socket
import subprocess
import sys

import pytest

from clusterpulse.agent import peeruid
from clusterpulse.agent.identity import SubordinateIds

HOLD = ("import socket, sys, time\n"
        "c = socket.create_connection(('127.0.0.1', int(sys.argv[1])), "
        "source_address=(sys.argv[2], 0))\n"
        "print('connected', flush=True); time.sleep(30)\n")


@pytest.mark.parametrize("source", ["127.0.0.1", "127.45.6.7", "host"])
def test_the_user_behind_a_local_connection_whatever_its_source_address(source):
    if os.geteuid() != 0:
        pytest.fail("this test plays a second local user: run it as root")
    if source == "host":  # an address of the host's own interface (eth0)
        out = subprocess.run(["ip", "-4", "-o", "addr", "show", "scope", "global"],
                             capture_output=True, text=True, check=True).stdout
        source = out.split()[3].split("/")[0]
    with socket.create_server(("127.0.0.1", 0)) as srv:
        other = subprocess.Popen(["setpriv", "--reuid=nobody", "--regid=nogroup",
                                  "--clear-groups", sys.executable, "-c", HOLD,
                                  str(srv.getsockname()[1]), source],
                                 stdout=subprocess.PIPE, text=True)
        try:
            assert other.stdout.readline().strip() == "connected"
            conn, addr = srv.accept()
            with conn:
                assert addr[0] == source
                assert peeruid.client_key(conn, addr) == "uid:65534"
                assert peeruid.uid_of_peer(addr, conn.getsockname()) == 65534
        finally:
            other.kill()
            other.wait()


def test_ipv6_and_a_remote_address_that_no_local_socket_has():
    with socket.create_server(("::1", 0), family=socket.AF_INET6) as srv, \
            socket.create_connection(("::1", srv.getsockname()[1])):
        conn, addr = srv.accept()
        with conn:
            assert peeruid.client_key(conn, addr) == f"uid:{os.geteuid()}"
    # another host's peer: no socket of this kernel has those ends, so its address
    assert peeruid.uid_of_peer(("203.0.113.9", 40000), ("127.0.0.1", 1)) is None
    assert peeruid.uid_of_peer(("not an address", "x"), ("127.0.0.1", 1)) is None


def test_subordinate_uids_are_their_owners(tmp_path, monkeypatch):
    """Found in the third review: a user's subordinate uids (a rootless container on the
    host network) were 65,536 clients of their own; two held every worker of a TLS agent."""
    subuid = tmp_path / "subuid"
    subuid.write_text("nobody:100000:65536\n")
    monkeypatch.setattr(peeruid, "_SUBIDS", SubordinateIds(str(subuid)))
    assert peeruid.account_key(100005) == peeruid.account_key(165535) == "uid:65534"
    assert peeruid.account_key(165536) == "uid:165536"


def test_a_peer_that_has_closed_is_no_ones_not_roots():
    """Found in the fourth and fifth reviews: the kernel reports an orphaned socket's
    owner as uid 0, so any user's closed connections counted as root's, and one that
    closed before the lookup fell to a shared fallback key. Such a peer is `closed`
    (the servers drop it unread); a half-closed one (shutdown) keeps its owner."""
    with socket.create_server(("127.0.0.1", 0)) as srv:
        gone = socket.create_connection(srv.getsockname())
        half = socket.create_connection(srv.getsockname())
        gone.close()
        half.shutdown(socket.SHUT_WR)
        conns = [srv.accept() for _ in range(2)]
        try:
            keys = sorted(peeruid.client_key(c, a) for c, a in conns)
            assert keys == sorted(["closed", f"uid:{os.geteuid()}"])
        finally:
            half.close()
            for c, _ in conns:
                c.close()
