"""Append-only audit log: who did what, when, why, and how it ended.

JSON lines, flushed and fsynced per record, so a crash loses no decided action.
Shared by the agent (control API) and the dashboard/remediation policy.

The file is created 0600 (and tightened if it was wider): it names operators and
clients. Each record carries `prev`, the SHA-256 of the line before it, so deleting
or editing a record breaks the chain from there on (`verify_chain`); this is tamper
*evidence* against someone who can write the file but not the last hash shipped
elsewhere (ship the log off the node for more, see docs/security.md).
"""

from __future__ import annotations

import errno
import hashlib
import json
import logging
import os
import stat
import threading
import time
from pathlib import Path
from typing import Any

GENESIS = "0" * 64
MAX_WAITING = 10_000  # records kept in memory while the file cannot be written
log = logging.getLogger(__name__)


def _digest(line: str) -> str:
    return hashlib.sha256(line.rstrip("\n").encode()).hexdigest()


def _last_line(path: Path) -> str | None:
    try:
        with open(path, "rb") as f:
            f.seek(0, os.SEEK_END)
            size = f.tell()
            f.seek(max(0, size - 65536))
            lines = f.read().splitlines()
    except OSError:
        return None
    return lines[-1].decode(errors="replace") if lines else None


class AuditLog:
    def __init__(self, path: Path | None, chain: bool = True) -> None:
        self.path = path
        self.chain = chain
        self._lock = threading.Lock()
        self._prev = GENESIS
        self._waiting: list[dict] = []  # records not yet written (the file refused them)
        self.failed_writes = 0
        if path is not None:
            path.parent.mkdir(parents=True, exist_ok=True)
            last = _last_line(path)
            if last:
                self._prev = _digest(last)

    def _open(self) -> int:
        assert self.path is not None
        fd = os.open(self.path, os.O_WRONLY | os.O_APPEND | os.O_CREAT, 0o600)
        if stat.S_IMODE(os.fstat(fd).st_mode) & 0o077:
            os.fchmod(fd, 0o600)
        return fd

    def write(self, who: str, action: str, why: str, outcome: str, **detail: Any) -> dict:
        """Append a record. Never raises: a full or read-only disk must not stop what
        is being recorded (the action has happened, or the caller's loop must go on);
        the record waits in memory, in order, until a later write succeeds, and the
        failure is logged and counted (`failed_writes`)."""
        record = {"ts": time.time(), "who": who, "action": action, "why": why,
                  "outcome": outcome, **detail}
        if self.path is None:
            return record
        with self._lock:
            self._waiting.append(record)
            try:
                self._write_waiting()
            except OSError as err:
                self.failed_writes += 1
                del self._waiting[:-MAX_WAITING]  # the newest: a bounded loss, logged
                log.error("audit log %s: cannot write (%s); %d record(s) kept in memory "
                          "until it can", self.path, err.strerror or err, len(self._waiting))
        return record

    def flush(self) -> bool:
        """Write the records still waiting in memory (at shutdown: they would be lost);
        True when none is left."""
        if self.path is None:
            return True
        with self._lock:
            if self._waiting:
                try:
                    self._write_waiting()
                except OSError as err:
                    log.error("audit log %s: %d record(s) could not be written: %s",
                              self.path, len(self._waiting), err.strerror or err)
            return not self._waiting

    def _write_waiting(self) -> None:
        fd = self._open()
        try:
            while self._waiting:
                record = self._waiting[0]
                if self.chain:
                    record["prev"] = self._prev
                line = json.dumps(record, sort_keys=True, default=str)
                data = (line + "\n").encode()
                end = os.lseek(fd, 0, os.SEEK_END)
                try:
                    # a nearly full disk (or a file size limit) can take part of it
                    # without an error: that is a failure too
                    if os.write(fd, data) != len(data):
                        raise OSError(errno.ENOSPC, "short write")
                    os.fsync(fd)
                except OSError:
                    os.ftruncate(fd, end)  # no torn line to break the chain
                    raise
                self._prev = _digest(line)
                self._waiting.pop(0)
        finally:
            os.close(fd)

    def read(self, limit: int = 1000) -> list[dict]:
        """The newest `limit` records; unreadable lines are skipped, not fatal."""
        if self.path is None or not self.path.exists():
            return []
        out = []
        with open(self.path, encoding="utf-8", errors="replace") as f:
            for line in f:
                try:
                    out.append(json.loads(line))
                except ValueError:
                    continue
        return out[-limit:]


def verify_chain(path: Path) -> list[int]:
    """1-based numbers of the lines whose `prev` does not match the line before."""
    broken = []
    prev = GENESIS
    with open(path, encoding="utf-8", errors="replace") as f:
        for n, line in enumerate(f, 1):
            try:
                rec = json.loads(line)
            except ValueError:
                broken.append(n)
                prev = _digest(line)
                continue
            if isinstance(rec, dict) and "prev" in rec and rec["prev"] != prev:
                broken.append(n)
            prev = _digest(line)
    return broken
