"""Automatic remediation: an Alertmanager webhook receiver that applies a policy.

The policy file (TOML) says which alert triggers which action:

    dry_run = false            # decide and audit, but do not act
    max_actions_per_run = 1    # rate limit: at most this many actions per run ...
    window_s = 900             # ... per this many seconds (no restart storms)

    [[rule]]
    alert = "RankHung"
    action = "restart"
    [[rule]]
    alert = "TrainingStraggler"
    action = "checkpoint-restart"
    sustained_s = 120          # only once the alert has fired this long

Alerts without a `run` label (a lost GPU) act on the runs with ranks on that node
(and GPU), found through Prometheus. Every decision (acted, dry run, rate-limited,
no rule) is audited, and every notification is kept for the dashboard's history.
"""

from __future__ import annotations

import argparse
import datetime
import json
import logging
import sys
import threading
import time
import tomllib
from dataclasses import dataclass, field
from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer
from pathlib import Path

from agent.audit import AuditLog
from agent.logsetup import setup_logging
from dashboard.actions import ACTIONS, ActionError, request_action
from dashboard.drain import NODE_ACTIONS, Drainer, DrainSettings
from dashboard.promclient import PrometheusClient, PrometheusError

log = logging.getLogger("dashboard.remediation")


class PolicyError(ValueError):
    pass


@dataclass(frozen=True)
class Rule:
    alert: str
    action: str
    sustained_s: float = 0.0


@dataclass
class Policy:
    rules: list[Rule]
    dry_run: bool = False
    max_actions_per_run: int = 1
    window_s: float = 900.0
    drain: DrainSettings = field(default_factory=DrainSettings)

    @classmethod
    def load(cls, path: Path) -> Policy:
        try:
            raw = tomllib.loads(path.read_text())
        except OSError as err:
            raise PolicyError(f"cannot read policy {path}: {err.strerror}") from None
        except tomllib.TOMLDecodeError as err:
            raise PolicyError(f"policy {path} is not valid TOML: {err}") from None
        rules = []
        for i, r in enumerate(raw.get("rule", [])):
            if not isinstance(r, dict) or not isinstance(r.get("alert"), str):
                raise PolicyError(f"policy {path}, rule #{i + 1}: 'alert' (a name) is required")
            if r.get("action") not in (*ACTIONS, *NODE_ACTIONS):
                raise PolicyError(f"policy {path}, rule #{i + 1}: 'action' must be one of "
                                  f"{', '.join((*ACTIONS, *NODE_ACTIONS))}")
            rules.append(Rule(r["alert"], r["action"], float(r.get("sustained_s", 0))))
        try:
            drain = DrainSettings.from_toml(raw.get("drain", {}), f"policy {path}")
        except ValueError as err:
            raise PolicyError(str(err)) from None
        return cls(rules, bool(raw.get("dry_run", False)),
                   int(raw.get("max_actions_per_run", 1)), float(raw.get("window_s", 900)),
                   drain)


@dataclass
class Remediator:
    policy: Policy
    prom: PrometheusClient
    token: str | None
    audit: AuditLog
    history_path: Path | None = None
    clock: callable = time.time
    _acted: dict[str, list[float]] = field(default_factory=dict)
    # Alerts a rule wants sustained: Alertmanager does not notify again for an unchanged
    # group until repeat_interval (hours), so the receiver re-checks them itself (tick).
    _waiting: dict[tuple[str, str], tuple[Rule, dict]] = field(default_factory=dict)
    _lock: threading.RLock = field(default_factory=threading.RLock)

    def handle(self, payload: dict) -> list[dict]:
        """One Alertmanager notification -> the decisions taken (also audited)."""
        if self.history_path is not None:
            with open(self.history_path, "a") as f:
                f.write(json.dumps({"received": self.clock(), **payload}) + "\n")
        decisions = []
        for alert in payload.get("alerts", []):
            name = alert.get("labels", {}).get("alertname", "")
            if alert.get("status") != "firing":
                with self._lock:
                    for key in [k for k in self._waiting if k[1] == name
                                and self._waiting[k][1].get("labels") == alert.get("labels")]:
                        del self._waiting[key]
                continue
            rule = next((r for r in self.policy.rules if r.alert == name), None)
            if rule is None:
                continue
            if rule.action in NODE_ACTIONS:  # acts on the node, not on a run (drain.py)
                decisions.append(Drainer(self.policy.drain, self.audit,
                                         self.policy.dry_run).decide(alert))
                continue
            for run in self._runs(alert["labels"]):
                decisions.append(self._decide(rule, run, alert))
        return decisions

    def _runs(self, labels: dict) -> list[str]:
        if "run" in labels:
            return [labels["run"]]
        if "node" not in labels:
            return []
        sel = f'node="{labels["node"]}"' + (f',gpu="{labels["gpu"]}"' if "gpu" in labels else "")
        try:
            return sorted({s.labels["run"] for s in self.prom.query(
                f"max by (run) (clusterpulse_trainer_rank_info{{{sel}}})")})
        except PrometheusError as err:
            log.error("cannot find runs for %s: %s", labels, err)
            return []

    def _decide(self, rule: Rule, run: str, alert: dict) -> dict:
        why = f"policy: {rule.alert} -> {rule.action}"
        started = _parse_time(alert.get("startsAt", ""))
        now = self.clock()
        base = {"run": run, "alert": rule.alert, "action": rule.action}
        if rule.sustained_s and started and now - started < rule.sustained_s:
            with self._lock:
                self._waiting[(run, rule.alert)] = (rule, alert)
            return {**base, "outcome": "waiting", "detail": f"firing {now - started:.0f} s of "
                    f"the {rule.sustained_s:.0f} s the policy requires"}
        with self._lock:
            self._waiting.pop((run, rule.alert), None)
        with self._lock:
            recent = [t for t in self._acted.get(run, []) if now - t < self.policy.window_s]
            if len(recent) >= self.policy.max_actions_per_run:
                outcome = "rate_limited"
            else:
                outcome = "dry_run" if self.policy.dry_run else "act"
                if not self.policy.dry_run:
                    recent.append(now)
            self._acted[run] = recent
        if outcome != "act":
            self.audit.write("policy", rule.action, why, outcome, run=run, source="remediation",
                             alert=alert.get("labels", {}))
            return {**base, "outcome": outcome}
        try:
            results = request_action(self.prom, run, rule.action, why, "policy", self.token,
                                     self.audit, source="remediation")
            ok = all(r.ok for r in results)
            return {**base, "outcome": "acted" if ok else "partial",
                    "nodes": {r.node: r.command or r.error for r in results}}
        except (ActionError, PrometheusError) as err:
            self.audit.write("policy", rule.action, why, "failed", run=run,
                             source="remediation", detail=str(err))
            return {**base, "outcome": "failed", "detail": str(err)}


    def tick(self) -> list[dict]:
        """Decide again on alerts still firing that were waiting to be sustained."""
        with self._lock:
            waiting = list(self._waiting.items())
        return [self._decide(rule, run, alert) for (run, _), (rule, alert) in waiting]


def _parse_time(text: str) -> float | None:
    try:
        return datetime.datetime.fromisoformat(text.replace("Z", "+00:00")).timestamp()
    except ValueError:
        return None


def serve(remediator: Remediator, host: str, port: int) -> ThreadingHTTPServer:
    class Handler(BaseHTTPRequestHandler):
        def do_POST(self) -> None:
            body = self.rfile.read(min(int(self.headers.get("Content-Length") or 0), 1 << 20))
            try:
                payload = json.loads(body)
                decisions = remediator.handle(payload if isinstance(payload, dict) else {})
                code, out = 200, {"decisions": decisions}
            except ValueError:
                code, out = 400, {"error": "body is not JSON"}
            data = json.dumps(out).encode()
            self.send_response(code)
            self.send_header("Content-Type", "application/json")
            self.send_header("Content-Length", str(len(data)))
            self.end_headers()
            self.wfile.write(data)

        def log_message(self, fmt: str, *args) -> None:
            log.debug(fmt, *args)

    server = ThreadingHTTPServer((host, port), Handler)
    threading.Thread(target=server.serve_forever, daemon=True).start()

    def ticker() -> None:
        while True:
            time.sleep(5)
            try:
                remediator.tick()
            except Exception:  # never let the timer die: log and go on
                log.exception("remediation tick failed")

    threading.Thread(target=ticker, name="remediation-tick", daemon=True).start()
    return server


EXAMPLES = """\
examples:
  clusterpulse-remediate --policy deploy/local/policy.toml --listen 127.0.0.1:19495 \\
      --prometheus http://127.0.0.1:9090 --token-file /etc/clusterpulse/token
  clusterpulse-remediate --policy policy.toml --dry-run    # decide and audit only
"""


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(prog="clusterpulse-remediate", description=__doc__,
                                epilog=EXAMPLES,
                                formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--policy", type=Path, required=True, help="policy TOML file")
    p.add_argument("--listen", default="127.0.0.1:19495", help="webhook address")
    p.add_argument("--prometheus", default="http://127.0.0.1:9090")
    p.add_argument("--token-file", type=Path, help="agents' control API token")
    p.add_argument("--audit-log", type=Path, default=Path("clusterpulse-audit.jsonl"))
    p.add_argument("--history", type=Path, help="keep received notifications here (JSONL)")
    p.add_argument("--dry-run", action="store_true", help="override the policy: never act")
    p.add_argument("--log-level", default="warning")
    a = p.parse_args(argv)
    setup_logging(a.log_level)
    try:
        policy = Policy.load(a.policy)
        token = a.token_file.read_text().strip() if a.token_file else None
    except (PolicyError, OSError) as err:
        print(f"clusterpulse-remediate: error: {err}", file=sys.stderr)
        return 2
    if a.dry_run:
        policy.dry_run = True
    host, _, port = a.listen.rpartition(":")
    rem = Remediator(policy, PrometheusClient(a.prometheus), token, AuditLog(a.audit_log),
                     a.history)
    serve(rem, host or "127.0.0.1", int(port))
    print(f"clusterpulse-remediate: listening on http://{a.listen}/alertmanager "
          f"({len(policy.rules)} rules, dry_run={policy.dry_run})", flush=True)
    threading.Event().wait()
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
