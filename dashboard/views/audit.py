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


@st.fragment
def table() -> None:
    top = st.columns([1, 1, 1, 1])
    # a click reruns this fragment, which reads the log again (no st.rerun of its own:
    # scope="fragment" raises where the click came with a whole page's run)
    top[3].button("Refresh", icon=":material/refresh:")
    records = ui.audit_log().read(limit=2000)
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
    st.caption(f"{len(frame)} action(s), newest first; times in UTC. `records`: the log's "
               "lines of the action (the request and each agent's states); `prev`: the "
               "hash chaining each line to the one before.")
    st.dataframe(frame, hide_index=True, width="stretch", column_config={
        # "checkpoint-restart" read "checkpc" at 1400 px
        "action": st.column_config.TextColumn("action", width="medium"),
        "prev": st.column_config.TextColumn("prev (hash)", width="small")})


table()
with chain:
    ui.audit_chain_status()
