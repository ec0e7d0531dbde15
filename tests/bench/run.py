"""Runs every benchmark and prints one table: `make bench` (or python -m tests.bench.run).

Figures are measured, never asserted: the machines are shared and noisy, so a timing
belongs in the docs next to its baseline, not in a pass/fail test.
"""

from __future__ import annotations

import argparse
import importlib
import sys
import time

from tests.bench.table import Row, render

SUITES = ["bench_agent", "bench_trainer", "bench_detection", "bench_dashboard", "bench_resume"]
# Run only when named (`make bench-fleet`): 16,384 GPUs in Prometheus and VictoriaMetrics
# (and an hour of their history for the event records) take minutes and GBs of memory;
# the testbed needs root (`make bench-testbed`); the
# incidents run real jobs for ~15 min (`make bench-incidents`, root for its link trials);
# the GPU figures need a GPU (`python -m tests.bench.bench_gpu`, ~5 min on an H200);
# the straggler scenarios take ~2 min (`make bench-detection`); a shared node with a
# hung job, a flood and 200 veths needs root and ~2 min (`make bench-node`).
ON_REQUEST = ["bench_detection_scenarios", "bench_fleet", "bench_event_rules",
              "bench_testbed_recovery", "bench_incidents", "bench_gpu", "bench_node"]


def main() -> int:
    p = argparse.ArgumentParser(description=__doc__,
                                epilog="example: python -m tests.bench.run --only bench_agent")
    p.add_argument("--only", action="append", choices=SUITES + ON_REQUEST,
                   help="run just these suites")
    args = p.parse_args()
    rows = []
    for name in args.only or SUITES:
        t0 = time.time()
        print(f"running {name} ...", file=sys.stderr, flush=True)
        try:
            rows += importlib.import_module(f"tests.bench.{name}").run()
        except Exception as err:  # one broken suite must not hide the others' figures
            print(f"  {name} FAILED: {type(err).__name__}: {err}", file=sys.stderr, flush=True)
            rows.append(Row(f"{name}: FAILED ({type(err).__name__})", float("nan"), ""))
        print(f"  {name} done in {time.time() - t0:.0f} s", file=sys.stderr, flush=True)
    print(render(rows))
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
