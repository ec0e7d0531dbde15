"""Free loopback ports for test servers."""

import random
import socket
from pathlib import Path

# Below the ports outgoing connections are given, above the usual services'.
_LOWEST = 20000
_pick = random.SystemRandom()  # not the random module's: a plugin may seed it per test


def _ephemeral_low() -> int:
    try:
        return int(Path("/proc/sys/net/ipv4/ip_local_port_range").read_text().split()[0])
    except (OSError, ValueError, IndexError):
        return 32768


def free_port(kind: int = socket.SOCK_STREAM) -> int:
    """A loopback port free now, for a server about to be told to listen on it.

    Taken from below the kernel's ephemeral range where it can: a port from inside it
    (what binding port 0 returns) may go to any outgoing connection before the server
    binds it, and CI lost an agent's start that way ("Address already in use")."""
    low = _ephemeral_low()
    for _ in range(100 if low - _LOWEST >= 1000 else 0):
        port = _pick.randrange(_LOWEST, low)
        with socket.socket(socket.AF_INET, kind) as s:
            try:
                s.bind(("127.0.0.1", port))
            except OSError:
                continue
            return port
    with socket.socket(socket.AF_INET, kind) as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]
