"""Remediation action `drain-node`: take a failing node out of Slurm the way Slurm
admins already do (`scontrol update NodeName=... State=DRAIN Reason=...`).

Draining stops new work from landing on the node and lets running jobs end; with
`requeue = true` the jobs running there are requeued at once (`scontrol requeue`), so
a job stuck on a broken GPU restarts from its last checkpoint on the remaining nodes
instead of waiting for its time limit.

Policy (in the remediation policy TOML):

    [[rule]]
    alert = "GpuDown"
    action = "drain-node"

    [drain]
    requeue = true       # also requeue the jobs running on the node (default false)
    max_drained = 1      # never hold more than this many nodes drained by us at once

A node already drained (by its health check, an admin or us) keeps its reason, which
names the first cause; `requeue` still moves the jobs left on it.

Drain decisions are taken one at a time (in this process): the webhook server answers
each notification on its own thread, and in an alert storm Alertmanager sends one per
node at once. A decision counts the nodes drained by us and drains its node before the
next one counts, so the storm drains `max_drained` nodes and the rest are refused
(`rate_limited`, saying which nodes count).

`max_drained` is the guard draino-style drainers keep: an alert storm (or a broken
exporter) must not empty the cluster. Nodes count as ours by their Reason prefix, so
they stay drained until an operator resumes them (`scontrol update NodeName=X
State=RESUME`); the node health check never resumes them (it only resumes its own).
The alert's `node` label is the Slurm node name (the agent's --node defaults to the
hostname, as Slurm's NodeName usually is). Every decision is audited.
"""

from __future__ import annotations

import logging
import re
import shutil
import subprocess
import threading
from dataclasses import dataclass
from typing import Any

from clusterpulse.agent.audit import AuditLog
from clusterpulse.agent.validate import unknown_keys

log = logging.getLogger("clusterpulse.dashboard.drain")

NODE_ACTIONS = ("drain-node",)
REASON_PREFIX = "clusterpulse-remediate:"
NODE_NAME = re.compile(r"^[A-Za-z0-9][A-Za-z0-9_.-]{0,127}$")
# Held from counting the nodes drained by us to draining this one: without it, six
# notifications of an alert storm each counted the same drained nodes before any had
# drained its own, and max_drained = 2 drained six. Requeueing counts nothing: outside.
_DECIDING = threading.Lock()
DECIDING_WAIT_S = 45.0  # one slow Slurm command (30 s timeout) ahead, not a queue of them


class DrainError(Exception):
    """Slurm refused or could not be reached; the message says which command and why."""


@dataclass(frozen=True)
class DrainSettings:
    requeue: bool = False
    max_drained: int = 1

    @classmethod
    def from_toml(cls, raw: Any, where: str) -> DrainSettings:
        if not isinstance(raw, dict):
            raise ValueError(f"{where}: [drain] must be a table")
        unknown = unknown_keys(raw, ("requeue", "max_drained"))
        if unknown:
            raise ValueError(f"{where}: [drain] has {unknown}")
        requeue, most = raw.get("requeue", False), raw.get("max_drained", 1)
        if not isinstance(requeue, bool):
            raise ValueError(f"{where}: [drain] requeue must be true or false")
        if not isinstance(most, int) or isinstance(most, bool) or most < 1:
            raise ValueError(f"{where}: [drain] max_drained must be an integer >= 1")
        return cls(requeue, most)


def slurm(exe: str, *args: str) -> str:
    """Run one Slurm client command (scontrol, sinfo, squeue); its stdout."""
    path = shutil.which(exe)
    if path is None:
        raise DrainError(f"{exe} not found in PATH (Slurm client tools are needed to drain)")
    try:
        r = subprocess.run([path, *args], capture_output=True, text=True, timeout=30)
    except subprocess.TimeoutExpired:
        raise DrainError(f"{exe} {' '.join(args)} timed out (slurmctld unreachable?)") from None
    if r.returncode != 0:
        raise DrainError(f"{exe} {' '.join(args)}: {(r.stderr or r.stdout).strip()}")
    return r.stdout


def drained_by_us() -> set[str]:
    """Nodes whose drain reason is ours (`sinfo -R`: reason and node list)."""
    out = slurm("sinfo", "-R", "-h", "-o", "%E|%N")
    nodes: set[str] = set()
    for line in out.splitlines():
        reason, _, nodelist = line.partition("|")
        if reason.startswith(REASON_PREFIX):
            nodes.update(slurm("scontrol", "show", "hostnames", nodelist).split())
    return nodes


def is_drained(node: str) -> bool:
    state = slurm("sinfo", "-h", "-N", "-n", node, "-o", "%T").split()
    return any("drain" in st for st in state)


def jobs_on(node: str) -> list[str]:
    out = slurm("squeue", "-h", "-t", "RUNNING,CONFIGURING", "-w", node, "-o", "%i")
    return [j for j in out.split() if j]


@dataclass
class Drainer:
    settings: DrainSettings
    audit: AuditLog
    dry_run: bool = False

    def decide(self, alert: dict) -> dict:
        labels = alert.get("labels", {})
        node, name = labels.get("node", ""), labels.get("alertname", "")
        base = {"node": node, "alert": name, "action": "drain-node"}
        why = f"policy: {name} -> drain-node"
        if not NODE_NAME.match(node):
            self.audit.write("policy", "drain-node", why, "failed", source="remediation",
                             alert=labels, detail="alert has no valid node label")
            return {**base, "outcome": "failed", "detail": "alert has no valid node label"}
        reason = f"{REASON_PREFIX} {name}" + (f" gpu {labels['gpu']}" if "gpu" in labels else "")
        try:
            if not _DECIDING.acquire(timeout=DECIDING_WAIT_S):
                # Slurm is slow and decisions queue: do not hold the webhook's threads
                # (and its connection slots) for minutes; the alert is resent
                raise DrainError(f"another drain decision has waited on Slurm for over "
                                 f"{DECIDING_WAIT_S:.0f} s; not drained now")
            try:
                outcome, detail = self._drain(node, reason)
            finally:
                _DECIDING.release()
            if (outcome in ("acted", "already_drained") and self.settings.requeue
                    and not self.dry_run):
                requeued = []
                for job in jobs_on(node):
                    slurm("scontrol", "requeue", job)
                    requeued.append(job)
                if requeued:
                    detail = f"requeued jobs {', '.join(requeued)}"
        except DrainError as err:
            outcome, detail = "failed", str(err)
        self.audit.write("policy", "drain-node", why, outcome, source="remediation",
                         node=node, alert=labels, slurm_reason=reason, detail=detail)
        log.info("drain-node %s: %s %s", node, outcome, detail)
        return {**base, "outcome": outcome, "detail": detail}

    def _drain(self, node: str, reason: str) -> tuple[str, str]:
        """Drain `node` unless it is drained already or max_drained would be exceeded:
        (outcome, detail). The caller holds _DECIDING, so the count is still true when
        the drain happens."""
        ours = drained_by_us()
        if node in ours or is_drained(node):
            # Drained already (by us, the node's health check or an admin): keep its
            # reason, which names the first cause; the running jobs still need moving.
            return "already_drained", ""
        if len(ours) >= self.settings.max_drained:
            return "rate_limited", (f"{len(ours)} node(s) already drained by remediation "
                                    f"(max_drained={self.settings.max_drained}): "
                                    f"{', '.join(sorted(ours))}")
        if self.dry_run:
            return "dry_run", ""
        slurm("scontrol", "update", f"NodeName={node}", "State=DRAIN", f"Reason={reason}")
        return "acted", ""
