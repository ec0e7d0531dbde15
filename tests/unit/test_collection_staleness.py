"""A stuck NVML call must be visible: /metrics keeps answering (the scrape never
waits on NVML) while the age of the last successful collection grows; and it must not
stop what the agent does besides collecting (command follow-ups, an unwritable audit
log)."""

from __future__ import annotations

import json
import threading

from prometheus_client.parser import text_string_to_metric_families

from clusterpulse.agent.audit import AuditLog
from clusterpulse.agent.backends.nvml import NvmlBackend
from clusterpulse.agent.core import Agent
from clusterpulse.agent.ranks import RankRegistry
from clusterpulse.agent.server import make_server, serve_in_thread
from tests.conftest import TOKEN, socket_path, start_agent
from tests.fakes.fake_pynvml import FakeNvml
from tests.support.procs import wait_until
from tests.support.ranksock import RankProcess


def _scrape(url: str) -> dict[str, float]:
    import requests

    body = requests.get(url + "/metrics", timeout=5).text
    return {f"{s.name}{{{s.labels.get('gpu', '')}}}": s.value
            for fam in text_string_to_metric_families(body) for s in fam.samples}


def test_collection_age_grows_while_nvml_is_stuck_and_metrics_keep_serving(tmp_path):
    fake = FakeNvml(gpus=2)
    agent = Agent(NvmlBackend(nvml=fake), "node-s", RankRegistry(), AuditLog(None),
                  interval_s=0.1)
    server = make_server(agent, "127.0.0.1", 0, None)
    agent.start()
    serve_in_thread(server)
    url = f"http://127.0.0.1:{server.server_port}"
    fake.stuck = threading.Event()
    try:
        first = _scrape(url)
        assert first["clusterpulse_gpu_up{0}"] == 1.0
        # Collection is now blocked inside NVML; the age must pass several intervals
        # while every scrape still answers with the last known GPU data.
        later = wait_until(
            lambda: (m := _scrape(url))["clusterpulse_agent_collection_age_seconds{}"] > 2.0
            and m, 60, "collection age growing past 2 s")
        assert later["clusterpulse_gpu_up{0}"] == 1.0
        fake.stuck.set()
        wait_until(lambda: _scrape(url)["clusterpulse_agent_collection_age_seconds{}"] < 1.0,
                   60, "collection age back to fresh once NVML answers")
    finally:
        fake.stuck.set()
        server.shutdown()
        agent.stop()


def test_an_agent_whose_first_collection_hangs_serves_and_says_how_stale_it_is(
        monkeypatch):
    """The first collection ran in start(), and the CLI served after it: an NVML call
    that hung at start kept /metrics, the control API, the telemetry receiver and the
    hard restarts' follow-ups off while the agent looked started (its unit active),
    and the collection age read 0 (no success yet) rather than growing."""
    from clusterpulse.agent import core

    monkeypatch.setattr(core, "FIRST_COLLECTION_WAIT_S", 0.3)
    fake = FakeNvml(gpus=2)
    agent = Agent(NvmlBackend(nvml=fake), "node-s", RankRegistry(), AuditLog(None),
                  interval_s=0.1)
    server = make_server(agent, "127.0.0.1", 0, None)
    fake.stuck = threading.Event()  # every per-GPU call blocks from now on
    starting = threading.Thread(target=agent.start, daemon=True)
    serve_in_thread(server)  # first, as the CLI does: it answers whatever NVML does
    try:
        starting.start()
        starting.join(10)
        assert not starting.is_alive(), "start() waits on the hung collection"
        wait_until(lambda: _scrape(f"http://127.0.0.1:{server.server_port}")[
            "clusterpulse_agent_collection_age_seconds{}"] > 0.5, 30,
                   "the age growing from the agent's start")
    finally:
        fake.stuck.set()
        server.shutdown()
        agent.stop()


def test_a_hard_restart_is_followed_up_while_nvml_is_stuck(tmp_path):
    """A GPU in trouble can block NVML calls for minutes, and that is when a job needs
    a restart. The command follow-ups ran in the collection loop: a hard restart's
    SIGKILL (5 s after its SIGTERM) never came, and a hung rank whose SIGTERM handler
    only sets a flag (the trainer's does) lived on."""
    import requests

    fake = FakeNvml(gpus=2)
    agent = Agent(NvmlBackend(nvml=fake), "node-s", RankRegistry(),
                  AuditLog(tmp_path / "audit.jsonl"), interval_s=0.1,
                  telemetry_addr=socket_path("node-s"))
    server = make_server(agent, "127.0.0.1", 0, TOKEN)
    agent.start()
    serve_in_thread(server)
    fake.stuck = threading.Event()
    try:
        with RankProcess(agent.telemetry_address.removeprefix("unix:"),
                         [{"type": "step", "run": "r1", "rank": 0, "step": 5}],
                         ignore_sigterm=True) as rank:
            r = requests.post(f"http://127.0.0.1:{server.server_port}/v1/runs/r1/actions",
                              json={"action": "restart", "reason": "hung"},
                              headers={"Authorization": f"Bearer {TOKEN}"}, timeout=10)
            assert r.status_code == 202 and r.json()["signalled_pids"] == [rank.pid], r.text
            assert rank.p.wait(timeout=60) == -9  # SIGTERM ignored, then SIGKILL
    finally:
        fake.stuck.set()
        server.shutdown()
        agent.stop()


def test_an_unwritable_audit_log_stops_nothing_and_loses_no_record(tmp_path):
    """A full or read-only disk under the audit log: the write raised, in the
    collection loop when a command finished (the loop ended for good: no GPU samples,
    no follow-ups, while /healthz said ok) and in the control API after the ranks were
    already signalled (the operator saw an error and would retry). Now the records
    wait in memory, the failure is counted, and they are written, in order and
    chained, once the file can be written again."""
    from clusterpulse.agent.audit import verify_chain

    running, server = start_agent(tmp_path)
    path = running.audit_path
    try:
        with RankProcess(running.socket_path, [{"type": "step", "run": "r1", "rank": 0,
                                                "step": 5}]) as rank:
            path.unlink(missing_ok=True)
            path.mkdir()  # unwritable, even for root
            r = running.post("/v1/runs/r1/actions", {"action": "restart", "reason": "hung",
                                                      "deadline_s": 1})
            assert r.status_code == 202 and r.json()["signalled_pids"] == [rank.pid], r.text
            assert rank.p.wait(timeout=10) == -15
        # nothing resumes: at the deadline the command's end is recorded, in the loop
        cycles = running.agent.snapshot.cycles
        wait_until(lambda: running.agent.collection_errors().get("audit_write", 0) >= 2, 60,
                   "the failed writes counted")
        wait_until(lambda: running.agent.snapshot.cycles > cycles + 5, 30,
                   "collection going on")
        path.rmdir()
        running.post("/v1/runs/r9/actions", {"action": "restart", "reason": "after"})
        records = [json.loads(x) for x in path.read_text().splitlines()]
        assert [(x["action"], x.get("run")) for x in records][:1] == [("restart", "r1")]
        assert records[-1]["run"] == "r9" and len(records) >= 3, records
        assert verify_chain(path) == []
        # a short write (the disk takes part of a line without an error) is a failure,
        # not a torn line: a file size limit shows it
        import resource
        import signal

        size = path.stat().st_size
        old_handler = signal.signal(signal.SIGXFSZ, signal.SIG_IGN)
        soft, hard = resource.getrlimit(resource.RLIMIT_FSIZE)
        resource.setrlimit(resource.RLIMIT_FSIZE, (size + 40, hard))
        try:
            running.agent.audit.write("ops", "restart", "short", "accepted", run="r10")
        finally:
            resource.setrlimit(resource.RLIMIT_FSIZE, (soft, hard))
            signal.signal(signal.SIGXFSZ, old_handler)
        assert path.stat().st_size == size  # nothing torn left behind
        assert running.agent.audit.flush() is True  # written once the file takes it
        assert json.loads(path.read_text().splitlines()[-1])["run"] == "r10"
        assert verify_chain(path) == []
    finally:
        if path.is_dir():
            path.rmdir()
        server.shutdown()
        running.agent.stop()
