"""torchrun for a job with hot spares: fixes to torch's c10d rendezvous, installed in
the torchrun process (`python -m clusterpulse.trainer.spares <torchrun args>`, or by
trainer/warmstart.py when HOT_SPARES_ENV is set; clusterpulse-train --hot-spares does
either).

1. A node left out of a full round stays on the wait list. torch keeps a node beyond
   `--nnodes`' maximum on a redundancy list, which does not count as waiting and has
   no join deadline. But in any restart of the job (a crash, a hard restart) every
   node, the spare too, passes through the wait list while the old round empties;
   they race for the new round's places, and the one left out is still on the wait
   list (torch moves a node to the redundancy list only from outside it). The
   members see a node waiting (`num_nodes_waiting() > 0`) and restart to take it in,
   the next race leaves one out again: on the testbed, a restart every ~10 s. And
   after join_timeout the left-out node's torchrun fails and, on its way out, closes
   the rendezvous for the whole job. Here the left-out node leaves the wait list for
   the redundancy list, as a node arriving late does, and until it has, a full round
   counts nobody waiting (it can take no one).
2. The launcher must tell a standby's end from a failure: a graceful restart ends
   every torchrun, a standby's with the error of a closed or vanished rendezvous,
   as a member's does when the job's host dies. What tells them apart is where the
   node was: STANDBY (on the redundancy list), REJOINING (a member gone back into a
   rendezvous: its workers failed, or a node joined) or JOINED (in a round), written
   to RDZV_STATE_ENV's file for clusterpulse-train to read.

These wrap methods of torch's rendezvous classes, private ones included (checked for
torch 2.13); on a torch without them the wrappers stand aside.
"""

from __future__ import annotations

import contextlib
import os
from pathlib import Path

HOT_SPARES_ENV = "CLUSTERPULSE_HOT_SPARES"  # set (to 1) for torchrun by the launcher
RDZV_STATE_ENV = "CLUSTERPULSE_RDZV_STATE_FILE"  # where this node's rendezvous place goes
STANDBY, REJOINING, JOINED = "standby", "rejoining", "joined"


def install() -> None:
    """Wrap the c10d rendezvous's methods (idempotent)."""
    from torch.distributed.elastic.rendezvous import dynamic_rendezvous as dr

    handler = dr.DynamicRendezvousHandler
    if getattr(handler, "_clusterpulse_spares", False):
        return
    waiting = handler.num_nodes_waiting
    joining = handler.next_rendezvous

    def num_nodes_waiting(self: dr.DynamicRendezvousHandler) -> int:
        count = waiting(self)  # synced the state
        return 0 if count and _full(self._state_holder.state, self._settings.max_nodes) \
            else count

    def next_rendezvous(self: dr.DynamicRendezvousHandler):  # type: ignore[no-untyped-def]
        if getattr(self, "_clusterpulse_joined", False):
            mark(REJOINING)
        info = joining(self)
        self._clusterpulse_joined = True
        mark(JOINED)
        return info

    handler.num_nodes_waiting = num_nodes_waiting  # type: ignore[method-assign]
    handler.next_rendezvous = next_rendezvous  # type: ignore[method-assign]
    handler._clusterpulse_spares = True  # type: ignore[attr-defined]

    join_op = getattr(dr, "_RendezvousJoinOp", None)
    executor = getattr(dr, "_DistributedRendezvousOpExecutor", None)
    action = getattr(dr, "_Action", None)
    if join_op is None or executor is None or \
            not hasattr(action, "REMOVE_FROM_WAIT_LIST") or \
            not hasattr(executor, "_add_to_redundancy_list"):
        return
    decide = join_op.__call__
    to_redundancy = executor._add_to_redundancy_list

    def join(self, ctx, deadline):  # type: ignore[no-untyped-def]
        state = ctx.state
        if not state.closed and ctx.node in state.wait_list and \
                ctx.node not in state.participants and \
                _full(state, ctx.settings.max_nodes):
            return action.REMOVE_FROM_WAIT_LIST  # then torch's own: the redundancy list
        return decide(self, ctx, deadline)

    def add_to_redundancy_list(self) -> None:  # type: ignore[no-untyped-def]
        to_redundancy(self)
        mark(STANDBY)

    join_op.__call__ = join
    executor._add_to_redundancy_list = add_to_redundancy_list


def _full(state, max_nodes: int) -> bool:  # type: ignore[no-untyped-def]
    return bool(state.complete and len(state.participants) >= max_nodes)


def mark(place: str) -> None:
    path = os.environ.get(RDZV_STATE_ENV)
    if not path:
        return
    tmp = Path(f"{path}.tmp")
    with contextlib.suppress(OSError):  # the launcher then takes the node for failed
        tmp.write_text(place)
        tmp.replace(path)


def place(path: Path) -> str | None:
    """Where a torchrun run with RDZV_STATE_ENV=path last was: STANDBY, REJOINING,
    JOINED, or None (it never got into a rendezvous)."""
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
