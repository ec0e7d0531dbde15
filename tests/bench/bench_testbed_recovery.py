"""Recovery on the multi-node testbed (root: network namespaces): a 4-node job, one
rank per node under clusterpulse-train with an agent on every node, through one
graceful checkpoint-restart and one rank crash (SIGKILL), with the same job without
faults in the same invocation as the baseline.

    python -m tests.bench.bench_testbed_recovery      # or: make bench-testbed

Reports, from the trainer's run summary: time from the graceful request and from the
crash to the first resumed step, steps recomputed, and the faulted run's wall time
against the fault-free one. Then an elastic job (3..4 nodes) whose node3 gets a slow
link (4 Mbit/s) that stays, under a policy that evicts such a node: step time before,
on the slow link and with node3 out, and how long the eviction took (the action to
the job stepping on three nodes).
"""

from __future__ import annotations

import argparse
import sys
import tempfile
import time
from pathlib import Path

from deploy.testbed import Testbed, missing_privileges
from deploy.testbed.cluster import TestbedCluster
from deploy.testbed.faults import TAKEN, live_ranks
from tests.bench.table import Row, render
from tests.support.procs import wait_until

NODES = 4
STEPS = 120
TRAINER = ["--preset", "tiny", "--steps", str(STEPS), "--global-batch", "8",
           "--ckpt-every", "20", "--sim-compute-seconds", "0.05", "--log-every", "20"]
FAULTS = ["--inject", "graceful:step=40", "--inject", "crash:rank=1:step=90:mode=sigkill:attempt=1"]


def _run(cl: TestbedCluster, run: str, extra: list[str]) -> dict:
    t0 = time.time()
    out = cl.run_job(run, [*TRAINER, *extra])
    out["bench_wall_s"] = time.time() - t0
    return out


def _live_step(cl: TestbedCluster, run: str) -> int:
    r = cl.query(f'max({live_ranks("clusterpulse_trainer_step", run)})')
    return int(float(r[0]["value"][1])) if r else -1


def evict() -> list[Row]:
    """A persistent slow link under an evict-node policy (sustained_s 0, a cooldown
    longer than the measurement): the job checkpoints and goes on without the node."""
    run, slow_node = "evict", NODES - 1
    with tempfile.TemporaryDirectory(prefix="cp-evict-") as tmp:
        policy = Path(tmp) / "policy.toml"
        policy.write_text('[[rule]]\nalert = "TrainingLinkCongested"\naction = "evict-node"\n'
                          "[evict]\nleave_s = 600\n")
        with Testbed(nodes=NODES) as bed, TestbedCluster(bed, Path(tmp), policy=policy) as cl:
            batch = NODES * (NODES - 1)  # a step's 100 ms on 4 nodes, per sequence (chaos.py)
            cl.start_job(run, ["--preset", "tiny", "--steps", "100000", "--global-batch",
                               str(batch), "--ckpt-every", "50", "--async-ckpt",
                               "--sim-sample-seconds", f"{0.1 * NODES / batch:.6f}"],
                         min_nodes=NODES - 1, max_restarts=20)
            wait_until(lambda: _live_step(cl, run) > 100, 300, "the job past step 100")
            before = cl.step_seconds(run, 10)
            node = bed.nodes[slow_node]
            bed.slow_link(node, rate="4mbit", burst="32kb", latency="500ms")
            t0 = time.monotonic()
            wait_until(lambda: cl.alerts("TrainingLinkCongested"), 300, "TrainingLinkCongested")
            on_slow = cl.step_seconds(run, time.monotonic() - t0 - 3)
            act = wait_until(lambda: [r for r in cl.audit() if r.get("action") == "evict-node"
                                      and r.get("source") == "remediation"
                                      and r.get("outcome") in TAKEN], 300, "the eviction")[0]
            at_action = _live_step(cl, run)
            others = sorted(n.name for n in bed.nodes if n is not node)
            wait_until(lambda: cl.job_nodes(run) == others and _live_step(cl, run) > at_action,
                  300, "the job stepping without the node")
            took = time.time() - act["ts"]
            time.sleep(15)
            without = cl.step_seconds(run, 12)
    name = f"testbed {NODES} nodes, slow link that stays (4 Mbit/s)"
    return [
        Row(f"{name}: step time on the slow link", on_slow * 1e3, "ms", baseline=before * 1e3,
            baseline_name="before the fault"),
        Row(f"{name}: step time with the node evicted", without * 1e3, "ms",
            baseline=on_slow * 1e3, baseline_name="on the slow link"),
        Row(f"{name}: step time with the node evicted, {NODES - 1} nodes", without * 1e3, "ms",
            baseline=before * 1e3, baseline_name=f"{NODES} nodes before the fault"),
        Row(f"{name}: evict-node action -> job stepping without it", took, "s"),
    ]


def run() -> list[Row]:
    reason = missing_privileges()
    if reason:
        raise RuntimeError(reason)
    with tempfile.TemporaryDirectory(prefix="cp-recovery-") as tmp, \
            Testbed(nodes=NODES) as bed, TestbedCluster(bed, Path(tmp)) as cl:
        clean = _run(cl, "clean", [])
        faulted = _run(cl, "faulted", FAULTS)
    graceful, crash = faulted["restarts"]
    assert graceful["cause"] == "checkpoint-restart" and crash["cause"] == "failure", \
        faulted["restarts"]
    assert faulted["param_sha256"] == clean["param_sha256"], "resumed run diverged"
    return [
        Row(f"testbed {NODES} nodes: graceful request -> first resumed step (relaunch)",
            graceful["downtime_seconds"], "s"),
        Row(f"testbed {NODES} nodes: graceful: steps recomputed", graceful["steps_recomputed"],
            "steps", budget="0"),
        Row(f"testbed {NODES} nodes: crash (SIGKILL) -> first resumed step",
            crash["downtime_seconds"], "s"),
        Row(f"testbed {NODES} nodes: crash: steps recomputed (checkpoint every 20)",
            crash["steps_recomputed"], "steps", budget="<= 20"),
        Row(f"testbed {NODES} nodes: job wall time, one graceful + one crash",
            faulted["bench_wall_s"], "s", baseline=clean["bench_wall_s"],
            baseline_name="same job without faults"),
        *evict(),
    ]


def main() -> int:
    argparse.ArgumentParser(description=__doc__, epilog="example: sudo make bench-testbed",
                            formatter_class=argparse.RawDescriptionHelpFormatter).parse_args()
    print(render(run()))
    return 0


if __name__ == "__main__":
    sys.exit(main())
