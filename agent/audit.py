"""Append-only audit log: who did what, when, why, and how it ended.

JSON lines, flushed and fsynced per record, so a crash loses no decided action.
Shared by the agent (control API), the dashboard, `clusterpulse-ctl` and the
remediation receiver, which may all append to the same file: each append takes an
exclusive `flock` and reads the file's own last record under it, so two processes
never chain onto the same predecessor (each used to remember only its own last
record, and a live file shared by the dashboard and the receiver read as tampered).

The file is created 0600 (and tightened if it was wider): it names operators and
clients. Each record carries `seq` (1, 2, 3...) and `prev`, the SHA-256 of the line
before it (the first record's `prev` is all zeros: it anchors the chain). A record
without either is a break, so deleting, reordering, editing or inserting a line (even
a bare `[]`) shows in `verify`, down to the line. Someone who can write the file can
still rewrite every record after the one they change; the head (`head`: the last
sequence number and hash) is therefore published outside the file, as a metric and
on the dashboard, and `clusterpulse-audit verify FILE --head SEQ:HASH` checks the
file against a head seen earlier. Ship the log off the node for more (docs/security.md).
"""

from __future__ import annotations

import errno
import fcntl
import hashlib
import json
import logging
import os
import stat
import threading
import time
from collections.abc import Callable, Iterator, Sequence
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

from clusterpulse.agent.logsetup import Throttle

GENESIS = "0" * 64
MAX_WAITING = 10_000  # records kept in memory while the file cannot be written
_TAIL_CHUNK = 65536
log = logging.getLogger(__name__)


def _digest(line: str | bytes) -> str:
    data = line if isinstance(line, bytes) else line.encode()
    return hashlib.sha256(data.rstrip(b"\n")).hexdigest()


@dataclass(frozen=True)
class Head:
    """Where a chain ends: the last record's sequence number and SHA-256."""

    seq: int = 0
    digest: str = GENESIS

    def __str__(self) -> str:
        return f"{self.seq}:{self.digest}"


def _tail(fd: int) -> tuple[bytes | None, bool]:
    """(the last line without its newline, or None for an empty file; whether the file
    ends with a newline). Reads backwards from the end, a chunk at a time."""
    end = os.lseek(fd, 0, os.SEEK_END)
    if end == 0:
        return None, True
    last = os.pread(fd, 1, end - 1)
    complete = last == b"\n"
    stop = end - 1 if complete else end
    buf = b""
    pos = stop
    while pos > 0:
        start = max(0, pos - _TAIL_CHUNK)
        buf = os.pread(fd, pos - start, start) + buf
        pos = start
        cut = buf.rfind(b"\n")
        if cut >= 0:
            return buf[cut + 1:], complete
    return buf, complete


def _count_lines(fd: int) -> int:
    n, pos = 0, 0
    while chunk := os.pread(fd, 1 << 20, pos):
        n += chunk.count(b"\n")
        pos += len(chunk)
    return n


def _head_of(fd: int) -> tuple[Head, bool]:
    """The chain's head as the file says (read under the lock), and whether the file
    ends with a newline (a torn last line from a crash elsewhere)."""
    last, complete = _tail(fd)
    if last is None:
        return Head(), True
    try:
        rec = json.loads(last)
        seq = rec["seq"] if isinstance(rec, dict) else None
    except (ValueError, KeyError, RecursionError):  # RecursionError: a forged `[[[...`
        seq = None
    if not isinstance(seq, int) or isinstance(seq, bool) or seq < 1:
        # a line from before sequence numbers, or garbage: count on from its position
        # (the verifier names that line; the records after it still chain)
        seq = _count_lines(fd) + (0 if complete else 1)
    return Head(seq, _digest(last)), complete


def open_private(path: Path) -> int:
    """An fd appending to `path`, created 0600 by this open (never readable by others
    in between), and tightened if an older file was wider."""
    # not through a symbolic link another user planted where the file was to be
    fd = os.open(path, os.O_RDWR | os.O_APPEND | os.O_CREAT | os.O_NOFOLLOW, 0o600)
    if stat.S_IMODE(os.fstat(fd).st_mode) & 0o077:
        os.fchmod(fd, 0o600)
    return fd


def file_head(path: Path) -> Head | None:
    """The head of the chain in `path` now (its last record), or None without a file.
    What is published outside the file is the file's own head, not the last record
    one writer made: several processes append to one file, and a restarted writer
    knows none until it writes (a head that drops to 0 would read as records cut)."""
    fd = -1
    try:
        fd = os.open(path, os.O_RDONLY)
        fcntl.flock(fd, fcntl.LOCK_SH)  # not half a record being appended
        return _head_of(fd)[0]
    except OSError as err:
        # none yet, unreadable, a directory (it opens, and its reading raised in every
        # /metrics scrape of the agent): the caller shows what it has
        if not isinstance(err, FileNotFoundError):
            log.warning("audit log %s: cannot read its head: %s", path, err.strerror or err)
        return None
    finally:
        if fd >= 0:
            os.close(fd)


def head_families(head: Head, labels: dict[str, str]) -> list[Any]:
    """The two metrics that carry a head outside the file, for every process that
    publishes one (the agent for its own log, the remediation receiver for the
    central one). Prometheus keeps their history: a sequence number that goes down
    (AuditLogRewound) is records cut from the end; a hash prefix that changes while
    the sequence stands still is a rewritten last record."""
    from prometheus_client.core import GaugeMetricFamily

    seq = GaugeMetricFamily("clusterpulse_audit_head_sequence",
                            "Sequence number of the last record in the audit log file.",
                            labels=list(labels))
    seq.add_metric(list(labels.values()), head.seq)
    digest = GaugeMetricFamily("clusterpulse_audit_head_hash_prefix",
                               "First 48 bits of that record's SHA-256, as an integer "
                               "(printf '%012x' to compare with `clusterpulse-audit verify "
                               "--head`).", labels=list(labels))
    digest.add_metric(list(labels.values()), int(head.digest[:12], 16))
    return [seq, digest]


class AuditLog:
    def __init__(self, path: Path | None) -> None:
        self.path = path
        self._lock = threading.Lock()
        self._waiting: list[dict] = []  # records not yet written (the file refused them)
        self.failed_writes = 0
        self.head = Head()  # the last record this process wrote (published as a metric)
        if path is not None:
            path.parent.mkdir(parents=True, exist_ok=True)

    def _open(self) -> int:
        assert self.path is not None
        return open_private(self.path)

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
            fcntl.flock(fd, fcntl.LOCK_EX)  # one writer at a time, across processes
            head, complete = _head_of(fd)
            while self._waiting:
                record = self._waiting[0]
                record["seq"], record["prev"] = head.seq + 1, head.digest
                line = json.dumps(record, sort_keys=True, default=str)
                data = (line + "\n").encode()
                if not complete:  # another writer's torn line: keep it a line of its own
                    data = b"\n" + data
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
                complete = True
                head = Head(record["seq"], _digest(line))
                self.head = head
                self._waiting.pop(0)
        finally:
            os.close(fd)  # releases the lock

    def read(self, limit: int = 1000) -> list[dict]:
        """The newest `limit` records; unreadable lines are skipped, not fatal."""
        if self.path is None or not self.path.exists():
            return []
        out = []
        with open(self.path, encoding="utf-8", errors="replace") as f:
            for line in f:
                try:
                    rec = json.loads(line)
                except (ValueError, RecursionError):
                    continue
                if isinstance(rec, dict):
                    out.append(rec)
        return out[-limit:]


@dataclass
class Verdict:
    """What `verify` found: the breaks (line number, reason) and the head it reached."""

    records: int = 0
    head: Head = field(default_factory=Head)
    breaks: list[tuple[int, str]] = field(default_factory=list)

    @property
    def intact(self) -> bool:
        return not self.breaks


def _lines(path: Path) -> Iterator[bytes]:
    with open(path, "rb") as f:
        yield from f


def verify(path: Path, expect: Head | Sequence[Head] | None = None) -> Verdict:
    """Check every record against the one before it: `seq` one more, `prev` its hash;
    the first record must anchor (seq 1, prev all zeros). After a break the check goes
    on from the breaking line, so each break is named once. `expect`, heads published
    earlier, must still be in the file (a record with that seq and hash, of which a
    prefix will do): records cut from the end show only that way, and so does a record
    deleted with the chain rebuilt after it (its successors' hashes all change).
    Raises OSError when the file cannot be read."""
    v = Verdict()
    prev, seq = GENESIS, 0
    wanted: dict[int, set[str]] = {}
    for h in [expect] if isinstance(expect, Head) else (expect or []):
        if h.seq > 0:
            wanted.setdefault(h.seq, set()).add(h.digest)
    unseen = set(wanted)
    for n, raw in enumerate(_lines(path), 1):
        digest = _digest(raw)
        v.records = n
        try:
            rec = json.loads(raw)
        except (ValueError, RecursionError):
            rec = None
        if not isinstance(rec, dict):
            v.breaks.append((n, "not a JSON object (a forged or damaged line)"))
            prev, seq = digest, seq + 1
            continue
        got_seq, got_prev = rec.get("seq"), rec.get("prev")
        if not isinstance(got_seq, int) or isinstance(got_seq, bool):
            v.breaks.append((n, "no sequence number"))
            got_seq = seq + 1
        elif got_seq != seq + 1:
            what = "records missing before it" if got_seq > seq + 1 else "out of order"
            v.breaks.append((n, f"seq {got_seq} after {seq}: {what}"))
        elif not isinstance(got_prev, str):
            v.breaks.append((n, "no 'prev' hash"))
        elif got_prev != prev:
            v.breaks.append((n, "'prev' is not the hash of the line before: a record "
                                "before it was changed, removed or inserted"))
        if got_seq in unseen:
            unseen.discard(got_seq)
            if not all(digest.startswith(d) for d in wanted[got_seq]):
                v.breaks.append((n, f"record {got_seq} differs from the published head"))
        prev, seq = digest, got_seq
    v.head = Head(seq, prev)
    for gone in sorted(unseen):
        v.breaks.append((v.records + 1, f"the published head {gone}:"
                                        f"{min(wanted[gone])[:12]} is gone: records were "
                                        "removed from the end"))
    return v


def verify_chain(path: Path) -> list[int]:
    """1-based numbers of the lines where the chain breaks (see `verify`)."""
    return [n for n, _ in verify(path).breaks]


class RefusalSummary:
    """Refusals (failed sign-ins, wrong tokens) audited at a bounded rate (`Throttle`):
    at most one line per client per `period_s`, carrying `refusals`, how many there were
    since that client's last line. Process-wide: shared by every session."""

    def __init__(self, period_s: float = 60.0, max_clients: int = 10_000,
                 clock: Callable[[], float] = time.monotonic) -> None:
        self._throttle = Throttle(period_s, max_clients, clock)

    def refused(self, audit: AuditLog, client: str, who: str, action: str, why: str,
                **detail: Any) -> bool:
        """Count a refusal; True when a line was written for it."""
        count = self._throttle.due(client)
        if not count:
            return False
        audit.write(who, action, why, "refused", client=client, refusals=count, **detail)
        return True
