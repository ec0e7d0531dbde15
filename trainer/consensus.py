"""One small collective every few steps: restart agreement plus straggler scores.

Every `every` steps each rank contributes [flags (restart, checkpoint, preempt), its
own time (step time minus waiting for peers) for each of the last `every` steps]; one
all_gather of 1 + `every` floats per rank on a CPU (gloo) group, read back once, gives
every rank
- the decision: restart if any rank heard a restart command (so all stop at the same
  step even if only one node's agent got the command); likewise a SIGTERM seen by
  any rank (preemption) and a time-based checkpoint wanted by any rank; and
- in a world of more than one, the straggler scores of every rank, from
  detection.scoring.StragglerScorer: the same
  code that `clusterpulse-detect replay` runs on a recorded trace. Each rank is scored
  against its peers step by step (job-wide slowdowns cancel) and against its own
  history (a GPU that is always a few percent slower, or rank 0's extra work, is not
  a straggler); see that module for the method. With `state_path`, the scorer's
  baselines are kept per hardware identity (host/GPU UUID, gathered once) in a file
  read at start and written by rank 0 every `save_every` exchanges
  (detection.state): a restart does not make a slow GPU normal.
"""

from __future__ import annotations

import logging
import socket
import statistics
import time
from dataclasses import dataclass, field
from pathlib import Path

import numpy as np
import torch
import torch.distributed as dist

from clusterpulse.detection import state as straggler_state
from clusterpulse.detection.scoring import Scores, ScoringConfig, StragglerScorer

log = logging.getLogger(__name__)


def hardware_identity(device: int) -> str:
    """host/GPU UUID (host/local<N> without CUDA): what a straggler baseline belongs to."""
    host = socket.gethostname()
    if torch.cuda.is_available() and device < torch.cuda.device_count():
        uuid = getattr(torch.cuda.get_device_properties(device), "uuid", None)
        if uuid is not None:
            return f"{host}/GPU-{uuid}"
    return f"{host}/local{device}"


@dataclass
class Consensus:
    every: int = 5
    warmup_windows: int = 1
    group: dist.ProcessGroup | None = None
    _window: list[float] = field(default_factory=list)
    _windows_seen: int = 0
    exchanges: int = 0
    seconds: float = 0.0  # total time spent in the exchange (its cost, for benchmarks)
    scorer: StragglerScorer | None = None
    last: Scores | None = None  # the latest evaluation (peer and self scores, flags)
    state_path: Path | None = None  # straggler baselines per GPU, kept across restarts
    identity: str = ""  # this rank's hardware (hardware_identity)
    save_every: int = 20  # exchanges between writes of state_path (by rank 0)
    # This rank's peer group (e.g. "stage2" of a pipeline): ranks doing the same work,
    # scored against each other. Pipeline stages differ by design: in one group the
    # costliest stage's every rank was a straggler from step 1 (past the 1.3x gross
    # rule), and a re-ranking restart that moved a GPU to a costlier stage flagged its
    # node for good (its baseline belongs to the GPU). Empty: one group, all ranks.
    peer_group: str = ""

    def record(self, compute_seconds: float) -> None:
        self._window.append(compute_seconds)

    def due(self, step: int) -> bool:
        return step % self.every == 0

    def exchange(self, want_restart: bool, world: int, want_checkpoint: bool = False,
                 want_preempt: bool = False,
                 ) -> tuple[bool, bool, list[float] | None, bool]:
        """(restart?, checkpoint?, per-rank scores or None during warm-up, preempt?).

        Collective: every rank calls it at the same step. Each flag is wanted by
        whichever rank says so and then acted on by all. The tensors stay on the CPU
        (the group is gloo; Pulse makes a gloo side group under NCCL), so the exchange
        never synchronizes a device, and the result is read back in one conversion.
        """
        t0 = time.perf_counter()
        # this rank's own time in each of the last `every` steps (NaN: not measured)
        mine = (self._window[-self.every:] + [float("nan")] * self.every)[:self.every]
        self._window = []
        self._windows_seen += 1
        flags = (1 if want_restart else 0) | (2 if want_checkpoint else 0) \
            | (4 if want_preempt else 0)
        row = [float(flags), *mine]
        if dist.is_initialized() and world > 1:
            local = torch.tensor(row, dtype=torch.float64)
            out = [torch.zeros(1 + self.every, dtype=torch.float64) for _ in range(world)]
            dist.all_gather(out, local, group=self.group)
            rows = torch.stack(out).tolist()
        else:
            rows = [row]
        self.exchanges += 1
        flags_all = [int(r[0]) for r in rows]
        restart = any(f & 1 for f in flags_all)
        checkpoint = any(f & 2 for f in flags_all)
        preempt = any(f & 4 for f in flags_all)
        if len(rows) == 1:
            # A world of one has no peers: every score would be 1 (each step against
            # itself), at ~0.3 ms of the training thread's time per exchange.
            self.seconds += time.perf_counter() - t0
            return restart, checkpoint, None, preempt
        times = np.array([r[1:] for r in rows], dtype=np.float64).T  # steps x ranks
        if self.scorer is None or self.scorer.ranks != len(rows):
            self.scorer = self._new_scorer(len(rows))
        scores = self.scorer.observe(times)
        if self.state_path is not None and self.exchanges % self.save_every == 0 \
                and (not dist.is_initialized() or dist.get_rank() == 0):
            try:
                # the checkpoint folder may not exist yet (HF makes output_dir at its
                # first save)
                self.state_path.parent.mkdir(parents=True, exist_ok=True)
                straggler_state.save(self.state_path, self.scorer.state())
            except OSError as err:
                log.warning("straggler state not saved to %s: %s", self.state_path, err)
        self.seconds += time.perf_counter() - t0
        if scores is None or self._windows_seen <= self.warmup_windows:
            return restart, checkpoint, None, preempt
        self.last = scores
        # The exported score: the larger of how slow the rank is now (10 steps) and what it
        # costs the job (50 steps), so an intermittent straggler's alert says 1.33x, not
        # the 1.05x of its typical step.
        shown = scores.peer if scores.cost is None else np.fmax(scores.peer, scores.cost)
        return restart, checkpoint, [round(float(v), 4) for v in shown], preempt


    def _new_scorer(self, world: int) -> StragglerScorer:
        """Collective (every rank makes its scorer at the same exchange): each rank's
        hardware identity and peer group, gathered once."""
        config = ScoringConfig(every=self.every)
        mine = [self.identity, self.peer_group]
        rows = [mine]
        if dist.is_initialized() and world > 1:
            gathered: list[object] = [None] * world
            dist.all_gather_object(gathered, mine, group=self.group)
            rows = [list(r) for r in gathered]  # type: ignore[call-overload]
        groups = peer_groups([str(g) for _, g in rows])
        if self.state_path is None:
            return StragglerScorer(world, groups=groups, config=config)
        scorer = StragglerScorer(world, groups=groups, config=config,
                                 keys=[str(k) for k, _ in rows])
        try:
            scorer.load_state(straggler_state.load(self.state_path))
        except ValueError as err:
            log.warning("%s: %s; learning afresh", self.state_path, err)
        return scorer


def peer_groups(labels: list[str]) -> list[int] | None:
    """The scorer's group of each rank from their labels; None: one group of all ranks.
    A rank is scored against the median of its group, so each group needs two ranks at
    least (alone, a rank is its own median and nothing about it shows): with a label no
    other rank shares (a pipeline without data parallelism), all ranks stay one group,
    each against its own history, as before there were groups."""
    counts = {g: labels.count(g) for g in labels}
    if len(counts) <= 1:
        return None
    if min(counts.values()) < 2:
        log.warning("straggler peer groups %s: a group of one rank cannot be compared; "
                    "scoring all ranks as one group", dict(sorted(counts.items())))
        return None
    order = sorted(counts)
    return [order.index(g) for g in labels]


def straggler_scores(medians: list[float]) -> list[float] | None:
    """Each rank's window median over the ranks' lower median (None if not measurable).

    The lower median: with many ranks it is the median; with two it is the faster rank,
    so a 2x straggler scores 2, not 1.33 against the mean of itself and its peer.
    A whole-job slowdown moves every median alike and leaves every score at ~1.
    """
    typical = statistics.median_low(medians)
    if typical <= 0:
        return None
    return [m / typical for m in medians]
