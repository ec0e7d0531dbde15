"""Cluster: the fleet at a glance, and what is unhealthy and why."""

from __future__ import annotations

import time

import pandas as pd
import streamlit as st

from clusterpulse.dashboard import data, links, ui
from clusterpulse.dashboard import heat as hmap
from clusterpulse.dashboard.incidents import alert_groups, problem_rows, run_alerts

s = ui.settings()
st.title("Cluster")
signin = ui.signin_box()
ui.window_from_link()  # no picker here: a link's window is kept for the other pages
# the metric's selector is drawn after the figures (ui.signin_box), in its place here
metric_slot = st.sidebar.container()
if st.session_state.get("heat_metric") not in data.HEATMAP_METRICS:
    st.session_state.pop("heat_metric", None)
metric = st.session_state.get("heat_metric", next(iter(data.HEATMAP_METRICS)))


@st.fragment(run_every=s.refresh_s)
def live() -> None:
    result = data.cluster(s.prometheus_url, s.alertmanager_url, metric)
    if not ui.show_status(result):
        return
    d = result.value
    nodes = d["nodes"]
    n_up = int(nodes["up"].sum()) if not nodes.empty else 0
    active = [a for a in d["alerts"] if a.state == "active"]
    c = ui.kpi_row(5)
    ui.kpi(c[0], "Nodes up", f"{n_up} / {len(nodes)}")
    ui.kpi(c[1], "Healthy GPUs", f"{d['gpus_up']} / {d['gpus_total']}")
    ui.kpi(c[2], "Critical alerts", sum(a.severity == "critical" for a in active))
    ui.kpi(c[3], "Warnings", sum(a.severity == "warning" for a in active))
    runs = d["runs"]
    ui.kpi(c[4], "Running jobs", data.running(runs))
    if active:  # several alerts of one fault are one thing to look at
        groups = alert_groups(active, time.time(), d["placement"])
        st.caption(f"{len(active)} active alert(s) from {len(groups)} incident(s): "
                   f"[Alerts]({links.page_url('alerts', None, ui.keep())})")
    if d["am_error"]:
        st.warning(d["am_error"])
    heat = d["heat"]
    st.subheader(f"{metric.capitalize()} ({d['unit']}) by node x GPU")
    if heat.empty and d["down"].empty:
        st.info("No GPU data yet.")
    else:
        cells = hmap.cells(heat, d["down"], nodes)
        cells["url"] = [links.page_url("node", {"node": n, "gpu": g}, ui.keep())
                        for n, g in zip(cells["node"], cells["gpu"], strict=True)]
        good_high = d["good_high"]
        shown = cells["node"].nunique()
        if shown < len(nodes):
            st.caption(f"The {shown} of {len(nodes)} nodes with the "
                       f"{'lowest' if good_high else 'highest'} {metric} "
                       f"(at most {d['heat_nodes']} are drawn), and every node or GPU down.")
        domain = data.HEATMAP_DOMAINS.get(metric)
        ui.heatmap(cells, "gpu", "node", "value", d["unit"], reverse=good_high,
                   height=max(120, 22 * shown), domain=domain,
                   x_order=sorted({int(g) for g in cells["gpu"]}),
                   y_order=sorted(set(cells["node"])))
        scale = (f"Colours on a fixed scale, {domain[0]:.0f}-{domain[1]:.0f} {d['unit']}"
                 + (f" (GpuTemperatureHigh fires above {data.GPU_THROTTLE_C:.0f} °C)"
                    if metric == "temperature" else "")
                 if domain else "Colours span the values shown")
        st.caption(f"{scale}. Click a cell for that GPU's charts.")
        # the same picture in words, for screen readers (and a glance)
        st.caption(hmap.summary(cells, metric, d["unit"], good_high))
    st.subheader("Unhealthy GPUs and nodes")
    rows = problem_rows(d["down"], nodes, active)
    if rows:
        table = pd.DataFrame(rows)
        table["evidence"] = [links.evidence({"node": r["node"], "gpu": r["gpu"]}, ui.keep())
                             for r in rows]
        # widths that sum to less than the page at a 1024 px window with the sidebar
        # open (564 px; a 400 px "problem" scrolled it 16 px), stretched on a wider
        # one; a long problem wraps over up to three lines (Streamlit wraps only in
        # rows taller than 4 rem)
        st.dataframe(table, hide_index=True, width="stretch", row_height=68, column_config={
            "node": st.column_config.TextColumn("node", width=90),
            "gpu": st.column_config.TextColumn("gpu", width=45),
            "problem": st.column_config.TextColumn("problem", width=330),
            "evidence": st.column_config.LinkColumn("evidence", display_text="open",
                                                    width=60)})
    else:
        st.success("All nodes and GPUs healthy.")
    of_jobs = run_alerts(active, d["placement"])
    job_only = [a for a in active if a.labels.get("run") and "node" not in a.labels]
    if job_only:  # the KPI above counts them: say where they are
        st.warning(f"{len(job_only)} alert(s) concern jobs, not nodes or GPUs: "
                   f"{', '.join(sorted({a.labels['run'] for a in job_only}))} (the Jobs "
                   "table below).")
    if not runs.empty:
        st.subheader("Jobs")
        jobs = runs.merge(d["goodput"], on="run", how="left") \
            if not d["goodput"].empty else runs.assign(goodput=float("nan"))
        jobs["goodput"] = jobs["goodput"] * 100  # a percentage, as on the Run page
        jobs["alerts"] = [of_jobs.get(r, "") for r in jobs["run"]]
        jobs["evidence"] = [links.page_url("run", {"run": r}, ui.keep()) for r in jobs["run"]]
        # fixed widths as the table above: sized to their text, a run's two alerts
        # ("TrainingStraggler (warning), ...") scrolled the table 13 px at a 1024 px
        # window; an alerts or state cell wraps over up to three lines
        st.dataframe(jobs, hide_index=True, width="stretch", row_height=68, column_config={
            "run": st.column_config.TextColumn("run", width=85),
            "step": st.column_config.NumberColumn("step", format="%d", width=60),
            "state": st.column_config.TextColumn("state", width=110),
            "goodput": st.column_config.NumberColumn("goodput %", format="%.0f %%",
                                                     width=75),
            "alerts": st.column_config.TextColumn("alerts", width=145),
            "evidence": st.column_config.LinkColumn("evidence", display_text="open",
                                                    width=60)})
    st.caption(f"{d['queries']} PromQL queries per refresh, shared by all viewers · "
               f"refresh every {s.refresh_s:.0f} s")


live()
metric_slot.selectbox("Heatmap metric", list(data.HEATMAP_METRICS), key="heat_metric")
ui.operator(signin)  # after the figures: see ui.signin_box
