"""The rank -> agent channel: validation, bounded memory, kernel-verified identity,
replies only from the agent, GPU UUIDs, heartbeat age."""

import contextlib
import json
import logging
import os
import re
import socket
import subprocess
import sys
import threading
import time

import pytest

from clusterpulse.agent import protocol
from clusterpulse.agent.identity import Sender
from clusterpulse.agent.ranks import (
    MAX_ACKS_KEPT,
    STEP_INTERVALS_KEPT,
    RankRegistry,
    Refused,
)
from clusterpulse.trainer.telemetry import AgentLink, rank_gpu_uuids
from tests.support.clock import ManualClock
from tests.support.procs import REPO, wait_until
from tests.support.promtool import metrics_are_clean
from tests.support.ranksock import RankProcess, connect, exchange


def msg(**kw) -> dict:
    base = {"v": 1, "type": "step", "run": "r1", "rank": 0, "local_rank": 0, "pid": 1,
            "gpu": 0, "step": 1, "step_seconds": 0.1, "compute_seconds": 0.08}
    return {**base, **kw}


def raw(m: dict) -> bytes:
    return json.dumps(m, separators=(",", ":")).encode()


@pytest.mark.parametrize("data,reason", [
    (b"\xff\xfe", "not_json"),
    (b"[1,2]", "not_object"),
    (raw(msg(v=2)), "bad_version"),
    (raw(msg(type="weird")), "bad_type"),
    (raw(msg(run="has space")), "bad_run"),
    (raw(msg(rank="0")), "bad_rank"),
    (raw({k: v for k, v in msg().items() if k != "rank"}), "bad_rank"),
    (raw(msg(loss="NaN")), "bad_loss"),
    (raw(msg(step=True)), "bad_step"),
    (raw(msg(type="event", event="boom")), "bad_event"),
    (raw(msg(acks="x")), "bad_acks"),
    (b"{" + b" " * protocol.MAX_DATAGRAM_BYTES + b"}", "too_large"),
    # findings: a 400-digit integer under any key, 4,000-deep JSON, non-finite numbers
    (raw(msg()).replace(b'"pid":1', b'"pid":' + b"9" * 400), "number_too_large"),
    (raw(msg()).replace(b'"pid":1', b'"anything":' + b"9" * 400), "number_too_large"),
    (b"[" * 4000 + b"]" * 4000, "too_deep"),
    (b'{"v":1,"type":"step","run":"r1","rank":0,"x":' + b"[" * 3000 + b"]" * 3000 + b"}",
     "too_deep"),
    (raw(msg()).replace(b'"loss"', b'"x"')[:-1] + b',"loss":Infinity}', "non_finite_number"),
    (raw(msg()).replace(b'"step_seconds":0.1', b'"step_seconds":1e999'), "bad_step_seconds"),
    # a counter below zero is no counter (the OpenMetrics text would be invalid)
    (raw(msg(samples_total=-5)), "bad_samples_total"),
    (raw(msg(gpu_uuids=["GPU-ok", "../etc"])), "bad_gpu_uuids"),
    (raw(msg(acks=["a b"])), "bad_acks"),
])
def test_malformed_messages_are_named(data, reason):
    with pytest.raises(protocol.MalformedMessage, match=reason):
        protocol.decode(data)


def test_decode_keeps_only_known_fields():
    m = protocol.decode(raw(msg(extra=5, nested={"a": 1}, note="x" * 100)))
    assert m["rank"] == 0 and m["compute_seconds"] == 0.08
    assert not {"extra", "nested", "note"} & set(m)


def test_registry_is_bounded_and_forgets_silent_ranks():
    t = [0.0]
    reg = RankRegistry(max_ranks=3, max_per_owner=3, grace_s=10, clock=lambda: t[0])
    for rank in range(10):
        with contextlib.suppress(Refused):
            reg.update(msg(rank=rank), None)
    assert len(reg.snapshot()) == 3
    t[0] = 5.0
    reg.update(msg(rank=0, step=2), None)
    assert reg.age(reg.of_run("r1")[1]) == 5.0
    t[0] = 12.0
    assert sorted(r.rank for r in reg.expire()) == [1, 2]
    assert [r.rank for r in reg.snapshot()] == [0]


def test_time_loading_or_saving_a_checkpoint_does_not_count_against_the_next_step():
    """Start and checkpoint have the absolute hang timeout; the steady threshold counts
    from when the rank leaves them, not from its last step (CI paged a rank that had
    loaded a checkpoint for seconds the moment its first step began)."""
    t = [0.0]
    reg = RankRegistry(clock=lambda: t[0])
    reg.update(msg(type="event", event="start", phase="start"), None)
    t[0] = 8.0
    reg.update(msg(type="heartbeat", phase="start"), None)  # loading: 8 s old
    assert reg.age(reg.of_run("r1")[0]) == 8.0
    t[0] = 9.0
    reg.update(msg(type="heartbeat", phase="forward_backward"), None)  # the first step
    t[0] = 12.0
    reg.update(msg(type="heartbeat", phase="forward_backward"), None)
    assert reg.age(reg.of_run("r1")[0]) == 3.0  # from the end of loading, and growing
    reg.update(msg(step=40), None)
    reg.update(msg(type="heartbeat", phase="checkpoint"), None)
    t[0] = 30.0  # an 18 s save
    reg.update(msg(type="heartbeat", phase="forward_backward"), None)
    t[0] = 31.0
    assert reg.age(reg.of_run("r1")[0]) == 1.0
    reg.update(msg(type="heartbeat", phase="sync"), None)  # training phases: no reset
    t[0] = 40.0
    reg.update(msg(type="heartbeat", phase="forward_backward"), None)
    assert reg.age(reg.of_run("r1")[0]) == 10.0


def test_the_step_interval_p99_holds_what_the_loop_does_between_steps():
    """The steady hang threshold is based on it (issue #27 item 4): a 15 s evaluation
    between two 1 s steps, every 50 steps, is in the p99 of the intervals the agent
    sees, though no step time shows it. A process's first step (set-up) and time
    loading or saving a checkpoint (their own timeouts) are not the loop's pace."""
    t = [0.0]
    reg = RankRegistry(clock=lambda: t[0])
    reg.update(msg(type="event", event="start", phase="start"), None)
    t[0] = 30.0  # loading and compiling: the first step ends 30 s after the start
    reg.update(msg(type="heartbeat", phase="forward_backward"), None)
    reg.update(msg(step=1), None)
    r = reg.of_run("r1")[0]
    assert r.step_intervals.p99() is None
    for step in range(2, 201):
        t[0] += 16.0 if step % 50 == 0 else 1.0  # an evaluation before every 50th step
        reg.update(msg(step=step), None)
    assert len(r.step_intervals) == 199
    assert r.step_intervals.p99() == 16.0  # 4 of 199: above the 1 % a p99 leaves out
    reg.update(msg(type="heartbeat", phase="checkpoint"), None)
    t[0] += 40.0  # a 40 s save
    reg.update(msg(type="heartbeat", phase="between"), None)
    t[0] += 1.0
    reg.update(msg(step=201), None)
    assert max(r.step_intervals._ring) == 16.0  # the step after the save: 1 s
    t[0] += 5.0
    reg.update(msg(step=201), None)  # the same step again: no interval
    assert len(r.step_intervals) == 200


def test_the_step_intervals_kept_are_bounded_and_recent():
    """A rank's memory stays bounded whatever its length of run: the p99 is that of its
    last STEP_INTERVALS_KEPT steps, so a pause that stopped recurring leaves it."""
    t = [0.0]
    reg = RankRegistry(clock=lambda: t[0])
    reg.update(msg(type="heartbeat", phase="forward_backward"), None)
    for step in range(1, 3001):
        t[0] += 10.0 if step <= 1000 and step % 20 == 0 else 0.5
        reg.update(msg(step=step), None)
    r = reg.of_run("r1")[0]
    assert len(r.step_intervals) == STEP_INTERVALS_KEPT
    assert r.step_intervals.p99() == 0.5


@pytest.mark.parametrize("outcome,phase,age", [
    ("finished", "exited", 10.0), ("preempted", "exited", 10.0),
    # a rank that raised keeps its last phase: the restart gap applies once its process
    # is gone (the hang rules), so a crash that nothing restarts still pages
    ("failed", "forward_backward", 10.0),
    # one that saved and leaves for a checkpoint-restart is "restarting" from its exit
    # event on (the restart gap, alive or not): its tear-down is no hung step
    ("checkpoint-restart", "restarting", 0.0)])
def test_only_a_clean_exit_ends_a_rank(outcome, phase, age):
    t = [0.0]
    reg = RankRegistry(clock=lambda: t[0])
    reg.update(msg(type="heartbeat", phase="forward_backward"), None)
    t[0] = 10.0
    reg.update(protocol.decode(raw(msg(type="event", event="exit", outcome=outcome))), None)
    r = reg.of_run("r1")[0]
    assert (r.phase, reg.age(r)) == (phase, age)
    for own in (protocol.EXITED, protocol.RESTARTING):  # the agent's to set, not a rank's
        with pytest.raises(protocol.MalformedMessage):
            protocol.decode(raw(msg(type="heartbeat", phase=own)))


def test_entering_a_checkpoint_is_told_at_once_not_at_the_next_heartbeat(tmp_path,
                                                                         monkeypatch):
    """Saving has its own timeout; the agent learnt of it from the 1 s heartbeat, and
    a late one on a loaded machine left it holding a saving rank to the 5 s floor of
    the training phase it saw last."""
    from clusterpulse.trainer import instrument
    from clusterpulse.trainer.instrument import Pulse

    monkeypatch.setattr(instrument, "HEARTBEAT_EVERY_S", 3600)  # only what _enter sends

    path = str(tmp_path / "agent.sock")
    rx = socket.socket(socket.AF_UNIX, socket.SOCK_DGRAM)
    rx.bind(path)
    rx.settimeout(10)
    pulse = Pulse(run="r1", agent=f"unix:{path}", world_size=1, catch_sigterm=False)
    try:
        sent = pulse.link.sent
        pulse._enter("checkpoint")
        assert pulse.link.sent == sent + 1  # sent from the call itself, not the thread
        pulse._enter("checkpoint")  # no change: nothing more
        pulse._enter("between")  # leaving is learnt from the next heartbeat or step
        assert pulse.link.sent == sent + 1
        seen = []
        while not any(m.get("phase") == "checkpoint" for m in seen):
            seen.append(json.loads(rx.recv(65536)))
        (told,) = [m for m in seen if m.get("phase") == "checkpoint"]
        assert told["type"] == "heartbeat" and told["run"] == "r1", told
    finally:
        pulse.close()
        rx.close()


def _failing_loader():
    yield 1
    raise OSError("the evaluation's storage went away")


def test_an_evaluation_is_told_at_once_and_the_phase_it_found_is_put_back(tmp_path,
                                                                          monkeypatch,
                                                                          sim_agent):
    """`with pulse.evaluating():` (an evaluation every N steps, often on rank 0 alone
    while its peers wait in the next all-reduce) is phase evaluate, told at once like a
    checkpoint save: in phase between it was held to the steady hang threshold and
    paged as a hang root (deploy/prometheus/tests/alerts_test.yml has the rule's side).
    The agent (real, in process) lists the phase in its replies; to an agent that does
    not (an older one would drop the heartbeat as malformed) the rank says between."""
    from clusterpulse.trainer import instrument
    from clusterpulse.trainer.instrument import Pulse

    monkeypatch.setattr(instrument, "HEARTBEAT_EVERY_S", 3600)  # only what _enter sends
    pulse = Pulse(run="ev1", agent=sim_agent.telemetry, world_size=1, catch_sigterm=False)
    try:
        # A first evaluation, before any step (a sanity check): the start event's reply
        # is read as the evaluation begins (a review: replies were read every 5 steps
        # only, and a first evaluation was reported as between).
        (rank,) = wait_until(lambda: sim_agent.agent.ranks.of_run("ev1"), 10, "the rank")
        time.sleep(0.3)  # the agent replies as it takes the message in
        sent = pulse.link.sent
        with pulse.evaluating():
            assert pulse.phase == "evaluate" and pulse.link.sent == sent + 1  # at once
            wait_until(lambda: rank.phase == "evaluate", 10, "the agent sees evaluate")
        assert pulse.phase == "start"  # what it found: no step yet
        with pulse.step(1) as s:
            s.loss = 1.0
        with pytest.raises(RuntimeError), pulse.evaluating():
            raise RuntimeError("the evaluation failed")
        assert pulse.phase == "between"  # put back whatever the evaluation raised
        with pytest.raises(ValueError, match="not one the agent accepts"), \
                pulse.step(2) as s:
            s.section("evaluate")  # Pulse's own, between steps
    finally:
        pulse.close()
    path = str(tmp_path / "agent.sock")  # an agent that never replies: an older one
    rx = socket.socket(socket.AF_UNIX, socket.SOCK_DGRAM)
    rx.bind(path)
    rx.settimeout(10)
    old = Pulse(run="r1", agent=f"unix:{path}", world_size=1, catch_sigterm=False)
    try:
        with old.evaluating():
            assert old.phase == "evaluate"
            old._send_heartbeat()
        told: list[dict] = []
        while len([m for m in told if m["type"] == "heartbeat"]) < 2:
            told.append(json.loads(rx.recv(65536)))  # the start event first
        assert [m["phase"] for m in told if m["type"] == "heartbeat"] == ["between"] * 2, told
    finally:
        old.close()
        rx.close()


def test_a_save_between_steps_is_phase_checkpoint_told_at_once_and_put_back(monkeypatch,
                                                                           sim_agent):
    """`with pulse.saving():` (a framework's save between steps, the Hugging Face
    Trainer's) is phase checkpoint, told at once with checkpoint_in_progress; a wait
    for input begun before it resumes after it without the save's time (before, the
    save was the next step's data wait, in phase data, held to the steady threshold)."""
    from clusterpulse.trainer import instrument
    from clusterpulse.trainer.instrument import Pulse

    monkeypatch.setattr(instrument, "HEARTBEAT_EVERY_S", 3600)  # only what _enter sends
    pulse = Pulse(run="sv1", agent=sim_agent.telemetry, world_size=1, catch_sigterm=False)
    try:
        (rank,) = wait_until(lambda: sim_agent.agent.ranks.of_run("sv1"), 10, "the rank")
        with pulse.step(1) as s:
            s.loss = 1.0
        pulse.awaiting_input()
        sent = pulse.link.sent
        with pulse.saving():
            assert pulse.phase == "checkpoint" and pulse.link.sent == sent + 1  # at once
            assert pulse.extra["checkpoint_in_progress"] == 1
            wait_until(lambda: rank.phase == "checkpoint", 10, "the agent sees checkpoint")
            time.sleep(0.3)  # the save
        assert pulse.phase == "data" and pulse.extra["checkpoint_in_progress"] == 0
        pulse.input_arrived()
        with pulse.step(2) as s:
            s.loss = 1.0
        assert pulse.last["data_wait_seconds"] < 0.3, pulse.last  # not the save's time
        with pytest.raises(OSError), pulse.saving():
            raise OSError("disk full")
        assert pulse.phase == "between" and pulse.extra["checkpoint_in_progress"] == 0
        with pulse.saving():  # a save within a save (a framework's inside the user's)
            with pulse.saving():
                pass
            assert pulse.phase == "checkpoint" and pulse.extra["checkpoint_in_progress"] == 1
        assert pulse.extra["checkpoint_in_progress"] == 0
    finally:
        pulse.close()
    # A review: what the loop was doing is put back whole. A wait for input begun before
    # (a framework validates between a batch's end and the next fetch) resumes without
    # the evaluation's time, which was the next step's data wait (its cause
    # data_loading); and the evaluation's own loader keeps the phase evaluate (pulse.data
    # left it in between, held to the steady threshold again) and is no data wait.
    with Pulse(run="r1", agent="none", world_size=1, catch_sigterm=False) as quiet:
        # a step inside an evaluation takes only its own data wait; what was pending for
        # the next training step stays pending, once (a review: it was counted twice)
        quiet.awaiting_input()
        time.sleep(0.1)
        quiet.input_arrived()
        with quiet.evaluating(), quiet.step(1) as inside:
            pass
        assert "data" not in inside.sections and 0.1 <= quiet._fetch_wait < 0.2
        quiet._fetch_wait = 0.0
        # a loader that fails inside the evaluation leaves no wait running
        with pytest.raises(OSError), quiet.evaluating():
            for _ in quiet.data(_failing_loader()):
                pass
        assert quiet._input_since is None
        # a reply without the phases (an older agent after a rollback) forgets them
        quiet._agent_phases = frozenset({"evaluate"})
        monkeypatch.setattr(quiet.link, "poll", lambda: [{"type": "agent", "node": "n"}])
        quiet._read_replies()
        assert quiet._agent_phases == frozenset()
        quiet.awaiting_input()
        with quiet.evaluating():
            for _ in quiet.data(range(3)):
                assert quiet.phase == "evaluate"
                time.sleep(0.05)
            assert quiet.phase == "evaluate"
            time.sleep(0.3)
        assert quiet.phase == "data"
        time.sleep(0.02)
        quiet.input_arrived()
        assert 0.02 <= quiet._fetch_wait < 0.15, quiet._fetch_wait  # not the 0.45 s
    # The agent's side: the evaluation's time is neither the next step's age nor a step
    # interval (the p99 the steady threshold is based on).
    t = [0.0]
    reg = RankRegistry(clock=lambda: t[0])
    reg.update(msg(type="event", event="start", phase="start"), None)
    for step in range(1, 41):
        t[0] += 1.0
        reg.update(msg(type="heartbeat", phase="forward_backward"), None)
        reg.update(msg(step=step), None)
    r = reg.of_run("r1")[0]
    reg.update(msg(type="heartbeat", phase="evaluate"), None)
    t[0] += 60.0  # a one-minute evaluation
    reg.update(msg(type="heartbeat", phase="between"), None)
    t[0] += 1.0
    assert reg.age(r) == 1.0
    reg.update(msg(step=41), None)
    assert max(r.step_intervals._ring) == 1.0


def test_the_rules_give_the_absolute_timeout_to_the_protocols_own_timeout_phases():
    """One list in two places: the agent's (protocol.OWN_TIMEOUT_PHASES: no step
    interval, the age restarted on leaving) and the hang threshold rule's."""
    import yaml

    rules = yaml.safe_load((REPO / "deploy" / "prometheus" / "clusterpulse.rules.yml")
                           .read_text())
    (expr,) = [r["expr"] for g in rules["groups"] for r in g["rules"]
               if r.get("record") == "clusterpulse:rank_hang_threshold_seconds"]
    own = re.findall(r'phase=~"([^"]+)"', expr)
    steady = set(re.findall(r'phase!~"([^"]+)"', expr))
    assert [set(x.split("|")) for x in own] == [set(protocol.OWN_TIMEOUT_PHASES)], expr
    assert [set(x.split("|")) for x in steady] == [
        set(protocol.OWN_TIMEOUT_PHASES) | {protocol.EXITED, protocol.RESTARTING}], expr


def test_rank_memory_is_bounded_whatever_arrives():
    """Finding: every unknown numeric key was kept and the acks set never shrank."""
    reg = RankRegistry()
    for i in range(3000):
        m = protocol.decode(raw(msg(**{f"k{i}": i}, acks=[f"cmd-{i}"])))
        reg.update(m, None)
    r = reg.snapshot()[0]
    assert set(r.values) <= protocol.NUMBER_FIELDS
    assert len(r.acks) == MAX_ACKS_KEPT and "cmd-2999" in r.acks


def test_one_user_cannot_fill_the_registry():
    """Finding: 1,024 fake ranks kept a real new rank out for 300 s."""
    reg = RankRegistry(max_ranks=8, max_per_owner=2, alive=lambda s: True)
    attacker = Sender(pid=100, uid=1000, start_time=1, verified=True)
    held = 0
    for rank in range(50):
        try:
            reg.update(msg(run="fake", rank=rank), None, attacker)
            held += 1
        except Refused as why:
            assert str(why) == "owner_quota"
    assert held == 2
    job = Sender(pid=200, uid=0, start_time=1, verified=True)
    assert reg.update(msg(run="real", rank=0), None, job) is not None


def test_a_live_rank_cannot_be_taken_over_and_dead_ones_make_room():
    alive = {1: True}
    reg = RankRegistry(max_ranks=1, alive=lambda s: alive.get(s.pid, False))
    owner = Sender(pid=1, uid=0, start_time=5, verified=True)
    other = Sender(pid=2, uid=0, start_time=5, verified=True)
    reg.update(msg(straggler_score=2.5), None, owner)
    for intruder in (other, Sender()):  # another process; an unverified (UDP) sender
        with pytest.raises(Refused, match="owned_by_other_process"):
            reg.update(msg(straggler_score=1.0), None, intruder)
    assert reg.snapshot()[0].values["straggler_score"] == 2.5
    alive[1] = False  # torchrun restarted the worker: the new process takes over
    assert reg.update(msg(restarts=1), None, other).sender == other
    alive[2] = False  # full of dead entries: a new rank evicts one
    assert reg.update(msg(run="r2"), None, owner) is not None


def test_another_user_never_takes_over_a_rank_whose_process_exited():
    """A worker torchrun restarts runs as the job's user: once the owner had exited,
    another user's process took its (run, rank) over, and its heartbeats (a step of
    999, a made-up phase) stood for the job's until the entry expired."""
    alive = {1: True, 2: True}
    reg = RankRegistry(grace_s=60, clock=(clock := ManualClock()),
                       alive=lambda s: alive.get(s.pid, False))
    owner = Sender(pid=1, uid=1000, start_time=1, verified=True)
    other = Sender(pid=2, uid=65534, start_time=1, verified=True)
    reg.update(msg(step=5), None, owner)
    alive[1] = False
    with pytest.raises(Refused, match="owned_by_other_user"):
        reg.update(msg(step=999, restarts=1), None, other)
    assert reg.snapshot()[0].step == 5
    successor = Sender(pid=3, uid=1000, start_time=2, verified=True)  # the job's own
    alive[3] = True
    assert reg.update(msg(step=6, restarts=1), None, successor).sender == successor
    alive[3] = False
    clock.t += 61
    reg.expire()  # gone, and forgotten: the (run, rank) is anyone's again
    assert reg.update(msg(step=1), None, other).sender == other
    # Within the entry's grace, but past a restart's gap (OTHER_USER_WAIT_S), another
    # user's later job may take the (run, rank): a shared default run id, or a pod with
    # another uid mapping, was refused for all 5 minutes (a second review)
    kept = RankRegistry(grace_s=300, clock=(later := ManualClock()),
                        alive=lambda s: alive.get(s.pid, False))
    alive[1] = True
    kept.update(msg(step=5), None, owner)
    alive[1] = False
    later.t += 30
    with pytest.raises(Refused, match="owned_by_other_user"):
        kept.update(msg(step=1), None, other)
    later.t += 31
    alive[2] = True  # another user's process took it, and lives on
    assert kept.update(msg(step=999), None, other).sender == other
    # the job's own next worker, slower than a minute (a node replaced, a long
    # rendezvous), takes its rank back from it (a re-review: it was refused for good)
    comeback = Sender(pid=4, uid=1000, start_time=3, verified=True)
    alive[4] = True
    later.t += 5
    assert kept.update(msg(step=6, restarts=1), None, comeback).sender == comeback
    with pytest.raises(Refused, match="owned_by_other_process"):  # and keeps it
        kept.update(msg(step=1000), None, other)


def test_one_users_churn_keeps_to_its_quota_and_evicts_nobody_elses_evidence():
    """Entries of exited processes did not count toward their user's quota, and a full
    registry dropped anyone's: one user whose processes each registered runs and
    exited filled it, and evicted another user's crashed rank (the evidence its
    alert reads) within seconds."""
    live: set[int] = set()
    reg = RankRegistry(max_ranks=8, max_per_owner=4, alive=lambda s: s.pid in live)
    victim = Sender(pid=1, uid=1000, start_time=1, verified=True)
    reg.update(msg(run="victim"), None, victim)  # then it crashed: pid 1 is not live
    for pid in range(100, 120):  # a process registers 4 runs, exits, the next one...
        churner = Sender(pid=pid, uid=65534, start_time=1, verified=True)
        live.add(pid)
        for k in range(4):
            assert reg.update(msg(run=f"x{pid}-{k}"), None, churner) is not None
        live.discard(pid)
    runs = [r.run for r in reg.snapshot()]
    assert "victim" in runs and sum(r.startswith("x") for r in runs) == 4, runs
    assert {r.run for r in reg.snapshot() if r.run != "victim"} == {f"x119-{k}"
                                                                    for k in range(4)}


def test_agent_survives_poison_datagrams(sim_agent):
    """Finding: one datagram (huge int, deep JSON) killed the telemetry thread."""
    s = connect(sim_agent.socket_path)
    poison = [
        b'{"v":1,"type":"step","run":"r1","rank":0,"loss":' + b"9" * 400 + b"}",
        b'{"v":1,"type":"step","run":"r1","rank":0,"junk":' + b"9" * 400 + b"}",
        b"[" * 4000 + b"]" * 4000,
        b'{"v":1,"type":"step","run":"r1","rank":0,"loss":1e999}',
    ]
    for p in poison:
        s.send(p)
    reply = exchange(s, type="step", run="r1", rank=0, step=3, gpu=1)
    assert reply["type"] == "agent"
    counts = sim_agent.agent.telemetry_counts
    assert counts["malformed_number_too_large"] == 2 and counts["malformed_too_deep"] == 1
    assert counts["malformed_bad_loss"] == 1


def test_receive_loop_survives_a_handler_bug(sim_agent, monkeypatch):
    calls = []

    def broken(*a, **kw):
        calls.append(1)
        raise RuntimeError("bug")

    monkeypatch.setattr(sim_agent.agent.ranks, "update", broken)
    s = connect(sim_agent.socket_path)
    s.send(protocol.encode({"type": "step", "run": "r1", "rank": 0}))
    deadline = time.time() + 10
    while not calls and time.time() < deadline:
        time.sleep(0.05)
    monkeypatch.undo()
    assert exchange(s, type="step", run="r1", rank=0)["type"] == "agent"
    assert sim_agent.agent.telemetry_counts["internal_error"] == 1


def test_agent_counts_malformed_and_flood_and_keeps_serving(sim_agent):
    s = connect(sim_agent.socket_path)
    for i in range(2000):  # a flood of garbage and of valid messages from many "ranks"
        s.send(b"garbage" if i % 2 else protocol.encode(
            {"type": "heartbeat", "run": "flood", "rank": i}))
    counts = sim_agent.agent.telemetry_counts
    wait_for(lambda: sum(counts.values()) - counts["reply_failed"] >= 2000, "the flood")
    assert counts["malformed_not_json"] == 1000
    # one process holds at most max_per_process ranks, the rest are refused and counted
    assert counts["accepted"] == sim_agent.agent.ranks.max_per_process
    assert counts["refused_process_quota"] == 1000 - sim_agent.agent.ranks.max_per_process
    assert exchange(s, type="step", run="flood", rank=0, step=3)["type"] == "agent"
    assert len(sim_agent.agent.ranks.snapshot()) <= sim_agent.agent.ranks.max_ranks
    text = sim_agent.get("/metrics", token=None).text
    series = ('clusterpulse_agent_telemetry_messages_total'
              '{node="node-a",result="malformed_not_json"}')
    assert series in text


def test_malformed_telemetry_is_logged_with_its_sender_a_line_a_minute(sim_agent,
                                                                        caplog):
    """Found by a review: malformed messages were only counted on /metrics, never
    logged, even at --log-level debug: nothing said who sent them. Each reason is now
    a warning naming the sender, at most once a minute with the count dropped since,
    so that a flood cannot fill the log."""
    now = [1000.0]
    sim_agent.agent.malformed_lines.clock = lambda: now[0]
    caplog.set_level(logging.WARNING, logger="clusterpulse.agent.core")

    def lines() -> list[str]:
        return [r.getMessage() for r in caplog.records
                if r.name == "clusterpulse.agent.core" and "malformed" in r.getMessage()]

    s = connect(sim_agent.socket_path)
    for _ in range(50):
        s.send(b"garbage")
    s.send(raw(msg(step=True)))
    exchange(s, type="step", run="r1", rank=0, step=3)  # answered after all of them
    me = f"uid {os.getuid()} pid {os.getpid()}"
    assert lines() == [f"dropped malformed telemetry (not_json) from {me}",
                       f"dropped malformed telemetry (bad_step) from {me}"]
    now[0] += 61
    s.send(b"garbage")
    exchange(s, type="step", run="r1", rank=0, step=4)
    assert lines()[2:] == [f"dropped malformed telemetry (not_json) from {me}; 49 more "
                           "dropped as not_json, unlogged, since the last such line"]
    assert sim_agent.agent.telemetry_counts["malformed_not_json"] == 51
    # UDP: the kernel names no process, the address is all there is
    sim_agent.agent.handle_datagram(b"[1]", ("192.0.2.7", 40001), Sender())
    assert lines()[3:] == ["dropped malformed telemetry (not_object) from "
                           "192.0.2.7:40001 (UDP, unverified)"]


def wait_for(cond, what: str, timeout: float = 20.0) -> None:
    deadline = time.time() + timeout
    while not cond():
        assert time.time() < deadline, f"timed out waiting for {what}"
        time.sleep(0.02)


def test_agent_replies_with_gpu_slowdown_and_exports_rank_series(sim_agent):
    s = connect(sim_agent.socket_path)
    reply = exchange(s, type="step", run="r1", rank=3, local_rank=1, gpu=1, pid=1, step=7,
                     step_seconds=0.2, compute_seconds=0.15, sync_wait_seconds=0.05,
                     loss=2.5, restarts=1)
    assert reply["type"] == "agent" and reply["slowdown"] == 1.0
    text = sim_agent.get("/metrics", token=None).text
    labels = '{local_rank="1",node="node-a",rank="3",run="r1"}'
    assert f"clusterpulse_trainer_step{labels} 7.0" in text
    assert f"clusterpulse_trainer_compute_seconds{labels} 0.15" in text
    assert f"clusterpulse_trainer_restarts_total{labels} 1.0" in text
    assert f"clusterpulse_trainer_heartbeat_age_seconds{labels}" in text
    assert f"clusterpulse_trainer_process_alive{labels} 1.0" in text
    # one step: no interval yet, so no pace (the rules fall back to the step time)
    assert "clusterpulse_trainer_step_interval_p99_seconds{" not in text
    # a rank that has not said its restart count (before its process group is up) has
    # no restarts series: a default 0 read as "0 restarts" then its count (RestartLoop)
    second = exchange(s, type="step", run="r1", rank=2, local_rank=0, gpu=0, pid=1, step=1)
    assert second["type"] == "agent", second
    step = 'clusterpulse_trainer_step{local_rank="0",node="node-a",rank="2",run="r1"}'
    wait_for(lambda: step in sim_agent.get("/metrics", token=None).text, "rank 2's series")
    text = sim_agent.get("/metrics", token=None).text
    assert 'clusterpulse_trainer_restarts_total{local_rank="0",node="node-a",rank="2",run="r1"}' \
        not in text


def test_the_step_interval_p99_is_exported_once_a_rank_has_one(sim_agent):
    s = connect(sim_agent.socket_path)
    for step in (7, 8, 9):  # the first of a process is set-up, not the loop's pace
        exchange(s, type="step", run="r1", rank=3, local_rank=1, gpu=1, pid=1, step=step,
                 step_seconds=0.2, phase="forward_backward")
    labels = '{local_rank="1",node="node-a",rank="3",run="r1"}'
    series = f"clusterpulse_trainer_step_interval_p99_seconds{labels} "

    def exported() -> str | None:
        text = sim_agent.get("/metrics", token=None).text
        return text if series in text else None

    # /metrics is rendered once per collection cycle: the next one holds the steps
    text = wait_until(exported, 10, "the pace of rank 3 exported")
    assert re.search(r"^# TYPE clusterpulse_trainer_step_interval_p99_seconds gauge$", text, re.M)


def test_checkpoint_failures_are_exported_as_a_counter_promtool_accepts(sim_agent):
    """CheckpointsFailing reads this counter; a failed save was only an event before."""

    s = connect(sim_agent.socket_path)
    exchange(s, type="step", run="r1", rank=0, local_rank=0, gpu=0, pid=1, step=7,
             step_seconds=0.2, checkpoint_failures_total=2)
    text = sim_agent.get("/metrics", token=None).text
    labels = '{local_rank="0",node="node-a",rank="0",run="r1"}'
    assert f"clusterpulse_trainer_checkpoint_failures_total{labels} 2.0" in text
    assert re.search(r"^# TYPE clusterpulse_trainer_checkpoint_failures(_total)? counter$",
                     text, re.M)
    metrics_are_clean(text)


def test_the_pid_is_the_kernels_not_the_payloads(sim_agent):
    """Finding: the agent recorded whatever pid telemetry claimed."""
    with RankProcess(sim_agent.socket_path,
                     [msg(run="k", pid=1, step=1), msg(run="k", pid=1, step=2)]) as rank:
        r = sim_agent.agent.ranks.of_run("k")[0]
        assert r.pid == rank.pid and r.sender.verified and r.sender.uid == os.getuid()
        # While it lives, nobody else (here: this test process) speaks for its rank.
        s = connect(sim_agent.socket_path)
        s.send(protocol.encode(msg(run="k", straggler_score=1.0, restarts=1)))
        exchange(s, type="heartbeat", run="other", rank=0)  # processed in order
        assert sim_agent.agent.telemetry_counts["refused_owned_by_other_process"] == 1
        assert r.restarts == 0 and "straggler_score" not in r.values


@pytest.mark.skipif(os.getuid() != 0, reason="sending as another uid needs root to drop to it")
def test_another_user_cannot_fill_the_registry(sim_agent):
    """Finding: a local process filled the registry with 1,024 fake ranks."""
    flood = [msg(run="fake", rank=i) for i in range(1024)] + [msg(run="fake", rank=0)]
    with RankProcess(sim_agent.socket_path, flood, user=65534):
        kept = sim_agent.agent.ranks.of_run("fake")
        assert 0 < len(kept) <= sim_agent.agent.ranks.max_per_owner
        assert all(r.sender.uid == 65534 for r in kept)
        s = connect(sim_agent.socket_path)
        exchange(s, type="step", run="real", rank=0)
        assert [r.rank for r in sim_agent.agent.ranks.of_run("real")] == [0]


def test_ranks_accept_replies_only_from_their_agent(sim_agent, tmp_path):
    """Finding: a forged `checkpoint-restart` from any local socket reached poll().

    Replies come back on the rank's own connection, whose socket has no name another
    process could send to; with an older agent's datagram socket the link is connected
    to the agent's path, and the kernel refuses datagrams from anyone else."""
    link = AgentLink(sim_agent.telemetry[len("unix:"):], local_rank=0)
    link.send({"type": "heartbeat", "run": "r1", "rank": 0})
    assert link._sock is not None and link._sock.type == socket.SOCK_SEQPACKET
    assert link._sock.getsockname() in ("", b"")  # unnamed: nobody can address it
    deadline = time.time() + 5
    got: list[dict] = []
    while not got and time.time() < deadline:
        got = link.poll()
        time.sleep(0.02)
    assert got and got[0]["type"] == "agent"
    link.close()

    old_agent = socket.socket(socket.AF_UNIX, socket.SOCK_DGRAM)  # an older release's
    old_agent.bind(str(tmp_path / "old.sock"))
    link = AgentLink(str(tmp_path / "old.sock"), local_rank=0)
    link.send({"type": "heartbeat", "run": "r1", "rank": 0})
    assert link._sock is not None and link._sock.type == socket.SOCK_DGRAM
    data, rank_addr = old_agent.recvfrom(8192)
    assert json.loads(data)["run"] == "r1"
    forger = socket.socket(socket.AF_UNIX, socket.SOCK_DGRAM)
    forged = protocol.encode({"type": "agent", "slowdown": 20,
                              "commands": [{"id": "x", "action": "checkpoint-restart"}]})
    with pytest.raises(PermissionError):
        forger.sendto(forged, rank_addr)
    old_agent.sendto(protocol.encode({"type": "agent", "slowdown": 1}), rank_addr)
    deadline = time.time() + 5
    got = []
    while not got and time.time() < deadline:
        got = link.poll()
        time.sleep(0.02)
    assert got == [{"v": 1, "type": "agent", "slowdown": 1}]
    link.close()
    old_agent.close()
    forger.close()


def test_events_wait_briefly_for_a_full_agent_queue_samples_do_not(tmp_path):
    """A Unix datagram queue holds only a few messages (net.unix.max_dgram_qlen);
    a busy agent used to lose the rare event that mattered (an acknowledgement)."""
    path = str(tmp_path / "agent.sock")
    rx = socket.socket(socket.AF_UNIX, socket.SOCK_DGRAM)
    rx.bind(path)
    # A training process can hold > 1024 descriptors, past what select() accepts.
    import resource

    soft, hard = resource.getrlimit(resource.RLIMIT_NOFILE)
    if soft < 1200:
        resource.setrlimit(resource.RLIMIT_NOFILE, (min(hard, 4096), hard))
    filler = [os.open(os.devnull, os.O_RDONLY) for _ in range(1100)]
    try:
        link = AgentLink(path, local_rank=0)
    finally:
        for fd in filler:
            os.close(fd)
    assert link._sock is not None and link._sock.fileno() > 1024
    while link.failed == 0:  # nobody reads: fill the queue until a sample is dropped
        link.send({"type": "step", "run": "r1", "rank": 0, "step": 1})
        assert link.sent < 100_000
    sent = link.sent
    link.send({"type": "step", "run": "r1", "rank": 0, "step": 2})
    assert (link.sent, link.failed) == (sent, 2)  # a sample: dropped at once

    def drain_later():
        time.sleep(0.05)
        rx.settimeout(0.5)
        with contextlib.suppress(OSError):
            while True:
                rx.recv(65536)

    reader = threading.Thread(target=drain_later)
    reader.start()
    link.send({"type": "event", "event": "exit", "run": "r1", "rank": 0}, wait_s=5)
    reader.join()
    assert (link.sent, link.failed) == (sent + 1, 2)  # the event waited and went
    link.close()
    rx.close()


def test_link_reconnects_after_the_agent_restarts(tmp_path):
    from tests.conftest import socket_path, start_agent

    path = socket_path("re")
    link = AgentLink(path, local_rank=0)
    link.send({"type": "heartbeat", "run": "r1", "rank": 0})  # agent not there: dropped
    assert link.failed == 1
    running, server = start_agent(tmp_path)
    try:
        running.agent.stop()
        from clusterpulse.agent.core import Agent

        agent = Agent(running.agent.backend, "node-a", running.agent.ranks,
                      running.agent.audit, telemetry_addr=path)
        agent.start()
        link.send({"type": "heartbeat", "run": "r1", "rank": 0})
        deadline = time.time() + 5
        while not link.poll() and time.time() < deadline:
            time.sleep(0.02)
        assert agent.telemetry_counts["accepted"] == 1
        agent.stop()
    finally:
        server.shutdown()


def test_a_udp_agents_host_name_is_never_looked_up_on_the_send_path(monkeypatch):
    """An agent at HOST:PORT whose name does not resolve (a resolver that does not
    answer, the agent's service not there yet): connect() looked the name up at every
    send, in the training loop's thread and under the link's lock, and every step waited
    for DNS (a review). The link's own thread looks it up, retrying with a growing
    delay, and connects once it resolves."""
    rx = socket.socket(socket.AF_INET, socket.SOCK_DGRAM)
    rx.bind(("127.0.0.1", 0))
    rx.settimeout(5)
    port = rx.getsockname()[1]
    resolves = threading.Event()
    lookups: list[int] = []  # the thread of each lookup of the name (or connect by it)
    real_getaddrinfo, real_connect = socket.getaddrinfo, socket.socket.connect

    def look_up(host: str) -> str:
        lookups.append(threading.get_ident())
        if not resolves.is_set():
            raise socket.gaierror(socket.EAI_AGAIN, "Temporary failure in name resolution")
        return "127.0.0.1"

    def getaddrinfo(host, *args, **kwargs):
        return real_getaddrinfo(look_up(host) if host == "agent.example" else host,
                                *args, **kwargs)

    def connect(sock, address):
        if isinstance(address, tuple) and address[0] == "agent.example":  # C's lookup
            address = (look_up(address[0]), address[1])
        return real_connect(sock, address)

    monkeypatch.setattr(socket, "getaddrinfo", getaddrinfo)
    monkeypatch.setattr(socket.socket, "connect", connect)
    link = AgentLink(("agent.example", port), local_rank=0)
    try:
        for _ in range(200):
            link.send({"type": "heartbeat", "run": "r1", "rank": 0})
        assert link.failed == 200
        assert 1 <= len(lookups) <= 2 and threading.get_ident() not in lookups, lookups
        resolves.set()  # the next try (a second later) finds it
        deadline = time.monotonic() + 10
        while link.sent == 0 and time.monotonic() < deadline:
            link.send({"type": "heartbeat", "run": "r1", "rank": 0})
            time.sleep(0.05)
        assert json.loads(rx.recv(8192))["type"] == "heartbeat"
        assert threading.get_ident() not in lookups
    finally:
        link.close()
        rx.close()


def test_a_link_that_closes_leaves_its_last_messages_readable(tmp_path):
    """Closing with the agent's replies unread made Linux report ECONNRESET to the
    agent before the records still queued from the rank, its exit event among them:
    the link reads what is left of its replies before it closes."""
    from clusterpulse.agent import channel

    path = str(tmp_path / "t.sock")
    listener = channel.bind_unix(path)
    link = AgentLink(path, local_rank=0)
    conn, _ = listener.accept()
    try:
        link.send({"type": "step", "run": "r1", "rank": 0, "step": 1})
        assert b'"step"' in conn.recv(8192)
        conn.send(protocol.encode({"type": "agent", "slowdown": 1}))  # never polled
        link.send({"type": "event", "event": "exit", "run": "r1", "rank": 0,
                   "outcome": "finished"})
        link.close()
        assert b'"exit"' in conn.recv(8192)
        assert conn.recv(8192) == b""  # then the end of the connection
    finally:
        conn.close()
        listener.close()


def test_gpu_is_named_by_uuid_not_local_rank(sim_agent, monkeypatch):
    """Finding: `gpu = local_rank` pinned faults on the wrong GPU under
    CUDA_VISIBLE_DEVICES renumbering."""
    uuids = [g.uuid for g in sim_agent.agent.snapshot.gpus]
    monkeypatch.setenv("CUDA_VISIBLE_DEVICES", f"{uuids[3]},{uuids[2]}")
    assert rank_gpu_uuids(1) == [uuids[2]]
    monkeypatch.setenv("CUDA_VISIBLE_DEVICES", "3,2")  # indices: no UUID to report
    assert rank_gpu_uuids(1) == []
    s = connect(sim_agent.socket_path)
    exchange(s, type="step", run="u", rank=1, local_rank=1, gpu=1, gpu_uuids=[uuids[2]])
    assert sim_agent.agent.ranks.of_run("u")[0].gpu == 2


def test_socket_directory_must_be_private(tmp_path, capsys):
    from clusterpulse.agent.cli import main as agent_main

    shared = tmp_path / "shared"
    shared.mkdir()
    shared.chmod(0o777)
    assert agent_main(["--backend", "sim", "--listen", "127.0.0.1:0",
                       "--telemetry", f"unix:{shared}/t.sock"]) == 2
    assert "writable by other users" in capsys.readouterr().err
    assert agent_main(["--backend", "sim", "--telemetry", "unix:relative.sock"]) == 2
    assert "must be absolute" in capsys.readouterr().err


@pytest.mark.skipif(os.geteuid() != 0, reason="chown to another user needs root")
def test_socket_directory_squatted_by_another_user_is_refused(tmp_path, capsys):
    """A directory another user created first (e.g. /tmp/clusterpulse-JOB, mode 0755)
    is not private even though nobody else can write it: its owner can."""
    from clusterpulse.agent.cli import main as agent_main

    squat = tmp_path / "squat"
    squat.mkdir(mode=0o755)
    os.chown(squat, 65534, 65534)  # nobody
    assert agent_main(["--backend", "sim", "--listen", "127.0.0.1:0",
                       "--telemetry", f"unix:{squat}/t.sock"]) == 2
    assert "writable by other users" in capsys.readouterr().err


def test_a_new_process_on_a_rank_inherits_nothing_of_the_old_ones_judgement():
    """A restart renumbers ranks across nodes: the process now holding rank 0 may run
    on another GPU. It inherited the old process's straggler score and flag (the
    trainer sends them only after its scorer's warm-up), checkpoint-in-progress and
    blocked collective, so TrainingStraggler pointed at the new process's GPU. What
    describes the job (its last checkpoint) stays."""
    alive = {1: True}
    reg = RankRegistry(alive=lambda s: alive.get(s.pid, False))
    old = Sender(pid=1, uid=0, start_time=5, verified=True)
    new = Sender(pid=2, uid=0, start_time=9, verified=True)
    reg.update(msg(straggler_score=1.6, straggler_flagged=1, checkpoint_in_progress=1,
                   checkpoint_step=100, checkpoint_timestamp_seconds=1e9), None, old)
    reg.update(msg(type="heartbeat", collective="all_reduce", phase="sync"), None, old)
    alive[1] = False  # torchrun restarted the worker
    r = reg.update(msg(restarts=1, step=101, gpu=1), None, new)
    assert not {"straggler_score", "straggler_flagged", "checkpoint_in_progress"} & set(r.values)
    assert r.collective == ""
    assert (r.values["checkpoint_step"], r.values["checkpoint_timestamp_seconds"]) == (100, 1e9)


def test_a_new_process_on_a_rank_starts_in_phase_start_not_in_the_old_ones():
    """A review's calm end-to-end run paged RankHung for three ranks under load: the
    process restarted on each rank kept the old one's phase `checkpoint` until its
    first heartbeat with a phase, and with its collective count back at 0 it read as a
    rank in a checkpoint holding its peers. A new process is starting: phase `start`
    (the absolute timeout), its age from now."""
    now = [100.0]
    alive = {1: True}
    reg = RankRegistry(alive=lambda s: alive.get(s.pid, False), clock=lambda: now[0])
    old = Sender(pid=1, uid=0, start_time=5, verified=True)
    new = Sender(pid=2, uid=0, start_time=9, verified=True)
    reg.update(msg(type="heartbeat", phase="checkpoint"), None, old)
    alive[1] = False  # it saved, then left for the restart
    now[0] = 130.0
    r = reg.update(msg(restarts=1, type="heartbeat"), None, new)  # no phase yet
    assert r.phase == "start" and r.last_progress == 130.0


def test_a_rank_that_finished_is_nobodys_straggler(tmp_path):
    """Review of #31: a rank flagged to its end kept exporting straggler_flagged and its
    score for the agent's grace (300 s) after a clean finish, and TrainingStraggler
    paged the finished run (cause slow_clocks: its GPU idled). Not exported once it
    has exited; the agent's API keeps them as evidence."""
    from prometheus_client import CollectorRegistry, generate_latest

    from clusterpulse.agent.audit import AuditLog
    from clusterpulse.agent.backends.sim import SimBackend
    from clusterpulse.agent.core import Agent
    from clusterpulse.agent.exporter import AgentCollector

    ranks = RankRegistry(alive=lambda s: True)
    agent = Agent(SimBackend(gpus=1, node="f"), "f", ranks, AuditLog(tmp_path / "a.jsonl"))
    reg = CollectorRegistry(auto_describe=False)
    reg.register(AgentCollector(agent))
    me = Sender(pid=1, uid=0, start_time=5, verified=True)
    ranks.update(msg(straggler_score=1.6, straggler_flagged=1, straggler_recurring=1.27,
                     checkpoint_step=100), None, me)
    text = generate_latest(reg)
    assert b"clusterpulse_trainer_straggler_flagged{" in text
    assert b"clusterpulse_trainer_straggler_recurring{" in text  # TrainingRecurringSlowness
    r = ranks.update(msg(type="event", event="exit", outcome="finished"), None, me)
    text = generate_latest(reg)
    assert r.phase == "exited" and r.values["straggler_score"] == 1.6
    assert b"clusterpulse_trainer_straggler_flagged{" not in text
    assert b"clusterpulse_trainer_straggler_recurring{" not in text
    assert b"clusterpulse_trainer_straggler_score{" not in text
    assert b"clusterpulse_trainer_checkpoint_last_step{" in text


def test_a_ranks_last_datagrams_read_after_it_exited_still_count(tmp_path):
    """A rank that connected, sent `exit` and exited before the agent accepted its
    connection is named by the kernel (pid and uid recorded at connect) but cannot be
    pinned any more: an unverified sender. Refused as not the owner, the rank stayed
    in its training phase, and JobStalled paged a run that had finished cleanly."""
    from clusterpulse.agent import channel

    listener = channel.bind_unix(str(tmp_path / "t.sock"))
    child = subprocess.Popen([sys.executable, "-c", (
        "import socket, sys; s = socket.socket(socket.AF_UNIX, socket.SOCK_SEQPACKET); "
        "s.connect(sys.argv[1]); s.send(b'exit')"), str(tmp_path / "t.sock")])
    child.wait()
    conn, _ = listener.accept()
    gone = channel.identify(conn)
    assert conn.recv(100) == b"exit"
    conn.close()
    listener.close()
    assert not gone.verified and gone.pid == child.pid  # kernel-named, now gone
    assert gone.uid == os.getuid()
    reg = RankRegistry(alive=lambda s: False)
    owner = Sender(pid=child.pid, uid=os.getuid(), gid=os.getgid(), start_time=7,
                   verified=True)
    reg.update(msg(phase="between"), None, owner)
    r = reg.update(msg(type="event", event="exit", outcome="finished"), None, gone)
    assert r.phase == "exited" and r.sender == owner and r.pid == child.pid
    # not another process's (another pid, or the same pid of another user)
    for other in (Sender(pid=child.pid + 1, uid=os.getuid()),
                  Sender(pid=child.pid, uid=os.getuid() + 1)):
        reg.update(msg(run="r2", phase="between"), None, owner)
        with pytest.raises(Refused, match="owned_by_other_process"):
            reg.update(msg(run="r2", type="event", event="exit", outcome="finished"), None,
                       other)


def test_the_resume_record_is_exported_and_belongs_to_its_process(sim_agent):
    """Where the run resumed from, in the trainer's own words (rank 0's run state): the
    incident timeline read it from the lowest scraped step instead, and showed "first
    resumed step 0" (a restarted rank reports 0 until it has loaded its checkpoint)."""
    s = connect(sim_agent.socket_path)
    exchange(s, type="step", run="r2", rank=0, local_rank=0, gpu=0, pid=1, step=151,
             restarts=1, resume_step=150, resume_steps_recomputed=9,
             resume_timestamp_seconds=1.7e9)
    text = sim_agent.get("/metrics", token=None).text
    labels = '{local_rank="0",node="node-a",rank="0",run="r2"}'
    assert f"clusterpulse_trainer_resume_step{labels} 150.0" in text
    assert f"clusterpulse_trainer_resume_steps_recomputed{labels} 9.0" in text
    assert f"clusterpulse_trainer_resume_timestamp_seconds{labels} 1.7e+09" in text
    reg = RankRegistry(alive=lambda s: s.pid == 2)
    old = Sender(pid=1, uid=0, start_time=5, verified=True)
    reg.update(msg(restarts=1, resume_step=150, resume_steps_recomputed=9), None, old)
    r = reg.update(msg(restarts=2, step=160), None, Sender(pid=2, uid=0, start_time=9,
                                                            verified=True))
    assert "resume_step" not in r.values  # the next restart's record is its own
