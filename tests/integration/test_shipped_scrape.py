"""The shipped scrape config (deploy/prometheus/prometheus.example.yml) on a real
Prometheus and a real agent: the agent's series every 5 s, the ranks' progress every
second on its own path, each rank's progress once (not once per job), the hang chain
and its alerts evaluated every second, and a hang named through that path.

The other integration tests scrape everything every second with one job; this is the
only one that runs the split an operator deploys."""

from __future__ import annotations

import threading
import time

from clusterpulse.agent.exporter import PROGRESS_FAMILIES
from tests.support.hangruns import STEP_S, Run, firing_runs
from tests.support.procs import RULE_FILES, Prometheus, _http, start_agent_cli, wait_until


def test_the_shipped_scrape_reads_progress_every_second_and_names_a_hang(tmp_path):
    agent, port, telemetry = start_agent_cli(tmp_path, "ship", gpus=2)
    prom = Prometheus(tmp_path, [f"127.0.0.1:{port}"], rule_files=list(RULE_FILES),
                      shipped=True)
    run = Run(telemetry.removeprefix("unix:"), "shipped")
    stop = threading.Event()

    def loop() -> None:
        while not stop.is_set():
            run.tick()
            time.sleep(STEP_S)

    threading.Thread(target=loop, daemon=True).start()
    try:
        def jobs() -> dict[str, tuple[str, str]]:
            targets = _http().get(prom.url + "/api/v1/targets", timeout=5).json()["data"]
            return {t["labels"]["job"]: (t["scrapeInterval"], t["scrapeUrl"].split("/", 3)[3])
                    for t in targets["activeTargets"]}

        intervals = wait_until(lambda: len(got := jobs()) == 2 and got, 30,
                               "both scrape jobs discovered")
        assert intervals == {"clusterpulse": ("5s", "metrics"),
                             "rank-progress": ("1s", "metrics/progress")}, intervals
        groups = {g["name"]: g["interval"] for g in _http().get(
            prom.url + "/api/v1/rules", timeout=5).json()["data"]["groups"]}
        assert groups["clusterpulse-progress"] == groups["clusterpulse-hangs"] == 1, groups

        def progress_jobs() -> dict[str, dict[str, float]]:
            got: dict[str, dict[str, float]] = {}
            for name in PROGRESS_FAMILIES:
                for s in prom.query(f"count by (job) ({name})"):
                    got.setdefault(name, {})[s["metric"]["job"]] = float(s["value"][1])
            return got

        # both ranks stepping: every family from rank-progress alone, one series a rank
        # (phase: one per rank too, the phase it is in; the receiver's lag, one for the
        # node); blocked_collective only waits
        present = wait_until(lambda: (g := progress_jobs()) and len(g) == 5 and g, 60,
                             "the ranks' progress in Prometheus")
        assert present == {n: {"rank-progress": 1.0 if "receive_lag" in n else 2.0}
                           for n in PROGRESS_FAMILIES if "blocked" not in n}, present
        # the main job still carries the rest of the rank's series
        steps = wait_until(lambda: prom.query("clusterpulse_trainer_step"), 30,
                           "the main scrape")
        assert {s["metric"]["job"] for s in steps} == {"clusterpulse"}
        wait_until(lambda: prom.query("clusterpulse:rank_hang_threshold_seconds"), 60,
                   "the hang chain recorded")
        run.hang = True
        wait_until(lambda: "shipped" in firing_runs(
            _http().get(prom.url + "/api/v1/alerts", timeout=5).json()["data"]["alerts"]),
            60, "RankHung for the hung run")
        latency = time.time() - run.last_step_at
        (alert,) = [a for a in _http().get(prom.url + "/api/v1/alerts", timeout=5)
                    .json()["data"]["alerts"] if a["labels"]["alertname"] == "RankHung"]
        assert alert["labels"]["rank"] == "1", alert  # the root, not the waiting rank 0
        print(f"RankHung {latency:.1f} s after the hung rank's last step (5 s floor)")
    finally:
        stop.set()
        prom.stop()
        agent.stop()
