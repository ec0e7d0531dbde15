"""The Audit page's table: one row per action, naming who took it.

One restart wrote 3-4 records (the dashboard's request, then each agent's states of
its command, signed `who = token`: the credential the dashboard used, with the
operator in `on_behalf_of`), and the chain's 64-character hash came before the
detail. Here the agents' records join the request whose command ids they carry, the
row names the authenticated signer (the request's, which the dashboard signs with its
signed-in operator), says how it ended on each node, and the hash goes last.
`on_behalf_of` is a claim from a request body, shown only beside its signer (`person`).
"""

from __future__ import annotations

import json

import pandas as pd

from clusterpulse.agent.validate import bounded_number

COLUMNS = ["time (UTC)", "who", "action", "run", "outcome", "why", "nodes", "source",
           "records", "detail", "prev"]


# The fields the table reads as text, and the last time pandas can hold (2262).
TEXT_FIELDS = ("who", "on_behalf_of", "action", "run", "outcome", "why", "source",
               "command", "node", "prev")
LAST_TS = 9.2e9


def usable(records: list[dict]) -> tuple[list[dict], int]:
    """The records whose fields the table reads have the types the writers give them
    (text, or none; a time in seconds; the request's nodes as a mapping), and how many
    do not. A damaged or forged record with valid JSON ("ts": "yesterday", "nodes":
    [...]) crashed the whole page before the chain's check, which names forged lines,
    was drawn."""
    kept = []
    for r in records:
        ts, nodes = r.get("ts", 0.0), r.get("nodes")
        if bounded_number(ts, 0, LAST_TS) is None:
            continue
        if any(r.get(k) is not None and not isinstance(r[k], str) for k in TEXT_FIELDS):
            continue
        if nodes is not None and not (isinstance(nodes, dict)
                                      and all(isinstance(n, str) for n in nodes)):
            continue
        kept.append({**r, **{k: "" for k in TEXT_FIELDS if k in r and r[k] is None}})
    return kept, len(records) - len(kept)


def person(record: dict) -> str:
    """Who acted: the record's signer, `who`, which its writer took from the kernel or a
    credential (the agent: the token's principal). `on_behalf_of` is only what the
    request's body said (any token holder can write "alice" there), so it never stands
    in for `who`: it is shown after it, labelled as the signer's claim,
    "fault-player (for alice)"."""
    who = record.get("who") or ""
    claim = record.get("on_behalf_of") or ""
    return f"{who or 'unknown'} (for {claim})" if claim and claim != who else who


def actions(records: list[dict]) -> pd.DataFrame:
    """Records (oldest first, as AuditLog.read gives them) -> one row per action,
    newest first. An agent record joins the request that sent its command; an agent
    record of no known request is an action of its own, with the later states of the
    same command."""
    rows: list[dict] = []
    by_command: dict[str, dict] = {}
    refusals: list[dict] = []
    for r in _requests_first(records):
        if _is_refusal(r):  # joined to its request below, which the log holds after it
            refusals.append(r)
            continue
        command = r.get("command")
        row = by_command.get(command) if command else None
        if row is None:
            row = {"ts": r.get("ts", 0.0), "who": person(r), "action": r.get("action", ""),
                   "run": r.get("run", ""), "outcome": r.get("outcome", ""),
                   "why": r.get("why", ""), "source": r.get("source", ""),
                   # each node the request went to, until its agent's records say more
                   "states": dict.fromkeys(r.get("nodes") or {}, "accepted" if r.get(
                       "outcome") == "accepted" else "requested"),
                   "records": 0, "detail": _detail(r), "prev": r.get("prev", "")}
            rows.append(row)
            for ref in (r.get("nodes") or {}).values():  # the request's command ids
                if isinstance(ref, str) and ref:
                    by_command[ref] = row
            if command:
                by_command[command] = row
        row["records"] += 1
        if r.get("source") == "agent" and r.get("node"):
            row["states"][r["node"]] = r.get("outcome", "")
            if row["who"] == (r.get("who") or "") and r.get("on_behalf_of"):
                row["who"] = person(r)  # the same signer, with the claim a later state names
    for r in refusals:
        row = next((row for row in rows if row["run"] == r.get("run") and row["source"] != "agent"
                    and r.get("node") in row["states"]
                    and 0 <= row["ts"] - r.get("ts", 0.0) <= REFUSAL_JOIN_S), None)
        if row is None:
            rows.append(row := {"ts": r.get("ts", 0.0), "who": person(r),
                                "action": r.get("action", ""), "run": r.get("run", ""),
                                "outcome": r.get("outcome", ""), "why": r.get("why", ""),
                                "source": r.get("source", ""), "states": {}, "records": 0,
                                "detail": _detail(r), "prev": r.get("prev", "")})
        row["records"] += 1
        row["states"][r["node"]] = r.get("outcome", "")
    rows.sort(key=lambda row: row["ts"])
    out = pd.DataFrame([{**{k: v for k, v in row.items() if k not in ("ts", "states")},
                         "time (UTC)": pd.Timestamp(row["ts"], unit="s").floor("s"),
                         "nodes": ", ".join(f"{n}: {s}" for n, s in sorted(row["states"].items()))}
                        for row in rows], columns=COLUMNS)
    return out.iloc[::-1].reset_index(drop=True)


# The table's columns as the page shows them: the actions table fits the page at a
# 1024 px window with the sidebar open (564 px), where its eleven columns took 1623 px
# and scrolled sideways at 1400 px too, "sim-node-1: refu…" the last of its nodes in
# view. What an on-call reads (when, who, what, how it ended on each node, why) is in
# five columns of text that wraps; the log's bookkeeping (source, records, detail,
# hash) is in a table of its own.
SHOWN = ["time (UTC)", "who", "action", "outcome", "why"]
BOOKKEEPING = ["time (UTC)", "source", "records", "detail", "prev"]


def shown(frame: pd.DataFrame) -> tuple[pd.DataFrame, pd.DataFrame]:
    """`frame` (as `actions` gives it) as the page's two tables, SHOWN and BOOKKEEPING:
    the time as text (it wraps between the date and the time), the run with the
    action ("checkpoint-restart on run web") and each node's outcome with the
    action's ("accepted; node-a: completed, node-b: completed")."""
    when = frame["time (UTC)"].map(lambda t: t.strftime("%Y-%m-%d %H:%M:%S"))
    action = [f"{a} on run {r}" if r else a for a, r in zip(frame["action"], frame["run"],
                                                                strict=True)]
    outcome = [f"{o}; {n}" if n else o for o, n in zip(frame["outcome"], frame["nodes"],
                                                       strict=True)]
    main = pd.DataFrame({"time (UTC)": when, "who": frame["who"], "action": action,
                         "outcome": outcome, "why": frame["why"]}, columns=SHOWN)
    rest = frame[BOOKKEEPING].assign(**{"time (UTC)": when})
    return main.reset_index(drop=True), rest.reset_index(drop=True)


# An agent refuses a restart while one of the run is in flight before the requester,
# waiting for every agent's answer, writes its request: it joins the first request for
# its run and node written within this long after it (one refused click read as three
# rows: the request, "sim-node-0: refused", "sim-node-1: refused").
REFUSAL_JOIN_S = 30.0


def _is_refusal(record: dict) -> bool:
    return record.get("source") == "agent" and bool(record.get("in_flight")) \
        and not record.get("command") and bool(record.get("node"))


def _requests_first(records: list[dict]) -> list[dict]:
    """`records` with each agent record of a requested command moved after the request:
    an agent writes "delivered" as its command arrives, before the requester, waiting
    for the command ids the agents answer, writes the request that names them (the
    remediation policy's restarts in the demo read as 3 actions: the request and one
    "delivered" per node)."""
    requested: dict[str, int] = {}  # command id -> the index of the request naming it
    for i, r in enumerate(records):
        for ref in (r.get("nodes") or {}).values():
            if isinstance(ref, str) and ref:
                requested.setdefault(ref, i)

    def place(i: int) -> tuple[int, int, int]:
        j = requested.get(records[i].get("command") or "")
        return (j, 1, i) if j is not None and j > i else (i, 0, i)

    return [records[i] for i in sorted(range(len(records)), key=place)]


def newest_line(frame: pd.DataFrame) -> str:
    """The newest action of `frame` (as `actions` gives it, filtered or not) in one line
    of Markdown: what an on-call opens the page for, drawn before the table (on a first
    visit the browser loads the table's code first, ~1 s). Every value is the log's, so
    it is escaped: an operator's reason is free text, and a link or image in it must
    not become one on the page."""
    if frame.empty:
        return ""
    row = frame.iloc[0]
    run = f" on run {_literal(row['run'])}" if row["run"] else ""
    nodes = f" ({_literal(row['nodes'])})" if row["nodes"] else ""
    why = f", because: {_literal(row['why'])}" if row["why"] else ""
    when = _literal(row["time (UTC)"].strftime("%Y-%m-%d %H:%M:%S"))
    return (f"**Newest action:** {when} UTC, "
            f"**{_literal(row['who']) or 'unknown'}** {_literal(row['action'])}{run}: "
            f"{_literal(row['outcome'])}{nodes}{why}")


def _literal(value: object) -> str:
    """`value` as plain Markdown text on one line: no emphasis, link, image, HTML,
    directive or emoji code of its own. Escaping the colons also keeps a time's
    `:33:` from reading as an emoji code, for which the browser loads Streamlit's
    emoji plugin first and draws the line after the table it was meant to precede."""
    text = " ".join(str(value).split())
    return "".join("\\" + c if c in "\\`*_[]()<>#|~:!{}$" else c for c in text)


def _detail(r: dict) -> str:
    rest = {k: v for k, v in r.items() if k not in (
        "ts", "who", "action", "why", "outcome", "run", "source", "prev", "on_behalf_of",
        "command", "node")}
    return json.dumps(rest, sort_keys=True, default=str) if rest else ""
