"""Operator actions on a run: find the agents of every node the run is on (through
Prometheus), ask each for the action, report per node (partial failures included),
follow the commands to completion, and audit everything. Shared by the dashboard,
`clusterpulse-ctl` and the remediation policy."""

from __future__ import annotations

import re
from dataclasses import dataclass

import requests

from agent.audit import AuditLog
from dashboard.promclient import PrometheusClient

RUN_ID = re.compile(r"^[A-Za-z0-9_.:-]{1,128}$")
ACTIONS = ("checkpoint-restart", "restart")


class ActionError(Exception):
    """The action cannot be attempted at all (bad run id, no token, no agents)."""


@dataclass
class NodeResult:
    node: str
    agent: str
    ok: bool
    command: str = ""
    state: str = ""
    error: str = ""


def agents_for_run(prom: PrometheusClient, run: str) -> dict[str, str]:
    """node -> agent base URL, from the scrape targets that export the run's ranks."""
    if not RUN_ID.match(run):
        raise ActionError(f"invalid run id {run!r}")
    samples = prom.query(f'max by (node, instance) (clusterpulse_trainer_rank_info{{run="{run}"}})')
    return {s.labels["node"]: f"http://{s.labels['instance']}" for s in samples
            if "instance" in s.labels and "node" in s.labels}


def request_action(prom: PrometheusClient, run: str, action: str, reason: str, who: str,
                   token: str | None, audit: AuditLog, deadline_s: float = 120,
                   source: str = "dashboard") -> list[NodeResult]:
    if action not in ACTIONS:
        raise ActionError(f"action must be one of {', '.join(ACTIONS)}")
    if not reason.strip():
        raise ActionError("a reason is required; it goes to the audit log")
    if not token:
        raise ActionError("no agent token configured (CLUSTERPULSE_AGENT_TOKEN_FILE)")
    agents = agents_for_run(prom, run)
    if not agents:
        raise ActionError(f"no agent reports ranks of run {run!r}")
    results = []
    for node, url in sorted(agents.items()):
        try:
            r = requests.post(f"{url}/v1/runs/{run}/actions", timeout=5,
                              headers={"Authorization": f"Bearer {token}"},
                              json={"action": action, "reason": reason, "requested_by": who,
                                    "deadline_s": deadline_s})
            body = r.json()
            ok = r.status_code == 202
            results.append(NodeResult(node, url, ok, body.get("id", ""), body.get("state", ""),
                                      "" if ok else body.get("error") or body.get("detail")
                                      or f"HTTP {r.status_code}"))
        except (requests.RequestException, ValueError) as err:
            results.append(NodeResult(node, url, False, error=f"unreachable: {type(err).__name__}"))
    accepted = sum(r.ok for r in results)
    outcome = "accepted" if accepted == len(results) else (
        "partial" if accepted else "failed")
    audit.write(who, action, reason, outcome, run=run, source=source,
                nodes={r.node: (r.command or r.error) for r in results})
    return results


def command_states(results: list[NodeResult], token: str | None) -> list[NodeResult]:
    """Refresh each node's command state (pending, delivered, escalated, completed...)."""
    out = []
    for r in results:
        if not r.ok or not r.command:
            out.append(r)
            continue
        try:
            body = requests.get(f"{r.agent}/v1/commands/{r.command}", timeout=5,
                                headers={"Authorization": f"Bearer {token}"}).json()
            out.append(NodeResult(r.node, r.agent, True, r.command, body.get("state", "?"),
                                  body.get("detail", "")))
        except (requests.RequestException, ValueError) as err:
            out.append(NodeResult(r.node, r.agent, r.ok, r.command, r.state,
                                  f"unreachable: {type(err).__name__}"))
    return out
