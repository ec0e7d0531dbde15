"""Straggler baselines kept across a job's restarts, per hardware identity.

The trainer relearns its scorer at every (re)start, including a restart the policy made
because of a slow GPU: relearnt, that GPU's slowness becomes its normal. The baselines
belong to the hardware (host and GPU UUID), so the trainer saves them in a small JSON
file next to its checkpoints and reads them back at start (detection.scoring's
StragglerScorer.state()/load_state()). A missing or unreadable file means "learn
afresh", never a failed start.
"""

from __future__ import annotations

import json
import logging
import os
from pathlib import Path

log = logging.getLogger(__name__)

STATE_FILE = "straggler-state.json"


def load(path: Path) -> dict[str, dict[str, float]]:
    try:
        data = json.loads(path.read_text())
    except FileNotFoundError:
        return {}
    except (OSError, ValueError, RecursionError) as err:
        log.warning("straggler state %s unreadable (%s): learning afresh", path,
                    type(err).__name__ if isinstance(err, RecursionError) else err)
        return {}
    if not isinstance(data, dict) or not isinstance(data.get("gpus"), dict):
        log.warning("straggler state %s has no 'gpus' object: learning afresh", path)
        return {}
    return data["gpus"]


def save(path: Path, gpus: dict[str, dict[str, float]]) -> None:
    """Atomically (a crash mid-write leaves the previous file)."""
    tmp = path.with_name(f".{path.name}.{os.getpid()}.tmp")
    tmp.write_text(json.dumps({"version": 1, "gpus": gpus}, sort_keys=True))
    os.replace(tmp, path)
