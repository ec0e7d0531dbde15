"""Deep links: which node, GPU, run, rank and time window a page shows, in its URL.

An alert could not link to its evidence and every page change reset the time range:
what a page shows now lives in its query string (`st.query_params`), so a link from
an alert, a table row or a heatmap cell opens the page at that GPU or rank, over
that window. Pure functions over plain dicts, so they are tested without a browser;
the alert rules' `dashboard_url` annotations build the same paths (tests check it).
"""

from __future__ import annotations

import calendar
import time
from dataclasses import dataclass
from urllib.parse import urlencode

# The time picker's ranges; "custom" is a window with its own end (`from`/`until`).
RANGES = {"15 min": 900, "1 h": 3600, "6 h": 21600, "24 h": 86400, "7 d": 604800}
CUSTOM = "custom"
DEFAULT_RANGE = "15 min"
# URL form of each range label (a query string with spaces and non-ASCII reads badly)
_SLUG = {"15 min": "15m", "1 h": "1h", "6 h": "6h", "24 h": "24h", "7 d": "7d", CUSTOM: CUSTOM}
_LABEL = {v: k for k, v in _SLUG.items()}
TIME_FORMAT = "%Y-%m-%dT%H:%M"  # UTC, like every time the dashboard shows
# The parameters a window is carried in: kept when a link leads to another page.
WINDOW_KEYS = ("range", "from", "until")


class LinkError(ValueError):
    """A query parameter the page cannot use; the message names it."""


@dataclass(frozen=True)
class Window:
    """A time window: the last `seconds` up to now, [start, end] (custom), or from
    `start` up to now (custom without `until`: an alert notification's link while the
    alert fires, which must still show its start when opened an hour later)."""

    label: str
    seconds: int
    end: float | None = None  # None: up to now
    start: float | None = None  # set only for a custom window up to now

    def bounds(self, now: float | None = None) -> tuple[float, float]:
        end = self.end if self.end is not None else (time.time() if now is None else now)
        return (self.start if self.start is not None else end - self.seconds), end

    def params(self) -> dict[str, str]:
        """The window as query parameters (empty for the default: short URLs)."""
        if self.label == CUSTOM:
            start, end = self.bounds()
            return {"range": CUSTOM, "from": fmt_utc(start),
                    **({"until": fmt_utc(end)} if self.end is not None else {})}
        return {} if self.label == DEFAULT_RANGE else {"range": _SLUG[self.label]}


def fmt_utc(t: float) -> str:
    return time.strftime(TIME_FORMAT, time.gmtime(t))


def parse_utc(text: str, name: str) -> float:
    try:
        return float(calendar.timegm(time.strptime(text.strip(), TIME_FORMAT)))
    except ValueError:
        raise LinkError(f"{name}={text!r}: expected a UTC time like 2026-01-31T14:05") from None


def window(params: dict[str, str], now: float | None = None) -> Window:
    """The window a URL asks for; LinkError names a parameter it cannot use."""
    slug = params.get("range", _SLUG[DEFAULT_RANGE])
    label = _LABEL.get(slug)
    if label is None:
        raise LinkError(f"range={slug!r}: expected one of {', '.join(_SLUG.values())}")
    if label != CUSTOM:
        return Window(label, RANGES[label])
    if not params.get("from"):
        raise LinkError("range=custom needs from= (UTC, 2026-01-31T14:05), and until= "
                        "unless it runs up to now")
    start = parse_utc(params["from"], "from")
    if not params.get("until"):
        now = time.time() if now is None else now
        if start >= now:
            raise LinkError(f"from={params['from']!r} is in the future")
        return Window(CUSTOM, int(now - start), None, start)
    end = parse_utc(params["until"], "until")
    if end <= start:
        raise LinkError(f"until={params['until']!r} is not after from={params['from']!r}")
    return Window(CUSTOM, int(end - start), end)


def page_url(page: str, params: dict[str, str | int | None] | None = None,
             keep: dict[str, str] | None = None) -> str:
    """A link to one of the dashboard's pages, relative (it works under any base path
    the dashboard is served at); `keep`: the current window's parameters."""
    query = {k: str(v) for k, v in {**(params or {}), **(keep or {})}.items()
             if v is not None and v != ""}
    return page + ("?" + urlencode(query) if query else "")


def evidence(labels: dict[str, str], keep: dict[str, str] | None = None) -> str:
    """Where an alert's (or a row's) evidence is: the Run page at its rank, the Node
    page at its GPU, the node, the run; the Alerts page for an alert of none."""
    if labels.get("run") and labels.get("rank"):
        return page_url("run", {"run": labels["run"], "rank": labels["rank"]}, keep)
    if labels.get("node"):
        return page_url("node", {"node": labels["node"], "gpu": labels.get("gpu")}, keep)
    if labels.get("run"):
        return page_url("run", {"run": labels["run"]}, keep)
    return page_url("alerts", None, keep)
