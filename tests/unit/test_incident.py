"""Incidents (clusterpulse/incident.py) from a recording of the demo's three faults.

The recording is what Prometheus and the audit log held when the issue was filed: a
hung rank (RankHung + JobStalled), a GPU off the bus (GpuDown + GpuCriticalXid), an
overheating GPU (GpuThermalSlowdown + the TrainingStraggler it makes). The timeline
listed 6 incidents, "first resumed step 0" where the trainer resumed from 150 and 735,
"1776 steps lost" where 9, 0 and 0 were recomputed, and the hang's action at +8 s,
+135 s, +8 s on refreshes and at other ranges. Each is asserted here on the Prometheus
answers sampled at several steps and ranges, as the Run page and the demo read them.
"""

from __future__ import annotations

import pytest

from clusterpulse import incident
from clusterpulse.incident import AlertEpisode, Resume, build, episodes_from, resumes_from

RUN = "demo"
NODES = {"sim-node-0", "sim-node-1"}
T0 = 1_700_000_000.0
# (labels, activeAt, first firing, last firing) relative to T0
ALERTS = [
    ({"alertname": "RankHung", "run": RUN, "node": "sim-node-1", "rank": "2"}, 40, 48, 130),
    ({"alertname": "JobStalled", "run": RUN}, 44, 56, 128),
    ({"alertname": "GpuDown", "node": "sim-node-1", "gpu": "0"}, 300, 300, 362),
    ({"alertname": "GpuCriticalXid", "node": "sim-node-1", "gpu": "0", "xid": "79"},
     302, 302, 420),
    ({"alertname": "GpuThermalSlowdown", "node": "sim-node-0", "gpu": "0"}, 600, 610, 760),
    ({"alertname": "TrainingStraggler", "run": RUN, "node": "sim-node-0", "rank": "0",
      "cause": "thermal_throttling"}, 625, 655, 750),
    # another run's hang, and a GPU alert on a node the run does not use
    ({"alertname": "RankHung", "run": "other", "node": "sim-node-1", "rank": "0"}, 50, 60, 90),
    ({"alertname": "GpuDown", "node": "sim-node-9", "gpu": "3"}, 500, 500, 540),
]
AUDIT = [
    {"ts": T0 + 92.4, "who": "remediation", "action": "restart", "outcome": "accepted",
     "run": RUN, "source": "remediation"},
    {"ts": T0 + 93.0, "who": "remediation", "action": "restart", "outcome": "rate_limited",
     "run": RUN, "source": "remediation"},
    {"ts": T0 + 331.7, "who": "remediation", "action": "restart", "outcome": "accepted",
     "run": RUN, "source": "remediation"},
    {"ts": T0 + 500.0, "who": "bob", "action": "restart", "outcome": "accepted",
     "run": "other", "source": "dashboard"},
]
# The trainer's resume records: (resumed from, recomputed, resumed at, process ends)
RESUMES = [(150, 9, 97.3, 336.0), (735, 0, 337.9, 900.0)]


def prometheus_answers(start: float, end: float, step: float, alerts=ALERTS):
    """The two alert queries (incident.alert_queries) and the resume series as a range
    query from `start` to `end` (relative to T0) at `step` answers them: the rules write
    an alert sample each second (activeAt .. last), and each point of the alert queries
    covers the step before it, (t - step, t]: ALERTS_FOR_STATE's activeAt, and the time
    of the last firing sample."""
    times = [T0 + start + i * step for i in range(int((end - start) / step) + 1)]

    def window(t: float, first: float, last: float) -> list[float]:
        return [T0 + s for s in range(int(first), int(last) + 1) if t - step < T0 + s <= t]

    for_state, firing, first = [], [], []
    for labels, active, fired, last in alerts:
        pts = [(t, T0 + active) for t in times if window(t, active, last)]
        if pts:
            for_state.append(({"alertname": labels["alertname"], **labels}, pts))
        fpts = [(t, max(w)) for t in times if (w := window(t, fired, last))]
        if fpts:
            firing.append(({"alertstate": "firing", **labels}, fpts))
            first.append(({"alertstate": "firing", **labels},
                          [(t, min(w)) for t in times if (w := window(t, fired, last))]))
    series = {"step": [], "recomputed": [], "at": []}
    for step_, redo, at, ends in RESUMES:
        for t in times:
            if T0 + at <= t < T0 + ends:
                series["step"].append((t, float(step_)))
                series["recomputed"].append((t, float(redo)))
                series["at"].append((t, T0 + at))
    return for_state, firing, first, series


def incidents_at(start: float, end: float, step: float, alerts=ALERTS) -> list[incident.Incident]:
    for_state, firing, first, s = prometheus_answers(start, end, step, alerts)
    return build(RUN, NODES, episodes_from(for_state, firing, first, T0 + start), AUDIT,
                 resumes_from(s["step"], s["recomputed"], s["at"]))


def test_three_faults_are_three_incidents_named_by_their_root():
    items = incidents_at(0, 900, 1.0)
    assert [(i.cause, i.where) for i in items] == [
        ("RankHung", "sim-node-1 rank 2"), ("GpuDown", "sim-node-1 GPU 0"),
        ("GpuThermalSlowdown", "sim-node-0 GPU 0")]
    assert [i.alerts for i in items] == [["RankHung", "JobStalled"],
                                         ["GpuDown", "GpuCriticalXid"],
                                         ["GpuThermalSlowdown", "TrainingStraggler"]]


def test_resumed_step_and_recomputed_steps_are_the_trainers_own():
    items = incidents_at(0, 900, 1.0)
    assert [(i.resume.step, i.recomputed) if i.resume else None for i in items] == [
        (150, 9), (735, 0), None]
    assert incident.summary(items) == ("3 incident(s), 9 steps recomputed in all over 2 "
                                       "resume(s) (as the trainer recorded each)")
    # the thermal incident resumed nothing: no number, not "0 recomputed" (a review read
    # "steps recomputed 0" on a row with no restart, and "0 ... in all" for a range
    # that held only the hang before its restart)
    assert items[2].row()["steps recomputed"] is None
    assert incident.summary(items[2:]) == "1 incident(s), no restart resumed in this range"
    # every fault that restarted has its action, from the audit log, taken ones only
    assert [(i.action, i.acted_at) for i in items] == [
        ("restart", T0 + 92.4), ("restart", T0 + 331.7), (None, None)]


@pytest.mark.parametrize("start,end,step", [(0, 900, 1.0), (0, 900, 9.0), (-2700, 900, 18.0),
                                            (3.5, 897.5, 4.5), (30, 900, 7.0),
                                            (100, 900, 9.0)])
def test_the_same_rows_for_any_range_step_and_refresh(start, end, step):
    """The page's range sets the query step (1 h: 9 s); each refresh moves the window."""
    rows = [i.row() for i in incidents_at(start, end, step)]
    whole = [i.row() for i in incidents_at(0, 900, 1.0)]
    # when it paged is read only where the range holds its first firing (the page reads
    # 10 min before its window for that): else it is unknown ("-"), never a later time
    late = [n for n, r in enumerate(whole) if T0 + start >= r["detected"]]
    assert [r["paged"] for n, r in enumerate(rows) if n in late] == ["-"] * len(late)
    assert [{**r, "paged": None} for r in rows] == [{**r, "paged": None} for r in whole]
    assert [r["paged"] for n, r in enumerate(rows) if n not in late] == \
        [r["paged"] for n, r in enumerate(whole) if n not in late]
    assert rows[0]["action"] == "restart +52 s" and rows[0]["resumed from step"] == 150
    assert rows[1]["action"] == "restart +32 s" and rows[1]["resumed from step"] == 735
    # when it paged (its first alert's first firing), not only when a condition began
    # to hold: the thermal fault's GpuThermalSlowdown was pending 10 s (a review read a
    # GpuTemperatureHigh's pending start as "detected", 41 s before anything paged)
    assert [r["paged"] for r in whole] == ["+8 s", "+0 s", "+10 s"]


def test_alerts_of_other_runs_and_of_nodes_the_run_does_not_use_are_left_out():
    items = incidents_at(0, 900, 1.0)
    assert all("sim-node-9" not in i.where for i in items)
    assert all(i.run == RUN for i in items) and len(items) == 3


def test_one_line_for_the_demo_and_the_page():
    first = incidents_at(0, 900, 1.0)[0]
    assert first.line() == ("RankHung on sim-node-1 rank 2 (with JobStalled); paged +8 s; "
                            "restart by remediation +52 s; resumed from step 150 (9 steps "
                            "recomputed)")


def test_a_pending_alert_that_never_fired_is_no_incident():
    ep = episodes_from([({"alertname": "RankHung", "run": RUN, "node": "n"}, [(1.0, 1.0)])], [])
    assert ep == []


def test_faults_on_two_nodes_at_once_stay_two_incidents():
    a = AlertEpisode("GpuDown", {"node": "sim-node-0", "gpu": "1"}, 10.0, 50.0)
    b = AlertEpisode("GpuDown", {"node": "sim-node-1", "gpu": "1"}, 12.0, 50.0)
    items = build(RUN, NODES, [a, b], [], [Resume(40, 2, 60.0)])
    assert [i.where for i in items] == ["sim-node-0 GPU 1", "sim-node-1 GPU 1"]
    assert [i.resume for i in items] == [None, Resume(40, 2, 60.0)]


@pytest.mark.parametrize("start,step", [(0, 9.0), (3.5, 9.0), (0, 18.0), (2, 4.5)])
def test_an_alert_that_fired_for_less_than_the_query_step_is_still_on_the_page(start, step):
    """The demo printed "RankHung ... (with JobStalled)" from its 1 s query while the Run
    page's 1 h range (9 s step) read "RankHung ..." alone: JobStalled fired for 4 s,
    between two of the page's samples."""
    short = [({"alertname": "RankHung", "run": RUN, "node": "sim-node-1", "rank": "0"},
              40, 48, 55),
             ({"alertname": "JobStalled", "run": RUN}, 50, 52, 54)]
    rows = [i.row() for i in incidents_at(start, 900, step, short)]
    assert rows == [i.row() for i in incidents_at(0, 900, 1.0, short)]
    assert rows[0]["alerts"] == "RankHung, JobStalled"
    # and the action taken at +52 s is this incident's, not a split-off JobStalled's
    assert rows[0]["action"] == "restart +52 s" and len(rows) == 1


def test_the_alert_queries_cover_each_step_whole():
    for_state, firing, first = incident.alert_queries(9.0)
    assert for_state == "max_over_time(ALERTS_FOR_STATE[9000ms])"
    assert firing == 'max_over_time(timestamp(ALERTS{alertstate="firing"})[9000ms:1s])'
    assert first == 'min_over_time(timestamp(ALERTS{alertstate="firing"})[9000ms:1s])'
    assert incident.alert_queries(4.5)[0].endswith("[4500ms])")


# -- found by a review on a loaded machine (load ~38): extra alerts around the faults --
# the demo's ranks: two a node, on GPUs 0 and 1
RANK_GPUS = {("sim-node-0", "0"): {"0"}, ("sim-node-0", "1"): {"1"},
             ("sim-node-1", "2"): {"0"}, ("sim-node-1", "3"): {"1"}}


def _ep(name: str, at: float, last: float, **labels: str) -> AlertEpisode:
    return AlertEpisode(name, {"alertname": name, **labels}, T0 + at, T0 + last)


def _shown(episodes: list[AlertEpisode], start: float, audit=(), until: float = 10_000,
           ranks=None, resumes=()) -> list[incident.Incident]:
    """What a time range from `start` shows: the episodes that fired in it."""
    return build(RUN, NODES, [e for e in episodes if e.last_seen >= T0 + start], list(audit),
                 list(resumes), ranks=ranks, until=T0 + until)


def test_a_gpu_lost_after_unrelated_alerts_is_its_own_incident_in_every_range():
    """A hung-rank blip and stragglers on the other node fired before GPU 0 of
    sim-node-1 was lost: a range that began before them showed "GpuDown ... detected"
    35 s before the loss, with no action; one that began after, the loss as it was."""
    eps = [_ep("RankHung", 59, 60, run=RUN, node="sim-node-1", rank="2"),
           _ep("TrainingStraggler", 60, 110, run=RUN, node="sim-node-0", rank="0"),
           _ep("TrainingStraggler", 79, 115, run=RUN, node="sim-node-0", rank="1"),
           _ep("JobStalled", 90, 100, run=RUN),
           _ep("GpuDown", 97, 160, node="sim-node-1", gpu="0"),
           _ep("GpuCriticalXid", 98, 700, node="sim-node-1", gpu="0", xid="79")]
    audit = [{"ts": T0 + 99.5, "who": "policy", "why": "policy: GpuDown -> restart",
              "action": "restart", "outcome": "accepted", "run": RUN, "source": "remediation"}]
    for start in (0, 61, 97):
        down = [i for i in _shown(eps, start, audit) if i.cause == "GpuDown"]
        assert len(down) == 1, (start, [i.line() for i in _shown(eps, start, audit)])
        assert down[0].detected_at == T0 + 97 and down[0].where == "sim-node-1 GPU 0"
        assert down[0].alerts == ["GpuDown", "GpuCriticalXid"]
        assert (down[0].action, down[0].acted_at) == ("restart", T0 + 99.5)
    stragglers = [i for i in _shown(eps, 0, audit) if i.cause == "TrainingStraggler"]
    assert stragglers and all(i.action is None for i in stragglers)  # the policy named GpuDown


def test_two_gpus_lost_minutes_apart_on_one_node_are_two_incidents():
    """GPU 2's XID alert fires for 10 minutes: GPU 3, lost 9 minutes after it, joined
    its incident, which then read "GpuDown sim-node-0 GPU 3, detected" at GPU 2's loss."""
    eps = [_ep("GpuDown", 100, 160, node="sim-node-0", gpu="2"),
           _ep("GpuCriticalXid", 101, 700, node="sim-node-0", gpu="2", xid="79"),
           _ep("GpuDown", 652, 720, node="sim-node-0", gpu="3"),
           _ep("GpuCriticalXid", 653, 1300, node="sim-node-0", gpu="3", xid="79")]
    for start in (0, 400):
        items = _shown(eps, start)
        gpu3 = [i for i in items if i.where == "sim-node-0 GPU 3"]
        assert len(gpu3) == 1 and gpu3[0].detected_at == T0 + 652, [i.line() for i in items]
        assert gpu3[0].alerts == ["GpuDown", "GpuCriticalXid"]
    assert [i.where for i in _shown(eps, 0)] == ["sim-node-0 GPU 2", "sim-node-0 GPU 3"]


def test_a_lost_gpu_no_rank_of_the_run_used_is_not_the_runs_incident():
    eps = [_ep("GpuDown", 100, 160, node="sim-node-0", gpu="2"),
           _ep("GpuDown", 300, 360, node="sim-node-0", gpu="0")]
    assert [i.where for i in _shown(eps, 0, ranks=RANK_GPUS)] == ["sim-node-0 GPU 0"]


def test_an_action_long_after_an_incident_or_past_the_range_is_not_its_action():
    """An operator's restart 11 minutes after a straggler had resolved read as its
    action at +827 s; so did one taken after the end of the range shown."""
    eps = [_ep("TrainingStraggler", 100, 160, run=RUN, node="sim-node-0", rank="0")]
    late = [{"ts": T0 + 927, "who": "dashboard", "action": "checkpoint-restart",
             "outcome": "accepted", "run": RUN, "source": "dashboard"}]
    assert _shown(eps, 0, late)[0].action is None
    soon = [{**late[0], "ts": T0 + 200}]
    assert _shown(eps, 0, soon)[0].action == "checkpoint-restart"
    assert _shown(eps, 0, soon, until=190)[0].action is None  # after the range's end


def test_a_lost_gpus_xid_alert_does_not_hold_its_incident_open_for_ten_minutes():
    """GpuCriticalXid fires for the 10 minutes its count looks back: a straggler of a
    rank on that node 4 minutes after the GPU was back joined the lost GPU's incident
    (the page then differed from the line the demo had printed)."""
    eps = [_ep("GpuDown", 100, 125, node="sim-node-1", gpu="0"),
           _ep("GpuCriticalXid", 101, 700, node="sim-node-1", gpu="0", xid="79"),
           _ep("TrainingStraggler", 360, 420, run=RUN, node="sim-node-1", rank="2")]
    items = _shown(eps, 0)
    assert [(i.cause, i.alerts) for i in items] == [
        ("GpuDown", ["GpuDown", "GpuCriticalXid"]), ("TrainingStraggler", ["TrainingStraggler"])]
    # and an operator's restart 8 minutes after the loss is not the lost GPU's action
    late = [{"ts": T0 + 600, "who": "dashboard", "action": "restart", "outcome": "accepted",
             "run": RUN, "source": "dashboard"}]
    assert _shown(eps[:2], 0, late)[0].action is None


def test_the_timeline_table_is_one_arrow_table_with_and_without_a_resume():
    """"resumed from step" held "-" beside integers: no Arrow type is both, and the Run
    page logged an ArrowTypeError on every render. The demo's lines are unchanged."""
    import pandas as pd
    import pyarrow as pa

    items = incidents_at(0, 900, 1.0)
    rows = [i.row() for i in items]
    assert [r["resumed from step"] for r in rows] == [150, 735, None]
    table = pa.Table.from_pandas(pd.DataFrame(rows))  # raised ArrowTypeError
    assert pa.types.is_integer(table.schema.field("resumed from step").type) or \
        pa.types.is_floating(table.schema.field("resumed from step").type)
    assert "resumed from step 150 (9 steps recomputed)" in items[0].line()
    assert "resumed" not in items[2].line()


def test_a_ranks_alert_joins_no_incident_of_another_gpu_than_its_own():
    """Found in the second review: a hung rank on GPU 0 joined a lost GPU 1 on its node
    ("GpuDown on n1 GPU 1 (with RankHung)"), a straggler on GPU 1 the heat of GPU 0."""
    eps = [_ep("GpuDown", 100, 160, node="sim-node-1", gpu="1"),
           _ep("RankHung", 110, 150, run=RUN, node="sim-node-1", rank="2"),
           _ep("GpuThermalSlowdown", 300, 400, node="sim-node-0", gpu="0"),
           _ep("TrainingStraggler", 320, 390, run=RUN, node="sim-node-0", rank="1"),
           _ep("TrainingStraggler", 330, 390, run=RUN, node="sim-node-0", rank="0")]
    items = _shown(eps, 0, ranks=RANK_GPUS)
    assert [(i.cause, i.where, i.alerts) for i in items] == [
        ("GpuDown", "sim-node-1 GPU 1", ["GpuDown"]),
        ("RankHung", "sim-node-1 rank 2", ["RankHung"]),
        ("GpuThermalSlowdown", "sim-node-0 GPU 0", ["GpuThermalSlowdown", "TrainingStraggler"]),
        ("TrainingStraggler", "sim-node-0 rank 1", ["TrainingStraggler"])], \
        [i.line() for i in items]


def test_a_resume_long_after_an_incident_is_not_its_resume_at_any_range():
    """Found in the second review: a hang with no action at 09:57 showed "resumed from
    step 3605, +446 s", the resume of an operator's restart 7 minutes later."""
    eps = [_ep("RankHung", 100, 130, run=RUN, node="sim-node-1", rank="3")]
    later = [Resume(3605, 0, T0 + 546)]
    assert _shown(eps, 0, resumes=later)[0].resume is None
    soon = [Resume(40, 2, T0 + 140)]
    assert _shown(eps, 0, resumes=soon)[0].resume == soon[0]
    # after an action, the resume of that action, not one before it
    act = [{"ts": T0 + 120, "who": "policy", "why": "policy: RankHung -> restart",
            "action": "restart", "outcome": "accepted", "run": RUN, "source": "remediation"}]
    before = [Resume(30, 1, T0 + 110), Resume(41, 0, T0 + 131)]
    assert _shown(eps, 0, act, resumes=before)[0].resume == before[1]


def test_a_window_that_begins_inside_an_incident_shows_it_whole():
    """Found in the second review: a custom window that began after the lost GPU's
    GpuDown had resolved, while its XID alert still fired, showed "GpuCriticalXid ...,
    action -". The page reads INCIDENT_LOOKBACK_S before its window and shows each
    incident that fired in it, whole, at a step of at most 30 s."""
    from clusterpulse.dashboard import data

    start, end = 380, 900  # GpuDown fired until 362, its XID until 420
    span = end - start + data.INCIDENT_LOOKBACK_S
    shown = data.fired_since(incidents_at(end - span, end, data.incident_step(span)), T0 + start)
    assert [(i.cause, i.alerts, i.action) for i in shown] == [
        ("GpuDown", ["GpuDown", "GpuCriticalXid"], "restart"),
        ("GpuThermalSlowdown", ["GpuThermalSlowdown", "TrainingStraggler"], None)]
    assert [data.incident_step(s) for s in (3600, 86400, 604800)] == [9.0, 30.0, 60.48]


def test_a_concurrent_incident_hides_neither_the_policys_restart_nor_its_resume():
    """Found in review: a hang the policy restarted at +6 s, while another node's GPU
    began throttling at +3 s: the hang's window for actions ended at the throttling's
    start, so it read "no action", and the throttling took the hang's resume record."""
    eps = [_ep("RankHung", 0, 8, run=RUN, node="sim-node-1", rank="2"),
           _ep("JobStalled", 1, 8, run=RUN),
           _ep("GpuThermalSlowdown", 3, 200, node="sim-node-0", gpu="0")]
    act = [{"ts": T0 + 6, "who": "policy", "why": "policy: RankHung -> restart",
            "action": "restart", "outcome": "accepted", "run": RUN, "source": "remediation"}]
    resumed = [Resume(900, 37, T0 + 40)]
    items = _shown(eps, 0, act, ranks=RANK_GPUS, resumes=resumed)
    assert [(i.cause, i.action, i.acted_at, i.resume) for i in items] == [
        ("RankHung", "restart", T0 + 6, resumed[0]),
        ("GpuThermalSlowdown", None, None, None)], [i.line() for i in items]
    # an operator's action is one incident's: the first that fires when it is taken
    op = [{**act[0], "who": "alice", "why": "hung"}]
    items = _shown(eps, 0, op, ranks=RANK_GPUS, resumes=resumed)
    assert [(i.action, i.resume) for i in items] == [("restart", resumed[0]), (None, None)]
    # a restart no one recorded (torchrun's own): its resume is the hang's, not the
    # throttling's beside it (root order), though the throttling was detected later
    items = _shown(eps, 0, [], ranks=RANK_GPUS, resumes=resumed)
    assert [(i.cause, i.resume) for i in items] == [
        ("RankHung", resumed[0]), ("GpuThermalSlowdown", None)], [i.line() for i in items]


def test_an_operators_action_is_the_firing_incidents_not_an_ended_ones():
    """A second review: a GPU throttled for 5 minutes and stopped; 40 s later a rank
    hung, and an operator restarted the run 10 s after that. Walked oldest first, the
    ended throttling (still in its 120 s tail) took the restart, and the hang read "no
    action"."""
    eps = [_ep("GpuThermalSlowdown", 0, 300, node="sim-node-0", gpu="0"),
           _ep("RankHung", 340, 400, run=RUN, node="sim-node-1", rank="2"),
           _ep("JobStalled", 341, 400, run=RUN)]
    op = [{"ts": T0 + 350, "who": "alice", "why": "rank 2 hung", "action": "restart",
           "outcome": "accepted", "run": RUN, "source": "remediation"}]
    resumed = [Resume(900, 37, T0 + 420)]
    items = _shown(eps, 0, op, ranks=RANK_GPUS, resumes=resumed)
    assert [(i.cause, i.action, i.resume) for i in items] == [
        ("GpuThermalSlowdown", None, None), ("RankHung", "restart", resumed[0])], \
        [i.line() for i in items]
    # taken in the throttling's tail with no other incident open, it is the throttling's
    late = [{**op[0], "ts": T0 + 330}]
    items = _shown(eps, 0, late, ranks=RANK_GPUS)
    assert [(i.cause, i.action) for i in items] == [
        ("GpuThermalSlowdown", "restart"), ("RankHung", None)], [i.line() for i in items]


@pytest.mark.parametrize("name,labels", [
    ("NicLinkDown", {"device": "mlx5_0", "port": "1", "kind": "infiniband"}),
    ("NicLinkDegraded", {"device": "mlx5_0", "port": "1", "kind": "infiniband"}),
    ("GpuNvLinkDown", {"gpu": "0", "link": "3"}), ("GpuNvLinkErrors", {"gpu": "0", "link": "3"}),
    ("GpuPcieLinkDegraded", {"gpu": "0"}), ("GpuReadingsFailing", {"gpu": "0"}),
    ("RankProgressNotScraped", {"instance": "10.0.0.1:9477"})])
def test_a_link_or_scrape_alert_on_a_runs_node_is_on_its_timeline_as_the_root(name, labels):
    """Found in review: a NIC port down on the run's node, with the JobSlowdown it made,
    showed JobSlowdown alone on the timeline (the link alerts were no run's), while the
    Jobs table listed the link alert beside the run. Root before the congestion and the
    slowdown they explain (alerts.rules.yml names them)."""
    eps = [_ep(name, 0, 1800, node="sim-node-0", **labels),
           _ep("TrainingLinkCongested", 60, 1800, node="sim-node-0"),
           _ep("JobSlowdown", 120, 1800, run=RUN)]
    items = _shown(eps, 0, ranks=RANK_GPUS)
    assert [(i.cause, i.alerts) for i in items] == [
        (name, [name, "TrainingLinkCongested", "JobSlowdown"])], [i.line() for i in items]


def test_the_root_order_names_alerts_the_rules_define():
    """A name misspelt here would never be a root nor any run's: each is an alert
    of deploy/prometheus/alerts.rules.yml."""
    import re

    from tests.support.procs import REPO

    defined = set(re.findall(r"- alert: (\w+)", (REPO / "deploy/prometheus/alerts.rules.yml")
                             .read_text()))
    assert set(incident.ROOT_ORDER) - defined == set()
    assert incident.NODE_ALERTS - defined == set()


def test_a_restart_goes_with_the_hang_beside_a_throttling_and_a_resume_with_the_fault_it_ended():
    """A second re-review: (1) a GPU throttling on one node, still firing, took the
    operator's restart of a hang on another (the earliest firing, not the root); (2) a
    hang that cleared by itself took the resume of the crash a GPU's XID caused a
    minute later (root order over which fault the restart ended)."""
    eps = [_ep("GpuThermalSlowdown", 0, 600, node="sim-node-0", gpu="0"),
           _ep("RankHung", 300, 345, run=RUN, node="sim-node-1", rank="2")]
    op = [{"ts": T0 + 340, "who": "alice", "why": "hung", "action": "restart",
           "outcome": "accepted", "run": RUN, "source": "dashboard"}]
    resumed = [Resume(100, 20, T0 + 380)]
    items = _shown(eps, 0, op, ranks=RANK_GPUS, resumes=resumed)
    assert [(i.cause, i.action, i.resume) for i in items] == [
        ("GpuThermalSlowdown", None, None), ("RankHung", "restart", resumed[0])], \
        [i.line() for i in items]
    eps = [_ep("RankHung", 0, 40, run=RUN, node="sim-node-1", rank="2"),
           _ep("GpuCriticalXid", 90, 120, node="sim-node-0", gpu="0")]
    resumed = [Resume(100, 20, T0 + 130)]
    items = _shown(eps, 0, [], ranks=RANK_GPUS, resumes=resumed)
    assert [(i.cause, i.resume) for i in items] == [
        ("RankHung", None), ("GpuCriticalXid", resumed[0])], [i.line() for i in items]
