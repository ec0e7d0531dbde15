"""Free loopback ports for test servers."""

import socket

from clusterpulse.trainer.torchrun import port_below_ephemeral


def free_port(kind: int = socket.SOCK_STREAM) -> int:
    """A port free now, for a server about to be told to listen on it: from below the
    kernel's ephemeral range, where no outgoing connection can take it first (CI lost an
    agent's start to "Address already in use" with a port from inside it)."""
    return port_below_ephemeral(kind=kind)
