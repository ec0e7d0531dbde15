"""Recovery on the multi-node testbed (root: network namespaces): a 4-node job, one
rank per node under clusterpulse-train with an agent on every node, through one
graceful checkpoint-restart and one rank crash (SIGKILL), with the same job without
faults in the same invocation as the baseline.

    python -m tests.bench.bench_testbed_recovery      # or: make bench-testbed

Reports, from the trainer's run summary: time from the graceful request and from the
crash to the first resumed step, steps recomputed, and the faulted run's wall time
against the fault-free one.
"""

from __future__ import annotations

import argparse
import sys
import tempfile
import time
from pathlib import Path

from deploy.testbed import Testbed, missing_privileges
from deploy.testbed.cluster import TestbedCluster
from tests.bench.table import Row, render

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
    ]


def main() -> int:
    argparse.ArgumentParser(description=__doc__, epilog="example: sudo make bench-testbed",
                            formatter_class=argparse.RawDescriptionHelpFormatter).parse_args()
    print(render(run()))
    return 0


if __name__ == "__main__":
    sys.exit(main())
