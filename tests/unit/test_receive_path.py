"""A shared node's receive path: senders that never read, a user who floods, a sender
whose pid is taken over, and who may witness or be the target of an action.

Each case was reproduced on the datagram receiver this replaced (issue: a production
GPU node): 8 non-reading sockets capped the agent at ~5 messages/s and the policy
hard-restarted a healthy job; a junk flood dropped 83 % of another user's telemetry;
a root process placed on a sender's freed pid was killed by a hard restart.
"""

from __future__ import annotations

import contextlib
import os
import select
import socket
import subprocess
import threading
import time
from collections.abc import Callable

import pytest

from clusterpulse.agent import protocol
from clusterpulse.agent.audit import AuditLog
from clusterpulse.agent.backends.sim import SimBackend
from clusterpulse.agent.commands import CommandBook
from clusterpulse.agent.core import Agent
from clusterpulse.agent.identity import Sender
from clusterpulse.agent.ranks import RankRegistry
from clusterpulse.trainer.telemetry import AgentLink
from tests.conftest import socket_path
from tests.support.clock import ManualClock
from tests.support.ranksock import NEIGHBOURS, SYSTEM_PYTHON, connect

ROOT = os.geteuid() == 0


def wait_for(cond, what: str | Callable[[], str], timeout: float = 30.0) -> None:
    """`what` names the wait in a time-out; a callable is asked then (a count as it
    was at the time-out, not as it was when the wait began)."""
    deadline = time.monotonic() + timeout
    while not cond():
        assert time.monotonic() < deadline, \
            f"timed out waiting for {what() if callable(what) else what}"
        time.sleep(0.02)


def steps_of(agent: Agent, run: str) -> int:
    return sum(r.steps_total for r in agent.ranks.of_run(run))


def send_steps(link: AgentLink, run: str, n: int, every_s: float) -> None:
    for step in range(1, n + 1):
        link.send({"type": "step", "run": run, "rank": 0, "step": step,
                   "step_seconds": every_s})
        time.sleep(every_s)


def victim_loses_nothing(running, run: str, n: int, every_s: float) -> None:
    """A healthy rank sends `n` steps through a real link beside whatever else the node
    holds: every one arrives, and the link dropped none."""
    link = AgentLink(running.socket_path, local_rank=0)
    try:
        send_steps(link, run, n, every_s)
        wait_for(lambda: steps_of(running.agent, run) == n, f"{run}'s {n} steps")
        assert link.failed == 0, f"{link.failed} of {n} of {run}'s messages were lost"
    finally:
        link.close()


def test_senders_that_never_read_their_replies_cost_the_others_nothing(sim_agent):
    """A hung job's ranks keep sending heartbeats (their heartbeat thread lives) and
    never read the replies (their main thread is stuck): each reply waited 0.2 s for
    room, and a healthy job's heartbeat age reached 25 s."""
    stalled = [connect(sim_agent.socket_path) for _ in range(8)]
    stop = threading.Event()

    def hung_job() -> None:
        while not stop.is_set():
            for i, s in enumerate(stalled):
                # its own queue full is its loss: BlockingIOError, or TimeoutError once
                # the socket's 2 s timeout ran out first (a loaded machine; the thread
                # died of it and the replies stopped piling up)
                with contextlib.suppress(BlockingIOError, TimeoutError):
                    s.send(protocol.encode({"type": "heartbeat", "run": "hung", "rank": i,
                                            "phase": "sync"}), socket.MSG_DONTWAIT)
            time.sleep(0.01)

    noise = threading.Thread(target=hung_job)
    noise.start()
    counts = sim_agent.agent.telemetry_counts
    try:
        wait_for(lambda: counts["reply_dropped"] >= 100, "the hung job's replies to pile up")
        victim_loses_nothing(sim_agent, "healthy", 200, every_s=0.005)
    finally:
        stop.set()
        noise.join()
        for s in stalled:
            s.close()
    assert counts["reply_dropped"] >= 100  # the hung job lost its replies, nobody else


@pytest.mark.skipif(not ROOT, reason="a second user's flood needs root to run as uid 65534")
def test_one_users_flood_costs_another_user_nothing(sim_agent):
    """Finding: a junk flood from one user dropped 83 % of another user's datagrams
    (one shared queue of 10). Each connection has its own queue now, and every user
    gets the same share of each round."""
    flooder = subprocess.Popen([SYSTEM_PYTHON, "-c", NEIGHBOURS, sim_agent.socket_path, "8",
                                "0", "4"],
                               stdout=subprocess.PIPE, text=True, user=65534)
    try:
        assert flooder.stdout is not None
        assert flooder.stdout.readline().strip() == "ready"
        victim_loses_nothing(sim_agent, "victim", 300, every_s=0.01)
        counts = sim_agent.agent.telemetry_counts
        assert counts["malformed_not_json"] > 1000  # the flood was real, and was read
    finally:
        flooder.kill()
        flooder.wait()


def _on_pid(pid: int, argv: list[str]) -> subprocess.Popen:
    """A process on exactly `pid` (freed by another), as a pid cycle would place one."""
    for _ in range(200):
        with open("/proc/sys/kernel/ns_last_pid", "w") as f:
            f.write(str(pid - 1))
        p = subprocess.Popen(argv)
        if p.pid == pid:
            return p
        p.kill()
        p.wait()
    raise AssertionError(f"could not start a process on pid {pid} (others kept forking)")


@pytest.mark.skipif(not ROOT, reason="placing a process on a chosen pid (ns_last_pid) "
                                     "and sending as another uid need root")
def test_a_sender_that_exited_is_never_taken_for_the_process_now_on_its_pid(tmp_path):
    """Finding: the sender was looked up when the agent read the datagram. With the
    agent paused, another user sent a rank of run "victim" and exited; a root process
    took the freed pid; the agent read the datagram, took root's process for the rank,
    and a hard restart killed it. The kernel names a connection's process when it
    connects; the agent pins it as it accepts, and one gone by then is unverified."""
    ranks, path = RankRegistry(), socket_path("pid")
    agent = Agent(SimBackend(gpus=2, node="p"), "p", ranks, AuditLog(tmp_path / "a.jsonl"),
                  telemetry_addr=path)
    assert agent.receiver is not None
    sleeper = None
    try:  # the agent is not started: busy, or paused, while this happens
        sender = subprocess.Popen([SYSTEM_PYTHON, "-c", (
            "import json, socket, sys; s = socket.socket(socket.AF_UNIX, "
            "socket.SOCK_SEQPACKET); s.connect(sys.argv[1]); s.send(json.dumps({'v': 1, "
            "'type': 'step', 'run': 'victim', 'rank': 0, 'step': 1}).encode())"),
            path], user=65534)
        assert sender.wait() == 0
        sleeper = _on_pid(sender.pid, ["sleep", "60"])
        for _ in range(5):
            agent.receiver.round(timeout=0.2)
        (r,) = ranks.of_run("victim")
        assert not r.sender.verified and r.pid == 0
        cmd = agent.commands.submit("victim", "restart", "hung", "token", 60)
        assert cmd.state == "failed" and "verified" in cmd.detail, cmd.detail
        assert cmd.killed_pids == [] and sleeper.poll() is None
    finally:
        if sleeper is not None:
            sleeper.kill()
            sleeper.wait()
        agent.stop()


def test_another_users_ranks_never_witness_that_a_run_resumed():
    """Finding: another user reporting new rank numbers of a victim's run with
    `restarts` 1 made an operator's graceful restart of a hung run show `completed: all
    ranks resumed`; it never escalated. Only new processes of the restarted ranks' own
    user are the run coming back; an unverified sender is never a witness."""
    alive = {1, 2, 3, 4}
    ranks = RankRegistry(alive=lambda s: s.pid in alive)
    book = CommandBook(ranks, AuditLog(None), "n")
    victim = Sender(pid=1, uid=1000, start_time=1, verified=True)
    base = {"v": 1, "run": "job", "local_rank": 0, "gpu": 0}
    ranks.update({**base, "type": "step", "rank": 0, "step": 5}, None, victim)
    cmd = book.submit("job", "checkpoint-restart", "hung", "op", deadline_s=60)
    assert cmd.targets == {0: 0}
    intruder = Sender(pid=2, uid=2000, start_time=2, verified=True)
    ranks.update({**base, "type": "step", "rank": 1, "step": 6, "restarts": 1}, None, intruder)
    ranks.update({**base, "type": "step", "rank": 2, "step": 6, "restarts": 1}, None,
                 Sender(pid=3, uid=1000))  # the victim's uid, but nobody vouches for it
    book.tick()
    assert cmd.state == "pending" and cmd.resumed == set(), cmd.to_json()
    alive.discard(1)  # the victim's rank restarted for real: a new process of its user
    ranks.update({**base, "type": "step", "rank": 0, "step": 6, "restarts": 1}, None,
                 Sender(pid=4, uid=1000, start_time=4, verified=True))
    book.tick()
    assert cmd.state == "completed" and cmd.resumed == {0}


def test_only_the_process_a_leave_was_for_can_say_its_node_cannot_sit_out():
    """Any local process that reported the rank's (run, rank) (the owner's successor,
    or another user's once the owner's entry expired) failed an operator's
    evict-node with `leave_refused`: the node never sat out, and the command said the
    job could not lose it. Only the process the command was given to has heard it."""
    alive = {1}
    clock = ManualClock()
    ranks = RankRegistry(grace_s=60, clock=clock, alive=lambda s: s.pid in alive)
    agent = Agent(SimBackend(gpus=1), "n", ranks, AuditLog(None))
    owner = Sender(pid=1, uid=1000, start_time=1, verified=True)

    def send(sender: Sender, **kw) -> None:
        agent.handle_datagram(protocol.encode({"run": "job", "rank": 0, **kw}), None, sender)

    def refuse(sender: Sender, cid: str) -> None:
        send(sender, type="event", event="leave_refused", command=cid, reason="single_node")

    send(owner, type="step", step=1)
    said = agent.commands.submit("job", "checkpoint-restart", "link", "op", 3600, leave_s=600)
    refuse(owner, said.id)
    assert said.state == "failed" and "single-node job" in said.detail
    cmd = agent.commands.submit("job", "checkpoint-restart", "link", "op", 3600, leave_s=600)
    alive.discard(1)  # the owner exited; the job's user's next process has the rank
    alive.add(2)
    send(Sender(pid=2, uid=1000, start_time=2, verified=True), type="step", step=2,
         restarts=1)
    refuse(Sender(pid=2, uid=1000, start_time=2, verified=True), cmd.id)
    assert cmd.state == "pending", cmd.detail
    alive.discard(2)
    clock.t += 61
    ranks.expire()  # forgotten: another user's process may report the rank now
    alive.add(3)
    refuse(Sender(pid=3, uid=2000, start_time=3, verified=True), cmd.id)
    assert agent.telemetry_counts["accepted"] == 5  # each heard, none refused
    assert cmd.state == "pending", cmd.detail


def test_an_unverified_sender_is_never_a_target():
    """A rank that only an unverified sender reports is evidence: a command for its run
    targets nothing and says why, instead of escalating against a process nobody
    named."""
    ranks = RankRegistry()
    book = CommandBook(ranks, AuditLog(None), "n")
    ranks.update({"v": 1, "type": "step", "run": "ghost", "rank": 0, "step": 1}, None,
                 Sender(pid=9, uid=0))
    cmd = book.submit("ghost", "checkpoint-restart", "straggler", "op", deadline_s=60)
    assert cmd.state == "failed" and cmd.targets == {}
    assert "verified" in cmd.detail


def test_the_receive_loops_lag_is_exported(sim_agent):
    """A stalled loop silences every rank of the node at once: the agent says so itself
    (AgentTelemetryStalled inhibits the node's RankHung), so nobody restarts a job for
    the agent's deafness."""
    s = connect(sim_agent.socket_path)
    s.send(protocol.encode({"type": "heartbeat", "run": "r", "rank": 0}))
    s.recv(8192)
    want = ('clusterpulse_agent_telemetry_connections{node="node-a",'
            f'sender="uid:{os.getuid()}"}} 1.0')
    text = ""

    def scraped() -> bool:  # /metrics may answer from a cache of the last second
        nonlocal text
        text = sim_agent.get("/metrics", token=None).text
        return want in text.splitlines()

    wait_for(scraped, "the connection in /metrics", timeout=10)
    (line,) = [ln for ln in text.splitlines()
               if ln.startswith("clusterpulse_agent_telemetry_receive_lag_seconds{")]
    assert float(line.rsplit(" ", 1)[1]) < 3.0
    s.close()


class _Pauses(threading.Event):
    """A stop event that records each pause the receive loop takes on it."""

    def __init__(self) -> None:
        super().__init__()
        self.pauses: list[float] = []

    def wait(self, timeout: float | None = None) -> bool:
        if timeout is not None:
            self.pauses.append(timeout)
        return super().wait(timeout)


def test_a_flooded_receive_loop_leaves_the_interpreter_to_the_agents_other_threads(
        tmp_path):
    """Benchmark finding (tests/bench/bench_node.py: a hung job, a flood and 200 veths
    on the loaded 2-core machine, 1 s scrapes): the loop never blocked while a user
    flooded, so it took a whole core of the agent and held the GIL but for its system
    calls, and the scrape's thread waited for it at each of its own: /metrics took up
    to 3 s and 5 of 40 scrapes failed. After a round that leaves a user's messages
    waiting the loop now pauses, the GIL free, for as long as the round held it; a
    round that empties every queue is followed by none (a quiet node loses no time)."""
    from clusterpulse.agent.receiver import PER_OWNER_BUDGET

    agent = Agent(SimBackend(gpus=2, node="f"), "f", RankRegistry(),
                  AuditLog(tmp_path / "a.jsonl"), telemetry_addr=socket_path("flood"))
    receiver = agent.receiver
    assert receiver is not None
    flood = connect(agent.telemetry_address.removeprefix("unix:"))
    flood.setblocking(False)
    queued = 0
    with contextlib.suppress(BlockingIOError):  # as many as its queue holds
        while queued < 8 * PER_OWNER_BUDGET:
            flood.send(b"junk" * 20)
            queued += 1
    assert queued > 4 * PER_OWNER_BUDGET, queued
    stop = _Pauses()
    loop = threading.Thread(target=receiver.run, args=(stop,))
    loop.start()
    try:
        wait_for(lambda: agent.telemetry_counts["malformed_not_json"] == queued,
                 lambda: f"the {queued} queued, {agent.telemetry_counts} read")
        time.sleep(0.5)  # the queue is empty: from now on the loop waits in select only
        drained = list(stop.pauses)
        time.sleep(0.5)
        assert len(drained) >= 5, drained  # one after each round that left a backlog
        assert stop.pauses == drained  # and none while nothing waits
        assert all(0 < p <= 0.05 for p in stop.pauses), stop.pauses  # as long as a round
    finally:
        stop.set()
        loop.join()
        flood.close()
        agent.stop()


@pytest.mark.skipif(not ROOT, reason="placing a process on a chosen pid (ns_last_pid) "
                                     "and sending as another uid need root")
def test_before_linux_6_5_a_pid_reused_by_another_user_is_never_taken_for_the_rank(
        tmp_path, monkeypatch):
    """Review finding: without SO_PEERPIDFD the agent opens a pidfd by the pid the
    kernel recorded at connect, and checked only that the peer end was still open. A
    user's child connected and exited, the parent kept the inherited socket, a root
    process took the child's pid: the agent took root's process for the user's rank,
    and a hard restart killed it. The process on the pid must run as the uid that
    connected."""
    from clusterpulse.agent import channel

    monkeypatch.setattr(channel, "SO_PEERPIDFD", 9999)  # ENOPROTOOPT: a kernel < 6.5
    ranks, path = RankRegistry(), socket_path("old")
    agent = Agent(SimBackend(gpus=2, node="o"), "o", ranks, AuditLog(tmp_path / "a.jsonl"),
                  telemetry_addr=path)
    assert agent.receiver is not None
    sleeper = None
    parent = subprocess.Popen([SYSTEM_PYTHON, "-c", (
        "import json, os, socket, sys, time\n"
        "s = socket.socket(socket.AF_UNIX, socket.SOCK_SEQPACKET)\n"
        "child = os.fork()\n"
        "if child == 0:\n"
        "    s.connect(sys.argv[1])\n"
        "    s.send(json.dumps({'v': 1, 'type': 'step', 'run': 'victim', 'rank': 0,"
        " 'step': 1}).encode())\n"
        "    os._exit(0)\n"
        "os.waitpid(child, 0)\n"
        "print(child, flush=True)\n"
        "time.sleep(60)\n"), path], stdout=subprocess.PIPE, text=True, user=65534)
    try:
        assert parent.stdout is not None
        child = int(parent.stdout.readline())
        sleeper = _on_pid(child, ["sleep", "60"])
        for _ in range(5):
            agent.receiver.round(timeout=0.2)
        (r,) = ranks.of_run("victim")
        assert not r.sender.verified, r.sender
        cmd = agent.commands.submit("victim", "restart", "hung", "token", 60)
        assert cmd.killed_pids == [] and sleeper.poll() is None
    finally:
        for p in (sleeper, parent):
            if p is not None:
                p.kill()
                p.wait()
        agent.stop()


@pytest.mark.skipif(not ROOT, reason="sending as many uids needs root")
def test_a_user_with_many_subordinate_uids_is_one_user(sim_agent, tmp_path):
    """Review finding: rootless containers give a user 65,536 subordinate uids, and
    the kernel names each as its own user: 14 of them reached the total connection cap
    and a new healthy rank could not connect; 1,000 made a round last 4.5 s. Senders
    whose uid falls in a user's /etc/subuid range count as that user."""
    from clusterpulse.agent.identity import SubordinateIds

    subuid = tmp_path / "subuid"
    subuid.write_text("nobody:200000:65536\n")
    assert sim_agent.agent.receiver is not None
    sim_agent.agent.receiver._subids = SubordinateIds(str(subuid))
    # Each child connects, then waits for the others, then keeps its queues full,
    # asleep while they are: 40 children that sent in a busy loop, each for 6 s from
    # its own start, starved a 2-core machine, the first had left (their connections
    # closed) before the last had forked, and the 80 were never open at once (a
    # time-out at 57 of 80); the agent lost nothing.
    go_r, go_w = os.pipe()
    parent = os.getpid()
    children = []
    for i in range(40):  # 40 uids of one user, 2 connections each, flooding
        pid = os.fork()
        if pid == 0:  # pragma: no cover - the child
            try:
                os.close(go_w)
                os.setresgid(200000 + i, 200000 + i, 200000 + i)
                os.setresuid(200000 + i, 200000 + i, 200000 + i)
                conns = [connect(sim_agent.socket_path) for _ in range(2)]
                for s in conns:
                    s.setblocking(False)
                os.read(go_r, 1)  # until the test says go (or is gone: EOF)
                while os.getppid() == parent:  # until killed (or orphaned)
                    for s in conns:  # its queues kept full: the agent reads a flood
                        with contextlib.suppress(BlockingIOError):  # other errors: gone
                            while s.send(b"junk" * 20):
                                pass
                        with contextlib.suppress(BlockingIOError):
                            while s.recv(8192):
                                pass
                    select.select([], conns, [], 1.0)  # asleep until there is room
            finally:
                os._exit(0)
        children.append(pid)
    os.close(go_r)
    try:
        want = {"uid:65534": 80}
        receiver = sim_agent.agent.receiver
        wait_for(lambda: receiver.connections() == want,
                 lambda: f"{want}, the agent counts {receiver.connections()}")
        os.close(go_w)  # the flood starts, and lasts until the children are killed
        go_w = -1
        wait_for(lambda: sim_agent.agent.telemetry_counts["malformed_not_json"] > 1000,
                 "the flood to be read")
        assert receiver.connections() == want  # a flooding user's 80, as one user
        victim_loses_nothing(sim_agent, "victim", 200, every_s=0.01)
        assert receiver.connections()["uid:65534"] == 80  # the flood went on all along
    finally:
        if go_w >= 0:
            os.close(go_w)
        for pid in children:
            with contextlib.suppress(ProcessLookupError):
                os.kill(pid, 9)
            os.waitpid(pid, 0)


def test_a_rank_that_fell_back_to_datagrams_reconnects_to_an_upgraded_agent(tmp_path):
    """Review finding: a rank that met an agent of an older release (a datagram socket)
    stayed on datagrams for good; once the agent was upgraded every send failed, and
    the job went silent until it restarted."""
    path = socket_path("up")
    old = socket.socket(socket.AF_UNIX, socket.SOCK_DGRAM)
    old.bind(path)
    link = AgentLink(path, local_rank=0)
    link.send({"type": "heartbeat", "run": "r1", "rank": 0})
    assert link._sock is not None and link._sock.type == socket.SOCK_DGRAM
    assert b"r1" in old.recv(8192)
    old.close()
    os.unlink(path)  # the agent is upgraded: a connection socket at the same path
    agent = Agent(SimBackend(gpus=2, node="u"), "u", RankRegistry(),
                  AuditLog(tmp_path / "a.jsonl"), telemetry_addr=path)
    agent.start()
    try:
        for step in range(1, 6):
            link.send({"type": "step", "run": "r1", "rank": 0, "step": step})
        wait_for(lambda: steps_of(agent, "r1") >= 2, "the rank's steps at the new agent")
        assert link._sock is not None and link._sock.type == socket.SOCK_SEQPACKET
    finally:
        link.close()
        agent.stop()


def test_what_a_rank_sent_before_leaving_is_read_though_it_left_replies_unread(
        tmp_path, monkeypatch):
    """Finding (the HF and Lightning tests on a loaded node): a graceful restart
    completed with `acknowledged: [1]`, rank 0's acknowledgement lost, and no rank's
    `exit` event ever arrived. A rank reads the agent's replies only at its consensus
    boundary, so it leaves with some unread; the kernel then reports ECONNRESET on the
    agent's end of the connection, once, ahead of the messages still queued there, and
    the agent closed the connection on it: a busy agent that had not yet read the
    acknowledgement the rank sent just before leaving (the last rank to reach the
    barrier sends it milliseconds before it goes) lost it, and the exit event with it."""
    from clusterpulse.trainer.instrument import Pulse
    from clusterpulse.trainer.restart import RELAUNCH_FILE_ENV, RESTART_EXIT_CODE

    monkeypatch.delenv(RELAUNCH_FILE_ENV, raising=False)  # a plain torchrun's exit code
    ranks, path = RankRegistry(), socket_path("ack")
    agent = Agent(SimBackend(gpus=2, node="k"), "k", ranks, AuditLog(tmp_path / "a.jsonl"),
                  telemetry_addr=path)
    assert agent.receiver is not None
    pulse = Pulse(run="job", agent=f"unix:{path}", rank=0, local_rank=0, world_size=1,
                  restarts=0, consensus_every=1, catch_sigterm=False)
    try:  # the agent is not started: each round below is one it gets to run
        with pulse.step(1):
            pass
        for _ in range(3):  # accepted, read and answered: the replies wait unread
            agent.receiver.round(timeout=0.2)
        cmd = agent.commands.submit("job", "checkpoint-restart", "test", "op", deadline_s=60)
        with pulse.step(2):
            pass
        agent.receiver.round(timeout=0.2)  # the reply to step 2 carries the command

        def save(step: int) -> None:  # meanwhile the agent reads the rank's heartbeat of
            agent.receiver.round(timeout=0.2)  # phase checkpoint: a reply it never reads

        # the rank agrees, saves, acknowledges and leaves before the busy agent reads on
        with pytest.raises(SystemExit) as leaving:
            pulse.boundary(2, save=save)
        assert leaving.value.code == RESTART_EXIT_CODE
        for _ in range(3):
            agent.receiver.round(timeout=0.2)
        agent.commands.tick()
        assert cmd.to_json()["acknowledged"] == [0], cmd.to_json()
        (r,) = ranks.of_run("job")
        assert r.phase == protocol.RESTARTING, r.phase  # its exit event was read too
    finally:
        pulse.close()
        agent.stop()


def test_a_rank_that_closes_with_replies_unread_still_delivers_its_last_messages(tmp_path):
    """Review finding: a clean finish lost the rank's exit event in 4 of 6 runs, and
    JobStalled paged the finished run. A rank that closes its connection with the
    agent's replies unread makes Linux report ECONNRESET on the agent's end before the
    records the rank queued before closing; the agent took the error for the end of
    the connection and dropped them, the exit event among them."""
    ranks, path = RankRegistry(), socket_path("rst")
    agent = Agent(SimBackend(gpus=2, node="r"), "r", ranks, AuditLog(tmp_path / "a.jsonl"),
                  telemetry_addr=path)
    receiver = agent.receiver
    assert receiver is not None
    base = {"run": "done", "rank": 0, "local_rank": 0, "gpu": 0}

    def serve_until(cond, what: str) -> None:
        def served() -> bool:
            receiver.round(timeout=0.05)
            return cond()

        wait_for(served, what)

    try:  # the agent is not started: the test drives its receive loop
        rank = connect(path)
        rank.send(protocol.encode({**base, "type": "step", "step": 1, "step_seconds": 0.1}))
        serve_until(lambda: agent.telemetry_counts["accepted"] == 1, "the first step")
        assert rank.recv(8192, socket.MSG_PEEK)  # the agent's reply waits in the rank's queue
        rank.send(protocol.encode({**base, "type": "step", "step": 2, "step_seconds": 0.1}))
        rank.send(protocol.encode({**base, "type": "event", "event": "exit",
                                   "outcome": "finished"}))
        rank.close()  # with the reply unread
        serve_until(lambda: not receiver.connections(), "the agent to see the rank's end")
        (r,) = ranks.of_run("done")
        assert (r.steps_total, r.phase) == (2, protocol.EXITED)
    finally:
        agent.stop()
