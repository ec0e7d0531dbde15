"""Free loopback ports for test servers."""

import socket

from clusterpulse.trainer.torchrun import port_below_ephemeral

# Below the kernel's ephemeral range, where no outgoing connection can take a port
# between its choice and its bind (CI lost an agent's start to "Address already in use"
# with a port from inside it), and below the blocks the local demo's tests give their
# clusters (20000-29999, tests/integration/test_demo_faults.py, tests/e2e).
TEST_PORTS = (10000, 19999)


def free_port(kind: int = socket.SOCK_STREAM) -> int:
    """A port free now, for a server about to be told to listen on it."""
    return port_below_ephemeral(kind=kind, span=TEST_PORTS)
