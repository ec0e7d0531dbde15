"""Incidents: one object per fault, built once, shown the same way everywhere.

A fault raises several alerts (a hung rank: RankHung and JobStalled; a lost GPU:
GpuDown and GpuCriticalXid; an overheating GPU: GpuThermalSlowdown and the
TrainingStraggler it causes). Listing each alert as an incident told an on-call
engineer of six faults where three happened, and rebuilding the numbers from
sampled step series made them change with the time range and every refresh. Here an
incident is built from inputs that do not depend on the sampling:

- alert episodes with Prometheus's own `activeAt` (the value of ALERTS_FOR_STATE),
  grouped by run, node and time, the root named by the order the Alertmanager
  inhibition rules imply (the GPU that is down explains its XIDs and its rank's hang);
- the audit log's actions (their own timestamps);
- the trainer's own resume record (`clusterpulse_trainer_resume_*`: the step it
  resumed from and the steps it recomputed, from rank 0's run state).

The dashboard's timeline, the demo's printout (deploy/testbed/scenario.py) and tests
all call `build` and print `Incident.line`/`Incident.row`. It lives at the package
root, not in the dashboard or the deploy tooling: it is a contract between them.
"""

from __future__ import annotations

import math
from collections.abc import Iterable, Sequence
from dataclasses import dataclass, field
from functools import partial
from typing import TYPE_CHECKING

if TYPE_CHECKING:
    from clusterpulse.dashboard.promclient import PrometheusClient

# Root first: an alert earlier in this list explains the later ones of the same fault
# (deploy/alertmanager/alertmanager.yml's inhibit_rules, plus a GPU's heat explaining
# the straggler it makes, and a link that is down or degraded the congestion and
# slowdown it makes). Unlisted alerts come after all of these.
LINK_ALERTS = ("NicLinkDown", "GpuNvLinkDown", "GpuPcieLinkDegraded", "NicLinkDegraded",
               "GpuNvLinkErrors")
ROOT_ORDER = ("NodeAgentDown", "AgentCollectionStale", "AgentTelemetryStalled",
              "RankProgressNotScraped", "GpuDown", "JobNodeUnreachable", "RankHung",
              "GpuCriticalXid", "GpuEccUncorrectable", "GpuReadingsFailing",
              "GpuThermalSlowdown", "GpuPowerBrake", "GpuTemperatureHigh", *LINK_ALERTS,
              "TrainingLinkCongested", "TrainingStraggler", "JobStalled")
# Alerts without a run label that concern the runs on their node (a link's too: the
# timeline showed a JobSlowdown alone while the NIC port under it was down).
NODE_ALERTS = frozenset({"NodeAgentDown", "AgentCollectionStale", "AgentTelemetryStalled",
                         "RankProgressNotScraped", "GpuDown", "GpuCriticalXid",
                         "GpuEccUncorrectable", "GpuReadingsFailing", "GpuThermalSlowdown",
                         "GpuPowerBrake", "GpuTemperatureHigh", *LINK_ALERTS,
                         "TrainingLinkCongested"})
# Audit outcomes of an action that was taken (a run's restart accepted by all or some
# of its agents; a node's drain done, or found done already).
TAKEN = frozenset({"accepted", "partial", "acted", "already_drained"})
# A later alert joins an incident only while one of its alerts still fires (their
# last firing sample, as Prometheus recorded it whatever the query step): a gap would
# join the next fault, played seconds after the last one resolved, to it.
JOIN_GAP_S = 0.0
# An alert nearer the root than every alert of an incident (a GPU down, after the
# stragglers and a hung-rank blip of a loaded machine) is a new fault unless it began
# within this long of the incident's first alert and on its node: alerts of one fault
# start within the rule groups' evaluation intervals of each other (the per-GPU groups
# run every 15-30 s). Joined to whatever fired before it, a lost GPU was "detected" 35 s
# before it was lost in one time range and at its loss in another.
ROOT_JOIN_S = 30.0
# An action counts for an incident only while the incident fires or this long after
# its last alert: an operator's restart 11 minutes after a straggler had resolved was
# shown as that straggler's action, at +827 s.
ACTION_AFTER_S = 120.0
# The labels that name what an alert is about on its node: a GPU's alert joins no
# incident of another GPU (two GPUs lost 9 minutes apart were one incident, chained by
# the first one's XID alert, which fires for 10 minutes), a rank's none of another rank.
SUBJECTS = ("gpu", "rank")
# Alerts on a count over a long window (an XID or ECC error in the last 10 minutes):
# they keep firing long after their fault, so they hold an incident open for later
# alerts only as long as a root may join (ROOT_JOIN_S). Held open by a lost GPU's XID
# alert, a straggler minutes after the GPU was back joined its incident on the page,
# after the demo had printed it.
LINGERING = frozenset({"GpuCriticalXid", "GpuEccUncorrectable"})


def _open_until(ep: AlertEpisode) -> float:
    """Until when `ep` holds its incident open: for later alerts to join, for actions."""
    return min(ep.last_seen, ep.active_at + ROOT_JOIN_S) if ep.name in LINGERING \
        else ep.last_seen
# The trainer series of the resume record (agent/exporter.py RANK_SERIES).
RESUME_SERIES = {"step": "clusterpulse_trainer_resume_step",
                 "recomputed": "clusterpulse_trainer_resume_steps_recomputed",
                 "at": "clusterpulse_trainer_resume_timestamp_seconds"}


@dataclass(frozen=True)
class AlertEpisode:
    """One firing of one alert: `active_at` is Prometheus's activeAt (when its
    condition first held), `last_seen` its last firing sample, `fired_at` its first
    (when it paged: after its rule's `for`), None where not read."""

    name: str
    labels: dict = field(hash=False, compare=False)
    active_at: float
    last_seen: float
    fired_at: float | None = None

    @property
    def node(self) -> str:
        return self.labels.get("node", "")


@dataclass(frozen=True)
class Resume:
    """The trainer's own record of one restart: rank 0 resumed from `step`, redoing
    `recomputed` steps it had made before (trainer/runstate.py), at unix time `at`."""

    step: int
    recomputed: int
    at: float


@dataclass
class Incident:
    run: str
    cause: str  # the root alert
    where: str  # its node, and rank or GPU
    alerts: list[str]  # every alert of the fault, root first
    detected_at: float  # the earliest activeAt of its alerts: when the fault began
    ended_at: float  # the last firing sample of any of them
    action: str | None = None
    acted_at: float | None = None
    actor: str = ""
    resume: Resume | None = None
    open_until: float = 0.0  # until when it takes later alerts and actions (_open_until)
    # the first firing sample of any of its alerts: when it paged. The timeline showed
    # only when a condition first held (a GpuTemperatureHigh pending for its `for` of
    # 1 min) as "detected", 41 s before anything paged.
    paged_at: float | None = None

    @property
    def recomputed(self) -> int:
        return self.resume.recomputed if self.resume else 0

    def line(self) -> str:
        """One line for the demo's printout and the page's summary."""
        act = (f"; {self.action} by {self.actor or '?'} +{self.acted_at - self.detected_at:.0f} s"
               if self.action and self.acted_at is not None else "; no action")
        paged = "" if self.paged_at is None else \
            f"; paged +{self.paged_at - self.detected_at:.0f} s"
        res = (f"; resumed from step {self.resume.step} ({self.resume.recomputed} steps "
               "recomputed)" if self.resume else "")
        also = [a for a in self.alerts if a != self.cause]
        return (f"{self.cause} on {self.where}" + (f" (with {', '.join(also)})" if also else "")
                + paged + act + res)

    def row(self) -> dict:
        """The timeline's table row: clock times, and offsets from detection that are
        the same for any time range and refresh (both ends are recorded timestamps).
        "resumed from step" is the step or None, never the "-" of the text columns: a
        column of both is no Arrow type, and the Run page logged an ArrowTypeError on
        every render (the page shows None as a dash)."""
        def rel(t: float | None) -> str:
            return "-" if t is None else f"+{t - self.detected_at:.0f} s"

        return {"incident": self.cause, "where": self.where,
                "alerts": ", ".join(self.alerts), "detected": self.detected_at,
                "paged": rel(self.paged_at),
                "action": f"{self.action} {rel(self.acted_at)}" if self.action else "-",
                "by": self.actor or "-",
                "resumed from step": None if self.resume is None else self.resume.step,
                "resumed": "-" if self.resume is None else rel(self.resume.at),
                # None without a resume record: nothing known, not "0 recomputed"
                "steps recomputed": None if self.resume is None else self.resume.recomputed}


def root_rank(name: str) -> int:
    return ROOT_ORDER.index(name) if name in ROOT_ORDER else len(ROOT_ORDER)


def _where(labels: dict) -> str:
    out = labels.get("node", "") or "(job)"
    if "rank" in labels:
        out += f" rank {labels['rank']}"
    elif "gpu" in labels:
        out += f" GPU {labels['gpu']}"
    return out


# (node, rank) -> the GPUs that rank used on that node in the time range (rank_info)
RankGpus = dict[tuple[str, str], set[str]]


def concerns(run: str, nodes: set[str], labels: dict, ranks: RankGpus | None = None) -> bool:
    """Whether an alert is about `run`: its own run label, or a node alert on a node
    where the run has ranks; with `ranks`, a GPU's alert only for a GPU one of them
    uses (a lost GPU no rank ran on is not the run's incident)."""
    if labels.get("run"):
        return labels["run"] == run
    if labels.get("alertname") not in NODE_ALERTS or labels.get("node") not in nodes:
        return False
    gpu = labels.get("gpu")
    return ranks is None or gpu is None or any(
        node == labels["node"] and gpu in used for (node, _), used in ranks.items())


def _gpus_of(ep: AlertEpisode, ranks: RankGpus) -> set[str]:
    """The GPUs an alert is about: its own label, else its rank's on its node."""
    if "gpu" in ep.labels:
        return {ep.labels["gpu"]}
    return set(ranks.get((ep.node, ep.labels["rank"]), ())) if "rank" in ep.labels else set()


def _joins(ep: AlertEpisode, g: list[AlertEpisode], gap_s: float, ranks: RankGpus) -> bool:
    """Whether `ep` is another alert of the fault of group `g` (see `group`)."""
    if ep.active_at > max(_open_until(e) for e in g) + gap_s:
        return False  # the group no longer fires
    nodes = {e.node for e in g} - {""}
    if ep.node and nodes and ep.node not in nodes:
        return False
    for subject in SUBJECTS:  # the same GPU or rank, where both name one on that node
        mine = ep.labels.get(subject)
        theirs = {e.labels[subject] for e in g if subject in e.labels and e.node == ep.node}
        if mine is not None and theirs and mine not in theirs:
            return False
    # a rank's alert and a GPU's: the same GPU, the one the rank used (a hung rank on
    # GPU 0 joined a lost GPU 1 on its node)
    mine_gpus = _gpus_of(ep, ranks)
    theirs_gpus = set().union(*(_gpus_of(e, ranks) for e in g if e.node == ep.node))
    if mine_gpus and theirs_gpus and not mine_gpus & theirs_gpus:
        return False
    if root_rank(ep.name) < min(root_rank(e.name) for e in g):  # a root come later
        return ep.active_at <= min(e.active_at for e in g) + ROOT_JOIN_S and \
            (not ep.node or nodes <= {ep.node})
    return True


def group(episodes: Iterable[AlertEpisode], gap_s: float = JOIN_GAP_S,
          ranks: RankGpus | None = None) -> list[list[AlertEpisode]]:
    """Alerts of one fault together: an episode joins the latest group that still fires
    (or fired within `gap_s`), on the same node or where one of the two names no node
    (a job-level alert such as JobStalled), about the same GPU or rank where both name
    one (a rank's GPU from `ranks`); an alert nearer the root than the whole group joins
    it only as its root (on its node, within ROOT_JOIN_S of its start). What an
    incident holds thus depends on the alerts around its fault, not on where a time
    range begins."""
    groups: list[list[AlertEpisode]] = []
    for ep in sorted(episodes, key=lambda e: (e.active_at, root_rank(e.name))):
        for g in reversed(groups):
            if _joins(ep, g, gap_s, ranks or {}):
                g.append(ep)
                break
        else:
            groups.append([ep])
    return groups


def _acts_for(record: dict, inc: Incident) -> bool:
    """A policy's action names the alert it acted on ("policy: GpuDown -> restart"):
    it is the action of an incident with that alert only. An operator's names none."""
    why = str(record.get("why", ""))
    if record.get("who") != "policy" or not why.startswith("policy: ") or " -> " not in why:
        return True
    return why[len("policy: "):].split(" -> ", 1)[0] in inc.alerts


def build(run: str, nodes: set[str], episodes: Iterable[AlertEpisode], audit: Sequence[dict],
          resumes: Sequence[Resume], sources: set[str] | None = None,
          gap_s: float = JOIN_GAP_S, ranks: RankGpus | None = None,
          until: float | None = None) -> list[Incident]:
    """The run's incidents, oldest first. An incident takes the first action taken on
    the run (audit outcome in TAKEN; from `sources` only, if given) after its detection,
    while it fires or within ACTION_AFTER_S of its end and before `until` (the end of
    the time range shown), and the policy's only if it named one of its alerts; an
    action is one incident's: the root-most firing when it was taken, else the latest
    in its tail. It takes the first trainer resume record after its action in
    the same span (a resume of an operator's restart 7 minutes after a hang had
    resolved read as the hang's). An incident without an action takes the first resume
    in its span that no action's incident took: one that ended before it first (a
    restart ends its fault), else one still firing, by root order. The span is
    the incident's own, whatever fires beside it: ended at the next incident's start, a
    hang's closed when another node's GPU began throttling 3 s later, the policy's
    restart of the hang was no one's and the throttling took the hang's resume record.
    `ranks`: the GPUs the run's ranks used (`concerns`, `group`)."""
    mine = [e for e in episodes
            if concerns(run, nodes, {"alertname": e.name, **e.labels}, ranks)]
    out = []
    for g in group(mine, gap_s, ranks):
        g.sort(key=lambda e: (root_rank(e.name), e.active_at))
        names = list(dict.fromkeys(e.name for e in g))
        # paged: its alerts' first firing, unknown if any's is (it fired before the range)
        fired = [e.fired_at for e in g]
        out.append(Incident(run, g[0].name, _where(g[0].labels), names,
                            min(e.active_at for e in g), max(e.last_seen for e in g),
                            open_until=max(_open_until(e) for e in g),
                            paged_at=None if None in fired else min(fired)))
    out.sort(key=lambda i: i.detected_at)
    acts = sorted((r for r in audit if r.get("run") == run and r.get("outcome") in TAKEN
                   and (sources is None or r.get("source") in sources)),
                  key=lambda r: r.get("ts", 0.0))
    shown_until = float("inf") if until is None else until
    last = {id(inc): min(max(inc.open_until, inc.detected_at) + ACTION_AFTER_S, shown_until)
            for inc in out}
    # Each action is one incident's, and an incident takes its first: an operator's
    # (or a policy's, of that incident's alert) goes to an incident firing when it is
    # taken, the root-most (a hang before the throttling beside it, whichever began
    # first), else to the latest one in its tail (within ACTION_AFTER_S of its end).
    # Oldest first, an ended throttling took the restart of the hang paged 40 s after
    # it, and a firing one the operator's restart of a hang beside it (reviews).
    for act in acts:
        at = act.get("ts", 0.0)
        open_ = [i for i in out if i.action is None and i.detected_at <= at < last[id(i)]
                 and _acts_for(act, i)]
        firing = sorted((i for i in open_ if at <= max(i.open_until, i.detected_at)),
                        key=lambda i: (root_rank(i.cause), -i.detected_at))
        inc = firing[0] if firing else (open_[-1] if open_ else None)
        if inc is not None:
            inc.action, inc.acted_at, inc.actor = act.get("action"), at, act.get("who", "")
    # The resumes of actions first (each the first after its action), then the others':
    # a restart ends the fault that caused it (its ranks' alerts resolve), so an
    # incident that ended before the resume first, the latest ended (not the hang that
    # cleared a minute before a GPU's XID crashed the run), then those still firing, by
    # root order (not the throttling that went on through a hang's restart).
    left = sorted(resumes, key=lambda r: r.at)
    acted = sorted((i for i in out if i.acted_at is not None), key=lambda i: i.acted_at or 0.0)
    for inc in acted:
        inc.resume = next((r for r in left if inc.acted_at <= r.at < last[id(inc)]), None)
        left = [r for r in left if r is not inc.resume]
    for r in list(left):
        open_ = [i for i in out if i.acted_at is None and i.resume is None
                 and i.detected_at <= r.at < last[id(i)]]
        ended = sorted((i for i in open_ if i.ended_at < r.at),
                       key=lambda i: (-i.ended_at, -i.detected_at))
        going = sorted((i for i in open_ if i.ended_at >= r.at),
                       key=lambda i: (root_rank(i.cause), -i.detected_at))
        for inc in [*ended, *going][:1]:
            inc.resume = r
    return out


def summary(items: Sequence[Incident]) -> str:
    """The timeline's caption: incidents and the steps the trainer says it redid."""
    resumed = [i for i in items if i.resume is not None]
    if not resumed:  # "0 steps recomputed" read as a fact where nothing was recorded
        return f"{len(items)} incident(s), no restart resumed in this range"
    return (f"{len(items)} incident(s), {sum(i.recomputed for i in resumed)} steps recomputed "
            f"in all over {len(resumed)} resume(s) (as the trainer recorded each)")


# -- from Prometheus's answers (plain data: labels and points) ------------------------
Series = Sequence[tuple[dict, Sequence[tuple[float, float]]]]


def episodes_from(for_state: Series, firing: Series, first_firing: Series = (),
                  since: float = -math.inf) -> list[AlertEpisode]:
    """Episodes from the range queries of `alert_queries`: ALERTS_FOR_STATE (value:
    activeAt, one value per episode whatever the step), the time of the last firing
    sample in each step and of the first. An episode counts once one of its samples
    fired (a pending alert that never fired is no incident), it ends at its last firing
    sample and paged at its first (exact at any step: each step's earliest), unless that
    is at or before `since`, the query's first point: the step it covers may begin
    before the range, in an episode that fired earlier (then unknown, None).

    Both queries cover each step whole. Plain samples at the Run page's 9 s step (1 h)
    missed a JobStalled that fired for 4 s between two of them, while the demo's 1 s
    printout named it; and an end taken from the step's points moved with the step,
    which split or joined the alerts of one fault differently at each range."""
    def key(labels: dict) -> tuple:
        return tuple(sorted((k, v) for k, v in labels.items()
                            if k not in ("__name__", "alertstate")))

    fired: dict[tuple, list[float]] = {}
    for labels, points in firing:
        fired.setdefault(key(labels), []).extend(v for _, v in points)
    firsts: dict[tuple, list[float]] = {}
    for labels, points in first_firing:
        firsts.setdefault(key(labels), []).extend(v for _, v in points)
    out = []
    for labels, points in for_state:
        times = sorted(set(fired.get(key(labels), [])))
        actives = sorted({float(v) for _, v in points})
        for n, active in enumerate(actives):
            nxt = actives[n + 1] if n + 1 < len(actives) else float("inf")
            seen = [t for t in times if active <= t < nxt]
            if seen:
                clean = {k: v for k, v in labels.items() if k != "__name__"}
                first = min((t for t in firsts.get(key(labels), []) if active <= t < nxt),
                            default=None)
                out.append(AlertEpisode(clean.get("alertname", ""), clean, active, max(seen),
                                        first if first is not None and first > since else None))
    return out


def alert_queries(step_s: float) -> tuple[str, str, str]:
    """The three range queries of `episodes_from` at `step_s`: each point covers the
    step before it (range selectors are open at the start, so consecutive points cover
    every sample once), the first with the latest activeAt there, the others with the
    time of the last and of the first firing sample there (a 1 s subquery: rules are
    evaluated every second at the most; `timestamp` of a plain selector is the sample's
    own time)."""
    window = f"{max(1, math.ceil(step_s * 1000))}ms"
    fired = f'timestamp(ALERTS{{alertstate="firing"}})[{window}:1s]'
    return (f"max_over_time(ALERTS_FOR_STATE[{window}])", f"max_over_time({fired})",
            f"min_over_time({fired})")


def resume_query(key: str, run: str) -> str:
    """The run's RESUME_SERIES[key], of the one rank-0 process that resumed last (the
    newest resume timestamp): an agent keeps an exited process's series for its grace,
    and the max of each series on its own read the new process's step with the old one's
    steps recomputed."""
    at = f'{RESUME_SERIES["at"]}{{run="{run}"}}'
    return (f'max({RESUME_SERIES[key]}{{run="{run}"}} and on (instance, node, rank, '
            f"local_rank) ({at} == on () group_left () max({at})))")


def resumes_from(step: Sequence[tuple[float, float]], recomputed: Sequence[tuple[float, float]],
                 at: Sequence[tuple[float, float]]) -> list[Resume]:
    """Resume records from range queries of the three RESUME_SERIES (max over the
    run): one per distinct resume timestamp, whatever the step of the query."""
    steps, redo = dict(step), dict(recomputed)
    out: dict[float, Resume] = {}
    for t, when in at:
        if when not in out and t in steps:
            out[when] = Resume(int(steps[t]), int(redo.get(t, 0)), float(when))
    return sorted(out.values(), key=lambda r: r.at)


def inputs(prom: PrometheusClient, run: str, start: float, end: float, step_s: float,
           ) -> tuple[set[str], RankGpus, list[AlertEpisode], list[Resume]]:
    """What `build` needs from Prometheus over [start, end]: the run's nodes and the
    GPUs its ranks used, its alert episodes and the trainer's resume records. The Run
    page and the demo's printout both read them here, so both show the same incidents."""
    from clusterpulse.dashboard.promclient import at_once  # the client's own module

    def ranged(expr: str) -> list:
        return [(r.labels, r.points) for r in prom.query_range(expr, start, end, step_s)]

    def one(expr: str) -> list:
        rows = ranged(expr)
        return list(rows[0][1]) if rows else []

    # the seven queries are independent: asked at once, they take the slowest, where one
    # after the other they took the sum (the Run page's timeline, every refresh)
    for_state, firing, first_firing = alert_queries(step_s)
    got = at_once({
        "nodes": partial(prom.query, f'max by (node, rank, gpu) (max_over_time(clusterpulse_'
                         f'trainer_rank_info{{run="{run}"}}[{max(1, int(end - start))}s]))',
                         at=end),
        "for_state": partial(ranged, for_state), "firing": partial(ranged, firing),
        "first_firing": partial(ranged, first_firing),
        **{k: partial(one, resume_query(k, run)) for k in RESUME_SERIES}})
    nodes = {s.labels.get("node", "") for s in got["nodes"]}
    ranks: RankGpus = {}
    for s in got["nodes"]:
        if s.labels.get("gpu") and s.labels.get("rank"):
            ranks.setdefault((s.labels.get("node", ""), s.labels["rank"]), set()).add(
                s.labels["gpu"])
    episodes = episodes_from(got["for_state"], got["firing"], got["first_firing"], start)
    resumes = resumes_from(*(got[k] for k in RESUME_SERIES))
    return nodes, ranks, episodes, resumes


def latest_resume(prom: PrometheusClient, run: str) -> Resume | None:
    """The run's resume record now (its current rank 0 process's), or None before any
    restart: the Run page's action progress says where the run resumed from."""
    got = {k: prom.query(resume_query(k, run)) for k in RESUME_SERIES}
    if not all(got.values()):
        return None
    return Resume(int(got["step"][0].value), int(got["recomputed"][0].value),
                  got["at"][0].value)
