"""Faults as real events, played one at a time, each judged by what the stack did.

Shared by the demo (loopback or testbed) and the chaos benchmark. A `Target` says how
to act on the cluster (the loopback demo's agents, or a `TestbedCluster`); `play`
injects one fault and `Observer.outcome` reads back, from Prometheus alerts, the
remediation audit log and the job's step metric, when it was detected, which action
was taken, and when the job made its first step past the point of the fault.

Kinds (the issue's list):
  gpu_overheat  a GPU's cooling fails: it thermal-throttles, its rank straggles
  gpu_lost      a GPU falls off the bus (NVML GPU_IS_LOST)
  rank_hang     a rank stops making progress, process alive (SIGSTOP)
  rank_crash    a rank dies (SIGKILL); torchrun restarts the workers
  agent_kill    the node's agent dies (SIGKILL) and is restarted later, as systemd would
  node_death    every process of a node is killed at once (testbed only)
  partition     the node's link goes down, then up (testbed only)
  slow_link     the node's link is shaped to a tenth of the bandwidth (testbed only)
"""

from __future__ import annotations

import json
import signal
import time
import urllib.parse
import urllib.request
from dataclasses import dataclass, field
from pathlib import Path
from typing import TYPE_CHECKING, Protocol

if TYPE_CHECKING:
    from clusterpulse.dashboard.remediation import Policy
    from clusterpulse.incident import Incident

# What each fault should raise. Whether the remediation acts on it, and how, is the
# policy's call (`expected_action`): ALERT_LABELS are the labels of those alerts that a
# policy rule may match on (the straggler of an overheating GPU has cause
# thermal_throttling). No action: the policy leaves the fault to the people paged,
# torchrun, the elastic restart, or its own end.
EXPECT: dict[str, tuple[str, ...]] = {
    "gpu_overheat": ("TrainingStraggler", "GpuThermalSlowdown"),
    "gpu_lost": ("GpuDown",),
    "rank_hang": ("RankHung",),
    "rank_crash": (),
    "agent_kill": ("NodeAgentDown",),
    "node_death": ("NodeAgentDown",),
    # the job stalls while the cut lasts; a policy with hot spares restarts it then
    "partition": ("NodeAgentDown", "JobNodeUnreachable"),
    "slow_link": ("TrainingLinkCongested",),
}
ALERT_LABELS: dict[str, dict[str, str]] = {"gpu_overheat": {"cause": "thermal_throttling"}}


def expected_action(kind: str, policy: Policy, seconds: float = 0.0) -> str | None:
    """The action `policy` takes on the alerts fault `kind` raises (the first one a
    rule fits), or None (also for a dry-run policy, which only audits, and for a fault
    of `seconds` that is over before the rule's `sustained_s` has passed)."""
    if policy.dry_run:
        return None
    for name in EXPECT[kind]:
        rule = policy.rule_for({"alertname": name, **ALERT_LABELS.get(kind, {})})
        if rule is not None:
            return None if 0 < seconds <= rule.sustained_s else rule.action
    return None


TESTBED_ONLY = {"node_death", "partition", "slow_link"}
# Faults the job recovers from by restarting its ranks (torchrun, the elastic restart,
# or any restart the policy takes): they count as recovered only once new rank
# processes step, not when old ones still do.
RESTARTS = {"gpu_lost", "rank_hang", "rank_crash", "node_death"}
# drained: requeued; evicted: the others restart without the node
RESTART_ACTIONS = {"restart", "checkpoint-restart", "drain-node", "evict-node"}
# The audit outcomes of an action taken: a run's restart (accepted by its agents, or by
# some), a node's drain (by the receiver, or found drained already and its jobs requeued)
TAKEN = {"accepted", "partial", "acted", "already_drained"}
# Faults that slow the job while it keeps stepping: recovered once their alerts have
# resolved (the job runs at its pace again), not at its first step after the fault.
SLOWDOWNS = {"gpu_overheat", "slow_link"}
# Faults the job can get past before the policy's action: torch's rendezvous drops a
# node silent past its keep-alive, and with a hot spare the job goes on without it
# (the action's alert, JobNodeUnreachable, then never fires: nothing to restart).
SELF_HEALING = {"partition"}
# How old a scraped step can be: the testbed's 1 s scrape plus its agents' 0.5 s
# interval, rounded up (Observer(sample_lag_s=...) for other intervals).
SAMPLE_LAG_S = 2.0


class Target(Protocol):
    """What a fault acts on: nodes by index, one training run."""

    def gpu_fault(self, node: int, kind: str, gpu: int, **fields) -> dict: ...
    def rank_pids(self, node: int) -> list[int]: ...
    def signal_pid(self, pid: int, sig: int) -> None: ...
    def kill_agent(self, node: int) -> None: ...
    def start_agent(self, node: int) -> None: ...
    def node_name(self, node: int) -> str: ...


def live_ranks(metric: str, run: str) -> str:
    """PromQL: `metric` of the run's live rank processes. An agent keeps an exited
    rank's entry for its grace period (evidence): counted, it held "recovered" back
    300 s after a restart that moved the rank to another node, its last step hid where
    an elastic restart (ranks renumbered) resumed from, and its last step time stays in
    a job's average after its node left."""
    return (f'{metric}{{run="{run}"}} unless on (run, rank, node, local_rank) '
            f'clusterpulse_trainer_process_alive == 0')


@dataclass
class Fault:
    kind: str
    node: int
    gpu: int = 1
    seconds: float = 60.0  # how long a transient fault lasts (overheat, lost, link)
    at: float = 0.0  # wall-clock time it was injected
    detail: str = ""

    def describe(self, names: list[str] | None = None) -> str:
        node = names[self.node] if names else f"node {self.node}"
        return {
            "gpu_overheat": f"GPU {self.gpu} of {node} overheats for {self.seconds:.0f} s",
            "gpu_lost": f"GPU {self.gpu} of {node} falls off the bus for {self.seconds:.0f} s",
            "rank_hang": f"the rank on {node} hangs",
            "rank_crash": f"the rank on {node} crashes",
            "agent_kill": f"the agent of {node} is killed",
            "node_death": f"{node} dies",
            "partition": f"{node} is cut off the network for {self.seconds:.0f} s",
            "slow_link": f"{node}'s link drops to 1/10 for {self.seconds:.0f} s",
        }[self.kind]


def play(fault: Fault, target: Target) -> Fault:
    """Inject `fault` now. Transient faults (partition, slow link, killed agent) are
    undone later by `undo` once their `seconds` have passed."""
    fault.at = time.time()
    k = fault.kind
    if k == "gpu_overheat":
        target.gpu_fault(fault.node, "overheat", fault.gpu, duration_s=fault.seconds)
    elif k == "gpu_lost":
        target.gpu_fault(fault.node, "gpu_lost", fault.gpu, duration_s=fault.seconds)
    elif k in ("rank_hang", "rank_crash"):
        pids = target.rank_pids(fault.node)
        if not pids:
            raise RuntimeError(f"no rank of the job on {target.node_name(fault.node)}")
        sig = signal.SIGSTOP if k == "rank_hang" else signal.SIGKILL
        target.signal_pid(pids[0], sig)
        fault.detail = f"pid {pids[0]}"
    elif k == "agent_kill":
        target.kill_agent(fault.node)
    elif k in TESTBED_ONLY:
        getattr(target, k)(fault.node, fault.seconds)
    else:
        raise ValueError(f"unknown fault kind {k!r}; known: {', '.join(EXPECT)}")
    return fault


def undo(fault: Fault, target: Target) -> None:
    """End a transient fault: heal the link, lift the shaping, restart the agent."""
    if fault.kind == "agent_kill":
        target.start_agent(fault.node)
    elif fault.kind in ("partition", "slow_link", "node_death"):
        getattr(target, f"undo_{fault.kind}")(fault.node)


@dataclass
class Outcome:
    fault: Fault
    alert: str | None = None
    detected_at: float | None = None
    action: str | None = None
    acted_at: float | None = None
    step_at_fault: int | None = None
    resumed_from: int | None = None
    recovered_at: float | None = None
    pids_at_fault: set[str] | None = None
    notes: list[str] = field(default_factory=list)

    @property
    def detect_s(self) -> float | None:
        return None if self.detected_at is None else max(0.0, self.detected_at - self.fault.at)

    @property
    def recover_s(self) -> float | None:
        return None if self.recovered_at is None else self.recovered_at - self.fault.at

    @property
    def recomputed(self) -> int | None:
        if self.step_at_fault is None or self.resumed_from is None:
            return None
        return max(0, self.step_at_fault - self.resumed_from)


class Observer:
    """Reads what the stack did: Prometheus (alerts, steps), the audit log."""

    def __init__(self, prometheus: str, audit_log: Path, run: str, policy: Policy,
                 sample_lag_s: float = SAMPLE_LAG_S) -> None:
        self.prometheus = prometheus
        self.audit_log = audit_log
        self.run = run
        self.policy = policy
        self.sample_lag_s = sample_lag_s

    def action_for(self, fault: Fault) -> str | None:
        return expected_action(fault.kind, self.policy, fault.seconds)

    def query(self, promql: str, at: float | None = None) -> list[dict]:
        params = {"query": promql, **({"time": f"{at:.3f}"} if at else {})}
        url = f"{self.prometheus}/api/v1/query?{urllib.parse.urlencode(params)}"
        with urllib.request.urlopen(url, timeout=10) as r:
            return json.load(r)["data"]["result"]

    def live(self, metric: str) -> str:
        return live_ranks(metric, self.run)

    def pids(self, at: float | None = None) -> set[str]:
        """The run's live rank processes (pid labels of rank_info)."""
        return {s["metric"].get("pid", "") for s in self.query(
            self.live("clusterpulse_trainer_rank_info"), at)}

    def step(self, at: float | None = None) -> int | None:
        r = self.query(f'max({self.live("clusterpulse_trainer_step")})', at)
        return int(float(r[0]["value"][1])) if r else None

    def alerts(self) -> list[dict]:
        with urllib.request.urlopen(self.prometheus + "/api/v1/alerts", timeout=10) as r:
            return json.load(r)["data"]["alerts"]

    def audit(self, since: float) -> list[dict]:
        if not self.audit_log.exists():
            return []
        out = []
        for line in self.audit_log.read_text(errors="replace").splitlines():
            try:
                rec = json.loads(line)
            except ValueError:
                continue
            if rec.get("ts", 0) >= since:
                out.append(rec)
        return out

    def update(self, o: Outcome, node_name: str) -> None:
        """Fill in what has happened since the fault; call repeatedly."""
        names, action = EXPECT[o.fault.kind], self.action_for(o.fault)
        if o.step_at_fault is None:
            o.step_at_fault = self.step(o.fault.at)
        if o.pids_at_fault is None:
            o.pids_at_fault = self.pids(o.fault.at)
        if o.detected_at is None and names:
            for a in self.alerts():
                labels = a["labels"]
                if (labels.get("alertname") in names and a["state"] == "firing"
                        and labels.get("node", node_name) == node_name):
                    started = _ts(a["activeAt"])
                    if started >= o.fault.at - 1:
                        o.alert, o.detected_at = labels["alertname"], started
                        break
        if o.acted_at is None and action:
            for rec in self.audit(o.fault.at):
                if rec.get("action") == action and rec.get("source") == "remediation" \
                        and rec.get("outcome") in TAKEN:
                    o.action, o.acted_at = action, rec["ts"]
                    break
        if o.recovered_at is None and o.step_at_fault is not None:
            self._recovery(o, node_name)

    def _recovery(self, o: Outcome, node_name: str) -> None:
        """Recovered once the run steps again since the fault, and after the action if
        one is expected (a fault in SELF_HEALING may be got past without it: then the
        new processes stepping tell). The lowest step since the fault (since the
        action, if one came) is where it resumed from; the
        steps it had made until the fault was handled (the action, else detection, else
        the fault) and lost are the recomputed ones."""
        action = self.action_for(o.fault)
        if action and o.acted_at is None and o.fault.kind not in SELF_HEALING:
            return
        if o.fault.kind in RESTARTS or action in RESTART_ACTIONS:
            now_pids = self.pids()  # new processes must be the ones stepping
            if not now_pids or now_pids & (o.pids_at_fault or set()):
                return
        elif o.fault.kind in SLOWDOWNS and (
                o.detected_at is None or self.firing(EXPECT[o.fault.kind], node_name)):
            return
        ref = o.acted_at or o.detected_at or o.fault.at
        # A scraped step is up to a scrape and an agent interval old: read from just
        # after the fault, the steps made before it look like progress since (a
        # partition "recovered" in 0.01 s). After an action, from the action: a job
        # slowed by the fault steps on until it (an eviction's graceful restart), and
        # the lowest step since the fault was its first one after it, not where it
        # resumed (an overheating GPU's eviction read as 108 steps recomputed).
        since = max(o.fault.at, o.acted_at or 0.0) + self.sample_lag_s
        if time.time() < since + 1:
            return
        span = f"{int(time.time() - since)}s"
        series = f'max({self.live("clusterpulse_trainer_step")})'
        # > 0: a restarted rank reports step 0 until it has loaded its checkpoint
        low = self.query(f"min_over_time(({series} > 0)[{span}:1s])")
        now = self.step()
        if not low or now is None:
            return
        lowest = int(float(low[0]["value"][1]))
        if now >= lowest + 2:
            peak = self.query(f"max_over_time({series}[{max(1, int(ref - o.fault.at) + 1)}s:1s])",
                              at=ref)
            reached = int(float(peak[0]["value"][1])) if peak else lowest
            o.step_at_fault = max(o.step_at_fault or 0, reached)
            # Only new processes can go back to a checkpoint; the same ones carry on
            # (a scrape taken just before the fault would read as steps lost).
            restarted = bool(self.pids() - (o.pids_at_fault or set()))
            o.resumed_from = min(lowest, o.step_at_fault) if restarted else o.step_at_fault
            o.recovered_at = time.time()

    def incident(self, o: Outcome) -> Incident | None:
        """The fault's incident, as the dashboard's timeline shows it (one object,
        clusterpulse/incident.py): its alerts grouped, the audit log's action, and
        where the trainer's own record says the run resumed from."""
        from clusterpulse import incident
        from clusterpulse.dashboard.promclient import PrometheusClient

        now = time.time()
        since = o.fault.at - 2  # activeAt is whole seconds
        nodes, ranks, episodes, resumes = incident.inputs(PrometheusClient(self.prometheus),
                                                         self.run, since, now, 1.0)
        found = incident.build(self.run, nodes, episodes, self.audit(0), resumes, ranks=ranks,
                               until=now)
        # its own, else one it joined (alerts of an earlier fault still firing on the node)
        return next((i for i in found if i.detected_at >= since),
                    next((i for i in found if i.ended_at >= since), None))

    def last_action(self) -> float:
        """When the remediation last acted on the run (its rate limit counts from there)."""
        acts = [r["ts"] for r in self.audit(0) if r.get("source") == "remediation"
                and r.get("run") == self.run and r.get("outcome") in TAKEN]
        return max(acts, default=0.0)

    def firing(self, names: tuple[str, ...], node: str) -> bool:
        return any(a["labels"].get("alertname") in names and a["state"] == "firing"
                   and a["labels"].get("node", node) == node for a in self.alerts())


def _ts(rfc3339: str) -> float:
    from datetime import datetime

    return datetime.fromisoformat(rfc3339.replace("Z", "+00:00")).timestamp()
