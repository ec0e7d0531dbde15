"""Pieces every page shares: settings, the stale-data banner, the time range, and
the operator login (viewers are read-only)."""

from __future__ import annotations

import time
from collections.abc import Callable

import streamlit as st

from clusterpulse.agent.audit import AuditLog, verify
from clusterpulse.dashboard import auth, config
from clusterpulse.dashboard.data import Result

RANGES = {"15 min": 900, "1 h": 3600, "6 h": 21600, "24 h": 86400}


def settings() -> config.Settings:
    """Read per run (cheap), so a changed environment takes effect; a setting the
    dashboard cannot run with stops the page with its name, not a traceback."""
    try:
        return config.from_env()
    except config.SettingsError as err:
        st.error(f"Dashboard setting: {err}", icon=":material/settings:")
        st.stop()
        raise  # not reached: st.stop() ends the run


def audit_log() -> AuditLog:
    return AuditLog(settings().audit_log)


def audit_chain_status() -> None:
    """The audit chain's head, shown outside the file: an operator who notes it (or a
    screenshot) can later prove that records were cut from the end or rewritten
    (`clusterpulse-audit verify FILE --head SEQ:HASH`); breaks are named by line."""
    path = settings().audit_log
    if not path.exists():
        return
    try:
        verdict = verify(path)
    except OSError as err:
        st.warning(f"Audit log {path}: cannot read it ({err.strerror or err}).")
        return
    head = f"head `{verdict.head.seq}:{verdict.head.digest[:16]}`"
    if verdict.intact:
        st.caption(f"Hash chain intact: {verdict.records} records, {head}.")
    else:
        where = ", ".join(f"line {n} ({why})" for n, why in verdict.breaks[:5])
        st.error(f"Audit hash chain broken at {len(verdict.breaks)} place(s): {where}; "
                 f"{head}.", icon=":material/gpp_bad:")


def show_status(result: Result, what: str = "Prometheus") -> bool:
    """A banner when data is stale; True if there is anything to show."""
    if result.stale:
        age = f"{time.time() - result.fetched_at:.0f} s old" if result.fetched_at else "none yet"
        st.error(f"{what} is unavailable — showing the last data ({age}). {result.error}",
                 icon=":material/warning:")
    return result.value is not None


def choose(label: str, names: Callable[[], Result], empty: str) -> str:
    """A selector over names from Prometheus (`names` reads them). While there are none
    (nothing reports yet, or Prometheus is down or slow at the page's first read) the
    page says so and reads again every refresh, reloading itself once there are: a
    page stopped there waited for a manual reload forever."""
    first = names()
    if not first.value:
        _until_any(names, empty)
        st.stop()
    show_status(first)
    return st.selectbox(label, first.value, key=label.lower())


def _until_any(names: Callable[[], Result], empty: str) -> None:
    @st.fragment(run_every=settings().refresh_s)
    def waiting() -> None:
        result = names()
        if result.value:
            st.rerun()  # from a fragment's own run, the whole page: now it can choose
        show_status(result)
        st.info(empty)

    waiting()


def time_range() -> int:
    label = st.sidebar.selectbox("Time range", list(RANGES), index=0, key="range")
    return RANGES[label]


def _secrets_section(name: str) -> dict | None:
    try:
        return dict(st.secrets[name]) if name in st.secrets else None
    except Exception:  # no secrets file at all: that is fine
        return None


def client_address() -> str:
    """Who is signing in, as the connection says: Streamlit's `st.context.ip_address`
    is the WebSocket's TCP peer (None on loopback). Behind a reverse proxy every user
    shares the proxy's address (docs/security.md)."""
    ip = st.context.ip_address
    return ip if isinstance(ip, str) and ip else "localhost"


def operator() -> str | None:
    """The signed-in operator's name, or None for a viewer. Renders the sign-in box."""
    box = st.sidebar.container(border=True)
    oidc = _secrets_section("auth")
    if oidc:
        allowed = set((_secrets_section("operators_oidc") or {}).get("emails", []))
        if not st.user.is_logged_in:
            box.button("Sign in (SSO)", on_click=st.login)
            return None
        email = st.user.get("email", "")
        box.caption(f"Signed in as {email}")
        box.button("Sign out", on_click=st.logout)
        return email if email in allowed else None
    who = st.session_state.get("operator")
    if who and auth.session_expired(st.session_state.get("operator_since")):
        del st.session_state["operator"]
        who = None
        box.warning("Your operator session expired; sign in again.")
    if who:
        box.caption(f"Operator: **{who}**")
        if box.button("Sign out"):
            del st.session_state["operator"]
            st.rerun()
        return who
    box.caption("Viewer (read-only). Operators sign in to act.")
    with box.form("login", clear_on_submit=True):
        name = st.text_input("Operator", key="login_name")
        password = st.text_input("Password", type="password", key="login_password")
        if st.form_submit_button("Sign in"):
            ops = auth.load_operators(settings().operators_file, _secrets_section("operators"))
            client = client_address()
            result = auth.authenticate(name, password, ops, client=client)
            if result.ok:
                st.session_state["operator"] = name
                st.session_state["operator_since"] = time.time()
                audit_log().write(name, "sign-in", "dashboard", "ok", source="dashboard",
                                  client=client)
                st.rerun()
            else:
                # the typed name only if it is an operator's (it may be a mistyped
                # password); one line per client per minute, however many tries
                auth.REFUSALS.refused(audit_log(), client, name if name in ops else "unknown",
                                      "sign-in", "dashboard", source="dashboard",
                                      detail=result.message)
                st.error(result.message)
    return None


# Colour-blind safe (perceptually uniform, readable in grey); down cells are not on it.
SCALE = "viridis"
DOWN_FILL = "#d9d9d9"


def heatmap(frame, x: str, y: str, value: str, title: str, scheme: str = SCALE,
            reverse: bool = False, height: int | None = None) -> None:
    """A node x GPU (or rank x time) heatmap with Altair, which Streamlit ships. With a
    `state` column, cells whose state is not "ok" are drawn grey, marked DOWN and
    named in the tooltip: a down GPU reports no value and was a blank cell."""
    import altair as alt

    has_state = "state" in frame.columns
    base = alt.Chart(frame).encode(x=alt.X(f"{x}:O", sort=None, title=x),
                                   y=alt.Y(f"{y}:O", sort=None, title=y))
    tooltip = [x, y, alt.Tooltip(f"{value}:Q", format=".2f"), *(["state"] if has_state else [])]
    values = base.mark_rect().encode(
        color=alt.Color(f"{value}:Q", title=title, scale=alt.Scale(scheme=scheme, reverse=reverse)),
        tooltip=tooltip)
    chart = values
    if has_state:
        values = values.transform_filter(alt.datum.state == "ok")
        down = base.transform_filter(alt.datum.state != "ok")
        chart = alt.layer(values, down.mark_rect(color=DOWN_FILL, stroke="black").encode(
            tooltip=tooltip), down.mark_text(text="DOWN", fontWeight="bold", color="black"))
    if height:
        chart = chart.properties(height=height)
    st.altair_chart(chart, width="stretch")
