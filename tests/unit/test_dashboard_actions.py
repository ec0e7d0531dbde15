"""Following a restart (dashboard/actions.py) when its agent restarts in the middle of
it: agents keep their commands in memory, so the agent that comes back answers 404
for the command. Review finding: that answer became state "?", its message was
dropped, the Run page said "Waiting for the ranks…" forever and `clusterpulse-ctl
--wait` waited out its timeout."""

from __future__ import annotations

import dataclasses

import pytest

from clusterpulse.agent.audit import AuditLog
from clusterpulse.dashboard import actions, ctl
from clusterpulse.dashboard.promclient import PrometheusClient
from tests.conftest import TOKEN, start_agent
from tests.support.ranksock import RankProcess


@pytest.fixture
def restarted_mid_restart(tmp_path, sim_agent, monkeypatch):
    """request_action as every client calls it, against an agent (node-a) that takes
    the restart of run "demo" and then restarts: its results point at the agent that
    comes back (`sim_agent`, which has never seen the command)."""
    (tmp_path / "before").mkdir()
    before, server = start_agent(tmp_path / "before")
    monkeypatch.setattr(actions, "run_agents", lambda _prom, _run, _token, lookback="":
                        actions.RunAgents({"node-a": before.url}, {}))
    real = actions.request_action

    def request_then_agent_restarts(*args, **kwargs) -> list[actions.NodeResult]:
        results = real(*args, **kwargs)
        server.shutdown()
        before.agent.stop()
        return [dataclasses.replace(r, agent=sim_agent.url) for r in results]

    monkeypatch.setattr(actions, "request_action", request_then_agent_restarts)
    with RankProcess(before.socket_path, [{"type": "step", "run": "demo", "rank": 0,
                                           "step": 5}]):
        yield


def test_a_command_the_agent_no_longer_knows_ends_as_lost_with_its_words(
        restarted_mid_restart, tmp_path):
    (sent,) = actions.request_action(PrometheusClient("http://127.0.0.1:9"), "demo",
                                     "restart", "hung", "alice", TOKEN,
                                     AuditLog(tmp_path / "audit.jsonl"))
    assert sent.ok and sent.command and not actions.ended([sent]), sent
    (now,) = actions.command_states([sent], TOKEN)
    assert (now.ok, now.command, now.state) == (True, sent.command, "lost"), now
    assert "no longer knows" in now.error and f"no command {sent.command!r}" in now.error
    assert actions.ended([now])  # the Run page stops waiting, and says a node failed
    assert actions.command_states([now], TOKEN)[0].state == "lost"  # and stays so


def test_ctl_wait_stops_on_a_lost_command_with_a_line_that_says_so(
        restarted_mid_restart, tmp_path, capsys):
    (tmp_path / "token").write_text(TOKEN + "\n")
    rc = ctl.main(["--prometheus", "http://127.0.0.1:9", "--token-file",
                   str(tmp_path / "token"), "--audit-log", str(tmp_path / "cli.jsonl"),
                   "restart", "--run", "demo", "--hard", "--reason", "hung", "--wait",
                   "--timeout", "6"])
    out, err = capsys.readouterr()
    assert rc == 1, (out, err)
    (line,) = [x for x in err.splitlines() if "lost" in x]
    assert line.startswith("clusterpulse-ctl: node-a: command node-a-") \
        and "no longer knows this command" in line, err
    assert "timed out" not in err and "node-a=lost" in out, (out, err)


def test_a_command_seen_final_keeps_its_state_when_its_agent_forgets_it(monkeypatch):
    """Found in review: a restart whose node had completed became "lost" when its agent
    answered 404 later (restarted since, or its book of 256 finished commands rolled
    over), and the Run page, refreshing every 2 s, said "Some nodes failed". A command
    seen final keeps its state and its agent is not asked again; 404 is "lost" only for
    a command not yet seen final."""
    sent = actions.NodeResult("node-a", "http://127.0.0.1:28001", True,
                              "node-a-1765100000-1", "pending",
                              token_id=actions.token_id(actions.token_for(TOKEN, "node-a")))

    class Answer:
        def __init__(self, status: int, body: dict) -> None:
            self.status_code, self.body = status, body

        def json(self) -> dict:
            return self.body

    answers = [Answer(200, {"state": "completed", "detail": "all ranks resumed"}),
               Answer(404, {"error": f"no command {sent.command!r}"})]
    asked: list[str] = []
    monkeypatch.setattr(actions.requests, "get", lambda url, **_kw: asked.append(url)
                        or answers.pop(0))
    (now,) = actions.command_states([sent], TOKEN)
    assert (now.state, now.error) == ("completed", "all ranks resumed"), now
    (later,) = actions.command_states([now], TOKEN)  # the next refresh, from the last
    assert later == now and len(asked) == 1, (later, asked)
    # the same 404 for a command not yet seen final: lost
    lost = actions._followed(sent, 404, {"error": "no command"})
    assert lost.state == "lost" and "no longer knows" in lost.error, lost
    assert actions._followed(now, 404, {"error": "no command"}) == now
