"""A run's incident timeline: fault -> detection -> action -> first resumed step, and
the work lost, assembled from what the stack records anyway (Prometheus's ALERTS
series and the run's step series, the audit log). No peer dashboard shows this chain.

Pure functions on plain data, so the Run page renders them and tests feed them.
"""

from __future__ import annotations

from dataclasses import dataclass

# Alerts that carry no run label but concern the runs on their node.
NODE_ALERTS = {"NodeAgentDown", "GpuDown", "GpuCriticalXid", "GpuEccUncorrectable",
               "GpuThermalSlowdown", "GpuPowerBrake"}


@dataclass
class Incident:
    alert: str
    where: str  # node or rank the alert names
    fault_at: float  # last step progress before detection (or detection if no stall)
    detected_at: float
    action: str | None
    acted_at: float | None
    resumed_at: float | None
    resumed_step: int | None
    lost_steps: int


def episodes(series: list[tuple[dict, list[tuple[float, float]]]], gap_s: float,
             ) -> list[tuple[dict, float, float]]:
    """(labels, start, end) of each firing episode in a range query of ALERTS."""
    out = []
    for labels, points in series:
        start = last = None
        for t, _ in points:
            if start is None:
                start = last = t
            elif t - last > gap_s:
                out.append((labels, start, last))
                start = t
            last = t
        if start is not None:
            out.append((labels, start, last))
    return sorted(out, key=lambda e: e[1])


def incidents(run: str, nodes: set[str], alert_series: list[tuple[dict, list]],
              steps: list[tuple[float, float]], audit: list[dict], step_s: float,
              window_s: float = 600) -> list[Incident]:
    """One incident per alert episode concerning `run` (run label, or a node alert on a
    node of the run); `steps` is the run's max step over time at `step_s` resolution."""
    out = []
    for labels, start, _end in episodes(alert_series, gap_s=2.5 * step_s):
        name = labels.get("alertname", "")
        if labels.get("run") != run and not (name in NODE_ALERTS and labels.get("node") in nodes):
            continue
        where = labels.get("node", "") + (f" rank {labels['rank']}" if "rank" in labels else "")
        acts = sorted((r for r in audit if r.get("run") == run and start <= r.get("ts", 0)
                       <= start + window_s and r.get("outcome") in ("accepted", "partial")),
                      key=lambda r: r["ts"])
        act = acts[0] if acts else None
        before = [(t, v) for t, v in steps if t <= start]
        reached = max((v for _, v in before), default=0)
        fault_at = start
        for t, v in reversed(before):  # the job stalled: the fault is when steps stopped
            if v < reached:
                break
            fault_at = t
        after = [(t, v) for t, v in steps if t > (act["ts"] if act else start)]
        resumed_at = resumed_step = None
        low = min((v for _, v in after), default=None)
        if low is not None:
            at_low = False
            for t, v in after:  # the first step made after the lowest point
                at_low = at_low or v == low
                if at_low and v > low:
                    resumed_at, resumed_step = t, int(low)
                    break
        lost = max(0, int(reached - resumed_step)) if resumed_step is not None else 0
        out.append(Incident(name, where.strip(), fault_at, start,
                            act["action"] if act else None, act["ts"] if act else None,
                            resumed_at, resumed_step, lost))
    return out


def rows(items: list[Incident]) -> list[dict]:
    """Table rows, times relative to the fault, for the Run page."""
    def rel(t: float | None, base: float) -> str:
        return "-" if t is None else f"+{t - base:.0f} s"

    return [{"alert": i.alert, "where": i.where,
             "fault (last progress)": i.fault_at, "detected": rel(i.detected_at, i.fault_at),
             "action": f"{i.action} {rel(i.acted_at, i.fault_at)}" if i.action else "-",
             "first resumed step": "-" if i.resumed_at is None else
             f"{i.resumed_step} {rel(i.resumed_at, i.fault_at)}",
             "lost steps": i.lost_steps} for i in items]
