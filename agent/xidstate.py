"""XID counts that survive agent restarts.

NVML delivers each XID once, as an event, to whoever is listening; the driver keeps no
count. An agent that restarts (upgrade, OOM kill, node reboot of the agent's pod) would
start its counters again at zero, so a new XID 79 after the restart reads 1, the same as
the value Prometheus saw 10 minutes earlier, and `increase` sees nothing. The ledger
keeps, per GPU UUID and XID, the total ever seen on this node in a small JSON file
written atomically (temporary file + rename) whenever it changes, and adds the
backend's in-process counts on top.
"""

from __future__ import annotations

import json
import logging
import os
import tempfile
from pathlib import Path

from clusterpulse.agent.validate import is_digits

log = logging.getLogger(__name__)


class XidLedger:
    """Turns per-process XID counts into per-node totals persisted in `path`."""

    def __init__(self, path: Path) -> None:
        self.path = path
        self._totals: dict[str, dict[int, int]] = self._load()
        self._seen: dict[str, dict[int, int]] = {}  # backend counts at the last merge

    def _load(self) -> dict[str, dict[int, int]]:
        try:
            raw = json.loads(self.path.read_text())
        except FileNotFoundError:
            return {}
        except (OSError, ValueError, RecursionError) as err:
            log.warning("XID state %s unreadable (%s): counting from zero", self.path,
                        type(err).__name__ if isinstance(err, RecursionError) else err)
            return {}
        totals: dict[str, dict[int, int]] = {}
        if isinstance(raw, dict):
            for uuid, counts in raw.items():
                if isinstance(uuid, str) and isinstance(counts, dict):
                    totals[uuid] = {int(k): v for k, v in counts.items()
                                    if is_digits(k) and type(v) is int and v >= 0}
        return totals

    def merge(self, uuid: str, counts: dict[int, int]) -> dict[int, int]:
        """Fold the backend's current counts for one GPU in; the node-wide totals."""
        seen = self._seen.setdefault(uuid, {})
        totals = self._totals.setdefault(uuid, {})
        changed = False
        for xid, n in counts.items():
            before = seen.get(xid, 0)
            delta = n - before if n >= before else n  # the backend restarted its count
            if delta > 0:
                totals[xid] = totals.get(xid, 0) + delta
                changed = True
            seen[xid] = n
        if changed:
            self._save()
        return dict(totals)

    def _save(self) -> None:
        write_json_atomic(self.path, {u: {str(k): v for k, v in c.items()}
                                      for u, c in self._totals.items() if c}, "XID state")


def write_json_atomic(path: Path, data: object, what: str) -> None:
    """Write `data` as JSON to `path` so that a crash leaves the old file or the new one,
    never half of one (temporary file, fsync, rename); a failure is logged, not raised:
    a full disk must not stop monitoring."""
    try:
        path.parent.mkdir(parents=True, exist_ok=True)
        fd, tmp = tempfile.mkstemp(dir=path.parent, prefix=f".{path.stem}-", suffix=".tmp")
        with os.fdopen(fd, "w") as f:
            json.dump(data, f, indent=1, sort_keys=True)
            f.flush()
            os.fsync(f.fileno())
        os.replace(tmp, path)
    except OSError as err:
        log.warning("cannot write %s %s: %s", what, path, err)
