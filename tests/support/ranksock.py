"""Send telemetry as a rank would: over a connection to the agent's Unix socket, from
this process or from a separate live process (its own pid, optionally another uid)."""

from __future__ import annotations

import json
import shutil
import socket
import subprocess
import sys
from collections.abc import Sequence
from typing import Any

from clusterpulse.agent import protocol

SYSTEM_PYTHON = shutil.which("python3", path="/usr/bin:/bin") or sys.executable
_SENDER = r"""
import json, socket, sys, time
path, msgs = sys.argv[1], json.loads(sys.stdin.readline())
s = socket.socket(socket.AF_UNIX, socket.SOCK_SEQPACKET)
s.connect(path)
s.settimeout(5)
for m in msgs:
    s.send(json.dumps({"v": 1, **m}).encode())
try:  # the agent handles datagrams in order: the last one's reply means all were seen
    s.settimeout(5)
    while True:
        s.recv(8192)
        s.settimeout(0.2)
except OSError:
    pass
print("sent", flush=True)
time.sleep(120)
"""


def connect(path: str) -> socket.socket:
    """A rank's connection to the agent. Its replies may come late on a loaded machine
    (2 s was once not enough for the first reply of an agent just started, in a
    fresh-machine run): the timeout only bounds a test that fails, none waits it out."""
    s = socket.socket(socket.AF_UNIX, socket.SOCK_SEQPACKET)
    s.connect(path)
    s.settimeout(10)
    return s


def exchange(sock: socket.socket, **msg: Any) -> dict:
    """Send one message and wait for the agent's reply."""
    sock.send(protocol.encode(msg))
    return json.loads(sock.recv(8192))


class RankProcess:
    """A live process that sent `msgs` and read the replies, then idles.

    The last message must be one the agent answers (replies drain until a pause)."""

    def __init__(self, path: str, msgs: list[dict], user: int | None = None,
                 ignore_sigterm: bool = False, wrap: Sequence[str] = ()) -> None:
        # Another user may not be able to run this venv's interpreter (under a private
        # home); the sender needs the standard library only. `wrap`: a command the
        # sender runs under (namespaces, dropped privileges), which then does the same.
        python = sys.executable if user is None and not wrap else SYSTEM_PYTHON
        # ignore_sigterm: a hung rank whose SIGTERM handler only sets a flag
        script = ("import signal; signal.signal(signal.SIGTERM, signal.SIG_IGN)\n"
                  if ignore_sigterm else "") + _SENDER
        self.p = subprocess.Popen([*wrap, python, "-c", script, path], stdin=subprocess.PIPE,
                                  stdout=subprocess.PIPE, text=True, user=user)
        assert self.p.stdout is not None and self.p.stdin is not None
        self.p.stdin.write(json.dumps(msgs) + "\n")
        self.p.stdin.flush()
        line = self.p.stdout.readline()
        assert line.strip() == "sent", f"sender failed: {line!r}"

    @property
    def pid(self) -> int:
        return self.p.pid

    def stop(self) -> int:
        if self.p.poll() is None:
            self.p.kill()
        return self.p.wait()

    def __enter__(self) -> RankProcess:
        return self

    def __exit__(self, *exc: object) -> None:
        self.stop()


# Bad neighbours on a node, in one process: `hung` ranks of a hung job (a heartbeat every
# 0.1 s each, replies never read) and `flood` connections sending junk and valid
# messages as fast as they can. argv: socket path, seconds, hung, flood. Prints "ready"
# once connected, then the number of flood messages sent.
NEIGHBOURS = r"""
import json, socket, sys, time
path, seconds, hung_n, flood_n = sys.argv[1], float(sys.argv[2]), int(sys.argv[3]), int(sys.argv[4])
def conn():
    s = socket.socket(socket.AF_UNIX, socket.SOCK_SEQPACKET)
    s.connect(path)
    s.setblocking(False)
    return s
hung = [conn() for _ in range(hung_n)]
flood = [conn() for _ in range(flood_n)]
junk = [b"junk" * 50] + [json.dumps({"v": 1, "type": "heartbeat", "run": "flood",
                                     "rank": i}).encode() for i in range(8)]
beat = [json.dumps({"v": 1, "type": "heartbeat", "run": "hung", "rank": i,
                    "phase": "sync"}).encode() for i in range(hung_n)]
print("ready", flush=True)
end, next_beat, sent = time.monotonic() + seconds, 0.0, 0
while time.monotonic() < end:
    if time.monotonic() >= next_beat:
        for s, m in zip(hung, beat):
            try:
                s.send(m)
            except BlockingIOError:
                pass
        next_beat = time.monotonic() + 0.1
    for s in flood:
        for m in junk:
            try:
                s.send(m)
                sent += 1
            except BlockingIOError:
                pass
        try:
            while s.recv(8192):
                pass
        except BlockingIOError:
            pass
print(sent, flush=True)
"""
