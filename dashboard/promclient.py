"""A typed client for the Prometheus HTTP API (and compatible ones: Thanos, Mimir,
VictoriaMetrics). Timeouts on every call; Prometheus's own error bodies parsed into
the exception text; "unreachable" kept apart from "query rejected" so the dashboard
can say which."""

from __future__ import annotations

import threading
from collections.abc import Callable
from concurrent.futures import ThreadPoolExecutor
from dataclasses import dataclass
from typing import Any, TypeVar

import requests

from clusterpulse.agent.validate import is_string_map


class PrometheusError(Exception):
    """Prometheus answered, but with an error (bad query, timeout, overload).
    `transient`: asking again later may work (a timeout, an overload, a proxy's 5xx),
    where a bad query or a URL that is no Prometheus will fail the same way."""

    def __init__(self, message: str, transient: bool = False) -> None:
        super().__init__(message)
        self.transient = transient


class PrometheusUnavailable(PrometheusError):
    """Prometheus could not be reached at all."""

    def __init__(self, message: str) -> None:
        super().__init__(message, transient=True)


# Prometheus's API error types that may pass (the others are the query's own fault)
TRANSIENT_ERRORS = {"timeout", "canceled", "unavailable", "internal"}


T = TypeVar("T")
# Requests in flight at once from one `at_once`: the session's connection pool keeps 10
# per host (more would be opened and dropped each time).
MAX_IN_FLIGHT = 10


def at_once(calls: dict[str, Callable[[], T]]) -> dict[str, T]:
    """Run independent fetches at once, each result under its name. A page's queries
    asked one after the other took the sum of their round trips (the Run page's 27,
    the Node page's 14), and Prometheus runs each query on one core: at once they take
    about the slowest. The first error is raised, as from a call alone."""
    if len(calls) <= 1:
        return {name: call() for name, call in calls.items()}
    with ThreadPoolExecutor(max_workers=min(MAX_IN_FLIGHT, len(calls))) as pool:
        futures = {name: pool.submit(call) for name, call in calls.items()}
        return {name: f.result() for name, f in futures.items()}


@dataclass(frozen=True)
class Sample:
    labels: dict[str, str]
    value: float


@dataclass(frozen=True)
class Series:
    labels: dict[str, str]
    points: list[tuple[float, float]]  # (unix time, value)


def _labels(metric: object) -> dict[str, str]:
    """A series' labels as the API gives them; TypeError for anything else."""
    if not is_string_map(metric):
        raise TypeError("labels")
    return metric


class PrometheusClient:
    def __init__(self, url: str, timeout_s: float = 5.0,
                 session: requests.Session | None = None,
                 auth: tuple[str, str] | None = None) -> None:
        """`auth`: basic-auth (user, password), for a store that asks for it
        (VictoriaMetrics past one machine, docs/scaling.md)."""
        self.url = url.rstrip("/")
        self.timeout_s = timeout_s
        self.session = session or requests.Session()
        if auth is not None:
            self.session.auth = auth
        self.queries = 0  # issued, for benchmarks and the dashboard's footer
        self._count_lock = threading.Lock()

    def _get(self, path: str, params: dict[str, Any]) -> Any:
        with self._count_lock:
            self.queries += 1
        try:
            r = self.session.get(self.url + path, params=params, timeout=self.timeout_s)
        except requests.RequestException as err:
            raise PrometheusUnavailable(f"Prometheus at {self.url} is unreachable: "
                                        f"{type(err).__name__}") from None
        try:
            body = r.json()
        except ValueError:
            raise PrometheusError(f"Prometheus answered HTTP {r.status_code} without JSON "
                                  f"(is {self.url} a Prometheus API?)",
                                  transient=r.status_code >= 500 or r.status_code == 429
                                  ) from None
        if not isinstance(body, dict) or body.get("status") != "success":
            kind = body.get("errorType") if isinstance(body, dict) else None
            text = body.get("error", "unknown error") if isinstance(body, dict) else body
            # without Prometheus's errorType it is some other server's JSON (an agent's
            # {"error": "no route ..."}), not "error: ..." that callers print after theirs
            why = f"{kind}: {text} (HTTP {r.status_code})" if kind else \
                f"{text} (HTTP {r.status_code}; is {self.url} a Prometheus API?)"
            raise PrometheusError(why,
                                  transient=kind in TRANSIENT_ERRORS
                                  or r.status_code >= 500 or r.status_code == 429)
        return body.get("data")  # missing: the caller names the shape

    def query(self, promql: str, at: float | None = None) -> list[Sample]:
        params: dict[str, Any] = {"query": promql}
        if at is not None:
            params["time"] = at
        data = self._get("/api/v1/query", params)
        try:
            if data["resultType"] == "scalar":
                return [Sample({}, float(data["result"][1]))]
            return [Sample(_labels(s["metric"]), float(s["value"][1])) for s in data["result"]]
        except (KeyError, TypeError, ValueError, IndexError):
            raise self._misshapen("query") from None

    def query_many(self, exprs: dict[str, str]) -> dict[str, list[Sample]]:
        """Instant queries asked at once (`at_once`): a page's independent queries take
        the time of the slowest, not the sum (at 16,384 GPUs, seconds)."""
        return at_once({name: (lambda e=e: self.query(e)) for name, e in exprs.items()})

    def query_range(self, promql: str, start: float, end: float, step: float) -> list[Series]:
        data = self._get("/api/v1/query_range",
                         {"query": promql, "start": start, "end": end, "step": step})
        try:
            return [Series(_labels(s["metric"]), [(float(t), float(v)) for t, v in s["values"]])
                    for s in data["result"]]
        except (KeyError, TypeError, ValueError, IndexError):
            raise self._misshapen("range query") from None

    def _misshapen(self, what: str) -> PrometheusError:
        """A success whose data is not what the API returns (a proxy's page, another
        service's JSON): named like a missing API, never a KeyError on the page."""
        return PrometheusError(f"Prometheus at {self.url} answered a {what} with data "
                               "that is not a Prometheus result (is it a Prometheus API?)")

    def alerts(self) -> list[dict]:
        """The alerts Prometheus's rules have active (/api/v1/alerts), each with its
        labels, state and, while `keep_firing_for` holds it after its condition ended,
        `keepFiringSince`: what the ALERTS series cannot tell. Raises PrometheusError
        where there is no such API (a store, not a rule evaluator)."""
        data = self._get("/api/v1/alerts", {})
        alerts = data.get("alerts") if isinstance(data, dict) else None
        if not isinstance(alerts, list):
            raise PrometheusError(f"{self.url}/api/v1/alerts has no list of alerts")
        return [a for a in alerts if isinstance(a, dict)]

    def ready(self) -> bool:
        try:
            return self.session.get(self.url + "/-/ready", timeout=self.timeout_s).ok
        except requests.RequestException:
            return False
