"""`clusterpulse-ctl`: the dashboard's actions from a terminal."""

from __future__ import annotations

import argparse
import getpass
import os
import sys
import time
from pathlib import Path

from clusterpulse.agent.audit import AuditLog
from clusterpulse.dashboard import actions, auth
from clusterpulse.dashboard.promclient import PrometheusClient, PrometheusError

EXAMPLES = """\
examples:
  clusterpulse-ctl restart --run llama-7b --graceful --reason "straggler on node-7" --wait
  clusterpulse-ctl restart --run llama-7b --hard --reason "rank 12 hung"
  clusterpulse-ctl agents --run llama-7b
  clusterpulse-ctl hash-password            # for the dashboard's operators file
environment: CLUSTERPULSE_PROMETHEUS_URL, CLUSTERPULSE_AGENT_TOKEN_FILE, CLUSTERPULSE_AUDIT_LOG
"""


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(prog="clusterpulse-ctl", description=__doc__, epilog=EXAMPLES,
                                formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--prometheus", default=os.environ.get("CLUSTERPULSE_PROMETHEUS_URL",
                                                          "http://127.0.0.1:9090"))
    p.add_argument("--token-file", type=Path,
                   default=os.environ.get("CLUSTERPULSE_AGENT_TOKEN_FILE"))
    p.add_argument("--audit-log", type=Path,
                   default=Path(os.environ.get("CLUSTERPULSE_AUDIT_LOG",
                                               "clusterpulse-audit.jsonl")))
    sub = p.add_subparsers(dest="cmd", required=True)
    r = sub.add_parser("restart", help="checkpoint-restart (graceful) or restart (hard) a run")
    r.add_argument("--run", required=True)
    mode = r.add_mutually_exclusive_group(required=True)
    mode.add_argument("--graceful", action="store_true", help="checkpoint-restart: no step lost")
    mode.add_argument("--hard", action="store_true", help="terminate ranks; resume from ckpt")
    r.add_argument("--reason", required=True)
    r.add_argument("--wait", action="store_true", help="follow until the ranks resume")
    r.add_argument("--timeout", type=float, default=300)
    a_ = sub.add_parser("agents", help="list the agents serving a run")
    a_.add_argument("--run", required=True)
    sub.add_parser("hash-password", help="print a password hash for the operators file")
    a = p.parse_args(argv)
    if a.cmd == "hash-password":
        pw = getpass.getpass("Password: ")
        if len(pw) < 8 or pw != getpass.getpass("Again: "):
            print("clusterpulse-ctl: passwords differ or are shorter than 8", file=sys.stderr)
            return 2
        print(auth.hash_password(pw))
        return 0
    prom = PrometheusClient(a.prometheus)
    try:
        if a.cmd == "agents":
            for node, url in sorted(actions.agents_for_run(prom, a.run).items()):
                print(f"{node}\t{url}")
            return 0
        token = a.token_file.read_text().strip() if a.token_file else None
        who = f"{getpass.getuser()}@cli"
        results = actions.request_action(prom, a.run, "checkpoint-restart" if a.graceful
                                         else "restart", a.reason, who, token,
                                         AuditLog(a.audit_log), source="cli")
    except (actions.ActionError, PrometheusError, OSError) as err:
        print(f"clusterpulse-ctl: error: {err}", file=sys.stderr)
        return 1
    for res in results:
        print(f"{res.node}: {'accepted ' + res.command if res.ok else 'FAILED: ' + res.error}")
    if not all(res.ok for res in results):
        return 1
    if not a.wait:
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
        time.sleep(2)
    print("clusterpulse-ctl: timed out waiting for the ranks to resume", file=sys.stderr)
    return 1


if __name__ == "__main__":
    raise SystemExit(main())
