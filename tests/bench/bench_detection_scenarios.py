"""Straggler detection on named scenarios, ours side by side with the previous scorer
and nvidia-resiliency-ext's rule: `make bench-detection`.

Scenarios (tests/support/straggler_traces.py, the generator the unit tests use):
steady 1.2x, intermittent (2x every 3rd step, 3x on 2 of 10, 2x every 5th), bursty
input stalls (8x every 4th step, 20x every 10th), rare large slow steps (an input stall
of 8 steps' time every 40th step, 5x on 1 of 20), bursts (3x for 10 of every 100 steps,
one incident), short slowness recurring (10x for 3 of every 100 steps: a blip to each
window, the job 27 % slower; named by the recurring flag), from the start (1.15x and 1.2x from
step 1, 1.2x appearing in the warm-up), a ramp to 1.3x over 2,000 steps, noisy ranks
(8 % AR(1) jitter), and a whole node slow (8 ranks, 1.2x). Each trial draws its noise
model in turn from AR(1) 5 %, heavy-tailed (Student t), unaligned + aligned pauses and
a hardware lottery, so that no scenario is judged on one generator.

Apart: healthy ranks with rare larger pauses (1-2 steps at 2-8x, one in 500 steps per
rank), which the long cost window's 10x cap can mistake for rare large slow steps.

Scaled down for a 2-core machine (the review used 1,024 ranks x 4,000 steps, 6 seeds):
128 ranks, 12 trials per scenario; false flags on clean traces of 256 ranks x 4,000
steps per noise model plus every healthy rank of every trial.

Per detector: recall, median and p90 latency (steps from the straggler's start; for
the ramp, from crossing 1.2x, negative when flagged before; from step 1 for the
from-start cases), flag on-events per
detected incident (1 = one notification), cause accuracy (ours and the previous scorer's
cause chain; the NVRx rule names no cause), false flags per million healthy rank-steps.
NVRx's rule: relative score (fastest rank's median over the report interval / the
rank's) or individual score (the rank's best median so far / its current) < 0.75, at
the same 5-step interval (bench_detection's baseline).
"""

from __future__ import annotations

import math
from collections.abc import Callable
from dataclasses import dataclass, field

import numpy as np

from clusterpulse.detection.causes import attribute
from clusterpulse.detection.scoring import ScoringConfig, StragglerScorer
from tests.bench.bench_detection import EVERY
from tests.bench.detection_baseline_scorer import StragglerScorer as PreviousScorer
from tests.bench.table import Row
from tests.support.straggler_traces import background, healthy_data, inject

RANKS = 128
TRIALS = 12
CLEAN_RANKS, CLEAN_STEPS = 256, 4000
NOISES = ("ar1", "heavy", "pauses", "lottery")
DETECTORS = ("ours", "previous scorer", "NVRx rule")

# name: (kind, start range, steps, noise sd, ranks made slow, expected cause)
SCENARIOS: dict[str, tuple[str, tuple[int, int], int, float, int, str]] = {
    "steady 1.2x": ("steady 1.2x", (150, 400), 600, 0.05, 1, "compute"),
    "intermittent 2x every 3rd step": ("2x every 3rd step", (150, 400), 600, 0.05, 1, "compute"),
    "intermittent 3x on 2 of 10": ("3x on 2 of 10 steps", (150, 400), 600, 0.05, 1, "compute"),
    "intermittent 2x every 5th step": ("2x every 5th step", (150, 400), 600, 0.05, 1, "compute"),
    "bursty input 8x every 4th": ("input stall 8x every 4th step", (150, 400), 600, 0.05, 1,
                                  "data_loading"),
    "bursty input 20x every 10th": ("input stall 20x every 10th step", (150, 400), 600, 0.05, 1,
                                    "data_loading"),
    "rare input stall 80x every 40th": ("input stall 80x every 40th step", (150, 400), 700,
                                        0.05, 1, "data_loading"),
    "rare 5x on 1 of 20": ("5x on 1 of 20 steps", (150, 400), 600, 0.05, 1, "compute"),
    "bursts 3x for 10 of 100": ("3x for 10 of every 100 steps", (150, 400), 1200, 0.05, 1,
                                "compute"),
    "from start 1.15x": ("steady 1.15x", (0, 0), 400, 0.05, 1, "compute"),
    "from start 1.2x": ("steady 1.2x", (0, 0), 400, 0.05, 1, "compute"),
    "1.2x during warm-up": ("steady 1.2x", (10, 60), 400, 0.05, 1, "compute"),
    "ramp to 1.3x over 2000": ("ramp to 1.3x", (100, 300), 2600, 0.05, 1, "compute"),
    "noisy 8% AR(1), 1.2x": ("steady 1.2x", (150, 400), 900, 0.08, 1, "compute"),
    "same node, 8 ranks 1.2x": ("steady 1.2x", (150, 400), 600, 0.05, 8, "compute"),
    # last: a scenario added keeps the seeds (seed + 100 x its place) of those before it
    "recurring 10x for 3 of 100": ("10x for 3 of every 100 steps", (150, 400), 1000, 0.05, 1,
                                   "compute"),
}


def _scorer_events(cls: type) -> Callable[[np.ndarray], np.ndarray]:
    def run(x: np.ndarray) -> np.ndarray:
        """Flag state per evaluation (evaluations x ranks) and the evaluation steps: ours
        names a rank by either of its flags (TrainingStraggler, or
        TrainingRecurringSlowness: `Scores.recurring`)."""
        s = cls(x.shape[1])
        out = []
        for t in range(0, len(x), EVERY):
            sc = s.observe(x[t:t + EVERY])
            if sc is not None:
                named = sc.flagged if getattr(sc, "recurring", None) is None \
                    else sc.flagged | sc.recurring
                out.append((sc.step, named.copy()))
        return out
    return run


def _nvrx_events(x: np.ndarray, threshold: float = 0.75) -> list:
    out, best = [], np.full(x.shape[1], np.inf)
    for end in range(EVERY, len(x) + 1, EVERY):
        med = np.median(x[end - EVERY:end], axis=0)
        best = np.minimum(best, med)
        out.append((end, (med.min() / med < threshold) | (best / med < threshold)))
    return out


RUNNERS = {"ours": _scorer_events(StragglerScorer),
           "previous scorer": _scorer_events(PreviousScorer), "NVRx rule": _nvrx_events}


def _cause(detector: str, own: np.ndarray, data: np.ndarray, rank: int, step: int) -> str:
    """Ours: means over the cost window (detection.replay); previous: medians over 10."""
    if detector == "NVRx rule":
        return ""
    n, agg = (ScoringConfig().cost_window, np.mean) if detector == "ours" else (10, np.median)
    lo = max(0, step - n)
    peers = np.delete(np.arange(own.shape[1]), rank)
    mine = {"own_seconds": agg(own[lo:step, rank]), "data_seconds": agg(data[lo:step, rank])}
    them = {"own_seconds": agg(own[lo:step, peers]), "data_seconds": agg(data[lo:step, peers])}
    return attribute(mine, them)


@dataclass
class Tally:
    hits: int = 0
    incidents: int = 0
    lat: list[int] = field(default_factory=list)
    ons: list[int] = field(default_factory=list)
    causes_right: int = 0
    false_ranks: int = 0
    healthy_rank_steps: int = 0


def _score(events: list, targets: list[int], ref: int) -> tuple[dict[int, int], dict[int, int],
                                                                  set[int]]:
    """(first flag step after ref per target, on-events per target, healthy ranks flagged)."""
    first: dict[int, int] = {}
    ons: dict[int, int] = {}
    false: set[int] = set()
    was = None
    for step, flagged in events:
        new = flagged if was is None else flagged & ~was
        for r in np.nonzero(new)[0]:
            r = int(r)
            if r in targets:
                if step > ref or ref == 0:
                    first.setdefault(r, step)
                    ons[r] = ons.get(r, 0) + 1
            else:
                false.add(r)
        was = flagged
    return first, ons, false


def scenario(name: str, seed: int) -> dict[str, Tally]:
    kind, (lo, hi), steps, sd, nslow, cause = SCENARIOS[name]
    tallies = {d: Tally() for d in DETECTORS}
    rng = np.random.default_rng(seed)
    for trial in range(TRIALS):
        noise = "ar1" if sd != 0.05 else NOISES[trial % len(NOISES)]
        own = background(rng, steps, RANKS, noise, sd)
        data = healthy_data(steps, RANKS)
        first_rank = int(rng.integers(0, RANKS // 8)) * 8 if nslow > 1 else \
            int(rng.integers(1, RANKS))
        targets = list(range(first_rank, first_rank + nslow))
        start = int(rng.integers(lo, hi + 1))
        inject(own, data, targets, kind, start)
        ref = start + int(2000 * 0.2 / 0.3) if kind == "ramp to 1.3x" else start
        for d in DETECTORS:
            first, ons, false = _score(RUNNERS[d](own), targets, start)
            t = tallies[d]
            t.incidents += len(targets)
            t.false_ranks += len(false)
            t.healthy_rank_steps += (RANKS - len(targets)) * steps
            for r in targets:
                if r in first:
                    t.hits += 1
                    t.lat.append(first[r] - ref)
                    t.ons.append(ons[r])
                    t.causes_right += _cause(d, own, data, r, first[r]) == cause
    return tallies


def clean_false_flags(seed: int, noises: tuple[str, ...] = NOISES) -> dict[str, tuple[int, int]]:
    """Healthy ranks flagged, rank-steps, per detector, over the noise models."""
    out = {d: (0, 0) for d in DETECTORS}
    for i, noise in enumerate(noises):
        x = background(np.random.default_rng(seed + i), CLEAN_STEPS, CLEAN_RANKS, noise)
        for d in DETECTORS:
            n = len(_score(RUNNERS[d](x), [], 0)[2])
            out[d] = (out[d][0] + n, out[d][1] + CLEAN_STEPS * CLEAN_RANKS)
    return out


def _pct(v: list[int], q: float) -> float:
    return float(np.percentile(v, q)) if v else math.nan


def measure(seed: int = 27) -> list[tuple[str, str, list[str]]]:
    """(scenario, metric, one figure per detector) rows."""
    table: list[tuple[str, str, list[str]]] = []
    clean = clean_false_flags(seed)
    false_all = {d: list(clean[d]) for d in DETECTORS}
    for i, name in enumerate(SCENARIOS):
        tallies = scenario(name, seed + 100 * i)
        metrics: dict[str, list[str]] = {m: [] for m in (
            "recall", "latency median / p90 (steps)", "flag on-events per incident (median / max)",
            "cause right")}
        for d in DETECTORS:
            t = tallies[d]
            false_all[d][0] += t.false_ranks
            false_all[d][1] += t.healthy_rank_steps
            metrics["recall"].append(f"{t.hits}/{t.incidents}")
            metrics["latency median / p90 (steps)"].append(
                f"{_pct(t.lat, 50):.0f} / {_pct(t.lat, 90):.0f}" if t.lat else "-")
            metrics["flag on-events per incident (median / max)"].append(
                f"{_pct(t.ons, 50):.0f} / {max(t.ons)}" if t.ons else "-")
            metrics["cause right"].append(
                "-" if d == "NVRx rule" or not t.hits else f"{t.causes_right}/{t.hits}")
        table += [(name, m, v) for m, v in metrics.items()]
    gc = clean_false_flags(seed, ("gc",))
    for name, counts in (("all healthy ranks (clean traces + trials)", false_all),
                         ("healthy, rare 2-8x pauses (1 in 500 steps)", gc)):
        table.append((name, "false flags per million rank-steps",
                      [f"{1e6 * n / max(rs, 1):.2f} ({n} in {rs / 1e6:.1f} M)"
                       for n, rs in (counts[d] for d in DETECTORS)]))
    return table


def render(table: list[tuple[str, str, list[str]]]) -> str:
    head = ["scenario", "metric", *DETECTORS]
    body = [[s, m, *v] for s, m, v in table]
    widths = [max(len(str(x)) for x in col) for col in zip(head, *body, strict=True)]
    lines = ["| " + " | ".join(h.ljust(w) for h, w in zip(head, widths, strict=True)) + " |",
             "|" + "|".join("-" * (w + 2) for w in widths) + "|"]
    lines += ["| " + " | ".join(c.ljust(w) for c, w in zip(row, widths, strict=True)) + " |"
              for row in body]
    return "\n".join(lines)


def run() -> list[Row]:
    """For `make bench`'s one table: recall per scenario, previous scorer as baseline."""
    rows = []
    for s, m, v in measure():
        if m == "recall":
            ours, prev = (int(x.split("/")[0]) / int(x.split("/")[1]) for x in v[:2])
            rows.append(Row(f"{s}: recall", ours, "", baseline=prev,
                            baseline_name="previous scorer"))
    return rows


if __name__ == "__main__":
    import time

    t0 = time.time()
    print(render(measure()))
    print(f"\n({RANKS} ranks x {TRIALS} trials per scenario; clean: {CLEAN_RANKS} ranks x "
          f"{CLEAN_STEPS} steps per noise model; {time.time() - t0:.0f} s)")
