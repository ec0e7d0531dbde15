"""The agent's command line: a node name that would break what is built from it is
refused at start, in one line."""

from __future__ import annotations

import pytest

from clusterpulse.agent.cli import NODE_NAME, main


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


@pytest.mark.parametrize(("flag", "value", "why"), [
    ("--interval", "nan", "--interval must be > 0 seconds"),
    ("--rank-grace", "nan", "--rank-grace must be > 0 seconds"),
    ("--rank-grace", "-1", "--rank-grace must be > 0 seconds"),
    ("--max-ranks", "0", "--max-ranks must be >= 1"),
])
def test_a_limit_it_cannot_work_with_is_refused_at_start(flag, value, why, capsys):
    """Found by a review: --interval nan passed `<= 0` and the agent spun a core
    (4.5 s of CPU in 5 s); --rank-grace and --max-ranks were not checked at all."""
    assert main(["--backend", "sim", "--listen", "127.0.0.1:0", f"{flag}={value}"]) == 2
    assert capsys.readouterr().err.strip() == f"clusterpulse-agent: error: {why}"


def test_a_telemetry_port_of_digits_int_cannot_read_is_the_forms_error(capsys):
    """'²'.isdigit() is true and int('²') raises: the message was int()'s."""
    assert main(["--backend", "sim", "--listen", "127.0.0.1:0",
                 "--telemetry", "127.0.0.1:\u00b2"]) == 2
    err = capsys.readouterr().err
    assert err.startswith("clusterpulse-agent: error: --telemetry: telemetry address must be"), \
        err
