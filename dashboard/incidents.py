"""What the Run page shows about a hang and a straggler, from the run's data dict.

A hang is one incident: its root rank(s) (behind the others in collectives entered,
as RankHung pages them) and the ranks that wait for them, with the collective each
waits in. Pure functions over `dashboard.data.run`'s result, so they are tested
without a browser.
"""

from __future__ import annotations

import time
from dataclasses import dataclass, field

import pandas as pd

from clusterpulse.agent.validate import is_digits
from clusterpulse.dashboard import links


@dataclass
class HangIncident:
    roots: list[str]  # ranks; empty when the root cannot be told (the job is paged)
    waiters: dict[str, str] = field(default_factory=dict)  # rank -> what it waits in
    nodes: dict[str, str] = field(default_factory=dict)  # rank -> node

    def headline(self) -> str:
        def where(rank: str) -> str:
            return f"rank {rank} on {self.nodes.get(rank, '?')}"

        waits = sorted(set(self.waiters.values()) - {""})
        waiting = f"{len(self.waiters)} rank(s) wait" + (f" in {', '.join(waits)}"
                                                         if waits else "")
        if not self.roots:
            return f"Job stalled, no root can be told: {waiting}."
        return f"Hang rooted at {', '.join(where(r) for r in self.roots)}; {waiting}."


def hang_incident(d: dict) -> HangIncident | None:
    """None unless some rank is past its hang threshold or its hold threshold (either
    margin > 0, as RankHung reads them: on the hang margin alone the page said "no
    root can be told" while RankHung named the root)."""
    per = d["per_rank"]
    margins = [per.get("hang margin s", {}), per.get("hold margin s", {})]
    stalled = sorted({r for m in margins for r, v in m.items() if v is not None and v > 0},
                     key=_rank_order)
    if not stalled:
        return None
    behind = per.get("collectives behind", {})
    roots = sorted((r for r in stalled if (behind.get(r) or 0) > 0), key=_rank_order)
    nodes = {}
    ranks = d.get("ranks")
    if ranks is not None and not ranks.empty:
        nodes = dict(zip(ranks["rank"], ranks["node"], strict=False))
    waiters = {r: d.get("blocked", {}).get(r, "") for r in stalled if r not in roots}
    return HangIncident(roots, waiters, nodes)


GPU_DOWN = "GPU DOWN"  # the Run table's flag for a rank whose GPU is down, first
# ... for a rank flagged for short slowness that recurs (TrainingRecurringSlowness),
# after the stragglers: its cause names what it costs
RECURRING = "RECURRING"


def straggler_flag(score: float | None, flagged: float | None, threshold: float = 1.1) -> str:
    """The scorer's decision when the rank reports it, else score over the threshold."""
    if flagged is not None and flagged == flagged:
        return "STRAGGLER" if flagged >= 1 else ""
    return "STRAGGLER" if score and score > threshold else ""


# The Run table's columns for a human, decision first; the rest behind an expander.
# It had 18 columns and cut `flag` off at 1600 px.
RANK_COLUMNS = ["flag", "cause", "score", "rank", "node", "gpu", "GPU °C", "compute ms",
                "sync wait ms", "data wait ms", "bus MB/s", "heartbeat age s", "evidence"]
INTERNAL_COLUMNS = ["rank", "local_rank", "pid", "step", "self score", "compute s",
                    "sync wait s", "data wait s", "all-reduce s", "heartbeat age s"]


def rank_tables(d: dict, keep: dict[str, str] | None = None,
                ) -> tuple[pd.DataFrame, pd.DataFrame]:
    """(the ranks for a human, their internals): one row per rank, stragglers first.
    A cause is shown only for a flagged rank (the recording rule names one for every
    rank, and 'compute' beside a healthy rank read as a diagnosis); `evidence` links
    to the Node page at the rank's GPU."""
    ranks = d["ranks"]
    if ranks.empty:
        return pd.DataFrame(columns=RANK_COLUMNS), pd.DataFrame(columns=INTERNAL_COLUMNS)
    per = d["per_rank"]
    out = ranks[["rank", "node", "local_rank", "gpu", "pid"]].copy()
    for col in ("score", "self score", "compute s", "sync wait s", "data wait s",
                "heartbeat age s", "step", "all-reduce s"):
        out[col] = out["rank"].map(per.get(col, {}))
    # bytes each rank moved in the gradient all-reduce over its window: a slow link
    # on the ring lowers every rank's figure together (no rank is a straggler then)
    out["bus MB/s"] = (out["rank"].map(per.get("all-reduce bytes", {}))
                       / out["all-reduce s"] / 1e6)
    for col in ("compute", "sync wait", "data wait"):
        out[f"{col} ms"] = out[f"{col} s"] * 1e3
    out["GPU °C"] = out["rank"].map(d["gpu_temp"])
    flagged = out["rank"].map(per.get("flagged", {}))
    recurring = out["rank"].map(per.get("recurring", {})).fillna(0.0)
    down = d.get("gpu_down", set())  # a rank on a lost GPU scored 1.00x, its °C a dash
    out["flag"] = [GPU_DOWN if r in down else straggler_flag(sc, fl)
                   or (RECURRING if rc > 0 else "")
                   for r, sc, fl, rc in zip(out["rank"], out["score"], flagged, recurring,
                                            strict=True)]
    out["cause"] = [d["causes"].get(r, "") if f == "STRAGGLER"
                    else f"short stalls recurring: the job {rc:.2f}x slower" if f == RECURRING
                    else "" for r, f, rc in zip(out["rank"], out["flag"], recurring, strict=True)]
    out["evidence"] = [links.page_url("node", {"node": n, "gpu": g}, keep)
                       for n, g in zip(out["node"], out["gpu"], strict=True)]
    out["_order"] = out["rank"].map(_rank_order)
    out["_flag"] = out["flag"].map({GPU_DOWN: 0, "STRAGGLER": 1, RECURRING: 2}).fillna(3)
    out = out.sort_values(["_flag", "score", "_order"], ascending=[True, False, True])
    return out[RANK_COLUMNS].reset_index(drop=True), out[INTERNAL_COLUMNS].sort_values(
        "rank", key=lambda c: c.map(_rank_order)).reset_index(drop=True)


def _known(value: object) -> bool:
    return value is not None and value == value  # NaN is not equal to itself


def straggler_line(r: dict) -> str:
    """The line above the Run page's table for a flagged rank (a row of `rank_tables`),
    in words: a figure the rank did not report is named as missing ("GPU °C not
    reported"), where the line read "GPU at nan °C"."""
    def shown(col: str, fmt: str) -> str:
        return fmt.format(r[col]) if _known(r.get(col)) else f"{col} not reported"

    score = f"is {r['score']:.2f}x the typical rank" if _known(r.get("score")) \
        else "is flagged a straggler"
    evidence = ", ".join((shown("GPU °C", "GPU at {:.0f} °C"),
                          shown("data wait ms", "data wait {:.0f} ms"),
                          shown("sync wait ms", "sync wait {:.0f} ms")))
    return (f"Rank {r['rank']} on {r['node']} GPU {r['gpu']} {score} — cause: "
            f"**{r['cause'] or 'not named'}** ({evidence}). [Its GPU's charts]({r['evidence']})")


def timeline_row(row: dict, dated: bool = False) -> tuple[dict, dict]:
    """An Incident.row() as the Run page's timeline row and its expander's row; with
    `dated` (a window over more than one UTC day) its start with the date: at 7 d two
    hangs on different days read as the same "14:00:00"."""
    detected = time.strftime("%m-%d %H:%M:%S" if dated else "%H:%M:%S",
                             time.gmtime(row["detected"]))
    action = row["action"] if row["by"] == "-" else f"{row['action']} by {row['by']}"
    resumed = "-" if row["resumed from step"] is None else (
        f"from step {row['resumed from step']} at {row['resumed']}, "
        f"{row['steps recomputed']} steps recomputed")
    paged = "" if row["paged"] == "-" else f", paged {row['paged']}"
    head = {"began (UTC)": detected, "incident": f"{row['incident']} on {row['where']}{paged}"}
    return ({**head, "action": action, "resumed": resumed},
            {**head, "alerts": row["alerts"], "steps recomputed": row["steps recomputed"]})


def _rank_order(rank: object) -> int:
    """Ranks in numeric order ('10' after '2'), anything else last (another exporter's
    rank="r3" stopped the Run page's hang incident in sorted(key=int))."""
    text = str(rank)
    return int(text) if is_digits(text) else 1 << 30


def rate_against_usual(now: float, usual: float | None) -> str | None:
    """Steps/s against the run's own last 15 minutes ('-12 % vs 15 min'); None
    without a baseline (a rate alone says nothing of whether it is slow)."""
    if not usual:
        return None
    return f"{(now / usual - 1) * 100:+.0f} % vs 15 min"


def alert_groups(alerts: list, now: float,
                 placement: dict[str, tuple[set[str], dict]] | None = None) -> list[list]:
    """Active alerts (amclient.Alert) grouped by fault with the incident model
    (clusterpulse/incident.py: same node, overlapping in time), root first, the
    group with the most severe and newest alert first. Listed one by one, a lost
    GPU's GpuDown, GpuCriticalXid and its rank's RankHung read as three problems.
    `placement` (data.placement): where each run's ranks are, as the Run page's
    incidents read it; without it a node shared by two runs put one run's lost GPU
    with the other run's hang."""
    from clusterpulse import incident

    eps = [incident.AlertEpisode(a.name, a.labels, started(a.starts_at, now), now)
           for a in alerts]
    owner = {id(e): a for e, a in zip(eps, alerts, strict=True)}
    # per run, as the Run page's incidents are (incident.concerns: its own alerts and
    # the node alerts of its nodes, a GPU's of the GPUs its ranks use); a job alert of
    # one run never joins another's fault
    parts: list[tuple[list, dict | None]] = []
    left = list(eps)
    for run in sorted({e.labels.get("run", "") for e in eps} - {""}):
        placed, ranks = (placement or {}).get(run, (set(), None))
        nodes = ({e.node for e in eps if e.labels.get("run") == run} | placed) - {""}
        mine = [e for e in left if incident.concerns(run, nodes, e.labels, ranks)]
        left = [e for e in left if all(e is not m for m in mine)]
        parts.append((mine, ranks))
    groups = [[owner[id(e)] for e in sorted(g, key=lambda e: (incident.root_rank(e.name),
                                                              e.active_at))]
              for part, ranks in [*parts, (left, None)]
              for g in incident.group(part, ranks=ranks)]
    return sorted(groups, key=lambda g: (min(SEVERITY_ORDER.get(a.severity, 9) for a in g),
                                         -max(started(a.starts_at, now) for a in g)))


# Most severe first; anything else after these.
SEVERITY_ORDER = {"critical": 0, "warning": 1, "info": 2}


def run_alerts(alerts: list, placement: dict[str, tuple[set[str], dict]] | None = None
               ) -> dict[str, str]:
    """Per run, its active alerts as the Jobs table shows them, critical first
    ("JobStalled (critical), CheckpointStale (warning)"). A job-level alert names no
    node: the cluster page said "Critical alerts 1" beside "All nodes and GPUs
    healthy" for 9 minutes, with the alert nowhere on the page. With `placement`
    (data.placement), a node's or GPU's alert is also the run's whose ranks are there
    (incident.concerns): the demo's job read "training", no alert, while its rank's GPU
    was down."""
    from clusterpulse.incident import concerns

    order = {"critical": 0, "warning": 1}
    by_run: dict[str, list] = {}
    for a in alerts:
        if a.labels.get("run"):
            by_run.setdefault(a.labels["run"], []).append(a)
            continue
        for run, (nodes, ranks) in (placement or {}).items():
            if concerns(run, nodes, {**a.labels, "alertname": a.name}, ranks):
                by_run.setdefault(run, []).append(a)
    return {run: ", ".join(dict.fromkeys(
                f"{a.name} ({a.severity})"
                for a in sorted(items, key=lambda a: (order.get(a.severity, 2), a.name))))
            for run, items in by_run.items()}


def problem_rows(down: pd.DataFrame, nodes: pd.DataFrame, active: list) -> list[dict]:
    """The Cluster page's unhealthy GPUs and nodes (node, gpu, problem): each GPU down
    (data.cluster's `down`), each agent target not up (NODES_UP), and the active alerts
    on a node. A NodeAgentDown of a target the table does not hold already (one without
    a node name, from an address no agent ever answered at) is a row of its own, named
    by its address: skipped, the page said "All nodes and GPUs healthy" while it paged."""
    rows = [{"node": r["node"], "gpu": r["gpu"], "problem": f"GPU down: {r['reason']}"}
            for _, r in (down.iterrows() if not down.empty else [])]
    gone = nodes[nodes["up"] == 0] if not nodes.empty else nodes
    rows += [{"node": r["node"], "gpu": "", "problem": "agent unreachable"}
             for _, r in gone.iterrows()]
    shown = set(gone.get("node", [])) | set(gone.get("instance", []))
    for a in active:
        if a.name == "NodeAgentDown":
            where = a.labels.get("node") or a.labels.get("instance", "")
            if where and not {a.labels.get("node"), a.labels.get("instance")} & shown:
                rows.append({"node": where, "gpu": "", "problem": "agent unreachable"})
        elif "node" in a.labels and a.name != "GpuDown":
            rows.append({"node": a.labels["node"], "gpu": a.labels.get("gpu", ""),
                         "problem": a.annotations.get("summary", a.name)})
    return rows


def started(starts_at: str, now: float) -> float:
    """Alertmanager's startsAt (RFC 3339) as unix time; `now` if it cannot be read."""
    try:
        return pd.Timestamp(starts_at).timestamp()
    except (ValueError, TypeError):
        return now


def ago(seconds: float) -> str:
    """'40 s ago', '12 min ago', '3 h ago', '2 d ago': an age at a glance."""
    s = max(0.0, seconds)
    for size, unit in ((86400, "d"), (3600, "h"), (60, "min")):
        if s >= size:
            return f"{s / size:.0f} {unit} ago"
    return f"{s:.0f} s ago"
