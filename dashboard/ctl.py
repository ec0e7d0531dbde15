"""`clusterpulse-ctl`: the dashboard's actions from a terminal.

Each action is audited as `NAME@cli`, NAME being the passwd name of the process's
real uid (`uid:N` without one): the kernel's word, not $USER or $LOGNAME, which
whoever runs the command sets. The record goes to --audit-log, else
$CLUSTERPULSE_AUDIT_LOG (the dashboard's log, to list it on its Audit page), else
$XDG_STATE_HOME/clusterpulse/audit.jsonl (~/.local/state/clusterpulse/audit.jsonl)."""

from __future__ import annotations

import argparse
import getpass
import os
import pwd
import sys
import time
from collections.abc import Mapping
from pathlib import Path

from clusterpulse.agent import protocol
from clusterpulse.agent.audit import AuditLog, open_private
from clusterpulse.dashboard import actions, auth, config
from clusterpulse.dashboard.promclient import PrometheusClient, PrometheusError

EXAMPLES = """\
examples:
  export CLUSTERPULSE_PROMETHEUS_URL=http://127.0.0.1:9090   # or --prometheus URL
  # a store behind basic auth (VictoriaMetrics past one machine, docs/scaling.md):
  export CLUSTERPULSE_PROMETHEUS_PASSWORD_FILE=/etc/clusterpulse/victoria-metrics-password
  #   or --prometheus-password-file FILE [--prometheus-user NAME]
  export CLUSTERPULSE_AGENT_TOKEN_FILE=/etc/clusterpulse/token   # or --token-file FILE
  clusterpulse-ctl restart --run llama-7b --graceful --reason "straggler on node-7" --wait
  clusterpulse-ctl restart --run llama-7b --hard --reason "rank 12 hung"
  # a graceful restart in flight that is stuck: hard now (the id its refusal named)
  clusterpulse-ctl escalate --run llama-7b --command node-7-1764927000-3 --reason "hung"
  clusterpulse-ctl evict --run llama-7b --node node-7 --for 600 --reason "NIC trained down"
  clusterpulse-ctl agents --run llama-7b
  clusterpulse-ctl hash-password            # for the dashboard's operators file (asks twice)
  clusterpulse-ctl hash-password --bcrypt < alertmanager-password   # Alertmanager web.yml
environment: CLUSTERPULSE_PROMETHEUS_URL, CLUSTERPULSE_PROMETHEUS_PASSWORD_FILE,
  CLUSTERPULSE_PROMETHEUS_USER, CLUSTERPULSE_AGENT_TOKEN_FILE, CLUSTERPULSE_AUDIT_LOG
"""

RESTART_EXAMPLES = """\
examples:
  clusterpulse-ctl restart --run llama-7b --graceful --reason "straggler on node-7" --wait
  clusterpulse-ctl restart --run llama-7b --hard --reason "rank 12 hung" --wait --timeout 600
"""
ESCALATE_EXAMPLES = """\
examples:
  # the graceful restart a second request was refused for (it named the command) is stuck
  clusterpulse-ctl escalate --run llama-7b --command node-7-1764927000-3 --reason "hung"
"""
EVICT_EXAMPLES = """\
examples:
  clusterpulse-ctl evict --run llama-7b --node node-7 --reason "NIC trained down"
  clusterpulse-ctl evict --run llama-7b --node node-7 --for 1800 --reason "ECC errors"
"""
AGENTS_EXAMPLES = """\
examples:
  clusterpulse-ctl agents --run llama-7b     # NODE<TAB>agent URL, one per line
  clusterpulse-ctl --prometheus http://victoria-metrics:8428 agents --run llama-7b
"""

HASH_PASSWORD_HELP = """\
Print a password hash: an operators file entry (scrypt$N$r$p$salt$digest, the
dashboard's policy: docs/security.md), or with --bcrypt one for Alertmanager.
At a terminal it asks for the password twice; when standard input is not a terminal
it reads one line, the password (its line ending dropped), as htpasswd -i does."""
HASH_PASSWORD_EXAMPLES = """\
examples:
  clusterpulse-ctl hash-password                          # asks twice
  clusterpulse-ctl hash-password < new-operator-password  # one line, for scripts
  clusterpulse-ctl hash-password --bcrypt < alertmanager-password   # Alertmanager web.yml
"""
MIN_PASSWORD = 8
NOT_UTF8 = "the password is not UTF-8 text"


def caller() -> str:
    """Who runs this command, for the audit: the real uid's passwd name, or `uid:N`
    when it has none (a container's arbitrary uid). Never getpass.getuser(): it
    believes $LOGNAME and $USER, so `USER=alice clusterpulse-ctl ...` was alice."""
    uid = os.getuid()
    try:
        return pwd.getpwuid(uid).pw_name
    except KeyError:
        return f"uid:{uid}"


def default_audit_log() -> Path:
    """$XDG_STATE_HOME/clusterpulse/audit.jsonl, or ~/.local/state/... when it is unset
    or relative (the XDG spec says to ignore a relative one): the audit used to land
    in whatever directory the command ran in."""
    state = os.environ.get("XDG_STATE_HOME", "")
    if os.path.isabs(state):
        base = Path(state)
    else:
        try:
            base = Path.home() / ".local" / "state"
        except RuntimeError:  # no $HOME and no passwd entry (a container's uid)
            return Path("clusterpulse-audit.jsonl")  # here, as before: said in --help
    return base / "clusterpulse" / "audit.jsonl"


def writable_audit_log(path: Path) -> AuditLog:
    """The audit log, once it is known to take records: opened for append as every
    record is (created if missing), nothing written. Checked before anything is asked
    of the agents: AuditLog.write never raises (an action that happened must not be
    undone by its log), so a log it could not write kept the record in memory, and
    this process then exited with it: the action taken, its record lost.
    SettingsError, one line naming the file, when it cannot be."""
    try:
        audit = AuditLog(path)  # makes the missing directories, as each write needs
        os.close(open_private(path))
    except OSError as err:
        raise config.SettingsError(f"--audit-log: cannot write the audit log {path}: "
                                   f"{err.strerror or err}; nothing was done") from None
    return audit


def build_parser(env: Mapping[str, str] = os.environ) -> argparse.ArgumentParser:
    """The parser; `env` gives the defaults of the shared settings (the dashboard's
    variables), so that the README's examples run as written after its exports."""
    p = argparse.ArgumentParser(prog="clusterpulse-ctl", description=__doc__, epilog=EXAMPLES,
                                formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--prometheus", default=env.get("CLUSTERPULSE_PROMETHEUS_URL",
                                                   "http://127.0.0.1:9090"),
                   help="Prometheus API URL, to find the run's agents (default: "
                   "$CLUSTERPULSE_PROMETHEUS_URL, else http://127.0.0.1:9090)")
    config.add_store_auth(p, env)
    p.add_argument("--token-file", type=Path, default=env.get("CLUSTERPULSE_AGENT_TOKEN_FILE"),
                   help="the agents' control API token file, needed by restart and evict "
                   "(default: $CLUSTERPULSE_AGENT_TOKEN_FILE)")
    p.add_argument("--audit-log", type=Path,
                   default=Path(env.get("CLUSTERPULSE_AUDIT_LOG") or default_audit_log()),
                   help="JSON-lines audit log (default: $CLUSTERPULSE_AUDIT_LOG, else "
                   "$XDG_STATE_HOME/clusterpulse/audit.jsonl, i.e. "
                   "~/.local/state/clusterpulse/audit.jsonl; with no home directory, "
                   "./clusterpulse-audit.jsonl)")
    sub = p.add_subparsers(dest="cmd", required=True)
    r = sub.add_parser("restart", help="checkpoint-restart (graceful) or restart (hard) a run",
                       epilog=RESTART_EXAMPLES,
                       formatter_class=argparse.RawDescriptionHelpFormatter)
    r.add_argument("--run", required=True)
    mode = r.add_mutually_exclusive_group(required=True)
    mode.add_argument("--graceful", action="store_true", help="checkpoint-restart: no step lost")
    mode.add_argument("--hard", action="store_true", help="terminate ranks; resume from ckpt")
    r.add_argument("--reason", required=True)
    r.add_argument("--wait", action="store_true", help="follow until the ranks resume")
    r.add_argument("--timeout", type=float, default=300)
    x = sub.add_parser("escalate", help="make a graceful restart in flight a hard one now "
                       "(a second restart is refused while one is in flight)",
                       epilog=ESCALATE_EXAMPLES,
                       formatter_class=argparse.RawDescriptionHelpFormatter)
    x.add_argument("--run", required=True)
    x.add_argument("--command", required=True,
                   help="the command in flight, as the refused request named it")
    x.add_argument("--reason", required=True)
    e = sub.add_parser("evict", help="graceful restart that one node sits out (elastic jobs "
                       "under clusterpulse-train; see docs/trainer.md)",
                       epilog=EVICT_EXAMPLES,
                       formatter_class=argparse.RawDescriptionHelpFormatter)
    e.add_argument("--run", required=True)
    e.add_argument("--node", required=True, help="the node to take out of the run")
    e.add_argument("--for", dest="leave_s", type=float, default=600,
                   help="seconds it sits out before it rejoins (default: 600)")
    e.add_argument("--reason", required=True)
    a_ = sub.add_parser("agents", help="list the agents serving a run", epilog=AGENTS_EXAMPLES,
                        formatter_class=argparse.RawDescriptionHelpFormatter)
    a_.add_argument("--run", required=True)
    h = sub.add_parser("hash-password", help="print a password hash for the operators file "
                       "(or, with --bcrypt, for Alertmanager's web config)",
                       description=HASH_PASSWORD_HELP, epilog=HASH_PASSWORD_EXAMPLES,
                       formatter_class=argparse.RawDescriptionHelpFormatter)
    h.add_argument("--bcrypt", action="store_true",
                   help="a bcrypt hash for basic_auth_users in Alertmanager's web.yml "
                   "(piped, the line's surrounding whitespace is dropped, as Alertmanager's "
                   "clients drop it from the password file)")
    return p


def parse(argv: list[str] | None, env: Mapping[str, str] = os.environ) -> argparse.Namespace:
    """Arguments checked for what each command needs: a one-line usage error (exit 2)
    here, not a failure once Prometheus and the agents have been asked."""
    p = build_parser(env)
    a = p.parse_args(argv)
    if a.cmd == "evict" and not 1 <= a.leave_s <= protocol.MAX_LEAVE_S:
        p.error(f"evict --for: seconds in 1..{protocol.MAX_LEAVE_S} (longer: drain the node)")
    if a.cmd in ("restart", "evict", "escalate") and a.token_file is None:
        p.error(f"{a.cmd} needs the agents' token: --token-file FILE or "
                "CLUSTERPULSE_AGENT_TOKEN_FILE")
    return a


def read_new_password(bcrypt: bool) -> str:
    """The password to hash: at a terminal typed twice and compared; otherwise one line
    of standard input (htpasswd -i, chpasswd). Piped, getpass asked twice, the second
    read found the end of input, and the command died in an EOFError traceback (with
    no terminal at all) or waited at /dev/tty ignoring the pipe. The operators entry
    keeps the line as typed but its ending (the sign-in form keeps a password's
    spaces); --bcrypt strips it, as the clients that read Alertmanager's password file
    do. ValueError: why there is no usable password, one line."""
    if sys.stdin is not None and sys.stdin.isatty():
        try:
            pw = getpass.getpass("Password: ")
            if len(pw) >= MIN_PASSWORD and pw != getpass.getpass("Again: "):
                raise ValueError("the passwords differ")
        except (EOFError, KeyboardInterrupt):
            raise ValueError("no password given") from None
    else:
        try:
            line = sys.stdin.readline() if sys.stdin is not None else ""
        except UnicodeDecodeError:  # a strict stdin (a C locale's escapes: below)
            raise ValueError(NOT_UTF8) from None
        if not line:
            raise ValueError("no password on standard input (pipe one line, or run "
                             "hash-password at a terminal)")
        pw = line.strip() if bcrypt else line.rstrip("\r\n")
    try:
        pw.encode()  # what the hash and the sign-in form's check encode
    except UnicodeEncodeError:
        raise ValueError(NOT_UTF8) from None
    if len(pw) < MIN_PASSWORD:
        raise ValueError(f"the password is shorter than {MIN_PASSWORD} characters")
    return pw


def main(argv: list[str] | None = None) -> int:
    a = parse(argv)
    if a.cmd == "hash-password":
        try:
            pw = read_new_password(bcrypt=a.bcrypt)
        except ValueError as err:
            print(f"clusterpulse-ctl: {err}", file=sys.stderr)
            return 2
        print(auth.bcrypt_hash(pw) if a.bcrypt else auth.hash_password(pw))
        return 0
    try:
        prom = PrometheusClient(a.prometheus, auth=config.store_auth(a))
        # `agents` sends nothing to the agents: it needs no token, even one in the env
        token = config.read_required_secret(a.token_file, "--token-file") \
            if a.token_file and a.cmd != "agents" else None
        # `agents` only reads: nothing to audit, no log to check
        audit = AuditLog(None) if a.cmd == "agents" else writable_audit_log(a.audit_log)
    except config.SettingsError as err:  # a credential or the log unusable: said, not acted
        print(f"clusterpulse-ctl: error: {err}", file=sys.stderr)
        return 2
    try:
        if a.cmd == "agents":
            found = actions.run_agents(prom, a.run, None)
            for node, url in sorted(found.urls.items()):
                print(f"{node}\t{url}")
            for node, why in sorted(found.refused.items()):
                print(f"clusterpulse-ctl: {node}: {why}", file=sys.stderr)
            return 0
        who = f"{caller()}@cli"
        if a.cmd == "escalate":
            res = actions.escalate_command(prom, a.run, a.command, a.reason, who, token,
                                           audit)
            print(f"{res.node}: {'escalated ' + res.command if res.ok else 'FAILED: ' + res.error}")
            return 0 if res.ok else 1
        if a.cmd == "evict":
            results = actions.request_action(prom, a.run, "checkpoint-restart", a.reason, who,
                                             token, audit, source="cli",
                                             nodes=[a.node], leave_s=a.leave_s,
                                             audited_as="evict-node")
        else:
            results = actions.request_action(prom, a.run, "checkpoint-restart" if a.graceful
                                             else "restart", a.reason, who, token,
                                             audit, source="cli")
    except (actions.ActionError, PrometheusError, OSError) as err:
        print(f"clusterpulse-ctl: error: {err}", file=sys.stderr)
        return 1
    for res in results:
        print(f"{res.node}: {'accepted ' + res.command if res.ok else 'FAILED: ' + res.error}")
    if not all(res.ok for res in results):
        return 1
    if a.cmd == "evict" or not a.wait:  # an eviction completes only after the node is back
        return 0
    deadline = time.time() + a.timeout
    while time.time() < deadline:
        results = actions.command_states(results, token)
        states = ", ".join(f"{x.node}={x.state}" for x in results)
        print(f"  {states}", flush=True)
        if all(x.state == "completed" for x in results):
            print("all ranks resumed")
            return 0
        if any(x.state == "failed" for x in results):
            return 1
        lost = [x for x in results if x.state == actions.LOST]
        if lost:  # no later answer will say how it ended: waiting out --timeout says less
            for x in lost:
                print(f"clusterpulse-ctl: {x.node}: command {x.command} lost: {x.error}",
                      file=sys.stderr)
            return 1
        time.sleep(2)
    print("clusterpulse-ctl: timed out waiting for the ranks to resume", file=sys.stderr)
    return 1


if __name__ == "__main__":
    raise SystemExit(main())
