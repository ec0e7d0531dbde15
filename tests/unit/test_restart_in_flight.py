"""One restart of a run at a time, as each client sees it: a second dashboard session,
the remediation policy and clusterpulse-ctl are refused (the agent's 409) with the
restart in flight named, and none of them records the refusal as an action taken.

Review finding: two operator tabs each requested a hard restart of one run, 6 s apart;
both were accepted, the second killed the processes the first had just started, and
80 s later the policy restarted the run a third time."""

from __future__ import annotations

import pytest

from clusterpulse import incident
from clusterpulse.agent.audit import AuditLog
from clusterpulse.dashboard import actions, ctl
from clusterpulse.dashboard.promclient import PrometheusClient
from clusterpulse.dashboard.remediation import Policy, Remediator, Rule
from tests.conftest import TOKEN
from tests.support.ranksock import RankProcess


@pytest.fixture
def run_on_agent(sim_agent, monkeypatch):
    """Run "demo" with one live rank on the sim agent, found there by every client."""
    monkeypatch.setattr(actions, "run_agents", lambda _prom, _run, _token, lookback="":
                        actions.RunAgents({sim_agent.agent.node: sim_agent.url}, {}))
    with RankProcess(sim_agent.socket_path, [{"type": "step", "run": "demo", "rank": 0,
                                              "step": 5}]) as rank:
        yield sim_agent, rank


def test_every_client_is_refused_a_second_restart_and_told_which_is_in_flight(
        run_on_agent, tmp_path, monkeypatch, capsys):
    agent, rank = run_on_agent
    prom = PrometheusClient("http://127.0.0.1:9")  # run_agents is the stub above
    audit = AuditLog(tmp_path / "audit.jsonl")
    (first,) = actions.request_action(prom, "demo", "checkpoint-restart", "slow", "alice",
                                      TOKEN, audit)
    assert first.ok, first
    # the second tab
    (second,) = actions.request_action(prom, "demo", "restart", "hung", "bob", TOKEN, audit)
    assert not second.ok and second.in_flight is not None
    assert second.in_flight["id"] == first.command
    assert first.command in second.error and "on behalf of alice" in second.error
    assert "already in flight" in second.error and "state pending" in second.error
    assert actions.all_in_flight([second])
    # what the tab follows instead: the restart in flight
    (followed,) = actions.follow_in_flight([second])
    assert followed.ok and followed.command == first.command
    assert actions.command_states([followed], TOKEN)[0].state == "pending"
    kind, said = actions.refusal_status([second], 0, actions.command_states([followed], TOKEN))
    assert kind == "error" and said.startswith("Not sent") and first.command in said, said
    assert "requested by alice" in said and "escalate" in said, said  # graceful: a way out
    # the policy: not an action taken (the audit), and its decision says why
    monkeypatch.setattr(Remediator, "_unconfirmed", lambda *_a: None)  # Prometheus agrees
    rem = Remediator(Policy([Rule("RankHung", "restart")]), prom, TOKEN, audit)
    (d,) = rem.handle({"alerts": [{"status": "firing", "startsAt": "2026-01-01T00:00:00Z",
                                   "labels": {"alertname": "RankHung", "run": "demo"}}]})
    assert d["outcome"] == "in_flight" and first.command in d["detail"], d
    # nothing was done, so the run's one action per window is still the policy's: another
    # alert meets the restart in flight too, not the rate limit
    (d,) = rem.handle({"alerts": [{"status": "firing", "startsAt": "2026-01-01T00:01:00Z",
                                   "labels": {"alertname": "RankHung", "run": "demo",
                                              "rank": "0"}}]})
    assert d["outcome"] == "in_flight", d
    # clusterpulse-ctl
    token_file = tmp_path / "token"
    token_file.write_text(TOKEN)
    cli = ["--token-file", str(token_file), "--audit-log", str(tmp_path / "cli.jsonl")]
    assert ctl.main([*cli, "restart", "--run", "demo", "--hard", "--reason", "hung"]) == 1
    assert first.command in capsys.readouterr().out
    assert rank.p.poll() is None, "a refused restart signalled the rank"
    requests_ = [r for r in audit.read() if r.get("source") in ("dashboard", "remediation")]
    assert [(r["who"], r["outcome"]) for r in requests_] == [
        ("alice", "accepted"), ("bob", "refused"), ("policy", "refused"), ("policy", "refused")]
    assert not {r["outcome"] for r in requests_[1:]} & incident.TAKEN
    # an operator forces the hard restart by naming the graceful one in flight
    assert ctl.main([*cli, "escalate", "--run", "demo", "--command", first.command,
                     "--reason", "stuck"]) == 0
    assert f"escalated {first.command}" in capsys.readouterr().out
    assert rank.p.wait(timeout=10) == -15
    assert agent.get(f"/v1/commands/{first.command}").json()["state"] == "escalated"


def test_the_refused_tab_says_when_the_restart_it_follows_has_ended():
    """The refusal was shown as each agent said it ("state delivered, deadline in
    118 s", ~900 characters for two nodes) and still said so after the restart it named
    had completed: now the restart is named once, its state is the progress table's."""
    running = {"id": "c1", "run": "demo", "action": "restart", "requested_by": "dashboard",
               "on_behalf_of": "alice", "created_unix": 3600.0, "state": "delivered"}
    refused = [actions.NodeResult(n, f"http://{n}", False, error="... state delivered ...",
                                  in_flight=running) for n in ("n1", "n2")]

    def node(state: str) -> actions.NodeResult:
        return actions.NodeResult("n1", "http://n1", True, "c1", state)

    kind, said = actions.refusal_status(refused, 3700, [node("delivered"), node("completed")])
    assert (kind, said) == ("error", "Not sent at 01:01:40 UTC: a restart of this run "
                            "requested by alice at 01:00:00 UTC (command c1) was already in "
                            "flight; a run is not restarted twice. Its progress is below.")
    kind, done = actions.refusal_status(refused, 3700, [node("completed"), node("completed")])
    assert kind == "info" and "has since completed" in done and "Ask again" in done
    kind, failed = actions.refusal_status(refused, 3700, [node("completed"), node("failed")])
    assert kind == "info" and "ended (see the table)" in failed
