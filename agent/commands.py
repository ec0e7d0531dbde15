"""Operator commands for the ranks of a run on this node, and their lifecycle.

`checkpoint-restart` is graceful: the ranks are told (in the reply to their next
message), agree on a step among themselves, save, and exit for torchrun to restart
them. With `leave_s` this node sits the restart out that long (its launcher waits,
trainer/restart.py) while an elastic job goes on without it: the ranks must leave by
the deadline, and once they have, the command has `leave_s` plus the deadline again to
see them back (a rank that cannot leave says why, and the command fails). `restart`
is hard: the agent terminates its local ranks and torchrun restarts them from the
last committed checkpoint. A graceful command that has not completed by its deadline
escalates to hard, because a hung rank never reaches a step boundary.

States: pending -> delivered (every targeted rank acknowledged: it heard the command,
or left for a checkpoint-restart while it was open) -> completed (as many of the run's
ranks as were targeted are back on this node as new processes with a higher restart
count that have each completed a step, whatever numbers the new rendezvous gave them;
joining the process group or loading the checkpoint is not resuming); or escalated
(then completed or failed); or failed (a leave whose ranks left and none came back
fails at its deadline without escalating: nothing is left to signal; so does a
command whose ranks all finished cleanly before they acknowledged it).

One restart of a run at a time: while a restart command of a run is in flight (not
completed or failed, its deadline not passed) a new one is refused (`InFlight`),
whoever asks. Two operators (or an operator and the remediation policy) each asking
for a restart had the second kill the processes the first had just started. A
graceful command that is stuck escalates by itself at its deadline; `escalate` does
it sooner, for whoever names that command.
"""

from __future__ import annotations

import contextlib
import datetime
import itertools
import signal
import threading
import time
from collections.abc import Callable
from dataclasses import dataclass, field

from clusterpulse.agent import identity, protocol
from clusterpulse.agent.audit import AuditLog
from clusterpulse.agent.identity import Sender
from clusterpulse.agent.protocol import EXITED
from clusterpulse.agent.ranks import RankRegistry, RankState

KILL_GRACE_S = 5.0
MAX_COMMANDS = 256


@dataclass
class Command:
    id: str
    run: str
    action: str
    reason: str
    requested_by: str
    created: float  # the book's monotonic clock: what deadlines count from
    deadline: float  # monotonic, like kill_at
    created_unix: float  # wall time, only to report: a wall-clock step moves no deadline
    on_behalf_of: str | None = None  # the operator a principal (the dashboard) acts for
    leave_s: float = 0.0  # graceful: how long this node sits the restart out
    state: str = "pending"
    detail: str = ""
    targets: dict[int, int] = field(default_factory=dict)  # rank -> restarts at creation
    # rank -> the process that held it at creation: "resumed" needs a new process
    owners: dict[int, Sender] = field(default_factory=dict)
    acked: set[int] = field(default_factory=set)
    resumed: set[int] = field(default_factory=set)
    killed_pids: list[int] = field(default_factory=list)
    not_signalled: list[str] = field(default_factory=list)  # why, per rank
    pidfds: list[int] = field(default_factory=list)  # pinned processes awaiting SIGKILL
    kill_at: float | None = None  # when (monotonic) to SIGKILL what SIGTERM did not end

    def to_json(self) -> dict:
        return {
            "id": self.id, "run": self.run, "action": self.action, "reason": self.reason,
            "requested_by": self.requested_by, "on_behalf_of": self.on_behalf_of,
            "leave_s": self.leave_s, "state": self.state, "detail": self.detail,
            "created_unix": self.created_unix, "ranks": sorted(self.targets),
            "acknowledged": sorted(self.acked), "resumed": sorted(self.resumed),
            "signalled_pids": list(self.killed_pids), "not_signalled": list(self.not_signalled),
        }


class InFlight(Exception):
    """A restart of the run is already in flight on this node: a second one would kill
    the processes the first has just started. `command` is the one in flight."""

    def __init__(self, command: Command, message: str) -> None:
        super().__init__(message)
        self.command = command


def in_flight_message(cmd: Command, node: str, now: float) -> str:
    """What a refused caller is told: the command in flight (action, who, when, state)
    and what to do instead, so that a second operator knows a restart is under way."""
    who = cmd.requested_by + (f" on behalf of {cmd.on_behalf_of}" if cmd.on_behalf_of else "")
    when = datetime.datetime.fromtimestamp(cmd.created_unix, datetime.UTC).strftime("%H:%M:%S")
    if cmd.action == "checkpoint-restart" and cmd.state != "escalated":
        then = ("; it escalates to a hard restart by itself at its deadline, or at once "
                f"with POST /v1/commands/{cmd.id}/escalate (clusterpulse-ctl escalate "
                f"--run {cmd.run} --command {cmd.id} --reason ...)")
    else:
        then = ""
    return (f"a restart of run {cmd.run!r} is already in flight on node {node}: command "
            f"{cmd.id} ({cmd.action}, requested by {who} at {when} UTC, state {cmd.state}, "
            f"deadline in {max(0.0, cmd.deadline - now):.0f} s); not restarted twice: ask "
            f"again once it has completed or failed{then}")


class CommandBook:
    """The node's commands. Deadlines and SIGKILL follow-ups run on `clock`, a
    monotonic clock: on the wall clock an NTP step or a VM resume forward escalated
    every open graceful command at once, and a step back delayed a hung job's
    escalation by its size. `wall_clock` only dates what is reported."""

    def __init__(self, ranks: RankRegistry, audit: AuditLog, node: str,
                 clock: Callable[[], float] = time.monotonic,
                 wall_clock: Callable[[], float] = time.time) -> None:
        self._ranks = ranks
        self._audit = audit
        self._node = node
        self._clock = clock
        self._wall_clock = wall_clock
        self._lock = threading.Lock()
        self._commands: dict[str, Command] = {}
        self._ids = itertools.count(1)

    def submit(self, run: str, action: str, reason: str, requested_by: str,
               deadline_s: float, on_behalf_of: str | None = None,
               leave_s: float = 0.0) -> Command:
        """Record a command and start it (a hard restart signals at once). Raises
        InFlight, audited as refused, while another restart of the run is in flight."""
        now, now_unix = self._clock(), self._wall_clock()
        # Not the departed (none of them comes back), and only ranks whose live process
        # and uid the kernel vouched for: a process the agent could not verify may have
        # reported any run's rank numbers, and is evidence, never a target.
        known = self._ranks.live_of_run(run)
        ranks = [r for r in known if r.sender.verified]
        cmd = Command(
            # wall time in the id: unique across agent restarts (the counter restarts)
            id=f"{self._node}-{int(now_unix)}-{next(self._ids)}", run=run, action=action,
            reason=reason, requested_by=requested_by, created=now, created_unix=now_unix,
            deadline=now + deadline_s, on_behalf_of=on_behalf_of, leave_s=leave_s,
            targets={r.rank: r.restarts for r in ranks},
            owners={r.rank: r.sender for r in ranks},
        )
        with self._lock:  # the check and the entry under one lock: two at once, one wins
            running = self._in_flight(run, now)
            if running is not None:
                refused = InFlight(running, in_flight_message(running, self._node, now))
            elif len(self._commands) >= MAX_COMMANDS:  # forget the oldest finished ones
                done = [c.id for c in self._commands.values()
                        if c.state in ("completed", "failed")]
                for cid in done[: len(done) // 2 + 1]:
                    del self._commands[cid]
            if running is None:
                self._commands[cmd.id] = cmd
        if running is not None:
            self._audit.write(requested_by, action, reason, "refused", run=run,
                              node=self._node, source="agent", in_flight=running.id,
                              detail=str(refused),
                              **({"on_behalf_of": on_behalf_of} if on_behalf_of else {}))
            raise refused
        if not ranks:  # one record for this outcome, written by _finish
            why = (f"no ranks of run {run!r} are known on this node" if not known else
                   f"no rank of run {run!r} on this node comes from a process the kernel "
                   "verified (over UDP, from a PID namespace the agent cannot see, or "
                   "gone): nothing is acted on for what an unverified sender reported")
            self._finish(cmd, "failed", why)
            return cmd
        if action == "restart":
            self._terminate(cmd)
        self._audit.write(requested_by, action, reason, cmd.state, run=run, command=cmd.id,
                          node=self._node, source="agent", **self._signals(cmd))
        return cmd

    def _in_flight(self, run: str, now: float) -> Command | None:
        """The run's restart command still under way (the lock held), if any. Past its
        deadline a command is over (the next tick fails or escalates it)."""
        for c in self._commands.values():
            if (c.run == run and c.action in protocol.ACTIONS
                    and c.state not in ("completed", "failed") and now < c.deadline):
                return c
        return None

    def escalate(self, cid: str, requested_by: str, reason: str,
                 on_behalf_of: str | None = None) -> Command:
        """Escalate an open graceful command to a hard restart now, as its deadline
        would: the way to force a hard restart over a graceful one that is stuck. It
        names the command it overrides, and is audited as who asked; only the processes
        the command targeted are signalled. Raises LookupError (no such command) or
        ValueError (not an open, unescalated checkpoint-restart)."""
        with self._lock:
            cmd = self._commands.get(cid)
            if cmd is None:
                raise LookupError(f"no command {cid[:160]!r}")
            if cmd.action != "checkpoint-restart" or cmd.state not in ("pending", "delivered"):
                raise ValueError(f"command {cid} is a {cmd.action} in state {cmd.state}: only "
                                 "a pending or delivered checkpoint-restart can be escalated")
            now = self._clock()
            self._terminate(cmd)
            cmd.deadline = now + max(60.0, cmd.deadline - cmd.created)
        signals = self._signals(cmd)  # the escalation's own on_behalf_of, not the command's
        signals.pop("on_behalf_of", None)
        self._audit.write(requested_by, "restart", f"escalated: {reason}", "escalated",
                          run=cmd.run, command=cmd.id, node=self._node, source="agent",
                          **signals, **({"on_behalf_of": on_behalf_of} if on_behalf_of else {}))
        return cmd

    @staticmethod
    def _signals(cmd: Command) -> dict:
        out: dict = {"on_behalf_of": cmd.on_behalf_of} if cmd.on_behalf_of else {}
        if cmd.leave_s:
            out["leave_s"] = cmd.leave_s
        if cmd.killed_pids or cmd.not_signalled:
            out.update(signalled_pids=list(cmd.killed_pids),
                       not_signalled=list(cmd.not_signalled))
        return out

    def get(self, cid: str) -> Command | None:
        with self._lock:
            return self._commands.get(cid)

    def all(self) -> list[Command]:
        with self._lock:
            return list(self._commands.values())

    def pending_for(self, run: str, rank: int, restarts: int = 0,
                    sender: Sender | None = None) -> list[dict]:
        """Graceful commands a rank must still hear about (resent until acknowledged).

        A command is for the processes that held the ranks when it was given: once a
        rank is back with a higher restart count (or as another verified process) it
        has left, so it is not told again even if its acknowledgement was lost, or it
        would restart a second time.
        """
        with self._lock:
            return [
                {"id": c.id, "action": c.action, **({"leave_s": c.leave_s} if c.leave_s else {})}
                for c in self._commands.values()
                if c.run == run and c.action == "checkpoint-restart" and rank in c.targets
                and rank not in c.acked and c.state in ("pending", "delivered")
                and restarts <= c.targets[rank] and not _replaced(c.owners.get(rank), sender)
            ]

    def left_gracefully(self, run: str, rank: int, sender: Sender) -> None:
        """A rank's process said it left for a checkpoint-restart: that carries out
        every open graceful command it was targeted by, heard or not. (Ranks agree on
        a restart among themselves; a rank can leave for a command only a peer heard,
        and would otherwise never acknowledge it.) Not a command that also takes the
        node out (`leave_s`): only the rank's own acknowledgement says it sat out."""
        with self._lock:
            for c in self._commands.values():
                if (c.run == run and c.action == "checkpoint-restart" and rank in c.targets
                        and c.state in ("pending", "delivered") and not c.leave_s
                        and c.owners.get(rank) == sender):
                    c.acked.add(rank)

    def leave_refused(self, run: str, rank: int, cid: str, reason: str,
                      sender: Sender) -> None:
        """A rank's process the command was given to said its node cannot sit out: the
        command fails. Not any other sender of the rank's number (its successor, or,
        once the entry expired, another user's process): none of them heard it."""
        with self._lock:
            cmd = self._commands.get(cid)
            if (cmd is None or cmd.run != run or not cmd.leave_s or rank not in cmd.targets
                    or cmd.state not in ("pending", "delivered")
                    or cmd.owners.get(rank) != sender):
                return
            then = ("it restarted with the job instead" if reason == "others_leaving"
                    else "nothing was restarted")
            self._finish(cmd, "failed", f"rank {rank} cannot take node {self._node} out of the "
                         f"job: {protocol.LEAVE_REFUSALS[reason]}; {then}")

    def _terminate(self, cmd: Command) -> None:
        """SIGTERM the run's ranks that the kernel vouched for, through pidfds.

        A rank learnt over UDP, or whose process is no longer the one that registered
        (exited, pid reused), is not signalled; the reason is kept for the audit log.
        Only the processes that held the ranks when the command was made: at an
        escalation the ranks that did leave may be back as new processes still
        loading their checkpoint, and those must not be killed.
        """
        owners = set(cmd.owners.values())
        for r in self._ranks.live_of_run(cmd.run):  # not departed ranks' entries
            if r.sender not in owners:
                continue
            try:
                fd = identity.open_verified(r.sender)
            except identity.SignalRefused as why:
                cmd.not_signalled.append(f"rank {r.rank}: {why}")
                continue
            try:
                if identity.send_signal(fd, signal.SIGTERM):
                    cmd.killed_pids.append(r.sender.pid)
                    cmd.pidfds.append(fd)
                    continue
            except PermissionError as err:
                cmd.not_signalled.append(f"rank {r.rank}: cannot signal pid "
                                         f"{r.sender.pid}: {err.strerror}")
            identity.close_quietly(fd)
        if cmd.not_signalled and not cmd.killed_pids:
            cmd.detail = "; ".join(cmd.not_signalled)[:500]
        cmd.kill_at = self._clock() + KILL_GRACE_S
        cmd.state = "escalated" if cmd.action == "checkpoint-restart" else "delivered"

    def _kill_survivors(self, cmd: Command) -> None:
        for fd in cmd.pidfds:
            with contextlib.suppress(OSError):
                identity.send_signal(fd, signal.SIGKILL)
            identity.close_quietly(fd)
        cmd.pidfds.clear()
        cmd.kill_at = None

    def _finish(self, cmd: Command, state: str, detail: str) -> None:
        cmd.state, cmd.detail = state, detail
        for fd in cmd.pidfds:  # nothing left to follow up: unpin the processes
            identity.close_quietly(fd)
        cmd.pidfds.clear()
        cmd.kill_at = None
        self._audit.write(cmd.requested_by, cmd.action, cmd.reason, state, run=cmd.run,
                          command=cmd.id, node=self._node, detail=detail, source="agent",
                          **self._signals(cmd))

    def tick(self) -> None:
        """Advance every open command: acks, resumption, deadlines, SIGKILL follow-up."""
        now = self._clock()
        ranks = self._ranks.snapshot()
        for cmd in self.all():
            if cmd.state in ("completed", "failed"):
                continue
            # Resumed = as many ranks of the run on this node as the command targeted,
            # each a new process with a higher restart count. Not the same rank numbers:
            # a new rendezvous (a relaunch after a graceful restart, an elastic change)
            # numbers nodes afresh, and ranks 0-1 here may come back as ranks 2-3.
            base = min(cmd.targets.values(), default=0)
            owners = set(cmd.owners.values())
            owner_uids = {o.uid for o in owners}
            for r in ranks:
                if r.run != cmd.run or not r.sender.verified:
                    continue  # an unverified sender is never a witness
                if r.rank in cmd.targets and cmd.id in r.acks:
                    cmd.acked.add(r.rank)
                # resumed: a new process of the user whose ranks were restarted; another
                # user reporting the run's rank numbers is not the job coming back
                new_process = r.sender not in owners and r.sender.uid in owner_uids
                stepped = r.process_steps > 0 or r.phase == EXITED  # or had none left
                if r.restarts > base and stepped and new_process:
                    cmd.resumed.add(r.rank)
            if cmd.state == "pending" and cmd.acked >= set(cmd.targets):
                cmd.state = "delivered"
                if cmd.leave_s:  # they left: the node sits out, then they come back
                    cmd.deadline = now + cmd.leave_s + (cmd.deadline - cmd.created)
            if len(cmd.resumed) >= len(cmd.targets):
                if cmd.leave_s and cmd.state == "pending":
                    # back without acknowledging it: another node's restart came first,
                    # or the ranks could not take this node out at the agreement
                    self._finish(cmd, "failed", "the ranks restarted with the job without "
                                 f"node {self._node} sitting out")
                else:
                    self._finish(cmd, "completed", "all ranks resumed")
                continue
            if cmd.state == "pending" and _all_finished(ranks, cmd):
                # The run ended cleanly before its ranks reached the agreement: nothing
                # is left to restart, and escalating at the deadline would audit a hard
                # restart of a job that had already finished.
                self._finish(cmd, "failed", f"run {cmd.run} finished (or was preempted) on node "
                             f"{self._node} before its ranks reached a step boundary: "
                             "nothing to restart")
                continue
            if cmd.kill_at is not None and now >= cmd.kill_at:
                self._kill_survivors(cmd)
            if now >= cmd.deadline:
                if cmd.leave_s and cmd.state == "delivered" and \
                        not self._ranks.live_of_run(cmd.run):
                    # the ranks left, their processes are gone and none came back:
                    # nothing to escalate against. Not "completed": nothing here can tell
                    # a spare in the node's place from a launcher that never rejoined.
                    self._finish(cmd, "failed", "the node sat out and its ranks did not "
                                 "come back: the job went on without it (a hot spare in its "
                                 "place, or this node's launcher did not rejoin)")
                    continue
                if cmd.action == "checkpoint-restart" and cmd.state != "escalated":
                    self._terminate(cmd)
                    self._audit.write(cmd.requested_by, "restart", "graceful deadline passed",
                                      "escalated", run=cmd.run, command=cmd.id,
                                      node=self._node, source="agent", **self._signals(cmd))
                    cmd.deadline = now + max(60.0, cmd.deadline - cmd.created)
                else:
                    self._finish(cmd, "failed", "ranks did not resume before the deadline")


def _all_finished(ranks: list[RankState], cmd: Command) -> bool:
    """True when every process the command targeted said it finished (or was
    preempted) and left: the kernel-verified owners only, so another user's exit
    event for the run's rank numbers never closes someone else's command."""
    owned = [r for r in ranks if r.run == cmd.run and r.sender.verified
             and cmd.owners.get(r.rank) == r.sender]
    return len(owned) == len(cmd.owners) > 0 and all(r.phase == EXITED for r in owned)


def _replaced(owner: Sender | None, current: Sender | None) -> bool:
    """True when the kernel vouches that another process now holds the rank."""
    return (owner is not None and current is not None and owner.verified
            and current.verified and owner != current)
