"""Synthetic per-rank step traces for straggler detection: several noise models and the
stragglers real clusters have (steady, intermittent, bursty input, from the start,
creeping), shared by the unit tests and the detection benchmark so both judge the same
cases. Own time = compute + data wait; a trace row adds the sync wait that makes every
rank's step as long as the slowest's.

Noise models differ in kind, not only in size, so that no threshold is tuned to one
generator: AR(1) jitter (rho 0.5), heavy-tailed (Student t, 3 degrees of freedom)
jitter, unaligned single-rank pauses, job-wide pauses, and a "hardware lottery" of GPUs
4-7 % slower for life; and, apart (`gc`), rare larger single-rank pauses.
"""

from __future__ import annotations

import math
from collections.abc import Iterator

import numpy as np

BASE = 0.1  # seconds of own time per step
DATA = 0.005  # seconds of it waiting for input, healthy


def background(rng: np.random.Generator, steps: int, ranks: int, noise: str = "ar1",
               sd: float = 0.05) -> np.ndarray:
    """Own seconds (steps x ranks) of a healthy job: a persistent 0-3 % per-GPU spread
    and the chosen noise model."""
    spread = rng.uniform(1.0, 1.03, ranks)
    if noise == "heavy":
        e = 0.03 * rng.standard_t(3, size=(steps, ranks))
    else:
        e = np.empty((steps, ranks))
        e[0] = rng.normal(0, sd, ranks)
        innov = rng.normal(0, sd * math.sqrt(1 - 0.25), size=(steps, ranks))
        for t in range(1, steps):
            e[t] = 0.5 * e[t - 1] + innov[t]
    x = BASE * spread * np.exp(e)
    if noise == "pauses":  # unaligned: one rank stalls 3x now and then (GC, page faults)
        x[rng.random((steps, ranks)) < 2e-3] *= 3.0
        x[np.arange(steps) % 97 == 96] *= 4.0  # aligned: job-wide pauses
    if noise == "gc":  # rare larger pauses on one rank (a garbage collection, a page-in):
        # 1-2 steps at 2-8x, one in 500 steps per rank (a hostile review's model)
        for r in range(ranks):
            for t in rng.integers(0, steps - 2, rng.poisson(steps / 500)):
                x[t:t + rng.integers(1, 3), r] *= rng.uniform(2.0, 8.0)
    if noise == "lottery":  # 2.5 % of GPUs 4-7 % slower for life
        lot = rng.random(ranks) < 0.025
        x[:, lot] *= rng.uniform(1.04, 1.07, int(lot.sum()))
    return x


def inject(own: np.ndarray, data: np.ndarray, ranks: list[int], kind: str,
           start: int, ramp_steps: int = 2000) -> None:
    """Make `ranks` stragglers of `kind` from step `start` (0-based row), in place."""
    n = len(own) - start
    k = np.arange(n)
    cols = np.asarray(ranks)
    factor = np.ones(n)
    stall = np.zeros(n)
    if kind.startswith("steady "):  # "steady 1.2x"
        factor[:] = float(kind.split()[1].rstrip("x"))
    elif kind == "2x every 3rd step":
        factor[k % 3 == 2] = 2.0
    elif kind == "3x on 2 of 10 steps":
        factor[k % 10 >= 8] = 3.0
    elif kind == "2x every 5th step":
        factor[k % 5 == 4] = 2.0
    elif kind == "input stall 8x every 4th step":  # 0.8 s on a 1 s step, scaled
        stall[k % 4 == 3] = 0.8 * BASE
    elif kind == "input stall 20x every 10th step":  # 2 s on a 1 s step, scaled
        stall[k % 10 == 9] = 2.0 * BASE
    elif kind == "input stall 80x every 40th step":  # 8 s on a 1 s step, scaled
        stall[k % 40 == 39] = 8.0 * BASE
    elif kind == "5x on 1 of 20 steps":
        factor[k % 20 == 19] = 5.0
    elif kind == "3x for 10 of every 100 steps":  # bursts: one straggler, one incident
        factor[k % 100 < 10] = 3.0
    elif kind == "10x for 3 of every 100 steps":  # a blip to each window, recurring
        factor[k % 100 < 3] = 10.0
    elif kind == "ramp to 1.3x":
        factor[:] = 1.0 + 0.3 * np.minimum(k / ramp_steps, 1.0)
    else:
        raise ValueError(f"unknown straggler kind {kind!r}")
    own[start:, cols] = own[start:, cols] * factor[:, None] + stall[:, None]
    data[start:, cols] += stall[:, None]


def job_slowdown(own: np.ndarray, healthy: np.ndarray) -> float:
    """How much slower the job runs than without the stragglers (sum of the slowest
    rank's time per step)."""
    return float(own.max(axis=1).sum() / healthy.max(axis=1).sum())


def rows(own: np.ndarray, data: np.ndarray, run: str = "r1",
         ranks_per_node: int = 8) -> Iterator[dict[str, str]]:
    """Trace rows for detection.replay (as read from CSV: strings)."""
    for t in range(len(own)):
        total = float(own[t].max()) + 0.002
        for r in range(own.shape[1]):
            o, d = float(own[t, r]), float(data[t, r])
            yield {"run": run, "step": str(t + 1), "rank": str(r),
                   "node": f"n{r // ranks_per_node}", "step_seconds": f"{total:.6f}",
                   "compute_seconds": f"{o - d:.6f}", "data_seconds": f"{d:.6f}",
                   "sync_seconds": f"{total - o:.6f}"}


def healthy_data(steps: int, ranks: int) -> np.ndarray:
    return np.full((steps, ranks), DATA)
