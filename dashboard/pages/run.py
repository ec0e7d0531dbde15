"""Run: progress, the straggler table with evidence, heartbeats, checkpoints,
restarts, goodput, and the actions (checkpoint-restart, hard restart)."""

from __future__ import annotations

import time

import pandas as pd
import streamlit as st

from clusterpulse.dashboard import actions, data, ui
from clusterpulse.dashboard.incidents import hang_incident, straggler_flag
from clusterpulse.dashboard.promclient import PrometheusClient, PrometheusError

s = ui.settings()
st.title("Run")
who = ui.operator()
range_s = ui.time_range()
run = ui.choose("Run", lambda: data.run_names(s.prometheus_url), "No training run reports yet.")


def straggler_table(d: dict) -> pd.DataFrame:
    ranks = d["ranks"]
    if ranks.empty:
        return ranks
    per = d["per_rank"]
    out = ranks[["rank", "node", "local_rank", "gpu", "pid"]].copy()
    for col in ("score", "self score", "compute s", "sync wait s", "data wait s",
                "heartbeat age s", "step"):
        out[col] = out["rank"].map(per.get(col, {}))
    # bytes each rank moved in the gradient all-reduce over its window: a slow link
    # on the ring lowers every rank's figure together (no rank is a straggler then)
    out["bus MB/s"] = (out["rank"].map(per.get("all-reduce bytes", {}))
                       / out["rank"].map(per.get("all-reduce s", {})) / 1e6)
    out["all-reduce s"] = out["rank"].map(per.get("all-reduce s", {}))
    out["cause"] = out["rank"].map(d["causes"])
    out["GPU °C"] = out["rank"].map(d["gpu_temp"])
    flagged = out["rank"].map(per.get("flagged", {}))
    out["flag"] = [straggler_flag(sc, fl) for sc, fl in zip(out["score"], flagged, strict=True)]
    return out.sort_values("score", ascending=False)


@st.fragment(run_every=s.refresh_s)
def live() -> None:
    result = data.run(s.prometheus_url, run, range_s)
    if not ui.show_status(result):
        return
    d = result.value
    per = d["per_rank"]
    step = max(per["step"].values(), default=0)
    ckpt_step = max(per["checkpoint step"].values(), default=None)
    ckpt_time = max(per["checkpoint time"].values(), default=None)
    c = st.columns(6)
    c[0].metric("Step", f"{step:.0f}")
    c[1].metric("Steps / s", f"{d['step_rate']:.2f}")
    c[2].metric("Loss", f"{per['loss'].get('0', float('nan')):.3f}")
    c[3].metric("Restarts", f"{max(per['restarts'].values(), default=0):.0f}")
    c[4].metric("Goodput", f"{per['goodput'].get('0', 0) * 100:.0f} %")
    c[5].metric("Last checkpoint", "none" if ckpt_step is None else
                f"step {ckpt_step:.0f}, {time.time() - ckpt_time:.0f} s ago")
    incident = hang_incident(d)
    if incident is not None:  # one incident: its root and the ranks waiting for it
        st.error(incident.headline())
    st.subheader("Ranks (straggler table)")
    table = straggler_table(d)
    st.dataframe(table, hide_index=True, width="stretch")
    flagged = table[table["flag"] != ""] if not table.empty else table
    for _, r in flagged.iterrows():
        st.warning(f"Rank {r['rank']} on {r['node']} GPU {r['gpu']} is {r['score']:.2f}x the "
                   f"typical rank — cause: **{r['cause']}** (GPU at {r['GPU °C']:.0f} °C, "
                   f"data wait {r['data wait s'] * 1e3:.0f} ms, sync wait "
                   f"{r['sync wait s'] * 1e3:.0f} ms)")
    left, right = st.columns(2)
    with left:
        st.markdown("**Compute time per rank (s)**")
        comp = d["compute"]
        if not comp.empty:
            long = comp.tail(40).reset_index(names="time").melt(
                id_vars="time", var_name="rank", value_name="seconds").dropna()
            long["time"] = long["time"].dt.strftime("%H:%M:%S")
            ui.heatmap(long, "time", "rank", "seconds", "compute s",
                       height=60 + 22 * long["rank"].nunique())
    with right:
        st.markdown("**Loss**")
        if not d["loss"].empty:
            st.line_chart(d["loss"], height=200)
        st.markdown("**Restarts over time**")
        if not d["restarts"].empty:
            st.line_chart(d["restarts"], height=120)
    blocking = max(per["checkpoint blocking s"].values(), default=0.0)
    st.caption(f"Checkpoint blocking (last): {blocking * 1e3:.0f} ms · {d['queries']} queries")


live()


def incident_timeline() -> None:
    """One row per fault (its alerts grouped, the root named), the action from the
    audit log, and where the trainer says it resumed from: clusterpulse/incident.py,
    the same objects the demo prints."""
    from clusterpulse import incident

    st.subheader("Incident timeline")
    result = data.run_incidents(s.prometheus_url, run, range_s,
                                str(s.audit_log) if s.audit_log else "")
    if not ui.show_status(result):
        return
    items = result.value
    if not items:
        st.caption("No incident in this time range.")
        return
    table = pd.DataFrame([i.row() for i in items])
    table["detected"] = pd.to_datetime(table["detected"], unit="s").dt.strftime("%H:%M:%S")
    st.dataframe(table, hide_index=True, width="stretch")
    st.caption(incident.summary(items))


incident_timeline()

st.subheader("Actions")


def request(who: str) -> None:
    """The form's submit callback: it runs before the page does, so it can clear the
    form it read. The reason and the ticked confirmation used to stay after a request,
    and one more click restarted the run again without anyone confirming it."""
    ss = st.session_state
    confirmed, ss["confirm"] = ss.get("confirm", False), False  # confirm each request
    if not confirmed:
        ss["action_message"] = ("error", "Tick the confirmation first.")
        return
    action, reason, sent = ss["kind"].split(" ")[0], ss.get("reason", ""), time.time()
    try:
        results = actions.request_action(PrometheusClient(s.prometheus_url), run, action,
                                         reason, who, s.agent_token(), ui.audit_log())
    except (actions.ActionError, PrometheusError) as err:
        ss["action_message"] = ("error", f"Not sent: {err}")
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
        st.form_submit_button("Request", type="primary", on_click=request, args=(who,))
    kind, text = st.session_state.pop("action_message", (None, ""))
    if kind == "error":
        st.error(text)

last = st.session_state.get("last_action")
if last and last["run"] == run:

    @st.fragment(run_every=2)
    def progress() -> None:
        results = actions.command_states(last["results"], s.agent_token())
        done = all(r.state in ("completed", "failed") or not r.ok for r in results)
        st.dataframe(pd.DataFrame([{"node": r.node, "command": r.command or "-",
                                    "state": r.state if r.ok else "not sent",
                                    "detail": r.error} for r in results]),
                     hide_index=True, width="stretch")
        st.caption(f"{last['action']} requested at "
                   f"{time.strftime('%H:%M:%S', time.localtime(last['at']))} "
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
