"""What clusterpulse-ctl says when an address it is given is not what it should be: a
server that answered is not called unreachable, and an error is said once."""

from __future__ import annotations

import threading
from collections.abc import Iterator
from http.server import SimpleHTTPRequestHandler, ThreadingHTTPServer

import pytest

from clusterpulse.dashboard import actions, ctl
from deploy.local.stack import free_port


class Quiet(SimpleHTTPRequestHandler):
    def log_message(self, *args: object) -> None:
        pass


@pytest.fixture
def web_server(tmp_path) -> Iterator[str]:
    """A web server that is no agent: it answers POST with an HTML error page."""
    server = ThreadingHTTPServer(("127.0.0.1", free_port()), Quiet)
    threading.Thread(target=server.serve_forever, daemon=True).start()
    yield f"http://127.0.0.1:{server.server_port}"
    server.shutdown()
    server.server_close()


def test_an_agent_address_that_answers_html_is_not_called_unreachable(
        web_server, tmp_path, monkeypatch, capsys):
    """Found in review: `FAILED: unreachable: JSONDecodeError` for a server that
    answered, with a page that is not the agent's JSON."""
    monkeypatch.setattr(actions, "run_agents", lambda prom, run, token, lookback="":
                        actions.RunAgents({"node-a": web_server}, {}))
    token = tmp_path / "token"
    token.write_text("agent-token-0123456789\n")
    assert ctl.main(["--prometheus", "http://127.0.0.1:9", "--token-file", str(token),
                     "--audit-log", str(tmp_path / "audit.jsonl"), "restart", "--run",
                     "job", "--graceful", "--reason", "x"]) == 1
    out = capsys.readouterr().out
    assert out == ("node-a: FAILED: answered with something that is not the agent's JSON "
                   "(is it an agent?)\n"), out


def test_an_agent_given_as_prometheus_is_one_error_naming_the_address(sim_agent, capsys):
    """Found in review: `--prometheus <an agent's URL>` printed `error: error: no route
    /api/v1/query`: the agent's JSON error read as Prometheus's, whose type defaulted
    to "error"."""
    assert ctl.main(["--prometheus", sim_agent.url, "agents", "--run", "job"]) == 1
    err = capsys.readouterr().err
    assert err.startswith("clusterpulse-ctl: error: no route /api/v1/query (HTTP 404; "
                          f"is {sim_agent.url} a Prometheus API?)"), err
    assert err.count("error:") == 1, err
