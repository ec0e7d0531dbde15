"""Offline replay of straggler detection on a recorded per-rank step trace.

The same StragglerScorer the trainer runs in-band, fed step by step from a file, so a
post-mortem of a real run (or a benchmark trace) gives the flags the live job would
have raised, each with its cause.

Trace columns (one row per rank per step): run, step, rank, node, step_seconds,
compute_seconds, data_seconds, sync_seconds; optional: group (peer group, e.g. the
pipeline stage), comm_seconds, comm_bytes, clock_ratio, thermal, power_brake,
hw_slowdown, gpu_idle (0/1: NVML's reason), utilization (0..1), xid_recent,
ecc_uncorrected_recent.
"""

from __future__ import annotations

import csv
import math
from collections import defaultdict
from collections.abc import Iterable, Iterator
from dataclasses import dataclass
from pathlib import Path

import numpy as np

from clusterpulse.detection.causes import attribute
from clusterpulse.detection.scoring import ScoringConfig, StragglerScorer

REQUIRED = ("run", "step", "rank", "node", "step_seconds", "compute_seconds", "data_seconds",
            "sync_seconds")
OPTIONAL = ("comm_seconds", "comm_bytes", "clock_ratio", "thermal", "power_brake",
            "hw_slowdown", "gpu_idle", "utilization", "xid_recent", "ecc_uncorrected_recent")


class TraceError(ValueError):
    """A trace that cannot be replayed; the text names the problem."""


@dataclass(frozen=True)
class Flag:
    run: str
    rank: int
    node: str
    step: int
    peer_score: float
    self_score: float
    cause: str

    def as_dict(self) -> dict:
        return {"run": self.run, "rank": self.rank, "node": self.node, "step": self.step,
                "peer_score": round(self.peer_score, 4), "self_score": round(self.self_score, 4),
                "cause": self.cause}


def read_rows(path: Path) -> Iterator[dict[str, str]]:
    if path.is_dir():  # "no such file" sent the user looking for a path that exists
        raise TraceError(f"{path}: is a directory; name a trace file in it")
    if not path.is_file():
        raise TraceError(f"{path}: no such file")
    if path.suffix in (".parquet", ".pq"):
        try:
            import pandas as pd

            frame = pd.read_parquet(path)
        except ImportError as err:
            raise TraceError(f"{path}: reading Parquet needs pandas with pyarrow ({err}); "
                             "convert the trace to CSV or install pyarrow") from None
        yield from ({k: str(v) for k, v in rec.items()} for rec in frame.to_dict("records"))
        return
    with path.open(newline="") as f:
        reader = csv.DictReader(f)
        try:
            missing = [c for c in REQUIRED if c not in (reader.fieldnames or [])]
            if missing:
                raise TraceError(f"{path}: missing column(s) {', '.join(missing)} "
                                 f"(needs {', '.join(REQUIRED)})")
            yield from reader
        except csv.Error as err:  # e.g. a field over csv's size limit
            raise TraceError(f"{path} line {reader.line_num + 1}: not a CSV trace ({err})") \
                from None
        except UnicodeDecodeError:  # decoded a block at a time: no line to name
            raise TraceError(f"{path}: not a CSV trace (not UTF-8 text)") from None


def _float(row: dict[str, str], key: str, where: str) -> float:
    v = row.get(key)
    if v in (None, ""):
        return math.nan
    try:
        return float(v)
    except ValueError:
        raise TraceError(f"{where}: {key}={v!r} is not a number") from None


def _int(row: dict[str, str], key: str, where: str) -> int:
    """A whole number, as a trace may write it (7 or 7.0)."""
    try:
        v = float(row[key])
    except ValueError:
        v = math.nan
    if not v.is_integer():  # NaN, infinities and fractions too
        raise TraceError(f"{where}: {key}={row[key]!r} is not a whole number")
    return int(v)


def replay(rows: Iterable[dict[str, str]], config: ScoringConfig | None = None,
           source: str = "trace") -> Iterator[Flag]:
    """Flags in step order per run: a rank is reported when it becomes flagged, by the
    straggler flag (its cause) or by the recurring-slowness flag (cause `recurring`)."""
    config = config or ScoringConfig()
    runs: dict[str, dict[int, dict[int, dict]]] = defaultdict(lambda: defaultdict(dict))
    nodes: dict[tuple[str, int], str] = {}
    groups: dict[tuple[str, int], int] = {}
    for i, row in enumerate(rows, start=2):
        where = f"{source} line {i}"
        missing = [c for c in REQUIRED if row.get(c) in (None, "")]
        if missing:
            raise TraceError(f"{where}: empty {', '.join(missing)}")
        step, rank = _int(row, "step", where), _int(row, "rank", where)
        rec = {k: _float(row, k, where) for k in (*REQUIRED[4:], *OPTIONAL)}
        sync = rec["sync_seconds"]
        rec["own_seconds"] = (rec["step_seconds"] - sync if not math.isnan(sync)
                              else rec["compute_seconds"] + rec["data_seconds"])
        runs[row["run"]][step][rank] = rec
        nodes[(row["run"], rank)] = row["node"]
        if row.get("group") not in (None, ""):
            groups[(row["run"], rank)] = _int(row, "group", where)
    for run in sorted(runs):
        steps = runs[run]
        ranks = sorted({r for by_rank in steps.values() for r in by_rank})
        col = {r: i for i, r in enumerate(ranks)}
        g = [groups.get((run, r), 0) for r in ranks]
        scorer = StragglerScorer(len(ranks), groups=g, config=config)
        history: list[dict[int, dict]] = []
        was = np.zeros(len(ranks), dtype=bool)
        was_recurring = np.zeros(len(ranks), dtype=bool)
        for step in sorted(steps):
            by_rank = steps[step]
            history = [*history, by_rank][-config.cost_window:]
            own = np.full(len(ranks), math.nan)
            for r, rec in by_rank.items():
                own[col[r]] = rec["own_seconds"]
            scores = scorer.observe(own[None, :])
            if scores is None:
                continue
            for i in np.nonzero(scores.flagged & ~was)[0]:
                r = ranks[i]
                yield Flag(run, r, nodes[(run, r)], step, float(scores.peer[i]),
                           float(scores.self_[i]), _cause(history, r))
            was = scores.flagged.copy()
            if scores.recurring is not None:  # TrainingRecurringSlowness: named apart
                for i in np.nonzero(scores.recurring & ~was_recurring)[0]:
                    r = ranks[i]
                    yield Flag(run, r, nodes[(run, r)], step, float(scores.peer[i]),
                               float(scores.self_[i]), "recurring")
                was_recurring = scores.recurring.copy()


def _cause(history: list[dict[int, dict]], rank: int) -> str:
    """The cause over the cost window, from means, not medians: a rank that waits 2 s
    for input every 10th step has a typical step like its peers' (the median said
    `compute`), but its input stalls are what it adds to the job's time."""
    keys = ("own_seconds", "data_seconds", *OPTIONAL)
    times = {"own_seconds", "data_seconds", "comm_seconds", "comm_bytes"}

    def summary(key: str, values: list[float]) -> float:  # states (0/1, clocks): median
        v = [x for x in values if not math.isnan(x)]
        return float((np.mean if key in times else np.median)(v)) if v else math.nan

    mine = {k: summary(k, [h[rank][k] for h in history if rank in h]) for k in keys}
    peers = {k: summary(k, [rec[k] for h in history for r, rec in h.items() if r != rank])
             for k in keys}
    return attribute(mine, peers)
