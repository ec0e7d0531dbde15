"""Alertmanager API v2: active alerts with their silenced/inhibited state."""

from __future__ import annotations

from dataclasses import dataclass

import requests


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
        return [Alert(name=a["labels"].get("alertname", "?"), labels=a["labels"],
                      annotations=a.get("annotations", {}), state=a["status"]["state"],
                      silenced_by=a["status"].get("silencedBy", []),
                      inhibited_by=a["status"].get("inhibitedBy", []),
                      starts_at=a.get("startsAt", ""))
                for a in raw]
