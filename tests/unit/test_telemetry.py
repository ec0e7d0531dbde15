"""The rank -> agent channel: validation, bounded memory, replies, heartbeat age."""

import json
import socket
import time

import pytest

from agent import protocol
from agent.ranks import RankRegistry


def msg(**kw) -> dict:
    base = {"v": 1, "type": "step", "run": "r1", "rank": 0, "local_rank": 0, "pid": 1,
            "gpu": 0, "step": 1, "step_seconds": 0.1, "compute_seconds": 0.08}
    return {**base, **kw}


@pytest.mark.parametrize("data,reason", [
    (b"\xff\xfe", "not_json"),
    (b"[1,2]", "not_object"),
    (json.dumps(msg(v=2)).encode(), "bad_version"),
    (json.dumps(msg(type="weird")).encode(), "bad_type"),
    (json.dumps(msg(run="has space")).encode(), "bad_run"),
    (json.dumps(msg(rank="0")).encode(), "bad_rank"),
    (json.dumps({k: v for k, v in msg().items() if k != "rank"}).encode(), "bad_rank"),
    (json.dumps(msg(loss="NaN")).encode(), "bad_loss"),
    (json.dumps(msg(step=True)).encode(), "bad_step"),
    (json.dumps(msg(type="event", event="boom")).encode(), "bad_event"),
    (json.dumps(msg(acks="x")).encode(), "bad_acks"),
    (b"{" + b" " * protocol.MAX_DATAGRAM_BYTES + b"}", "too_large"),
])
def test_malformed_messages_are_named(data, reason):
    with pytest.raises(protocol.MalformedMessage, match=reason):
        protocol.decode(data)


def test_valid_message_roundtrip():
    m = protocol.decode(protocol.encode({k: v for k, v in msg().items() if k != "v"}))
    assert m["rank"] == 0 and m["compute_seconds"] == 0.08


def test_registry_is_bounded_and_forgets_silent_ranks():
    t = [0.0]
    reg = RankRegistry(max_ranks=3, grace_s=10, clock=lambda: t[0])
    for rank in range(10):
        reg.update(msg(rank=rank), None)
    assert len(reg.snapshot()) == 3 and reg.rejected_full == 7
    t[0] = 5.0
    reg.update(msg(rank=0, step=2), None)
    assert reg.age(reg.of_run("r1")[1]) == 5.0
    t[0] = 12.0
    assert sorted(r.rank for r in reg.expire()) == [1, 2]
    assert [r.rank for r in reg.snapshot()] == [0]


def test_agent_counts_malformed_and_flood_and_keeps_serving(sim_agent):
    s = socket.socket(socket.AF_INET, socket.SOCK_DGRAM)
    addr = ("127.0.0.1", sim_agent.telemetry_port)
    for i in range(2000):  # a flood of garbage and of valid messages from many "ranks"
        s.sendto(b"garbage" if i % 2 else protocol.encode(
            {"type": "heartbeat", "run": "flood", "rank": i}), addr)
    s.sendto(protocol.encode({"type": "step", "run": "r1", "rank": 0, "step": 3, "gpu": 1}), addr)
    deadline = time.time() + 5
    counts = sim_agent.agent.telemetry_counts
    while time.time() < deadline and counts["accepted"] + counts["malformed_not_json"] < 2001:
        time.sleep(0.05)
    assert counts["malformed_not_json"] > 0
    assert counts["accepted"] > 0
    assert len(sim_agent.agent.ranks.snapshot()) <= sim_agent.agent.ranks.max_ranks
    text = sim_agent.get("/metrics", token=None).text
    series = ('clusterpulse_agent_telemetry_messages_total'
              '{node="node-a",result="malformed_not_json"}')
    assert series in text


def test_agent_replies_with_gpu_slowdown_and_exports_rank_series(sim_agent):
    s = socket.socket(socket.AF_INET, socket.SOCK_DGRAM)
    s.settimeout(2)
    s.sendto(protocol.encode({"type": "step", "run": "r1", "rank": 3, "local_rank": 1, "gpu": 1,
                              "pid": 1, "step": 7, "step_seconds": 0.2,
                              "compute_seconds": 0.15, "sync_wait_seconds": 0.05,
                              "loss": 2.5, "restarts": 1}),
             ("127.0.0.1", sim_agent.telemetry_port))
    reply = json.loads(s.recv(4096))
    assert reply["type"] == "agent" and reply["slowdown"] == 1.0
    text = sim_agent.get("/metrics", token=None).text
    labels = '{local_rank="1",node="node-a",rank="3",run="r1"}'
    assert f"clusterpulse_trainer_step{labels} 7.0" in text
    assert f"clusterpulse_trainer_compute_seconds{labels} 0.15" in text
    assert f"clusterpulse_trainer_restarts_total{labels} 1.0" in text
    assert f"clusterpulse_trainer_heartbeat_age_seconds{labels}" in text
