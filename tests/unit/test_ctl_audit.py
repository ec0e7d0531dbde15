"""clusterpulse-ctl's audit records: who acted comes from the kernel (the real uid's
passwd name), never from the environment, and without CLUSTERPULSE_AUDIT_LOG or
--audit-log the record goes to the user's state directory, not the current one.

No Prometheus or agent: the run's agent is a closed port, so the request fails, and
the failure is audited like any outcome."""

from __future__ import annotations

import json
import os
import pwd
from pathlib import Path

import pytest

from clusterpulse.dashboard import actions, ctl


@pytest.fixture
def isolated(tmp_path, monkeypatch) -> Path:
    """A home, a state directory and a working directory of the test's own; the run
    `job` has one agent, on a port nothing listens on."""
    for var in ("CLUSTERPULSE_AUDIT_LOG", "XDG_STATE_HOME"):
        monkeypatch.delenv(var, raising=False)
    monkeypatch.setenv("HOME", str(tmp_path / "home"))
    (tmp_path / "cwd").mkdir()
    monkeypatch.chdir(tmp_path / "cwd")
    monkeypatch.setattr(actions, "run_agents", lambda prom, run, token, lookback="":
                        actions.RunAgents({"node-a": "http://127.0.0.1:9"}, {}))
    (tmp_path / "token").write_text("agent-token-0123456789\n")
    return tmp_path


def restart(tmp_path: Path, *extra: str) -> int:
    return ctl.main(["--prometheus", "http://127.0.0.1:9", "--token-file",
                     str(tmp_path / "token"), *extra, "restart", "--run", "job", "--hard",
                     "--reason", "rank 3 hung"])


def records(path: Path) -> list[dict]:
    return [json.loads(line) for line in path.read_text().splitlines()]


def test_who_is_the_real_uid_not_user_or_logname(isolated, monkeypatch):
    """Found in review: `USER=alice clusterpulse-ctl restart ...` was audited as
    alice@cli (getpass.getuser() reads $LOGNAME, $USER, ... first)."""
    monkeypatch.setenv("USER", "alice")
    monkeypatch.setenv("LOGNAME", "alice")
    monkeypatch.setenv("LNAME", "alice")
    monkeypatch.setenv("USERNAME", "alice")
    log = isolated / "audit.jsonl"
    assert restart(isolated, "--audit-log", str(log)) == 1  # the agent is unreachable
    (record,) = records(log)
    assert record["who"] == f"{pwd.getpwuid(os.getuid()).pw_name}@cli" != "alice@cli"
    assert (record["action"], record["why"], record["source"]) == ("restart", "rank 3 hung",
                                                                   "cli")


def test_a_uid_without_a_passwd_entry_is_named_by_number(isolated, monkeypatch):
    """A container's arbitrary uid has no passwd entry: the record says uid:N (and
    still not what $USER says)."""
    def no_entry(uid: int) -> pwd.struct_passwd:
        raise KeyError(f"getpwuid(): uid not found: {uid}")

    monkeypatch.setattr(pwd, "getpwuid", no_entry)
    monkeypatch.setenv("USER", "alice")
    log = isolated / "audit.jsonl"
    assert restart(isolated, "--audit-log", str(log)) == 1
    assert [r["who"] for r in records(log)] == [f"uid:{os.getuid()}@cli"]


def test_the_default_audit_log_is_in_the_state_directory(isolated, monkeypatch):
    """Without CLUSTERPULSE_AUDIT_LOG the CLI audited into whatever directory it ran
    in; now $XDG_STATE_HOME/clusterpulse/audit.jsonl, else ~/.local/state/...
    (a relative XDG_STATE_HOME is ignored, as the XDG spec says)."""
    assert restart(isolated) == 1
    home_log = isolated / "home/.local/state/clusterpulse/audit.jsonl"
    assert [r["why"] for r in records(home_log)] == ["rank 3 hung"]
    monkeypatch.setenv("XDG_STATE_HOME", "relative/state")
    assert restart(isolated) == 1
    assert len(records(home_log)) == 2
    monkeypatch.setenv("XDG_STATE_HOME", str(isolated / "state"))
    assert restart(isolated) == 1
    assert len(records(isolated / "state/clusterpulse/audit.jsonl")) == 1
    monkeypatch.setenv("CLUSTERPULSE_AUDIT_LOG", str(isolated / "shared.jsonl"))
    assert restart(isolated) == 1
    assert len(records(isolated / "shared.jsonl")) == 1
    assert list((isolated / "cwd").iterdir()) == []  # nothing in the working directory


def test_a_store_password_file_that_cannot_be_read_is_an_error_naming_it(
        isolated, monkeypatch, capsys):
    """The store's password file as the dashboard takes it (CLUSTERPULSE_PROMETHEUS_
    PASSWORD_FILE, or --prometheus-password-file): ctl ignored the variable and had no
    option, so a store behind basic auth answered 401. One that cannot be read is one
    line naming it, before anything is asked of the store or an agent."""
    missing = isolated / "no-such-password"
    monkeypatch.setenv("CLUSTERPULSE_PROMETHEUS_PASSWORD_FILE", str(missing))
    assert ctl.main(["agents", "--run", "job"]) == 2
    assert capsys.readouterr() == ("", "clusterpulse-ctl: error: --prometheus-password-file: "
                                   f"cannot read the password file {missing}: No such file "
                                   "or directory\n")
    monkeypatch.delenv("CLUSTERPULSE_PROMETHEUS_PASSWORD_FILE")
    assert restart(isolated, "--prometheus-password-file", str(isolated / "cwd")) == 2
    assert capsys.readouterr().err.endswith(f"{isolated / 'cwd'}: Is a directory\n")
    assert not (isolated / "home").exists()  # nothing requested, so nothing audited


@pytest.mark.parametrize("command", [["restart", "--run", "job", "--graceful"],
                                     ["evict", "--run", "job", "--node", "node-a"],
                                     ["escalate", "--run", "job", "--command", "node-a-1-1"]])
def test_an_audit_log_it_cannot_write_is_refused_before_anything_is_asked(
        isolated, monkeypatch, capsys, command):
    """Found in review: with --audit-log a directory, restart was accepted by the
    agents, and then `1 record(s) kept in memory until it can` as ctl exited with the
    record: an action taken and no audit of it. The log is checked first."""
    asked: list[str] = []
    monkeypatch.setattr(actions, "run_agents", lambda prom, run, token, lookback="": (
        asked.append(run), actions.RunAgents({"node-a": "http://127.0.0.1:9"}, {}))[1])
    for log, why in ((isolated / "cwd", "Is a directory"),
                     (isolated / "token" / "audit.jsonl", "File exists")):
        assert ctl.main(["--prometheus", "http://127.0.0.1:9", "--token-file",
                         str(isolated / "token"), "--audit-log", str(log), *command,
                         "--reason", "x"]) == 2
        assert capsys.readouterr() == ("", "clusterpulse-ctl: error: --audit-log: cannot "
                                       f"write the audit log {log}: {why}; nothing was done\n")
    assert asked == []


def test_the_audit_check_writes_no_record(isolated):
    """The check opens the log as a record's write does, creating it (0600) if missing,
    and writes nothing: the one record is the request's."""
    log = isolated / "state" / "audit.jsonl"
    assert restart(isolated, "--audit-log", str(log)) == 1  # the agent is unreachable
    assert [r["action"] for r in records(log)] == ["restart"]
    assert log.stat().st_mode & 0o777 == 0o600


@pytest.mark.parametrize("text", ["", "\n", " \n\n"])
def test_a_store_password_file_that_holds_no_password_is_an_error_naming_it(
        isolated, capsys, text):
    """Found in review: an empty password file sent no credentials at all, silently
    (the store then answers 401, or, open, is asked without the auth it was meant to
    get). Refused as an unreadable one is, before the store or an agent is asked."""
    empty = isolated / "password"
    empty.write_text(text)
    assert restart(isolated, "--prometheus-password-file", str(empty)) == 2
    assert capsys.readouterr() == ("", "clusterpulse-ctl: error: --prometheus-password-file: "
                                   f"the password file {empty} holds no password\n")
    assert not (isolated / "home").exists()  # nothing requested, so nothing audited
