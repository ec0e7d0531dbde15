"""The remediation takes a node whose link holds the job back out of an elastic job
and lets it back in: real testbed nodes, the real stack (Prometheus, Alertmanager,
the remediation receiver with an evict-node policy), clusterpulse-train on each node.

A persistent slow link (tbf, 4 Mbit/s) on node2 slows every rank; TrainingLinkCongested
fires for node2; the policy asks node2's agent alone for a graceful restart that node2
sits out; the job checkpoints and goes on, on node0 and node1, at its pace without the
slow link (the link is still slow); after the sit-out node2's launcher starts again
and the job takes it back.
"""

from __future__ import annotations

import time
from collections.abc import Iterator

import pytest

from deploy.testbed import Testbed
from deploy.testbed.cluster import TestbedCluster
from deploy.testbed.faults import live_ranks
from tests.support.procs import wait_until

pytestmark = [pytest.mark.cluster, pytest.mark.slow]

RUN = "ev"
LEAVE_S = 30
TRAINER = ["--preset", "tiny", "--steps", "100000", "--global-batch", "6", "--ckpt-every", "20",
           "--sim-sample-seconds", "0.025", "--log-every", "50"]
POLICY = f"""
[[rule]]
alert = "TrainingLinkCongested"
action = "evict-node"

[evict]
leave_s = {LEAVE_S}
"""


@pytest.fixture(scope="module")
def cl(tmp_path_factory) -> Iterator[TestbedCluster]:
    state = tmp_path_factory.mktemp("evict")
    policy = state / "policy.toml"
    policy.write_text(POLICY)
    with Testbed(nodes=3) as bed, TestbedCluster(bed, state, scrape_interval="1s",
                                                 policy=policy) as c:
        c.start_job(RUN, TRAINER, min_nodes=2)
        wait_until(lambda: len(c.query(f'clusterpulse_trainer_step{{run="{RUN}"}} > 5')) == 3,
                   300, "3 ranks stepping")
        yield c


def test_a_node_with_a_slow_link_sits_out_and_rejoins(cl):
    slow = cl.bed.nodes[2]  # node0 hosts the rendezvous store: it would stay
    log = cl.state / f"{RUN}-{slow.name}.log"
    before = cl.step_seconds(RUN, 8)
    cl.bed.slow_link(slow, rate="4mbit", burst="32kb", latency="500ms")
    try:
        t0 = time.monotonic()
        wait_until(lambda: cl.alerts("TrainingLinkCongested"), 180, "TrainingLinkCongested")
        on_slow_link = cl.step_seconds(RUN, time.monotonic() - t0 - 3)
        wait_until(lambda: "leaving the job for 30 s" in log.read_text(errors="replace"), 180,
                   f"{slow.name}'s launcher to leave the job")
        left = time.monotonic()
        (act,) = [r for r in cl.audit() if r.get("source") == "remediation"]
        assert (act["action"], act["outcome"], act["leave_s"]) == (
            "evict-node", "accepted", LEAVE_S)
        assert list(act["nodes"]) == [slow.name]  # only the slow node's agent was asked
        # the job goes on without node2, whose link is still slow
        wait_until(lambda: cl.job_nodes(RUN) == ["node0", "node1"], 120, "the job on 2 nodes")
        time.sleep(12)  # steps of the job on 2 nodes to average
        without = cl.step_seconds(RUN, 10)
    finally:
        cl.bed.fix_link(slow)
    assert on_slow_link > 3 * before, (on_slow_link, before)
    assert without < on_slow_link / 3, f"step {without:.3f}s without node2 vs " \
        f"{on_slow_link:.3f}s with its slow link ({before:.3f}s before)"
    # after the sit-out node2 starts again and the job takes it back
    wait_until(lambda: cl.job_nodes(RUN) == ["node0", "node1", "node2"], LEAVE_S + 180,
               "node2 back in the job")
    assert time.monotonic() - left >= LEAVE_S  # it sat out the whole time
    wait_until(lambda: len(cl.query(f'{live_ranks("clusterpulse_trainer_step", RUN)} > 0')) == 3,
               120, "3 live ranks stepping")
    # node2's agent saw its ranks leave and come back: the command is carried out
    cmd = act["nodes"][slow.name]
    wait_until(lambda: cl.agent_command(slow, cmd)["state"] == "completed", 120,
               f"command {cmd} completed")
