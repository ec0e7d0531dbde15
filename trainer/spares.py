"""torchrun for a job with hot spares: fixes to torch's c10d rendezvous, installed in
the torchrun process when HOT_SPARES_ENV is set (trainer/torchrun.py, `prepare`, which
trainer/warmstart/ calls too; clusterpulse-train --hot-spares sets it).

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
   node was: STANDBY (seen on the redundancy list, and in no round since), REJOINING
   (a member gone back into a rendezvous: its workers failed, or a node joined) or
   JOINED (in a round), written to RDZV_STATE_ENV's file for clusterpulse-train.
3. torchrun shuts its rendezvous down on every way out, which closes it for every
   node: a standby ending on a passing store error would close the running job's
   rendezvous (its members fail at their next restart). A node outside the round
   leaves without closing it.
4. A node the job went on without never learns it: cut off the network, its ranks
   block in a collective; the others restart (a hard restart, or a peer error) and
   torch's rendezvous drops the silent node as dead. Back on the network its
   connections are idle (its ranks wait to receive, so nothing sends and nothing is
   reset) and its torchrun, in a healthy worker group by its own account, keeps them
   waiting until the collective timeout. A node whose round has ended (the state is
   in a later round: every member left the old one) without it among the new round's
   participants now counts as waiting itself: torchrun stops its workers and joins
   again (a standby if the round is full, else the members take it in, as for any
   returning node). Only a later round: torch also drops a member of the running
   round whose keep-alive is a few seconds late (a starved torchrun), whose workers
   still train; restarting for that would restart the whole job.

5. A standby that serves the rendezvous store, whose round ended (a graceful
   restart), must start its torchrun at once: the others need its store. It was
   first into the new round and took a job node's place. Its launcher writes how
   long to hold back in JOIN_WHEN_ROOM_ENV's file; the first join waits, reading the
   state from its own store, until the new round has room (`room_in`), as a standby
   that does not host the store waits in its launcher (`room_for_a_standby`).

These wrap methods of torch's rendezvous classes and read their private state
(checked for torch 2.6 to 2.13); where those are missing the wrappers give torch's answer.

`running_without` reads the same state from the launcher, for any multi-node job: a
node back from a leave (the remediation's evict-node) rejoins only once the job runs
without it (trainer/launch.py); `room_for_a_standby` tells a standby whose round ended
when the job's own nodes have had their places back.
"""

from __future__ import annotations

import binascii
import contextlib
import os
import pickle
import sys
import time
from base64 import b64decode
from datetime import UTC, datetime, timedelta
from pathlib import Path
from typing import Any

from clusterpulse.trainer.restart import write_atomically
from clusterpulse.trainer.torch_support import fallback

HOT_SPARES_ENV = "CLUSTERPULSE_HOT_SPARES"  # set (to 1) for torchrun by the launcher
RDZV_STATE_ENV = "CLUSTERPULSE_RDZV_STATE_FILE"  # where this node's rendezvous place goes
STANDBY, REJOINING, JOINED = "standby", "rejoining", "joined"
# A file whose seconds tell a torchrun's first join to wait for room in the new round
# (5.); read once and removed: a later rejoin of the same torchrun does not wait.
JOIN_WHEN_ROOM_ENV = "CLUSTERPULSE_JOIN_WHEN_ROOM_FILE"
# How close to the end of a new round's last call a standby whose round ended joins it
# (`room_in`): the job's own nodes get their places back first, and a place left free
# (an evicted node's) is still taken in this round, not the next.
STANDBY_JOIN_MARGIN_S = 2.0
# A counter in the new round's store of the nodes that sit that round out (an evicted
# node's launcher adds to it: `announce_sitting_out`), by round: the place a standby may
# take before the last call ends (`room_in`).
SITTING_OUT_KEY = "clusterpulse.sitting_out.{run_id}.{round}"


def install() -> None:
    """Wrap the c10d rendezvous's methods (idempotent)."""
    from torch.distributed.elastic.rendezvous import dynamic_rendezvous as dr

    handler = dr.DynamicRendezvousHandler
    if getattr(handler, "_clusterpulse_spares", False):
        return
    waiting = handler.num_nodes_waiting
    joining = handler.next_rendezvous
    shutting = handler.shutdown

    def num_nodes_waiting(self: dr.DynamicRendezvousHandler) -> int:
        count = waiting(self)  # synced the state
        try:
            state = self._state_holder.state
            full = _full(state, self._settings.max_nodes)
            joined_round = getattr(self, "_clusterpulse_round", None)
            dropped = joined_round is not None and state.round > joined_round and \
                self._this_node not in state.participants
        except AttributeError:  # another torch: its answer
            return count
        if dropped:  # the job went on without this node: rejoin (4.)
            return max(count, 1)
        return 0 if count and full else count

    def next_rendezvous(self: dr.DynamicRendezvousHandler):  # type: ignore[no-untyped-def]
        if getattr(self, "_clusterpulse_joined", False):
            mark(REJOINING)
        else:
            _wait_for_room(self, _join_when_room_s())
        info = joining(self)
        self._clusterpulse_joined = True
        with contextlib.suppress(AttributeError):  # another torch: no round to compare
            self._clusterpulse_round = self._state_holder.state.round
        mark(JOINED)
        return info

    def shutdown(self: dr.DynamicRendezvousHandler) -> bool:
        # torchrun shuts its rendezvous down on every way out, and that closes it for
        # every node: a standby's torchrun ending on a passing store error would close
        # the running job's rendezvous, and the members would fail at their next
        # restart. A node not in the round leaves without closing it.
        try:
            outside = self._this_node not in self._state_holder.state.participants
            if outside:
                self._stop_heartbeats()
                return True
        except AttributeError:
            pass
        return shutting(self)

    handler.num_nodes_waiting = num_nodes_waiting  # type: ignore[method-assign]
    handler.next_rendezvous = next_rendezvous  # type: ignore[method-assign]
    handler.shutdown = shutdown  # type: ignore[method-assign]
    handler._clusterpulse_spares = True  # type: ignore[attr-defined]

    join_op = getattr(dr, "_RendezvousJoinOp", None)
    action = getattr(dr, "_Action", None)
    if join_op is None or not all(hasattr(action, a) for a in (
            "REMOVE_FROM_WAIT_LIST", "ADD_TO_REDUNDANCY_LIST")):
        fallback("the c10d rendezvous join decisions hot spares need (_RendezvousJoinOp)",
                 "a standby node joins rounds as torch decides")
        return
    decide = join_op.__call__

    def join(self, ctx, deadline):  # type: ignore[no-untyped-def]
        state = ctx.state
        if ctx.node in state.redundancy_list:  # synced: where torch has this node now
            mark(STANDBY)
        elif not state.closed and ctx.node not in state.participants and \
                _full(state, ctx.settings.max_nodes):
            # left out of a full round: to the redundancy list, which torch does only
            # for a node on no list and only before its join deadline
            if ctx.node in state.wait_list:
                return action.REMOVE_FROM_WAIT_LIST
            return action.ADD_TO_REDUNDANCY_LIST
        return decide(self, ctx, deadline)

    join_op.__call__ = join


def _join_when_room_s() -> float | None:
    """JOIN_WHEN_ROOM_ENV's seconds, taken (the file removed); None when not asked."""
    path = os.environ.get(JOIN_WHEN_ROOM_ENV)
    if not path:
        return None
    try:
        text = Path(path).read_text()
        Path(path).unlink()
        return float(text)
    except (OSError, ValueError):
        return None


def _wait_for_room(handler, within_s: float | None) -> None:  # type: ignore[no-untyped-def]
    """Hold this torchrun's first join, at most `within_s`, until the new round has
    room for a standby (5.); longer, the job is more likely short of its minimum
    without this node, and it joins."""
    if within_s is None:
        return
    end = time.monotonic() + within_s
    try:
        while time.monotonic() < end:
            handler._state_holder.sync()
            state = handler._state_holder.state
            # closed on this node's own new store: the job's nodes closed it (the job is
            # over), not the old round's store (`room_in`); torch's join says so
            backend = getattr(handler._state_holder, "_backend", None)
            freed = _sitting_out(getattr(backend, "_store", None),
                                 handler._settings.run_id, state)
            if state.closed or room_in(state, STANDBY_JOIN_MARGIN_S, freed):
                return
            time.sleep(0.2)
    except AttributeError:  # another torch: join, as torchrun would
        return
    print(f"clusterpulse: the job's new round did not form in {within_s:.0f} s (a job node "
          "lost in the restart, or the job over): joining it", file=sys.stderr, flush=True)


def _full(state, max_nodes: int) -> bool:  # type: ignore[no-untyped-def]
    return bool(state.complete and len(state.participants) >= max_nodes)


_last_mark: dict[str, str] = {}


def mark(place: str) -> None:
    path = os.environ.get(RDZV_STATE_ENV)
    if not path or _last_mark.get(path) == place:
        return  # a standby re-reads its place every second: written when it changes
    _last_mark[path] = place
    with contextlib.suppress(OSError):  # the launcher then takes the node for failed
        write_atomically(Path(path), place)


def place(path: Path) -> str | None:
    """Where a torchrun run with RDZV_STATE_ENV=path last was: STANDBY, REJOINING,
    JOINED, or None (it never got into a rendezvous)."""
    try:
        return path.read_text().strip() or None
    except OSError:
        return None


def running_without(endpoint: tuple[str, int], run_id: str, node: tuple[str, int]) -> bool:
    """Whether the job's rendezvous at `endpoint` runs a round without `node` (the
    address and torchrun pid it joined with): complete, nobody on its wait list, `node`
    not among its participants; or closed (the job is over: nothing to wait for).

    A node back from a leave shorter than the job's restart (its sit-out counts
    from its own ranks' exit; a restart of many nodes, or of loaded ones, is slower)
    found the new round still forming, joined it, and took its place again, ahead of
    a spare whose torchrun starts only once the store's host is back. Nobody waiting:
    a spare that missed the round's last call and has joined since is on the wait list
    and gets in first (one still starting is not seen, and races this node).
    A store that does not answer, or has no round yet, reads as not running."""
    state = _rendezvous_state(endpoint, run_id)
    if state is None or state is _NO_ANSWER or state is _UNREADABLE:
        return state is _UNREADABLE  # a state this torch does not know: rejoin, as torchrun would
    try:
        outside = not any((p.addr, p.pid) == node for p in state.participants)
        # closed with the node in it: the round it left, closed by its own torchrun's
        # exit, on a store whose host has not restarted yet (not the job's end)
        if state.closed:
            return outside
        return bool(state.complete and not state.wait_list and outside)
    except (AttributeError, TypeError):
        return True


def room_for_a_standby(endpoint: tuple[str, int], run_id: str,
                       margin_s: float = STANDBY_JOIN_MARGIN_S) -> bool | None:
    """Whether a standby whose round ended (the job restarted gracefully) joins the new
    round now (`room_in`), read from the store at `endpoint`: None when it does not
    answer (its host restarting, or the job over); no state yet: not yet."""
    state, store = _read_rendezvous(endpoint, run_id)
    if state is _NO_ANSWER:
        return None
    if state is None or state is _UNREADABLE:
        return state is _UNREADABLE  # join, as torchrun would
    return room_in(state, margin_s, _sitting_out(store, run_id, state))


def room_in(state, margin_s: float, sitting_out: int | None) -> bool:  # type: ignore[no-untyped-def]
    """Whether the new round `state` has room for a standby: it is complete (full: the
    standby stands by again; short of the maximum: the job takes it in, as any late
    node), or it has the job's minimum, a node of the job sits it out (`sitting_out`
    of them said so: an evicted node's place) and its last call ends within
    `margin_s`, so that the place is taken in this round, not by one more restart.
    Until then the job's own nodes get their places back first: with every torchrun
    started ahead of its turn (trainer/launch.py, Prewarmed) the standby was as quick
    as they were, took a place, and a job node became the standby, on torch's first
    come, first served; without the count a job node more than the last call less the
    margin (3 s) behind the others lost its place too (CI, on a loaded machine).
    `sitting_out` None: the count cannot be read (another torch), the margin alone
    decides. A closed round is the one that ended (its store's host has not restarted
    yet)."""
    try:
        if state.closed:
            return False
        if state.complete:
            return True
        deadline = state.deadline
        return deadline is not None and sitting_out != 0 and (
            deadline - datetime.now(UTC)).total_seconds() <= margin_s
    except (AttributeError, TypeError):
        return True


def announce_sitting_out(endpoint: tuple[str, int], run_id: str) -> bool:
    """Count this node, leaving the job for a while (an eviction), as sitting out the
    round forming at `endpoint` (`room_in`: a standby takes its place in that round).
    False while there is no such round yet: the store's host has not restarted, or its
    state is the round that ended (closed)."""
    state, store = _read_rendezvous(endpoint, run_id)
    if store is None or state is None or state is _UNREADABLE:
        return False
    try:
        if state.closed:
            return False
        store.add(SITTING_OUT_KEY.format(run_id=run_id, round=state.round), 1)
    except (AttributeError, RuntimeError, TimeoutError, OSError, ValueError):
        return False
    return True


def _sitting_out(store, run_id: str, state) -> int | None:  # type: ignore[no-untyped-def]
    """How many nodes said they sit out `state`'s round, from `store`: 0 when the store
    does not answer (no room yet: asked again at the next poll, within the hold);
    None for another torch's rendezvous, where the margin alone decides."""
    try:
        key = SITTING_OUT_KEY.format(run_id=run_id, round=state.round)
    except AttributeError:
        return None
    if store is None:
        return None
    try:
        return int(store.get(key)) if store.check([key]) else 0
    except (RuntimeError, TimeoutError, OSError, ValueError):
        return 0


_UNREADABLE = object()  # a rendezvous state this torch version does not know
_NO_ANSWER = object()  # the store did not answer


def _rendezvous_state(endpoint: tuple[str, int], run_id: str) -> Any:
    """torch's rendezvous state for `run_id` as every torchrun unpickles it from the
    store at `endpoint`; _NO_ANSWER when the store does not answer, None when it holds
    none yet, _UNREADABLE when it cannot be read."""
    return _read_rendezvous(endpoint, run_id)[0]


def _read_rendezvous(endpoint: tuple[str, int], run_id: str) -> tuple[Any, Any]:
    """`_rendezvous_state`'s state, and the store client it was read with (None when
    the store did not answer): for the keys beside it (`SITTING_OUT_KEY`)."""
    from torch.distributed import TCPStore

    key = f"torch.rendezvous.{run_id}"
    try:
        store = TCPStore(endpoint[0], endpoint[1], is_master=False,
                         timeout=timedelta(seconds=2), wait_for_workers=False)
        raw = store.get(key) if store.check([key]) else _NO_STATE
    except (RuntimeError, TimeoutError, OSError, ValueError):  # not answering (yet)
        return _NO_ANSWER, None
    if raw == _NO_STATE:
        return None, store
    try:
        return pickle.loads(b64decode(raw, validate=True)), store
    except (binascii.Error, ValueError, pickle.UnpicklingError, EOFError, AttributeError,
            ImportError, TypeError, KeyError, IndexError):
        return _UNREADABLE, store


_NO_STATE = b"Y2FuaW1hZGFt"  # torch's C10dRendezvousBackend's sentinel: no state yet
