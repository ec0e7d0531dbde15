"""The control API over TLS (self-signed certificate made here with the openssl CLI),
with one token per client naming the principal in the audit log."""

import json
import shutil
import socket
import subprocess
import time

import pytest
import requests

from clusterpulse.agent.cli import UsageError, read_token
from clusterpulse.agent.cli import main as agent_main
from clusterpulse.agent.httpsafe import tls_context
from clusterpulse.agent.server import make_server, serve_in_thread
from clusterpulse.agent.tokens import TokenError, Tokens

pytestmark = pytest.mark.skipif(shutil.which("openssl") is None,
                                reason="the openssl CLI makes the test certificate "
                                "(scripts/setup.sh installs it)")


@pytest.fixture(scope="module")
def cert(tmp_path_factory):
    d = tmp_path_factory.mktemp("tls")
    subprocess.run(["openssl", "req", "-x509", "-newkey", "ec", "-pkeyopt",
                    "ec_paramgen_curve:prime256v1", "-nodes", "-days", "1",
                    "-subj", "/CN=127.0.0.1", "-addext", "subjectAltName=IP:127.0.0.1",
                    "-keyout", str(d / "key.pem"), "-out", str(d / "cert.pem")],
                   check=True, capture_output=True)
    return d / "cert.pem", d / "key.pem"


def test_control_api_over_tls_with_per_client_tokens(sim_agent, cert):
    tokens = Tokens.parse("dashboard dash-token-0123456789\nremediation rem-token-0123456789\n")
    server = make_server(sim_agent.agent, "127.0.0.1", 0, tokens, tls=tls_context(*cert))
    serve_in_thread(server)
    url = f"https://127.0.0.1:{server.server_port}"
    try:
        # a client that connects and never says hello does not hold up the others
        with socket.create_connection(("127.0.0.1", server.server_port)):
            r = requests.post(url + "/v1/runs/r1/actions", verify=str(cert[0]), timeout=10,
                              headers={"Authorization": "Bearer rem-token-0123456789"},
                              json={"action": "restart", "reason": "tls", "requested_by": "x"})
        assert r.status_code == 409  # no ranks: but authenticated, over TLS
        assert requests.get(url + "/metrics", verify=str(cert[0]), timeout=10).ok
        with pytest.raises(requests.exceptions.SSLError):
            requests.get(url + "/metrics", timeout=10)  # an unknown CA is refused
        with pytest.raises(requests.exceptions.ConnectionError):
            requests.get(f"http://127.0.0.1:{server.server_port}/metrics", timeout=10)
    finally:
        server.shutdown()
    record = json.loads(sim_agent.audit_path.read_text().splitlines()[-1])
    assert record["who"] == "remediation" and record["on_behalf_of"] == "x"


# Another local user's TLS connections that send one byte of a handshake and stop,
# each from its own loopback address (the review of issue #29: 13 of 15 HTTPS scrapes
# failed; over TLS a scrape cannot be told from the rest before the handshake).
TLS_STALLS = """
import socket, sys, time
port, n, hosts = int(sys.argv[1]), int(sys.argv[2]), sys.argv[3].split(",")
held = []
for i in range(n):
    source = (hosts[i % len(hosts)], 0) if i % 2 else (f"127.2.0.{i + 2}", 0)
    s = socket.create_connection(("127.0.0.1", port), source_address=source)
    s.sendall(bytes([0x16]))
    held.append(s)
print("holding", flush=True)
time.sleep(120)
"""
# ... and, found by the second review, a full handshake then a byte every 5 s: each
# read waits less than its timeout, and the deadline cut the socket TLS had taken over.
TLS_TRICKLE = """
import socket, ssl, sys, threading, time
port, n = int(sys.argv[1]), int(sys.argv[2])
ctx = ssl.create_default_context()
ctx.check_hostname, ctx.verify_mode = False, ssl.CERT_NONE
held = []
for i in range(n):
    try:  # over the gate's handshake rate some are closed: the rest trickle
        held.append(ctx.wrap_socket(socket.create_connection(
            ("127.0.0.1", port), source_address=(f"127.3.0.{i + 2}", 0))))
    except OSError:
        pass
print("holding", flush=True)
for _ in range(24):
    for s in held:
        try:
            s.send(b"G")
        except OSError:
            pass
    time.sleep(5)
"""


def test_other_users_stalled_handshakes_leave_https_scrapes_answered(sim_agent, cert):
    """Stalled handshakes from two other users (the third review: each held half the
    workers, and over TLS a scrape could not be told apart, so 0 of 86 requests were
    answered) hold no worker at all: the gate runs the handshake and reads the head."""
    from tests.unit.test_http_hardening import as_user, host_addresses

    server = make_server(sim_agent.agent, "127.0.0.1", 0, Tokens.single("t" * 24),
                         tls=tls_context(*cert))
    serve_in_thread(server)
    attackers = [as_user(user, TLS_STALLS, server.server_port, 100, host_addresses())
                 for user in ("nobody", "12345")]
    attackers.append(as_user("23456", TLS_TRICKLE, server.server_port, 40))
    try:
        for a in attackers:
            assert a.stdout.readline().strip() == "holding"
        codes = [requests.get(f"https://127.0.0.1:{server.server_port}/metrics",
                              verify=str(cert[0]), timeout=30).status_code for _ in range(10)]
        assert codes == [200] * 10
    finally:
        for a in attackers:
            a.kill()
            a.wait()
        server.shutdown()


def test_the_deadline_ends_a_tls_request_that_trickles(sim_agent, cert, monkeypatch):
    """After the handshake, one byte every 5 s: each read waits less than its timeout,
    so only the absolute deadline (2 s here) can end it; it used to cut the plain
    socket that TLS had taken over, and the connection was held on."""
    from clusterpulse.agent import httpsafe
    from tests.unit.test_http_hardening import as_nobody

    monkeypatch.setattr(httpsafe, "READ_TIMEOUT_S", 2.0)
    server = make_server(sim_agent.agent, "127.0.0.1", 0, Tokens.single("t" * 24),
                         tls=tls_context(*cert))
    serve_in_thread(server)
    attacker = as_nobody(TLS_TRICKLE, server.server_port, 4)
    try:
        assert attacker.stdout.readline().strip() == "holding"

        def held() -> int:
            out = subprocess.run(["ss", "-Htn", "state", "established",
                                  f"( sport = :{server.server_port} )"],
                                 capture_output=True, text=True, check=True).stdout
            return len(out.splitlines())

        assert held() == 4
        time.sleep(12)  # past the deadline and two trickled bytes
        assert held() == 0
    finally:
        attacker.kill()
        attacker.wait()
        server.shutdown()


# Found in the fourth review: ClientHellos at no cost to the sender (connect, hello,
# close), each a private-key operation in the gate's one thread, held every HTTPS
# request 8-10 s.
HELLOS = """
import socket, ssl, sys, time
host, port, n = sys.argv[1], int(sys.argv[2]), int(sys.argv[3])
ctx = ssl.create_default_context()
ctx.check_hostname, ctx.verify_mode = False, ssl.CERT_NONE
print("started", flush=True)
end = time.monotonic() + 60
while time.monotonic() < end:
    for _ in range(n):
        try:  # a connection refused or reset costs the sender nothing either
            s = ctx.wrap_socket(socket.create_connection((host, port), timeout=1),
                                do_handshake_on_connect=False)
        except OSError:
            continue
        s.setblocking(False)
        try:
            s.do_handshake()
        except (ssl.SSLWantReadError, OSError):
            pass
        s.close()
    time.sleep(0.2)
"""


def test_a_flood_of_hellos_from_one_user_is_held_to_its_rate(sim_agent, cert):
    from tests.unit.test_http_hardening import as_nobody

    server = make_server(sim_agent.agent, "127.0.0.1", 0, Tokens.single("t" * 24),
                         tls=tls_context(*cert))
    serve_in_thread(server)
    flood = as_nobody(HELLOS, "127.0.0.1", server.server_port, 200)
    try:
        assert flood.stdout.readline().strip() == "started"
        time.sleep(1.0)
        codes = [requests.get(f"https://127.0.0.1:{server.server_port}/metrics",
                              verify=str(cert[0]), timeout=30).status_code for _ in range(10)]
        assert codes == [200] * 10
        assert server.refused_handshakes > 0  # the flood's excess closed unread
    finally:
        flood.kill()
        flood.wait()
        server.shutdown()


def test_tls_and_token_files_are_checked(tmp_path, cert, capsys):
    assert agent_main(["--backend", "sim", "--tls-cert", str(cert[0])]) == 2
    assert "--tls-cert and --tls-key go together" in capsys.readouterr().err
    assert agent_main(["--backend", "sim", "--tls-cert", str(cert[0]),
                       "--tls-key", str(cert[0])]) == 2
    assert "cannot load TLS certificate" in capsys.readouterr().err
    with pytest.raises(TokenError, match="line 2: token shorter than 16"):
        Tokens.parse("a 0123456789abcdef0\nb short\n")
    with pytest.raises(TokenError, match="principal 'a' appears twice"):
        Tokens.parse("a 0123456789abcdef0\na 0123456789abcdef1\n")


@pytest.mark.parametrize("line", ["alice {token}", "{token}"])
def test_a_token_file_a_windows_editor_saved_with_a_bom_still_opens(line, tmp_path):
    """Found by a review: a file that begins with a UTF-8 byte-order mark (Notepad's
    "UTF-8 with BOM") was accepted, the mark taken for part of the first token, and its
    holder's right token then refused as wrong for ever."""
    token = "0123456789abcdef0123"
    path = tmp_path / "tokens"
    path.write_bytes(b"\xef\xbb\xbf" + line.format(token=token).encode() + b"\r\n")
    path.chmod(0o600)
    tokens = read_token(path)
    assert tokens.match(token) == ("alice" if line.startswith("alice") else "token")
    assert tokens.match("\ufeff" + token) is None


def test_one_token_under_two_principals_is_refused_naming_both(tmp_path):
    """Found by a review: `alice T` and `bob T` were accepted, and the audit log named
    bob for everything alice did. The error names both; the token is never shown."""
    token = "shared-token-0123456789"
    path = tmp_path / "tokens"
    path.write_text(f"alice {token}\ncarol other-token-0123456789\nbob {token}  # new\n")
    path.chmod(0o600)
    with pytest.raises(UsageError) as err:
        read_token(path)
    message = str(err.value)
    assert "line 3" in message and "'bob'" in message and "'alice'" in message, message
    assert token not in message and "\n" not in message, message


def test_per_node_agent_tokens():
    from clusterpulse.dashboard.actions import token_for

    assert token_for("0123456789abcdef0\n", "any") == "0123456789abcdef0"
    table = "node-a aaaaaaaaaaaaaaaa1\nnode-b bbbbbbbbbbbbbbbb2  # rack 2\n"
    assert token_for(table, "node-b") == "bbbbbbbbbbbbbbbb2"
    assert token_for(table, "node-c") is None
    assert token_for(table + "* cccccccccccccccc3\n", "node-c") == "cccccccccccccccc3"
    # a "#" inside a token is part of it, as the agent reads its own file (agent.tokens):
    # cut there, the dashboard sent a shorter token every agent refused
    assert token_for("node-a aaaaaaaa#aaaaaaaa1 # rack 1\n", "node-a") == "aaaaaaaa#aaaaaaaa1"
    assert token_for("0123456789abcdef#0\n", "any") == "0123456789abcdef#0"
