"""Grafana dashboards for ClusterPulse, written as code: `scripts/gen_deploy.py` turns
`dashboards()` into deploy/grafana/*.json and the `grafana_dashboard` ConfigMap.

Plain dictionaries in Grafana's dashboard JSON model (schemaVersion 39) rather than a
library: the model needed here is small, and the output must be stable byte for byte so
that the sync test can tell when someone forgot to regenerate.
"""

from __future__ import annotations

from typing import Any

DS = {"type": "prometheus", "uid": "${datasource}"}
RATE = "$__rate_interval"


def _target(expr: str, legend: str = "", ref: str = "A") -> dict[str, Any]:
    return {"datasource": DS, "expr": expr, "legendFormat": legend, "refId": ref,
            "range": True}


def _panel(kind: str, title: str, targets: list[tuple[str, str]], unit: str,
           pos: tuple[int, int, int, int], desc: str = "", **opts: Any) -> dict[str, Any]:
    x, y, w, h = pos
    return {
        "type": kind, "title": title, "description": desc, "datasource": DS,
        "gridPos": {"x": x, "y": y, "w": w, "h": h},
        "fieldConfig": {"defaults": {"unit": unit, **opts.pop("defaults", {})},
                        "overrides": []},
        "options": opts.pop("options", {}),
        "targets": [_target(e, leg, "ABCDEFGH"[i]) for i, (e, leg) in enumerate(targets)],
        **opts,
    }


def _var(name: str, query: str, label: str, multi: bool = True) -> dict[str, Any]:
    return {"name": name, "label": label, "type": "query", "datasource": DS,
            "query": {"query": query, "refId": f"{name}-var"}, "definition": query,
            "refresh": 2, "multi": multi, "includeAll": multi, "sort": 1,
            "current": {}, "options": []}


def _dashboard(uid: str, title: str, panels: list[dict[str, Any]],
               variables: list[dict[str, Any]]) -> dict[str, Any]:
    for i, p in enumerate(panels, start=1):
        p["id"] = i
    ds_var = {"name": "datasource", "label": "Prometheus", "type": "datasource",
              "query": "prometheus", "current": {}, "options": [], "refresh": 1}
    return {
        "uid": uid, "title": title, "tags": ["clusterpulse"], "editable": True,
        "schemaVersion": 39, "version": 1, "refresh": "30s", "timezone": "utc",
        "time": {"from": "now-1h", "to": "now"},
        "templating": {"list": [ds_var, *variables]},
        "annotations": {"list": []}, "links": [
            {"type": "dashboards", "tags": ["clusterpulse"], "asDropdown": True,
             "title": "ClusterPulse"}],
        "panels": panels,
    }


def fleet() -> dict[str, Any]:
    stat, ts = "stat", "timeseries"
    return _dashboard("clusterpulse-fleet", "ClusterPulse / Fleet", [
        _panel(stat, "GPUs up", [("sum(clusterpulse_gpu_up)", "")], "none", (0, 0, 4, 4)),
        _panel(stat, "GPUs down", [("count(clusterpulse_gpu_up == 0) or vector(0)", "")],
               "none", (4, 0, 4, 4), desc="GPUs that did not answer NVML this cycle."),
        _panel(stat, "Agents", [("count(clusterpulse_agent_build_info)", "")], "none",
               (8, 0, 4, 4)),
        _panel(stat, "Mean GPU utilization", [("avg(clusterpulse_gpu_utilization_ratio)", "")],
               "percentunit", (12, 0, 4, 4)),
        _panel(stat, "Fleet power", [("sum(clusterpulse_gpu_power_watts)", "")], "watt",
               (16, 0, 4, 4)),
        _panel(stat, "Firing alerts",
               [('count(ALERTS{alertstate="firing", alertname!="Watchdog"}) or vector(0)', "")],
               "none", (20, 0, 4, 4)),
        _panel(ts, "GPU utilization by node",
               [("avg by (node) (clusterpulse_gpu_utilization_ratio)", "{{node}}")],
               "percentunit", (0, 4, 12, 8)),
        _panel(ts, "Hottest GPU by node",
               [("max by (node) (clusterpulse_gpu_temperature_celsius)", "{{node}}")],
               "celsius", (12, 4, 12, 8)),
        _panel(ts, "Throttled or slowed GPUs",
               [("count(clusterpulse:gpu_thermal_throttled == 1) or vector(0)", "thermal"),
                ("count(clusterpulse:gpu_power_brake == 1) or vector(0)", "power brake"),
                ("count(clusterpulse:gpu_clock_ratio < 0.8) or vector(0)", "clock < 80 %")],
               "none", (0, 12, 12, 8)),
        _panel(ts, "XID and uncorrected ECC errors (1 h)",
               [("sum(increase(clusterpulse_gpu_xid_errors_total[1h])) or vector(0)", "XID"),
                ('sum(increase(clusterpulse_gpu_ecc_errors_total{kind=~".*uncorrected.*"}[1h]))'
                 " or vector(0)", "ECC uncorrected")],
               "none", (12, 12, 12, 8)),
    ], [])


def node() -> dict[str, Any]:
    sel = 'node=~"$node"'
    ts = "timeseries"
    return _dashboard("clusterpulse-node", "ClusterPulse / Node", [
        _panel(ts, "GPU utilization", [(f"clusterpulse_gpu_utilization_ratio{{{sel}}}",
                                        "{{node}} GPU {{gpu}}")], "percentunit", (0, 0, 12, 8)),
        _panel(ts, "Memory used", [(f"clusterpulse_gpu_memory_used_bytes{{{sel}}} / "
                                    f"clusterpulse_gpu_memory_total_bytes{{{sel}}}",
                                    "{{node}} GPU {{gpu}}")], "percentunit", (12, 0, 12, 8)),
        _panel(ts, "Temperature", [(f"clusterpulse_gpu_temperature_celsius{{{sel}}}",
                                    "core {{node}} GPU {{gpu}}"),
                                   (f"clusterpulse_gpu_memory_temperature_celsius{{{sel}}}",
                                    "HBM {{node}} GPU {{gpu}}")], "celsius", (0, 8, 12, 8)),
        _panel(ts, "Power / limit", [(f"clusterpulse_gpu_power_watts{{{sel}}} / "
                                      f"clusterpulse_gpu_power_limit_watts{{{sel}}}",
                                      "{{node}} GPU {{gpu}}")], "percentunit", (12, 8, 12, 8)),
        _panel(ts, "SM clock / max", [(f"clusterpulse:gpu_clock_ratio{{{sel}}}",
                                       "{{node}} GPU {{gpu}}")], "percentunit", (0, 16, 12, 8)),
        _panel(ts, "Active clock-event reasons",
               [(f"sum by (node, gpu, reason) (clusterpulse_gpu_clock_event_active{{{sel}}})",
                 "{{node}} GPU {{gpu}} {{reason}}")], "none", (12, 16, 12, 8)),
        _panel(ts, "NVLink and PCIe traffic",
               [(f"sum by (node, gpu) (rate(clusterpulse_gpu_nvlink_tx_bytes_total{{{sel}}}"
                 f"[{RATE}]) + rate(clusterpulse_gpu_nvlink_rx_bytes_total{{{sel}}}[{RATE}]))",
                 "NVLink {{node}} GPU {{gpu}}"),
                (f"sum by (node, gpu) (rate(clusterpulse_gpu_pcie_tx_bytes_total{{{sel}}}"
                 f"[{RATE}]) + rate(clusterpulse_gpu_pcie_rx_bytes_total{{{sel}}}[{RATE}]))",
                 "PCIe {{node}} GPU {{gpu}}")], "Bps", (0, 24, 12, 8)),
        _panel(ts, "Agent collection time",
               [(f"clusterpulse_agent_collection_duration_seconds{{{sel}}}", "{{node}}")],
               "s", (12, 24, 12, 8)),
    ], [_var("node", "label_values(clusterpulse_gpu_info, node)", "Node")])


def run() -> dict[str, Any]:
    sel = 'run=~"$run"'
    ts, stat = "timeseries", "stat"
    return _dashboard("clusterpulse-run", "ClusterPulse / Training run", [
        _panel(stat, "Step", [(f"max(clusterpulse_trainer_step{{{sel}}})", "")], "none",
               (0, 0, 6, 4)),
        _panel(stat, "Ranks reporting", [(f"count(clusterpulse_trainer_step{{{sel}}})", "")],
               "none", (6, 0, 6, 4)),
        _panel(stat, "Last checkpoint step",
               [(f"max(clusterpulse_trainer_checkpoint_last_step{{{sel}}})", "")], "none",
               (12, 0, 6, 4)),
        _panel(stat, "Worst straggler score",
               [(f"max(clusterpulse_trainer_straggler_score{{{sel}}})", "")], "none",
               (18, 0, 6, 4)),
        _panel(ts, "Step time by rank",
               [(f"clusterpulse_trainer_step_seconds{{{sel}}}", "rank {{rank}}")], "s",
               (0, 4, 12, 8)),
        _panel(ts, "Compute vs sync wait by rank",
               [(f"clusterpulse_trainer_compute_seconds{{{sel}}}", "compute rank {{rank}}"),
                (f"clusterpulse_trainer_sync_wait_seconds{{{sel}}}", "wait rank {{rank}}")],
               "s", (12, 4, 12, 8),
               desc="The straggler computes longest and waits least; the others wait for it."),
        _panel(ts, "Loss", [(f"avg by (run) (clusterpulse_trainer_loss{{{sel}}})", "{{run}}")],
               "none", (0, 12, 12, 8)),
        _panel(ts, "Throughput",
               [(f"sum by (run) (rate(clusterpulse_trainer_samples_total{{{sel}}}[{RATE}]))",
                 "{{run}}")], "none", (12, 12, 12, 8)),
        _panel(ts, "Heartbeat age by rank",
               [(f"clusterpulse_trainer_heartbeat_age_seconds{{{sel}}}", "rank {{rank}}")],
               "s", (0, 20, 12, 8)),
        _panel(ts, "Data wait share by rank",
               [(f"clusterpulse_trainer_data_wait_seconds{{{sel}}} / "
                 f"clusterpulse_trainer_step_seconds{{{sel}}}", "rank {{rank}}")],
               "percentunit", (12, 20, 12, 8)),
        _panel(ts, "Gradient all-reduce bus bandwidth by rank",
               [(f"clusterpulse_trainer_comm_bytes{{{sel}}} / "
                 f"clusterpulse_trainer_comm_seconds{{{sel}}}", "rank {{rank}}")],
               "Bps", (0, 28, 24, 8),
               desc="Bytes each rank moved in the gradient all-reduce over its window (a "
                    "lower bound). A slow link on the ring lowers every rank's together."),
    ], [_var("run", "label_values(clusterpulse_trainer_step, run)", "Run")])


def dashboards() -> dict[str, dict[str, Any]]:
    """uid -> dashboard JSON model; each becomes deploy/grafana/<uid>.json."""
    return {d["uid"]: d for d in (fleet(), node(), run())}
