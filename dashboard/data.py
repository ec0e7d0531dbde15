"""What the pages show, fetched with a small, fixed number of PromQL queries per page.

Every fetch goes through `cached`: results are shared between all viewers of this
server for one refresh interval (st.cache_data is process-wide), so ten viewers cost
Prometheus what one does. When Prometheus is down, the last good result is returned
marked stale with the reason, never an exception.
"""

from __future__ import annotations

import math
import re
import time
from collections.abc import Callable
from dataclasses import dataclass, field
from functools import partial
from pathlib import Path
from typing import Any

import pandas as pd
import streamlit as st

from clusterpulse.agent.validate import is_digits
from clusterpulse.dashboard import auditview, config, explain
from clusterpulse.dashboard.amclient import AlertmanagerClient, AlertmanagerUnavailable
from clusterpulse.dashboard.config import Settings
from clusterpulse.dashboard.promclient import PrometheusClient, PrometheusError, at_once

# metric -> (PromQL per GPU, unit, whether high is good). `{sel}` stands for the label
# matchers of every selector: empty for the whole fleet, the heatmap's nodes after.
# The first is the page's default: temperature shows a GPU in trouble (an overheating,
# throttled GPU kept its utilization high and looked like the best cell).
HEATMAP_METRICS = {
    "temperature": ("clusterpulse_gpu_temperature_celsius{sel}", "°C", False),
    "utilization": ("clusterpulse_gpu_utilization_ratio{sel} * 100", "%", True),
    "power": ("clusterpulse_gpu_power_watts{sel}", "W", False),
    "memory": ("100 * clusterpulse_gpu_memory_used_bytes{sel}"
               " / clusterpulse_gpu_memory_total_bytes{sel}", "% used", False),
    "clocks": ("100 * clusterpulse_gpu_sm_clock_hertz{sel}"
               " / clusterpulse_gpu_sm_clock_max_hertz{sel}", "% of max", True),
    "errors": ("sum by (node, gpu) (clusterpulse:gpu_xid_recent{sel}) or "
               "0 * max by (node, gpu) (clusterpulse_gpu_up{sel})", "XIDs / 10 min", False),
}
# The temperature GpuTemperatureHigh fires above (deploy/prometheus/alerts.rules.yml):
# throttling is near. The Node page's charts mark it; the heatmap's scale is built round it.
GPU_THROTTLE_C = 85.0
# metric -> the heatmap's fixed colour range (values beyond it take its end colour), so
# that a colour means one value on every load: over the values shown, a normal 63 °C was
# as bright as a throttling 89 °C whenever they were the extremes. Temperature: 30 °C
# (idle) to 95 °C, 10 over the throttle line, so 85 °C sits near the top; the percentages
# their natural 0-100. Power (its range depends on the GPU model) and XID counts have no
# such range and keep a scale over the values shown.
HEATMAP_DOMAINS: dict[str, tuple[float, float]] = {
    "temperature": (30.0, GPU_THROTTLE_C + 10), "utilization": (0.0, 100.0),
    "memory": (0.0, 100.0), "clocks": (0.0, 100.0)}
# The heatmap shows at most this many nodes, those at the bad end of the metric
# (Prometheus picks them: topk/bottomk). 2,048 rows of 8 cells help nobody, and
# fetching and drawing 16,384 cells every refresh took the page tens of seconds.
HEATMAP_NODES = 64


@dataclass
class Result:
    value: Any
    stale: bool = False
    error: str = ""
    fetched_at: float = field(default_factory=time.time)


_last_good: dict[str, Result] = {}


def _guard(key: str, fn: Callable[[], Any]) -> Result:
    try:
        value = fn()
    except (PrometheusError, AlertmanagerUnavailable, config.SettingsError) as err:
        return _stale(key, str(err))
    result = Result(value)
    _last_good[key] = result
    return result


def _stale(key: str, error: str) -> Result:
    last = _last_good.get(key)
    return Result(last.value if last else None, stale=True, error=error,
                  fetched_at=last.fetched_at if last else 0.0)


def _range_query(prom: PrometheusClient, range_s: int, end: float | None = None,
                 ) -> Callable[[str], list]:
    """query_range over the page's window (up to now, or to `end`), ~200 points."""
    end = time.time() if end is None else end
    step = range_step(range_s)
    return lambda expr: prom.query_range(expr, end - range_s, end, step)


def range_step(range_s: float) -> float:
    """The step of the page's range queries (`_range_query`)."""
    return max(1.0, range_s / 200)


def _frame(samples, value: str = "value") -> pd.DataFrame:
    return pd.DataFrame([{**s.labels, value: s.value} for s in samples])


def _tagged(parts: dict[str, str]) -> str:
    """Several expressions as one query, each result tagged with its name (label
    `part`): one round trip where there were as many as parts."""
    return " or ".join(f'label_replace({e}, "part", "{name}", "", "")'
                       for name, e in parts.items())


def _matchers(*parts: str) -> str:
    """`{a,b}` of the non-empty label matchers given."""
    return "{" + ",".join(p for p in parts if p) + "}"


def exited(sel: str = "") -> str:
    """The ranks (run, rank, node) whose process has exited, of the runs `sel` selects
    (label matchers, empty for all): the agent exports such a rank's last figures for
    its grace period (300 s), with clusterpulse_trainer_process_alive 0, or with phase
    "exited" after its exit event (a clean finish, a preemption)."""
    phase = _matchers(sel, 'phase="exited"')
    return (f"(clusterpulse_trainer_process_alive{_matchers(sel)} == 0 or "
            f"clusterpulse_trainer_phase{phase})")


def live(expr: str, sel: str = "") -> str:
    """`expr`'s series less those of exited processes (`exited`). After a relaunch that
    renumbered the ranks, `max by (rank)` merged the dead process's compute time and
    growing heartbeat age into the live rank's for 5 minutes, and a finished run
    counted as running."""
    return f"({expr} unless on (run, rank, node) {exited(sel)})"


# -- the cluster page (7 queries + 1 Alertmanager call) -----------------------------
# The node each agent's address serves: one per address (an agent restarted there with
# another --node left two names, the join below was many-to-many, and Prometheus's 422
# blanked the page for an hour), the one seen last, over 30 days (as far back as
# NodeAgentDown looks: a node down for more than an hour left the page while it paged).
# When each name was last seen: its samples' own times, the newest as it is (a node
# scraped first since the last whole 5 s was listed by its address), read every 5 s over
# the last 10 minutes (a node down within a minute of its start was seen at no whole minute), every
# minute over the hour, every 5 minutes over the day and hourly over 30 days
# (`timestamp` in subqueries):
# 30 days of raw samples are 172,800 a series at a 15 s scrape, over Prometheus's
# 50 million a query at ~300 nodes. The rules record the same expression
# (clusterpulse:agent_node, which NodeAgentDown names its node by; the page computes it
# itself rather than wait for the record's first evaluation, and a test holds the two
# equal). Value 1.
_SEEN = 'timestamp(clusterpulse_agent_build_info{job=~"clusterpulse.*"})'
AGENT_NODE = ("topk by (instance) (1, max by (instance, node) ("
              + " or ".join([_SEEN] + [f"max_over_time({_SEEN}[{window}])"
                                        for window in ("10m:5s", "1h:1m", "1d:5m", "30d:1h")])
              + "))")
NODE_OF_ADDRESS = f"group by (instance, node) ({AGENT_NODE})"
# Each agent target up (1) or not (0), by node; a target no agent ever answered at is
# named by its scrape configuration's `target_node`, else its address
_UP = 'up{job=~"clusterpulse.*"}'
NODES_UP = (f"max by (node, instance) ({_UP} * on (instance) group_left (node) "
            f"{NODE_OF_ADDRESS} or on (instance) label_replace(label_replace({_UP}, "
            '"node", "$1", "instance", "(.*)"), "node", "$1", "target_node", "(.+)"))')
GPU_COUNTS = 'count_values("up", max by (node, gpu, uuid) (clusterpulse_gpu_up))'


def heatmap_query(metric: str, nodes: list[str] | None = None) -> str:
    """Per-GPU values of `metric`; with `nodes`, only theirs, selected by the index (the
    expression then reads 8 series a node instead of aggregating the whole fleet)."""
    expr = HEATMAP_METRICS[metric][0]
    sel = ""
    if nodes is not None:  # a regex of the names, escaped for RE2 and a PromQL string
        names = "|".join(re.escape(n).replace("\\", "\\\\") for n in nodes)
        sel = f'{{node=~"{names}"}}'
    return f"max by (node, gpu) ({expr.format(sel=sel)})"


def gpu_cells(samples: list, *labels: str) -> list:
    """The samples a node x GPU cell can be drawn from: a node, a GPU index (the
    agent's labels; another exporter writing these names with gpu="GPU-3" stopped the
    Cluster page with a ValueError) and `labels`."""
    return [s for s in samples if s.labels.get("node") and all(s.labels.get(k) for k in labels)
            and is_digits(s.labels.get("gpu", ""))]


def cluster_gpu_data(prom: PrometheusClient, metric: str) -> tuple[dict[str, int], list]:
    """The page's GPU data, answered small by Prometheus: the GPUs counted (up="1"/"0"
    -> how many: 2 rows) and, at the same time, the heatmap's nodes (at most
    HEATMAP_NODES, at the bad end of `metric`: topk/bottomk over each node's worst
    GPU); then only their GPUs. Two round trips, not three: the count needs nothing
    from the others, and the page waited for it before asking for the nodes."""
    good_high = HEATMAP_METRICS[metric][2]
    per_gpu = heatmap_query(metric)
    got = at_once({"counts": partial(prom.query, GPU_COUNTS), "worst": partial(
        prom.query, f"bottomk({HEATMAP_NODES}, min by (node) ({per_gpu}))" if good_high
        else f"topk({HEATMAP_NODES}, max by (node) ({per_gpu}))")})
    counts = {s.labels["up"]: int(s.value) for s in got["counts"]}
    nodes = sorted(s.labels["node"] for s in got["worst"] if "node" in s.labels)
    return counts, (prom.query(heatmap_query(metric, nodes)) if nodes else [])


# The Jobs table in one query: each run's step, whether a rank of it is restarting
# (leaving for a checkpoint-restart, or a new process still loading: phase start at
# step 0), and its last checkpoint. A restarted rank reports step 0 until it has
# loaded its checkpoint: the table said "step 0" during every restart. The trainer's
# own series, not the recorded clusterpulse:run_step: a rule evaluation later, a new
# run read "Running jobs 0" at step 8.
_RANK = "on (run, rank, node, local_rank) group_left ()"
# Where each run's ranks are (`placement` reads it): the Jobs table's and the Alerts
# page's grouping of a node's and a GPU's alerts by run
PLACEMENT = ('label_replace(max by (run, node, rank, gpu) (clusterpulse_trainer_rank_info), '
             '"part", "placement", "", "")')
JOBS = (f'label_replace(max by (run) ({live("clusterpulse_trainer_step")}), "part", "step", '
        '"", "") or '
        # a run with no live rank: its last step; exited (not running) only if its ranks
        # left cleanly, not while one's process is gone without its exit event (`gone`)
        'label_replace(max by (run) (clusterpulse_trainer_step), "part", "last", "", "") or '
        # ranks whose process is gone without leaving (phase not exited): a hard restart
        # (SIGKILL) or a torchrun relaunch, until the new processes register. They read
        # as exited, and the run as not running, for those seconds
        'label_replace(max by (run) ((clusterpulse_trainer_process_alive == 0) unless on '
        '(run, rank, node) clusterpulse_trainer_phase{phase="exited"}), "part", "gone", "", '
        '"") or '
        'label_replace('
        'max by (run) (clusterpulse_trainer_phase{phase="restarting"} or '
        f'clusterpulse_trainer_phase{{phase="start"}} * {_RANK} '
        '(clusterpulse_trainer_step == 0)), "part", "restarting", "", "") or label_replace('
        'max by (run) (clusterpulse_trainer_checkpoint_last_step), "part", "checkpoint", "", "") '
        # where each run's ranks are: a GPU's or node's alert is the run's too (`placement`)
        f"or {PLACEMENT}")


EXITED = "exited"
# a run with no live rank, one of whose processes is gone without leaving cleanly
GONE = "restarting (process gone)"


def jobs(samples: list) -> pd.DataFrame:
    """run, step, state: one row per run that reports a step; during a restart its step
    is blank and its state says which checkpoint it restarts from; a run whose ranks
    have all left cleanly (phase exited) shows its last step, state EXITED (`running`
    leaves it out). One with a rank whose process is gone without that (a hard restart,
    a torchrun relaunch, before the new processes register) is GONE: still running."""
    parts: dict[str, dict[str, float]] = {}
    for x in samples:
        if x.labels.get("part") != "placement":
            parts.setdefault(x.labels.get("part", ""), {})[x.labels.get("run", "")] = x.value
    rows = []
    steps, restarting = parts.get("step", {}), parts.get("restarting", {})
    for run in sorted(set(steps) | set(restarting)):  # a run still loading is running too
        ckpt = parts.get("checkpoint", {}).get(run)
        if run in restarting:
            rows.append({"run": run, "step": None, "state": "starting" if ckpt is None
                         else f"restarting from checkpoint {ckpt:.0f}"})
        else:
            rows.append({"run": run, "step": steps[run], "state": "training"})
    gone = parts.get("gone", {})
    for run in sorted(set(parts.get("last", {})) - set(steps) - set(restarting)):
        rows.append({"run": run, "step": None if run in gone else parts["last"][run],
                     "state": GONE if run in gone else EXITED})
    return pd.DataFrame(rows, columns=["run", "step", "state"])


def running(runs: pd.DataFrame) -> int:
    """The Cluster page's "Running jobs": the Jobs table's runs less the exited ones (a
    cleanly finished job counted for the agent's 5-minute grace); a run restarting with
    its processes gone (GONE) is running."""
    return int((runs["state"] != EXITED).sum()) if not runs.empty else 0


def placement(samples: list) -> dict[str, tuple[set[str], dict]]:
    """Per run, its nodes and the GPUs its ranks use ((node, rank) -> GPUs), from JOBS's
    placement part: what `incident.concerns` needs to tell a node's or GPU's alert as a
    run's."""
    out: dict[str, tuple[set[str], dict]] = {}
    for x in samples:
        if x.labels.get("part") != "placement":
            continue
        nodes, ranks = out.setdefault(x.labels.get("run", ""), (set(), {}))
        node = x.labels.get("node", "")
        nodes.add(node)
        if x.labels.get("gpu"):
            ranks.setdefault((node, x.labels.get("rank", "")), set()).add(x.labels["gpu"])
    return out


def run_step(per_rank: dict[str, dict[str, float]]) -> tuple[str, str | None]:
    """The Run page's Step figure and its caption. A restarted rank reports step 0
    until it has loaded its checkpoint, so during every restart the figure read
    "Step 0" (issue #28): a run whose ranks are all behind its last checkpoint is
    restarting from it, as the Cluster page's Jobs table says (`jobs`)."""
    step = max(per_rank["step"].values(), default=None)
    ckpt = max(per_rank["checkpoint step"].values(), default=None)
    if step is None:  # no rank reports one: nothing known, not "Step 0"
        return MISSING, None
    if ckpt is not None and step < ckpt:
        return "restarting", f"from checkpoint step {ckpt:.0f}"
    return f"{step:.0f}", None


# What a figure shows when its value is missing (the tables' ui.MISSING): "0 %" and
# "nan" read as values.
MISSING = "—"


def figure(value: float | None, fmt: str) -> str:
    """`value` formatted, or MISSING when there is none (None or NaN)."""
    return MISSING if value is None or value != value else fmt.format(value)


def run_figures(per_rank: dict[str, dict[str, float]]) -> dict[str, str]:
    """The Run page's Loss, Restarts, Goodput and Last checkpoint as shown (rank 0's loss
    and goodput): a dash where no rank reports one. A cleanly finished run read "Loss
    nan", "Goodput 0 %" and "Last checkpoint none" beside a Jobs table that said it
    exited at step 500; "none" only while ranks report a step without a checkpoint."""
    ckpt = max(per_rank["checkpoint step"].values(), default=None)
    goodput = per_rank["goodput"].get("0")
    return {"Loss": figure(per_rank["loss"].get("0"), "{:.3f}"),
            "Restarts": figure(max(per_rank["restarts"].values(), default=None), "{:.0f}"),
            "Goodput": figure(None if goodput is None else goodput * 100, "{:.0f} %"),
            "Last checkpoint": figure(ckpt, "step {:.0f}") if ckpt is not None or
            not per_rank["step"] else "none"}


@st.cache_data(ttl=5, show_spinner=False)
def cluster(prom_url: str, am_url: str, metric: str) -> Result:
    def fetch() -> dict:
        prom = _prometheus(prom_url)
        _, unit, good_high = HEATMAP_METRICS[metric]

        def active_alerts() -> tuple[list, str]:
            try:
                return _alertmanager(am_url).alerts(), ""
            except AlertmanagerUnavailable as err:
                return [], str(err)

        got = at_once({
            "nodes": partial(prom.query, NODES_UP),
            "gpus": partial(cluster_gpu_data, prom, metric),  # two steps, in turn
            "down": partial(prom.query,
                            "max by (node, gpu, reason) (clusterpulse_gpu_down_reason)"),
            "runs": partial(prom.query, JOBS),
            "goodput": partial(prom.query, "max by (run) (clusterpulse_trainer_goodput_ratio)"),
            "alerts": active_alerts})
        counts, heat_rows = got["gpus"]
        alerts, am_error = got["alerts"]
        return {"nodes": _frame(got["nodes"], "up"), "gpus_up": counts.get("1", 0),
                "gpus_total": sum(counts.values()), "heat": _frame(gpu_cells(heat_rows)),
                "unit": unit, "good_high": good_high, "heat_nodes": HEATMAP_NODES,
                "down": _frame(gpu_cells(got["down"], "reason")), "runs": jobs(got["runs"]),
                "placement": placement(got["runs"]),
                "goodput": _frame(got["goodput"], "goodput"), "alerts": alerts,
                "am_error": am_error, "queries": prom.queries}

    return _guard(f"cluster:{prom_url}:{metric}", fetch)


# -- the node page --------------------------------------------------------------------
NODE_SERIES = {
    "utilization %": "100 * clusterpulse_gpu_utilization_ratio{node=NODE}",
    "temperature °C": "clusterpulse_gpu_temperature_celsius{node=NODE}",
    "power W": "clusterpulse_gpu_power_watts{node=NODE}",
    "SM clock MHz": "clusterpulse_gpu_sm_clock_hertz{node=NODE} / 1e6",
    "memory used GiB": "clusterpulse_gpu_memory_used_bytes{node=NODE} / 2^30",
    "PCIe rx MB/s": "rate(clusterpulse_gpu_pcie_rx_bytes_total{node=NODE}[1m]) / 1e6",
    "NVLink tx MB/s": "rate(clusterpulse_gpu_nvlink_tx_bytes_total{node=NODE}[1m]) / 1e6",
}


# Link health of one node, each part a per-GPU (or per-port) expression; they are
# fetched as one query (`label_replace` tags each with "part") and pivoted here.
GPU_LINK_PARTS = {
    "pcie_gen": "max by (gpu) (clusterpulse_gpu_pcie_link_generation{node=NODE})",
    "pcie_gen_max": "max by (gpu) (clusterpulse_gpu_pcie_link_generation_max{node=NODE})",
    "pcie_width": "max by (gpu) (clusterpulse_gpu_pcie_link_width_lanes{node=NODE})",
    "pcie_width_max": "max by (gpu) (clusterpulse_gpu_pcie_link_width_max_lanes{node=NODE})",
    "pcie_replays_10m":
        "sum by (gpu) (increase(clusterpulse_gpu_pcie_replays_total{node=NODE}[10m]))",
    "nvlinks": "count by (gpu) (clusterpulse_gpu_nvlink_up{node=NODE})",
    "nvlinks_up": "count by (gpu) (clusterpulse_gpu_nvlink_up{node=NODE} == 1)",
    "nvlink_errors_10m":
        "sum by (gpu) (increase(clusterpulse_gpu_nvlink_errors_total{node=NODE}[10m]))",
}
NIC_PORT = "device, port, kind"


def _nic_sum(*counters: str) -> str:
    """Counters of one port added up. Each gets a label of its own first: after
    increase() drops the name they share labels, and `a or b` would keep only a."""
    tagged = [f'label_replace(increase(clusterpulse_nic_{c}_total{{node=NODE}}[10m]), '
              f'"counter", "{c}", "", "")' for c in counters]
    return f"sum by ({NIC_PORT}) ({' or '.join(tagged)})"


NIC_LINK_PARTS = {
    "up": f"max by ({NIC_PORT}) (clusterpulse_nic_port_up{{node=NODE}})",
    "rx_mb_s": f"sum by ({NIC_PORT}) "
               "(rate(clusterpulse_nic_receive_bytes_total{node=NODE}[1m])) / 1e6",
    "tx_mb_s": f"sum by ({NIC_PORT}) "
               "(rate(clusterpulse_nic_transmit_bytes_total{node=NODE}[1m])) / 1e6",
    "errors_10m": _nic_sum("symbol_errors", "receive_errors", "transmit_errors"),
    "flaps_10m": _nic_sum("link_downed", "carrier_changes"),
}


def _parts(prom: PrometheusClient, parts: dict[str, str], node: str, keys: list[str]
           ) -> pd.DataFrame:
    """One query for several per-key expressions; one row per key, one column per part."""
    sel = f'"{node}"'
    expr = _tagged({name: e.replace("NODE", sel) for name, e in parts.items()})
    rows = [{**{k: s.labels.get(k, "") for k in keys}, "part": s.labels["part"],
             "value": s.value} for s in prom.query(expr)]
    if not rows:
        return pd.DataFrame(columns=keys)
    wide = pd.DataFrame(rows).pivot_table(index=keys, columns="part", values="value",
                                          aggfunc="max").reset_index()
    return wide.reindex(columns=[*keys, *parts])


def _num(v: Any, fmt: str = ".0f") -> str | None:
    return None if v is None or pd.isna(v) else format(v, fmt)


def gpu_link_health(wide: pd.DataFrame, down: dict[str, str] | None = None) -> pd.DataFrame:
    """Per GPU: PCIe as trained vs its maximum, NVLinks up, errors; and what is wrong.
    `down`: gpu -> why it is down (clusterpulse_gpu_down_reason). A down GPU reports no
    link series: it read `Gennan xnan`, NVLinks 0 / 0, health ok."""
    down = down or {}
    out = []
    rows = {str(r["gpu"]): r for _, r in wide.iterrows()}
    for gpu in sorted(set(rows) | set(down), key=lambda g: (len(g), g)):
        r = rows.get(gpu, pd.Series(dtype=float))
        if gpu in down:
            out.append({"gpu": gpu, "PCIe": "-", "NVLinks up": "-",
                        "NVLink errors (10 min)": None, "PCIe replays (10 min)": None,
                        "health": f"DOWN: {explain.down_reason(down[gpu])}"})
            continue
        problems = []
        gen, width = _num(r.get("pcie_gen")), _num(r.get("pcie_width"))
        gen_max, width_max = _num(r.get("pcie_gen_max")), _num(r.get("pcie_width_max"))
        if width and width_max and float(width) < float(width_max):
            problems.append(f"PCIe x{width} of x{width_max}")
        links = 0 if pd.isna(r.get("nvlinks")) else int(r["nvlinks"])
        up = 0 if pd.isna(r.get("nvlinks_up")) else int(r["nvlinks_up"])
        if up < links:
            problems.append(f"{links - up} NVLink(s) down")
        for part, what in (("nvlink_errors_10m", "NVLink errors"),
                           ("pcie_replays_10m", "PCIe replays")):
            if (_num(r.get(part)) or "0") != "0":
                problems.append(f"{r[part]:.0f} {what}")
        pcie = (f"Gen{gen} x{width} (max Gen{gen_max or '?'} x{width_max or '?'})"
                if gen and width else "not reported")
        out.append({
            "gpu": gpu, "PCIe": pcie,
            "NVLinks up": f"{up} / {links}" if links else "none",
            "NVLink errors (10 min)": r.get("nvlink_errors_10m"),
            "PCIe replays (10 min)": r.get("pcie_replays_10m"),
            "health": "; ".join(problems) or "ok",
        })
    return pd.DataFrame(out)


# GpuReadingsFailing's ratio (deploy/prometheus/alerts.rules.yml): below it, failed
# readings are one-offs the page does not warn of (one in a 10-minute window is 0.2 %)
FAILING_SHARE = 0.5
# Its evidence, one query (`_tagged`: every part read at the same moment): the readings
# that failed in the last 10 minutes and in the latest cycle, by card; the share of the
# agent's cycles with a failure; the cards up now.
FAILING_PARTS = {
    "window": "max by (gpu, uuid, metric) (last_over_time("
              "clusterpulse_gpu_reading_failing{node=NODE}[10m]))",
    "now": "max by (gpu, uuid, metric) (clusterpulse_gpu_reading_failing{node=NODE})",
    "share": "sum by (gpu, uuid) (increase(clusterpulse_gpu_failed_reading_cycles_total"
             "{node=NODE}[10m])) / scalar(sum(increase(clusterpulse_agent_collections_total"
             "{node=NODE}[10m])))",
    "up": "max by (gpu, uuid) (clusterpulse_gpu_up{node=NODE} == 1)",
}


@dataclass(frozen=True)
class FailingReadings:
    """A GPU up whose NVML readings fail: the share of the agent's cycles of the last 10
    minutes with a failure, the readings that failed then, and those of the latest."""

    share: float
    readings: list[str]
    now: list[str]


def failing_readings(samples: list) -> dict[str, FailingReadings]:
    """gpu -> its FailingReadings (FAILING_PARTS' samples), for the card up now at that
    index (a replaced card does not inherit its predecessor's) at GpuReadingsFailing's
    ratio or above. Such a GPU answers its liveness probe but not its other readings:
    up, with gaps where its temperature, power or error counters should be, and the
    alerts that read them cannot fire."""
    parts: dict[str, dict[tuple[str, str], Any]] = {"window": {}, "now": {}, "share": {},
                                                     "up": {}}
    for x in samples:
        part = parts.get(x.labels.get("part", ""))
        card = (x.labels.get("gpu", ""), x.labels.get("uuid", ""))
        if part is None or not math.isfinite(x.value):
            continue
        if "metric" in x.labels:
            if x.value >= 1:
                part.setdefault(card, set()).add(x.labels["metric"])
        else:
            part[card] = x.value
    found: dict[str, FailingReadings] = {}
    for card, share in parts["share"].items():
        gpu = card[0]
        if card not in parts["up"] or share < FAILING_SHARE or card not in parts["window"]:
            continue
        if gpu in found and found[gpu].share >= share:  # two cards up at one index
            continue
        # `increase` extrapolates to the window's ends: every cycle failing reads ~104 %
        found[gpu] = FailingReadings(min(share, 1.0), sorted(parts["window"][card]),
                                     sorted(parts["now"].get(card, ())))
    return dict(sorted(found.items(), key=lambda kv: (len(kv[0]), kv[0])))


@st.cache_data(ttl=5, show_spinner=False)
def node(prom_url: str, name: str, range_s: int, end: float | None = None) -> Result:
    def fetch() -> dict:
        prom = _prometheus(prom_url)
        ranged = _range_query(prom, range_s, end)
        sel = f'"{name}"'
        got = at_once({
            **{title: partial(ranged, f"max by (gpu) ({expr.replace('NODE', sel)})")
               for title, expr in NODE_SERIES.items()},
            "throttle": partial(ranged, f'max by (gpu, reason) (clusterpulse_gpu_clock_event_'
                                f'active{{node={sel},reason!="gpu_idle"}} == 1)'),
            "xid": partial(prom.query,
                           f'sum by (gpu, xid) (clusterpulse:gpu_xid_recent{{node={sel}}})'),
            "ecc": partial(prom.query, f'max by (gpu, kind) '
                           f'(clusterpulse_gpu_ecc_errors_total{{node={sel}}})'),
            "down": partial(prom.query,
                            f"max by (gpu, reason) (clusterpulse_gpu_down_reason{{node={sel}}})"),
            "failing": partial(prom.query, _tagged(
                {part: e.replace("NODE", sel) for part, e in FAILING_PARTS.items()})),
            "gpu_links": partial(_parts, prom, GPU_LINK_PARTS, name, ["gpu"]),
            "nics": partial(_parts, prom, NIC_LINK_PARTS, name, ["device", "port", "kind"])})
        series = {title: _wide(got[title], "gpu") for title in NODE_SERIES}
        events, ecc = _frame(got["xid"], "count"), _frame(got["ecc"], "count")
        down = {s.labels.get("gpu", ""): s.labels.get("reason", "unknown") for s in got["down"]}
        gpu_links = gpu_link_health(got["gpu_links"], down)
        if not events.empty:  # what each XID means, next to its code
            events["meaning"] = events["xid"].map(explain.xid)
        nics = got["nics"]
        return {"series": series, "throttle": [(r.labels, r.points) for r in got["throttle"]],
                "step": range_step(range_s),
                "down": down, "failing": failing_readings(got["failing"]),
                "xid": events, "ecc": ecc, "gpu_links": gpu_links, "nics": nics,
                "queries": prom.queries}

    return _guard(f"node:{prom_url}:{name}:{range_s}:{end}", fetch)


def throttle_episodes(throttle: list, step: float, gpu: str | None = None) -> pd.DataFrame:
    """The Node page's throttle table: one row per episode of a reason on a GPU (of
    `gpu` only, if given), from the range query's points (`node`'s "throttle": only
    where the reason is active, at `step`). A gap of more than a step between two
    points ends an episode: two throttlings 50 minutes apart read as one of 51."""
    rows = []
    for labels, points in throttle:
        times = [t for t, _ in points]
        if not times or (gpu is not None and labels.get("gpu") != gpu):
            continue
        starts = [0, *(i for i in range(1, len(times)) if times[i] - times[i - 1] > step * 1.5)]
        for a, b in zip(starts, [*starts[1:], len(times)], strict=True):
            rows.append({"gpu": labels.get("gpu"), "reason": labels.get("reason"),
                         "from (UTC)": pd.Timestamp(times[a], unit="s"),
                         "until (UTC)": pd.Timestamp(times[b - 1], unit="s")})
    return pd.DataFrame(rows)


# The figures of one GPU's line on the Node page (its title in NODE_SERIES -> as read)
GPU_NOW = ("temperature °C", "SM clock MHz", "utilization %", "power W")


@dataclass
class GpuNow:
    """One GPU's latest figures (NODE_SERIES title -> value), the throttle reasons it
    had in the window, and why it is down (None when it is up)."""

    figures: dict[str, float]
    throttled: list[str]
    down: str | None


@st.cache_data(ttl=5, show_spinner=False)
def gpu_now(prom_url: str, name: str, gpu: str, range_s: int, end: float | None = None
            ) -> Result:
    """The Node page's line for the GPU a link opened it at, from one instant query: the
    page's own fetch (`node`, 13 queries, 8 of them ranges, and their frames) took
    0.15-0.3 s of the server under load before the line could be drawn. `gpu` is a
    device index (digits), checked here: it comes from the URL and goes into PromQL."""
    if not is_digits(gpu):
        raise ValueError(f"gpu must be a device index, not {gpu!r}")
    sel = f'"{name}",gpu="{gpu}"'
    parts = {title: f"max ({NODE_SERIES[title].replace('NODE', sel)})" for title in GPU_NOW}
    parts["throttle"] = (f"max by (reason) (max_over_time(clusterpulse_gpu_clock_event_active"
                         f'{{node={sel},reason!="gpu_idle"}}[{int(range_s)}s])) == 1')
    parts["down"] = f"max by (reason) (clusterpulse_gpu_down_reason{{node={sel}}})"

    def fetch() -> GpuNow:
        got = _prometheus(prom_url).query(_tagged(parts), at=end)
        by_part: dict[str, list] = {}
        for sample in got:
            by_part.setdefault(sample.labels["part"], []).append(sample)
        down = by_part.get("down", [])
        return GpuNow({t: by_part[t][0].value for t in GPU_NOW if by_part.get(t)},
                      sorted(x.labels.get("reason", "") for x in by_part.get("throttle", [])),
                      down[0].labels.get("reason", "unknown") if down else None)

    return _guard(f"gpu-now:{prom_url}:{name}:{gpu}:{range_s}:{end}", fetch)


def _wide(rows, key: str) -> pd.DataFrame:
    frames = [pd.Series({pd.Timestamp(t, unit="s"): v for t, v in r.points},
                        name=f"{key} {r.labels.get(key, '?')}") for r in rows]
    return pd.concat(frames, axis=1).sort_index() if frames else pd.DataFrame()


@st.cache_data(ttl=5, show_spinner=False)
def node_names(prom_url: str) -> Result:
    return _guard("node-names", lambda: sorted({s.labels["node"] for s in _prometheus(
        prom_url).query("max by (node) (clusterpulse_agent_build_info)")}))


@st.cache_data(ttl=5, show_spinner=False)
def run_names(prom_url: str) -> Result:
    return _guard("run-names", lambda: sorted({s.labels["run"] for s in _prometheus(
        prom_url).query("clusterpulse:run_step")}))


@st.cache_data(ttl=5, show_spinner=False)
def central_audit_heads_seen(prom_url: str, days: int = 7) -> Result:
    """The heads of the central audit log Prometheus saw (the remediation receiver
    publishes them), one a minute over `days` (10,080 points: under Prometheus's 11,000
    a query) and every second over the last hour, by sequence number, as Head(seq, hex
    prefix of its hash). The file alone cannot
    show records cut from its end, nor a record deleted with the chain rebuilt after
    it; a head seen earlier that the file no longer holds shows both."""
    from clusterpulse.agent.audit import Head

    def fetch() -> list[Head]:
        prom, end = _prometheus(prom_url), time.time()
        heads: set[Head] = set()
        # one a minute over the days, and every second over the last hour: a record
        # rewritten a minute after it was written is there only at scrape resolution
        windows = {"days": (end - days * 86400, 60.0), "hour": (end - 3600, 1.0)}
        got = at_once({f"{w}:{name}": partial(
            prom.query_range, f'clusterpulse_audit_head_{name}{{log="central"}}', start, end,
            step) for w, (start, step) in windows.items() for name in ("sequence", "hash_prefix")})
        for w in windows:
            # each target's sequence with its own hash, never one's with another's (a
            # receiver scraped twice would pair values of two scrapes)
            seqs, prefixes = ({tuple(sorted((k, v) for k, v in r.labels.items()
                                            if k != "__name__")): dict(r.points)
                               for r in got[f"{w}:{name}"]}
                              for name in ("sequence", "hash_prefix"))
            for key, points in seqs.items():
                mine = prefixes.get(key, {})
                heads |= {Head(int(seq), f"{int(mine[t]):012x}")
                          for t, seq in points.items() if t in mine}
        return sorted(heads, key=lambda h: h.seq)
    return _guard(f"central-audit-heads:{prom_url}:{days}", fetch)


# -- the run page ---------------------------------------------------------------------
# The straggler table's columns, each rank's value of a metric: fetched as one query
# (`_tagged`), where they were 18.
_T = "clusterpulse_trainer_"
PER_RANK = {"step": _T + "step", "score": _T + "straggler_score",
            "self score": _T + "straggler_self_score", "flagged": _T + "straggler_flagged",
            "recurring": _T + "straggler_recurring",
            "collectives behind": "clusterpulse:rank_collectives_behind",
            "hang margin s": "clusterpulse:rank_hang_margin_seconds",
            "hold margin s": "clusterpulse:rank_hold_margin_seconds",
            "compute s": _T + "compute_seconds", "sync wait s": _T + "sync_wait_seconds",
            "data wait s": _T + "data_wait_seconds", "all-reduce s": _T + "comm_seconds",
            "all-reduce bytes": _T + "comm_bytes",
            "heartbeat age s": _T + "heartbeat_age_seconds", "restarts": _T + "restarts_total",
            "checkpoint step": _T + "checkpoint_last_step",
            "checkpoint time": _T + "checkpoint_last_timestamp_seconds",
            "checkpoint blocking s": _T + "checkpoint_blocking_seconds",
            "loss": _T + "loss", "goodput": _T + "goodput_ratio"}


# The Run page's figures a run with no live rank keeps from its ranks' last values (the
# agent exports an exited rank's for its grace, 5 min): a cleanly finished run read
# "Step 0" while the Jobs table said it exited at step 500. The straggler table's
# timings stay live only.
LAST_KEPT = frozenset({"step", "loss", "goodput", "restarts", "checkpoint step",
                       "checkpoint time", "checkpoint blocking s"})


def per_rank_expr(col: str, metric: str, sel: str) -> str:
    """One PER_RANK column's series of the run `sel` selects: the live ranks', and for a
    LAST_KEPT column of a run with no live rank, the last ones exported."""
    expr = live(f"{metric}{{{sel}}}", sel)
    if col not in LAST_KEPT:
        return expr
    return (f"{expr} or ({metric}{{{sel}}} unless on (run) "
            f"{live(f'clusterpulse_trainer_rank_info{{{sel}}}', sel)})")


@st.cache_data(ttl=5, show_spinner=False)
def run(prom_url: str, name: str, range_s: int, end: float | None = None) -> Result:
    def fetch() -> dict:
        prom = _prometheus(prom_url)
        ranged = _range_query(prom, range_s, end)
        sel = f'run="{name}"'
        rate = f"sum (rate(clusterpulse_trainer_steps_total{{{sel},rank='0'}}[1m]))"
        # ranks whose GPU is down: their own series look healthy (the last step's
        # figures, kept) or are absent. Now for the table, over the window for the
        # compute heatmap, which drew such a rank's stale step time as a healthy cell.
        down = (f"max by (rank) (clusterpulse:rank_gpu{{{sel}}} "
                "and on (node, gpu) (clusterpulse_gpu_up == 0))")
        info = f"clusterpulse_trainer_rank_info{{{sel}}}"
        got = at_once({
            # one row per live process; a rank with none (it exited and was not
            # relaunched) keeps its last one, its live figures blank
            "ranks": partial(prom.query, f"max by (run, rank, node, local_rank, gpu, pid) "
                             f"({live(info, sel)} or ({info} unless on (run, rank) "
                             f"{live(info, sel)}))"),
            "per_rank": partial(prom.query, _tagged(
                {col: f"max by (rank) ({per_rank_expr(col, metric, sel)})"
                 for col, metric in PER_RANK.items()})),
            "causes": partial(prom.query, f"clusterpulse:rank_straggler_cause{{{sel}}}"),
            "blocked": partial(prom.query, f"clusterpulse_trainer_blocked_collective{{{sel}}}"),
            "evidence": partial(prom.query, f"max by (rank) (clusterpulse:rank_gpu{{{sel}}} * on "
                                "(node, gpu) group_left () max by (node, gpu) "
                                "(clusterpulse_gpu_temperature_celsius))"),
            "gpu_down": partial(prom.query, down),
            "compute": partial(ranged, "max by (rank) "
                               f"({live(f'clusterpulse_trainer_compute_seconds{{{sel}}}', sel)})"),
            "compute_down": partial(ranged, down),
            "loss": partial(ranged, f"avg (clusterpulse_trainer_loss{{{sel}}})"),
            "rate": partial(prom.query, rate),
            # its own recent baseline: a rate alone says nothing of whether it is slow
            # (the mean of the 1 min rate: rate over 15 min undercounts a younger run)
            "usual": partial(prom.query, f"avg_over_time({rate}[15m:15s])"),
            "restarts": partial(ranged, f"max (clusterpulse_trainer_restarts_total{{{sel}}})")})
        per_rank: dict[str, dict[str, float]] = {col: {} for col in PER_RANK}
        for s in got["per_rank"]:
            per_rank[s.labels["part"]][s.labels["rank"]] = s.value
        rate_now, usual = got["rate"], got["usual"]
        return {"ranks": _frame(got["ranks"], "info"), "per_rank": per_rank,
                "causes": {s.labels["rank"]: s.labels.get("cause", "") for s in got["causes"]},
                "gpu_temp": {s.labels["rank"]: s.value for s in got["evidence"]},
                "gpu_down": {s.labels["rank"] for s in got["gpu_down"]},
                "blocked": {s.labels["rank"]: f"{s.labels.get('op', '')} #{s.value:.0f}"
                            for s in got["blocked"]},
                "compute": _wide(got["compute"], "rank"),
                "compute_down": _wide(got["compute_down"], "rank"),
                "loss": _wide(got["loss"], "run"),
                "step_rate": rate_now[0].value if rate_now else 0.0,
                "step_rate_usual": usual[0].value if usual else None,
                "restarts": _wide(got["restarts"], "run"), "queries": prom.queries}

    return _guard(f"run:{prom_url}:{name}:{range_s}:{end}", fetch)


# The incident timeline reads this much before the window too, and shows each incident
# that fired in the window whole: a custom window that began between a lost GPU's
# GpuDown and the end of its XID alert showed "GpuCriticalXid ..., no action".
INCIDENT_LOOKBACK_S = 600
# Its query step: at most 30 s (two episodes of one alert in one step are read as one:
# at the 24 h range's step of 216 s a rank's two hangs 46 s apart were one incident, and
# which one changed with each refresh), and no more than 10,000 points a series (under
# Prometheus's 11,000).
INCIDENT_MAX_STEP_S = 30.0


def incident_step(span_s: float) -> float:
    return max(1.0, span_s / 10_000, min(span_s / 400, INCIDENT_MAX_STEP_S))


def fired_since(items: list, start: float) -> list:
    """The incidents (read from before `start`, whole) that still fired at or after it."""
    return [i for i in items if i.ended_at >= start]


@st.cache_data(ttl=5, show_spinner=False)
def run_incidents(prom_url: str, name: str, range_s: int, audit_path: str,
                  end: float | None = None) -> Result:
    """The run's incidents that fired in the page's window, each whole
    (clusterpulse/incident.py)."""
    from clusterpulse import incident
    from clusterpulse.agent.audit import AuditLog

    def fetch() -> list:
        prom = _prometheus(prom_url)
        until = time.time() if end is None else end
        span = range_s + INCIDENT_LOOKBACK_S
        nodes, ranks, episodes, resumes = incident.inputs(prom, name, until - span, until,
                                                         incident_step(span))
        try:  # the Audit page's records: a damaged one would stop the timeline
            audit = auditview.usable(AuditLog(Path(audit_path)).read(5000))[0] \
                if audit_path else []
        except OSError:  # unreadable: the timeline without the actions (the Audit
            audit = []   # page says why)
        return fired_since(incident.build(name, nodes, episodes, audit, resumes, ranks=ranks,
                                          until=until), until - range_s)

    return _guard(f"incidents:{prom_url}:{name}:{range_s}:{end}", fetch)


@st.cache_data(ttl=2, show_spinner=False)
def run_resume(prom_url: str, name: str) -> Result:
    """Where the run's current processes resumed from (clusterpulse/incident.py)."""
    from clusterpulse import incident

    return _guard(f"resume:{prom_url}:{name}",
                  lambda: incident.latest_resume(_prometheus(prom_url), name))


# -- alerts ---------------------------------------------------------------------------
def alert_history(prom: PrometheusClient, start: float, end: float) -> pd.DataFrame:
    """Each alert series that fired in [start, end]: when it was first and last seen
    firing, from incident.alert_queries' forms, which cover each step whole (~200 points
    over the range). Plain ALERTS points at the 24 h range's 432 s step missed an alert
    that fired for a minute between two of them."""
    from clusterpulse import incident

    step = max(5.0, (end - start) / 200)
    got = at_once({q: partial(prom.query_range, q, start, end, step)
                   for q in incident.alert_queries(step)[1:]})  # last and first firing
    seen: dict[tuple, tuple[dict, list[float]]] = {}  # labels -> (labels, firing times)
    for r in (r for rows in got.values() for r in rows):
        seen.setdefault(tuple(sorted(r.labels.items())), (r.labels, []))[1].extend(
            v for _, v in r.points)
    return pd.DataFrame([
        {"alert": labels.get("alertname"), "severity": labels.get("severity"),
         "labels": ", ".join(f"{k}={v}" for k, v in sorted(labels.items())
                             if k not in ("alertname", "alertstate", "severity",
                                          "__name__", "instance", "job", "uuid")),
         "where": dict(labels),
         "first seen": pd.Timestamp(min(times), unit="s"),
         "last seen": pd.Timestamp(max(times), unit="s")}
        for labels, times in seen.values() if times])


@st.cache_data(ttl=5, show_spinner=False)
def alerts(prom_url: str, am_url: str, range_s: int, end: float | None = None) -> Result:
    """The active alerts (Alertmanager) and the history (Prometheus), each fetched and
    kept on its own, as the Cluster page keeps them: fetched as one, Alertmanager down
    hid the history Prometheus still had. `sources` holds each one's Result (name ->
    Result: stale, why, and its last good value) for the page to say which is down."""
    def history() -> pd.DataFrame:
        until = time.time() if end is None else end
        return alert_history(_prometheus(prom_url), until - range_s, until)

    got = at_once({
        "Alertmanager": partial(_guard, f"alerts-active:{am_url}",
                                lambda: _alertmanager(am_url).alerts()),
        "Prometheus": partial(_guard, f"alerts-history:{prom_url}:{range_s}:{end}", history),
        # the runs' placement, for grouping the active alerts as the Cluster page does
        "placement": partial(_guard, f"placement:{prom_url}", lambda: placement(
            _prometheus(prom_url).query(PLACEMENT)))})
    active, hist = got["Alertmanager"].value, got["Prometheus"].value
    return Result({"active": active or [],
                   "history": hist if hist is not None else pd.DataFrame(),
                   "placement": got.pop("placement").value or {}, "sources": got})


def _prometheus(prom_url: str) -> PrometheusClient:
    """A client with the store's configured credentials (read at each use, like
    Alertmanager's: never part of a cache key)."""
    return PrometheusClient(prom_url, auth=config.from_env().prometheus_auth())


def _alertmanager(am_url: str) -> AlertmanagerClient:
    """A client with the configured credentials (read from their file at each use, so
    they never become part of a cache key)."""
    return AlertmanagerClient(am_url, auth=config.from_env().alertmanager_auth())


def settings_key(s: Settings) -> tuple[str, str]:
    return s.prometheus_url, s.alertmanager_url
