"""What `clusterpulse-healthcheck` has already judged of each GPU's critical XIDs.

The agent's XID counts are totals that never go down (agent.xidstate keeps them across
agent restarts and reboots, so that Prometheus sees every new one). Judged as "any
count above zero", one routine XID 63 (a row remap to apply at the next reset) drained
its node for good: every check failed again, an operator's `State=RESUME` was undone
within one HealthCheckInterval, and Node Problem Detector kept its condition set.

So the check fails a node for the XIDs counted since what an operator does about one:
- a reboot (the kernel's boot id changed): what the check had seen before it is done;
- an operator resuming a node this check drained (`scontrol update State=RESUME`): the
  XIDs it was drained for are done;
- `clusterpulse-healthcheck --acknowledge` (after a GPU reset, or where no Slurm
  resumes anything, as under Node Problem Detector): every XID counted so far is done.
A count lower than the one acknowledged is a new count (the agent's state was lost):
all of it is new.

Kept in a small JSON file written atomically; one that cannot be read counts as empty
(every XID counted is new: the safe side), and one that cannot be written is said once
per run on stderr by the caller.
"""

from __future__ import annotations

import fcntl
import json
import os
import tempfile
import time
from dataclasses import dataclass, field
from pathlib import Path

# per GPU UUID, per XID code (as text, as in the labels): a count
Counts = dict[str, dict[str, int]]

BOOT_ID = Path("/proc/sys/kernel/random/boot_id")


def boot_id(path: Path = BOOT_ID) -> str:
    """This boot's id from the kernel; "" where there is none to read."""
    try:
        return path.read_text().strip()
    except OSError:
        return ""


def _counts(raw: object) -> Counts:
    out: Counts = {}
    if isinstance(raw, dict):
        for uuid, codes in raw.items():
            if isinstance(uuid, str) and isinstance(codes, dict):
                out[uuid] = {str(k): v for k, v in codes.items()
                             if type(v) is int and v >= 0}
    return out


def _replaced(a: Counts, b: Counts) -> Counts:
    """`a` with `b`'s counts in place of its own: what is done is what was counted then,
    lower too (after the agent's counts were lost and began again, a higher count kept
    every later one under it: the node could not be cleared)."""
    out = {u: dict(c) for u, c in a.items()}
    for uuid, codes in b.items():
        out.setdefault(uuid, {}).update(codes)
    return out


def hold_lock(path: Path, wait_s: float = 60.0) -> int | None:
    """Take `path`'s lock (a `.lock` beside it): two checks at once (slurmd's, an
    operator's --acknowledge) each saved the state they had read, and one's update was
    lost. The lock's descriptor, held until closed by this process and by the children
    it forked since (the detached drain keeps it after its parent returned); None where
    it cannot be had within `wait_s`, or there is nowhere to keep it."""
    try:
        path.parent.mkdir(parents=True, exist_ok=True)
        fd = os.open(path.with_name(path.name + ".lock"), os.O_RDWR | os.O_CREAT, 0o600)
    except OSError:
        return None
    deadline = time.monotonic() + wait_s
    while True:
        try:
            fcntl.flock(fd, fcntl.LOCK_EX | fcntl.LOCK_NB)
            return fd
        except BlockingIOError:
            if time.monotonic() > deadline:
                os.close(fd)
                return None
            time.sleep(0.1)
        except OSError:
            os.close(fd)
            return None


@dataclass
class XidJudged:
    boot: str = ""  # the boot id at the last run
    seen: Counts = field(default_factory=dict)  # the counts at the last run
    acknowledged: Counts = field(default_factory=dict)  # counts that are done
    drained_for: Counts | None = None  # the counts when this check drained the node

    @classmethod
    def load(cls, path: Path) -> XidJudged:
        try:
            raw = json.loads(path.read_text())
        except (OSError, ValueError, RecursionError):
            return cls()
        if not isinstance(raw, dict):
            return cls()
        drained = raw.get("drained_for")
        return cls(boot=raw.get("boot") if isinstance(raw.get("boot"), str) else "",
                   seen=_counts(raw.get("seen")), acknowledged=_counts(raw.get("acknowledged")),
                   drained_for=_counts(drained) if isinstance(drained, dict) else None)

    def save(self, path: Path) -> None:
        """Atomically (temporary file + rename); OSError to the caller."""
        path.parent.mkdir(parents=True, exist_ok=True)
        data = json.dumps({"boot": self.boot, "seen": self.seen,
                           "acknowledged": self.acknowledged, "drained_for": self.drained_for})
        fd, tmp = tempfile.mkstemp(dir=path.parent, prefix=".healthcheck-")
        try:
            with os.fdopen(fd, "w") as f:
                f.write(data)
            os.replace(tmp, path)
        except BaseException:
            Path(tmp).unlink(missing_ok=True)
            raise

    def after_boot(self, boot: str) -> None:
        """A reboot since the last run: what was seen before it is done."""
        if boot and self.boot and boot != self.boot:
            self.acknowledged = _replaced(self.acknowledged, self.seen)
            self.drained_for = None
        if boot:
            self.boot = boot

    def resumed(self) -> None:
        """An operator resumed the node this check drained: what it was drained for
        is done."""
        if self.drained_for is not None:
            self.acknowledged = _replaced(self.acknowledged, self.drained_for)
            self.drained_for = None

    def acknowledge(self, counts: Counts) -> None:
        self.acknowledged = _replaced(self.acknowledged, counts)

    def new(self, uuid: str, code: str, count: int) -> int:
        """How many of `count` XIDs `code` of GPU `uuid` are new."""
        done = self.acknowledged.get(uuid, {}).get(code, 0)
        return count - done if count >= done else count
