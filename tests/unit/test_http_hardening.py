"""The agent's HTTP server against hostile clients: Content-Length, body caps before
auth, malformed requests, idle connections, connection limit, typed numbers, audit."""

import json
import socket
import stat

import pytest

from clusterpulse.agent.server import MAX_BODY, make_server, serve_in_thread
from tests.conftest import TOKEN


def raw_request(port: int, data: bytes, timeout: float = 30) -> bytes:
    """Send bytes as they are and read the whole answer (the server closes)."""
    with socket.create_connection(("127.0.0.1", port), timeout=timeout) as s:
        s.sendall(data)
        out = b""
        while chunk := s.recv(65536):
            out += chunk
    return out


def post(path: str, headers: dict[str, str], body: bytes = b"") -> bytes:
    lines = [f"POST {path} HTTP/1.1", "Host: x", *(f"{k}: {v}" for k, v in headers.items())]
    return ("\r\n".join(lines) + "\r\n\r\n").encode() + body


def status_and_error(answer: bytes) -> tuple[int, str]:
    head, _, body = answer.partition(b"\r\n\r\n")
    return int(head.split()[1]), json.loads(body)["error"]


def port_of(running) -> int:
    return int(running.url.rsplit(":", 1)[1])


@pytest.mark.parametrize("length,status,reason", [
    ("-1", 400, "non-negative integer"),  # finding: -1 read to EOF, bypassing the cap
    ("abc", 400, "non-negative integer"),  # finding: dropped the connection silently
    (str(200 * 1024 * 1024), 413, "larger than"),
    ("99999999999999999999999", 413, "larger than"),
])
def test_content_length_is_validated_before_reading_or_auth(sim_agent, length, status,
                                                            reason):
    answer = raw_request(port_of(sim_agent), post("/v1/faults", {"Content-Length": length}))
    assert status_and_error(answer)[0] == status and reason in status_and_error(answer)[1]


def test_body_is_not_read_before_the_token_is_checked(sim_agent):
    """A client without a token gets 401 without the server reading its body."""
    answer = raw_request(port_of(sim_agent), post("/v1/faults", {
        "Content-Length": str(MAX_BODY)}, b"x" * 10))
    assert status_and_error(answer) == (401, "missing bearer token (Authorization: Bearer "
                                              "<token>)")


@pytest.mark.parametrize("body,reason", [
    (b"[" * 5000 + b"]" * 5000, "nested too deeply"),  # finding: dropped the connection
    (b'{"kind": "slow_clocks", "gpu": 0, "duration_s": Infinity}', "Infinity"),
    (b"\xff\xfe", "not valid JSON"),
])
def test_malformed_bodies_get_a_reason(sim_agent, body, reason):
    answer = raw_request(port_of(sim_agent), post("/v1/faults", {
        "Authorization": f"Bearer {TOKEN}", "Content-Length": str(len(body))}, body))
    code, error = status_and_error(answer)
    assert code == 400 and reason in error


def test_malformed_request_line_gets_a_json_reason(sim_agent):
    code, error = status_and_error(raw_request(port_of(sim_agent), b"NOT HTTP\r\n\r\n"))
    assert code == 400 and error


@pytest.mark.parametrize("path,body,field", [
    ("/v1/runs/r1/actions", {"action": "restart", "reason": "x", "deadline_s": True},
     "'deadline_s'"),
    ("/v1/runs/r1/actions", {"action": "restart", "reason": "x", "deadline_s": 1e308},
     "'deadline_s'"),
    ("/v1/faults", {"kind": "slow_clocks", "gpu": 0, "factor": True}, "'factor'"),
    ("/v1/faults", {"kind": "slow_clocks", "gpu": 0, "duration_s": 10**400}, "'duration_s'"),
    # found by tests/unit/test_fuzz.py: a list where a name belongs raised TypeError
    ("/v1/runs/r1/actions", {"action": [], "reason": "x"}, "'action'"),
    ("/v1/faults", {"kind": [], "gpu": 0}, "unknown fault kind"),
])
def test_numbers_are_typed(sim_agent, path, body, field):
    """Finding: `deadline_s: true`, `duration_s: Infinity`, `factor: true` were accepted."""
    r = sim_agent.post(path, body)
    assert r.status_code == 400 and field in r.json()["error"]


@pytest.fixture
def tight_agent(sim_agent):
    """The same agent behind a server with a short read timeout and 2 connections."""
    from clusterpulse.agent import httpsafe

    old = httpsafe.READ_TIMEOUT_S
    httpsafe.READ_TIMEOUT_S = 1.0
    server = make_server(sim_agent.agent, "127.0.0.1", 0, TOKEN, max_connections=2)
    serve_in_thread(server)
    yield server.server_port
    server.shutdown()
    httpsafe.READ_TIMEOUT_S = old


def test_idle_connections_are_closed_and_their_number_is_limited(tight_agent):
    """Finding: 200 idle connections were held for 20 s, one thread each."""
    idle = [socket.create_connection(("127.0.0.1", tight_agent), timeout=30) for _ in range(2)]
    try:
        idle[0].sendall(b"GET /metrics HTTP/1.1\r\n")  # a request that never ends
        answer = raw_request(tight_agent, b"GET /healthz HTTP/1.0\r\n\r\n")
        assert b" 503 " in answer.split(b"\r\n")[0] and b"too many connections" in answer
        # the server closes the idle ones (recv returns, possibly after a 408/400 answer)
        for s in idle:
            while s.recv(65536):
                pass
    finally:
        for s in idle:
            s.close()
    answer = raw_request(tight_agent, b"GET /healthz HTTP/1.0\r\n\r\n")
    assert b" 200 " in answer.split(b"\r\n")[0]


def test_failed_authentication_is_audited_and_files_are_private(sim_agent):
    sim_agent.get("/v1/ranks", token="not-the-token-at-all")
    sim_agent.post("/v1/runs/nobody/actions", {"action": "restart", "reason": "t"})
    records = [json.loads(x) for x in sim_agent.audit_path.read_text().splitlines()]
    assert records[0]["outcome"] == "refused" and records[0]["why"] == "wrong token"
    assert records[0]["client"] == "127.0.0.1"
    # finding: a failed command was logged twice
    assert [r["outcome"] for r in records[1:]] == ["failed"]
    assert stat.S_IMODE(sim_agent.audit_path.stat().st_mode) == 0o600


def test_audit_log_is_hash_chained(tmp_path):
    from clusterpulse.agent.audit import AuditLog, verify_chain

    path = tmp_path / "audit.jsonl"
    path.write_text("")
    path.chmod(0o644)
    log = AuditLog(path)
    for i in range(3):
        log.write("token", "restart", f"r{i}", "delivered")
    assert stat.S_IMODE(path.stat().st_mode) == 0o600
    assert verify_chain(path) == []
    AuditLog(path).write("token", "restart", "after a restart of the agent", "delivered")
    assert verify_chain(path) == []
    lines = path.read_text().splitlines()
    del lines[1]  # someone removes a record
    path.write_text("\n".join(lines) + "\n")
    assert verify_chain(path) == [2]
