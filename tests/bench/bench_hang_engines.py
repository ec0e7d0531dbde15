"""Hang latency on the two rule engines, the same hangs at the same intervals: how long
after a rank's last step RankHung fires on Prometheus (scrape and rules every 5 s, as
deploy/prometheus/prometheus.example.yml) and on vmagent + VictoriaMetrics + vmalert
(the shipped deploy/victoriametrics flags: scrape and rules every 5 s), both reading
the same real agent.

Each run has two ranks on the agent (steps every 0.2 s, so the hang threshold is the
5 s floor). After a warm-up that lets every recorded rule of the chain exist on both
engines, rank 1 of each run stops stepping (alive, still heartbeating: stuck in its
compute) while rank 0 enters the next collective and waits there: the hang RankHung
names. The runs hang a few seconds apart, so that the hangs fall at different points
of the scrape and evaluation cycles. Latency: from the hung rank's last step to the
first poll (every 0.25 s) that finds RankHung for its run firing in each engine.

    python -m tests.bench.bench_hang_engines [RUNS] [VMALERT FLAG=VALUE ...]

Extra arguments `-flag=value` replace vmalert's shipped flags of that name (to measure
a change before shipping it). Prints one line per run and the summary as JSON.
"""

from __future__ import annotations

import json
import statistics
import sys
import tempfile
import threading
import time
from pathlib import Path

from tests.support.hangruns import STEP_S, Run, firing_runs
from tests.support.procs import RULE_FILES, Prometheus, _http, start_agent_cli
from tests.support.victoria import Shard, VmAlert, victoria_metrics, write_targets

WARM_S = 60.0  # the chain of recorded rules, 5 links at 5 s on vmalert, and the p99
STAGGER_S = 7.0  # not a multiple of the 5 s cycles
POLL_S = 0.25
GIVE_UP_S = 120.0


def main(runs_n: int = 6, vmalert_flags: dict[str, str] | None = None) -> dict:
    tmp = Path(tempfile.mkdtemp(prefix="bench-hang-"))
    procs: list = []
    try:
        agent, port, telemetry = start_agent_cli(tmp, "hb", gpus=4)
        procs.append(agent)
        target = f"127.0.0.1:{port}"
        prom = Prometheus(tmp, [target], rule_files=list(RULE_FILES), shipped=True)
        procs.append(prom)
        vm = victoria_metrics(tmp)
        procs.append(vm)
        write_targets(tmp / "targets", [target])
        procs.append(Shard(tmp, 0, 1, vm.url, tmp / "targets", password_file=vm.password_file))
        vmalert = VmAlert(tmp, vm.url, "http://127.0.0.1:9", extra=vmalert_flags,
                          password_file=vm.password_file)
        procs.append(vmalert)
        runs = [Run(telemetry.removeprefix("unix:"), f"h{i}") for i in range(runs_n)]
        stop = threading.Event()

        def loop() -> None:
            while not stop.is_set():
                for r in runs:
                    r.tick()
                time.sleep(STEP_S)

        threading.Thread(target=loop, daemon=True).start()
        start = time.time()
        hang_at = {r.name: start + WARM_S + i * STAGGER_S for i, r in enumerate(runs)}
        seen: dict[str, dict[str, float]] = {"prometheus": {}, "vmalert": {}}
        prom_alerts = lambda: _http().get(prom.url + "/api/v1/alerts",  # noqa: E731
                                          timeout=5).json()["data"]["alerts"]
        while time.time() < max(hang_at.values()) + GIVE_UP_S:
            now = time.time()
            for r in runs:
                if now >= hang_at[r.name]:
                    r.hang = True  # its last step stays the last one the ticks sent
            for engine, alerts in (("prometheus", prom_alerts), ("vmalert", vmalert.alerts)):
                for run in firing_runs(alerts()):
                    seen[engine].setdefault(run, time.time())
            if all(len(s) == runs_n for s in seen.values()):
                break
            time.sleep(POLL_S)
        stop.set()
        out = {"runs": {}, "vmalert_flags": vmalert_flags or {}}
        for r in runs:
            out["runs"][r.name] = {e: round(seen[e][r.name] - r.last_step_at, 1)
                                   if r.name in seen[e] else None for e in seen}
            print(r.name, out["runs"][r.name], flush=True)
        for e in seen:
            lat = [v[e] for v in out["runs"].values() if v[e] is not None]
            out[e] = {"n": len(lat), "missed": runs_n - len(lat),
                      "median": round(statistics.median(lat), 1) if lat else None,
                      "min": min(lat, default=None), "max": max(lat, default=None)}
        print(json.dumps(out), flush=True)
        return out
    finally:
        for p in reversed(procs):
            p.stop()


if __name__ == "__main__":
    args = sys.argv[1:]
    n = int(args.pop(0)) if args and args[0].isdigit() else 6
    flags = dict(a.lstrip("-").split("=", 1) for a in args)
    main(n, flags or None)
