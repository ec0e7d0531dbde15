"""The XID/ECC "recent events" records at fleet scale, on an hour of history: the
current rules against the previous point-lookup form, side by side in one Prometheus.

    python -m tests.bench.run --only bench_event_rules      # or: make bench-fleet

Why a history: the records' "seen before" part reads the hour before their 10-minute
window, which a benchmark that starts scraping now does not have. So the history is
written first (promtool's OpenMetrics backfill: 80 minutes at a 30 s scrape for 16,384
GPUs' uncorrected-ECC counters, 16 of them with errors, and the XID counters of the
GPUs that had XIDs) and a Prometheus with no scrapes and no rules answers both forms
at its end, in turn, as instant queries (median of 7 each).
"""

from __future__ import annotations

import shutil
import subprocess
import tempfile
import time
from pathlib import Path

import requests
import yaml

from tests.bench.bench_fleet import GPUS, NODES  # the same fleet (CLUSTERPULSE_FLEET_NODES)
from tests.bench.table import Row
from tests.support.ports import free_port
from tests.support.procs import REPO, Proc, wait_until

HISTORY_S, SCRAPE_S = 80 * 60, 30
WITH_ERRORS = 16  # GPUs with uncorrected ECC errors and an XID 79 in their history
RECORDS = ("clusterpulse:gpu_ecc_uncorrected_recent", "clusterpulse:gpu_xid_recent")
ECC = 'clusterpulse_gpu_ecc_errors_total{kind="uncorrected"}'
XID = "clusterpulse_gpu_xid_errors_total"
# The previous release's records: "new within the window" was a point lookup at its start.
PREVIOUS = {
    RECORDS[0]: f"sum by (node, gpu) (({ECC} - {ECC} offset 10m) > 0 "
                f"or ({ECC} > 0 unless {ECC} offset 10m))",
    RECORDS[1]: f"sum by (node, gpu, xid) (({XID} - {XID} offset 10m) > 0 "
                f"or ({XID} unless {XID} offset 10m))",
}


def _history(path: Path, end: int) -> None:
    """OpenMetrics text, one series after another (each in time order)."""
    start = end - HISTORY_S
    stamps = range(start, end + 1, SCRAPE_S)
    with path.open("w") as f:
        f.write("# TYPE clusterpulse_gpu_ecc_errors counter\n")
        for n in range(NODES):
            for g in range(GPUS):
                value = 2 if n * GPUS + g < WITH_ERRORS else 0
                labels = f'gpu="{g}",kind="uncorrected",node="n{n:04d}",uuid="GPU-{n:04d}-{g}"'
                f.writelines(f"clusterpulse_gpu_ecc_errors_total{{{labels}}} {value} {t}\n"
                             for t in stamps)
        f.write("# TYPE clusterpulse_gpu_xid_errors counter\n")
        for i in range(WITH_ERRORS):
            n, g = divmod(i, GPUS)
            labels = f'gpu="{g}",node="n{n:04d}",uuid="GPU-{n:04d}-{g}",xid="79"'
            f.writelines(f"clusterpulse_gpu_xid_errors_total{{{labels}}} 1 {t}\n" for t in stamps)
        f.write("# EOF\n")


def _ours() -> dict[str, str]:
    groups = yaml.safe_load((REPO / "deploy/prometheus/clusterpulse.rules.yml").read_text())
    rules = {r.get("record"): r["expr"] for g in groups["groups"] for r in g["rules"]}
    return {name: rules[name] for name in RECORDS}


def run() -> list[Row]:
    promtool, prometheus = shutil.which("promtool"), shutil.which("prometheus")
    assert promtool and prometheus, "prometheus/promtool not installed (scripts/setup.sh)"
    end = int(time.time())
    with tempfile.TemporaryDirectory(prefix="cp-event-rules-") as tmp_name:
        tmp = Path(tmp_name)
        _history(tmp / "history.om", end)
        subprocess.run([promtool, "tsdb", "create-blocks-from", "openmetrics", "-q",
                        str(tmp / "history.om"), str(tmp / "data")], check=True,
                       capture_output=True, timeout=1800)
        (tmp / "history.om").unlink()
        (tmp / "prometheus.yml").write_text("global:\n  scrape_interval: 1h\n")
        port = free_port()
        proc = Proc([prometheus, f"--config.file={tmp / 'prometheus.yml'}",
                     f"--storage.tsdb.path={tmp / 'data'}",
                     f"--web.listen-address=127.0.0.1:{port}"], tmp / "prometheus.log")
        url = f"http://127.0.0.1:{port}"
        try:
            wait_until(lambda: requests.get(url + "/-/ready", timeout=2).ok, 120,
                       "prometheus ready")
            times = _time_both(url, end, _ours())
        finally:
            proc.stop()
    gpus = NODES * GPUS
    return [Row(f"{name} at {gpus:,} GPUs, 80 min history (one evaluation)", ours, "s",
                baseline=prev, baseline_name="previous rule (point lookup)")
            for name, (ours, prev) in times.items()]


def _time_both(url: str, at: int, ours: dict[str, str], repeats: int = 7,
               ) -> dict[str, tuple[float, float]]:
    def query(expr: str) -> list:
        r = requests.get(url + "/api/v1/query", params={"query": expr, "time": at}, timeout=300)
        r.raise_for_status()
        return r.json()["data"]["result"]

    count = query(f"count({ECC})")  # the history is there (else both forms read nothing)
    assert count and int(count[0]["value"][1]) == NODES * GPUS, count
    out = {}
    for name in RECORDS:
        # Both forms must agree on this history (nothing new in the last 10 minutes).
        assert query(ours[name]) == query(PREVIOUS[name]) == [], name
        samples: dict[str, list[float]] = {"ours": [], "previous": []}
        for _ in range(repeats):
            for which, expr in (("ours", ours[name]), ("previous", PREVIOUS[name])):
                t0 = time.perf_counter()
                query(expr)
                samples[which].append(time.perf_counter() - t0)
        mid = repeats // 2
        out[name] = (sorted(samples["ours"])[mid], sorted(samples["previous"])[mid])
    return out
