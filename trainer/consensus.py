"""One small collective every few steps: restart agreement plus straggler scores.

Every `every` steps each rank contributes [restart wanted?, its median compute time
over the window]; one all_gather of 2 floats per rank gives every rank
- the decision: restart if any rank heard a restart command (so all stop at the same
  step even if only one node's agent got the command), and
- its straggler score: its median compute time over the (lower) median of all ranks'
  medians.
  Medians over a window ignore single noisy or checkpoint steps; dividing by the
  ranks' median cancels whole-job slowdowns (which are not stragglers); the first
  window after a (re)start is skipped as warm-up.
"""

from __future__ import annotations

import statistics
import time
from dataclasses import dataclass, field

import torch
import torch.distributed as dist


@dataclass
class Consensus:
    every: int = 5
    warmup_windows: int = 1
    group: dist.ProcessGroup | None = None
    _window: list[float] = field(default_factory=list)
    _windows_seen: int = 0
    exchanges: int = 0
    seconds: float = 0.0  # total time spent in the exchange (its cost, for benchmarks)

    def record(self, compute_seconds: float) -> None:
        self._window.append(compute_seconds)

    def due(self, step: int) -> bool:
        return step % self.every == 0

    def exchange(self, want_restart: bool, world: int,
                 want_checkpoint: bool = False) -> tuple[bool, bool, list[float] | None]:
        """(restart?, checkpoint?, per-rank scores or None during warm-up).

        Collective: every rank calls it at the same step. A time-based checkpoint is
        wanted by whichever rank's clock says so and then taken by all.
        """
        t0 = time.perf_counter()
        mine = statistics.median(self._window) if self._window else 0.0
        self._window = []
        self._windows_seen += 1
        flags = (1 if want_restart else 0) | (2 if want_checkpoint else 0)
        device = "cpu"
        if dist.is_initialized() and dist.get_backend(self.group) == "nccl":
            device = f"cuda:{torch.cuda.current_device()}"  # NCCL moves only device tensors
        local = torch.tensor([float(flags), mine], dtype=torch.float64, device=device)
        if dist.is_initialized() and world > 1:
            out = [torch.zeros(2, dtype=torch.float64, device=device) for _ in range(world)]
            dist.all_gather(out, local, group=self.group)
        else:
            out = [local]
        self.exchanges += 1
        self.seconds += time.perf_counter() - t0
        flags_all = [int(t[0].item()) for t in out]
        restart = any(f & 1 for f in flags_all)
        checkpoint = any(f & 2 for f in flags_all)
        if self._windows_seen <= self.warmup_windows:
            return restart, checkpoint, None
        return restart, checkpoint, straggler_scores([t[1].item() for t in out])


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
