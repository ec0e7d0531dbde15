"""`clusterpulse-healthcheck` against a real agent (simulated GPUs, faults injected
through the control API), run exactly as Node Problem Detector runs it (the rule's
path and args from the shipped plugin config) and as Slurm's HealthCheckProgram would:
exit 0 healthy, 1 problem (with the reason on stdout), 2 unknown."""

from __future__ import annotations

import json
import re
import socket
import subprocess
import sys
from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer
from pathlib import Path
from threading import Thread

import pytest
import requests

from clusterpulse.agent.healthcheck import OK, PROBLEM, UNKNOWN
from tests.support.ports import free_port
from tests.support.procs import REPO, start_agent_cli, wait_until

pytestmark = pytest.mark.integration
TOKEN = "healthcheck-token-0123456789"
NPD_CONFIG = REPO / "deploy/kubernetes/node-problem-detector/clusterpulse-gpu-monitor.json"


def healthcheck(url: str, *extra: str) -> subprocess.CompletedProcess:
    """The check as NPD invokes it: the rule's args, our agent's URL substituted."""
    rule = json.loads(NPD_CONFIG.read_text())["rules"][0]
    args = [url if a == "http://127.0.0.1:9477" else a for a in rule["args"]]
    return subprocess.run([sys.executable, "-m", "clusterpulse.agent.healthcheck", *args, *extra],
                          capture_output=True, text=True, timeout=60, cwd=REPO)


@pytest.fixture(scope="module")
def agent(tmp_path_factory) -> str:
    """Base URL of a real agent with 4 simulated GPUs and its control API on."""
    tmp: Path = tmp_path_factory.mktemp("healthcheck")
    token = tmp / "token"
    token.write_text(TOKEN)
    proc, port, _ = start_agent_cli(tmp, "hc-node", gpus=4, token_file=token)
    yield f"http://127.0.0.1:{port}"
    proc.stop()


def inject(agent: str, fault: dict) -> None:
    r = requests.post(f"{agent}/v1/faults", json=fault, timeout=5,
                      headers={"Authorization": f"Bearer {TOKEN}"})
    assert r.status_code == 200, r.text


def test_healthy_node_is_ok_then_each_fault_is_a_problem_naming_it(agent):
    r = healthcheck(agent)
    assert (r.returncode, r.stdout.strip()) == (OK, "OK"), r.stderr

    inject(agent, {"kind": "gpu_lost", "gpu": 1})
    r = wait_until(lambda: (x := healthcheck(agent)).returncode == PROBLEM and x, 30,
                   "health check to see the lost GPU")
    assert "GPU 1 down" in r.stdout and r.stdout.startswith("ERROR:")

    inject(agent, {"kind": "xid", "gpu": 2, "code": 79})
    inject(agent, {"kind": "ecc_uncorrectable", "gpu": 3})
    r = wait_until(lambda: "ECC" in (x := healthcheck(agent)).stdout and x, 30,
                   "health check to see the XID and the ECC error")
    assert r.returncode == PROBLEM
    assert "GPU 2 XID 79" in r.stdout and "GPU 3 1 uncorrectable ECC errors" in r.stdout
    assert "GPU 1 down" in r.stdout  # every reason, not just the first


def test_application_xid_is_not_a_node_problem_unless_asked(agent):
    inject(agent, {"kind": "xid", "gpu": 0, "code": 13})  # a job's own fault
    wait_until(lambda: 'xid="13"' in requests.get(
        agent + "/metrics", timeout=5).text, 30, "XID 13 exported")
    assert "XID 13" not in healthcheck(agent).stdout
    assert "GPU 0 XID 13" in healthcheck(agent, "--xid", "13").stdout


def test_unreachable_or_non_agent_is_unknown_never_a_problem(tmp_path):
    # Refused (no agent yet, an agent rollout): unknown, so nothing drains the node.
    r = healthcheck(f"http://127.0.0.1:{free_port()}")
    assert r.returncode == UNKNOWN and "agent unreachable" in r.stdout, r.stdout + r.stderr
    assert "Traceback" not in r.stderr

    # Accepts the connection and never answers: a timeout, unknown too.
    silent = socket.create_server(("127.0.0.1", 0))
    try:
        r = healthcheck(f"http://127.0.0.1:{silent.getsockname()[1]}", "--timeout", "1")
    finally:
        silent.close()
    assert r.returncode == UNKNOWN and "agent unreachable" in r.stdout, r.stdout + r.stderr

    # Answers something that is not HTTP: a bad answer, unknown, one line.
    def garbage(server: socket.socket) -> None:
        conn, _ = server.accept()
        conn.sendall(b"SSH-2.0-OpenSSH_9.2\r\n")
        conn.close()

    liar = socket.create_server(("127.0.0.1", 0))
    Thread(target=garbage, args=(liar,), daemon=True).start()
    try:
        r = healthcheck(f"http://127.0.0.1:{liar.getsockname()[1]}")
    finally:
        liar.close()
    assert r.returncode == UNKNOWN and "bad answer" in r.stdout, r.stdout + r.stderr
    assert "Traceback" not in r.stderr

    class NotAnAgent(BaseHTTPRequestHandler):
        def do_GET(self) -> None:
            body = b"# HELP node_load1 load\n# TYPE node_load1 gauge\nnode_load1 0.5\n"
            self.send_response(200)
            self.send_header("Content-Length", str(len(body)))
            self.end_headers()
            self.wfile.write(body)

        def log_message(self, *args) -> None:
            pass

    server = ThreadingHTTPServer(("127.0.0.1", 0), NotAnAgent)
    Thread(target=server.serve_forever, daemon=True).start()
    try:
        r = healthcheck(f"http://127.0.0.1:{server.server_address[1]}")
    finally:
        server.shutdown()
    assert r.returncode == UNKNOWN and "no clusterpulse_gpu_up" in r.stdout


def test_bad_arguments_are_one_line_errors():
    r = subprocess.run([sys.executable, "-m", "clusterpulse.agent.healthcheck", "--xid", "abc"],
                       capture_output=True, text=True, cwd=REPO)
    assert r.returncode == 2 and "XID must be a number" in r.stderr
    assert "Traceback" not in r.stderr
    r = subprocess.run([sys.executable, "-m", "clusterpulse.agent.healthcheck", "--agent",
                        "127.0.0.1:9477"], capture_output=True, text=True, cwd=REPO)
    assert r.returncode == 2 and "--agent must be an http:// or https:// URL" in r.stderr
    assert "Traceback" not in r.stderr
    for flag, value, says in [("--timeout", "inf", "--timeout must be > 0 and at most"),
                              ("--timeout", "1e308", "--timeout must be > 0 and at most"),
                              ("--timeout", "nan", "--timeout must be > 0 and at most"),
                              ("--max-age", "inf", "--max-age must be a number of seconds")]:
        # an endless timeout overflowed into a traceback, exit 1 (a review)
        r = subprocess.run([sys.executable, "-m", "clusterpulse.agent.healthcheck", flag, value],
                           capture_output=True, text=True, cwd=REPO)
        assert r.returncode == 2 and says in r.stderr, (flag, value, r.stderr)
        assert "Traceback" not in r.stderr


def test_a_gpu_lost_before_an_agent_restart_is_still_a_problem_after_it(tmp_path):
    """Review (issue #30): a GPU off the bus, then an agent restart (a DaemonSet rollout,
    Restart=always) with the same --state-dir: the restarted agent listed the others,
    all up, the next one relabelled, so the health check said OK and NPD/draino or
    Slurm put the node with a dead GPU back into service. The real agent over the fake
    NVML, run twice on one state directory, with --remember-gpus as the node-level
    deploy files pass it."""
    state = tmp_path / "state"
    extra = ["--state-dir", str(state), "--remember-gpus", "--fake-gpus", "4"]
    proc, port, _ = start_agent_cli(tmp_path, "hc-restart", module="tests.fakes.nvml_agent",
                                    extra=extra)
    try:
        wait_until(lambda: healthcheck(f"http://127.0.0.1:{port}").returncode == OK, 30,
                   "the healthy node's check to say OK")
    finally:
        proc.stop()
    proc, port, _ = start_agent_cli(tmp_path, "hc-restart", module="tests.fakes.nvml_agent",
                                    extra=[*extra, "--lost-gpu", "2"])
    try:
        r = wait_until(lambda: (x := healthcheck(f"http://127.0.0.1:{port}")).returncode
                       != UNKNOWN and x, 30, "the restarted agent's first collection")
        metrics = requests.get(f"http://127.0.0.1:{port}/metrics", timeout=5).text
    finally:
        proc.stop()
    assert r.returncode == PROBLEM and "GPU 2 down (missing)" in r.stdout, r.stdout + r.stderr
    up = {m.group(1, 2): float(m.group(3)) for m in re.finditer(
        r'^clusterpulse_gpu_up\{[^}]*gpu="(\d+)"[^}]*uuid="([^"]+)"[^}]*\} (\S+)$',
        metrics, re.M)}
    assert up == {("0", "GPU-fake-0"): 1, ("1", "GPU-fake-1"): 1,
                  ("2", "GPU-fake-2"): 0, ("3", "GPU-fake-3"): 1}, up
