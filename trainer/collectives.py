"""Collective sequence numbers, as NCCL's flight recorder keeps them.

Each rank counts the collectives it has entered and completed. In a hang the ranks
that wait are inside a collective (entered > completed) and the rank that holds them
has entered fewer than they have: it never reached the collective they wait in. The
counts travel on every heartbeat, so the rules can name the root of a hang and keep
the waiting ranks as evidence instead of paging each of them.

Counting is two integer increments under a lock per collective (a DDP bucket, a
consensus exchange, a sync probe): nothing here touches the device or the network.
"""

from __future__ import annotations

import contextlib
import threading
from collections.abc import Iterator
from typing import Any


class CollectiveLog:
    """Thread-safe counters: collectives run on the main thread and complete on
    the backend's (gloo/NCCL) threads; the heartbeat thread reads them."""

    def __init__(self) -> None:
        self._lock = threading.Lock()
        self.entered = 0
        self.completed = 0
        self._ops: dict[int, str] = {}  # sequence number -> op, for those in flight

    def enter(self, op: str) -> int:
        with self._lock:
            self.entered += 1
            self._ops[self.entered] = op
            return self.entered

    def complete(self, seq: int) -> None:
        with self._lock:
            self.completed += 1
            self._ops.pop(seq, None)

    @contextlib.contextmanager
    def track(self, op: str) -> Iterator[None]:
        """Count a blocking collective run inside the block."""
        seq = self.enter(op)
        try:
            yield
        finally:
            self.complete(seq)

    def track_future(self, op: str, fut: Any) -> Any:
        """Count an asynchronous collective: completes when its future does. Returns
        a future with the same value (what a DDP comm hook must return)."""
        seq = self.enter(op)

        def done(f: Any) -> Any:
            self.complete(seq)
            return f.value()

        return fut.then(done)

    def fields(self) -> dict[str, Any]:
        """Telemetry fields: the counts, and the oldest collective still in flight."""
        with self._lock:
            oldest = min(self._ops) if self._ops else None
            return {"collectives_entered_total": self.entered,
                    "collectives_completed_total": self.completed,
                    "collective": self._ops[oldest] if oldest is not None else ""}


def ring_bus_bytes(nbytes: float, world_size: int) -> float:
    """Bytes each rank sends (and receives) in a ring all-gather or reduce-scatter of
    an `nbytes` buffer (the gathered output, the reduce-scatter's input): (n-1)/n of
    them. Over the collective's time this is nccl-tests' "bus bandwidth", the figure
    to hold against the link's own speed; it does not depend on the rank count."""
    return nbytes * (world_size - 1) / max(world_size, 1)


def ring_allreduce_bytes(nbytes: float, world_size: int) -> float:
    """The same for an all-reduce: a reduce-scatter then an all-gather, 2(n-1)/n."""
    return 2.0 * ring_bus_bytes(nbytes, world_size)
