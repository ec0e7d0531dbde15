"""The Run page's hang incident (root + waiters + what they wait in) and straggler
flag, from the data the page fetches."""

from __future__ import annotations

import pandas as pd

from clusterpulse.dashboard.incidents import hang_incident, straggler_flag


def data(margin, behind, blocked) -> dict:
    ranks = pd.DataFrame({"rank": ["0", "1", "2", "3"], "node": ["a", "a", "b", "b"]})
    return {"ranks": ranks, "blocked": blocked,
            "per_rank": {"hang margin s": margin, "collectives behind": behind}}


def test_a_hang_shows_its_root_and_the_waiters_with_their_collective():
    d = data({"0": 9, "1": 9, "2": 9, "3": 9}, {"0": 0, "1": 2, "2": 0, "3": 0},
             {"0": "all_reduce #41", "2": "all_reduce #41", "3": "all_reduce #41"})
    inc = hang_incident(d)
    assert inc.roots == ["1"] and sorted(inc.waiters) == ["0", "2", "3"]
    assert inc.headline() == ("Hang rooted at rank 1 on a; 3 rank(s) wait in "
                              "all_reduce #41.")


def test_no_incident_while_every_rank_is_within_its_threshold_and_job_level_otherwise():
    assert hang_incident(data({"0": -3, "1": -1}, {}, {})) is None
    inc = hang_incident(data({"0": 4, "1": 4}, {"0": 0, "1": 0}, {}))
    assert inc.roots == [] and inc.headline().startswith("Job stalled, no root can be told")


def test_straggler_flag_follows_the_scorer_when_it_reports():
    assert straggler_flag(1.3, 0.0) == ""  # slower for life, not a straggler
    assert straggler_flag(1.08, 1.0) == "STRAGGLER"
    assert straggler_flag(1.2, None) == "STRAGGLER" and straggler_flag(1.05, None) == ""


def test_ranks_that_are_not_numbers_are_ordered_last_not_a_crash():
    """Found by a review: another exporter's rank="r3" (or "²", which isdigit() takes)
    stopped the Run page in sorted(key=int)."""
    inc = hang_incident(data({"10": 9, "2": 9, "r3": 9, "\u00b2": 9},
                             {"10": 1, "2": 1, "r3": 1, "\u00b2": 0}, {}))
    assert inc.roots == ["2", "10", "r3"] and list(inc.waiters) == ["\u00b2"]


def _alert(name: str, **labels: str):
    from clusterpulse.dashboard.amclient import Alert

    return Alert(name, {"alertname": name, **labels}, {"summary": f"{name} summary"},
                 "active", [], [], "2026-01-01T00:00:00Z")


def test_an_agent_down_without_a_node_name_is_a_row_of_the_cluster_page():
    """Found in review: the Cluster page left NodeAgentDown out of its table (the node
    table holds it), also when the table did not: "All nodes and GPUs healthy" while
    an address no agent ever answered at paged. Named by its address; a node the
    table holds down is one row, not two."""
    from clusterpulse.dashboard.incidents import problem_rows

    nodes = pd.DataFrame({"node": ["a", "b"], "instance": ["10.0.0.1:9477", "10.0.0.2:9477"],
                          "up": [1, 0]})
    rows = problem_rows(pd.DataFrame(), nodes, [
        _alert("NodeAgentDown", instance="10.0.0.9:9477"),
        _alert("NodeAgentDown", node="b", instance="10.0.0.2:9477"),
        _alert("GpuThermalSlowdown", node="a", gpu="1")])
    assert rows == [
        {"node": "b", "gpu": "", "problem": "agent unreachable"},
        {"node": "10.0.0.9:9477", "gpu": "", "problem": "agent unreachable"},
        {"node": "a", "gpu": "1", "problem": "GpuThermalSlowdown summary"}]


def test_a_rank_past_its_hold_margin_only_is_the_hangs_root_as_rankhung_pages_it():
    """Found in review: RankHung fires on either margin (the hang's or the hold's: a
    rank holding the others in a collective past the usual), the Run page read only the
    hang margin and said "no root can be told" while RankHung named rank 1."""
    d = data({"0": 4, "1": -2, "2": 4, "3": 4}, {"0": 0, "1": 3, "2": 0, "3": 0}, {})
    d["per_rank"]["hold margin s"] = {"1": 6.0}
    inc = hang_incident(d)
    assert inc.roots == ["1"] and sorted(inc.waiters) == ["0", "2", "3"]
    d["per_rank"]["hang margin s"] = {}
    assert hang_incident(d).roots == ["1"]


def test_the_timeline_dates_an_incident_where_the_window_spans_days():
    """Found in review: at 7 d two hangs on different days, at the same time of day,
    both read "began 14:00:00"."""
    from clusterpulse.dashboard.incidents import timeline_row

    row = {"detected": 1_796_565_600.0, "incident": "RankHung", "where": "n1 rank 1",
           "paged": "+0 s", "action": "-", "by": "-", "resumed from step": None,
           "resumed": "-", "alerts": "RankHung", "steps recomputed": None}
    assert timeline_row(row)[0]["began (UTC)"] == "14:00:00"
    assert timeline_row(row, dated=True)[0]["began (UTC)"] == "12-06 14:00:00"


def test_the_straggler_line_names_a_missing_figure_not_nan():
    """Found in review: a flagged rank whose GPU temperature was not reported read "GPU
    at nan °C" above the table."""
    from clusterpulse.dashboard.incidents import straggler_line

    r = {"rank": "3", "node": "b", "gpu": "1", "score": 1.5, "cause": "compute",
         "GPU °C": float("nan"), "data wait ms": 2.0, "sync wait ms": None, "evidence": "u"}
    line = straggler_line(r)
    assert "nan" not in line and "None" not in line
    assert line == ("Rank 3 on b GPU 1 is 1.50x the typical rank — cause: **compute** (GPU °C "
                    "not reported, data wait 2 ms, sync wait ms not reported). "
                    "[Its GPU's charts](u)")


def test_the_throttle_table_splits_episodes_at_gaps_longer_than_the_step():
    """Found in review: GPU 1 throttled 13:00-13:01 and 13:50-13:51 read as one episode
    13:00-13:51 on the Node page."""
    from clusterpulse.dashboard.data import throttle_episodes

    t0, step = 1_796_562_000.0, 18.0
    pts = [(t0 + s, 1.0) for s in range(0, 61, 18)] + \
        [(t0 + 3000 + s, 1.0) for s in range(0, 61, 18)]
    rows = throttle_episodes([({"gpu": "1", "reason": "hw_thermal_slowdown"}, pts)], step)
    assert [(r["from (UTC)"].timestamp() - t0, r["until (UTC)"].timestamp() - t0)
            for _, r in rows.iterrows()] == [(0, 54), (3000, 3054)]
    assert throttle_episodes([({"gpu": "1", "reason": "x"}, pts)], step, gpu="0").empty
