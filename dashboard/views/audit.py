"""Audit: every action taken, by whom, why, and how it ended: one row per action."""

from __future__ import annotations

import streamlit as st

from clusterpulse.dashboard import auditview, ui

st.title("Audit")
operator = ui.operator()
# The chain's verdict goes here, above the table, but is worked out after it: it reads
# the whole file and asks Prometheus for a week of published heads, and the table,
# which needs neither, waited for both.
chain = st.container()
HIDDEN_FROM_VIEWERS = ("sign-in", "authenticate", "webhook")
# Widths that sum to less than the page at a 1024 px window with the sidebar open (564
# px), stretched on a wider one; a cell's text wraps over up to four lines (Streamlit
# wraps only in rows taller than 4 rem): auditview.SHOWN. Four lines, and "who" wide
# enough for "fault-player": at 1024 px, three lines of 140 px cut a two-node outcome
# after "sim-node-1:" and 60 px broke "fault-pl ayer".
ROW_PX = 88
COLUMNS = {
    "time (UTC)": st.column_config.TextColumn("time (UTC)", width=85),
    "who": st.column_config.TextColumn("who", width=85),
    # "checkpoint-restart" read "checkpc" at 1400 px
    "action": st.column_config.TextColumn("action", width=135),
    "outcome": st.column_config.TextColumn("outcome", width=140,
                                           help="the action's, then each node's"),
    "why": st.column_config.TextColumn("why", width=95),
}


@st.fragment
def table() -> None:
    top = st.columns([1, 1, 1, 1])
    # a click reruns this fragment, which reads the log again (no st.rerun of its own:
    # scope="fragment" raises where the click came with a whole page's run)
    top[3].button("Refresh", icon=":material/refresh:")
    try:
        records, unusable = auditview.usable(ui.audit_log().read(limit=2000))
    except OSError as err:
        st.error(f"The audit log {ui.settings().audit_log} cannot be read: "
                 f"{err.strerror or err}", icon=":material/error:")
        return
    if unusable:
        st.warning(f"{unusable} record(s) of the log are not shown: a field of a type no "
                   "writer gives (damaged or forged; the chain check names such lines).",
                   icon=":material/warning:")
    if operator is None:  # viewers: nothing about refused sign-ins or authentication
        records = [r for r in records if not (r.get("outcome") == "refused"
                                              and r.get("action") in HIDDEN_FROM_VIEWERS)]
    if not records:
        st.info("No action has been taken yet.")
        return
    frame = auditview.actions(records)
    who = top[0].multiselect("Who", sorted(set(frame["who"])))
    action = top[1].multiselect("Action", sorted(set(frame["action"])))
    run = top[2].multiselect("Run", sorted(set(frame["run"]) - {""}))
    for col, chosen in (("who", who), ("action", action), ("run", run)):
        if chosen:
            frame = frame[frame[col].isin(chosen)]
    if not frame.empty:  # the answer in words first: the table's code loads after it
        st.markdown(auditview.newest_line(frame))
    st.caption(f"{len(frame)} action(s), newest first; times in UTC. `outcome`: the "
               "action's, then each node's.")
    main, rest = auditview.shown(frame)
    st.dataframe(main, hide_index=True, width="stretch", row_height=ROW_PX,
                 column_config=COLUMNS)
    with st.expander("Source, records and hash of each action"):
        st.caption("`records`: the log's lines of the action (the request and each "
                   "agent's states); `prev`: the hash chaining each line to the one before.")
        st.dataframe(rest, hide_index=True, width="stretch", column_config={
            "time (UTC)": COLUMNS["time (UTC)"],
            "prev": st.column_config.TextColumn("prev (hash)", width="small")},
            row_height=ROW_PX)


table()
with chain:
    ui.audit_chain_status()
