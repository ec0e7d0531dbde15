"""The Run page's incident timeline, from recorded alert, step and audit data."""

from __future__ import annotations

from clusterpulse.dashboard.timeline import incidents, rows


def steps_series() -> list[tuple[float, float]]:
    """Steps 0..99 over t=0..99, a hang from t=100 (stuck at 100), a hard restart
    at t=130 that resumes from checkpoint 80 and trains on."""
    pts = [(float(t), float(t)) for t in range(100)]
    pts += [(float(t), 100.0) for t in range(100, 130)]
    pts += [(float(t), 80.0 + (t - 130)) for t in range(130, 200)]
    return pts


def test_hang_incident_chains_fault_detection_action_resume_and_lost_work():
    alerts = [({"alertname": "RankHung", "run": "r", "node": "n1", "rank": "1"},
               [(float(t), 1.0) for t in range(115, 131)]),
              ({"alertname": "RankHung", "run": "other", "node": "n1", "rank": "0"},
               [(120.0, 1.0)])]
    audit = [{"ts": 120.5, "run": "r", "action": "restart", "outcome": "accepted"},
             {"ts": 121.0, "run": "r", "action": "restart", "outcome": "rate_limited"}]
    [inc] = incidents("r", {"n0", "n1"}, alerts, steps_series(), audit, step_s=1.0)
    assert inc.alert == "RankHung" and inc.where == "n1 rank 1"
    assert inc.fault_at == 100.0  # the last progress before the alert
    assert inc.detected_at == 115.0 and inc.action == "restart" and inc.acted_at == 120.5
    assert inc.resumed_step == 80 and inc.resumed_at == 131.0
    assert inc.lost_steps == 20  # steps 81..100 are done again
    [row] = rows([inc])
    assert row["detected"] == "+15 s" and row["first resumed step"] == "80 +31 s"


def test_node_alerts_count_only_for_nodes_of_the_run():
    alerts = [({"alertname": "NodeAgentDown", "node": "n9"}, [(50.0, 1.0)]),
              ({"alertname": "NodeAgentDown", "node": "n1"}, [(60.0, 1.0), (61.0, 1.0)])]
    found = incidents("r", {"n0", "n1"}, alerts, steps_series(), [], step_s=1.0)
    assert [(i.alert, i.where, i.action) for i in found] == [("NodeAgentDown", "n1", None)]
    assert found[0].lost_steps == 0  # the run kept stepping: nothing lost
