"""Straggler detection on synthetic traces of large jobs, side by side with a baseline.

Ours: the trainer's in-band scoring (trainer.consensus.straggler_scores over windows of
`WINDOW` steps, the default --consensus-every) with the alert rule's decision: score
above THRESHOLD in K consecutive windows (the rule's `for:`).
Baseline: nvidia-resiliency-ext's rule, applied to the same traces: every report
interval, each rank's relative score = fastest rank's median / its median; flagged
when < 0.75.

Traces (compute time per rank per step): 5 % log-normal jitter, a warm-up of 20 slow
steps, checkpoint spikes every 200 steps (3x on every rank), whole-job slowdowns
(1.5x for 50 steps, twice), and one injected straggler per trace (persistent from a
random step, or intermittent: slow on a random half of its steps).
"""

from __future__ import annotations

import numpy as np

from tests.bench.table import Row
from trainer.consensus import straggler_scores

RANKS = 1024
WINDOW = 5
THRESHOLD = 1.1
K = 2
NVRX_INTERVAL = 60  # steps between nvidia-resiliency-ext reports (its default is 60-300 s)
NVRX_THRESHOLD = 0.75
TRIALS = 12


def trace(rng: np.random.Generator, steps: int, straggler: tuple[int, int, float, bool] | None,
          ranks: int = RANKS) -> np.ndarray:
    t = np.exp(rng.normal(0.0, 0.05, size=(steps, ranks)))
    t[:20] *= 2.0  # warm-up
    t[np.arange(steps) % 200 == 199] *= 3.0  # checkpoint steps
    for start in rng.integers(100, steps - 60, size=2):  # whole-job slowdowns
        t[start:start + 50] *= 1.5
    if straggler is not None:
        rank, start, magnitude, intermittent = straggler
        slow = np.ones(steps - start, dtype=bool)
        if intermittent:
            slow = rng.random(steps - start) < 0.5
        t[start:, rank] *= np.where(slow, magnitude, 1.0)
    return t


def ours(t: np.ndarray) -> dict[int, int]:
    """rank -> first step at which the alert would fire (window ends, K in a row)."""
    windows = t[: len(t) // WINDOW * WINDOW].reshape(-1, WINDOW, t.shape[1])
    medians = np.median(windows, axis=1)
    above_run = np.zeros(t.shape[1], dtype=int)
    flagged: dict[int, int] = {}
    for w, row in enumerate(medians):
        if w == 0:  # warm-up window, as in Consensus
            continue
        scores = np.asarray(straggler_scores(row.tolist()))
        above_run = np.where(scores > THRESHOLD, above_run + 1, 0)
        for rank in np.nonzero(above_run >= K)[0]:
            flagged.setdefault(int(rank), (w + 1) * WINDOW)
    return flagged


def baseline(t: np.ndarray) -> dict[int, int]:
    flagged: dict[int, int] = {}
    for end in range(NVRX_INTERVAL, len(t) + 1, NVRX_INTERVAL):
        med = np.median(t[end - NVRX_INTERVAL:end], axis=0)
        rel = med.min() / med
        for rank in np.nonzero(rel < NVRX_THRESHOLD)[0]:
            flagged.setdefault(int(rank), end)
    return flagged


def evaluate(detector, magnitude: float, intermittent: bool, seed: int) -> tuple:
    rng = np.random.default_rng(seed)
    latencies, true_pos, false_pos = [], 0, 0
    for _ in range(TRIALS):
        rank, start = int(rng.integers(RANKS)), int(rng.integers(200, 1500))
        flagged = detector(trace(rng, 2000, (rank, start, magnitude, intermittent)))
        for r, step in flagged.items():
            if r == rank and step > start:
                true_pos += 1
                latencies.append(step - start)
            else:
                false_pos += 1
    recall = true_pos / TRIALS
    precision = true_pos / (true_pos + false_pos) if true_pos + false_pos else float("nan")
    return recall, precision, latencies


def false_flags_per_10k(detector, seed: int = 7, steps: int = 10_000) -> int:
    return len(detector(trace(np.random.default_rng(seed), steps, None)))


def run() -> list[Row]:
    rows = []
    for magnitude, intermittent in [(1.05, False), (1.1, False), (1.2, False), (1.33, False),
                                    (1.5, False), (2.0, False), (2.0, True)]:
        kind = f"{magnitude}x" + (" intermittent 50%" if intermittent else "")
        o_rec, o_prec, o_lat = evaluate(ours, magnitude, intermittent, seed=int(magnitude * 100))
        b_rec, b_prec, b_lat = evaluate(baseline, magnitude, intermittent,
                                        seed=int(magnitude * 100))
        rows.append(Row(f"{kind}: recall", o_rec, "", baseline=b_rec,
                        baseline_name="nvidia-resiliency-ext rule"))
        rows.append(Row(f"{kind}: precision", o_prec, "", baseline=b_prec,
                        baseline_name="nvidia-resiliency-ext rule"))
        rows.append(Row(f"{kind}: median detection latency", float(np.median(o_lat))
                        if o_lat else float("nan"), "steps",
                        baseline=float(np.median(b_lat)) if b_lat else None,
                        baseline_name="nvidia-resiliency-ext rule",
                        budget="<= 10 (1.2x)" if magnitude == 1.2 and not intermittent else ""))
        rows.append(Row(f"{kind}: max detection latency", float(max(o_lat)) if o_lat
                        else float("nan"), "steps",
                        baseline=float(max(b_lat)) if b_lat else None,
                        baseline_name="nvidia-resiliency-ext rule"))
    rows.append(Row(f"false flags, 10,000 clean steps x {RANKS} ranks", false_flags_per_10k(ours),
                    "flags", baseline=false_flags_per_10k(baseline),
                    baseline_name="nvidia-resiliency-ext rule", budget="0"))
    return rows
