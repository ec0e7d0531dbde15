"""Secret files are private from the open that creates them (issue #29): another user
read 5 of 5 tokens made as the README said (`openssl rand > token; chmod 600 token`)
and 3 of the demo's 7 secret files, in the window before the chmod. Each check runs
with umask 000 and with chmod made to do nothing: a file is then 0600 only if it was
created so."""

from __future__ import annotations

import os
import re
import stat
import subprocess
import sys
from pathlib import Path

import pytest

REPO = Path(__file__).resolve().parents[2]


@pytest.fixture
def no_chmod(monkeypatch):
    """umask 000, and every chmod a no-op: only the mode given at creation counts."""
    old = os.umask(0)
    monkeypatch.setattr(os, "chmod", lambda *a, **k: None)
    monkeypatch.setattr(os, "fchmod", lambda *a, **k: None)
    monkeypatch.setattr(Path, "chmod", lambda *a, **k: None)
    yield
    os.umask(old)


def mode(path: Path) -> int:
    return stat.S_IMODE(path.stat().st_mode)


def test_write_secret_creates_0600_and_replaces_atomically(tmp_path, no_chmod):
    from clusterpulse.agent.tokens import write_secret

    path = tmp_path / "token"
    assert write_secret(path, "first")
    assert mode(path) == 0o600 and path.read_text() == "first"
    assert write_secret(path, "second") and path.read_text() == "second"
    assert mode(path) == 0o600
    assert not write_secret(path, "third", replace=False)  # kept as it is
    assert path.read_text() == "second"
    assert sorted(p.name for p in tmp_path.iterdir()) == ["token"]  # no temporary left


def test_a_secret_others_could_read_is_not_kept(tmp_path, caplog):
    """Found in review: an existing token file of mode 0644 (an older demo's, or one
    made by the README's old `chmod` recipe) was kept as it was, readable and possibly
    read: it is replaced by a new 0600 secret, with a warning."""
    from clusterpulse.agent.tokens import write_secret

    path = tmp_path / "token"
    path.write_text("oldtoken\n")
    path.chmod(0o644)
    assert write_secret(path, "fresh", replace=False)
    assert mode(path) == 0o600 and path.read_text() == "fresh"
    assert "readable by other users" in caplog.text
    assert not write_secret(path, "third", replace=False)  # a private one is kept
    assert path.read_text() == "fresh"


def test_a_secret_another_user_planted_is_not_kept(tmp_path, caplog):
    """Found in the second review: a 0600 token that another user created first in a
    shared state directory was kept and used: its content was the attacker's."""
    from clusterpulse.agent.tokens import write_secret

    if os.geteuid() != 0:
        pytest.fail("this test plays a second local user: run it as root")
    path = tmp_path / "webhook-token"
    path.write_text("attackers-token\n")
    path.chmod(0o600)
    os.chown(path, 65534, 65534)
    assert write_secret(path, "fresh", replace=False)
    assert path.stat().st_uid == os.geteuid() and path.read_text() == "fresh"
    assert "owned by uid 65534" in caplog.text


def test_the_demo_refuses_a_state_directory_others_own_or_can_write(tmp_path):
    import sys

    shared = tmp_path / "shared"
    shared.mkdir()
    for how in ("chmod", "chown"):
        if how == "chmod":
            shared.chmod(0o777)
        else:
            shared.chmod(0o700)
            os.chown(shared, 65534, 65534)
        p = subprocess.run([sys.executable, "deploy/local/cluster.py", "--state-dir",
                            str(shared), "--no-dashboard"], cwd=REPO, capture_output=True,
                           text=True, timeout=60)
        assert p.returncode == 2, p.stderr
        assert "must be yours and writable by you alone" in p.stderr
        assert "Traceback" not in p.stderr


def test_the_demos_secret_files_are_created_private(tmp_path, no_chmod):
    from deploy.local.cluster import operator_password
    from deploy.local.stack import secret_file

    assert mode(secret_file(tmp_path / "webhook-token")) == 0o600
    operator_password(tmp_path)
    assert mode(tmp_path / "operators.toml") == 0o600


def test_each_demo_client_has_its_own_token_the_agents_name(tmp_path, no_chmod):
    """The demo gave one token to the dashboard, the policy and its fault player: the
    audit log signed the faults `token`. Each client now holds its own, private; the
    agents' file names every client by its token, and a run reuses the tokens."""
    from clusterpulse.agent.tokens import Tokens
    from deploy.local.stack import CLIENTS, client_tokens

    agents, own = client_tokens(tmp_path)
    assert set(own) == set(CLIENTS) == {"dashboard", "remediation", "fault-player"}
    tokens, others_read = Tokens.load(agents)
    assert not others_read and mode(agents) == 0o600
    for client, path in own.items():
        assert mode(path) == 0o600
        assert tokens.match(path.read_text().strip()) == client
    again, own_again = client_tokens(tmp_path)
    assert {c: p.read_text() for c, p in own_again.items()} == \
        {c: p.read_text() for c, p in own.items()}
    assert again.read_text() == agents.read_text()


def test_the_readmes_token_command_creates_it_private(tmp_path):
    """Run the README's own command, as a shell would, with chmod doing nothing; also
    over an older token file others could read (found in review: `>` kept its 0644)."""
    text = (REPO / "README.md").read_text()
    command = re.search(r"`(\(umask 077; rm -f token; openssl rand -hex 32 > token\))`", text)
    assert command, "the README's token command changed: update this test"
    for old in (None, 0o644):
        if old is not None:
            (tmp_path / "token").write_text("oldtoken\n")
            (tmp_path / "token").chmod(old)
        subprocess.run(["bash", "-c", f"umask 000; chmod() {{ :; }}; {command.group(1)}"],
                       cwd=tmp_path, check=True)
        assert mode(tmp_path / "token") == 0o600
        assert len((tmp_path / "token").read_text().strip()) == 64


@pytest.mark.parametrize("command", ["agent", "remediate webhook", "remediate agents",
                                     "ctl"])
def test_a_token_file_that_is_not_text_is_one_line_naming_it(command, tmp_path, capsys):
    """Found by a review: a token file with bytes that are not UTF-8 (a binary secret,
    a file in another encoding) was a UnicodeDecodeError traceback in all three."""
    from clusterpulse.agent import cli as agent_cli
    from clusterpulse.dashboard import ctl, remediation

    bad = tmp_path / "token"
    bad.write_bytes(b"tok\xff\xfe" + b"a" * 40)
    good = tmp_path / "hook-token"
    good.write_text("alertmanager-hook-token-0123456789\n")
    run_dir = tmp_path / "run"
    run_dir.mkdir(mode=0o700)
    policy = ["--policy", str(REPO / "deploy/local/policy.toml"),
              "--audit-log", str(tmp_path / "audit.jsonl")]
    code = {
        "agent": lambda: agent_cli.main(
            ["--backend", "sim", "--listen", "127.0.0.1:0", "--token-file", str(bad),
             "--telemetry", f"unix:{run_dir}/agent.sock",
             "--audit-log", str(tmp_path / "audit.jsonl")]),
        "remediate webhook": lambda: remediation.main(
            [*policy, "--webhook-token-file", str(bad)]),
        "remediate agents": lambda: remediation.main(
            [*policy, "--webhook-token-file", str(good), "--token-file", str(bad)]),
        "ctl": lambda: ctl.main(
            ["--prometheus", "http://127.0.0.1:9", "--token-file", str(bad),
             "--audit-log", str(tmp_path / "audit.jsonl"),
             "restart", "--run", "r", "--graceful", "--reason", "x"]),
    }[command]()
    err = capsys.readouterr().err
    assert code == 2, err
    assert err.count("\n") == 1 and str(bad) in err and "utf-8" in err.lower(), err


def test_listing_agents_needs_no_token_even_an_unreadable_one(tmp_path, capsys):
    """`agents` sends nothing to the agents: a token file it cannot read (root's, named
    by $CLUSTERPULSE_AGENT_TOKEN_FILE for everyone) must not cost the listing."""
    from clusterpulse.dashboard import ctl

    assert ctl.main(["--prometheus", "http://127.0.0.1:9", "--token-file",
                     str(tmp_path / "missing"), "agents", "--run", "r"]) == 1
    err = capsys.readouterr().err
    assert "Prometheus at http://127.0.0.1:9 is unreachable" in err and "token" not in err


@pytest.mark.parametrize("text", ["", "\n", "  \n\t\n", "# put the token here\n"])
@pytest.mark.parametrize("command", ["ctl", "remediate"])
def test_a_token_file_that_holds_no_token_is_refused_at_start_naming_it(
        command, text, tmp_path, capsys):
    """Found in review: clusterpulse-remediate started ("listening ...") with an empty
    agent token file and failed at the first alert it acted on; clusterpulse-ctl blamed
    CLUSTERPULSE_AGENT_TOKEN_FILE, not the file it was given. Both refuse it, as the
    agent refuses its own ("holds no token")."""
    from deploy.local.stack import free_port

    empty = tmp_path / "token"
    empty.write_text(text)
    hook = tmp_path / "hook-token"
    hook.write_text("alertmanager-hook-token-0123456789\n")
    audit = str(tmp_path / "audit.jsonl")
    if command == "ctl":
        from clusterpulse.dashboard import ctl

        code = ctl.main(["--prometheus", "http://127.0.0.1:9", "--token-file", str(empty),
                         "--audit-log", audit, "restart", "--run", "r", "--graceful",
                         "--reason", "x"])
        err = capsys.readouterr().err
    else:  # a process: it would otherwise listen until killed
        r = subprocess.run(
            [sys.executable, "-m", "clusterpulse.dashboard.remediation", "--policy",
             str(REPO / "deploy/local/policy.toml"), "--audit-log", audit,
             "--listen", f"127.0.0.1:{free_port()}", "--webhook-token-file", str(hook),
             "--token-file", str(empty)],
            capture_output=True, text=True, timeout=60, cwd=REPO)
        code, err = r.returncode, r.stderr
    assert code == 2, err
    assert err == (f"clusterpulse-{command}: error: --token-file: the token file {empty} "
                   "holds no token\n")


def test_a_clients_secret_file_is_read_as_the_agent_reads_its_own(tmp_path):
    """A byte-order mark some editors write first is no part of the token (the agent
    drops it; in the shipped layouts one file serves the agent and the dashboard, and
    the client sent it, failing to encode); a password's "#" is no comment (a token
    file's is)."""
    from clusterpulse.dashboard.config import SettingsError, read_required_secret

    token = tmp_path / "token"
    token.write_bytes("\ufeffdash-token-0123456789\n".encode())
    assert read_required_secret(token, "--token-file") == "dash-token-0123456789"
    password = tmp_path / "password"
    password.write_text("#not-a-comment\n")
    assert read_required_secret(password, "--x", "password") == "#not-a-comment"
    with pytest.raises(SettingsError, match="holds no token"):
        read_required_secret(password, "--token-file")
