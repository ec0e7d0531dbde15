"""Alertmanager API v2: active alerts with their silenced/inhibited state."""

from __future__ import annotations

from dataclasses import dataclass

import requests

from clusterpulse.agent.validate import is_string_map


class AlertmanagerUnavailable(Exception):
    pass


@dataclass(frozen=True)
class Alert:
    name: str
    labels: dict[str, str]
    annotations: dict[str, str]
    state: str  # active, suppressed, unprocessed
    silenced_by: list[str]
    inhibited_by: list[str]
    starts_at: str

    @property
    def severity(self) -> str:
        return self.labels.get("severity", "none")


class AlertmanagerClient:
    """`auth`: (user, password) for an Alertmanager whose API needs basic auth (the
    project ships it so: docs/security.md)."""

    def __init__(self, url: str, timeout_s: float = 5.0,
                 auth: tuple[str, str] | None = None) -> None:
        self.url = url.rstrip("/")
        self.timeout_s = timeout_s
        self.auth = auth

    def alerts(self) -> list[Alert]:
        try:
            r = requests.get(self.url + "/api/v2/alerts", timeout=self.timeout_s,
                             auth=self.auth)
            r.raise_for_status()
            raw = r.json()
        except (requests.RequestException, ValueError) as err:
            raise AlertmanagerUnavailable(f"Alertmanager at {self.url} is unreachable or "
                                          f"answered badly: {type(err).__name__}") from None
        try:
            if not isinstance(raw, list):
                raise TypeError("not a list")
            return [_alert(a) for a in raw]
        except (KeyError, TypeError, AttributeError):
            raise AlertmanagerUnavailable(
                f"Alertmanager at {self.url} answered with data that is not a list of "
                "alerts (is it an Alertmanager API v2?)") from None


def _strings(value: object, what: str) -> dict[str, str]:
    if not is_string_map(value):
        raise TypeError(what)
    return value


def _alert(a: dict) -> Alert:
    """One alert of /api/v2/alerts; KeyError/TypeError where it is not one."""
    status = a["status"]
    if not isinstance(status, dict) or not isinstance(status["state"], str):
        raise TypeError("status")
    labels = _strings(a["labels"], "labels")
    return Alert(name=labels.get("alertname", "?"), labels=labels,
                 annotations=_strings(a.get("annotations") or {}, "annotations"),
                 state=status["state"],
                 silenced_by=list(status.get("silencedBy") or []),
                 inhibited_by=list(status.get("inhibitedBy") or []),
                 starts_at=str(a.get("startsAt") or ""))
