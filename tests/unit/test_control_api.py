"""Control API: authentication, fault injection, command delivery and audit."""

import json
import socket
import subprocess
import sys
import time
from dataclasses import replace

import pytest

from clusterpulse.agent import protocol
from clusterpulse.agent.identity import Sender
from tests.conftest import TOKEN, start_agent
from tests.support.procs import wait_until
from tests.support.ranksock import RankProcess, connect, exchange


def test_no_token_configured_means_api_off(tmp_path):
    running, server = start_agent(tmp_path, token=None)
    try:
        r = running.get("/v1/ranks", token="anything")
        assert r.status_code == 403 and "disabled" in r.json()["error"]
    finally:
        server.shutdown()
        running.agent.stop()


def test_missing_and_wrong_tokens_are_refused(sim_agent):
    r = sim_agent.get("/v1/ranks", token=None)
    assert r.status_code == 401 and "missing bearer token" in r.json()["error"]
    assert r.headers["WWW-Authenticate"].startswith("Bearer")
    r = sim_agent.post("/v1/faults", {"kind": "gpu_lost", "gpu": 0}, token="wrong-token")
    assert r.status_code == 401 and r.json()["error"] == "wrong token"
    assert sim_agent.get("/v1/ranks").status_code == 200
    # /metrics and /healthz stay open for Prometheus and probes.
    assert sim_agent.get("/metrics", token=None).status_code == 200
    assert sim_agent.get("/healthz", token=None).json()["control_api"] is True


@pytest.mark.parametrize("scheme", ["Bearer", "bearer", "BEARER"])
def test_the_bearer_scheme_is_case_insensitive(scheme):
    """RFC 7235: `Authorization: bearer <token>` (some clients send it so) was refused
    as a missing token."""
    from clusterpulse.agent.control import check_bearer
    from clusterpulse.agent.tokens import Tokens

    tokens = Tokens.single(TOKEN, "ops")
    assert check_bearer(f"{scheme} {TOKEN}", tokens) == ("ops", None)
    assert check_bearer(f"{scheme}x {TOKEN}", tokens)[1][0] == 401


def test_a_hash_inside_a_token_is_part_of_it():
    """A comment starts a line or follows a space: a token holding `#` was cut there
    without a word, and then its holder was refused (or a shorter secret accepted)."""
    from clusterpulse.agent.tokens import Tokens

    tokens = Tokens.parse("# the clients\n"
                          "ops  0123456789abcdef#XYZ  # the operators' token\n"
                          "bot\t0123456789abcdef#bot\t# the bot's\n")
    assert tokens.by_principal == {"ops": "0123456789abcdef#XYZ",
                                   "bot": "0123456789abcdef#bot"}


def test_fault_injection_through_the_api(sim_agent):
    r = sim_agent.post("/v1/faults", {"kind": "gpu_lost", "gpu": 2, "requested_by": "alice"})
    assert r.status_code == 200
    sim_agent.agent.collect_once()
    text = sim_agent.get("/metrics", token=None).text
    assert 'clusterpulse_gpu_up{gpu="2",node="node-a"' in text
    up2 = [line for line in text.splitlines() if line.startswith('clusterpulse_gpu_up{gpu="2"')]
    assert up2[0].endswith(" 0.0")
    r = sim_agent.post("/v1/faults", {"kind": "overheat", "gpu": 99})
    assert r.status_code == 400 and "'gpu' must be an integer in 0..3" in r.json()["error"]
    r = sim_agent.post("/v1/faults", {"kind": "melt", "gpu": 0})
    assert r.status_code == 400 and "unknown fault kind" in r.json()["error"]
    records = _audit(sim_agent)
    assert records[-1]["who"] == "token" and records[-1]["on_behalf_of"] == "alice"
    assert records[-1]["action"] == "fault:gpu_lost"


def test_bad_bodies_are_named(sim_agent):
    import requests

    r = requests.post(sim_agent.url + "/v1/faults", data=b"{nope",
                      headers={"Authorization": f"Bearer {TOKEN}"}, timeout=5)
    assert r.status_code == 400 and "not valid JSON" in r.json()["error"]
    r = sim_agent.post("/v1/runs/r1/actions", {"action": "explode", "reason": "x"})
    assert r.status_code == 400 and "'action'" in r.json()["error"]
    r = sim_agent.post("/v1/runs/r1/actions", {"action": "restart"})
    assert r.status_code == 400 and "'reason' is required" in r.json()["error"]
    r = sim_agent.post("/v1/runs/nobody/actions", {"action": "restart", "reason": "test"})
    assert r.status_code == 409 and "no ranks" in r.json()["detail"]


def _rank(sock, **kw):
    return exchange(sock, type="step", run="r1", rank=0, local_rank=0, gpu=0, **kw)


def _audit(running) -> list[dict]:
    return [json.loads(x) for x in running.audit_path.read_text().splitlines()]


def test_graceful_command_is_delivered_acknowledged_and_completes(sim_agent):
    s = connect(sim_agent.socket_path)
    assert "commands" not in _rank(s, step=1, restarts=0)
    r = sim_agent.post("/v1/runs/r1/actions", {"action": "checkpoint-restart",
                                                "reason": "straggler", "requested_by": "bob"})
    assert r.status_code == 202
    cid = r.json()["id"]
    reply = _rank(s, step=2, restarts=0)
    assert reply["commands"] == [{"id": cid, "action": "checkpoint-restart"}]
    _rank(s, step=3, restarts=0, acks=[cid])
    sim_agent.agent.collect_once()
    assert sim_agent.get(f"/v1/commands/{cid}").json()["state"] == "delivered"
    # The same process claiming a restart is not a restart (finding: a forged
    # `restarts=1` made the audit log say "completed, all ranks resumed").
    _rank(s, step=3, restarts=1)
    sim_agent.agent.collect_once()
    assert sim_agent.get(f"/v1/commands/{cid}").json()["state"] == "delivered"
    s.close()
    # torchrun restarted the worker: a new process, a higher restart count, progress.
    with RankProcess(sim_agent.socket_path, [{"type": "step", "run": "r1", "rank": 0,
                                              "step": 3, "restarts": 1}]):
        pass  # the old owner (this process) is alive, so the new one is refused ...
    sim_agent.agent.ranks.of_run("r1")[0].sender = Sender()  # ... unless it has exited
    # Joined its process group and loading the checkpoint (heartbeats carry the old
    # step): not resumed yet (CI finding: the page said "All ranks resumed" before the
    # run had recorded its restart).
    with RankProcess(sim_agent.socket_path, [{"type": "heartbeat", "run": "r1", "rank": 0,
                                              "step": 3, "restarts": 1, "phase": "start"}]):
        sim_agent.agent.collect_once()
        assert sim_agent.get(f"/v1/commands/{cid}").json()["state"] == "delivered"
    sim_agent.agent.ranks.of_run("r1")[0].sender = Sender()
    with RankProcess(sim_agent.socket_path, [{"type": "step", "run": "r1", "rank": 0,
                                              "step": 4, "restarts": 1}]):
        sim_agent.agent.collect_once()
    status = sim_agent.get(f"/v1/commands/{cid}").json()
    assert status["state"] == "completed" and status["resumed"] == [0]
    records = _audit(sim_agent)
    assert [x["outcome"] for x in records] == ["pending", "completed"]
    # who = the authenticated principal; the caller's own name is only recorded
    assert {x["who"] for x in records} == {"token"}
    assert {x["on_behalf_of"] for x in records} == {"bob"}


def test_a_lost_acknowledgement_does_not_restart_the_resumed_rank_again(sim_agent):
    """CI finding: under load a rank's acknowledgement datagram was dropped; after its
    graceful restart the agent told the new process again, and the job restarted twice."""
    s = connect(sim_agent.socket_path)
    _rank(s, step=1, restarts=0)
    cid = sim_agent.post("/v1/runs/r1/actions", {"action": "checkpoint-restart",
                                                 "reason": "straggler"}).json()["id"]
    assert _rank(s, step=2, restarts=0)["commands"] == [{"id": cid,
                                                         "action": "checkpoint-restart"}]
    owner = sim_agent.agent.ranks.of_run("r1")[0].sender
    # The rank saved and left without its acknowledgement arriving; torchrun restarted it.
    sim_agent.agent.ranks.of_run("r1")[0].sender = Sender()  # the old process exited
    assert "commands" not in _rank(s, step=2, restarts=1)
    sim_agent.agent.collect_once()
    status = sim_agent.get(f"/v1/commands/{cid}").json()
    assert status["acknowledged"] == [] and status["state"] == "pending"
    # Another verified process holding the rank is not the command's process either,
    # whatever restart count it claims; the owner itself still is.
    book = sim_agent.agent.commands
    other = replace(owner, pid=owner.pid + 1)
    assert book.pending_for("r1", 0, 0, other) == []
    assert book.pending_for("r1", 0, 0, owner) == [{"id": cid, "action": "checkpoint-restart"}]
    s.close()


def test_a_rank_leaving_for_a_peers_command_has_carried_it_out(sim_agent):
    """CI finding: ranks agree on a restart among themselves, so a rank can leave for a
    command only its peer heard; it never acknowledged it and the command showed it
    as not acknowledged forever."""
    s = connect(sim_agent.socket_path)
    _rank(s, step=1, restarts=0)
    cid = sim_agent.post("/v1/runs/r1/actions", {"action": "checkpoint-restart",
                                                 "reason": "straggler"}).json()["id"]
    exchange(s, type="event", event="exit", run="r1", rank=0, outcome="failed")
    sim_agent.agent.collect_once()
    assert sim_agent.get(f"/v1/commands/{cid}").json()["acknowledged"] == []  # a crash is not
    exchange(s, type="event", event="exit", run="r1", rank=0, outcome="checkpoint-restart")
    sim_agent.agent.collect_once()
    status = sim_agent.get(f"/v1/commands/{cid}").json()
    assert status["acknowledged"] == [0] and status["state"] == "delivered"
    s.close()


def test_a_command_completes_when_the_node_gets_new_rank_numbers(sim_agent):
    """Finding (browser e2e under clusterpulse-train): a relaunch is a new rendezvous,
    which numbered the nodes afresh; ranks 0-1 of this node came back as ranks 2-3, the
    command waited for 0-1 here until its deadline and escalated to a hard restart."""
    s = connect(sim_agent.socket_path)
    for rank in (0, 1):
        exchange(s, type="step", run="r1", rank=rank, local_rank=rank, gpu=rank, step=5,
                 restarts=0)
    cid = sim_agent.post("/v1/runs/r1/actions", {"action": "checkpoint-restart",
                                                 "reason": "straggler"}).json()["id"]

    def new_rank(rank: int) -> RankProcess:
        return RankProcess(sim_agent.socket_path, [{"type": "step", "run": "r1", "rank": rank,
                                                    "local_rank": rank - 2, "step": 5,
                                                    "restarts": 1}])

    with new_rank(2):
        sim_agent.agent.collect_once()
        assert sim_agent.get(f"/v1/commands/{cid}").json()["state"] == "pending"  # one of two
        with new_rank(3):
            sim_agent.agent.collect_once()
    status = sim_agent.get(f"/v1/commands/{cid}").json()
    assert status["state"] == "completed" and status["resumed"] == [2, 3]
    s.close()


def test_departed_ranks_are_not_targets_of_a_new_command(sim_agent):
    """After such a relaunch this node still lists ranks 0-1 (their processes exited,
    kept for their evidence); a command that targeted them waited for four ranks where
    two run, and escalated to a hard restart at its deadline."""
    with RankProcess(sim_agent.socket_path, [
            {"type": "step", "run": "r1", "rank": r, "local_rank": r, "step": 5}
            for r in (0, 1)]):
        pass  # ranks 0-1 left (their process exited)
    with RankProcess(sim_agent.socket_path, [
            {"type": "step", "run": "r1", "rank": r, "local_rank": r - 2, "step": 5,
             "restarts": 1} for r in (2, 3)]):
        assert {r.rank for r in sim_agent.agent.ranks.of_run("r1")} == {0, 1, 2, 3}
        r = sim_agent.post("/v1/runs/r1/actions", {"action": "checkpoint-restart",
                                                   "reason": "straggler"})
        assert r.json()["ranks"] == [2, 3]


def _sleeper() -> subprocess.Popen:
    return subprocess.Popen([sys.executable, "-c", "import time; time.sleep(60)"])


def test_hard_restart_terminates_the_verified_rank_not_the_claimed_pid(sim_agent):
    """Finding: a hard restart SIGTERMed whatever pid telemetry last claimed."""
    victim = _sleeper()
    try:
        with RankProcess(sim_agent.socket_path, [{"type": "step", "run": "r1", "rank": 0,
                                                  "step": 5, "pid": victim.pid}]) as rank:
            r = sim_agent.post("/v1/runs/r1/actions", {"action": "restart", "reason": "hung"})
            assert r.status_code == 202 and r.json()["state"] == "delivered"
            assert r.json()["signalled_pids"] == [rank.pid]
            assert rank.p.wait(timeout=10) == -15  # SIGTERM
        assert victim.poll() is None  # the unrelated process lives on
        record = _audit(sim_agent)[-1]
        assert record["signalled_pids"] == [rank.pid] and record["outcome"] == "delivered"
    finally:
        victim.kill()
        victim.wait()
    assert sim_agent.get("/v1/commands").json()["commands"][0]["action"] == "restart"


def test_a_reused_or_exited_pid_is_never_signalled(sim_agent):
    """The registered process is gone and its pid may be reused: no signal."""
    with RankProcess(sim_agent.socket_path, [{"type": "step", "run": "r1", "rank": 0}]) as rank:
        pass
    r = sim_agent.agent.ranks.of_run("r1")[0]
    victim = _sleeper()  # pretend the pid was reused by an unrelated process
    try:
        r.sender = replace(r.sender, pid=victim.pid)
        # Alone, the departed rank is no target: there is nothing to restart here.
        out = sim_agent.post("/v1/runs/r1/actions", {"action": "restart", "reason": "x"})
        assert out.status_code == 409 and victim.poll() is None
        # With a live peer the run is restarted, and still the reused pid is not signalled.
        with RankProcess(sim_agent.socket_path, [{"type": "step", "run": "r1", "rank": 1}]) \
                as live:
            out = sim_agent.post("/v1/runs/r1/actions", {"action": "restart",
                                                          "reason": "x"}).json()
            assert out["signalled_pids"] == [live.p.pid]
        assert victim.poll() is None
        # Should the pid be reused between listing the ranks and signalling them, the
        # pidfd's start-time check refuses it.
        from clusterpulse.agent import identity

        with pytest.raises(identity.SignalRefused, match="start time changed"):
            identity.open_verified(r.sender)
        assert victim.poll() is None
    finally:
        victim.kill()
        victim.wait()
    assert rank.p.returncode == -9


def test_udp_ranks_are_never_signalled(tmp_path):
    from clusterpulse.agent.audit import AuditLog
    from clusterpulse.agent.backends.sim import SimBackend
    from clusterpulse.agent.core import Agent
    from clusterpulse.agent.ranks import RankRegistry

    ranks = RankRegistry()
    agent = Agent(SimBackend(gpus=2, node="u"), "u", ranks, AuditLog(tmp_path / "a.jsonl"),
                  telemetry_addr=("127.0.0.1", 0))
    agent.start()
    victim = _sleeper()
    try:
        s = socket.socket(socket.AF_INET, socket.SOCK_DGRAM)
        s.settimeout(5)
        s.sendto(protocol.encode({"type": "step", "run": "r1", "rank": 0, "pid": victim.pid}),
                 ("127.0.0.1", agent.telemetry_port))
        s.recv(4096)
        cmd = agent.commands.submit("r1", "restart", "x", "token", 60)
        assert cmd.killed_pids == [] and cmd.state == "failed"
        assert "comes from a process the kernel verified (over UDP" in cmd.detail
        assert victim.poll() is None
    finally:
        victim.kill()
        victim.wait()
        agent.stop()


def test_escalation_spares_the_new_processes_still_loading(sim_agent):
    """Review finding: once "resumed" waited for a step, an escalation at the deadline
    SIGTERMed every live rank of the run, the restarted processes still loading their
    checkpoint included. It may signal only the processes the command was made for."""
    s = connect(sim_agent.socket_path)
    _rank(s, step=5, restarts=0)
    cid = sim_agent.post("/v1/runs/r1/actions", {"action": "checkpoint-restart",
                                                 "reason": "slow", "deadline_s": 1}).json()["id"]
    s.close()
    sim_agent.agent.ranks.of_run("r1")[0].sender = Sender()  # the old process left
    with RankProcess(sim_agent.socket_path, [{"type": "heartbeat", "run": "r1", "rank": 0,
                                              "step": 5, "restarts": 1,
                                              "phase": "start"}]) as new:
        time.sleep(1.3)
        sim_agent.agent.collect_once()
        assert sim_agent.get(f"/v1/commands/{cid}").json()["state"] == "escalated"
        time.sleep(0.5)
        assert new.p.poll() is None, "the new process was signalled"
    assert not _audit(sim_agent)[-1].get("signalled_pids")


def test_graceful_command_escalates_to_hard_after_deadline(sim_agent):
    with RankProcess(sim_agent.socket_path, [{"type": "step", "run": "r1", "rank": 0,
                                              "step": 5}]) as rank:
        r = sim_agent.post("/v1/runs/r1/actions", {"action": "checkpoint-restart",
                                                    "reason": "hung", "deadline_s": 1})
        cid = r.json()["id"]
        time.sleep(1.3)
        sim_agent.agent.collect_once()
        assert sim_agent.get(f"/v1/commands/{cid}").json()["state"] == "escalated"
        assert rank.p.wait(timeout=10) == -15
    escalated = _audit(sim_agent)[-1]
    assert escalated["outcome"] == "escalated" and escalated["signalled_pids"] == [rank.pid]


def test_deadlines_follow_the_monotonic_clock_not_wall_clock_steps():
    """Review finding: a wall-clock step (NTP makestep, VM resume) 130 s forward
    escalated a `deadline_s: 120` checkpoint-restart at once, and a backward step
    would delay a hung job's escalation by its size. Deadlines and the SIGKILL
    follow-up run on the monotonic clock; `created_unix` still reports wall time."""
    from clusterpulse.agent.audit import AuditLog
    from clusterpulse.agent.commands import CommandBook
    from clusterpulse.agent.identity import Sender
    from clusterpulse.agent.ranks import RankRegistry

    mono, wall = [1000.0], [1_700_000_000.0]
    ranks = RankRegistry(clock=lambda: mono[0], alive=lambda s: True)
    ranks.update({"v": 1, "type": "step", "run": "r1", "rank": 0, "local_rank": 0,
                  "gpu": 0, "step": 5}, None,
                 Sender(pid=1, uid=0, start_time=1, verified=True))
    book = CommandBook(ranks, AuditLog(None), "n", clock=lambda: mono[0],
                       wall_clock=lambda: wall[0])
    cmd = book.submit("r1", "checkpoint-restart", "hung", "op", deadline_s=120)
    assert cmd.to_json()["created_unix"] == 1_700_000_000.0
    wall[0] += 130  # the wall clock steps past the deadline; 10 s really pass
    mono[0] += 10
    book.tick()
    assert cmd.state == "pending"
    wall[0] -= 3600  # then an hour back: the deadline still comes 120 s after submit
    mono[0] += 110
    book.tick()
    assert cmd.state == "escalated"
    assert cmd.to_json()["created_unix"] == 1_700_000_000.0


def test_a_leave_rides_on_the_graceful_command_and_its_deadline_restarts_once_left(sim_agent):
    """evict-node: the node's agent tells its ranks how long to sit the restart out. The
    ranks must leave within deadline_s (else it escalates: a hung rank never leaves);
    once they have, the command has leave_s more to see them back."""
    s = connect(sim_agent.socket_path)
    _rank(s, step=1, restarts=0)
    r = sim_agent.post("/v1/runs/r1/actions", {"action": "checkpoint-restart", "reason": "link",
                                                "deadline_s": 1, "leave_s": 2.5})
    assert r.status_code == 202 and r.json()["leave_s"] == 2.5
    cid = r.json()["id"]
    assert _rank(s, step=2, restarts=0)["commands"] == [
        {"id": cid, "action": "checkpoint-restart", "leave_s": 2.5}]
    cmd = sim_agent.agent.commands.get(cid)
    assert cmd.deadline == cmd.created + 1  # to leave
    _rank(s, step=2, restarts=0, acks=[cid])  # left
    sim_agent.agent.collect_once()
    assert sim_agent.get(f"/v1/commands/{cid}").json()["state"] == "delivered"
    assert cmd.deadline >= cmd.created + 1 + 2.5  # to be back: the sit-out and deadline_s
    # a rank that does not leave within deadline_s (hung) is escalated then
    with RankProcess(sim_agent.socket_path, [{"type": "step", "run": "r2", "rank": 0,
                                              "step": 5}]) as rank:
        r = sim_agent.post("/v1/runs/r2/actions", {"action": "checkpoint-restart",
                                                    "reason": "link", "deadline_s": 1,
                                                    "leave_s": 600})
        time.sleep(1.3)
        sim_agent.agent.collect_once()
        assert sim_agent.get(f"/v1/commands/{r.json()['id']}").json()["state"] == "escalated"
        assert rank.p.wait(timeout=10) == -15
    s.close()
    assert _audit(sim_agent)[0]["leave_s"] == 2.5
    for body, says in [({"action": "restart", "leave_s": 5}, "only with checkpoint-restart"),
                       ({"action": "checkpoint-restart", "leave_s": -1}, "'leave_s'"),
                       ({"action": "checkpoint-restart", "leave_s": protocol.MAX_LEAVE_S + 1},
                        f"0..{protocol.MAX_LEAVE_S}")]:
        r = sim_agent.post("/v1/runs/r1/actions", {**body, "reason": "x"})
        assert r.status_code == 400 and says in r.json()["error"], r.text


def test_a_leave_whose_ranks_stay_out_fails_at_its_deadline_without_escalating():
    """A node evicted from a job with a hot spare is replaced by it and, after its
    sit-out, stands by itself: its ranks never come back. That used to escalate at the
    deadline (a hard restart of nothing, audited as one) and fail a deadline later. It
    fails at the deadline now, saying what may have happened (nothing here tells a
    spare in its place from a launcher that never rejoined). A rank process still there
    at the deadline (it said it was leaving, then hung on its way out) is escalated."""
    from clusterpulse.agent.audit import AuditLog
    from clusterpulse.agent.commands import CommandBook
    from clusterpulse.agent.identity import Sender
    from clusterpulse.agent.protocol import RESTARTING
    from clusterpulse.agent.ranks import RankRegistry

    mono, living = [1000.0], {1, 2}
    ranks = RankRegistry(clock=lambda: mono[0], alive=lambda s: s.pid in living)
    book = CommandBook(ranks, AuditLog(None), "n", clock=lambda: mono[0])
    commands = {}
    for pid, run in [(1, "r1"), (2, "r2")]:
        rank = {"v": 1, "run": run, "rank": 0, "local_rank": 0, "pid": pid, "gpu": 0}
        sender = Sender(pid=pid, uid=0, start_time=pid, verified=True)
        ranks.update({**rank, "type": "step", "step": 5}, None, sender)
        cmd = book.submit(run, "checkpoint-restart", "link", "op", deadline_s=10, leave_s=30)
        ranks.update({**rank, "type": "step", "step": 6, "acks": [cmd.id]}, None, sender)
        ranks.update({**rank, "type": "event", "event": "exit",
                      "outcome": "checkpoint-restart"}, None, sender)
        commands[run] = cmd
    book.tick()
    assert [c.state for c in commands.values()] == ["delivered", "delivered"]
    assert ranks.of_run("r2")[0].phase == RESTARTING
    living.discard(1)  # r1's rank exited; r2's said so but its process is still there
    mono[0] += 39  # the sit-out and the deadline again, less a second: still waiting
    book.tick()
    assert [c.state for c in commands.values()] == ["delivered", "delivered"]
    mono[0] += 2
    book.tick()
    assert commands["r1"].state == "failed", commands["r1"].detail
    assert "went on without it (a hot spare in its place" in commands["r1"].detail
    assert commands["r2"].state == "escalated"


def test_a_leave_whose_node_gave_way_fails_and_says_why(sim_agent):
    """Of two nodes evicted at once only one may go; the other's ranks restart with
    the job. Its command fails: with the reason when the ranks say so, and also when
    that word is lost (or the ranks never heard the command before the agreement): a
    leave whose ranks come back without having acknowledged it did not sit out. It
    used to say "completed, all ranks resumed"."""
    s = connect(sim_agent.socket_path)
    _rank(s, step=1, restarts=0)

    def evict() -> str:
        r = sim_agent.post("/v1/runs/r1/actions", {"action": "checkpoint-restart",
                                                    "reason": "link", "leave_s": 60})
        assert r.status_code == 202, r.text
        return r.json()["id"]

    # one node's agent stands for each: one command of the run at a time on a node
    said = evict()
    exchange(s, type="event", event="leave_refused", run="r1", rank=0, local_rank=0,
             command=said, reason="others_leaving")
    sim_agent.agent.collect_once()
    status = sim_agent.get(f"/v1/commands/{said}").json()
    assert status["state"] == "failed", status
    assert "other nodes leave the job at the same restart" in status["detail"]
    assert "it restarted with the job instead" in status["detail"]
    lost = evict()
    s.close()
    sim_agent.agent.ranks.of_run("r1")[0].sender = Sender()  # the old process exited
    with RankProcess(sim_agent.socket_path, [{"type": "step", "run": "r1", "rank": 0,
                                              "step": 2, "restarts": 1}]):
        sim_agent.agent.collect_once()
    status = sim_agent.get(f"/v1/commands/{lost}").json()
    assert status["state"] == "failed", status
    assert "without node node-a sitting out" in status["detail"]


def test_as_many_nodes_leave_as_the_job_can_lose(monkeypatch):
    from clusterpulse.trainer.restart import nodes_that_leave

    monkeypatch.setenv("GROUP_WORLD_SIZE", "4")
    wanted = {3: 30.0, 1: 60.0, 2: 30.0}
    assert nodes_that_leave(wanted, minimum=2) == {1: 60.0, 2: 30.0}  # the lowest ranks
    assert nodes_that_leave(wanted, minimum=3) == {1: 60.0}
    assert nodes_that_leave(wanted, minimum=4) == {}
    assert nodes_that_leave(wanted, minimum=None) == {}  # not known: nobody leaves
    assert nodes_that_leave({}, minimum=1) == {}


@pytest.mark.parametrize(("nodes", "leaves"), [(3, True), (2, False)])
def test_a_rank_leaves_for_a_leave_or_refuses_it_before_anything_restarts(
        sim_agent, tmp_path, monkeypatch, nodes, leaves):
    """The rank side for real (Pulse over the agent's Unix socket): in a job of `nodes`
    nodes whose minimum is 2, a leave is taken (checkpoint, relaunch file and leave
    file, exit 0 for the launcher) or refused: the command fails naming why, and the
    rank trains on without a restart."""
    from clusterpulse.trainer.instrument import Pulse

    relaunch = tmp_path / "relaunch"
    monkeypatch.setenv("CLUSTERPULSE_RELAUNCH_FILE", str(relaunch))
    monkeypatch.setenv("CLUSTERPULSE_MIN_NODES", "2")
    monkeypatch.setenv("GROUP_WORLD_SIZE", str(nodes))
    pulse = Pulse(run="r1", agent=f"unix:{sim_agent.socket_path}", rank=0, local_rank=0,
                  world_size=1, consensus_every=1, catch_sigterm=False)
    try:
        with pulse.step(1):
            pass
        wait_until(lambda: sim_agent.agent.ranks.of_run("r1"), 10, "the rank registered")
        r = sim_agent.post("/v1/runs/r1/actions", {"action": "checkpoint-restart",
                                                    "reason": "link", "leave_s": 30})
        cid = r.json()["id"]
        with pulse.step(2):
            pass
        time.sleep(0.3)  # the reply to step 2 carries the command
        saved = []
        if leaves:
            with pytest.raises(SystemExit) as exit_:
                pulse.boundary(2, save=saved.append)
            assert exit_.value.code == 0 and saved == [2]
            assert (tmp_path / "relaunch.leave").read_text() == "30\n"
            assert relaunch.read_text() == "checkpoint-restart 0\n"  # the attempt left
        else:
            pulse.boundary(2, save=saved.append)  # returns: no restart
            assert saved == [] and not relaunch.exists()
            status = wait_until(lambda: (c := sim_agent.get(f"/v1/commands/{cid}").json())
                                ["state"] == "failed" and c, 10, "the command to fail")
            assert "the job is at its minimum node count" in status["detail"], status
            assert "nothing was restarted" in status["detail"]
    finally:
        pulse.close()


def test_a_graceful_restart_of_a_run_that_finishes_first_is_not_escalated(sim_agent):
    """Closing-note finding: a checkpoint-restart posted a few steps before the job's
    end waited for its deadline and was then audited as "escalated" (a hard restart)
    although the ranks had finished cleanly and nothing was left to act on."""
    s = connect(sim_agent.socket_path)
    _rank(s, step=1, restarts=0)
    cid = sim_agent.post("/v1/runs/r1/actions", {"action": "checkpoint-restart",
                                                 "reason": "straggler"}).json()["id"]
    exchange(s, type="event", event="exit", run="r1", rank=0, outcome="finished")
    sim_agent.agent.collect_once()
    status = sim_agent.get(f"/v1/commands/{cid}").json()
    assert status["state"] == "failed", status
    assert "finished" in status["detail"], status
    audit = _audit(sim_agent)
    assert [a.get("outcome") for a in audit if a.get("command") == cid][-1] == "failed", audit
    assert not any(a.get("outcome") == "escalated" for a in audit), audit
    s.close()


def test_a_second_restart_while_one_is_in_flight_is_refused_and_names_it(sim_agent):
    """Review finding: two operator tabs each asked for a restart of one run, 6 s apart;
    both were accepted and the second killed the processes the first had just started,
    and the second tab never learnt a restart was under way. The agent refuses any
    restart of a run while one is in flight, with 409 naming it, whoever asks."""
    with RankProcess(sim_agent.socket_path, [{"type": "step", "run": "r1", "rank": 0,
                                              "step": 5}]) as rank:
        first = sim_agent.post("/v1/runs/r1/actions", {"action": "checkpoint-restart",
                                                        "reason": "slow",
                                                        "requested_by": "alice"})
        assert first.status_code == 202
        cid = first.json()["id"]
        for action in ("restart", "checkpoint-restart"):
            r = sim_agent.post("/v1/runs/r1/actions", {"action": action, "reason": "hung",
                                                        "requested_by": "bob"})
            assert r.status_code == 409, r.text
            error = r.json()["error"]
            assert "already in flight" in error and cid in error, error
            assert "checkpoint-restart, requested by token on behalf of alice" in error, error
            assert "state pending" in error and " UTC" in error, error
            assert r.json()["in_flight"]["id"] == cid
        assert rank.p.poll() is None, "the refused restart signalled the rank"
        assert [c["id"] for c in sim_agent.get("/v1/commands").json()["commands"]] == [cid]
        refused = _audit(sim_agent)[-1]
        assert refused["outcome"] == "refused" and refused["in_flight"] == cid
        assert refused["on_behalf_of"] == "bob" and refused["action"] == "checkpoint-restart"
        # Forcing a hard restart over the stuck graceful one names it (audited as who
        # asked); it is the same command, escalated, never a second one beside it.
        r = sim_agent.post(f"/v1/commands/{cid}/escalate", {"requested_by": "bob"})
        assert r.status_code == 400 and "'reason'" in r.json()["error"]
        r = sim_agent.post(f"/v1/commands/{cid}/escalate", {"reason": "stuck",
                                                             "requested_by": "bob"})
        assert r.status_code == 202 and r.json()["state"] == "escalated", r.text
        assert rank.p.wait(timeout=10) == -15
        escalated = _audit(sim_agent)[-1]
        assert escalated["outcome"] == "escalated" and escalated["on_behalf_of"] == "bob"
        assert escalated["signalled_pids"] == [rank.pid] and escalated["command"] == cid
        r = sim_agent.post(f"/v1/commands/{cid}/escalate", {"reason": "again"})
        assert r.status_code == 409 and "escalated" in r.json()["error"]
        assert sim_agent.post("/v1/commands/nope/escalate", {"reason": "x"}).status_code == 404
        r = sim_agent.post("/v1/runs/r1/actions", {"action": "restart", "reason": "again"})
        assert r.status_code == 409 and "state escalated" in r.json()["error"]


def test_a_restart_is_accepted_again_once_the_one_in_flight_is_over():
    """In flight means not completed or failed and not past its deadline: after it, the
    next restart of the run goes ahead; another run is never held up by it."""
    from clusterpulse.agent.audit import AuditLog
    from clusterpulse.agent.commands import CommandBook, InFlight
    from clusterpulse.agent.ranks import RankRegistry

    mono = [1000.0]
    old = Sender(pid=10**7 + 1, uid=0, start_time=1, verified=True)  # no such process
    alive = {old}
    ranks = RankRegistry(clock=lambda: mono[0], alive=lambda s: s in alive)
    for run in ("r1", "r2"):
        ranks.update({"v": 1, "type": "step", "run": run, "rank": 0, "local_rank": 0,
                      "gpu": 0, "step": 5}, None, old)
    book = CommandBook(ranks, AuditLog(None), "n", clock=lambda: mono[0])
    first = book.submit("r1", "restart", "hung", "op", deadline_s=60)
    assert first.state == "delivered"
    with pytest.raises(InFlight, match=f"command {first.id} \\(restart, requested by op"):
        book.submit("r1", "checkpoint-restart", "slow", "policy", deadline_s=60)
    assert book.submit("r2", "restart", "hung", "op", deadline_s=60).state == "delivered"
    # torchrun restarted the rank: a new process that stepped -> completed
    alive.discard(old)
    new = Sender(pid=10**7 + 2, uid=0, start_time=2, verified=True)
    alive.add(new)
    ranks.update({"v": 1, "type": "step", "run": "r1", "rank": 0, "local_rank": 0,
                  "gpu": 0, "step": 6, "restarts": 1}, None, new)
    book.tick()
    assert first.state == "completed", first.detail
    second = book.submit("r1", "restart", "hung again", "op", deadline_s=10)
    assert second.state == "delivered"
    mono[0] += 10  # past its deadline: over, whatever the next tick makes of it
    third = book.submit("r1", "checkpoint-restart", "slow", "op", deadline_s=10)
    assert third.state == "pending"
