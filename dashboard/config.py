"""Dashboard settings, from the environment (so one container image serves any
cluster). Credentials never come from here: see dashboard/auth.py."""

from __future__ import annotations

import argparse
import math
import os
from collections.abc import Mapping
from dataclasses import dataclass
from pathlib import Path

from clusterpulse.agent.tokens import without_comment


class SettingsError(ValueError):
    """A setting the dashboard cannot run with; the message names the variable."""


@dataclass(frozen=True)
class Settings:
    prometheus_url: str
    alertmanager_url: str
    agent_token_file: Path | None
    audit_log: Path
    refresh_s: float
    operators_file: Path | None
    alertmanager_user: str = "clusterpulse"
    alertmanager_password_file: Path | None = None
    # The store's basic auth: VictoriaMetrics past one machine asks for it
    # (docs/scaling.md); Prometheus as shipped needs none.
    prometheus_user: str = "clusterpulse"
    prometheus_password_file: Path | None = None

    def alertmanager_auth(self) -> tuple[str, str] | None:
        """Basic-auth credentials for Alertmanager's API, read per use (rotation needs
        no restart); None without a password file. SettingsError when the file cannot
        be read: silently sent without credentials, every page said 401."""
        return basic_auth(self.alertmanager_user, self.alertmanager_password_file,
                          "CLUSTERPULSE_ALERTMANAGER_PASSWORD_FILE")

    def prometheus_auth(self) -> tuple[str, str] | None:
        """Basic-auth credentials for the Prometheus API (the store), read per use like
        Alertmanager's; None without a password file; SettingsError as above."""
        return basic_auth(self.prometheus_user, self.prometheus_password_file,
                          "CLUSTERPULSE_PROMETHEUS_PASSWORD_FILE")
    # where docs/ is published (a runbook link is this + "/runbooks.md#<alert>"); empty:
    # the Alerts page shows the runbook's text from the installed docs instead
    docs_url: str = ""

    def agent_token(self) -> str | None:
        if self.agent_token_file is None:
            return None
        # unreadable or empty: SettingsError naming the file (an action refused by every
        # agent for a missing token did not say why)
        return read_required_secret(self.agent_token_file, "CLUSTERPULSE_AGENT_TOKEN_FILE")


def from_env(env: dict[str, str] | None = None) -> Settings:
    e = os.environ if env is None else env
    token = e.get("CLUSTERPULSE_AGENT_TOKEN_FILE")
    operators = e.get("CLUSTERPULSE_OPERATORS_FILE")
    am_password = e.get("CLUSTERPULSE_ALERTMANAGER_PASSWORD_FILE")
    prom_password = e.get("CLUSTERPULSE_PROMETHEUS_PASSWORD_FILE")
    return Settings(
        prometheus_url=e.get("CLUSTERPULSE_PROMETHEUS_URL", "http://127.0.0.1:9090"),
        alertmanager_url=e.get("CLUSTERPULSE_ALERTMANAGER_URL", "http://127.0.0.1:9093"),
        agent_token_file=Path(token) if token else None,
        audit_log=_audit_path(e.get("CLUSTERPULSE_AUDIT_LOG", "clusterpulse-audit.jsonl")),
        refresh_s=_seconds(e, "CLUSTERPULSE_REFRESH_S", "5"),
        operators_file=Path(operators) if operators else None,
        alertmanager_user=e.get("CLUSTERPULSE_ALERTMANAGER_USER", "clusterpulse"),
        alertmanager_password_file=Path(am_password) if am_password else None,
        prometheus_user=e.get("CLUSTERPULSE_PROMETHEUS_USER", "clusterpulse"),
        prometheus_password_file=Path(prom_password) if prom_password else None,
        docs_url=e.get("CLUSTERPULSE_DOCS_URL", "").rstrip("/"),
    )


def basic_auth(user: str, password_file: Path | None,
               setting: str = "--prometheus-password-file") -> tuple[str, str] | None:
    """(user, the file's password), or None without a file. SettingsError, one line
    naming the file, when it cannot be read or holds no password: sent without
    credentials, a store or Alertmanager behind basic auth answers 401 to everything
    and nothing said the file was the cause (`setting` says where it was given)."""
    if password_file is None:
        return None
    return user, read_required_secret(password_file, setting, "password")


def read_secret_file(path: Path, setting: str, what: str = "token") -> str:
    """The secret in `path`, stripped (empty: none). SettingsError, one line naming the
    setting and the file, when it cannot be read or is not UTF-8 text. A byte-order
    mark that some editors write first is no part of it (as the agent reads its token
    file: one file serves both in the shipped layouts)."""
    try:
        return path.read_text(encoding="utf-8-sig").strip()
    except (OSError, UnicodeDecodeError) as err:
        why = err.strerror if isinstance(err, OSError) and err.strerror else str(err)
        raise SettingsError(f"{setting}: cannot read the {what} file {path}: {why}") from None


def read_required_secret(path: Path, setting: str, what: str = "token") -> str:
    """The secret in `path`, as read_secret_file reads it; SettingsError also when the
    file holds none (empty, or only whitespace): a credential named and then silently
    not sent is refused where it was named, not found missing at the first request
    (the agent says the same of its own token file: "holds no token")."""
    secret = read_secret_file(path, setting, what)
    # a token file's comments only ("# put the token here") hold none either (its
    # lines are read without comments, actions.token_for); a password may hold a "#"
    if what == "token":
        secret_lines = [without_comment(ln) for ln in secret.splitlines()]
    else:
        secret_lines = [secret]
    if not any(secret_lines):
        raise SettingsError(f"{setting}: the {what} file {path} holds no {what}")
    return secret


def add_store_auth(p: argparse.ArgumentParser, env: Mapping[str, str] = os.environ) -> None:
    """--prometheus-password-file and --prometheus-user, for every command that reads
    the store (the dashboard, clusterpulse-ctl, clusterpulse-remediate): VictoriaMetrics
    past one machine asks for basic auth (docs/scaling.md). Defaults from the
    dashboard's variables, so one environment serves them all."""
    p.add_argument("--prometheus-password-file", type=Path, metavar="FILE",
                   default=env.get("CLUSTERPULSE_PROMETHEUS_PASSWORD_FILE") or None,
                   help="password for the store's basic auth (VictoriaMetrics past one "
                   "machine, docs/scaling.md), as user --prometheus-user (default: "
                   "$CLUSTERPULSE_PROMETHEUS_PASSWORD_FILE; none: no auth)")
    p.add_argument("--prometheus-user", metavar="NAME",
                   default=env.get("CLUSTERPULSE_PROMETHEUS_USER") or "clusterpulse",
                   help="the store's basic-auth user (default: "
                   "$CLUSTERPULSE_PROMETHEUS_USER, else clusterpulse)")


def store_auth(a: argparse.Namespace) -> tuple[str, str] | None:
    """The store's credentials from add_store_auth's options (SettingsError: the
    password file cannot be read)."""
    return basic_auth(a.prometheus_user, a.prometheus_password_file)


def _audit_path(text: str) -> Path:
    """The audit log's path, refused where no file can be: a directory, or under a file
    (IsADirectoryError on the Audit and Run pages, and FileExistsError on every sign-in,
    right or wrong, which then went unaudited)."""
    path = Path(text)
    try:
        if path.is_dir():
            raise SettingsError(f"CLUSTERPULSE_AUDIT_LOG={text!r} is a directory; name a file")
        parent = next((p for p in path.absolute().parents if p.exists()), None)
    except OSError as err:  # a directory on the way this user cannot enter (3.11 raises)
        raise SettingsError(f"CLUSTERPULSE_AUDIT_LOG={text!r}: {err.strerror or err}") \
            from None
    if parent is not None and not parent.is_dir():
        raise SettingsError(f"CLUSTERPULSE_AUDIT_LOG={text!r}: {parent} is not a directory")
    return path


# The live views' refresh, seconds: 0 or inf stood every view still; under a second a
# browser reran its fragments as fast as it could (1e-9) for data cached 5 s, and past
# 2^31 ms a browser's setInterval fires at once.
REFRESH_S = (1.0, 86400.0)


def refresh_problem(value: float) -> str | None:
    """Why `value` cannot be the refresh (None: it can)."""
    low, high = REFRESH_S
    if math.isfinite(value) and low <= value <= high:
        return None
    return f"expected a number of seconds from {low:g} to {high:g}"


def _seconds(env: dict[str, str] | os._Environ[str], name: str, default: str) -> float:
    """The refresh from `name` (REFRESH_S)."""
    text = env.get(name, default)
    try:
        value = float(text)
    except ValueError:
        value = math.nan
    if problem := refresh_problem(value):
        raise SettingsError(f"{name}={text!r}: {problem} (default {default})")
    return value
