"""The dashboard's own PromQL (dashboard/data.py), evaluated by promtool on the series
the agents and Prometheus's scrapes leave."""

from __future__ import annotations

import pytest
import yaml

from clusterpulse.dashboard.data import AGENT_NODE, NODES_UP
from clusterpulse.incident import RESUME_SERIES, resume_query
from tests.support.promtool import exprs_pass

A, B, C, D = (f"10.0.0.{n}:9477" for n in (7, 8, 9, 10))


def _up(instance: str, values: str, **labels: str) -> dict:
    extra = "".join(f',{k}="{v}"' for k, v in labels.items())
    return {"series": f'up{{job="clusterpulse",instance="{instance}"{extra}}}', "values": values}


def _info(instance: str, node: str, values: str) -> dict:
    return {"series": f'clusterpulse_agent_build_info{{job="clusterpulse",instance='
                      f'"{instance}",node="{node}",version="1"}}', "values": values}


def _nodes_up(tmp_path, series: list[dict], at: str, expect: dict[tuple[str, str], int],
              interval: str = "1m") -> None:
    exprs_pass(tmp_path, interval, series, [{"expr": NODES_UP, "eval_time": at, "exp_samples": [
        {"labels": f'{{node="{n}",instance="{i}"}}', "value": v}
        for (n, i), v in expect.items()]}])


@pytest.mark.parametrize("at", ["90m", "50h"])
def test_a_node_down_for_hours_or_never_seen_stays_on_the_cluster_page(tmp_path, at):
    """Found in review: NODES_UP named a target's node from the last hour of build info
    while NodeAgentDown looks back 30 days: a node down for more than an hour left the
    page ("Nodes up 1 / 1" while it paged), and so did one whose agent never answered.
    Such a target is named by its `target_node` label, else its address."""
    _nodes_up(tmp_path, [
        _up(A, "1x10 0x3000"), _info(A, "gpu-007", "1x10"),
        _up(B, "1x3010"), _info(B, "gpu-008", "1x3010"),
        _up(C, "0x3010", target_node="gpu-009"), _up(D, "0x3010")],
        at, {("gpu-007", A): 0, ("gpu-008", B): 1, ("gpu-009", C): 0, (D, D): 0})


def test_an_address_that_reported_two_node_names_is_one_node_the_newest(tmp_path):
    """Found in review: an agent restarted at the same address with another --node left
    two names in the last hour; the join was many-to-many, Prometheus answered 422 and
    the Cluster page read "Prometheus is unavailable" for an hour."""
    _nodes_up(tmp_path, [
        _up(A, "1x20"), _info(A, "gpu-007", "1x5"), _info(A, "gpu-007b", "_x5 1x14"),
        _up(B, "1x20"), _info(B, "gpu-008", "1x20")],
        "12m", {("gpu-007b", A): 1, ("gpu-008", B): 1})


def test_a_renamed_agent_then_down_is_named_by_its_newest_name(tmp_path):
    """The same choice NodeAgentDown makes: the address's newest node name, also
    once its agent is down (its last name seen within the hour before, not the other)."""
    _nodes_up(tmp_path, [
        _info(A, "a-old", "1x10"), _info(A, "b-new", "_x20 1x40"),
        _up(A, "1x10 _x10 1x40 0x20")],
        "70m", {("b-new", A): 0})


def test_the_resume_record_is_one_processs_the_newest(tmp_path):
    """Found in review: rank 0 moved to n2 at a restart, and n1's agent kept the old
    process's series for its grace; each value was the max over both processes, and the
    Run page read "resumed from step 1200, 37 steps recomputed" (the new process's step,
    the old one's 37) after a graceful restart that redid none."""
    old = 'run="r1",rank="0",node="n1",local_rank="0"'
    new = 'run="r1",rank="0",node="n2",local_rank="0"'
    values = {"step": (1000, 1200), "recomputed": (37, 0), "at": (1000, 1100)}
    series = [s for k, (was, now) in values.items() for s in (
        {"series": f"{RESUME_SERIES[k]}{{{old}}}", "values": f"{was}x36"},
        {"series": f"{RESUME_SERIES[k]}{{{new}}}", "values": f"_x20 {now}x16"})]
    exprs_pass(tmp_path, "5s", series, [
        {"expr": resume_query(k, "r1"), "eval_time": t, "exp_samples": [
            {"labels": "{}", "value": values[k][i]}]}
        for k in values for t, i in (("50s", 0), ("150s", 1))])


class _OneAlert:
    """A store holding one alert that fired each second over [first, last], answering
    query_range as Prometheus does: a plain ALERTS point only where the alert fires at
    that instant (its series is marked stale once it resolves), incident.alert_queries'
    forms with the last (first) firing sample in the step before each point."""

    LABELS = {"alertname": "GpuDown", "alertstate": "firing", "severity": "critical",
              "node": "n1", "gpu": "0"}

    def __init__(self, first: float, last: float) -> None:
        self.first, self.last = first, last

    def query_range(self, expr: str, start: float, end: float, step: float) -> list:
        from clusterpulse.dashboard.promclient import Series
        from clusterpulse.incident import alert_queries

        times = [start + i * step for i in range(int((end - start) // step) + 1)]
        fired = [float(s) for s in range(int(self.first), int(self.last) + 1)]
        _, last_q, first_q = alert_queries(step)
        if expr == 'ALERTS{alertstate="firing"}':
            points = [(t, 1.0) for t in times if self.first <= t <= self.last]
        elif expr in (last_q, first_q):
            pick = max if expr == last_q else min
            points = [(t, pick(w)) for t in times if (w := [s for s in fired if t - step < s <= t])]
        else:
            raise AssertionError(f"unexpected query {expr}")
        return [Series(dict(self.LABELS), points)] if points else []


def test_the_alert_history_holds_an_alert_shorter_than_its_step():
    """Found in review: at the 24 h range (a 432 s step) the Alerts page's History read
    plain ALERTS points and left out a GpuDown that fired for a minute between two."""
    import pandas as pd

    from clusterpulse.dashboard.data import alert_history

    end = 100_000.0
    hist = alert_history(_OneAlert(99_000, 99_060), end - 86_400, end)
    assert list(hist["alert"]) == ["GpuDown"], hist
    assert (hist["first seen"][0], hist["last seen"][0]) == (
        pd.Timestamp(99_000, unit="s"), pd.Timestamp(99_060, unit="s"))


def test_the_page_names_nodes_as_the_rules_do():
    """NodeAgentDown names a down node by clusterpulse:agent_node; the Cluster page by
    its own copy of that expression (it need not wait for the record): the same, or a
    node the page lists is one the alert names otherwise."""
    from tests.support.procs import REPO

    rules = yaml.safe_load((REPO / "deploy/prometheus/clusterpulse.rules.yml").read_text())
    (expr,) = [r["expr"] for g in rules["groups"] for r in g["rules"]
               if r.get("record") == "clusterpulse:agent_node"]
    def squeeze(text: str) -> str:
        return "".join(text.split())
    # the record also carries its own last hour forward (a name seen only between two
    # whole minutes); the page reads the raw windows alone
    carried = " or (max_over_time(clusterpulse:agent_node[1h]) > time() - 2592000)"
    assert squeeze(expr) == squeeze(AGENT_NODE[:-2] + carried + "))")


def test_a_node_down_within_a_minute_of_its_start_is_named(tmp_path):
    """Seen at no whole minute (its address's names were read every minute over the
    hour), a node cut off 30 s after its agent first answered was named by no one: the
    testbed's partitioned node paged NodeAgentDown without a node. The last 10 minutes
    are read every 5 s."""
    _nodes_up(tmp_path, [_up(A, "0 0 1 1 1 1 1 1 0 0 0 0 0 0 0 0 0 0 0 0 0 0 0"),
                         _info(A, "gpu-late", "_ _ 1 1 1 1 1 1 stale")],
              "100s", {("gpu-late", A): 0}, interval="5s")


def test_a_node_first_seen_since_the_last_whole_5_seconds_is_named(tmp_path):
    """Seen in CI (tests/integration/test_sharded_scrape.py): the Cluster page, read within
    5 s of a new agent's first scrape, listed that node by its address. Every window read
    its names at whole 5 s (or coarser) points, all before the one sample there was. The
    newest sample is read as it is."""
    _nodes_up(tmp_path, [_up(A, "_ 1"), _info(A, "gpu-new", "_ 1")],
              "4s", {("gpu-new", A): 1}, interval="2s")
