"""Automatic remediation: an Alertmanager webhook receiver that applies a policy.

The policy file (TOML) says which alert triggers which action:

    dry_run = false            # decide and audit, but do not act
    max_actions_per_run = 1    # rate limit: at most this many actions per run ...
    window_s = 900             # ... per this many seconds (no restart storms)

    [[rule]]
    alert = "RankHung"
    action = "restart"
    [[rule]]
    alert = "TrainingStraggler"
    match = { cause = "compute|data_loading" }   # labels, as anchored regexes
    action = "checkpoint-restart"
    sustained_s = 120          # only once the alert has fired this long

    [[rule]]
    alert = "TrainingLinkCongested"
    action = "evict-node"      # the alert's node sits out; the job goes on without it
    [evict]
    leave_s = 300              # how long it sits out before it rejoins

`evict-node` is a graceful checkpoint-restart of the runs with ranks on the alert's
node, asked of that node's agent only, with the node sitting out `leave_s` before
its launcher starts again (clusterpulse-train, trainer/launch.py): an elastic job
(`--nnodes MIN:MAX`) goes on without the node and takes it back at its return,
instead of running every step at its pace. When the job cannot go on without the
node (at its minimum node count, or the node hosts the rendezvous store) its ranks
refuse the command, which fails saying why, and nothing restarts. The launcher sits
out at most half the rendezvous join_timeout.

The first rule whose alert and `match` fit an alert decides; an alert no rule fits
is left to the people it pages. `match` lets the action follow the evidence: a
straggler whose GPU throttles for heat is not cured by restarting the job in place
(the GPU is as hot after it), while a scheduler can move the job off the node.
Alerts without a `run` label (a lost GPU) act on the runs with ranks on that node
(and GPU), found through Prometheus. An alert waiting for `sustained_s` is acted on
only if Prometheus still has it firing then. Every decision taken (acted, dry run,
rate-limited, failed) is audited, and every notification is kept for the dashboard's
history. A restart the agents refuse because one of the run is already in flight (an
operator's, say) is the decision "in_flight", audited "refused": no action was taken,
and it keeps the run's rate-limit slot all the same (the run was just restarted).

The webhook can restart jobs, so it only takes authenticated notifications: a bearer
token or basic auth (password = a token) from --webhook-token-file, both of which
Alertmanager's `http_config` can send. Payloads are schema-checked and bounded; label
values reach PromQL escaped; and `sustained_s` is measured from when this receiver
first heard of the alert (a missing or backdated `startsAt` cannot shorten it).

Durations (`sustained_s`, the rate-limit window, the resend window) run on the
monotonic clock: a wall clock stepped forward (NTP, a resumed VM) skipped the
`sustained_s` wait and emptied the window. The wall clock only stamps what is kept
(the notification history); Alertmanager's `startsAt` is only compared with itself
(a later one: the alert re-fired, and waits again). None of this state
outlives the process: a restarted receiver hears a firing alert anew, waits its
`sustained_s` again, and has a fresh window (Alertmanager resends at repeat_interval).

A restart no agent took ("failed" in the audit: every agent refused or failed, none
had one in flight) did nothing: it frees its rate-limit slot and resend entry, and
the notification is answered 503, so that Alertmanager sends it again.
"""

from __future__ import annotations

import argparse
import base64
import binascii
import contextlib
import datetime
import json
import logging
import os
import re
import sys
import threading
import time
from collections.abc import Callable, Iterator
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

from prometheus_client import CONTENT_TYPE_LATEST, CollectorRegistry, generate_latest
from prometheus_client.registry import Collector

from clusterpulse.agent import protocol
from clusterpulse.agent.audit import AuditLog, file_head, head_families, open_private
from clusterpulse.agent.httpsafe import (
    HttpError,
    SafeHandler,
    SafeServer,
    content_length,
    listen_address,
    parse_json_object,
    read_body,
)
from clusterpulse.agent.logsetup import LEVELS, log_level, setup_logging
from clusterpulse.agent.tokens import TokenError, Tokens, credentials
from clusterpulse.agent.validate import is_number, read_toml, unknown_keys
from clusterpulse.dashboard import config
from clusterpulse.dashboard.actions import (
    ACTIONS,
    ActionError,
    NodeResult,
    OwnersUnknown,
    recent_rank_info,
    request_action,
)
from clusterpulse.dashboard.drain import NODE_ACTIONS, Drainer, DrainSettings
from clusterpulse.dashboard.promclient import PrometheusClient, PrometheusError

log = logging.getLogger("clusterpulse.dashboard.remediation")


class PolicyError(ValueError):
    pass


LABEL_NAME = re.compile(r"^[A-Za-z_][A-Za-z0-9_]*$")
EVICT_NODE = "evict-node"  # a graceful restart the alert's node sits out (see above)
# A policy action every node refused outright frees the run's slot and asks Alertmanager
# to resend at most this many times per run and window_s; then the slot is held.
MAX_REFUSED_ATTEMPTS = 3


@dataclass(frozen=True)
class EvictSettings:
    leave_s: float = 300.0

    @classmethod
    def from_toml(cls, raw: object, where: str) -> EvictSettings:
        if not isinstance(raw, dict):
            raise PolicyError(f"{where}: [evict] must be a table")
        unknown = unknown_keys(raw, ("leave_s",))
        if unknown:
            raise PolicyError(f"{where}: [evict] has {unknown}")
        leave = raw.get("leave_s", 300)
        if (not isinstance(leave, int | float) or isinstance(leave, bool)
                or not 1 <= leave <= protocol.MAX_LEAVE_S):
            raise PolicyError(f"{where}: [evict] leave_s must be a number of seconds in "
                              f"1..{protocol.MAX_LEAVE_S}")
        return cls(float(leave))


@dataclass(frozen=True)
class Rule:
    alert: str
    action: str
    sustained_s: float = 0.0
    # (label, anchored regex) pairs the alert's labels must all fit (a missing label
    # is the empty string, as in Alertmanager's matchers)
    match: tuple[tuple[str, re.Pattern[str]], ...] = ()

    def fits(self, labels: dict) -> bool:
        return labels.get("alertname") == self.alert and all(
            pattern.fullmatch(labels.get(name, "")) for name, pattern in self.match)


def _matchers(raw: object, where: str) -> tuple[tuple[str, re.Pattern[str]], ...]:
    if not isinstance(raw, dict):
        raise PolicyError(f"{where}: 'match' must be a table of label = regex, "
                          f"e.g. match = {{ cause = \"compute|data_loading\" }}")
    out = []
    for name, value in raw.items():
        if not LABEL_NAME.match(name):
            raise PolicyError(f"{where}: match: {name!r} is not a label name")
        if not isinstance(value, str):
            raise PolicyError(f"{where}: match.{name} must be a string (a regex)")
        try:
            out.append((name, re.compile(value)))
        except re.error as err:
            raise PolicyError(f"{where}: match.{name}: bad regular expression "
                              f"{value!r}: {err}") from None
    return tuple(out)


@dataclass
class Policy:
    rules: list[Rule]
    dry_run: bool = False
    max_actions_per_run: int = 1
    window_s: float = 900.0
    drain: DrainSettings = field(default_factory=DrainSettings)
    evict: EvictSettings = field(default_factory=EvictSettings)

    def rule_for(self, labels: dict) -> Rule | None:
        return next((r for r in self.rules if r.fits(labels)), None)

    @classmethod
    def load(cls, path: Path) -> Policy:
        """The policy in the TOML file at `path`. Every key and value is checked, and
        a bad one is a PolicyError naming it: a misspelt key or a zero window would
        otherwise load as a default and change what the policy does (act instead of
        dry-run, no rate limit) without a word."""
        where = f"policy {path}"
        raw = read_toml(path, "policy", PolicyError)
        unknown = unknown_keys(raw, POLICY_KEYS)
        if unknown:
            raise PolicyError(f"{where}: {unknown}")
        rules = raw.get("rule", [])
        if not isinstance(rules, list):
            raise PolicyError(f"{where}: 'rule' must be an array of tables ([[rule]])")
        dry_run = raw.get("dry_run", False)
        if not isinstance(dry_run, bool):
            raise PolicyError(f"{where}: dry_run must be true or false, not {dry_run!r}")
        most = raw.get("max_actions_per_run", 1)
        if not isinstance(most, int) or isinstance(most, bool) or most < 1:
            raise PolicyError(f"{where}: max_actions_per_run must be an integer >= 1, "
                              f"not {most!r}")
        window = raw.get("window_s", 900)
        if not is_number(window) or window <= 0:
            raise PolicyError(f"{where}: window_s must be a number of seconds > 0, "
                              f"not {window!r}")
        try:
            drain = DrainSettings.from_toml(raw.get("drain", {}), where)
        except ValueError as err:
            raise PolicyError(str(err)) from None
        return cls([_rule(r, f"{where}, rule #{i + 1}") for i, r in enumerate(rules)],
                   dry_run, most, float(window), drain,
                   EvictSettings.from_toml(raw.get("evict", {}), where))


POLICY_KEYS = ("dry_run", "max_actions_per_run", "window_s", "rule", "drain", "evict")
RULE_KEYS = ("alert", "action", "match", "sustained_s")


def _rule(raw: object, where: str) -> Rule:
    """One [[rule]] table, checked as Policy.load checks the file (`where` names it)."""
    if not isinstance(raw, dict):
        raise PolicyError(f"{where}: must be a table ([[rule]])")
    unknown = unknown_keys(raw, RULE_KEYS)
    if unknown:
        raise PolicyError(f"{where}: {unknown}")
    if not isinstance(raw.get("alert"), str) or not raw["alert"]:
        raise PolicyError(f"{where}: 'alert' (a name) is required")
    actions = (*ACTIONS, EVICT_NODE, *NODE_ACTIONS)
    if raw.get("action") not in actions:
        raise PolicyError(f"{where}: 'action' must be one of {', '.join(actions)}")
    sustained = raw.get("sustained_s", 0)
    if not is_number(sustained) or sustained < 0:
        raise PolicyError(f"{where}: sustained_s must be a number of seconds >= 0, "
                          f"not {sustained!r}")
    return Rule(raw["alert"], raw["action"], float(sustained),
                _matchers(raw.get("match", {}), where))


@dataclass
class Remediator:
    policy: Policy
    prom: PrometheusClient
    token: str | None
    audit: AuditLog
    history_path: Path | None = None
    # durations: monotonic, so that a step of the wall clock neither skips sustained_s
    # nor ends the rate-limit window early
    clock: Callable[[], float] = time.monotonic
    # the time stamped on what is kept (the notification history)
    wall_clock: Callable[[], float] = time.time
    _acted: dict[str, list[float]] = field(default_factory=dict)
    # (run, alert fingerprint, startsAt) -> when it was acted on: a resend within
    # window_s is not acted on again
    _done: dict[tuple[str, str, str], float] = field(default_factory=dict)
    # Alerts a rule wants sustained, one entry per alert (its labels) and subject
    # (("run", run) or ("node", node)): Alertmanager does not notify again for an
    # unchanged group until repeat_interval (hours), so the receiver re-checks them
    # itself (tick), and asks Prometheus whether each still fires before acting (a
    # resolved notification comes only at the next group_interval, minutes later).
    _waiting: dict[tuple, tuple[Rule, tuple[str, str], dict]] = field(default_factory=dict)
    # the same key -> when this receiver first heard it firing (monotonic: the clock
    # sustained_s runs on) and the startsAt it came with (a later one: it re-fired)
    # (bounded: entries go when the alert resolves or is acted on)
    _first_seen: dict[tuple, tuple[float, float | None]] = field(default_factory=dict)
    _refusals: list[float] = field(default_factory=list)
    # run -> when the policy's action on it was refused by every node (monotonic):
    # each freed the slot and asked for a resend, at most MAX_REFUSED_ATTEMPTS a window
    _refused: dict[str, list[float]] = field(default_factory=dict)
    _said_no_alerts_api: bool = False
    _lock: threading.RLock = field(default_factory=threading.RLock)

    def handle(self, payload: dict) -> list[dict]:
        """One Alertmanager notification -> the decisions taken (also audited).

        Raises PayloadError when the payload does not have Alertmanager's shape."""
        alerts, refused = split_payload(payload)
        if self.history_path is not None:
            self._keep(payload)
        decisions: list[dict] = [{"outcome": "refused", "detail": why} for why in refused]
        for why in refused:
            log.warning("alert refused: %s", why)
        retry = False
        for alert in alerts:
            try:
                retry |= self._handle_alert(alert, decisions)
            except Exception as err:  # one alert's bug never costs the others their turn
                log.exception("deciding on %s failed", alert.get("labels"))
                decisions.append({"alert": alert["labels"]["alertname"], "outcome": "failed",
                                  "detail": f"internal error: {type(err).__name__}"})
        if retry:
            raise RetryLater(decisions)
        return decisions

    def _keep(self, payload: dict) -> None:
        """The notification in the history file (created 0600: alerts name jobs and
        nodes); a history that cannot be written never stops a decision."""
        assert self.history_path is not None
        try:
            line = json.dumps({"received": self.wall_clock(), **payload}) + "\n"
        except (ValueError, RecursionError) as err:  # e.g. an annotation nested 979 deep
            # kept as a line that says so: its alerts are decided all the same
            log.error("alert history: a notification could not be written: %s",
                      type(err).__name__)
            line = json.dumps({"received": self.wall_clock(),
                               "unkept": f"notification not serialisable: {type(err).__name__}"}
                              ) + "\n"
        try:
            fd = open_private(self.history_path)
            try:
                os.write(fd, line.encode())
            finally:
                os.close(fd)
        except OSError as err:
            log.error("alert history %s: cannot write: %s", self.history_path,
                      err.strerror or err)

    def _handle_alert(self, alert: dict, decisions: list[dict]) -> bool:
        """Decide on one alert (decisions appended); True when Prometheus could not be
        asked and the notification must come again."""
        if alert.get("status") != "firing":
            ident = _identity(alert)
            with self._lock:  # over: a new firing is a new alert, whatever startsAt says
                self._done = {k: t for k, t in self._done.items()
                              if k[1] != _fingerprint(alert)}
                for key in [k for k in self._first_seen if k[1:] == ident]:
                    self._waiting.pop(key, None)
                    del self._first_seen[key]
            return False
        rule = self.policy.rule_for(alert.get("labels", {}))
        if rule is None:
            return False
        if rule.action in NODE_ACTIONS:  # acts on the node, not on a run (drain.py)
            d = self._decide_node(rule, alert)
            decisions.append(d)
            return d.pop("retry", False)
        try:
            runs = self._runs(alert["labels"])
        except PrometheusError as err:
            decisions.append(self._failed(rule, alert, "", "cannot find the runs the "
                                          f"alert is about: Prometheus: {err}"))
            return err.transient
        retry = False
        for run in runs:
            d = self._decide(rule, run, alert)
            retry |= d.pop("retry", False)
            decisions.append(d)
        return retry

    def _failed(self, rule: Rule, alert: dict, run: str, detail: str) -> dict:
        """An audited failure; the alert's labels name what it was about."""
        labels = alert.get("labels", {})
        self.audit.write("policy", rule.action, f"policy: {rule.alert} -> {rule.action}",
                         "failed", **({"run": run} if run else {}), source="remediation",
                         detail=detail, alert=labels)
        return {**({"run": run} if run else {"node": labels.get("node", "")}),
                "alert": rule.alert, "action": rule.action, "outcome": "failed",
                "detail": detail}

    def _decide_node(self, rule: Rule, alert: dict, recheck: bool = False) -> dict:
        node = alert.get("labels", {}).get("node", "")
        waiting = self._still_waiting(rule, ("node", node), alert, recheck)
        if waiting is not None:
            return {"node": node, "alert": rule.alert, "action": rule.action, **waiting}
        if not self.policy.dry_run:
            refused = self._unconfirmed(rule, alert, "", ("node", node), recheck)
            if refused is not None:
                return {"node": node, "alert": rule.alert, "action": rule.action, **refused}
            unheld, transient = self._gpu_not_held(alert)
            if unheld is not None:  # Prometheus could not answer: nothing done, ask again
                return {**self._failed(rule, alert, "", unheld), "retry": transient}
        return Drainer(self.policy.drain, self.audit, self.policy.dry_run).decide(alert)

    def _gpu_not_held(self, alert: dict) -> tuple[str | None, bool]:
        """For a node action on a rank's alert (TrainingStraggler, cause a GPU's): None
        where NVML lists the rank's process on the GPU the alert names, else why not.
        A rank names its GPU, and reports its straggler score, itself: a local user's
        process could report as a straggler on another user's GPU, idle or throttled,
        and have the Slurm policy drain the node and requeue every job on it (a
        review). A node's or a GPU's own alert (GpuDown) is NVML's evidence already.
        (why not, or None; and whether asking again may help: Prometheus failed).
        Ranks this cannot vouch for are refused too: a rank on UDP telemetry (no pid
        from the kernel) and one on a MIG instance (its `gpu` is its own visible index,
        not NVML's GPU)."""
        labels = alert.get("labels", {})
        if not (labels.get("run") and labels.get("rank")):
            return None, False
        gpu = labels.get("gpu", "")
        if not gpu:
            return "the rank's alert names no GPU: a node action needs the GPU's evidence", False
        sel = ",".join(f'{k}="{promql_string(labels.get(k, ""))}"'
                       for k in ("run", "rank", "node", "gpu"))
        try:
            held = self.prom.query(f"clusterpulse_trainer_rank_info{{{sel}}} "
                                   "and on (node, gpu, pid) clusterpulse_gpu_process_info")
        except PrometheusError as err:
            return (f"cannot ask Prometheus whether rank {labels['rank']} holds GPU {gpu}: "
                    f"{err}"), err.transient
        if not held:
            return (f"NVML lists no process of rank {labels['rank']} of run {labels['run']} on "
                    f"GPU {gpu} of {labels.get('node', '')}: that GPU is the rank's own claim"
                    ), False
        return None, False

    def _still_waiting(self, rule: Rule, subject: tuple[str, str], alert: dict,
                       recheck: bool = False) -> dict | None:
        """None once the alert has fired `sustained_s` (or the rule wants no wait);
        else the waiting (or resolved) decision, and a waiting alert is kept for `tick`
        to decide again. `recheck` (tick): the last notification may be minutes old,
        so Prometheus must still show the alert firing before the policy acts."""
        if not rule.sustained_s:
            return None
        key = (subject, *_identity(alert))
        now = self.clock()
        stated = _parse_time(alert.get("startsAt", ""))
        with self._lock:
            if len(self._first_seen) >= MAX_TRACKED and key not in self._first_seen:
                self._first_seen.pop(next(iter(self._first_seen)))
            started, first_stated = self._first_seen.setdefault(key, (now, stated))
            # Alertmanager's startsAt may only make the alert younger than our own
            # sighting, never older: a missing or backdated one cannot skip sustained_s.
            # A startsAt later than the one first heard says it re-fired since (its
            # resolved notification missed): the wait starts again, from now. Its wall
            # time is never subtracted from ours: a clock step would shorten the wait.
            if stated is not None and first_stated is not None and stated > first_stated:
                started, _ = self._first_seen[key] = (now, stated)
            if now - started < rule.sustained_s:
                self._waiting[key] = (rule, subject, alert)
                return {"outcome": "waiting", "detail": f"firing {now - started:.0f} s of "
                        f"the {rule.sustained_s:.0f} s the policy requires"}
        if recheck:
            firing = self._firing_now(alert)
            if firing is None:  # Prometheus cannot say: never act blind, ask again later
                with self._lock:
                    self._waiting[key] = (rule, subject, alert)
                return {"outcome": "waiting", "detail": "sustained, but Prometheus cannot "
                        "confirm it still fires"}
            if not firing:
                with self._lock:
                    self._waiting.pop(key, None)
                    self._first_seen.pop(key, None)
                return {"outcome": "resolved", "detail": "no longer firing in Prometheus"}
        with self._lock:  # claim it: a notification and the ticker may both get here
            self._waiting.pop(key, None)
            if self._first_seen.pop(key, None) is None:
                return {"outcome": "decided", "detail": "decided already"}
        return None

    def _unconfirmed(self, rule: Rule, alert: dict, run: str, subject: tuple[str, str],
                     recheck: bool = False) -> dict | None:
        """None when Prometheus has this alert firing, so the policy may act; else the
        decision, audited. A notification is only a claim: anyone who can reach an
        Alertmanager's API can post one (a forged RankHung killed a victim's ranks 2 s
        later), so every automatic action first asks Prometheus, and does nothing
        when Prometheus cannot answer (the notification comes again: retry).

        Firing is not enough where `keep_firing_for` holds the alert after its condition
        ended: JobNodeUnreachable held 10 s after a cut healed, the job had already gone
        on with a spare, and the policy's restart took the returned node back in (the
        hot-spare test on a clean machine). Such an alert waits (`tick` asks again): it
        is acted on if its condition holds again, dropped when it resolves."""
        key = (subject, *_identity(alert))
        firing = self._firing_now(alert, rule)
        if firing:
            unheld = self._why_not_now(alert, rule)
            with self._lock:
                if unheld is None:  # claimed: a waiting copy of it is decided now, once
                    self._waiting.pop(key, None)
                    claimed = self._first_seen.pop(key, None) is not None
                    if recheck and not rule.sustained_s and not claimed:
                        return {"outcome": "decided", "detail": "decided already"}
                    return None
                self._keep_waiting(key, rule, subject, alert)
            return {"outcome": "waiting", "detail": unheld}
        if firing is None:
            if recheck:  # waiting already: asked again at the next tick, not audited each
                with self._lock:
                    self._keep_waiting(key, rule, subject, alert)
                return {"outcome": "waiting", "detail": "Prometheus cannot confirm the "
                        "alert fires: asking again"}
            return {**self._failed(rule, alert, run, "Prometheus cannot confirm the alert "
                                   "fires: not acting blind"), "retry": True}
        if recheck:  # one this policy kept waiting (held, above) has ended
            with self._lock:
                self._waiting.pop(key, None)
                self._first_seen.pop(key, None)
            return {"outcome": "resolved", "detail": "no longer firing in Prometheus"}
        detail = ("Prometheus has no such alert firing (ALERTS): a forged or stale "
                  "notification")
        self.audit.write("policy", rule.action, f"policy: {rule.alert} -> {rule.action}",
                         "refused", **({"run": run} if run else {}), source="remediation",
                         detail=detail, alert=alert.get("labels", {}))
        return {"outcome": "refused", "detail": detail}

    def _keep_waiting(self, key: tuple, rule: Rule, subject: tuple[str, str],
                      alert: dict) -> None:
        """Keep an alert past its sustained_s (if any) for `tick` to decide again: it
        stays sustained. Called under the lock."""
        self._first_seen.setdefault(key, (self.clock() - rule.sustained_s,
                                          _parse_time(alert.get("startsAt", ""))))
        self._waiting[key] = (rule, subject, alert)

    def _subject(self, alert: dict, rule: Rule | None) -> dict[str, str]:
        """The labels Prometheus's copy of the alert must have: those that name what it
        is about and those the rule matched it on; not severity unless the rule chose by
        it (alert relabelling may rewrite it on the way to Alertmanager)."""
        labels = alert.get("labels", {})
        matched = {name for name, _ in rule.match} if rule else set()
        keys = dict.fromkeys(("alertname", *SUBJECT_LABELS, *sorted(matched)))
        return {k: str(labels[k]) for k in keys
                if k in labels and (k != "severity" or k in matched)}

    def _firing_now(self, alert: dict, rule: Rule | None = None) -> bool | None:
        """Whether Prometheus has this alert firing now (its ALERTS series, on
        `_subject`'s labels); None when Prometheus cannot be asked."""
        sel = ",".join(f'{k}="{promql_string(v)}"' for k, v in self._subject(alert, rule).items())
        try:
            return bool(self.prom.query(f'ALERTS{{alertstate="firing",{sel}}}'))
        except PrometheusError as err:
            log.warning("cannot check that %s still fires: %s", alert.get("labels", {}), err)
            return None

    def _why_not_now(self, alert: dict, rule: Rule | None) -> str | None:
        """None when the condition of a firing copy of this alert holds now (Prometheus's
        alerts API: no `keepFiringSince`); else why the policy waits: every copy is held
        after its condition ended, or none is firing there (it ended between the two
        questions, or an HA replica answered), or the API failed for now. Where there is
        no such API (a store without a rule evaluator, e.g. VictoriaMetrics' vmselect)
        ALERTS alone decides, said once."""
        want = self._subject(alert, rule)
        try:
            active = self.prom.alerts()
        except PrometheusError as err:
            if err.transient:
                return f"Prometheus's alerts API failed ({err}): asking again"
            if not self._said_no_alerts_api:
                self._said_no_alerts_api = True
                log.warning("cannot tell an alert held by keep_firing_for from one whose "
                            "condition holds (acting on ALERTS alone): %s", err)
            return None
        held: list[float] = []
        for a in active:
            labels = a.get("labels") if isinstance(a.get("labels"), dict) else {}
            if a.get("state") != "firing" or any(labels.get(k) != v for k, v in want.items()):
                continue
            since = _parse_time(a.get("keepFiringSince"))
            if since is None:
                return None
            held.append(since)
        if not held:
            return "Prometheus's alerts API has no firing copy of it: asking again"
        return (f"its condition ended {max(0.0, time.time() - min(held)):.0f} s ago and "
                "Prometheus holds it firing (keep_firing_for): acting only if it holds again")

    def _runs(self, labels: dict) -> list[str]:
        """The runs an alert is about: its own `run` label, or the live runs with ranks
        on its node (and GPU). Raises PrometheusError when Prometheus cannot say."""
        if "run" in labels:
            return [labels["run"]]
        if "node" not in labels:
            return []
        sel = f'node="{promql_string(labels["node"])}"' + (
            f',gpu="{promql_string(labels["gpu"])}"' if "gpu" in labels else "")
        # Runs with a rank here and a live rank anywhere. An agent keeps an ended rank for
        # its grace period (evidence): restarting a run whose ranks have all ended only
        # audits a failure (the chaos run restarted its stopped baseline job). The rank
        # on the lost GPU itself may have died with it (a CUDA error) while its peers
        # wait: that run is the one to restart.
        live = ("clusterpulse_trainer_rank_info unless on (run, rank, node, local_rank) "
                "(clusterpulse_trainer_process_alive == 0)")
        # Ranks here within actions.NODE_LOOKBACK: the fault an alert names a node for (a slow
        # link) can make its scrapes time out, and Prometheus marks its series stale.
        query = f"max by (run) ({recent_rank_info(sel)}) and on (run) max by (run) ({live})"
        return sorted({s.labels["run"] for s in self.prom.query(query)})  # PrometheusError

    def _decide(self, rule: Rule, run: str, alert: dict, recheck: bool = False) -> dict:
        why = f"policy: {rule.alert} -> {rule.action}"
        base = {"run": run, "alert": rule.alert, "action": rule.action}
        waiting = self._still_waiting(rule, ("run", run), alert, recheck)
        if waiting is not None:
            return {**base, **waiting}
        if not self.policy.dry_run:
            refused = self._unconfirmed(rule, alert, run, ("run", run), recheck)
            if refused is not None:
                return {**base, **refused}
        now = self.clock()
        # the same alert in a resent notification (Alertmanager retries after a 503, or
        # two Alertmanagers of an HA pair both send): carried out once
        resend = (run, _fingerprint(alert), alert.get("startsAt", ""))
        with self._lock:
            self._done = {k: t for k, t in self._done.items() if now - t < self.policy.window_s}
            if resend[2] and resend in self._done:
                return {**base, "outcome": "decided", "detail": "decided already"}
            recent = [t for t in self._acted.get(run, []) if now - t < self.policy.window_s]
            if len(recent) >= self.policy.max_actions_per_run:
                outcome = "rate_limited"
            else:
                outcome = "dry_run" if self.policy.dry_run else "act"
                if not self.policy.dry_run:
                    recent.append(now)
                    self._done[resend] = now  # claimed with the slot, under one lock
            self._acted[run] = recent
        if outcome != "act":
            self.audit.write("policy", rule.action, why, outcome, run=run, source="remediation",
                             alert=alert.get("labels", {}))
            return {**base, "outcome": outcome}
        try:
            labels = alert.get("labels", {})
            if rule.action == EVICT_NODE:
                node = labels.get("node")
                if not node:
                    raise ActionError("the alert names no node to evict")
                results = request_action(self.prom, run, "checkpoint-restart", why, "policy",
                                         self.token, self.audit, source="remediation",
                                         nodes=[node], leave_s=self.policy.evict.leave_s,
                                         audited_as=EVICT_NODE, alert=labels,
                                         one_owner=True)
            else:
                results = request_action(self.prom, run, rule.action, why, "policy",
                                         self.token, self.audit, source="remediation",
                                         alert=labels, one_owner=True)
            if not any(r.ok for r in results) and any(r.in_flight is not None for r in results):
                # someone's restart is under way (on one node is enough: a node that
                # refused or did not answer beside it made this a "failure" that freed
                # the resend entry, and the resend after that restart ended restarted
                # the run again): not taken twice. Nothing was done: the run's slot is
                # free again (with the default one action per 15 min, an operator's
                # restart in flight cost the policy its only slot, and a hang after
                # that restart waited out the window); the resend entry stays
                with self._lock, contextlib.suppress(ValueError):
                    self._acted.get(run, []).remove(now)
                return {**base, "outcome": "in_flight",
                        "detail": "; ".join(f"{r.node}: {r.error}" for r in results),
                        "nodes": {r.node: r.error for r in results}}
            nodes = {r.node: r.command or r.error for r in results}
            if not any(r.ok or r.unanswered for r in results):  # audited "failed"
                return self._refused_by_all(rule, run, alert, now, results, base, nodes)
            # a node that did not answer may have taken it (audited "unconfirmed"):
            # the slot stays the run's, and no resend asks again
            return {**base, "outcome": "acted" if all(r.ok for r in results) else "partial",
                    "nodes": nodes,
                    **({"detail": "no answer from " + ", ".join(
                        r.node for r in results if r.unanswered) + ": it may have been "
                        "taken there"} if any(r.unanswered for r in results) else {})}
        except OwnersUnknown as err:  # nothing was asked of any agent: try again
            self._release(rule, run, alert, now)
            return {**self._failed(rule, alert, run, str(err)), "retry": True}
        except ActionError as err:
            return self._failed(rule, alert, run, str(err))
        except PrometheusError as err:  # nothing was asked of any agent: try again
            self._release(rule, run, alert, now)
            return {**self._failed(rule, alert, run, f"Prometheus: {err}"),
                    "retry": err.transient}

    def _refused_by_all(self, rule: Rule, run: str, alert: dict, claimed: float,
                        results: list[NodeResult], base: dict, nodes: dict) -> dict:
        """Every node refused the policy's action outright: nothing was done.

        The slot and the resend entry are freed and the notification asked for again
        (503): the run's one action per window went to a restart no agent took, and the
        hang after it waited out the window (not the ticker, which would ask agents
        that refuse every 5 s). A refusal that never clears (no ranks of the run known
        on the node, a rank no process vouches for) made that a resend every
        notification for as long as the alert fired: after MAX_REFUSED_ATTEMPTS in
        the window the slot is held and no resend is asked for."""
        why = "no agent took the action: " + "; ".join(f"{r.node}: {r.error}"
                                                       for r in results)
        with self._lock:  # runs refused no more within the window are forgotten
            self._refused = {r: kept for r, ts in self._refused.items()
                             if (kept := [t for t in ts if claimed - t < self.policy.window_s])}
            spent = [*self._refused.get(run, []), claimed]
            self._refused[run] = spent
        if len(spent) > MAX_REFUSED_ATTEMPTS:
            return {**base, "outcome": "failed", "nodes": nodes,
                    "detail": f"{why}; {MAX_REFUSED_ATTEMPTS} attempts in "
                              f"{self.policy.window_s:.0f} s refused: attempts spent, the "
                              "run's slot is held and no resend is asked for"}
        self._release(rule, run, alert, claimed, tick=False)
        return {**base, "outcome": "failed", "retry": True, "nodes": nodes, "detail": why}

    def _release(self, rule: Rule, run: str, alert: dict, claimed: float,
                 tick: bool = True) -> None:
        """Undo a decision that was not carried out (for want of Prometheus, or no agent
        took it): the run's rate-limit slot is free again, and a sustained alert stays
        sustained (Alertmanager's retry, and with `tick` the ticker, decide again, not
        after another sustained_s)."""
        with self._lock:
            self._done.pop((run, _fingerprint(alert), alert.get("startsAt", "")), None)
            with contextlib.suppress(ValueError):
                self._acted.get(run, []).remove(claimed)
            if rule.sustained_s:
                key = (("run", run), *_identity(alert))
                self._first_seen.setdefault(key, (claimed - rule.sustained_s,
                                                  _parse_time(alert.get("startsAt", ""))))
                if tick:
                    self._waiting[key] = (rule, ("run", run), alert)


    def audit_refused(self, client: str) -> None:
        """Log a notification refused for missing/wrong credentials (at most 30 a minute,
        so a flood cannot fill the disk)."""
        now = self.clock()
        with self._lock:
            self._refusals = [t for t in self._refusals if now - t < 60]
            if len(self._refusals) >= 30:
                return
            self._refusals.append(now)
        self.audit.write("unauthenticated", "webhook", "missing or wrong credentials",
                         "refused", client=client, source="remediation")

    def tick(self) -> list[dict]:
        """Decide again on alerts still firing that were waiting to be sustained, or
        held by keep_firing_for (`_unconfirmed`)."""
        with self._lock:
            waiting = list(self._waiting.values())
        return [self._decide(rule, subject, alert, recheck=True) if kind == "run"
                else self._decide_node(rule, alert, recheck=True)
                for rule, (kind, subject), alert in waiting]


# The labels that say what an alert is about (Prometheus's ALERTS series has them;
# Alertmanager may add external labels that it does not).
# severity too: TrainingLinkCongested fires as a warning and, on the same labels, as a
# critical (the run's pace halved), and each keeps its own sustained_s clock.
SUBJECT_LABELS = ("run", "rank", "node", "gpu", "local_rank", "cause", "device", "port",
                  "severity")


def _fingerprint(alert: dict) -> str:
    """Alertmanager's fingerprint of the alert's labels, or those labels themselves."""
    return str(alert.get("fingerprint") or _identity(alert))


def _identity(alert: dict) -> tuple[str, tuple[tuple[str, str], ...]]:
    labels = alert.get("labels", {})
    return (str(labels.get("alertname", "")),
            tuple(sorted((k, str(v)) for k, v in labels.items() if k in SUBJECT_LABELS)))


def _parse_time(text: object) -> float | None:
    if not isinstance(text, str):
        return None
    try:
        t = datetime.datetime.fromisoformat(text.replace("Z", "+00:00"))
    except ValueError:
        return None
    if t.tzinfo is None:  # a time without a zone means nothing here
        return None
    return t.timestamp()


MAX_BODY = 1 << 20
MAX_ALERTS = 1000
MAX_LABELS = 64
MAX_LABEL_VALUE = 1024
MAX_TRACKED = 10000


class PayloadError(ValueError):
    """A notification that is not Alertmanager's webhook shape; the text says where."""


class RetryLater(Exception):
    """A notification the policy could not decide on for want of Prometheus (or of an
    agent that could say who runs the job): answered
    503, so that Alertmanager sends it again (a 200 would have been the end of it until
    repeat_interval, hours later). Carries the decisions taken, for the reply."""

    def __init__(self, decisions: list[dict]) -> None:
        super().__init__("Prometheus or an agent could not be asked; send it again")
        self.decisions = decisions


def split_payload(payload: object) -> tuple[list[dict], list[str]]:
    """(the alerts fit to decide on, why each other one was refused). A notification
    that is not Alertmanager's shape at all raises PayloadError; one bad alert in it
    costs only itself (a label with a lone surrogate killed the whole request)."""
    if not isinstance(payload, dict):
        raise PayloadError("payload must be a JSON object")
    alerts = payload.get("alerts", [])
    if not isinstance(alerts, list):
        raise PayloadError("'alerts' must be a list")
    if len(alerts) > MAX_ALERTS:
        raise PayloadError(f"more than {MAX_ALERTS} alerts in one notification")
    good, refused = [], []
    for i, alert in enumerate(alerts):
        try:
            validate_alert(alert, f"alerts[{i}]")
        except PayloadError as err:
            refused.append(str(err))
        else:
            good.append(alert)
    return good, refused


def validate_payload(payload: object) -> None:
    """Alertmanager's webhook schema, as far as the policy reads it, with bounds;
    raises PayloadError naming the first problem, in any alert."""
    _, refused = split_payload(payload)
    if refused:
        raise PayloadError(refused[0])


def _text(value: str) -> bool:
    """Encodable as UTF-8: JSON's \\ud800 escapes decode to lone surrogates, which every
    encoder after this (PromQL query, log, reply) would refuse."""
    try:
        value.encode()
    except UnicodeEncodeError:
        return False
    return True


MAX_ALERT_DEPTH = 8  # Alertmanager's alerts are 2 deep (alert -> labels -> value)


def _deeper_than(value: object, limit: int) -> bool:
    """Whether JSON `value` nests deeper than `limit`, found without recursion (an
    annotation nested 979 deep broke json.dumps of the whole notification: 500)."""
    stack = [(value, 1)]
    while stack:
        item, depth = stack.pop()
        if isinstance(item, dict | list):
            if depth > limit:
                return True
            stack.extend((v, depth + 1) for v in (item.values() if isinstance(item, dict)
                                                  else item))
    return False


def validate_alert(alert: object, where: str) -> None:
    """One alert of a notification; PayloadError naming the field."""
    if not isinstance(alert, dict):
        raise PayloadError(f"{where} must be an object")
    if _deeper_than(alert, MAX_ALERT_DEPTH):
        raise PayloadError(f"{where} nests deeper than {MAX_ALERT_DEPTH} levels "
                           "(Alertmanager's alerts are 2 deep)")
    if alert.get("status") not in ("firing", "resolved"):
        raise PayloadError(f"{where}.status must be 'firing' or 'resolved'")
    labels = alert.get("labels")
    if not isinstance(labels, dict) or not isinstance(labels.get("alertname"), str):
        raise PayloadError(f"{where}.labels must be an object with an 'alertname'")
    if len(labels) > MAX_LABELS:
        raise PayloadError(f"{where}.labels has more than {MAX_LABELS} labels")
    for k, v in labels.items():
        name = k[:64].encode("ascii", "backslashreplace").decode()  # printable, whatever k
        if not isinstance(v, str) or len(v) > MAX_LABEL_VALUE or len(k) > 128:
            raise PayloadError(f"{where}.labels.{name} must be a string of at most "
                               f"{MAX_LABEL_VALUE} characters")
        if not (_text(k) and _text(v)):
            raise PayloadError(f"{where}.labels.{name} is not valid Unicode "
                               "(a lone surrogate)")
    if "startsAt" in alert and not (isinstance(alert["startsAt"], str)
                                    and _text(alert["startsAt"])):
        raise PayloadError(f"{where}.startsAt must be an RFC 3339 time string")


def promql_string(value: str) -> str:
    """A label value safe inside a double-quoted PromQL string literal."""
    return (value.replace("\\", "\\\\").replace('"', '\\"').replace("\n", "\\n")
            .replace("\r", "\\r"))


def check_webhook_auth(header: str | None, tokens: Tokens) -> str | None:
    """The principal behind a Bearer token or basic auth (password = token), or None."""
    bearer, value = credentials(header, "Bearer"), credentials(header, "Basic")
    if bearer is not None:
        return tokens.match(bearer)
    if value is not None:  # the scheme is case-insensitive (RFC 7235)
        try:
            user, sep, password = base64.b64decode(value, validate=True).decode().partition(":")
        except (binascii.Error, UnicodeDecodeError):
            return None
        principal = tokens.match(password) if sep else None
        # a named token must be presented under its name; a bare one under any name
        return principal if principal in (user, "token") else None
    return None


class CentralAuditHead(Collector):
    """The head of the audit log this receiver shares with the dashboard and
    `clusterpulse-ctl`, the one that records automatic restarts: Prometheus keeps its
    history outside the file, so records cut from its end page (AuditLogRewound)."""

    def __init__(self, audit: AuditLog) -> None:
        self.audit = audit

    def collect(self) -> Iterator[Any]:
        head = file_head(self.audit.path) if self.audit.path is not None else None
        if head is not None:
            yield from head_families(head, {"log": "central"})


def serve(remediator: Remediator, host: str, port: int, tokens: Tokens,
          tls: object | None = None) -> SafeServer:
    class Handler(SafeHandler):
        server_version = "clusterpulse-remediate"

        def do_POST(self) -> None:
            try:
                length = content_length(self.headers, MAX_BODY)
                principal = check_webhook_auth(self.headers.get("Authorization"), tokens)
                if principal is None:  # before reading a byte of the body
                    remediator.audit_refused(self.client_address[0])
                    self.close_connection = True
                    self.send_json(401, {"error": "webhook needs a bearer token or basic auth "
                                                  "(Alertmanager: http_config)"},
                                   {"WWW-Authenticate": 'Bearer realm="clusterpulse", '
                                                        'Basic realm="clusterpulse"'})
                    return
                payload = parse_json_object(read_body(self, length), empty_ok=False)
                decisions = remediator.handle(payload)
            except HttpError as err:
                self.refuse(err)
                return
            except PayloadError as err:
                self.send_json(400, {"error": f"not an Alertmanager notification: {err}"})
                return
            except RetryLater as err:
                self.send_json(503, {"error": str(err), "decisions": err.decisions})
                return
            except TimeoutError:
                self.refuse(HttpError(408, "timed out reading the request body"))
                return
            except Exception as err:  # answered, whatever went wrong: never a dead socket
                log.exception("notification from %s failed", self.client_address[0])
                self.send_json(500, {"error": f"internal error: {type(err).__name__}"})
                return
            self.send_json(200, {"decisions": decisions})

        def do_GET(self) -> None:
            # The pod's liveness and readiness probes: no token, nothing secret.
            path = self.path.split("?", 1)[0]
            if path == "/healthz":
                self.send_json(200, {"status": "ok", "rules": len(remediator.policy.rules),
                                     "dry_run": remediator.policy.dry_run})
                return
            if path == "/metrics":  # the central audit log's head, kept by Prometheus
                self.send_bytes(200, generate_latest(registry), CONTENT_TYPE_LATEST)
                return
            self.send_json(405, {"error": "POST Alertmanager notifications here"})

    registry = CollectorRegistry(auto_describe=False)
    registry.register(CentralAuditHead(remediator.audit))

    server = SafeServer((host, port), Handler, tls=tls)  # type: ignore[arg-type]
    threading.Thread(target=server.serve_forever, daemon=True).start()

    def ticker() -> None:
        while True:
            time.sleep(5)
            try:
                remediator.tick()
            except Exception:  # never let the timer die: log and go on
                log.exception("remediation tick failed")

    threading.Thread(target=ticker, name="remediation-tick", daemon=True).start()
    return server


EXAMPLES = """\
examples:
  clusterpulse-remediate --policy deploy/local/policy.toml --listen 127.0.0.1:19495 \\
      --prometheus http://127.0.0.1:9090 --token-file /etc/clusterpulse/token \\
      --webhook-token-file /etc/clusterpulse/webhook-token
  clusterpulse-remediate --policy policy.toml --webhook-token-file hook-token --dry-run
  clusterpulse-remediate --policy policy.toml --webhook-token-file hook-token \\
      --prometheus http://victoria-metrics:8428 \\
      --prometheus-password-file /etc/clusterpulse/victoria-metrics-password
"""


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(prog="clusterpulse-remediate", description=__doc__,
                                epilog=EXAMPLES,
                                formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--policy", type=Path, required=True, help="policy TOML file")
    p.add_argument("--listen", default="127.0.0.1:19495", help="webhook address")
    p.add_argument("--prometheus", default="http://127.0.0.1:9090")
    config.add_store_auth(p)
    p.add_argument("--token-file", type=Path, help="agents' control API token")
    p.add_argument("--webhook-token-file", type=Path, required=True,
                   help="tokens Alertmanager must present (bearer, or basic auth with the "
                   "token as password); one per line, optionally 'NAME TOKEN'")
    p.add_argument("--audit-log", type=Path, default=Path("clusterpulse-audit.jsonl"))
    p.add_argument("--history", type=Path, help="keep received notifications here (JSONL)")
    p.add_argument("--dry-run", action="store_true", help="override the policy: never act")
    p.add_argument("--log-level", default="warning", type=log_level,
                   help=f"one of {', '.join(LEVELS)} (default: warning)")
    a = p.parse_args(argv)
    setup_logging(a.log_level)
    try:
        policy = Policy.load(a.policy)
        # empty: refused now, as the agent and the webhook tokens are ("holds no token"),
        # not at the first alert the policy acts on
        token = config.read_required_secret(a.token_file, "--token-file") \
            if a.token_file else None
        prom_auth = config.store_auth(a)
        hook_tokens, _ = Tokens.load(a.webhook_token_file)
    except (PolicyError, OSError, TokenError, config.SettingsError) as err:
        print(f"clusterpulse-remediate: error: {err}", file=sys.stderr)
        return 2
    if a.dry_run:
        policy.dry_run = True
    rem = Remediator(policy, PrometheusClient(a.prometheus, auth=prom_auth), token,
                     AuditLog(a.audit_log), a.history)
    try:
        host, port = listen_address(a.listen)
        serve(rem, host, port, hook_tokens)
    except (ValueError, OSError) as err:
        print(f"clusterpulse-remediate: error: cannot listen on {a.listen}: "
              f"{getattr(err, 'strerror', None) or err}", file=sys.stderr)
        return 2
    print(f"clusterpulse-remediate: listening on http://{a.listen}/alertmanager "
          f"({len(policy.rules)} rules, dry_run={policy.dry_run})", flush=True)
    threading.Event().wait()
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
