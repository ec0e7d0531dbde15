"""Who sent a message, as the kernel says, and whether that process is still the same.

The agent may signal processes, so a rank's identity is never a number from a
payload: over the Unix socket the kernel records the connecting process (pid, uid,
gid in the agent's own PID namespace) at `connect()`, and agent.channel.identify pins
it as it accepts. A pid alone can be reused after the process exits, so a sender is
pinned by (pid, start time from /proc/PID/stat), and signals go through a pidfd
opened and then re-checked against that start time.
"""

from __future__ import annotations

import contextlib
import os
import pwd
import signal
from dataclasses import dataclass

from clusterpulse.agent.validate import is_digits


@dataclass(frozen=True)
class Sender:
    """A message's origin. `verified` only when the kernel named the process."""

    pid: int = 0
    uid: int = -1
    gid: int = -1
    start_time: int = 0  # clock ticks after boot, field 22 of /proc/PID/stat
    verified: bool = False
    # The user accountable for `uid`: itself, or the owner of the subordinate uid range
    # it falls in (/etc/subuid: rootless containers give a user 65,536 uids, and per-uid
    # quotas and fair shares would count each of them as another user). -1: `uid`.
    account: int = -1

    @property
    def owner_key(self) -> str:
        """The bucket a per-user quota and a fair share count against."""
        if not self.verified:
            return "unverified"
        return f"uid:{self.account if self.account >= 0 else self.uid}"


class SubordinateIds:
    """uid -> the user whose subordinate range (/etc/subuid) holds it, re-read when the
    file changes. Lines are `USER:FIRST:COUNT`, USER a name or a number."""

    def __init__(self, path: str = "/etc/subuid") -> None:
        self._path = path
        self._mtime: float | None = None
        self._ranges: list[tuple[int, int, int]] = []  # (first, last + 1, owner uid)

    def account(self, uid: int) -> int:
        self._reload()
        for first, end, owner in self._ranges:
            if first <= uid < end:
                return owner
        return uid

    def _reload(self) -> None:
        try:
            mtime = os.stat(self._path).st_mtime
        except OSError:
            self._ranges, self._mtime = [], None
            return
        if mtime == self._mtime:
            return
        ranges = []
        try:
            with open(self._path, encoding="utf-8", errors="replace") as f:
                lines = f.read().splitlines()
        except OSError:
            lines = []
        for line in lines:
            parts = line.strip().split(":")
            if len(parts) != 3 or not is_digits(parts[1]) or not is_digits(parts[2]):
                continue
            owner = _uid_of(parts[0])
            if owner is not None:
                ranges.append((int(parts[1]), int(parts[1]) + int(parts[2]), owner))
        self._ranges, self._mtime = ranges, mtime


def _uid_of(user: str) -> int | None:
    if is_digits(user):
        return int(user)
    try:
        return pwd.getpwnam(user).pw_uid
    except KeyError:
        return None


def real_uid(pid: int, proc: str = "/proc") -> int | None:
    """The process's real uid (/proc/PID/status), or None if it is gone."""
    try:
        with open(f"{proc}/{pid}/status", "rb") as f:
            for line in f:
                if line.startswith(b"Uid:"):
                    return int(line.split()[1])
    except (OSError, ValueError, IndexError):
        return None
    return None


def start_time(pid: int, proc: str = "/proc") -> int | None:
    """The process's start time in clock ticks, or None if it is gone or unreadable."""
    try:
        with open(f"{proc}/{pid}/stat", "rb") as f:
            stat = f.read()
    except OSError:
        return None
    # comm (field 2) may hold spaces and parentheses: split after the last ")".
    try:
        return int(stat[stat.rindex(b")") + 2:].split()[19])
    except (ValueError, IndexError):
        return None


def still_running(sender: Sender) -> bool:
    """The very process that registered is alive (not a new one with a reused pid)."""
    return sender.verified and start_time(sender.pid) == sender.start_time


class SignalRefused(Exception):
    """Why a process was not signalled; the text goes to the audit log."""


def open_verified(sender: Sender) -> int:
    """A pidfd for the sender's process, after checking it is the same process.

    The pidfd pins the process: once it is open, a later signal through it cannot
    reach another process even if the pid is reused. The start time is compared
    after opening, so the check and the signal refer to the same process.
    """
    if not sender.verified:
        raise SignalRefused("sender not verified by the kernel (UDP or foreign PID "
                            "namespace): never signalled")
    try:
        fd = os.pidfd_open(sender.pid)
    except ProcessLookupError:
        raise SignalRefused(f"pid {sender.pid} has exited") from None
    except OSError as err:
        raise SignalRefused(f"cannot open pid {sender.pid}: {err.strerror}") from None
    if start_time(sender.pid) != sender.start_time:
        os.close(fd)
        raise SignalRefused(f"pid {sender.pid} is no longer the registered rank process "
                            "(start time changed)")
    return fd


def send_signal(fd: int, sig: int) -> bool:
    """Signal through a pidfd; False if the process has exited meanwhile."""
    try:
        signal.pidfd_send_signal(fd, sig)
    except ProcessLookupError:
        return False
    return True


def close_quietly(fd: int) -> None:
    with contextlib.suppress(OSError):
        os.close(fd)
