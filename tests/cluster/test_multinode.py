"""A real multi-node job on the testbed, watched by the real stack, under real faults.

One testbed (3 nodes, one rank each, elastic 2..3 nodes) and one job serve the whole
module, in order: the job spans the nodes over the bridge; a link slowed on its far
side slows its steps and is named; a partition is detected and heals without duplicate
ranks; a link that drops packets is named; a node dies, NodeAgentDown fires within
two scrapes (within 15 s of its last answer where that came late, as on a loaded
machine), and the job restarts on the two remaining nodes from its last checkpoint;
teardown leaves nothing. Detection is judged from Prometheus's own sample timestamps,
not from the wall clock of a loaded machine.
"""

from __future__ import annotations

import re
import shutil
import time
from collections.abc import Iterator
from pathlib import Path

import pytest
import yaml

from clusterpulse.trainer.checkpoint import find_latest_valid
from deploy.testbed import Testbed, net
from deploy.testbed.cluster import TestbedCluster
from tests.support.procs import REPO, wait_until

pytestmark = [pytest.mark.cluster, pytest.mark.slow]

RUN = "mn"
TRAINER = ["--preset", "tiny", "--steps", "100000", "--global-batch", "6", "--ckpt-every", "20",
           "--sim-compute-seconds", "0.05", "--log-every", "50"]


@pytest.fixture(scope="module")
def cl(tmp_path_factory) -> Iterator[TestbedCluster]:
    state = tmp_path_factory.mktemp("multinode")
    with Testbed(nodes=3) as bed, TestbedCluster(bed, state, scrape_interval="1s") as c:
        c.start_job(RUN, TRAINER, min_nodes=2)
        wait_until(lambda: len(c.query(f'clusterpulse_trainer_step{{run="{RUN}"}} > 5')) == 3,
                   300, "3 ranks stepping")
        yield c


def max_step(cl: TestbedCluster) -> int:
    r = cl.query(f'max(clusterpulse_trainer_step{{run="{RUN}"}})')
    return int(float(r[0]["value"][1])) if r else -1


def holders_by_rank(cl: TestbedCluster) -> dict[int, int]:
    """Rank -> how many live processes report it (process_alive 1; a missing series is
    not live, unlike deploy/testbed/faults.live_ranks): an exited process's entry stays
    on its agent, process_alive 0, for its grace."""
    held = cl.query(f'count by (rank) (clusterpulse_trainer_rank_info{{run="{RUN}"}} and on '
                    f'(run, rank, node, local_rank) clusterpulse_trainer_process_alive == 1)')
    return {int(s["metric"]["rank"]): int(s["value"][1]) for s in held}


def test_ranks_span_the_nodes_over_the_bridge(cl):
    nodes = {s["metric"]["node"]: s["metric"]["instance"]
             for s in cl.query(f'clusterpulse_trainer_rank_info{{run="{RUN}"}}')}
    assert nodes == {n.name: cl.agent_target(n) for n in cl.bed.nodes}
    ips = {n.ip for n in cl.bed.nodes}
    for node in cl.bed.nodes:  # every TCP connection of the job's processes: node IPs only
        pids = cl.bed.find(node, "-m", RUN) + cl.rank_pids(node, RUN)  # launchers, ranks
        out = node.run(["ss", "-Htnp"]).stdout
        peers = {m.group(1) for line in out.splitlines()
                 if any(f"pid={p}," in line for p in pids)
                 for m in [re.search(r"\s(?:\[::ffff:)?([\d.]+)\]?:\d+\s+users", line)] if m}
        assert peers and peers <= ips, f"{node.name}: job connections to {peers}"
        assert peers - {node.ip}, f"{node.name} talks to no other node"


def comm_bandwidth(cl: TestbedCluster, window_s: float) -> float:
    r = cl.query(f'avg_over_time(clusterpulse:run_comm_bandwidth_bytes_per_second'
                 f'{{run="{RUN}"}}[{max(2, int(window_s))}s])')
    return float(r[0]["value"][1])


def alert_for_seconds(name: str) -> dict[str, float]:
    """Each severity of alert `name` -> its `for:` in seconds, from the rule file."""
    rules = yaml.safe_load((REPO / "deploy/prometheus/alerts.rules.yml").read_text())
    units = {"s": 1, "m": 60, "h": 3600}
    return {r["labels"]["severity"]: float(r.get("for", "0s")[:-1]) * units[r.get("for", "0s")[-1]]
            for g in rules["groups"] for r in g["rules"] if r.get("alert") == name}


def runs_after(series: list[dict], t0: float, label: str | None = None) -> dict:
    """A range query's samples as runs of consecutive evaluations, in whole seconds
    after `t0`: {label value (or ""): ["from-to", ...]}. Gaps of more than 2 s split."""
    out: dict[str, list[str]] = {}
    for s in series:
        times = [round(float(t) - t0) for t, _ in s["values"]]
        runs: list[list[int]] = []
        for t in times:
            if runs and t - runs[-1][1] <= 2:
                runs[-1][1] = t
            else:
                runs.append([t, t])
        out[s["metric"].get(label, "") if label else ""] = [f"{a}-{b}" for a, b in runs]
    return out


def test_a_link_slowed_on_its_far_side_slows_the_job_and_is_named(cl):
    """tbf on the bridge side of one node's link (4 Mbit/s): what reaches the node is
    slow, as behind a slow switch port or a peer's egress, and no agent's queue holds
    anything back (issue #27: no alert named the node in 150 s). Every rank's step slows
    (ranks wait for the gradients that cross the slow link, so no rank is a straggler)
    and the run's all-reduce bus bandwidth falls with it. The ranks' TCP connections see
    it: every connection of that node waits in the slow queue, its data or its
    acknowledgements, and TrainingLinkCongested names that node alone (cause
    communication) within 60 s of the shaping, from Prometheus's own timestamps. Its
    agent answers late, not never: no NodeAgentDown; and no rank, its GPU idle while it
    waits, is a slow_clocks straggler. The node's own egress queue: test_evict.py."""
    start = max_step(cl)
    wait_until(lambda: max_step(cl) >= start + 20, 120, "20 normal steps")
    before, bw_before = cl.step_seconds(RUN, 8), comm_bandwidth(cl, 8)
    node = cl.bed.nodes[1]
    shaped_at = time.time()
    cl.bed.slow_link(node, rate="4mbit", burst="32kb", latency="500ms", side="ingress")
    s0 = max_step(cl)
    try:
        # the step and bandwidth gauges hold the last step's figures: until a step wholly
        # over the slow link is done they still read the fast ones. A window from the
        # shaping held enough of those on a loaded machine, where scrapes lag, to read
        # 4.3e7 B/s against 7.0e7 before (a third is asserted). Measured from here on.
        wait_until(lambda: max_step(cl) >= s0 + 3, 180, "3 steps over the slow link")
        slow_since = time.monotonic()
        wait_until(lambda: max_step(cl) >= s0 + 6, 180, "6 steps over the slow link")
        first = wait_until(lambda: cl.alerts("TrainingLinkCongested"), 180,
                           "TrainingLinkCongested")
        fors = alert_for_seconds("TrainingLinkCongested")
        time.sleep(5)  # the other severity, a wrong node: one more evaluation to show
        alerts = cl.alerts("TrainingLinkCongested")
        during = cl.step_seconds(RUN, time.monotonic() - slow_since)
        bw_during = comm_bandwidth(cl, time.monotonic() - slow_since)
        # the link is still slow: a page that resolves now would page again (a young
        # run's usual pace catching up ended the critical before the warning fired)
        assert alerts, f"{[a['labels'] for a in first]} fired, and 5 s later nothing"
        named = {(a["labels"]["node"], a["labels"]["cause"]) for a in alerts}
        firing_after = {a["labels"]["severity"]: round(
            _ts(a["activeAt"]) + fors[a["labels"]["severity"]] - shaped_at) for a in alerts}
        named_after = min(firing_after.values())
        window = f"[{int(time.time() - shaped_at) + 1}s]"
        down = cl.query(f'ALERTS{{alertname="NodeAgentDown",alertstate="firing"}}{window}')
        stragglers = cl.query(f'ALERTS{{alertname="TrainingStraggler"}}{window}')
        up = f'up{{instance="{cl.agent_target(node)}"}}{window}'
        failed = cl.query(f"count_over_time({up}) - sum_over_time({up})")
        rtt = {s["metric"]["node"]: float(s["value"][1])
               for s in cl.query("clusterpulse:node_tcp_rtt_seconds")}
        # when the evidence held, and when each severity's `for` started (again): a late
        # naming tells a late first sign from a clock restarted by a gap
        evidence = runs_after(cl.query(
            f'clusterpulse:node_link_rtt_seconds{{node="{node.name}"}}{window}'), shaped_at)
        pending = runs_after(cl.query(
            f'ALERTS{{alertname="TrainingLinkCongested",alertstate="pending"}}{window}'),
            shaped_at, "severity")
    finally:
        cl.bed.fix_link(node)
    print(f"far-side slow link: step {during:.3f} s vs {before:.3f} s before, all-reduce "
          f"{bw_during:.3g} B/s vs {bw_before:.3g}; named after {named_after:.0f} s (by "
          f"severity, from the shaping: {firing_after}); link RTT by node {rtt}; "
          f"{failed[0]['value'][1] if failed else 0} failed scrapes of its agent; "
          f"straggler alerts: {[s['metric'] for s in stragglers]}; seconds after the shaping "
          f"(from-to) of the RTT evidence {evidence}, of the pending alert {pending}")
    assert during > 3 * before, f"step {during:.3f}s on the slow link vs {before:.3f}s before"
    assert bw_during < bw_before / 3, f"all-reduce {bw_during:.3g} B/s vs {bw_before:.3g} before"
    assert named == {(node.name, "communication")}, named
    assert named_after <= 60, f"named {named_after:.0f} s after the shaping"
    assert down == [], [s["metric"] for s in down]
    assert [s for s in stragglers if s["metric"].get("cause") == "slow_clocks"] == [], \
        [s["metric"] for s in stragglers]


def late_window_seconds() -> float:
    """How long after its last answer NodeAgentDown spares an agent that answered late
    (the `max_over_time(up[...])` of clusterpulse:target_answers_late)."""
    rules = yaml.safe_load((REPO / "deploy/prometheus/alerts.rules.yml").read_text())
    (expr,) = [r["expr"] for g in rules["groups"] for r in g["rules"]
               if r.get("record") == "clusterpulse:target_answers_late"]
    return float(re.search(r"max_over_time\(up\{[^}]*\}\[(\d+)s\]\)", expr).group(1))


def paged_promptly(cl: TestbedCluster, target: str, alert: dict) -> str:
    """Asserts NodeAgentDown for `target` went pending at its first failed scrape in a
    row (the second at most: an evaluation may lag) or, where the rule held the target's
    last answer for late (behind a slow link, or on a loaded machine: answers of 0.5-1 s
    against the testbed's 1 s timeout), once that answer was the late window old (5 s
    more at most: evaluations lag on a loaded machine), not a minute later as the first
    late-agent rule did, which left a partition unpaged for 60 s in CI. From
    Prometheus's own timestamps. Returns what it saw."""
    active = _ts(alert["activeAt"])
    samples = cl.query(f'up{{instance="{target}"}}[3m]')[0]["values"]
    last_ok = max(t for t, v in samples if v == "1" and t <= active)
    failed = [t for t, v in samples if v == "0" and last_ok < t <= active]
    late = cl.query(f'clusterpulse:target_answers_late{{instance="{target}"}}[3m]')
    late = bool(late) and any(t > last_ok for t, _ in late[0]["values"])
    seen = (f"pending {active - last_ok:.0f} s after the last answer, at failed scrape "
            f"{len(failed)}, {'late' if late else 'not late'}")
    if late:
        assert failed and active - last_ok <= late_window_seconds() + 5, seen
    else:
        assert 1 <= len(failed) <= 2, seen
    return seen


def test_partition_is_detected_and_heals_without_duplicate_ranks(cl):
    node = cl.bed.nodes[1]
    cl.bed.partition(node)
    try:
        alert = wait_until(lambda: [a for a in cl.alerts("NodeAgentDown")
                                    if a["labels"]["node"] == node.name], 60, "NodeAgentDown")[0]
    finally:
        cl.bed.heal(node)
    print(f"partition: NodeAgentDown {paged_promptly(cl, cl.agent_target(node), alert)}")
    stalled = max_step(cl)
    wait_until(lambda: not cl.alerts("NodeAgentDown"), 90, "NodeAgentDown resolved")
    wait_until(lambda: max_step(cl) >= stalled + 10, 240, "training resumed after the heal")
    # A partition can restart the job (a peer's gloo connection failed: "No route to
    # host"; elastic 2..3): on two nodes, renumbered (CI, 2026-12-07: rank 1 counted
    # twice, a departed entry), then on three once the healed node rejoins. Every poll:
    # no rank held by two live processes; the end: each of the three ranks by one.
    deadline = time.monotonic() + 240
    while (held := holders_by_rank(cl)) != {0: 1, 1: 1, 2: 1}:
        assert all(n == 1 for n in held.values()), f"a rank held twice: {held}"
        assert time.monotonic() < deadline, f"live holders by rank: {held}"
        time.sleep(1)
    # a departed process's entry stays on its node's agent for its grace (its number
    # may be another node's now), marked as such (polled: one failed scrape of the
    # progress path, or an entry expiring, leaves a rank_info without it for a second)
    unmarked = f'clusterpulse_trainer_rank_info{{run="{RUN}"}} unless on (run, rank, node, ' \
               f'local_rank) clusterpulse_trainer_process_alive'
    try:
        wait_until(lambda: not cl.query(unmarked), 30, "every rank entry marked live or not")
    except AssertionError as err:
        raise AssertionError(f"{err}: {[s['metric'] for s in cl.query(unmarked)]}") from None
    departed = cl.query(f'clusterpulse_trainer_process_alive{{run="{RUN}"}} == 0')
    print(f"partition: departed entries after the heal {[s['metric'] for s in departed]}")


def alert_runs(series: list[dict], t0: float) -> dict:
    """An ALERTS range query as {"node/alertstate/severity": runs_after's runs}."""
    return {"/".join(s["metric"].get(k, "-") for k in ("node", "alertstate", "severity")):
            runs_after([s], t0)[""] for s in series}


def per_path(series: list[dict], pick, digits: int) -> dict:
    """(node, peer) -> `pick` of a range query's values, rounded."""
    return {(s["metric"]["node"], s["metric"]["peer"]):
            round(pick(float(v) for _, v in s["values"]), digits) for s in series}


def test_a_link_that_drops_packets_is_named_by_its_retransmissions(cl):
    """Random loss (3 %, iptables) on one node's link, both ways, as a policer or a bad
    cable: nothing queues, so the RTT barely moves; the ranks' connections retransmit
    (issue #27 item 5). What the node sends is lost in its own connections (side "sent",
    from its agent), what reaches it in its peers' connections to it (side "received",
    from theirs); every healthy node also talks to a peer over a clean path, so neither
    side of it moves. TrainingLinkCongested names that node alone within 60 s, from
    Prometheus's timestamps; no NodeAgentDown, no slow_clocks straggler. Both sides in
    one phase, for the suite's time: the healthy nodes read the same with one side
    dropping as with both, so each side's first evaluation past the 1 % floor plus the
    alert's `for` is when that side alone names the node, asserted within 60 s too."""
    if shutil.which("iptables") is None:
        pytest.skip("iptables is needed to drop packets")
    wait_until(lambda: not cl.alerts("TrainingLinkCongested")
               and not cl.alerts("TrainingLinkCongested", state="pending"), 120,
               "no TrainingLinkCongested before the loss")
    start = max_step(cl)
    wait_until(lambda: max_step(cl) >= start + 10, 120, "10 steps before the loss")
    node = cl.bed.nodes[1]
    dropped_at = time.time()
    cl.bed.drop_packets(node, 0.03, side="both")
    try:
        alerts = wait_until(lambda: cl.alerts("TrainingLinkCongested"), 90,
                            "TrainingLinkCongested")
        fors = alert_for_seconds("TrainingLinkCongested")
        time.sleep(3)  # a wrong node, the other severity: one more evaluation to show
        alerts = cl.alerts("TrainingLinkCongested")
        window = f"[{int(time.time() - dropped_at) + 1}s]"
        ratios = cl.query(f"clusterpulse:node_tcp_loss_ratio{window}")
        paths = cl.query(f"clusterpulse:tcp_peer_loss_ratio{window}")
        pending = cl.query(f'ALERTS{{alertname="TrainingLinkCongested"}}{window}')
        sends = cl.query("sum by (node, peer) (rate(clusterpulse_tcp_peer_data_segments_sent_total"
                         f"[30s])){window[:-1]}:1s]")
        rtt = {s["metric"]["node"]: float(s["value"][1])
               for s in cl.query("clusterpulse:node_tcp_rtt_seconds")}
        down = cl.query(f'ALERTS{{alertname="NodeAgentDown",alertstate="firing"}}{window}')
        stragglers = cl.query(f'ALERTS{{alertname="TrainingStraggler"}}{window}')
    finally:
        cl.bed.fix_drops(node)
    named = {(a["labels"]["node"], a["labels"]["cause"]) for a in alerts}
    firing_after = {a["labels"]["severity"]: round(
        _ts(a["activeAt"]) + fors[a["labels"]["severity"]] - dropped_at) for a in alerts}
    evidence = {a["annotations"]["summary"].partition(": ")[2].split(" while ")[0]
                for a in alerts}
    # each side of each node: its peak ratio, and when the lossy node's first passed 1 %
    peak = {(s["metric"]["node"], s["metric"]["side"]): max(float(v) for _, v in s["values"])
            for s in ratios}
    first = {s["metric"]["side"]: min(float(t) for t, v in s["values"] if float(v) >= 0.01)
             - dropped_at for s in ratios if s["metric"]["node"] == node.name
             and any(float(v) >= 0.01 for _, v in s["values"])}
    alone = {side: round(t + fors["warning"]) for side, t in first.items()}
    print(f"lossy link (3 % both ways) named after {min(firing_after.values())} s "
          f"(by severity: {firing_after}, evidence {evidence}); each side alone would name "
          f"it after {alone} s; peak loss ratio by node and side "
          f"{ {k: round(v, 4) for k, v in sorted(peak.items())} }; link RTT by node {rtt}")
    # per path: its peak ratio, and the fewest segments/s it sent (a path under the rule's
    # 5/s is left out of its node's sides)
    print(f"paths (node, peer): peak loss ratio {per_path(paths, max, 4)}; "
          f"least segments/s {per_path(sends, min, 0)}; TrainingLinkCongested by labels, "
          f"seconds after the drop (from-to) {alert_runs(pending, dropped_at)}")
    assert named == {(node.name, "communication")}, named
    assert min(firing_after.values()) <= 60, firing_after
    assert set(alone) == {"sent", "received"} and max(alone.values()) <= 60, alone
    healthy = {k: v for k, v in peak.items() if k[0] != node.name}
    assert healthy and max(healthy.values()) < 0.002, healthy  # 5x under the floor
    assert down == [], [s["metric"] for s in down]
    assert [s for s in stragglers if s["metric"].get("cause") == "slow_clocks"] == [], \
        [s["metric"] for s in stragglers]


def test_node_death_alerts_within_two_scrapes_and_job_restarts_on_the_rest(cl):
    dead = cl.bed.nodes[2]  # node0 hosts the rendezvous and survives
    target = cl.agent_target(dead)
    wait_until(lambda: (find_latest_valid(ckpt(cl)) or 0) and
               find_latest_valid(ckpt(cl)).step > 0, 120, "a committed checkpoint")
    cl.kill_node(dead)
    at_kill = find_latest_valid(ckpt(cl)).step
    # the step gauge is Prometheus's last scrape: under load it read 78 beside a
    # committed checkpoint of step 80, which the job had reached
    reached = max(max_step(cl), at_kill)
    alert = wait_until(lambda: [a for a in cl.alerts("NodeAgentDown")
                                if a["labels"]["node"] == dead.name], 60, "NodeAgentDown")[0]
    print(f"node death: NodeAgentDown {paged_promptly(cl, target, alert)}")
    # the job restarts on node0 and node1, from the last checkpoint
    log = cl.state / f"{RUN}-{cl.bed.nodes[0].name}.log"
    before = log.read_text(errors="replace").count("trainer: resumed from")
    wait_until(lambda: log.read_text(errors="replace").count("trainer: resumed from") > before,
               300, "the job's restart")
    resumed = int(re.findall(r"trainer: resumed from \S+ \(step (\d+)",
                             log.read_text(errors="replace"))[-1])
    assert at_kill <= resumed <= reached, (at_kill, resumed, reached)
    wait_until(lambda: max_step(cl) > resumed + 10, 240, "steps after the restart")
    live = f'clusterpulse_trainer_rank_info{{run="{RUN}"}} and on (run, rank, node, ' \
           f'local_rank) clusterpulse_trainer_process_alive == 1'
    # polled: one failed scrape of a node's progress path hides its ranks for a second
    wait_until(lambda: sorted((s["metric"]["node"], s["metric"]["rank"])
                              for s in cl.query(live)) in (
                   [("node0", "0"), ("node1", "1")], [("node0", "1"), ("node1", "0")]),
               30, "ranks 0 and 1 live on node0 and node1, nowhere else")


def ckpt(cl: TestbedCluster) -> Path:
    return cl.jobs[RUN].ckpt_dir


def _ts(rfc3339: str) -> float:
    from datetime import datetime

    return datetime.fromisoformat(rfc3339.replace("Z", "+00:00")).timestamp()


def test_teardown_leaves_nothing(cl):
    prefix, state = cl.bed.prefix, str(cl.state)
    cl.stop()
    cl.bed.close()
    assert [n for n in net.list_netns() if n.startswith(prefix)] == []
    assert [n for n in net.list_links() if n.startswith(prefix)] == []
    assert _procs_mentioning(state) == []


def _procs_mentioning(text: str) -> list[int]:
    out = []
    for p in Path("/proc").iterdir():
        if p.name.isdigit():
            try:
                if text.encode() in (p / "cmdline").read_bytes():
                    out.append(int(p.name))
            except OSError:
                continue
    return out
