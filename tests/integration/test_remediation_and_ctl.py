"""The remediation policy and clusterpulse-ctl against a real agent and a real
Prometheus; ranks are real processes that report over the agent's Unix socket."""

from __future__ import annotations

import datetime
import json
import os
import signal
import subprocess
import sys
import time

import pytest
import requests

from clusterpulse.agent.audit import AuditLog
from clusterpulse.agent.tokens import Tokens
from clusterpulse.dashboard.actions import (
    ActionError,
    command_states,
    rank_owners,
    request_action,
    run_agents,
)
from clusterpulse.dashboard.promclient import PrometheusClient
from clusterpulse.dashboard.remediation import Policy, PolicyError, Remediator, Rule, serve
from tests.support.procs import REPO, Prometheus, start_agent_cli, wait_until
from tests.support.ranksock import SYSTEM_PYTHON, RankProcess

pytestmark = pytest.mark.integration
TOKEN = "remediation-token-0123456789"
HOOK_TOKEN = "alertmanager-hook-token-0123456789"


@pytest.fixture
def cluster(tmp_path):
    token = tmp_path / "token"
    token.write_text(TOKEN)
    agent, port, telemetry = start_agent_cli(tmp_path, "node-r", gpus=2, token_file=token)
    # Rank 0 of run "job" straggles while it reports, every rank of it hangs, and the
    # node's eth0 is congested (stand-ins for the project's rules, evaluated by the real
    # Prometheus: the receiver checks ALERTS before every action).
    rules = tmp_path / "standin.rules.yml"
    rules.write_text("groups:\n- name: t\n  rules:\n  - alert: TrainingStraggler\n"
                     "    expr: max by (run, rank) (clusterpulse_trainer_step{run=\"job\","
                     "rank=\"0\"}) >= 0\n"
                     "  - alert: RankHung\n"
                     "    expr: max by (run, rank, node) (clusterpulse_trainer_step{run=\"job\"})"
                     " >= 0\n"
                     "  - alert: TrainingLinkCongested\n"
                     "    expr: max by (node) (clusterpulse_agent_build_info)\n")
    prom = Prometheus(tmp_path, [f"127.0.0.1:{port}"], rule_files=[rules])
    # the rank: a live process the agent knows from the kernel's credentials
    rank = RankProcess(telemetry[len("unix:"):], [{
        "type": "step", "run": "job", "rank": 0, "local_rank": 0, "gpu": 1, "step": 3}])
    victim = rank.p
    wait_until(lambda: prom.query('clusterpulse_trainer_rank_info{run="job"}'), 30,
               "rank scraped")
    yield prom, port, token, victim, tmp_path, telemetry
    rank.stop()
    prom.stop()
    agent.stop()


def fires(prom: Prometheus, selector: str) -> None:
    """Wait until Prometheus has the alert firing: the policy acts on no other."""
    wait_until(lambda: prom.query(f'ALERTS{{alertstate="firing",{selector}}}'), 30,
               f"{selector} firing in Prometheus")


def firing(name: str, started: float | None = None, **labels) -> dict:
    at = datetime.datetime.fromtimestamp(started or time.time(), datetime.UTC).isoformat()
    return {"status": "firing", "labels": {"alertname": name, **labels}, "startsAt": at}


def test_policy_acts_rate_limits_and_audits(cluster):
    prom, _port, _, victim, tmp, _telemetry = cluster
    audit = AuditLog(tmp / "audit.jsonl")
    policy = Policy([Rule("RankHung", "restart"), Rule("TrainingStraggler",
                                                          "checkpoint-restart", 60)],
                    max_actions_per_run=1, window_s=600)
    rem = Remediator(policy, PrometheusClient(prom.url), TOKEN, audit, tmp / "history.jsonl")
    fires(prom, 'alertname="RankHung",run="job",rank="0"')
    (d,) = rem.handle({"alerts": [firing("RankHung", run="job", rank="0")]})
    assert d["outcome"] == "acted" and d["nodes"]["node-r"].startswith("node-r-")
    assert victim.wait(timeout=10) == -15  # the agent terminated the hung rank
    (d,) = rem.handle({"alerts": [firing("RankHung", run="job", rank="0")]})
    assert d["outcome"] == "rate_limited"
    (d,) = rem.handle({"alerts": [firing("TrainingStraggler", run="job", rank="0")]})
    assert d["outcome"] == "waiting"  # sustained_s not reached
    assert rem.tick()[0]["outcome"] == "waiting"
    assert rem.handle({"alerts": [firing("GpuTemperatureHigh", node="node-r")]}) == []
    outcomes = [r["outcome"] for r in audit.read() if r["who"] == "policy"]
    assert outcomes == ["accepted", "rate_limited"]
    assert len((tmp / "history.jsonl").read_text().splitlines()) == 4


def test_a_resent_notification_is_not_acted_on_twice(cluster):
    """Alertmanager sends a whole notification again after a 503 (Prometheus could not
    support the decision on another alert in it): an alert already acted on was
    decided again, and with max_actions_per_run above 1 acted on twice."""
    prom, _port, _, victim, tmp, _telemetry = cluster
    audit = AuditLog(tmp / "audit.jsonl")
    rem = Remediator(Policy([Rule("RankHung", "restart")], max_actions_per_run=5),
                     PrometheusClient(prom.url), TOKEN, audit)
    hung = {**firing("RankHung", run="job", rank="0"), "fingerprint": "a1b2c3"}
    fires(prom, 'alertname="RankHung",run="job",rank="0"')
    # the same notification twice at once (a retry while the first is still being
    # handled, or both Alertmanagers of an HA pair): one action
    import threading

    out: list[dict] = []
    both = [threading.Thread(target=lambda: out.extend(rem.handle({"alerts": [hung]})))
            for _ in range(2)]
    for t in both:
        t.start()
    for t in both:
        t.join(timeout=60)
    assert sorted(d["outcome"] for d in out) == ["acted", "decided"], out
    assert victim.wait(timeout=10) == -15
    (d,) = rem.handle({"alerts": [hung]})  # the resend
    assert (d["outcome"], d["detail"]) == ("decided", "decided already"), d
    assert [r["outcome"] for r in audit.read() if r["who"] == "policy"] == ["accepted"]


def test_sustained_alert_is_acted_on_without_a_new_notification(cluster):
    """Alertmanager repeats an unchanged alert only after hours: the receiver re-checks
    waiting alerts itself, and forgets them when they resolve. Its resolved
    notification comes only at the next group_interval (minutes in production): a
    sustained alert is acted on only if Prometheus still has it firing."""
    prom, _, _, _, tmp, _telemetry = cluster
    wait_until(lambda: prom.query('ALERTS{alertname="TrainingStraggler",run="job",'
                                  'rank="0",alertstate="firing"}'), 30, "the alert firing")
    now = [time.time()]
    audit = AuditLog(tmp / "audit.jsonl")
    rem = Remediator(Policy([Rule("TrainingStraggler", "checkpoint-restart", 60)]),
                     PrometheusClient(prom.url), TOKEN, audit, clock=lambda: now[0])
    # rank 2: notified firing, but resolved in Prometheus before the wait was over
    gone = firing("TrainingStraggler", now[0], run="job", rank="2")
    alert = firing("TrainingStraggler", now[0], run="job", rank="0")
    assert [d["outcome"] for d in rem.handle({"alerts": [gone, alert]})] == ["waiting"] * 2
    now[0] += 61
    decided = {d["outcome"] for d in rem.tick()}
    assert decided == {"resolved", "acted"}, decided
    assert [r["outcome"] for r in audit.read() if r["who"] == "policy"] == ["accepted"]
    assert rem.tick() == []  # acted on once, the other dropped: nothing waits
    other = firing("TrainingStraggler", now[0], run="job", rank="1")
    rem.handle({"alerts": [other]})
    rem.handle({"alerts": [{**other, "status": "resolved"}]})
    now[0] += 61
    assert rem.tick() == []


def test_node_level_alert_finds_the_runs_on_that_gpu_and_dry_run_never_acts(cluster):
    prom, port, _, victim, tmp, _telemetry = cluster
    policy = Policy([Rule("GpuDown", "restart")], dry_run=True)
    rem = Remediator(policy, PrometheusClient(prom.url), TOKEN, AuditLog(tmp / "a.jsonl"))
    (d,) = rem.handle({"alerts": [firing("GpuDown", node="node-r", gpu="1")]})
    assert d == {"run": "job", "alert": "GpuDown", "action": "restart", "outcome": "dry_run"}
    assert rem.handle({"alerts": [firing("GpuDown", node="node-r", gpu="0")]}) == []
    assert victim.poll() is None
    r = requests.get(f"http://127.0.0.1:{port}/v1/commands", timeout=5,
                     headers={"Authorization": f"Bearer {TOKEN}"}).json()
    assert r["commands"] == []


def test_node_level_alert_restarts_a_run_only_while_one_of_its_ranks_lives(cluster):
    """The rank on a lost GPU may die with it (a CUDA error) while its peers wait: the run
    is restarted. Once every rank of the run has ended (it finished, or was stopped) the
    agent still lists them for its grace period, and GpuDown under them acts on nothing."""
    prom, _, _, victim, tmp, telemetry = cluster
    peer = RankProcess(telemetry[len("unix:"):], [{
        "type": "step", "run": "job", "rank": 1, "local_rank": 1, "gpu": 0, "step": 3}])
    try:
        wait_until(lambda: prom.query('clusterpulse_trainer_rank_info{run="job",rank="1"}'), 30,
                   "the peer scraped")
        victim.kill()
        victim.wait()
        wait_until(lambda: prom.query('clusterpulse_trainer_process_alive{rank="0"} == 0'), 30,
                   "the rank on GPU 1 seen ended")
        policy = Policy([Rule("GpuDown", "restart")], dry_run=True)
        rem = Remediator(policy, PrometheusClient(prom.url), TOKEN, AuditLog(tmp / "a.jsonl"))
        (d,) = rem.handle({"alerts": [firing("GpuDown", node="node-r", gpu="1")]})
        assert d == {"run": "job", "alert": "GpuDown", "action": "restart", "outcome": "dry_run"}
    finally:
        peer.stop()
    wait_until(lambda: prom.query('clusterpulse_trainer_process_alive{rank="1"} == 0'), 30,
               "the peer seen ended")
    assert prom.query('clusterpulse_trainer_rank_info{run="job",node="node-r",gpu="1"}')
    audit = AuditLog(tmp / "b.jsonl")
    rem = Remediator(Policy([Rule("GpuDown", "restart")]), PrometheusClient(prom.url), TOKEN,
                     audit)
    assert rem.handle({"alerts": [firing("GpuDown", node="node-r", gpu="1")]}) == []
    assert audit.read() == []


def test_a_run_reported_by_another_users_process_is_not_restarted(cluster):
    """A run id is a name: another user's process on any node could report a rank of
    the victim's run (here rank 7, never stepping: RankHung fires for it), and the
    policy, trusting the alert's run label, hard-restarted the victim's ranks every
    window_s. An action now asks the run's agents who (kernel uid) reports its ranks,
    and acts on none when more than one user does."""
    prom, _port, _, victim, tmp, telemetry = cluster
    audit = AuditLog(tmp / "audit.jsonl")
    with RankProcess(telemetry[len("unix:"):], [{"type": "step", "run": "job", "rank": 7,
                                                  "local_rank": 0, "gpu": 0, "step": 1}],
                     user=65534) as intruder:
        rem = Remediator(Policy([Rule("RankHung", "restart")]), PrometheusClient(prom.url),
                         TOKEN, audit)
        fires(prom, 'alertname="RankHung",run="job",rank="7"')
        (d,) = rem.handle({"alerts": [firing("RankHung", run="job", rank="7",
                                             node="node-r")]})
        assert d["outcome"] == "failed", d
        assert "more than one user" in d["detail"] and "uid 65534" in d["detail"], d
        assert victim.poll() is None and intruder.p.poll() is None  # nobody signalled
    (record,) = [r for r in audit.read() if r["who"] == "policy"]
    assert record["outcome"] == "failed" and record["alert"]["rank"] == "7"


@pytest.mark.skipif(os.geteuid() != 0, reason="sending as another uid needs root")
def test_a_rank_no_process_vouches_for_is_never_acted_for(cluster):
    """Finding: a datagram from a process that exited at once was recorded with uid
    null, which the policy ignored: one fake straggler datagram made it restart another
    user's run, and the agent SIGTERMed the victim's ranks. Here the agent is paused
    while another user's process reports rank 7 of the victim's run and exits: nobody
    can vouch for it, and the policy refuses to act for the run."""
    prom, port, _, victim, tmp, telemetry = cluster
    audit = AuditLog(tmp / "audit.jsonl")
    agent_pid = _agent_pid(port)
    os.kill(agent_pid, signal.SIGSTOP)
    try:
        ghost = subprocess.run([SYSTEM_PYTHON, "-c", (
            "import json, socket, sys; s = socket.socket(socket.AF_UNIX, "
            "socket.SOCK_SEQPACKET); s.connect(sys.argv[1]); s.send(json.dumps({'v': 1, "
            "'type': 'step', 'run': 'job', 'rank': 7, 'step': 1, 'straggler_score': 9}"
            ").encode())"), telemetry[len("unix:"):]], user=65534, timeout=30)
        assert ghost.returncode == 0
    finally:
        os.kill(agent_pid, signal.SIGCONT)
    ranks = {}
    wait_until(lambda: ranks.update({r["rank"]: r for r in requests.get(
        f"http://127.0.0.1:{port}/v1/ranks", timeout=5,
        headers={"Authorization": f"Bearer {TOKEN}"}).json()["ranks"]}) or 7 in ranks, 30,
               "the ghost rank")
    assert ranks[7]["uid"] is None and ranks[0]["uid"] == os.getuid()
    rem = Remediator(Policy([Rule("RankHung", "restart")]), PrometheusClient(prom.url),
                     TOKEN, audit)
    fires(prom, 'alertname="RankHung",run="job",rank="7"')
    (d,) = rem.handle({"alerts": [firing("RankHung", run="job", rank="7", node="node-r")]})
    assert d["outcome"] == "failed" and "could not verify" in d["detail"], d
    assert victim.poll() is None  # nobody signalled


def test_an_agent_that_cannot_say_who_runs_the_job_stops_the_action(cluster):
    """Finding: when an agent answered 503 or timed out on the ownership query, the
    action was still sent to the other agents. What it holds is unknown: fail closed."""
    _prom, port, _, _victim, _tmp, _telemetry = cluster
    agents = {"node-r": f"http://127.0.0.1:{port}", "node-gone": "http://127.0.0.1:9"}
    with pytest.raises(ActionError, match="the agent on node-gone did not answer"):
        rank_owners(agents, "job", TOKEN)
    assert rank_owners({"node-r": agents["node-r"]}, "job", TOKEN) == {os.getuid(): {"node-r"}}


def _agent_pid(port: int) -> int:
    """The agent process listening on `port` (its /healthz does not say)."""
    out = subprocess.run(["ss", "-Hltnp", f"sport = :{port}"], capture_output=True,
                         text=True, check=True).stdout
    return int(out.split("pid=", 1)[1].split(",", 1)[0])


def test_webhook_endpoint(cluster):
    prom, _, _, _, _tmp, _telemetry = cluster
    rem = Remediator(Policy([]), PrometheusClient(prom.url), TOKEN, AuditLog(None))
    server = serve(rem, "127.0.0.1", 0, Tokens.single(HOOK_TOKEN, "alertmanager"))
    try:
        url = f"http://127.0.0.1:{server.server_port}/alertmanager"
        auth = {"Authorization": f"Bearer {HOOK_TOKEN}"}
        assert requests.post(url, json={"alerts": []}, headers=auth,
                             timeout=5).json() == {"decisions": []}
        assert requests.post(url, data=b"{nope", headers=auth, timeout=5).status_code == 400
    finally:
        server.shutdown()


def test_label_values_are_escaped_in_promql(cluster):
    """Finding: a `node` label was pasted into PromQL; this one selected every run."""
    prom, _, _, victim, tmp, _telemetry = cluster
    rem = Remediator(Policy([Rule("GpuDown", "restart")], dry_run=True),
                     PrometheusClient(prom.url), TOKEN, AuditLog(tmp / "a.jsonl"))
    evil = 'x"} or clusterpulse_trainer_rank_info{node!="'
    assert rem.handle({"alerts": [firing("GpuDown", node=evil)]}) == []
    assert rem.handle({"alerts": [firing("GpuDown", node="node-r")]})[0]["run"] == "job"
    assert victim.poll() is None


def test_policy_files_are_validated(tmp_path):
    p = tmp_path / "p.toml"
    p.write_text('[[rule]]\nalert = "RankHung"\naction = "reboot"\n')
    with pytest.raises(PolicyError, match="'action' must be one of"):
        Policy.load(p)
    p.write_text("[[rule]\n")
    with pytest.raises(PolicyError, match="not valid TOML"):
        Policy.load(p)
    assert len(Policy.load(REPO / "deploy" / "local" / "policy.toml").rules) == 4
    for table, says in [("[evict]\nleave_s = 0\n", "leave_s must be a number"),
                        ("[evict]\nleave_s = 'long'\n", "leave_s must be a number"),
                        ("[evict]\ngrace = 5\n", "unknown keys grace")]:
        p.write_text(table)
        with pytest.raises(PolicyError, match=says):
            Policy.load(p)


def test_evict_node_asks_the_alerts_node_alone_to_sit_the_restart_out(cluster):
    """A link alert names a node, not a run: the runs with ranks there get a graceful
    restart that this node's agent alone is asked for, with the policy's cooldown as the
    time its ranks' launcher waits before rejoining (the rest of the job goes on)."""
    prom, port, _, victim, tmp, _telemetry = cluster
    policy_file = tmp / "evict.toml"
    policy_file.write_text('[[rule]]\nalert = "TrainingLinkCongested"\naction = "evict-node"\n'
                           "[evict]\nleave_s = 45\n")
    audit = AuditLog(tmp / "audit.jsonl")
    rem = Remediator(Policy.load(policy_file), PrometheusClient(prom.url), TOKEN, audit)
    fires(prom, 'alertname="TrainingLinkCongested",node="node-r"')
    (d,) = rem.handle({"alerts": [firing("TrainingLinkCongested", node="node-r")]})
    assert d["outcome"] == "acted" and d["action"] == "evict-node", d
    cid = d["nodes"]["node-r"]
    cmd = requests.get(f"http://127.0.0.1:{port}/v1/commands/{cid}", timeout=5,
                       headers={"Authorization": f"Bearer {TOKEN}"}).json()
    assert (cmd["action"], cmd["leave_s"], cmd["run"]) == ("checkpoint-restart", 45, "job")
    assert victim.poll() is None  # graceful: nothing is signalled
    (rec,) = [r for r in audit.read() if r["who"] == "policy"]
    assert (rec["action"], rec["outcome"], rec["leave_s"]) == ("evict-node", "accepted", 45)
    # the request goes to the named nodes' agents only
    with pytest.raises(ActionError, match="has no ranks on node-z"):
        request_action(PrometheusClient(prom.url), "job", "checkpoint-restart", "t", "ops",
                       TOKEN, audit, nodes=["node-z"], leave_s=45)


def test_ctl_restart_and_agents(cluster):
    prom, port, token, _victim, tmp, _telemetry = cluster

    def ctl(*args):
        return subprocess.run([sys.executable, "-m", "clusterpulse.dashboard.ctl",
                               "--prometheus", prom.url,
                               "--token-file", str(token), "--audit-log",
                               str(tmp / "ctl.jsonl"), *args],
                              capture_output=True, text=True, timeout=60, cwd=REPO)

    r = ctl("agents", "--run", "job")
    assert r.returncode == 0 and r.stdout.startswith(f"node-r\thttp://127.0.0.1:{port}")
    r = ctl("restart", "--run", "job", "--graceful", "--reason", "test")
    assert r.returncode == 0 and "node-r: accepted node-r-" in r.stdout
    r = ctl("restart", "--run", "nope", "--hard", "--reason", "test")
    assert r.returncode == 1 and "no agent reports ranks of run 'nope'" in r.stderr
    record = json.loads((tmp / "ctl.jsonl").read_text().splitlines()[0])
    assert record["source"] == "cli" and record["why"] == "test"
    r = ctl("restart", "--run", "bad run", "--hard", "--reason", "x")
    assert r.returncode == 1 and "invalid run id" in r.stderr
    r = ctl("evict", "--run", "job", "--node", "node-r", "--for", "0", "--reason", "link")
    assert r.returncode == 2 and "evict --for: seconds in 1..3600" in r.stderr
    r = ctl("evict", "--run", "job", "--node", "node-z", "--for", "60", "--reason", "link")
    assert r.returncode == 1 and "has no ranks on node-z" in r.stderr
    # the graceful restart above is in flight: a second restart of "job" is refused,
    # naming it (one at a time on a node); the eviction goes to another run
    graceful = json.loads((tmp / "ctl.jsonl").read_text().splitlines()[0])["nodes"]["node-r"]
    r = ctl("evict", "--run", "job", "--node", "node-r", "--for", "60", "--reason", "link")
    assert r.returncode == 1 and "already in flight" in r.stdout and graceful in r.stdout, r
    with RankProcess(_telemetry[len("unix:"):], [{"type": "step", "run": "job2", "rank": 0,
                                                  "local_rank": 0, "gpu": 0, "step": 3}]):
        wait_until(lambda: prom.query('clusterpulse_trainer_rank_info{run="job2"}'), 30,
                   "job2 scraped")
        r = ctl("evict", "--run", "job2", "--node", "node-r", "--for", "60", "--reason", "link")
    assert r.returncode == 0 and "node-r: accepted node-r-" in r.stdout
    cid = r.stdout.split("accepted ")[1].split()[0]
    cmd = requests.get(f"http://127.0.0.1:{port}/v1/commands/{cid}", timeout=5,
                       headers={"Authorization": f"Bearer {TOKEN}"}).json()
    assert (cmd["action"], cmd["leave_s"]) == ("checkpoint-restart", 60)
    record = json.loads((tmp / "ctl.jsonl").read_text().splitlines()[-1])
    assert (record["action"], record["leave_s"], record["source"]) == ("evict-node", 60, "cli")


class _Forger:
    """A scrape target that is no agent: it exports `metrics` (a rank of run "job"
    under a node name), and keeps the Authorization header of every other request it is
    sent (a token the clients should never send it)."""

    def __init__(self, metrics: str) -> None:
        import http.server
        import threading

        self.sent: list[str] = []
        forger = self

        class Handler(http.server.BaseHTTPRequestHandler):
            def _answer(self) -> None:
                if self.path.startswith("/metrics"):
                    body = metrics.encode()
                else:
                    forger.sent.append(self.headers.get("Authorization", ""))
                    body = b"{}"
                self.send_response(200)
                self.send_header("Content-Length", str(len(body)))
                self.end_headers()
                self.wfile.write(body)

            do_GET = do_POST = _answer

            def log_message(self, *args) -> None:
                pass

        self.server = http.server.ThreadingHTTPServer(("127.0.0.1", 0), Handler)
        self.address = f"127.0.0.1:{self.server.server_address[1]}"
        threading.Thread(target=self.server.serve_forever, daemon=True).start()

    def stop(self) -> None:
        self.server.shutdown()
        self.server.server_close()


def test_a_nodes_own_token_goes_only_to_the_agent_its_scrape_target_names(tmp_path):
    """Per-node tokens keep a token taken from one node from opening another's control
    API. A node's name is what its agent exports; an agent whose `--node` says node-v
    (its configuration changed on host node-x) was sent node-v's token, and one that
    says node-r could be asked in node-r's place. The token goes now only to the agent
    whose scrape target (the operator's configuration: `node`, or `k8s_node` from the
    pod, or `target_node`) names that node, read from `up` of the agents' jobs, where a
    target's own `up` series or a relabelling within the lookback make it name none, and
    a target of another job is no agent however it is labelled."""
    tokens = {n: f"{n}-token-0123456789abcdef" for n in ("node-r", "node-u", "node-v",
                                                          "node-w", "node-x")}
    agents, ranks = [], []
    targets: dict[str, dict[str, str]] = {}
    # the honest node-r, an agent calling itself node-v on host node-x, and one calling
    # itself node-r on host node-y: each holds its own host's token only
    for says, host in [("node-r", "node-r"), ("node-v", "node-x"), ("node-r", "node-y")]:
        home = tmp_path / host
        home.mkdir()
        (home / "token").write_text(tokens.get(host, f"{host}-token-0123456789abcdef"))
        proc, port, telemetry = start_agent_cli(home, says, gpus=1,
                                                token_file=home / "token")
        agents.append(proc)
        # each of the ways a target names its node (TARGET_NODE_LABELS)
        targets[f"127.0.0.1:{port}"] = {{"node-r": "node", "node-x": "k8s_node"}.get(
            host, "target_node"): host}
        ranks.append(RankProcess(telemetry[len("unix:"):], [{
            "type": "step", "run": "job", "rank": len(ranks), "local_rank": 0, "gpu": 0,
            "step": 3}]))
    honest, impostor, twin = targets
    rank_info = ('clusterpulse_trainer_rank_info{{run="job",rank="{}",node="{}",'
                 'local_rank="0",gpu="0",pid="1",world_size="5"}} 1\n')
    # in the agents' job, with an `up` of its own that names node-w; and an application
    # in a job of its own, its target labelled with its node (node-u) by the operator
    forger = _Forger(rank_info.format(3, "node-w") + 'up{k8s_node="node-w"} 1\n')
    targets[forger.address] = {"target_node": "node-z"}
    app = _Forger(rank_info.format(4, "node-u"))
    targets[app.address] = {"job": "apps", "node": "node-u"}
    prom = Prometheus(tmp_path, list(targets), labels=targets)
    try:
        wait_until(lambda: len(prom.query('clusterpulse_trainer_rank_info{run="job"}')) == 5,
                   30, "five ranks scraped")
        table = "".join(f"{node} {tok}\n" for node, tok in tokens.items())
        audit = AuditLog(tmp_path / "audit.jsonl")
        client = PrometheusClient(prom.url)
        # the policy acts on nothing while a node's agent is in doubt
        with pytest.raises(ActionError, match=r"cannot tell who runs 'job'.*node-v: not sent"):
            request_action(client, "job", "checkpoint-restart", "t", "policy", table, audit,
                           one_owner=True)
        r, v, w = request_action(client, "job", "checkpoint-restart", "t", "ops", table, audit)
        assert (r.node, r.ok, r.agent) == ("node-r", True, f"http://{honest}"), r
        assert (v.node, v.ok) == ("node-v", False), v
        assert "not sent" in v.error and "k8s_node=node-x" in v.error, v.error
        assert (w.node, w.ok) == ("node-w", False) and "more than one set" in w.error, w
        # no impostor was presented any token: no failed authentication there, and the
        # forger of `up` was sent nothing at all
        for host in ("node-x", "node-y"):
            log = tmp_path / host / "node-v-audit.jsonl" if host == "node-x" \
                else tmp_path / host / "node-r-audit.jsonl"
            assert not log.exists() or all(
                rec.get("who") != "unauthenticated" for rec in AuditLog(log).read()), host
        assert forger.sent == [] and app.sent == [], (forger.sent, app.sent)
        (rec,) = AuditLog(tmp_path / "audit.jsonl").read()[-1:]
        assert rec["outcome"] == "partial" and "not sent" in rec["nodes"]["node-v"], rec
        # following the request sends each agent only the token it was sent with: a token
        # file changed since (node-r's token rotated) was never checked against it
        (same,) = command_states([r], table)
        assert same.state and not same.error, same
        rotated = table.replace(tokens["node-r"], "node-r-token-rotated-0123456789")
        (held,) = command_states([r], rotated)
        assert held.error.startswith("not followed"), held
        assert all(rec.get("who") != "unauthenticated"
                   for rec in AuditLog(tmp_path / "node-r" / "node-r-audit.jsonl").read())
        # whatever the tokens, node-r is the agent its target names, never the twin
        # that also says node-r (two agents under one name: one was dropped at random)
        for token in (None, tokens["node-r"], table):
            found = run_agents(client, "job", token)
            assert found.urls.get("node-r") == f"http://{honest}", (token, found)
        assert twin not in str(found) and impostor not in str(found.urls), found
        # node-r's address is relabelled node-q: within the lookback it names no node
        # (before, its labels were merged, and either the old one vouched for node-r
        # there for 2 minutes or the new one for node-q)
        config = prom.dir / "prometheus.yml"
        config.write_text(config.read_text().replace('{"node": "node-r"}',
                                                     '{"node": "node-q"}'))
        requests.post(f"{prom.url}/-/reload", timeout=10).raise_for_status()
        wait_until(lambda: prom.query('up{node="node-q"}'), 30, "the relabelled target")
        found = run_agents(client, "job", table, lookback="2m")
        assert "node-r" not in found.urls and "node-q" not in found.urls, found
        assert "more than one set" in found.refused["node-q"], found
    finally:
        for rank in ranks:
            rank.stop()
        prom.stop()
        forger.stop()
        app.stop()
        for proc in agents:
            proc.stop()
