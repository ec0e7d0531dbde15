"""The rank side of the telemetry channel: fire-and-forget UDP to the node agent.

Never blocks and never raises into the training loop: the socket is non-blocking
and unconnected (a closed port produces no error on later sends), every OS error is
counted and swallowed. Replies from the agent (commands, GPU slowdown) are read
without waiting at step boundaries.
"""

from __future__ import annotations

import json
import socket
from typing import Any

from agent import protocol


class AgentLink:
    def __init__(self, addr: tuple[str, int] | None) -> None:
        self.addr = addr
        self.sent = 0
        self.failed = 0
        self._sock: socket.socket | None = None
        if addr is not None:
            self._sock = socket.socket(socket.AF_INET, socket.SOCK_DGRAM)
            self._sock.setblocking(False)

    def send(self, msg: dict[str, Any]) -> None:
        if self._sock is None:
            return
        try:
            self._sock.sendto(protocol.encode(msg), self.addr)
            self.sent += 1
        except OSError:  # agent absent, buffer full, ...: drop this sample, never the step
            self.failed += 1

    def poll(self) -> list[dict[str, Any]]:
        """Replies that arrived since the last poll (non-blocking)."""
        out: list[dict[str, Any]] = []
        if self._sock is None:
            return out
        for _ in range(64):
            try:
                data = self._sock.recv(protocol.MAX_DATAGRAM_BYTES)
            except (BlockingIOError, InterruptedError):
                break
            except OSError:
                break
            try:
                msg = json.loads(data)
            except ValueError:
                continue
            if isinstance(msg, dict) and msg.get("type") == "agent":
                out.append(msg)
        return out

    def close(self) -> None:
        if self._sock is not None:
            self._sock.close()
            self._sock = None


def parse_agent_addr(text: str | None) -> tuple[str, int] | None:
    """"127.0.0.1:9401" -> tuple; "" or "none" -> None (telemetry off)."""
    if not text or text.lower() == "none":
        return None
    host, _, port = text.rpartition(":")
    if not port.isdigit():
        raise ValueError(f"agent address must be HOST:PORT or 'none', got {text!r}")
    return host or "127.0.0.1", int(port)
