"""The operators file: a file that cannot be used is an error naming it (and the line,
where TOML says), at start, in the log and on the sign-in page, never an empty list of
operators; an entry that cannot be used is skipped naming its line and why, and the
others still sign in.

Found in review: load_operators returned what Streamlit secrets held when the file
could not be read or parsed, and nothing said so: a typo left a dashboard nobody could
sign in to, answering "Wrong operator name or password", with nothing in the journal."""

from __future__ import annotations

import hashlib
import logging
from pathlib import Path

import pytest

from clusterpulse.dashboard import auth, cli

REPO = Path(__file__).resolve().parents[2]
GOOD = auth.hash_password("correct horse")
WEAK = "pbkdf2_sha256$1$00$" + hashlib.pbkdf2_hmac("sha256", b"pw", b"\0", 1).hex()
# line 1 blank; alice on 3; bob's value is his password (not a hash) on 4; carol.smith
# unquoted makes a table on 5; dave's hash is below the policy on 6
MIXED = f"""
[operators]
alice = "{GOOD}"
bob = "hunter2-plain"
carol.smith = "{GOOD}"
dave = "{WEAK}"
"""


def write(tmp_path: Path, text: str) -> Path:
    path = tmp_path / "operators.toml"
    path.write_text(text)
    return path


def test_an_unreadable_file_is_named_not_an_empty_list(tmp_path):
    missing = tmp_path / "operators.toml"
    ops = auth.load_operators(missing, {"root": GOOD})
    assert ops.broken and str(missing) in ops.broken and "cannot read" in ops.broken
    assert ops.hashes == {"root": GOOD}  # the secrets' operators still sign in


def test_a_toml_error_names_the_file_and_its_line(tmp_path):
    path = write(tmp_path, f'[operators]\nalice = "{GOOD}"\nbob = "scrypt$unclosed\n')
    ops = auth.load_operators(path, None)
    assert ops.hashes == {}
    assert ops.broken and str(path) in ops.broken and "line 3" in ops.broken, ops.broken


@pytest.mark.parametrize(("text", "problem"), [
    ('[operator]\nalice = "x"\n', "did you mean operators?"),
    ('operators = "alice"\n', "[operators] must be a table"),
    ('[operators]\nbob = "hunter2-plain"\n', "line 2: operator 'bob' skipped"),
])
def test_a_file_with_no_usable_operator_is_broken_saying_why(tmp_path, text, problem):
    """A misspelt table or a value where the table belongs left no operator, silently
    (the second with an AttributeError traceback)."""
    path = write(tmp_path, text)
    ops = auth.load_operators(path, None)
    assert ops.hashes == {} and ops.broken and str(path) in ops.broken
    assert problem in " ".join(ops.problems) + ops.broken, (ops.problems, ops.broken)
    assert "hunter2" not in " ".join(ops.problems) + ops.broken  # a value is never shown


def test_a_bad_entry_is_skipped_naming_its_line_and_the_others_sign_in(tmp_path):
    path = write(tmp_path, MIXED)
    ops = auth.load_operators(path, None)
    assert ops.broken is None
    assert sorted(ops.hashes) == ["alice", "dave"]  # dave: told to re-create his hash
    assert auth.authenticate("alice", "correct horse", ops.hashes, auth.Throttle()).ok
    text = "\n".join(ops.problems)
    assert f"{path} line 4: operator 'bob' skipped: not a password hash" in text, text
    assert f"{path} line 5: operator 'carol' skipped: a table, not a hash" in text, text
    assert f"{path} line 6: operator 'dave': hash weaker than the policy" in text, text
    assert "hunter2" not in text and GOOD not in text
    assert len(ops.skipped) == 2


def test_each_skipped_entry_is_named_by_its_own_line(tmp_path):
    """A quoted name may hold a dot; a bare dotted one is a table under its first part;
    [operators.NAME] is a table too."""
    path = write(tmp_path, f'[operators]\n"erin.x" = 1\nerin.y = 2\nok = "{GOOD}"\n'
                           '[operators.frank]\nhash = "x"\n')
    ops = auth.load_operators(path, None)
    assert [p.partition(": operator ")[0].rpartition(" ")[2] for p in ops.skipped] == [
        "2", "3", "5"], ops.skipped
    assert sorted(ops.hashes) == ["ok"]


def test_an_empty_file_is_no_operators_and_no_error(tmp_path):
    """An OIDC deployment under the shipped systemd unit still needs the file to exist
    (LoadCredential=), and may leave it empty."""
    for text in ("", "# no password operators: OIDC\n", "[operators]\n"):
        ops = auth.load_operators(write(tmp_path, text), None)
        assert (ops.hashes, ops.problems, ops.broken) == ({}, (), None)


def test_a_bad_secrets_entry_is_skipped_naming_it():
    ops = auth.load_operators(None, {"alice": GOOD, "bob": "hunter2-plain", "eve": 7})
    assert sorted(ops.hashes) == ["alice"] and ops.broken is None
    text = "\n".join(ops.problems)
    assert "Streamlit secrets [operators]: operator 'bob' skipped" in text, text
    assert "operator 'eve' skipped: a number, not a hash" in text, text


class Exec(Exception):
    """os.execv called: the dashboard would have started."""


@pytest.fixture
def no_exec(monkeypatch):
    def execv(path, args):
        raise Exec(args)

    monkeypatch.setattr(cli.os, "execv", execv)
    for name in ("CLUSTERPULSE_OPERATORS_FILE", "CLUSTERPULSE_AUDIT_LOG",
                 "CLUSTERPULSE_PROMETHEUS_PASSWORD_FILE"):
        monkeypatch.delenv(name, raising=False)


def test_the_dashboard_refuses_to_start_with_an_unusable_operators_file(
        tmp_path, no_exec, capsys):
    """At start, where systemctl status and the journal show it, and before any
    operator finds a sign-in that cannot succeed."""
    path = write(tmp_path, '[operator]\nalice = "x"\n')
    assert cli.main(["--operators-file", str(path)]) == 2
    *warnings, error = capsys.readouterr().err.splitlines()  # last: what status shows
    assert error.startswith(f"clusterpulse-dashboard: error: operators file {path}"), error
    assert "not starting" in error
    assert [w for w in warnings if "did you mean operators?" in w], warnings
    broken_toml = write(tmp_path, '[operators]\nalice = "x\n')
    assert cli.main(["--operators-file", str(broken_toml)]) == 2
    (error,) = capsys.readouterr().err.splitlines()
    assert "line 2" in error and "not starting" in error, error


@pytest.mark.parametrize("option", ["--prometheus-password-file",
                                    "--alertmanager-password-file"])
def test_the_dashboard_refuses_to_start_with_a_password_file_it_cannot_read(
        tmp_path, no_exec, capsys, option):
    """One line naming the file, at start: it used to start and send no credentials,
    and every page said 401."""
    missing = tmp_path / "no-such-password"
    assert cli.main([option, str(missing)]) == 2
    assert capsys.readouterr().err == (f"clusterpulse-dashboard: error: {option}: cannot "
                                       f"read the password file {missing}: No such file "
                                       "or directory\n")


def test_the_dashboard_starts_saying_which_entries_it_skips(tmp_path, no_exec, capsys):
    path = write(tmp_path, MIXED)
    with pytest.raises(Exec):
        cli.main(["--operators-file", str(path)])
    err = capsys.readouterr().err.splitlines()
    assert [line.partition(" line ")[0] for line in err] == [
        f"clusterpulse-dashboard: warning: operators file {path}"] * 3
    assert any("line 4: operator 'bob' skipped" in line for line in err), err


def audit_page(tmp_path: Path, monkeypatch, operators: Path):
    from streamlit.testing.v1 import AppTest

    monkeypatch.setenv("CLUSTERPULSE_AUDIT_LOG", str(tmp_path / "audit.jsonl"))
    monkeypatch.setenv("CLUSTERPULSE_OPERATORS_FILE", str(operators))
    monkeypatch.setattr(auth, "THROTTLE", auth.Throttle(per_client=100))
    monkeypatch.setattr(auth, "REFUSALS", auth.RefusalSummary())
    monkeypatch.setattr(auth, "REPORTED", auth.ProblemReport())
    at = AppTest.from_file(str(REPO / "dashboard" / "views" / "audit.py"), default_timeout=60)
    at.run()
    assert not at.exception, at.exception
    return at


def test_the_sign_in_box_says_sign_in_is_unavailable_and_why(tmp_path, monkeypatch, caplog):
    """Not a sign-in form that answers "Wrong operator name or password" to the right
    one; the journal says it once, not at every page run."""
    path = write(tmp_path, f'[operators]\nalice = "{GOOD}"\nbob = "x\n')
    caplog.set_level(logging.WARNING, logger="clusterpulse.dashboard.auth")
    at = audit_page(tmp_path, monkeypatch, path)
    (shown,) = [e.value for e in at.sidebar.error]
    assert shown.startswith("Sign-in is unavailable: operators file"), shown
    assert str(path) in shown and "line 3" in shown, shown
    assert not [t for t in at.sidebar.text_input if t.key == "login_password"]
    at.run()
    logged = [r for r in caplog.records if r.name == "clusterpulse.dashboard.auth"]
    assert [(r.levelno, str(path) in r.getMessage()) for r in logged] == [
        (logging.ERROR, True)]


def test_a_refused_sign_in_says_entries_were_skipped(tmp_path, monkeypatch, caplog):
    """bob's entry was skipped: his right password is refused, and the answer says the
    file has unusable entries (not whose: no operator names to viewers); the journal
    names the line."""
    caplog.set_level(logging.WARNING, logger="clusterpulse.dashboard.auth")
    at = audit_page(tmp_path, monkeypatch, write(tmp_path, MIXED))
    at.text_input(key="login_name").input("bob")
    at.text_input(key="login_password").input("hunter2-plain")
    at.sidebar.button[0].click().run()
    (shown,) = [e.value for e in at.sidebar.error]
    assert shown.startswith("Wrong operator name or password."), shown
    assert "2 operator entries could not be used" in shown, shown
    assert "bob" not in shown and "carol" not in shown
    logged = " ".join(r.getMessage() for r in caplog.records)
    assert "line 4: operator 'bob' skipped" in logged, logged
    at.text_input(key="login_name").input("alice")
    at.text_input(key="login_password").input("correct horse")
    at.sidebar.button[0].click().run()
    assert at.session_state["operator"] == "alice"


@pytest.mark.parametrize("option", ["--prometheus-password-file",
                                    "--alertmanager-password-file"])
def test_the_dashboard_refuses_to_start_with_a_password_file_that_holds_none(
        tmp_path, no_exec, capsys, option):
    """An empty (or blank-lined) password file started a dashboard that sent no
    credentials: refused as an unreadable one is."""
    empty = tmp_path / "password"
    empty.write_text("\n")
    assert cli.main([option, str(empty)]) == 2
    assert capsys.readouterr().err == (f"clusterpulse-dashboard: error: {option}: the "
                                       f"password file {empty} holds no password\n")


@pytest.mark.parametrize("name, why", [("missing", "cannot read the token file {}: No such "
                                        "file or directory"),
                                       ("dir", "cannot read the token file {}: Is a directory"),
                                       ("empty", "the token file {} holds no token")])
def test_the_dashboard_refuses_to_start_with_a_token_file_ctl_would_refuse(
        tmp_path, no_exec, capsys, name, why):
    """Found in review: the dashboard started with a --token-file that did not exist
    (or was a directory), which clusterpulse-ctl refuses; every action an operator then
    asked for failed. The same check, at start, in the same words."""
    path = tmp_path / name
    if name == "dir":
        path.mkdir()
    elif name == "empty":
        path.write_text(" \n")
    assert cli.main(["--token-file", str(path)]) == 2
    assert capsys.readouterr().err == ("clusterpulse-dashboard: error: --token-file: "
                                       f"{why.format(path)}\n")


@pytest.mark.parametrize("port", ["99999", "65536", "0", "-1"])
def test_the_dashboard_refuses_a_port_no_server_can_listen_on(no_exec, capsys, port):
    """--port 99999 reached Streamlit, which died in a traceback (OverflowError:
    bind(): port must be 0-65535)."""
    with pytest.raises(SystemExit) as exit_:
        cli.main(["--port", port])
    assert exit_.value.code == 2
    err = capsys.readouterr().err
    assert f"--port: expected a port from 1 to 65535, not {port}" in err, err
    assert "Traceback" not in err
