"""Control API: authentication, fault injection, command delivery and audit."""

import json
import os
import socket
import subprocess
import sys
import time

from agent import protocol
from tests.conftest import TOKEN, start_agent


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
    records = [json.loads(x) for x in sim_agent.audit_path.read_text().splitlines()]
    assert records[-1]["who"] == "alice" and records[-1]["action"] == "fault:gpu_lost"


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


def _rank(sock, port, **kw):
    sock.sendto(protocol.encode({"type": "step", "run": "r1", "rank": 0, "local_rank": 0,
                                 "gpu": 0, **kw}), ("127.0.0.1", port))
    return json.loads(sock.recv(4096))


def test_graceful_command_is_delivered_acknowledged_and_completes(sim_agent):
    s = socket.socket(socket.AF_INET, socket.SOCK_DGRAM)
    s.settimeout(2)
    port = sim_agent.telemetry_port
    assert "commands" not in _rank(s, port, step=1, restarts=0, pid=os.getpid())
    r = sim_agent.post("/v1/runs/r1/actions", {"action": "checkpoint-restart",
                                                "reason": "straggler", "requested_by": "bob"})
    assert r.status_code == 202
    cid = r.json()["id"]
    reply = _rank(s, port, step=2, restarts=0, pid=os.getpid())
    assert reply["commands"] == [{"id": cid, "action": "checkpoint-restart"}]
    _rank(s, port, step=3, restarts=0, pid=os.getpid(), acks=[cid])
    sim_agent.agent.collect_once()
    assert sim_agent.get(f"/v1/commands/{cid}").json()["state"] == "delivered"
    # torchrun restarted the worker: a higher restart count, progress again.
    _rank(s, port, step=3, restarts=1, pid=os.getpid())
    sim_agent.agent.collect_once()
    status = sim_agent.get(f"/v1/commands/{cid}").json()
    assert status["state"] == "completed" and status["resumed"] == [0]
    outcomes = [json.loads(x)["outcome"] for x in sim_agent.audit_path.read_text().splitlines()]
    assert outcomes == ["pending", "completed"]


def test_hard_restart_terminates_the_local_ranks(sim_agent):
    victim = subprocess.Popen([sys.executable, "-c", "import time; time.sleep(60)"])
    try:
        s = socket.socket(socket.AF_INET, socket.SOCK_DGRAM)
        s.settimeout(2)
        _rank(s, sim_agent.telemetry_port, step=5, restarts=0, pid=victim.pid)
        r = sim_agent.post("/v1/runs/r1/actions", {"action": "restart", "reason": "hung"})
        assert r.status_code == 202 and r.json()["state"] == "delivered"
        assert victim.wait(timeout=10) == -15  # SIGTERM
    finally:
        victim.kill()
    assert sim_agent.get("/v1/commands").json()["commands"][0]["action"] == "restart"


def test_graceful_command_escalates_to_hard_after_deadline(sim_agent):
    victim = subprocess.Popen([sys.executable, "-c", "import time; time.sleep(60)"])
    try:
        s = socket.socket(socket.AF_INET, socket.SOCK_DGRAM)
        s.settimeout(2)
        _rank(s, sim_agent.telemetry_port, step=5, restarts=0, pid=victim.pid)
        r = sim_agent.post("/v1/runs/r1/actions", {"action": "checkpoint-restart",
                                                    "reason": "hung", "deadline_s": 1})
        cid = r.json()["id"]
        time.sleep(1.3)
        sim_agent.agent.collect_once()
        assert sim_agent.get(f"/v1/commands/{cid}").json()["state"] == "escalated"
        assert victim.wait(timeout=10) == -15
    finally:
        victim.kill()
