"""The audit log's hash chain (issue #29): every deletion, reordering or forged line
is named by line, several processes appending to one file keep one chain, and the
head is published outside the file (a metric) and checked by `clusterpulse-audit`."""

from __future__ import annotations

import json
import subprocess
import sys
from pathlib import Path

import pytest

from clusterpulse.agent import auditcli
from clusterpulse.agent.audit import AuditLog, verify, verify_chain


def _log(path: Path, n: int) -> AuditLog:
    log = AuditLog(path)
    for i in range(n):
        log.write("ops", "restart", f"r{i}", "delivered", run=f"run{i}")
    return log


def _rewrite(path: Path, lines: list[str]) -> None:
    path.write_text("".join(line + "\n" for line in lines))


def test_deleting_a_record_and_dropping_prev_after_it_is_a_break(tmp_path):
    """Found in review: delete a record, then drop `prev` from every line after it:
    verify_chain found nothing."""
    path = tmp_path / "audit.jsonl"
    _log(path, 5)
    lines = path.read_text().splitlines()
    del lines[2]
    kept = lines[:2]
    for line in lines[2:]:
        rec = json.loads(line)
        del rec["prev"]
        kept.append(json.dumps(rec, sort_keys=True))
    _rewrite(path, kept)
    assert verify_chain(path) and verify_chain(path)[0] == 3


def test_a_forged_line_is_a_break(tmp_path):
    """Found in review: a line `[]` inserted in the middle passed."""
    path = tmp_path / "audit.jsonl"
    _log(path, 3)
    lines = path.read_text().splitlines()
    _rewrite(path, [*lines[:2], "[]", lines[2]])
    assert verify_chain(path) == [3, 4]


def test_a_line_nested_too_deep_to_parse_is_a_break_not_a_crash(tmp_path):
    """Found by a review: a forged line `[[[...` 200,000 deep raised RecursionError in
    verify, and, as the file's last line, in the head every /metrics scrape of the
    agent publishes: the node's metrics were lost. It is a forged line, like `[]`."""
    from clusterpulse.agent.audit import file_head

    path = tmp_path / "audit.jsonl"
    _log(path, 2)
    lines = path.read_text().splitlines()
    deep = "[" * 200_000
    _rewrite(path, [*lines, deep])
    assert verify_chain(path) == [3]
    assert file_head(path).seq == 3  # counted on from its position, as other garbage
    log = AuditLog(path)  # a writer chains on after it
    log.write("ops", "restart", "r9", "delivered", run="r9")
    assert log.head.seq == 4 and verify_chain(path) == [3]
    assert len(log.read()) == 3  # the reader skips it
    _rewrite(path, [*lines, "{}"])  # an object without a sequence number: the same
    assert file_head(path).seq == 3


def test_an_audit_log_path_that_is_a_directory_has_no_head_and_no_scrape_fails(tmp_path):
    """A directory opens read-only, and reading its end raised IsADirectoryError in
    every /metrics scrape of the agent: the node's metrics were lost, not the head."""
    from prometheus_client import CollectorRegistry, generate_latest

    from clusterpulse.agent.audit import file_head
    from clusterpulse.agent.backends.sim import SimBackend
    from clusterpulse.agent.core import Agent
    from clusterpulse.agent.exporter import AgentCollector
    from clusterpulse.agent.ranks import RankRegistry

    assert file_head(tmp_path) is None
    agent = Agent(SimBackend(gpus=1), "n", RankRegistry(), AuditLog(tmp_path))
    agent.collect_once()
    registry = CollectorRegistry(auto_describe=False)
    registry.register(AgentCollector(agent))
    assert b"clusterpulse_gpu_up{" in generate_latest(registry)


def test_reordering_and_a_rewritten_anchor_are_breaks(tmp_path):
    path = tmp_path / "audit.jsonl"
    _log(path, 4)
    lines = path.read_text().splitlines()
    _rewrite(path, [lines[0], lines[2], lines[1], lines[3]])
    assert 2 in verify_chain(path)
    _rewrite(path, lines[1:])  # the first records removed: the chain has no anchor
    assert verify_chain(path)[:1] == [1]


def test_records_cut_from_the_end_show_against_the_published_head(tmp_path):
    path = tmp_path / "audit.jsonl"
    log = _log(path, 4)
    head = log.head
    assert head.seq == 4 and verify(path, head).intact
    _rewrite(path, path.read_text().splitlines()[:3])
    verdict = verify(path, head)
    assert not verdict.intact and "removed from the end" in verdict.breaks[0][1]


_WRITER = """
import sys
from pathlib import Path
from clusterpulse.agent.audit import AuditLog
log = AuditLog(Path(sys.argv[1]))
for i in range(int(sys.argv[3])):
    AuditLog(Path(sys.argv[1])).write(sys.argv[2], "sign-in", "dashboard", "ok")
    log.write(sys.argv[2], "restart", "policy", "delivered", n=i)
"""


def test_processes_sharing_one_file_keep_one_chain(tmp_path):
    """Found in review: the dashboard and the remediation receiver write the same file
    (demo, systemd, Kubernetes), each chaining onto the last record *it* wrote; an
    untouched live file had 7 lines flagged as tampered. Three processes, each with a
    long-lived log and a fresh one per record (as the dashboard does)."""
    path = tmp_path / "audit.jsonl"
    procs = [subprocess.Popen([sys.executable, "-c", _WRITER, str(path), who, "60"])
             for who in ("dashboard", "policy", "cli")]
    assert [p.wait(timeout=120) for p in procs] == [0, 0, 0]
    assert verify_chain(path) == []
    verdict = verify(path)
    assert verdict.records == 360 and verdict.head.seq == 360


def test_a_torn_line_from_another_writer_stays_a_line_of_its_own(tmp_path):
    path = tmp_path / "audit.jsonl"
    _log(path, 2)
    with open(path, "a") as f:
        f.write('{"ts": 1, "who": "crashed mid-wri')
    _log(path, 1)
    lines = path.read_text().splitlines()
    assert len(lines) == 4 and json.loads(lines[3])["seq"] == 4
    assert verify_chain(path) == [3]


def test_cli_says_where_the_chain_breaks(tmp_path, capsys):
    path = tmp_path / "audit.jsonl"
    log = _log(path, 3)
    assert auditcli.main(["verify", str(path)]) == 0
    assert "3 records, chain intact" in capsys.readouterr().out
    lines = path.read_text().splitlines()
    _rewrite(path, [lines[0], lines[2]])
    assert auditcli.main(["verify", str(path)]) == 1
    out = capsys.readouterr().out
    assert f"{path}:2: seq 3 after 1: records missing before it" in out
    _rewrite(path, lines[:2])
    assert auditcli.main(["verify", str(path), "--head", f"3:{log.head.digest[:12]}"]) == 1
    assert "removed from the end" in capsys.readouterr().out


def test_cli_bad_input_is_one_line(tmp_path, capsys):
    assert auditcli.main(["verify", str(tmp_path / "missing.jsonl")]) == 2
    err = capsys.readouterr().err
    assert err.count("\n") == 1 and "No such file" in err
    try:
        auditcli.main(["verify", str(tmp_path), "--head", "12"])
    except SystemExit as exit_:
        assert exit_.code == 2
    assert "expected SEQ:HASH" in capsys.readouterr().err


def test_the_agent_publishes_the_head(sim_agent):
    from prometheus_client.parser import text_string_to_metric_families

    sim_agent.get("/v1/ranks", token="wrong-token-xxxxxxxxxxxx")  # an audited refusal
    head = sim_agent.agent.audit.head
    assert head.seq >= 1
    values = {s.name: s.value for f in text_string_to_metric_families(
        sim_agent.get("/metrics", token=None).text) for s in f.samples}
    assert values["clusterpulse_audit_head_sequence"] == head.seq
    assert values["clusterpulse_audit_head_hash_prefix"] == int(head.digest[:12], 16)


def test_the_remediation_receiver_publishes_the_central_logs_head(tmp_path):
    """Found in review of issue #29: the central log (the receiver's, the dashboard's
    and clusterpulse-ctl's: it records automatic restarts) had no head outside the
    file: 2 policy records cut from its end left `verify` at "intact" and no trace
    anywhere. The receiver now serves its head at /metrics (and a writer that restarts
    publishes the file's head, not 0), so Prometheus's AuditLogRewound sees the cut."""
    import requests
    from prometheus_client.parser import text_string_to_metric_families

    from clusterpulse.agent.tokens import Tokens
    from clusterpulse.dashboard.promclient import PrometheusClient
    from clusterpulse.dashboard.remediation import Policy, Remediator, Rule, serve

    path = tmp_path / "audit.jsonl"
    _log(path, 5)
    rem = Remediator(Policy([Rule("RankHung", "restart")], dry_run=True),
                     PrometheusClient("http://127.0.0.1:9"), "agent-token-0123456789",
                     AuditLog(path))  # a receiver started after the records were written
    server = serve(rem, "127.0.0.1", 0, Tokens.single("hook-token-0123456789", "alertmanager"))

    def head() -> dict[str, float]:
        text = requests.get(f"http://127.0.0.1:{server.server_port}/metrics", timeout=10).text
        return {s.name: s.value for f in text_string_to_metric_families(text)
                for s in f.samples if s.labels == {"log": "central"}}

    try:
        assert head()["clusterpulse_audit_head_sequence"] == 5
        lines = path.read_text().splitlines()
        _rewrite(path, lines[:3])
        assert verify(path).intact  # the file alone cannot tell
        now = head()
        assert now["clusterpulse_audit_head_sequence"] == 3
        assert now["clusterpulse_audit_head_hash_prefix"] == int(
            verify(path).head.digest[:12], 16)
    finally:
        server.shutdown()
        server.server_close()


def test_the_audit_page_shows_the_head_and_names_breaks(tmp_path, monkeypatch):
    from streamlit.testing.v1 import AppTest

    path = tmp_path / "audit.jsonl"
    log = _log(path, 3)
    monkeypatch.setenv("CLUSTERPULSE_AUDIT_LOG", str(path))
    page = str(Path(__file__).resolve().parents[2] / "dashboard" / "views" / "audit.py")
    at = AppTest.from_file(page, default_timeout=60)
    at.run()
    assert not at.exception
    assert any(f"3:{log.head.digest[:16]}" in c.value and "intact" in c.value
               for c in at.caption)
    lines = path.read_text().splitlines()
    _rewrite(path, [lines[0], lines[2]])
    at = AppTest.from_file(page, default_timeout=60)
    at.run()
    assert any("broken" in e.value and "line 2" in e.value for e in at.error)


def test_records_of_types_no_writer_gives_are_left_out_and_counted(tmp_path, monkeypatch):
    """Found by a review: valid JSON with a field of another type ("ts": "yesterday",
    "nodes": [...], "command": [...], "who": 5, "ts": NaN or 1e30) crashed the Audit page
    before the chain's check, which names forged lines, was drawn."""
    from streamlit.testing.v1 import AppTest

    path = tmp_path / "audit.jsonl"
    _log(path, 2)
    good = path.read_text().splitlines()
    forged = ['{"ts": "yesterday", "who": "x", "action": "restart"}',
              '{"ts": 1e30, "who": "x"}', '{"ts": NaN, "who": "x"}',
              '{"ts": 5, "who": 5, "action": "restart"}',
              '{"ts": 5, "who": "x", "nodes": ["n1"]}',
              '{"ts": 5, "who": "x", "command": ["c"]}',
              '{"ts": 6, "who": "y", "action": null, "run": null}']
    _rewrite(path, [*good, *forged])
    monkeypatch.setenv("CLUSTERPULSE_AUDIT_LOG", str(path))
    page = str(Path(__file__).resolve().parents[2] / "dashboard" / "views" / "audit.py")
    at = AppTest.from_file(page, default_timeout=60)
    at.run()
    assert not at.exception, at.exception
    assert any(w.value.startswith("6 record(s) of the log are not shown") for w in at.warning)
    assert any("broken" in e.value for e in at.error)  # the chain's check is drawn
    assert "3 action(s)" in " ".join(c.value for c in at.caption)  # 2 + the null one


@pytest.mark.parametrize("where", ["dir", "under-a-file"])
def test_an_audit_log_path_no_file_can_have_is_a_named_setting(tmp_path, monkeypatch,
                                                                 where):
    """A directory, or a path under a file: IsADirectoryError on the Audit and Run
    pages, FileExistsError on every sign-in (which then went unaudited)."""
    from streamlit.testing.v1 import AppTest

    (tmp_path / "file").write_text("x")
    path = tmp_path if where == "dir" else tmp_path / "file" / "audit.jsonl"
    monkeypatch.setenv("CLUSTERPULSE_AUDIT_LOG", str(path))
    page = str(Path(__file__).resolve().parents[2] / "dashboard" / "views" / "audit.py")
    at = AppTest.from_file(page, default_timeout=60)
    at.run()
    assert not at.exception, at.exception
    assert [e.value for e in at.error] == [
        f"Dashboard setting: CLUSTERPULSE_AUDIT_LOG={str(path)!r}"
        + (" is a directory; name a file" if where == "dir"
           else f": {tmp_path / 'file'} is not a directory")], at.error


def test_the_audit_page_names_the_authenticated_caller_not_the_bodys_name(tmp_path):
    """Found in review: a caller holding the `fault-player` token posted a restart with
    "requested_by": "alice"; the record said who: fault-player, and the Audit page's
    who column and "Newest action" line said alice, fault-player nowhere. A name from a
    request body is a claim: shown only after the signer, labelled."""
    import types

    from clusterpulse.agent.commands import CommandBook
    from clusterpulse.agent.control import ControlApi
    from clusterpulse.agent.ranks import RankRegistry
    from clusterpulse.agent.tokens import Tokens
    from clusterpulse.dashboard import auditview

    audit = AuditLog(tmp_path / "audit.jsonl")
    ranks = RankRegistry()
    agent = types.SimpleNamespace(audit=audit, node="node-1", ranks=ranks, backend=None,
                                  commands=CommandBook(ranks, audit, "node-1"))
    api = ControlApi(agent, Tokens({"fault-player": "fp-token-0123456789abcdef"}))
    api.handle("POST", "/v1/runs/demo/actions", "Bearer fp-token-0123456789abcdef",
               json.dumps({"action": "restart", "reason": "x",
                           "requested_by": "alice"}).encode())
    assert [r["who"] for r in audit.read()] == ["fault-player"]
    frame = auditview.actions(auditview.usable(audit.read())[0])
    assert list(frame["who"]) == ["fault-player (for alice)"]
    line = auditview.newest_line(frame)
    assert r"**fault-player \(for alice\)** restart on run demo" in line, line
    # the body's name alone never stands for the caller, in any of the record's states
    recs = [{"ts": 1.0, "who": "token", "action": "restart", "outcome": "delivered",
             "source": "agent", "node": "n", "command": "n-1-1"},
            {"ts": 2.0, "who": "token", "on_behalf_of": "alice", "action": "restart",
             "outcome": "completed", "source": "agent", "node": "n", "command": "n-1-1"}]
    assert list(auditview.actions(recs)["who"]) == ["token (for alice)"]
    assert auditview.person({"who": "policy", "on_behalf_of": "policy"}) == "policy"
