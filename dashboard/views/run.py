"""Run: progress, the straggler table with evidence, heartbeats, checkpoints,
restarts, goodput, and the actions (checkpoint-restart, hard restart)."""

from __future__ import annotations

import time

import pandas as pd
import streamlit as st

from clusterpulse.dashboard import actions, config, data, links, ui
from clusterpulse.dashboard import heat as hmap
from clusterpulse.dashboard.incidents import (
    GPU_DOWN,
    hang_incident,
    rank_tables,
    rate_against_usual,
    straggler_line,
    timeline_row,
)
from clusterpulse.dashboard.promclient import PrometheusClient, PrometheusError

s = ui.settings()
st.title("Run")
signin = ui.signin_box()
later: list = []  # widgets drawn after the first content (ui.signin_box)
win = ui.time_window(later)
run = ui.choose("Run", lambda: data.run_names(s.prometheus_url), "No training run reports yet.",
                "run", later)
focus = ui.url_param("rank")  # a link to one rank (an alert, a heatmap cell)
# The straggler table fits the page at a 1024 px window with the sidebar open (564 px):
# its 13 columns took 1083 px, "compu…" was the last one in view there and at 1400 px
# "evidence" read "GPU ch…". It shows what an on-call decides on and where: flag,
# cause, score, rank, node, GPU and its evidence, in fixed widths that sum to less
# (stretched on a wider page); each rank's temperature and times are in the expander
# below it (the flagged ranks' in the line above it too).
COLUMNS = {
    "flag": st.column_config.TextColumn("flag", width=90),
    "cause": st.column_config.TextColumn("cause", width=120),
    "score": st.column_config.NumberColumn("score", format="%.2fx", width=60,
                                           help="compute time / the typical rank's"),
    "rank": st.column_config.TextColumn("rank", width=50),
    "node": st.column_config.TextColumn("node", width=85),
    "gpu": st.column_config.TextColumn("gpu", width=45),
    "GPU °C": st.column_config.NumberColumn("GPU °C", format="%.0f"),
    "compute ms": st.column_config.NumberColumn("compute ms", format="%.0f"),
    "sync wait ms": st.column_config.NumberColumn("sync wait ms", format="%.0f"),
    "data wait ms": st.column_config.NumberColumn("data wait ms", format="%.0f"),
    "bus MB/s": st.column_config.NumberColumn("bus MB/s", format="%.0f"),
    "heartbeat age s": st.column_config.NumberColumn("heartbeat age s", format="%.1f"),
    "evidence": st.column_config.LinkColumn("evidence", display_text="GPU charts",
                                            width=85),
}
SHOWN = ["flag", "cause", "score", "rank", "node", "gpu", "evidence"]
TIMINGS = ["rank", "GPU °C", "compute ms", "sync wait ms", "data wait ms", "bus MB/s",
           "heartbeat age s"]


def window_note(win: links.Window) -> str:
    """What a custom past window changes on this page, in words: the figures and the
    straggler table are Prometheus's latest values whatever the window, and they were
    shown under a window of an hour ago as if they were of it."""
    start, end = (links.fmt_utc(t) for t in win.bounds())
    return (f"The figures above, the hang line and the straggler table are **now**; the "
            f"compute heatmap, the loss and restart charts and the incident timeline are "
            f"the chosen window, {start} to {end} UTC.")


@st.fragment(run_every=s.refresh_s)
def live() -> None:
    result = data.run(s.prometheus_url, run, win.seconds, win.end)
    if not ui.show_status(result):
        return
    d = result.value
    per = d["per_rank"]
    step, step_note = data.run_step(per)
    ckpt_time = max(per["checkpoint time"].values(), default=None)
    if win.end is not None:  # a past window: say which parts of the page are of it
        st.caption(window_note(win))
    c = ui.kpi_row(6)
    ui.kpi(c[0], "Step", step)
    if step_note:
        c[0].caption(step_note)
    ui.kpi(c[1], "Steps / s", f"{d['step_rate']:.2f}",
           rate_against_usual(d["step_rate"], d["step_rate_usual"]))
    figures = data.run_figures(per)
    ui.kpi(c[2], "Loss", figures["Loss"])
    ui.kpi(c[3], "Restarts", figures["Restarts"])
    ui.kpi(c[4], "Goodput", figures["Goodput"],
           help="time spent on steps that count / wall time since the run began")
    ui.kpi(c[5], "Last checkpoint", figures["Last checkpoint"])
    if ckpt_time is not None:
        c[5].caption(f"saved {time.time() - ckpt_time:.0f} s ago")
    incident = hang_incident(d)
    if incident is not None:  # one incident: its root and the ranks waiting for it
        st.error(incident.headline())
    table, internal = rank_tables(d, ui.keep())
    # the answer in words first: a line draws at once, where the table below waits for
    # the browser to load its grid (a second or more on a first visit)
    for _, r in table[table["flag"] == GPU_DOWN].iterrows():
        st.error(f"Rank {r['rank']} on {r['node']}: its GPU {r['gpu']} is DOWN. "
                 f"[Its GPU's charts]({r['evidence']})")
    for _, r in table[table["flag"] == "STRAGGLER"].iterrows():
        st.warning(straggler_line(r.to_dict()))
    st.subheader("Ranks (straggler table)")
    shown = table
    if focus is not None and focus in set(table["rank"]):  # stragglers stay first
        st.caption(f"Rank {focus}, the link's, is highlighted.")
        shown = table.style.apply(lambda row: ["background-color: #fff3b0" if row["rank"] == focus
                                               else "" for _ in row], axis=1)
    # during a restart a rank reports no figures yet: its cells read "None" (ui.table)
    ui.table(shown, hide_index=True, width="stretch", column_config=COLUMNS,
             column_order=SHOWN)
    with st.expander("Temperatures, times and internals (process, local rank, raw seconds)"):
        ui.table(internal, hide_index=True, width="stretch")
        ui.table(table, hide_index=True, width="stretch", column_config=COLUMNS,
                 column_order=TIMINGS)
    left, right = st.columns(2)
    with left:
        st.markdown("**Compute time per rank (s)** · click a cell for its rank")
        comp, down = d["compute"], d["compute_down"]
        if not comp.empty or not down.empty:
            long = hmap.rank_cells(comp, down)  # in time order, the down cells marked
            words = hmap.rank_summary(long)  # of the times, before they are labels
            span = (long["time"].max() - long["time"].min()).total_seconds()
            long["time"] = long["time"].dt.strftime("%m-%d %H:%M" if span > 86400
                                                    else "%H:%M:%S")
            long["url"] = [links.page_url("run", {"run": run, "rank": r.split(" ")[-1]},
                                          ui.keep()) for r in long["rank"]]
            ui.heatmap(long.rename(columns={"time": ui.TIME_TITLE}), ui.TIME_TITLE, "rank",
                       "seconds", "compute s", height=110 + 24 * long["rank"].nunique(),
                       y_order=sorted(long["rank"].unique(), key=lambda r: int(r.split()[-1])))
            st.caption("Grey cells marked DOWN: the rank's GPU was down then (its step "
                       "time, the last it reported, is not drawn). Blank cells: the rank "
                       "reported no step then (a restart, or before it began).")
            # the same picture in words, for screen readers (and a glance)
            st.caption(words)
    with right:
        st.markdown("**Loss**")
        if not d["loss"].empty:
            ui.line_chart(d["loss"], "loss (mean of ranks)", height=200)
        st.markdown("**Restarts over time**")
        if not d["restarts"].empty:
            ui.line_chart(d["restarts"], "restarts (count)", height=170, counts=True)
    blocking = max(per["checkpoint blocking s"].values(), default=0.0)
    st.caption(f"Checkpoint blocking (last): {blocking * 1e3:.0f} ms · {d['queries']} queries")


live()
for draw in later:
    draw()
who = ui.operator(signin)  # after the figures and the table: see ui.signin_box


# The timeline fits the page at a 1024 px window with the sidebar open (564 px): its nine
# columns of Incident.row() took 1309 px there, and "action" and "by" were behind a
# horizontal scroll. Its columns hold their facts in words, in widths that sum to less
# (stretched on a wider page), each cell up to three lines (Streamlit wraps a cell's
# text only in rows taller than 4 rem); the alerts of each fault beside its root are
# in the expander below it.
TIMELINE_ROW_PX = 68
TIMELINE_COLUMNS = {
    "began (UTC)": st.column_config.TextColumn(
        "began (UTC)", width=100, help="when the first of its alerts' conditions held"),
    "incident": st.column_config.TextColumn(
        "incident", width=160, help="the root alert, where it fired, and when it paged (its "
        "alerts' first firing, after their rules' `for`)"),
    "action": st.column_config.TextColumn("action", width=150,
                                          help="the first action taken on it: offset, who"),
    "resumed": st.column_config.TextColumn("resumed", width=140,
                                           help="the trainer's own resume record"),
    "alerts": st.column_config.TextColumn("alerts", width=140),
    "steps recomputed": st.column_config.NumberColumn("steps recomputed", width=120),
}


def incident_timeline() -> None:
    """One row per fault (its alerts grouped, the root named), the action from the
    audit log, and where the trainer says it resumed from: clusterpulse/incident.py,
    the same objects the demo prints."""
    from clusterpulse import incident

    st.subheader("Incident timeline")
    result = data.run_incidents(s.prometheus_url, run, win.seconds,
                                str(s.audit_log) if s.audit_log else "", win.end)
    if not ui.show_status(result):
        return
    items = result.value
    if not items:
        st.caption("No incident in this time range.")
        return
    start, end = win.bounds()  # dated where the incidents shown span UTC days
    first = min([start, *(i.detected_at for i in items)])  # one may begin before it
    dated = time.gmtime(first)[:3] != time.gmtime(end)[:3]
    rows = [timeline_row(i.row(), dated) for i in items]
    ui.table(pd.DataFrame([r for r, _ in rows]), hide_index=True, width="stretch",
             row_height=TIMELINE_ROW_PX, column_config=TIMELINE_COLUMNS)
    with st.expander("Every alert of each incident, steps recomputed"):
        ui.table(pd.DataFrame([r for _, r in rows]), hide_index=True, width="stretch",
                 row_height=TIMELINE_ROW_PX, column_config=TIMELINE_COLUMNS)
    st.caption(incident.summary(items))


incident_timeline()

st.subheader("Actions")


def request() -> None:
    """The form's submit callback: it runs before the page does, so it can clear the
    form it read. The reason and the ticked confirmation used to stay after a request,
    and one more click restarted the run again without anyone confirming it. The
    operator is the one verified now (ui.acting_operator), not the page's from before
    the click: an operator removed since could still restart the run."""
    ss = st.session_state
    who = ui.acting_operator()
    if who is None:
        ss["action_message"] = ("error", "Not sent: you are not signed in as an operator "
                                "(any more); sign in to act.")
        return
    confirmed, ss["confirm"] = ss.get("confirm", False), False  # confirm each request
    if not confirmed:
        ss["action_message"] = ("error", "Tick the confirmation first.")
        return
    action, reason, sent = ss["kind"].split(" ")[0], ss.get("reason", ""), time.time()
    try:
        prom = PrometheusClient(s.prometheus_url, auth=s.prometheus_auth())
        results = actions.request_action(prom, run, action, reason, who, s.agent_token(),
                                         ui.audit_log())
    except (actions.ActionError, PrometheusError, config.SettingsError) as err:
        ss["action_message"] = ("error", f"Not sent: {err}")
        return
    if actions.all_in_flight(results):  # another session's (or the policy's) restart
        running = results[0].in_flight or {}
        ss["last_action"] = {"run": run, "results": actions.follow_in_flight(results),
                             "at": running.get("created_unix", sent),
                             "action": f"{running.get('action', '?')} (already in flight)",
                             "reason": running.get("reason", ""),
                             "refused": results, "asked_at": sent}
        return
    ss["reason"] = ""
    ss["last_action"] = {"run": run, "results": results, "at": sent, "action": action,
                         "reason": reason}


if who is None:
    st.info("Viewers are read-only: sign in as an operator (sidebar) to restart this run.")
else:
    with st.form("action"):
        st.radio("Action", ["checkpoint-restart (graceful, no step lost)",
                            "restart (hard, from the last checkpoint)"], key="kind")
        st.text_input("Reason (audited)", key="reason")
        st.checkbox(f"I confirm: restart run {run}", key="confirm")
        st.form_submit_button("Request", type="primary", on_click=request)
kind, text = st.session_state.pop("action_message", (None, ""))
if kind == "error":  # also when the click found its operator signed out (request)
    st.error(text)

last = st.session_state.get("last_action")
if last and last["run"] == run:

    @st.fragment(run_every=2)
    def progress() -> None:
        try:
            token = s.agent_token()
        except config.SettingsError as err:  # the file went away since the request
            st.warning(f"Cannot follow the request: {err}")
            return
        # each refresh starts from the last one's states: a node's command seen final
        # stays so (a later 404 of its agent made a completed restart "lost")
        results = last["results"] = actions.command_states(last["results"], token)
        done = actions.ended(results)
        if last.get("refused"):  # refreshed with the restart it follows
            kind, text = actions.refusal_status(last["refused"], last["asked_at"], results)
            (st.error if kind == "error" else st.info)(text)
        st.dataframe(pd.DataFrame([{"node": r.node, "command": r.command or "-",
                                    "state": r.state if r.ok else "not sent",
                                    "detail": r.error} for r in results]),
                     hide_index=True, width="stretch")
        st.caption(f"{last['action']} requested at "
                   f"{time.strftime('%H:%M:%S', time.gmtime(last['at']))} UTC "
                   f"because: {last['reason']}")
        resumed = data.run_resume(s.prometheus_url, run).value
        if resumed is not None and resumed.at < last["at"]:
            resumed = None  # the record of an earlier restart
        if resumed is not None:  # the trainer's own record (rank 0's run state)
            st.success(f"Resumed from step {resumed.step} ({resumed.recomputed} steps "
                       "recomputed).")
        if done and all(r.ok and r.state == "completed" for r in results):
            st.success("All ranks resumed.")
        elif done:
            st.error("Some nodes failed: see the table.")
        else:
            st.info("Waiting for the ranks to checkpoint, restart and resume …")

    progress()
