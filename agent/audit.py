"""Append-only audit log: who did what, when, why, and how it ended.

JSON lines, flushed and fsynced per record, so a crash loses no decided action.
Shared by the agent (control API) and the dashboard/remediation policy.
"""

from __future__ import annotations

import json
import os
import threading
import time
from pathlib import Path
from typing import Any


class AuditLog:
    def __init__(self, path: Path | None) -> None:
        self.path = path
        self._lock = threading.Lock()
        if path is not None:
            path.parent.mkdir(parents=True, exist_ok=True)

    def write(self, who: str, action: str, why: str, outcome: str, **detail: Any) -> dict:
        record = {"ts": time.time(), "who": who, "action": action, "why": why,
                  "outcome": outcome, **detail}
        if self.path is not None:
            line = json.dumps(record, sort_keys=True, default=str) + "\n"
            with self._lock, open(self.path, "a", encoding="utf-8") as f:
                f.write(line)
                f.flush()
                os.fsync(f.fileno())
        return record

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
