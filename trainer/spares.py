"""torchrun for a job with hot spares: two fixes to torch's c10d rendezvous, installed in
the torchrun process (`python -m clusterpulse.trainer.spares <torchrun args>`, or by
trainer/warmstart.py when HOT_SPARES_ENV is set; clusterpulse-train --hot-spares does
either).

1. A node left out of a full round stays waiting, and every restart repeats it.
   torch keeps a node beyond `--nnodes`' maximum on a redundancy list that does not
   count as waiting. But in any restart of the job (a crash, a hard restart) every
   node, the spare too, passes through the wait list while the old round empties;
   then they race for the new round's places, and the one left out is still on the
   wait list (torch moves a node to the redundancy list only from outside it). The
   members see a node waiting (`num_nodes_waiting() > 0`), restart to take it in,
   and the next race leaves one out again: on the testbed, a restart every ~10 s
   until something else failed. A full round can take no one, so here a node waiting
   for one counts as nobody waiting; when the job loses a node the round is below
   its maximum and the waiting node counts again.
2. The launcher must tell a standby's end from a failure: a graceful restart ends
   every torchrun, and a standby's ends with the error of a closed or vanished
   rendezvous, as a member's does when the job's host dies. What tells them apart is
   where the node was: waiting in a rendezvous (it stood by) or in the job. This
   process writes that to RDZV_STATE_ENV's file ("waiting" when it enters a
   rendezvous, "joined" when it is in a round) for clusterpulse-train to read.

Both wrap `DynamicRendezvousHandler` methods; (1) reads its synced state, which is
torch's private attribute: on a torch without it, the wrapper gives torch's answer.
"""

from __future__ import annotations

import contextlib
import os
from pathlib import Path

HOT_SPARES_ENV = "CLUSTERPULSE_HOT_SPARES"  # set (to 1) for torchrun by the launcher
RDZV_STATE_ENV = "CLUSTERPULSE_RDZV_STATE_FILE"  # where this node's rendezvous place goes
WAITING, JOINED = "waiting", "joined"


def install() -> None:
    """Wrap the c10d rendezvous handler's methods (idempotent)."""
    from torch.distributed.elastic.rendezvous.dynamic_rendezvous import (
        DynamicRendezvousHandler as Handler,
    )

    if getattr(Handler, "_clusterpulse_spares", False):
        return
    waiting = Handler.num_nodes_waiting
    joining = Handler.next_rendezvous

    def num_nodes_waiting(self: Handler) -> int:
        count = waiting(self)  # synced the state
        try:
            state = self._state_holder.state
            full = state.complete and len(state.participants) >= self._settings.max_nodes
        except AttributeError:  # another torch: its answer
            return count
        return 0 if full else count

    def next_rendezvous(self: Handler):  # type: ignore[no-untyped-def]
        mark(WAITING)
        info = joining(self)
        mark(JOINED)
        return info

    Handler.num_nodes_waiting = num_nodes_waiting  # type: ignore[method-assign]
    Handler.next_rendezvous = next_rendezvous  # type: ignore[method-assign]
    Handler._clusterpulse_spares = True  # type: ignore[attr-defined]


def mark(place: str) -> None:
    path = os.environ.get(RDZV_STATE_ENV)
    if not path:
        return
    tmp = Path(f"{path}.tmp")
    with contextlib.suppress(OSError):  # the launcher then takes the node for failed
        tmp.write_text(place)
        tmp.replace(path)


def place(path: Path) -> str | None:
    """Where a torchrun run with RDZV_STATE_ENV=path last was: WAITING, JOINED, None."""
    try:
        return path.read_text().strip() or None
    except OSError:
        return None


def main() -> None:
    install()
    from torch.distributed.run import main as torchrun

    torchrun()


if __name__ == "__main__":
    main()
