"""The straggler scorer as it was before issue #27 (detection/scoring.py at ff3c763),
kept verbatim as the benchmark's "previous scorer" baseline: per-step log-relative
times, winsorised, over a 10-step window, against peers and the rank's own history.
Not used by the product.

Robust straggler scoring: each rank against its peers AND its own history.

Why both (as nvidia-resiliency-ext's relative and individual scores): real GPUs of one
model differ by a few percent for life, pipeline stages differ by design, and rank 0
often does extra work. Against peers alone every one of those is a "straggler" forever;
against its own history alone a job-wide slowdown is. Here:

- each step, a rank's time is taken relative to the (lower) median of its peer group (ranks
  doing the same work: the same pipeline stage, by default all ranks), in log space.
  Job-wide events (checkpoints, a slow storage read, jitter common to all) cancel
  step by step;
- every `every` steps (the consensus interval), its relative time averaged over the
  last `window` steps, `m`, is its peer score (exp(m): 1.2 = 20 % slower than a
  typical peer);
- its baseline `b` is its own typical peer score (learnt over a warm-up, then a slow
  moving average that stops while it is flagged), so a GPU that is always 3 % slower,
  a slower pipeline stage and rank 0's extra work all have a self score exp(m - b) ~ 1;
- the noise of m is learnt per rank and pooled across ranks (the larger wins): a
  rank is flagged when m - b exceeds both log(self_threshold) and `z` noise standard
  deviations, and it is slower than its typical peer now (exp(m) > peer_threshold).
  Correlated (AR(1)) jitter widens the learnt noise instead of flagging;
- a rank slower than its peer group by `gross_threshold` (1.3) is flagged whatever its
  history: no healthy GPU of a model is that much slower than its siblings.

Input per step is the rank's own time: its step time minus the time it waited for
peers (compute + data loading + its own communication). Using total own time rather
than compute alone means a data-starved rank is detected; the cause is named apart
(`detection.causes`).
"""

from __future__ import annotations

import collections
import math
from collections.abc import Sequence
from dataclasses import dataclass, field

import numpy as np


def _lower_median(vals: np.ndarray) -> np.ndarray:
    """Per row, the lower median of the finite values (0 if none). The lower one: with
    4 ranks of which 2 are slow, the median would be half a straggler and understate
    both; the lower median is a typical healthy rank (with 2 ranks, the faster one)."""
    finite = np.isfinite(vals)
    filled = np.where(finite, vals, np.inf)  # unmeasured ranks sort last
    count = finite.sum(axis=1)
    k = np.maximum((count - 1) // 2, 0)
    srt = np.sort(filled, axis=1)
    low = srt[np.arange(len(vals)), k]
    return np.where(count > 0, low, 0.0)[:, None]


@dataclass(frozen=True)
class ScoringConfig:
    window: int = 10  # steps averaged into a score
    every: int = 5  # steps between evaluations (the consensus interval)
    # Steps learnt before any flag (includes the window). 80, not 40: the noise of AR(1)
    # jitter estimated from 7 evaluations flagged 11 healthy ranks in 400 benchmark
    # trials, all within 55 steps of the start; from 15, none (two seed sets).
    warmup_steps: int = 80
    self_threshold: float = 1.1  # slowdown against its own history to flag
    peer_threshold: float = 1.05  # and slower than the typical peer by at least this
    # Slower than its peer group by this much is a straggler even if it always was:
    # GPUs of one model differ by a few percent, not by 30 % (a slow-from-the-start GPU
    # would otherwise be learnt as normal). Pipeline stages need their own groups.
    gross_threshold: float = 1.3
    z: float = 5.5  # noise standard deviations a slowdown must exceed
    noise_floor: float = 0.005  # log units: below this, noise estimates are not trusted
    baseline_alpha: float = 0.05  # per evaluation, for the baseline and the noise

    def validate(self) -> None:
        if self.window < 2 or self.every < 1 or self.warmup_steps < self.window:
            raise ValueError("window >= 2, every >= 1 and warmup_steps >= window required")
        if self.self_threshold <= 1 or self.peer_threshold < 1 or self.z <= 0 \
                or self.gross_threshold <= self.peer_threshold:
            raise ValueError("self_threshold > 1, peer_threshold >= 1, z > 0 and "
                             "gross_threshold > peer_threshold required")


@dataclass
class Scores:
    """One evaluation: per rank, the peer score, the self score and the decision."""

    step: int
    peer: np.ndarray  # exp(m): time relative to the typical peer now
    self_: np.ndarray  # exp(m - b): relative to the rank's own usual peer score
    flagged: np.ndarray  # bool


@dataclass
class StragglerScorer:
    ranks: int
    groups: Sequence[int] | None = None  # peer group of each rank (pipeline stage)
    config: ScoringConfig = field(default_factory=ScoringConfig)

    def __post_init__(self) -> None:
        self.config.validate()
        g = np.zeros(self.ranks, dtype=int) if self.groups is None else np.asarray(self.groups)
        if g.shape != (self.ranks,):
            raise ValueError(f"groups must give one group per rank ({self.ranks})")
        self._groups = [np.nonzero(g == k)[0] for k in np.unique(g)]
        self._rows: collections.deque[np.ndarray] = collections.deque(maxlen=self.config.window)
        self.steps = 0
        self._since_eval = 0
        self._warm: list[np.ndarray] = []
        self.baseline: np.ndarray | None = None
        self._var: np.ndarray | None = None
        self.flagged = np.zeros(self.ranks, dtype=bool)

    def reset(self) -> None:
        """A (re)started job: ranks may sit on other GPUs now; learn again."""
        self.__post_init__()

    def _relative(self, block: np.ndarray) -> np.ndarray:
        """log(own time / median of the rank's peer group), step by step (rows)."""
        with np.errstate(invalid="ignore", divide="ignore"):
            logs = np.log(np.maximum(block, 1e-9))
        rel = np.zeros_like(logs)
        for idx in self._groups:
            vals = logs[:, idx]
            rel[:, idx] = vals - _lower_median(vals)
        return np.where(np.isfinite(rel), rel, 0.0)  # not measured: typical

    def observe(self, own_seconds: Sequence[Sequence[float]] | np.ndarray) -> Scores | None:
        """Feed steps (rows: steps, columns: ranks; NaN = not measured). Returns the
        last evaluation made during these steps, or None if none was due."""
        block = np.atleast_2d(np.asarray(own_seconds, dtype=float))
        if block.shape[1] != self.ranks:
            raise ValueError(f"expected {self.ranks} ranks per step, got {block.shape[1]}")
        out = None
        for rel in self._relative(block):
            self._rows.append(rel)
            self.steps += 1
            self._since_eval += 1
            if self._since_eval >= self.config.every and len(self._rows) == self.config.window:
                self._since_eval = 0
                out = self._evaluate()
        return out

    def _evaluate(self) -> Scores:
        c = self.config
        window = np.stack(self._rows)
        # Winsorise single steps at 4 pooled spreads: a one-step spike on one rank (its
        # own checkpoint write, a page fault) must not move a 10-step average.
        level = np.median(window, axis=0)  # each rank's own level in the window
        dev = window - level
        spread = np.median(np.abs(dev)) * 1.4826 + 1e-6  # pooled over ranks and steps
        m = level + np.clip(dev, -4 * spread, 4 * spread).mean(axis=0)
        peer = np.exp(m)
        if self.steps < c.warmup_steps or self.baseline is None:
            self._warm.append(m)
            if self.steps >= c.warmup_steps:
                warm = np.stack(self._warm)
                self.baseline = np.median(warm, axis=0)
                self._var = np.maximum(warm.var(axis=0), c.noise_floor ** 2)
            return Scores(self.steps, peer, np.ones(self.ranks), np.zeros(self.ranks, bool))
        assert self._var is not None
        d = m - self.baseline
        sigma = np.sqrt(np.maximum(self._var, np.median(self._var)))
        limit = np.maximum(math.log(c.self_threshold), c.z * sigma)
        self.flagged = (((d > limit) & (m > math.log(c.peer_threshold)))
                        | (m > math.log(c.gross_threshold)))
        # Learn only from ranks that look normal: a straggler must not become the norm.
        calm = ~self.flagged & (d < limit / 2)
        a = c.baseline_alpha
        self.baseline = np.where(calm, (1 - a) * self.baseline + a * m, self.baseline)
        self._var = np.where(calm, (1 - a) * self._var + a * np.maximum(d * d, c.noise_floor ** 2),
                             self._var)
        return Scores(self.steps, peer, np.exp(d), self.flagged.copy())
