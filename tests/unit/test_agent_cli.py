"""The agent's command line: a node name that would break what is built from it is
refused at start, in one line."""

from __future__ import annotations

import itertools
import re
import subprocess
import sys
from pathlib import Path

import pytest

from clusterpulse.agent.cli import NODE_NAME, main

REPO = Path(__file__).resolve().parents[2]


@pytest.mark.parametrize("node", ['gpu"7', "gpu\\7", "gpu 7", "", "-gpu", "x" * 254])
def test_a_node_name_that_would_break_the_alerts_queries_is_refused(node, capsys):
    """The link alert's templates query the node's evidence by its label
    (`{node="..."}`): a quote or a backslash in the name broke them, and the alert was
    sent without its evidence."""
    assert main(["--backend", "sim", "--listen", "127.0.0.1:0", f"--node={node}"]) == 2
    err = capsys.readouterr().err.strip()
    assert err.startswith("clusterpulse-agent: error: --node must be a host name"), err


@pytest.mark.parametrize("node", ["node-0", "gpu_001", "ip-10-0-3-7.ec2.internal",
                                  "DGX-A100-07", "x" * 253])
def test_host_kubernetes_and_slurm_node_names_are_accepted(node):
    assert NODE_NAME.fullmatch(node)


@pytest.mark.parametrize(("listen", "reason"), [
    ("127.0.0.1:{taken}", "Address already in use"),
    ("127.0.0.1:http", "--listen must be HOST:PORT"),
    ("nowhere", "--listen must be HOST:PORT"),
    ("127.0.0.1:\u00b2", "--listen must be HOST:PORT"),  # isdigit(), and int() refuses it
])
def test_an_address_it_cannot_listen_on_is_one_line_naming_it(listen, reason, tmp_path,
                                                               capsys):
    """A port another process holds (in CI, a neighbour that took it first) ended in
    two tracebacks: the bind's, then the server's cleanup failing on a gate it never
    built. The operator needs the address and the reason, in one line, exit 2, and
    nothing left behind."""
    import socket

    with socket.socket() as held:
        held.bind(("127.0.0.1", 0))
        held.listen()
        listen = listen.format(taken=held.getsockname()[1])
        run_dir = tmp_path / "run"
        run_dir.mkdir(mode=0o700)
        code = main(["--backend", "sim", "--node", "n0", "--listen", listen,
                     "--telemetry", f"unix:{run_dir}/agent.sock",
                     "--audit-log", str(tmp_path / "audit.jsonl")])
    err = capsys.readouterr().err
    assert code == 2, err
    assert err.startswith("clusterpulse-agent: error: ") and err.count("\n") == 1, err
    assert listen in err and reason in err, err
    assert not (run_dir / "agent.sock").exists()  # the telemetry socket bound first: gone


@pytest.mark.parametrize("where", ["{dir}", "{dir}/file/audit.jsonl"])
def test_an_audit_log_that_cannot_be_a_file_is_named_at_start(where, tmp_path, capsys):
    """A directory started an agent whose every scrape then failed; a path under a
    file was reported as `cannot listen`, naming the listen addresses."""
    (tmp_path / "file").write_text("")
    run_dir = tmp_path / "run"
    run_dir.mkdir(mode=0o700)
    audit = where.format(dir=tmp_path)
    code = main(["--backend", "sim", "--node", "n0", "--listen", "127.0.0.1:0",
                 "--telemetry", f"unix:{run_dir}/agent.sock", "--audit-log", audit])
    err = capsys.readouterr().err
    assert code == 2, err
    assert err.startswith(f"clusterpulse-agent: error: --audit-log {audit}"), err
    assert err.count("\n") == 1 and "listen" not in err, err
    assert not (run_dir / "agent.sock").exists()


SECONDS = "must be > 0 and at most 604800 seconds (a week), got"


@pytest.mark.parametrize(("flag", "value", "why"), [
    ("--interval", "nan", f"--interval {SECONDS} nan"),
    ("--interval", "0", f"--interval {SECONDS} 0"),
    ("--rank-grace", "nan", f"--rank-grace {SECONDS} nan"),
    ("--rank-grace", "-1", f"--rank-grace {SECONDS} -1"),
    ("--max-ranks", "0", "--max-ranks must be >= 1"),
])
def test_a_limit_it_cannot_work_with_is_refused_at_start(flag, value, why, capsys):
    """Found by a review: --interval nan passed `<= 0` and the agent spun a core
    (4.5 s of CPU in 5 s); --rank-grace and --max-ranks were not checked at all."""
    assert main(["--backend", "sim", "--listen", "127.0.0.1:0", f"{flag}={value}"]) == 2
    assert capsys.readouterr().err.strip() == f"clusterpulse-agent: error: {why}"


@pytest.mark.parametrize(("flag", "value"), [
    ("--interval", "inf"), ("--interval", "1e300"), ("--interval", "1e400"),
    ("--interval", "604801"), ("--rank-grace", "inf"), ("--rank-grace", "infinity"),
])
def test_an_endless_or_overflowing_duration_is_refused_at_start(flag, value, tmp_path):
    """Found by a review: --interval inf was accepted, and the collection thread died of
    OverflowError at its first wait: the agent served the same GPU data for ever. The
    real command runs: an agent that accepts the value starts and never exits."""
    run_dir = tmp_path / "run"
    run_dir.mkdir(mode=0o700)
    try:
        done = subprocess.run(
            [sys.executable, "-m", "clusterpulse.agent", "--backend", "sim",
             "--listen", "127.0.0.1:0", "--telemetry", f"unix:{run_dir}/agent.sock",
             "--audit-log", str(tmp_path / "audit.jsonl"), f"{flag}={value}"],
            capture_output=True, text=True, timeout=30, cwd=REPO)
    except subprocess.TimeoutExpired:
        pytest.fail(f"{flag} {value} was accepted: the agent started")
    assert done.returncode == 2, done.stderr
    assert done.stderr == f"clusterpulse-agent: error: {flag} {SECONDS} " \
                          f"{float(value):g}\n"


def test_the_help_shows_each_example_as_it_is_typed():
    """A backslash-newline inside the (non-raw) examples string joined the lines, and
    --help printed `--token-file /etc/clusterpulse/tokens       --tls-cert ...`: each
    continued example must end its line with a backslash, as a shell wants it."""
    out = subprocess.run([sys.executable, "-m", "clusterpulse.agent", "--help"],
                         capture_output=True, text=True, check=True, cwd=REPO).stdout
    lines = out.split("examples:", 1)[1].splitlines()
    continued = [(a, b) for a, b in itertools.pairwise(lines)
                 if b.startswith("      --")]
    assert len(continued) >= 2, out  # the TLS and the Kubernetes examples
    assert all(a.endswith(" \\") for a, _ in continued), out
    assert not re.search(r"\S {3,}--", out), out


def test_a_telemetry_port_of_digits_int_cannot_read_is_the_forms_error(capsys):
    """'²'.isdigit() is true and int('²') raises: the message was int()'s."""
    assert main(["--backend", "sim", "--listen", "127.0.0.1:0",
                 "--telemetry", "127.0.0.1:\u00b2"]) == 2
    err = capsys.readouterr().err
    assert err.startswith("clusterpulse-agent: error: --telemetry: telemetry address must be"), \
        err
