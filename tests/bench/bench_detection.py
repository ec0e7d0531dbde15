"""Straggler detection on synthetic traces that look like real clusters, with a
baseline at the same report interval, >= 100 trials per class and 95 % intervals.

Ours: detection.scoring.StragglerScorer (the code the trainer runs in-band every
`EVERY` steps, and `clusterpulse-detect replay` offline).
Baseline: nvidia-resiliency-ext's rule at the SAME interval (every EVERY steps, over
the last EVERY steps): relative score = fastest rank's median / the rank's median,
individual score = the rank's best median so far / its current one; flagged when
either is < 0.75 (its documented default thresholds are 0.7-0.75).

Every trace has what real GPUs have: a persistent per-GPU speed spread (uniform 0-3 %),
AR(1) correlated jitter (rho 0.5, 5 %), a warm-up, job-wide checkpoint pauses every
200 steps (3x, rank 0 writes longer: 5x), four pipeline stages of unequal cost, and
rank 0 doing 10 % extra work. Straggler classes: compute 1.2x / 1.5x, data loading
(+20 % of a step waiting for input on one rank), communication (one rank's link at
1/10 bandwidth: +20 % own time spent sending); false flags are counted on clean
traces of 10,000 steps x 1,024 ranks.
"""

from __future__ import annotations

import math

import numpy as np

from clusterpulse.detection.scoring import ScoringConfig, StragglerScorer
from tests.bench.table import Row

EVERY = 5
TRIALS = 100
TRIAL_RANKS = 128
TRIAL_STEPS = 700
STAGES = np.array([1.0, 1.08, 0.95, 1.15])
NVRX = "nvidia-resiliency-ext rule, same interval"


def clean(rng: np.random.Generator, steps: int, ranks: int) -> np.ndarray:
    """Own time per rank per step (no straggler)."""
    spread = rng.uniform(1.0, 1.03, size=ranks)  # persistent per-GPU speed
    stage = STAGES[np.arange(ranks) * len(STAGES) // ranks]  # pipeline stages
    e = np.empty((steps, ranks))
    e[0] = rng.normal(0, 0.05, ranks)
    innov = rng.normal(0, 0.05 * math.sqrt(1 - 0.25), size=(steps, ranks))
    for t in range(1, steps):  # AR(1), rho = 0.5, stationary sd 5 %
        e[t] = 0.5 * e[t - 1] + innov[t]
    x = 0.1 * spread * stage * np.exp(e)
    x[:20] *= 2.0  # warm-up
    x[:, 0] *= 1.10  # rank 0's extra work (logging, metrics)
    ckpt = np.arange(steps) % 200 == 199
    x[ckpt] *= 3.0
    x[ckpt, 0] *= 5.0 / 3.0
    return x


def inject(x: np.ndarray, rank: int, start: int, kind: str) -> None:
    if kind == "compute 1.2x":
        x[start:, rank] *= 1.2
    elif kind == "compute 1.5x":
        x[start:, rank] *= 1.5
    elif kind in ("data loading +20%", "communication 1/10 bw"):
        x[start:, rank] += 0.2 * np.median(x[start:], axis=1)


def ours(x: np.ndarray) -> dict[int, int]:
    scorer = StragglerScorer(x.shape[1], config=ScoringConfig(every=EVERY))
    flagged: dict[int, int] = {}
    for t in range(0, len(x), EVERY):
        s = scorer.observe(x[t:t + EVERY])
        if s is not None:
            for r in np.nonzero(s.flagged)[0]:
                flagged.setdefault(int(r), s.step)
    return flagged


def baseline(x: np.ndarray, threshold: float = 0.75) -> dict[int, int]:
    flagged: dict[int, int] = {}
    best = np.full(x.shape[1], np.inf)
    for end in range(EVERY, len(x) + 1, EVERY):
        med = np.median(x[end - EVERY:end], axis=0)
        best = np.minimum(best, med)
        relative, individual = med.min() / med, best / med
        for r in np.nonzero((relative < threshold) | (individual < threshold))[0]:
            flagged.setdefault(int(r), end)
    return flagged


def wilson(k: int, n: int) -> tuple[float, float]:
    """95 % Wilson interval of a proportion."""
    if n == 0:
        return (float("nan"), float("nan"))
    z, p = 1.96, k / n
    c = (p + z * z / (2 * n)) / (1 + z * z / n)
    h = z * math.sqrt(p * (1 - p) / n + z * z / (4 * n * n)) / (1 + z * z / n)
    return (c - h, c + h)


def median_ci(values: list[int]) -> tuple[float, float, float]:
    """Median and its 95 % distribution-free interval (order statistics)."""
    if not values:
        return (float("nan"),) * 3
    v, n = sorted(values), len(values)
    lo = max(0, int(n / 2 - 1.96 * math.sqrt(n) / 2))
    hi = min(n - 1, math.ceil(n / 2 + 1.96 * math.sqrt(n) / 2))
    return float(np.median(v)), float(v[lo]), float(v[hi])


def trials(detector, kind: str, seed: int) -> dict:
    rng = np.random.default_rng(seed)
    hits, lat, false_ranks = 0, [], 0
    for _ in range(TRIALS):
        x = clean(rng, TRIAL_STEPS, TRIAL_RANKS)
        rank, start = int(rng.integers(1, TRIAL_RANKS)), int(rng.integers(150, 450))
        inject(x, rank, start, kind)
        flagged = detector(x)
        if rank in flagged and flagged[rank] > start:
            hits += 1
            lat.append(flagged[rank] - start)
        false_ranks += sum(1 for r in flagged if r != rank)
    return {"hits": hits, "lat": lat, "false": false_ranks}


def run() -> list[Row]:
    rows: list[Row] = []
    for i, kind in enumerate(["compute 1.2x", "compute 1.5x", "data loading +20%",
                              "communication 1/10 bw"]):
        o, b = trials(ours, kind, 100 + i), trials(baseline, kind, 100 + i)
        lo, hi = wilson(o["hits"], TRIALS)
        rows.append(Row(f"{kind}: recall ({TRIALS} trials; ours 95% CI {lo:.2f}-{hi:.2f})",
                        o["hits"] / TRIALS, "", baseline=b["hits"] / TRIALS, baseline_name=NVRX))
        med, mlo, mhi = median_ci(o["lat"])
        rows.append(Row(f"{kind}: median detection latency (ours 95% CI {mlo:.0f}-{mhi:.0f})",
                        med, "steps", baseline=median_ci(b["lat"])[0] if b["lat"] else None,
                        baseline_name=NVRX, budget="<= 10" if kind == "compute 1.2x" else ""))
        rows.append(Row(f"{kind}: healthy ranks flagged in {TRIALS} trials x {TRIAL_RANKS} ranks",
                        o["false"], "ranks", baseline=b["false"], baseline_name=NVRX, budget="0"))
    x = clean(np.random.default_rng(7), 10_000, 1024)
    rows.append(Row("false flags, 10,000 steps x 1,024 ranks (spread, AR(1), stages, rank 0)",
                    len(ours(x)), "ranks", baseline=len(baseline(x)), baseline_name=NVRX,
                    budget="0"))
    return rows


if __name__ == "__main__":
    from tests.bench.table import render

    print(render(run()))
