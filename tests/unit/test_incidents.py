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
