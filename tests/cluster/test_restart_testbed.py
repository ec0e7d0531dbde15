"""Restarts of a job that spans real nodes: 2 testbed nodes x 2 ranks under
clusterpulse-train, through a graceful checkpoint-restart (a relaunch: a new
rendezvous across the nodes) and a rank crash (SIGKILL: torchrun restarts in place),
ending bit-exactly where the same job without faults ends. With 4 ranks over 2 nodes
the gradient reduction's order matters, which 2 ranks on one machine cannot show."""

from __future__ import annotations

from collections.abc import Iterator

import pytest

from deploy.testbed import Testbed
from deploy.testbed.cluster import TestbedCluster

pytestmark = [pytest.mark.cluster, pytest.mark.slow]

CKPT_EVERY = 10
TRAINER = ["--preset", "tiny", "--steps", "50", "--global-batch", "8",
           "--ckpt-every", str(CKPT_EVERY), "--sim-compute-seconds", "0.02"]


@pytest.fixture(scope="module")
def cl(tmp_path_factory) -> Iterator[TestbedCluster]:
    with Testbed(nodes=2) as bed, \
            TestbedCluster(bed, tmp_path_factory.mktemp("restart")) as c:
        yield c


def test_graceful_and_crash_restarts_across_nodes_resume_bit_exactly(cl):
    clean = cl.run_job("clean", TRAINER, ranks_per_node=2)
    assert clean["world_size"] == 4 and clean["restarts"] == []
    faulted = cl.run_job("faulted", [
        *TRAINER, "--inject", "graceful:step=17",
        "--inject", "crash:rank=3:step=33:mode=sigkill:attempt=1"], ranks_per_node=2,
        max_restarts=1)
    graceful, crash = faulted["restarts"]
    # the graceful one: agreed at the next consensus step (20), saved there, relaunched
    assert graceful["cause"] == "checkpoint-restart" and graceful["resume_step"] == 20
    assert graceful["steps_recomputed"] == 0
    # the crash: torchrun's one failure restart, from the last checkpoint (30)
    assert crash["cause"] == "failure" and crash["resume_step"] == 30
    assert 0 < crash["steps_recomputed"] <= CKPT_EVERY
    assert faulted["param_sha256"] == clean["param_sha256"]
