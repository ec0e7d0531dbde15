"""Incidents end to end, in real processes, with the rule we had before as the baseline
in the same Prometheus: how fast the right page comes, and how many pages one
incident costs.

    python -m tests.bench.bench_incidents            # or: make bench-incidents
    python -m tests.bench.bench_incidents --hangs 4 --no-links

Hangs (loopback, no privileges): a two-node job (2 x 2 ranks, real agents, Prometheus
and Alertmanager with the project's rules and routing), one rank stopped at a random
step, a random rank each trial. Ours: RankHung naming the root. Baseline: the per-rank
rule of the previous release (every rank past its hang threshold and alive), loaded
next to ours, as NVRx's per-rank heartbeat timeout works: it pages each rank that
stops completing steps, so the waiters too. Latency is from the hung rank's last
completed step to the alert firing (Prometheus's `activeAt`, on its own clock); pages
are the critical alerts Alertmanager holds active and not inhibited for the run.

Slow links (the testbed: root, network namespaces): a 3-node job; each trial shapes
one node's link to 4 Mbit/s (tc tbf). Ours: TrainingLinkCongested naming that node.
Baseline: JobSlowdown, the job-wide alert, whose condition (median step > 1.3x usual)
is timed in the same run; it then waits its 10 min `for` and names the run, no node.

Prometheus scrapes and evaluates every second here (the deploy files: 5 s / 15 s),
so production latencies are up to one interval longer.
"""

from __future__ import annotations

import argparse
import random
import statistics
import sys
import tempfile
import time
from datetime import datetime
from pathlib import Path

import requests

from tests.bench.table import Row, render
from tests.support.procs import wait_until
from tests.support.stack import Stack

# The previous release's RankHung: a rank past its hang threshold while alive pages.
BASELINE_RULES = """groups:
  - name: baseline-previous-release
    rules:
      - alert: BaselineRankHung
        expr: |
          max by (run, rank, node, local_rank) (clusterpulse_trainer_heartbeat_age_seconds)
            and on (run, rank, node, local_rank) (clusterpulse:rank_hang_margin_seconds > 0)
            and on (run, rank, node)
              (max by (run, rank, node) (clusterpulse_trainer_process_alive) == 1)
        labels:
          severity: critical
"""
INCIDENT_WINDOW_S = 30  # how long after the first page the pages are counted


def _ts(rfc3339: str) -> float:
    return datetime.fromisoformat(rfc3339.replace("Z", "+00:00")).timestamp()


def _prom_alerts(s: Stack, name: str, run: str) -> list[dict]:
    r = requests.get(s.prom.url + "/api/v1/alerts", timeout=5).json()["data"]["alerts"]
    return [a for a in r if a["labels"]["alertname"] == name and a["labels"].get("run") == run
            and a["state"] == "firing"]


def _last_step_time(s: Stack, run: str, rank: int, at: float) -> float:
    """When the rank last completed a step, seen from `at`: the agent exports the age
    of its last step at each scrape, so sample time - age."""
    sel = f'clusterpulse_trainer_heartbeat_age_seconds{{run="{run}",rank="{rank}"}}'
    r = requests.get(s.prom.url + "/api/v1/query", timeout=5, params={
        "query": f"max(timestamp({sel}) - {sel})", "time": at}).json()["data"]["result"]
    return float(r[0]["value"][1])


def _pages(s: Stack, run: str) -> dict[str, set[str]]:
    """Alert name -> ranks (or "job") Alertmanager would page for now."""
    out: dict[str, set[str]] = {}
    for a in s.am.alerts():
        lab = a["labels"]
        if (lab.get("run") == run and lab.get("severity") == "critical"
                and a["status"]["state"] == "active"):
            out.setdefault(lab["alertname"], set()).add(lab.get("rank", "job"))
    return out


def hang_trial(s: Stack, run: str, rank: int, step: int) -> dict:
    s.start_job(run, steps=3000, trainer_args=[
        "--sim-compute-seconds", "0.1", "--inject", f"hang:rank={rank}:step={step}"])
    try:
        ours = wait_until(lambda: _prom_alerts(s, "RankHung", run), 180, f"RankHung in {run}")
        fired = min(_ts(a["activeAt"]) for a in ours)
        hang_start = _last_step_time(s, run, rank, fired)
        base = wait_until(lambda: _prom_alerts(s, "BaselineRankHung", run), 120,
                          f"BaselineRankHung in {run}")
        base_first = min(_ts(a["activeAt"]) for a in base)
        pages: dict[str, set[str]] = {}
        end = time.time() + INCIDENT_WINDOW_S
        while time.time() < end:  # the most each alert paged at once over the window
            for name, ranks in _pages(s, run).items():
                pages.setdefault(name, set()).update(ranks)
            time.sleep(2)
    finally:
        s.stop_jobs()
    named = {a["labels"]["rank"] for a in ours}
    ours_pages = sum(len(v) for k, v in pages.items() if not k.startswith("Baseline"))
    return {"latency": fired - hang_start, "base_latency": base_first - hang_start,
            "right": named == {str(rank)}, "pages": ours_pages,
            "base_pages": len(pages.get("BaselineRankHung", ())), "ranks": 4}


def hangs(trials: int, seed: int) -> list[Row]:
    rng = random.Random(seed)
    with tempfile.TemporaryDirectory(prefix="cp-incidents-") as tmp:
        tmp_path = Path(tmp)
        baseline = tmp_path / "baseline.rules.yml"
        baseline.write_text(BASELINE_RULES)
        s = Stack.start(tmp_path, extra_rules=[baseline])
        try:
            results = []
            for i in range(trials):
                rank, step = rng.randrange(4), rng.randrange(40, 80)
                r = hang_trial(s, f"hang{i}", rank, step)
                print(f"  hang {i + 1}/{trials}: rank {rank} at step {step}: paged after "
                      f"{r['latency']:.1f} s ({r['pages']} page(s); baseline "
                      f"{r['base_latency']:.1f} s, {r['base_pages']} pages)",
                      file=sys.stderr, flush=True)
                results.append(r)
        finally:
            s.stop()
    lat = [r["latency"] for r in results]
    base = [r["base_latency"] for r in results]
    n = len(results)
    return [
        Row(f"hang, 4 ranks, {n} trials: last step of the hung rank -> page (median)",
            statistics.median(lat), "s", baseline=statistics.median(base),
            baseline_name="previous per-rank rule", budget="<= 15"),
        Row(f"hang, 4 ranks, {n} trials: same, worst", max(lat), "s", baseline=max(base),
            baseline_name="previous per-rank rule", budget="<= 15"),
        Row(f"hang, 4 ranks, {n} trials: trials whose page names the hung rank",
            sum(r["right"] for r in results), "trials", budget=f"{n}"),
        Row(f"hang, 4 ranks, {n} trials: pages per incident (mean)",
            statistics.mean(r["pages"] for r in results), "pages",
            baseline=statistics.mean(r["base_pages"] for r in results),
            baseline_name="previous per-rank rule", budget="1"),
    ]


def links(seed: int) -> list[Row]:
    """One trial per node of a 3-node testbed job (root needed)."""
    from deploy.testbed import Testbed, missing_privileges
    from deploy.testbed.cluster import TestbedCluster

    reason = missing_privileges()
    if reason:
        raise RuntimeError(f"slow-link trials need the testbed: {reason}")
    run = "links"
    trainer = ["--preset", "tiny", "--steps", "100000", "--global-batch", "6",
               "--ckpt-every", "50", "--sim-compute-seconds", "0.05", "--log-every", "100"]
    order = list(range(3))
    random.Random(seed).shuffle(order)
    results = []
    with tempfile.TemporaryDirectory(prefix="cp-links-") as tmp, Testbed(nodes=3) as bed, \
            TestbedCluster(bed, Path(tmp), scrape_interval="1s") as cl:
        cl.start_job(run, trainer)
        wait_until(lambda: len(cl.query(f'clusterpulse_trainer_step{{run="{run}"}} > 5')) == 3,
                   300, "3 ranks stepping")
        def bandwidth(window_s: float) -> float:
            r = cl.query(f'avg_over_time(clusterpulse:run_comm_bandwidth_bytes_per_second'
                         f'{{run="{run}"}}[{max(2, int(window_s))}s])')
            return float(r[0]["value"][1]) if r else float("nan")

        slow_expr = (f'clusterpulse:run_step_seconds_median{{run="{run}"}} > 1.3 * '
                     f'clusterpulse:run_step_seconds_usual{{run="{run}"}}')
        for i, k in enumerate(order):
            time.sleep(60)  # a normal minute: the usual step time, the queue rates clean
            node = bed.nodes[k]
            bw_before = bandwidth(30)
            bed.slow_link(node, rate="4mbit", burst="32kb", latency="500ms")
            t0, base_t, alerts = time.time(), None, []
            try:  # until ours names a node and the baseline's condition holds
                while time.time() < t0 + 300 and (not alerts or base_t is None):
                    if base_t is None and cl.query(slow_expr):
                        base_t = time.time()
                    alerts = alerts or cl.alerts("TrainingLinkCongested")
                    time.sleep(1)
                bw_during = bandwidth(time.time() - t0 - 5)
            finally:
                bed.fix_link(node)
            if not alerts:
                raise RuntimeError(f"no TrainingLinkCongested in 300 s for {node.name}")
            fired = min(_ts(a["activeAt"]) for a in alerts) + 30  # its `for: 30s`
            nodes = {a["labels"]["node"] for a in alerts}
            r = {"latency": fired - t0, "right": nodes == {node.name},
                 "base": (base_t or float("nan")) - t0, "bw": bw_during, "bw_before": bw_before}
            print(f"  slow link {i + 1}/3 on {node.name}: named after {r['latency']:.0f} s, "
                  f"nodes {sorted(nodes)}; JobSlowdown's condition after {r['base']:.0f} s",
                  file=sys.stderr, flush=True)
            results.append(r)
            wait_until(lambda: not cl.alerts("TrainingLinkCongested"), 240, "link alert resolved")
    lat = [r["latency"] for r in results]
    base = [r["base"] + 600 for r in results]
    return [
        Row("slow link (4 Mbit/s), 3 nodes, 3 trials: shaping -> node named (median)",
            statistics.median(lat), "s", baseline=statistics.median(base),
            baseline_name="JobSlowdown pages (names no node)", budget="<= 60"),
        Row("slow link, 3 trials: same, worst", max(lat), "s", baseline=max(base),
            baseline_name="JobSlowdown pages (names no node)", budget="<= 60"),
        Row("slow link, 3 trials: trials naming exactly the shaped node",
            sum(r["right"] for r in results), "trials", budget="3"),
        Row("slow link, 3 trials: all-reduce bus bandwidth while shaped (median)",
            statistics.median(r["bw"] for r in results) / 1e6, "MB/s",
            baseline=statistics.median(r["bw_before"] for r in results) / 1e6,
            baseline_name="the minute before"),
    ]


def run(trials: int = 8, seed: int = 1, with_links: bool = True) -> list[Row]:
    rows = hangs(trials, seed)
    if with_links:
        rows += links(seed)
    return rows


def main() -> int:
    p = argparse.ArgumentParser(description=__doc__,
                                formatter_class=argparse.RawDescriptionHelpFormatter,
                                epilog="example: sudo make bench-incidents")
    p.add_argument("--hangs", type=int, default=8, help="hang trials (default 8)")
    p.add_argument("--seed", type=int, default=1)
    p.add_argument("--no-links", action="store_true",
                   help="skip the slow-link trials (they need root for the testbed)")
    args = p.parse_args()
    print(render(run(args.hangs, args.seed, not args.no_links)))
    return 0


if __name__ == "__main__":
    sys.exit(main())
