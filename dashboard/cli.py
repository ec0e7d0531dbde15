"""`clusterpulse-dashboard`: start the Streamlit dashboard with its settings."""

from __future__ import annotations

import argparse
import importlib.util
import os
import sys
from pathlib import Path

from clusterpulse.dashboard import auth, config

EXAMPLES = """\
examples:
  clusterpulse-dashboard --prometheus http://127.0.0.1:9090 --alertmanager http://127.0.0.1:9093
  clusterpulse-dashboard --port 8501 --operators-file /etc/clusterpulse/operators.toml \\
      --token-file /etc/clusterpulse/token --audit-log /var/log/clusterpulse/audit.jsonl
  clusterpulse-dashboard --address 127.0.0.1 --trusted-proxy 127.0.0.1   # behind nginx
  clusterpulse-dashboard --prometheus http://victoria-metrics:8428 \\
      --prometheus-password-file /etc/clusterpulse/victoria-metrics-password
"""


def operators_usable(path: Path) -> bool:
    """Whether the dashboard can start with this operators file. Each entry it skips
    (or keeps below the hash policy) is a warning on stderr, the journal under
    systemd, and the others still sign in; a file that cannot be read or parsed, or
    has no usable entry, is an error and no start: it gave a dashboard nobody could
    sign in to, which said "wrong password" and nothing in the journal. The pages
    check it again as they read it (an edit needs no restart): auth.load_operators."""
    ops = auth.load_operators(path, None)
    for problem in ops.problems:
        print(f"clusterpulse-dashboard: warning: {problem}", file=sys.stderr)
    if ops.broken:
        print(f"clusterpulse-dashboard: error: {ops.broken}; not starting: no operator "
              "could sign in (fix it, or start without --operators-file)", file=sys.stderr)
        return False
    return True


def streamlit_command(app: Path, address: str, port: int) -> list[str]:
    """The Streamlit server the dashboard runs as (also the bare page its timing is
    compared with in tests/e2e: the same server, only the app differs)."""
    return [sys.executable, "-m", "streamlit", "run", str(app),
            f"--server.address={address}", f"--server.port={port}",
            "--server.headless=true", "--browser.gatherUsageStats=false",
            "--server.fileWatcherType=none",
            # no full garbage collection after every page run and every refresh: it held
            # the one Python process 0.1-0.8 s each time (110,000 objects, 2 busy cores),
            # just when the browser asks it for the scripts to draw what the run sent;
            # Python's own collector still runs
            "--runner.postScriptGC=false"]


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(prog="clusterpulse-dashboard", description=__doc__,
                                epilog=EXAMPLES,
                                formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--prometheus", default="http://127.0.0.1:9090",
                   help="Prometheus-compatible API URL")
    config.add_store_auth(p)
    p.add_argument("--alertmanager", default="http://127.0.0.1:9093")
    p.add_argument("--alertmanager-password-file", type=Path,
                   help="password for Alertmanager's basic auth (its web config), as user "
                   "--alertmanager-user")
    p.add_argument("--alertmanager-user", default="clusterpulse")
    p.add_argument("--address", default="127.0.0.1", help="listen address (default: localhost)")
    p.add_argument("--port", type=int, default=8501, help="listen port, 1-65535 (default: 8501)")
    p.add_argument("--token-file", type=Path, help="agents' control API token (for actions)")
    p.add_argument("--operators-file", type=Path, help="TOML [operators] name = hash")
    p.add_argument("--audit-log", type=Path, default=Path("clusterpulse-audit.jsonl"))
    p.add_argument("--refresh", type=float, default=5, help="seconds between refreshes")
    p.add_argument("--trusted-proxy", default="", metavar="ADDR[,ADDR]",
                   help="reverse proxies whose X-Forwarded-For names the client (sign-in "
                   "throttling is per client address); default: none, not even loopback, "
                   "so a local user cannot pose as many clients")
    a = p.parse_args(argv)
    if problem := config.refresh_problem(a.refresh):
        p.error(f"--refresh: {problem}, not {a.refresh:g}")
    if not 1 <= a.port <= 65535:  # Streamlit's bind() said so only in a traceback
        p.error(f"--port: expected a port from 1 to 65535, not {a.port}")
    if a.operators_file and not operators_usable(a.operators_file):
        return 2
    try:  # a password file that cannot be read: said now, not as 401 on every page
        config.store_auth(a)
        if a.token_file:  # as clusterpulse-ctl: now, not when an operator acts
            config.read_required_secret(a.token_file, "--token-file")
        config.basic_auth(a.alertmanager_user, a.alertmanager_password_file,
                          "--alertmanager-password-file")
    except config.SettingsError as err:
        print(f"clusterpulse-dashboard: error: {err}", file=sys.stderr)
        return 2
    env = {"CLUSTERPULSE_PROMETHEUS_URL": a.prometheus,
           "CLUSTERPULSE_ALERTMANAGER_URL": a.alertmanager,
           "CLUSTERPULSE_AUDIT_LOG": str(a.audit_log.resolve()),
           "CLUSTERPULSE_REFRESH_S": str(a.refresh),
           # uvicorn (Streamlit's server) trusts X-Forwarded-For from loopback unless told
           "FORWARDED_ALLOW_IPS": a.trusted_proxy}
    if a.token_file:
        env["CLUSTERPULSE_AGENT_TOKEN_FILE"] = str(a.token_file.resolve())
    if a.operators_file:
        env["CLUSTERPULSE_OPERATORS_FILE"] = str(a.operators_file.resolve())
    if a.prometheus_password_file:
        env["CLUSTERPULSE_PROMETHEUS_PASSWORD_FILE"] = str(a.prometheus_password_file.resolve())
        env["CLUSTERPULSE_PROMETHEUS_USER"] = a.prometheus_user
    if a.alertmanager_password_file:
        env["CLUSTERPULSE_ALERTMANAGER_PASSWORD_FILE"] = str(
            a.alertmanager_password_file.resolve())
        env["CLUSTERPULSE_ALERTMANAGER_USER"] = a.alertmanager_user
    os.environ.update(env)
    if importlib.util.find_spec("streamlit") is None:  # before exec: clusterpulse.entry
        raise ModuleNotFoundError("No module named 'streamlit'", name="streamlit")
    app = Path(__file__).with_name("app.py")
    args = streamlit_command(app, a.address, a.port)
    os.execv(sys.executable, args)
    return 0  # not reached


if __name__ == "__main__":
    raise SystemExit(main())
