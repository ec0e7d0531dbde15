"""Pieces every page shares: settings, the stale-data banner, the time window and
what the URL selects (dashboard/links.py), charts with units, and the operator login
(viewers are read-only)."""

from __future__ import annotations

import contextlib
import inspect
import os
import re
import time
from collections.abc import Callable
from typing import TYPE_CHECKING

import streamlit as st

from clusterpulse.agent.audit import AuditLog, verify
from clusterpulse.agent.peeruid import account_key, uid_of_peer
from clusterpulse.agent.validate import is_digits
from clusterpulse.dashboard import auth, config, data, links
from clusterpulse.dashboard.data import Result

if TYPE_CHECKING:
    from streamlit.delta_generator import DeltaGenerator

# Every time the dashboard shows is UTC, 24-hour: charts and tables agree, and say so.
TIME_TITLE = "time (UTC)"


def settings() -> config.Settings:
    """Read per run (cheap), so a changed environment takes effect; a setting the
    dashboard cannot run with stops the page with its name, not a traceback. The
    password files are read here too: one that cannot be read stops the page naming
    it, where the store and Alertmanager used to answer 401 on every panel."""
    try:
        s = config.from_env()
        s.prometheus_auth()
        s.alertmanager_auth()
        return s
    except config.SettingsError as err:
        st.error(f"Dashboard setting: {err}", icon=":material/settings:")
        st.stop()
        raise  # not reached: st.stop() ends the run


# The key of a page's top row of figures (`kpi_row`): its CSS class is `st-key-` + it.
KPI_ROW_KEY = "cp-kpirow"
# Streamlit draws captions at 60 % opacity: 3.8:1 against the page, under the 4.5:1
# WCAG AA asks of text (measured in the browser test). A solid grey keeps them quieter
# than body text: 7.2:1 on the page, 6.8:1 on the sidebar.
READABLE_CSS = ('<style>[data-testid="stCaptionContainer"] {opacity: 1; color: #595755;}'
                # a figure of a top row (kpi_row) is never narrower than its text on one
                # line: the row wraps a figure to the next line instead
                f'.st-key-{KPI_ROW_KEY} > * {{min-width: max-content;}}'
                '</style>')


def readable_text() -> None:
    """Apply READABLE_CSS to the page (a style alone takes no room on it)."""
    st.html(READABLE_CSS)


def audit_log() -> AuditLog:
    return AuditLog(settings().audit_log)


def audit_chain_status() -> None:
    """The audit chain, checked in the file and against the heads Prometheus saw of it
    (published outside the file by the remediation receiver): records cut from the end,
    or a record deleted with the chain rebuilt after it, read "intact" in the file alone.
    Breaks are named by line; `clusterpulse-audit verify FILE --head SEQ:HASH` checks
    any one head by hand."""
    path = settings().audit_log
    if not path.exists():
        return
    seen = data.central_audit_heads_seen(settings().prometheus_url).value or []
    try:
        verdict = verify(path, seen)
    except OSError as err:
        st.warning(f"Audit log {path}: cannot read it ({err.strerror or err}).")
        return
    head = f"head `{verdict.head.seq}:{verdict.head.digest[:16]}`"
    checked = f", checked against {len(seen)} head(s) Prometheus saw" if seen else ""
    highest = max((h.seq for h in seen), default=0)
    if highest > verdict.head.seq:
        st.error(f"Audit log rewound: Prometheus saw record {highest}, the file ends at "
                 f"{verdict.head.seq} ({head}): records were cut from its end. Check it "
                 "against an earlier head: `clusterpulse-audit verify FILE --head SEQ:HASH` "
                 "(docs/runbooks.md#auditlogrewound).", icon=":material/gpp_bad:")
    elif verdict.intact:
        st.caption(f"Hash chain intact: {verdict.records} records, {head}{checked}.")
    else:
        where = ", ".join(f"line {n} ({why})" for n, why in verdict.breaks[:5])
        st.error(f"Audit hash chain broken at {len(verdict.breaks)} place(s): {where}; "
                 f"{head}{checked}.", icon=":material/gpp_bad:")


# The key prefix of a figure of a page's top row (`kpi`): its container's CSS class
# is `st-key-` + the key, which the browser tests find it by.
KPI_KEY = "cp-kpi-"


def kpi_row(count: int) -> list[DeltaGenerator]:
    """`count` places for figures (`kpi`), side by side while the page is wide enough
    and on further lines where it is not, each at least as wide as its figure on one
    line (READABLE_CSS). Not st.columns: its columns shrink with the page, and at a 1024 px
    window with the sidebar open the Run page's six were 80 px wide, its "Loss" value
    broke into "0.90" over "5" and "Last checkpoint" into "step" over "300" (at 1400 px
    "step 1480" broke too)."""
    row = st.container(horizontal=True, gap="small", key=KPI_ROW_KEY)
    return [row.container(gap=None) for _ in range(count)]


def kpi(where: DeltaGenerator, label: str, value: object, delta: str | None = None,
        help: str | None = None) -> None:
    """One figure of a page's top row, in `where` (a column): its label, its value as
    large as st.metric's, a delta as a coloured badge under it, all of them Markdown
    and a heading. Not st.metric: its code is one of the scripts a browser loads when
    the first metric appears, and on a first visit the Cluster and Run pages' rows
    waited 0.4-1.0 s after their data had come for it and for the page's other new
    element kinds, which the browser drew together (docs/benchmarks.md); Markdown and
    headings are in Streamlit's main script and are drawn as they come. (Not Markdown
    with HTML or an emoji code such as `:33:` in it: their readers load on first use
    too; the label and value are escaped.) A delta ('+3 % vs 15 min') reads green with
    an up arrow, one that starts with '-' red with a down arrow, as st.metric's did."""
    key = KPI_KEY + re.sub(r"[^a-z0-9]+", "-", label.lower()).strip("-")
    with where.container(key=key, gap=None):
        st.markdown(_markdown_text(label), help=help)
        st.header(_markdown_text(str(value)), anchor=False)
        if delta:
            down = delta.lstrip().startswith("-")
            colour, arrow = ("red", "arrow_downward") if down else ("green", "arrow_upward")
            st.markdown(f":{colour}-badge[:material/{arrow}: {_markdown_text(delta)}]")


def _markdown_text(text: str) -> str:
    """`text` as literal Markdown: no emphasis, link, HTML, directive (`:red[...]`) or
    list of its own (a leading '-' or '+' starts one); digits, dots, slashes and
    percent signs, all a figure has, are left as they are."""
    text = "".join("\\" + c if c in "\\`*_[]<>#|~:" else c for c in text)
    return "\\" + text if text[:1] in ("-", "+") else text


def show_status(result: Result, what: str = "Prometheus") -> bool:
    """A banner when data is stale; True if there is anything to show."""
    if result.stale:
        age = f"{time.time() - result.fetched_at:.0f} s old" if result.fetched_at else "none yet"
        st.error(f"{what} is unavailable — showing the last data ({age}). {result.error}",
                 icon=":material/warning:")
    return result.value is not None


def choose(label: str, names: Callable[[], Result], empty: str, param: str,
           later: list[Callable[[], None]] | None = None) -> str:
    """A selector over names from Prometheus (`names` reads them), preselected by the
    URL's `param` (a deep link) and written back to it. While there are none (nothing
    reports yet, or Prometheus is down or slow at the page's first read) the page says
    so and reads again every refresh, reloading itself once there are: a page stopped
    there waited for a manual reload forever. With `later`, the widget's place is kept
    and it is drawn when the page calls what is appended there (see signin_box)."""
    first = names()
    if not first.value:
        _until_any(names, empty)
        st.stop()
    show_status(first)
    key = label.lower()
    wanted = _from_url(param, key)
    if wanted is not None and wanted not in first.value:
        st.warning(f"{label} {wanted!r} from the link reports nothing now; showing another.")
        st.session_state.pop(key, None)
    if later is None:
        value = st.selectbox(label, first.value, key=key)
    else:  # its place now, the widget after the page's first content (signin_box)
        if st.session_state.get(key) not in first.value:
            st.session_state.pop(key, None)  # what the widget then shows: the first
        value = st.session_state.get(key, first.value[0])
        slot = st.container()
        later.append(lambda: slot.selectbox(label, first.value, key=key))
    _to_url(param, value)
    return value


def _from_url(param: str, key: str) -> str | None:
    """The URL's value of `param` when it is new (a link was followed), put into the
    widget `key` before the widget is drawn; None when the URL did not change it."""
    ss, qp = st.session_state, st.query_params
    value = qp.get(param)
    if value is None or value == ss.get(f"url:{param}"):
        return None
    ss[key] = value
    ss[f"url:{param}"] = value
    return value


def _to_url(param: str, value: str | None) -> None:
    ss = st.session_state
    if value is None:
        st.query_params.pop(param, None)
    else:
        st.query_params[param] = value
    ss[f"url:{param}"] = value


def url_param(param: str) -> str | None:
    """A parameter only links set (the GPU or rank to show first); None if absent."""
    return st.query_params.get(param) or None


def _until_any(names: Callable[[], Result], empty: str) -> None:
    @st.fragment(run_every=settings().refresh_s)
    def waiting() -> None:
        result = names()
        if result.value:
            st.rerun()  # from a fragment's own run, the whole page: now it can choose
        show_status(result)
        st.info(empty)

    waiting()


def time_window(later: list[Callable[[], None]] | None = None) -> links.Window:
    """The sidebar's time picker (ranges, or a custom UTC window). A link's window is
    applied; otherwise the last one chosen is kept across pages (the range reset to
    15 min on every page change), and the URL always says which it is. The choice is
    kept outside the widgets (a page change gives them fresh state): their callbacks
    store it before the page runs, and every run puts it back into them. With `later`,
    the widgets are drawn when the page calls what it appends there."""
    ss, qp = st.session_state, st.query_params
    url = {k: qp[k] for k in links.WINDOW_KEYS if k in qp}
    last = ss.get("window_params")
    try:  # a URL other than the one this session last wrote: a link was followed
        win = links.window(url if url and url != ss.get("window_url") else last or {})
    except links.LinkError as err:
        st.sidebar.warning(f"Time range from the link: {err}. Showing {links.DEFAULT_RANGE}.")
        win = links.window({})
    ss["range_choice"] = win.label
    if win.label == links.CUSTOM:
        start, end = win.bounds()
        ss["range_from"] = links.fmt_utc(start)
        ss["range_until"] = links.fmt_utc(end) if win.end is not None else ""
    slot = st.sidebar.container()

    def picker() -> None:
        slot.selectbox("Time range", [*links.RANGES, links.CUSTOM], key="range_choice",
                       on_change=_window_chosen)
        if win.label == links.CUSTOM:
            slot.text_input("From (UTC)", key="range_from", on_change=_window_chosen,
                            help="e.g. 2026-01-31T14:05")
            slot.text_input("Until (UTC)", key="range_until", on_change=_window_chosen,
                            placeholder="now", help="empty: up to now")

    if later is None:
        picker()
    else:  # after the page's first content (signin_box); its place is kept
        later.append(picker)
    error = ss.pop("range_error", None)
    if error:
        slot.error(error)
    ss["window_params"] = ss["window_url"] = win.params()
    for k in links.WINDOW_KEYS:
        if k not in win.params():
            qp.pop(k, None)
    qp.update(win.params())
    return win


def _window_chosen() -> None:
    """The picker's callback: the window the widgets now say, or the error in it."""
    ss = st.session_state
    choice = ss["range_choice"]
    if choice != links.CUSTOM:
        ss["window_params"] = links.Window(choice, links.RANGES[choice]).params()
        return
    params = {"range": links.CUSTOM,
              "from": ss.get("range_from") or links.fmt_utc(time.time() - 3600),
              "until": ss.get("range_until") or ""}  # empty: up to now
    try:
        ss["window_params"] = links.window(params).params()
    except links.LinkError as err:
        ss["range_error"] = str(err)


def keep() -> dict[str, str]:
    """The current window's URL parameters, for links to other pages."""
    return dict(st.session_state.get("window_params") or {})


def window_from_link() -> None:
    """On a page without a picker (Cluster): a link's valid window becomes the
    session's, as `time_window` does, so the page's links and the pages the sidebar
    opens keep it. Opened with `range=1h`, its heatmap cells and the sidebar's pages
    opened at 15 min."""
    ss, qp = st.session_state, st.query_params
    url = {k: qp[k] for k in links.WINDOW_KEYS if k in qp}
    if not url or url == ss.get("window_url"):
        return
    with contextlib.suppress(links.LinkError):  # a bad one: the default, as elsewhere
        ss["window_params"] = ss["window_url"] = links.window(url).params()


def _secrets_section(name: str) -> dict | None:
    try:
        return dict(st.secrets[name]) if name in st.secrets else None
    except Exception:  # no secrets file at all: that is fine
        return None


def client_address() -> str:
    """Who is signing in, as the connection says: for a WebSocket from this host the
    user that owns it (`uid:N`, the kernel's answer), else its address, every loopback
    one `localhost` (auth.client_of). A local user may connect from any 127/8 or host
    address, and one of them made 5 wrong tries a quarter of an hour and kept every
    operator, all arriving over loopback (SSH tunnels, the shipped 127.0.0.1 bind),
    from signing in. Behind a reverse proxy every user shares the proxy's (docs/security.md)."""
    ends = _websocket_ends()
    if ends is not None:
        uid = uid_of_peer(*ends)
        if uid is not None and uid >= 0:
            return account_key(uid)
    if os.environ.get("FORWARDED_ALLOW_IPS"):
        # behind a trusted proxy the address is X-Forwarded-For's, and whoever reaches
        # the dashboard from the proxy's address writes that header: one budget for all
        # (a review's local user made each try a new client with a forged header)
        return "proxied"
    return auth.client_of(st.context.ip_address)


def _websocket_ends() -> tuple[tuple, tuple] | None:
    """(peer, our end) of this session's WebSocket, each (host, port), or None where
    this Streamlit does not tell (its server's session client and the ASGI WebSocket
    are read as they are in Streamlit 1.5x-1.6x; any other shape falls back to the
    address)."""
    try:
        from streamlit import runtime
        from streamlit.runtime.scriptrunner import get_script_run_ctx

        ctx = get_script_run_ctx()
        client = runtime.get_instance().get_client(ctx.session_id) if ctx else None
        ws = getattr(client, "_websocket", None)
        peer, ours = getattr(ws, "client", None), (getattr(ws, "scope", None) or {}).get("server")
    except Exception:  # an internal that moved: the address is the fallback
        return None
    if not (isinstance(peer, tuple | list) and isinstance(ours, tuple | list)):
        return None
    return tuple(peer[:2]), tuple(ours[:2])


def signin_box() -> DeltaGenerator:
    """The sidebar's place for the sign-in box, kept at its top: a page draws its first
    content, then the box (`operator(box)`). The form's text inputs are elements whose
    code a browser loads on first use, and drawn first they came before the page's
    figures on a first visit (docs/benchmarks.md)."""
    return st.sidebar.container(border=True)


def operator(box: DeltaGenerator | None = None) -> str | None:
    """The signed-in operator's name, or None for a viewer. Renders the sign-in box, in
    `box` (`signin_box()`) or at the sidebar's end."""
    box = signin_box() if box is None else box
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
    who = signed_in_operator()
    why = st.session_state.pop("signed_out", None)
    if why:
        box.warning(why)
    if who:
        box.caption(f"Operator: **{who}**")
        broken = operators().broken
        if broken:  # the session is kept as it was (signed_in_operator)
            box.warning(f"The operators file cannot be read: {broken}. Sessions are kept "
                        "as they were until an administrator fixes it.",
                        icon=":material/no_accounts:")
        if box.button("Sign out"):
            sign_out()
            st.rerun()
        return who
    box.caption("Viewer (read-only). Operators sign in to act.")
    ops = operators()
    if ops.broken and not ops.hashes:  # a form would answer "wrong password" to everyone
        box.error(f"Sign-in is unavailable: {ops.broken}. An administrator must fix it; "
                  "the dashboard's log says more.", icon=":material/no_accounts:")
        return None
    with box.form("login", clear_on_submit=True):
        name = st.text_input("Operator", key="login_name")
        password = st.text_input("Password", type="password", key="login_password")
        if st.form_submit_button("Sign in"):
            client = client_address()
            result = auth.authenticate(name, password, ops.hashes, client=client)
            if result.ok:
                st.session_state["operator"] = name
                st.session_state["operator_since"] = time.time()
                st.session_state["operator_entry"] = auth.entry_fingerprint(ops.hashes[name])
                audit_log().write(name, "sign-in", "dashboard", "ok", source="dashboard",
                                  client=client)
                st.rerun()
            else:
                # the typed name only if it is an operator's (it may be a mistyped
                # password); one line per client per minute, however many tries
                auth.REFUSALS.refused(audit_log(), client,
                                      name if name in ops.hashes else "unknown",
                                      "sign-in", "dashboard", source="dashboard",
                                      detail=result.message)
                st.error(result.message + ops.refusal_note())
    return None


def signed_in_operator() -> str | None:
    """The session's password operator, checked at every page run against the operators
    as they are now, or None. The session once trusted its own "operator" for 8 hours:
    an operator removed from the operators file (or whose password was changed) kept
    acting until then. One who is no longer there, whose entry changed, or whose
    session expired is signed out here, the reason kept for the sign-in box
    (session_state "signed_out"). Only a file read whole says an entry is gone or
    changed: one that cannot be read or parsed (`broken`: a typo, or a page run
    reading it mid-rewrite) has no entries, and signed every session out as "removed
    by an administrator" (and out it stayed once fixed); sessions are kept as they are
    while it is broken, and the sign-in box says so (`operator`)."""
    ss = st.session_state
    who = ss.get("operator")
    if not who:
        return None
    ops = operators()
    stored = ops.hashes.get(who)
    if auth.session_expired(ss.get("operator_since")):
        why = "Your operator session expired; sign in again."
    elif ops.broken:
        return who
    elif stored is None:
        why = (f"Signed out: {who} is no longer an operator (removed from the operators "
               "by an administrator).")
    elif auth.entry_fingerprint(stored) != ss.get("operator_entry"):
        why = f"Signed out: the password of operator {who} was changed; sign in again."
    else:
        return who
    sign_out()
    ss["signed_out"] = why
    return None


def acting_operator() -> str | None:
    """Who may act now, checked when an action is asked for (a button's callback), not
    taken from the page drawn before the click: an operator removed since then is
    refused. SSO operators are checked against the allowed emails as `operator` does."""
    if _secrets_section("auth"):
        allowed = set((_secrets_section("operators_oidc") or {}).get("emails", []))
        email = st.user.get("email", "") if st.user.is_logged_in else ""
        return email if email and email in allowed else None
    return signed_in_operator()


def sign_out() -> None:
    for key in ("operator", "operator_since", "operator_entry"):
        st.session_state.pop(key, None)


def operators() -> auth.Operators:
    """The password operators (Streamlit secrets and the operators file), read again
    whenever the file changed (auth.OPERATORS: each page run checks its operator
    against them, so an edited file takes effect at once); what is wrong with them goes
    to the dashboard's log (the journal under systemd), once (auth.REPORTED)."""
    ops = auth.OPERATORS.load(settings().operators_file, _secrets_section("operators"))
    auth.REPORTED.report(ops)
    return ops


# What a table shows for a missing value: Streamlit's grid writes "None", which read as
# a value (the straggler table's cells during a restart). st.dataframe's `placeholder`
# says otherwise where this Streamlit has it (pyproject.toml's floor may not).
MISSING = data.MISSING
_HAS_PLACEHOLDER = "placeholder" in inspect.signature(st.dataframe).parameters


def table(data, **kwargs) -> None:
    """st.dataframe(data, **kwargs), its missing values shown as MISSING."""
    if _HAS_PLACEHOLDER:
        kwargs.setdefault("placeholder", MISSING)
    st.dataframe(data, **kwargs)


# Colour-blind safe (perceptually uniform, readable in grey); down cells are not on it.
SCALE = "viridis"
DOWN_FILL = "#d9d9d9"


def heatmap(frame, x: str, y: str, value: str, title: str, scheme: str = SCALE,
            reverse: bool = False, height: int | None = None,
            y_order: list | None = None, x_order: list | None = None,
            domain: tuple[float, float] | None = None) -> None:
    """Draw `heatmap_spec`'s chart of `frame` (its arguments are that function's)."""
    _chart(frame, heatmap_spec(frame, x, y, value, title, scheme, reverse, height, y_order,
                               x_order, domain))


def heatmap_spec(frame, x: str, y: str, value: str, title: str, scheme: str = SCALE,
                 reverse: bool = False, height: int | None = None,
                 y_order: list | None = None, x_order: list | None = None,
                 domain: tuple[float, float] | None = None) -> dict:
    """A node x GPU (or rank x time) heatmap's Vega-Lite spec. With a `state` column,
    cells whose state is not "ok" are drawn grey, marked DOWN and named in the tooltip:
    a down GPU reports no value and was a blank cell. With a `url` column, a click
    anywhere on a cell opens its evidence (dashboard/links.py): the DOWN word is a mark
    of its own over the cell, and without the link of its own only the cell's edge
    around the word opened it. Every row and column is labelled: Vega drops labels
    that would overlap, and rank 2's row of a short chart had none.

    Rows and columns come in `y_order` / `x_order`, else in the frame's order: the
    ok and down cells are separate layers, and Vega orders a layered axis by layer
    (GPUs 0, 1, 3, 2 when GPU 2 was down). `domain`: the colour scale's fixed range,
    values beyond it clamped to its ends, so that a colour means the same value on
    every load (a relative scale drew a normal 63 °C as bright as a throttling 89 °C
    when those were the extremes); without it the scale spans the values shown.

    With a boolean `word` column (the Run page's rank x time chart: heat.rank_cells) the
    DOWN word is drawn on those down cells only, ending at the cell's centre, over the
    down cells before it: a time column is narrower than the word."""
    has_state = "state" in frame.columns

    def order(field: str, given: list | None) -> list:
        return list(given) if given is not None else list(dict.fromkeys(frame[field].tolist()))

    position = {
        "x": {"field": x, "type": "ordinal", "sort": order(x, x_order), "title": x, "axis": {
            "labelOverlap": "parity", "labelAngle": 0 if frame[x].nunique() <= 16 else -90}},
        "y": {"field": y, "type": "ordinal", "sort": order(y, y_order), "title": y,
              "axis": {"labelOverlap": False}}}
    tooltip = [{"field": x, "type": "nominal"}, {"field": y, "type": "nominal"},
               {"field": value, "type": "quantitative", "format": ".2f", "title": title},
               *([{"field": "state", "type": "nominal"}] if has_state else [])]
    link = {"href": {"field": "url", "type": "nominal"}} if "url" in frame.columns else {}
    cursor = "pointer" if link else "default"
    scale: dict = {"scheme": scheme, "reverse": reverse}
    if domain is not None:
        scale.update(domain=list(domain), clamp=True)
    spec: dict = {"mark": {"type": "rect", "cursor": cursor},
                  "encoding": {**position, "tooltip": tooltip, **link, "color": {
                      "field": value, "type": "quantitative", "title": title,
                      "scale": scale}}}
    if has_state:
        down = [{"filter": "datum.state !== 'ok'"}]
        some = "word" in frame.columns
        spec = {"layer": [
            {**spec, "transform": [{"filter": "datum.state === 'ok'"}]},
            {"mark": {"type": "rect", "color": DOWN_FILL, "stroke": "black", "cursor": cursor},
             "encoding": {**position, "tooltip": tooltip, **link}, "transform": down},
            {"mark": {"type": "text", "text": "DOWN", "fontWeight": "bold", "color": "black",
                      "cursor": cursor, **({"align": "right"} if some else {})},
             "encoding": {**position, "tooltip": tooltip, **link},
             "transform": down + ([{"filter": "datum.word"}] if some else [])}]}
    if height:
        spec["height"] = height
    return spec


# Axis and legend text dark enough to read: Streamlit's theme greys both to 3.7:1
# contrast, under the 4.5:1 WCAG AA asks of text (measured in the browser test)
_TEXT = {"labelColor": "#262730", "titleColor": "#262730", "labelFontSize": 12,
         "titleFontSize": 12}
READABLE = {"axis": _TEXT, "legend": _TEXT}


def _chart(frame, spec: dict) -> None:
    """Draw a Vega-Lite `spec` over `frame`, written out as the spec itself: Altair built
    the same specs in 60-130 ms a chart (it validates every part against the schema),
    the Node page's 9 charts most of its script's time on every refresh, and importing
    it cost a server's first page view ~1 s."""
    st.vega_lite_chart(frame, {**spec, "config": READABLE}, width="stretch")


def _natural(name: str) -> list:
    """'gpu 10' after 'gpu 2': the numbers in a name compared as numbers."""
    return [(0, int(part), "") if is_digits(part) else (1, 0, part)
            for part in re.split(r"(\d+)", name) if part]


def line_chart(frame, y_title: str, threshold: float | None = None,
               threshold_label: str = "", height: int = 240, counts: bool = False) -> None:
    """A time series chart that says what it shows: the y axis's quantity and unit, the
    time axis in 24-hour UTC (it read '03:56 … 04 PM' beside 24-hour tables), and a
    dashed line at the threshold that matters (the throttle temperature). `frame`: one
    column per series, indexed by time. Series in natural order ('gpu 2' before 'gpu
    10') on a categorical scale whose neighbours differ in hue (Streamlit's own drew
    GPUs 2 and 3 red and pink); `counts`: whole-number ticks (restarts read 0.5)."""
    long = frame.rename_axis("time").reset_index().melt(
        id_vars="time", var_name="series", value_name="value").dropna()
    span = (long["time"].max() - long["time"].min()).total_seconds() if len(long) else 0
    x = {"field": "time", "type": "temporal", "title": TIME_TITLE, "axis": {
        "format": "%m-%d %H:%M" if span > 86400 else "%H:%M", "tickCount": _ticks(span),
        "labelOverlap": True}}
    big = bool(long["value"].abs().max() >= 1e4) if len(long) else False
    y = {"field": "value", "type": "quantitative", "title": y_title,
         "axis": {"format": "~s"} if big else {"tickMinStep": 1, "format": "d"} if counts
         else {}}
    one = long["series"].nunique() <= 1  # one line needs no legend ("run ?")
    spec: dict = {"mark": {"type": "line"}, "encoding": {
        "x": x, "y": y,
        "color": {"field": "series", "type": "nominal", "title": None,
                  "sort": sorted(map(str, long["series"].unique()), key=_natural),
                  "scale": {"scheme": "tableau10"},
                  "legend": None if one else {"orient": "right"}},
        "tooltip": [{"field": "time", "type": "temporal", "format": "%H:%M:%S",
                     "title": TIME_TITLE}, {"field": "series", "type": "nominal"},
                    {"field": "value", "type": "quantitative", "format": ".3~f",
                     "title": y_title}]}}
    if threshold is not None:
        rule = {"values": [{"value": threshold, "label": threshold_label}]}
        at = {"field": "value", "type": "quantitative"}
        spec = {"layer": [
            spec,
            {"data": rule, "mark": {"type": "rule", "strokeDash": [6, 4], "color": "#d62728"},
             "encoding": {"y": at, "tooltip": [{"field": "label", "type": "nominal"}]}},
            {"data": rule, "mark": {"type": "text", "align": "left", "dx": 4, "dy": -6,
                                    "color": "#d62728"},
             "encoding": {"y": at, "x": {"value": 0},
                          "text": {"field": "label", "type": "nominal"}}}]}
    spec["height"] = height
    _chart(long, spec)


def _ticks(span_s: float) -> int:
    """At most six ticks, at least a minute apart: ticks every 30 s under an HH:MM
    format read '18:45 18:45 18:46 ...'."""
    return max(1, min(6, int(span_s // 60)))
