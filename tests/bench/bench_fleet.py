"""A fleet at the recommended 5 s scrape with a training rank on every GPU, on three
back ends in turn: one Prometheus (scrapes and rules); one VictoriaMetrics that scrapes,
with the rules on vmalert; and the path past one machine, two vmagent scrape shards
(hashmod, deploy/victoriametrics) remote-writing into VictoriaMetrics, rules on vmalert.
For each: series and ingest against what the scrapes should bring, every rule group's
evaluation time against its interval and missed evaluations, each process's CPU and
memory, and the dashboard's cluster page render time (AppTest) on that store.

    make bench-fleet NODES=2048 STORES=prometheus      # 16,384 GPUs, Prometheus only
    CLUSTERPULSE_FLEET_NODES=256 CLUSTERPULSE_FLEET_STORES=sharded \\
        python -m tests.bench.run --only bench_fleet

The fleet is tests/bench/fleet_static.py: the agent's real exposition of one simulated
8-GPU node with 8 ranks, served for every node at its own loopback address, the ranks
in runs of 1,024 GPUs. What it leaves out and how the figures were taken:
docs/benchmarks.md ("Fleet at a 5 s scrape").
"""

from __future__ import annotations

import os
import shutil
import subprocess
import sys
import tempfile
import time
from collections.abc import Callable
from dataclasses import dataclass, field
from pathlib import Path

import requests
from streamlit.testing.v1 import AppTest

from clusterpulse.agent.exporter import PROGRESS_FAMILIES
from tests.bench.fleet_static import node_address
from tests.bench.table import Row
from tests.support.pages import kpis
from tests.support.ports import free_port
from tests.support.procs import REPO, RULE_FILES, Proc, wait_until
from tests.support.victoria import (
    Shard,
    Store,
    VmAlert,
    victoria_metrics,
    write_targets,
)

NODES, GPUS = int(os.environ.get("CLUSTERPULSE_FLEET_NODES", "2048")), 8
STORES = os.environ.get("CLUSTERPULSE_FLEET_STORES", "prometheus,victoria,sharded").split(",")
SCRAPE_S = 5     # the recommended scrape interval (deploy/prometheus/prometheus.example.yml)
RULE_S = 5       # the global evaluation interval; the heavy groups set 15-30 s themselves
RUN_NODES = 128  # a run of 1,024 GPUs: 16 runs at 16,384 GPUs
WINDOW_S = int(os.environ.get("CLUSTERPULSE_FLEET_WINDOW", "60"))  # steady state measured
SETTLE_S = 10    # after the last GPU arrives: the first scrapes create every series
COLD_RENDERS = 5  # one render is one sample of a query time that rule evaluation moves
SHARDS = 2
MIN_FREE_GIB = 1.5  # a run stops when the machine's available memory falls below this


@dataclass
class Setup:
    """One back end under test: its store, what evaluates the rules, its processes."""

    name: str
    store: Store
    procs: dict[str, Proc] = field(default_factory=dict)  # what to measure, by role
    rules: Callable[[], dict[str, tuple[float, float, float]]] | None = None  # name -> now
    vmalert: VmAlert | None = None

    def stop(self) -> None:
        for p in reversed(list(self.procs.values())):
            p.stop()


def _targets(port: int) -> list[str]:
    return [f"{node_address(i)}:{port}" for i in range(NODES)]


def _scrape_config(targets_dir: Path) -> list[str]:
    """The shipped jobs (deploy/victoriametrics/vmagent.yml, prometheus.example.yml), the
    agents from a file: every 5 s without the ranks' progress, and the progress alone
    every second (job rank-progress, for hang detection)."""
    files = ["    file_sd_configs:", f"      - files: ['{targets_dir}/*.yml']"]
    progress = "|".join(PROGRESS_FAMILIES)
    return ["scrape_configs:", "  - job_name: clusterpulse",
            f"    scrape_interval: {SCRAPE_S}s", f"    scrape_timeout: {SCRAPE_S - 1}s", *files,
            "    metric_relabel_configs:", "      - source_labels: [__name__]",
            f"        regex: '{progress}'", "        action: drop",
            "  - job_name: rank-progress", "    scrape_interval: 1s", "    scrape_timeout: 1s",
            "    metrics_path: /metrics/progress", *files]


def _metrics(url: str) -> dict[str, float]:
    """A process's own /metrics, summed by name and label set as written."""
    out: dict[str, float] = {}
    for line in requests.get(url + "/metrics", timeout=60).text.splitlines():
        if line and not line.startswith("#"):
            key, _, value = line.rpartition(" ")
            try:
                out[key] = out.get(key, 0.0) + float(value)
            except ValueError:
                continue
    return out


def _total(metrics: dict[str, float], name: str, having: str = "") -> float:
    return sum(v for k, v in metrics.items()
               if (k == name or k.startswith(name + "{")) and having in k)


def _prometheus(tmp: Path, targets_dir: Path) -> Setup:
    binary = shutil.which("prometheus")
    assert binary, "prometheus is not installed (scripts/setup.sh installs it)"
    port = free_port()
    cfg = ["global:", f"  scrape_interval: {SCRAPE_S}s", f"  evaluation_interval: {RULE_S}s",
           "rule_files:", *[f"  - {p}" for p in RULE_FILES], *_scrape_config(targets_dir)]
    (tmp / "prometheus.yml").write_text("\n".join(cfg) + "\n")
    proc = Proc([binary, f"--config.file={tmp / 'prometheus.yml'}",
                 f"--storage.tsdb.path={tmp / 'prom-data'}",
                 f"--web.listen-address=127.0.0.1:{port}"], tmp / "prometheus.log")
    url = f"http://127.0.0.1:{port}"
    wait_until(lambda: requests.get(url + "/-/ready", timeout=2).ok, 60, "prometheus ready")
    store = Store("Prometheus", url, proc)

    def rules() -> dict[str, tuple[float, float, float]]:
        groups = requests.get(url + "/api/v1/rules", timeout=60).json()["data"]["groups"]
        return {g["name"]: (g["evaluationTime"], g["interval"], 0.0) for g in groups}

    return Setup("Prometheus", store, {"prometheus": proc}, rules)


def _with_vmalert(setup: Setup, tmp: Path) -> Setup:
    # Alerts are evaluated and counted; nothing listens for them (a healthy fleet sends none).
    vmalert = VmAlert(tmp, setup.store.url, f"http://127.0.0.1:{free_port()}",
                      password_file=setup.store.password_file)
    setup.procs["vmalert"], setup.vmalert = vmalert.proc, vmalert

    def rules() -> dict[str, tuple[float, float, float]]:
        """vmalert's slowest iteration of each group in its summary's window (the last
        few minutes), its interval and its mean iteration time so far."""
        m = _metrics(vmalert.url)
        out = {}
        for g in vmalert_groups(vmalert):
            has = f'group="{g["name"]}"'
            count = _total(m, "vmalert_iteration_duration_seconds_count", has)
            mean = _total(m, "vmalert_iteration_duration_seconds_sum", has) / max(count, 1)
            worst = max((v for k, v in m.items()
                         if k.startswith("vmalert_iteration_duration_seconds{") and has in k
                         and 'quantile="1"' in k), default=0.0)
            out[g["name"]] = (worst, float(g["interval"]), mean)
        return out

    setup.rules = rules
    return setup


def vmalert_groups(vmalert: VmAlert) -> list[dict]:
    r = requests.get(vmalert.url + "/api/v1/rules", timeout=60)
    r.raise_for_status()
    return r.json()["data"]["groups"]


def _victoria(tmp: Path, targets_dir: Path) -> Setup:
    (tmp / "vm-scrape.yml").write_text("\n".join(_scrape_config(targets_dir)) + "\n")
    store = victoria_metrics(tmp, tmp / "vm-scrape.yml")
    return _with_vmalert(Setup("VictoriaMetrics", store, {"victoria-metrics": store.proc}), tmp)


def _shards(tmp: Path, targets_dir: Path, name: str) -> Setup:
    store = victoria_metrics(tmp)
    setup = Setup(name, store, {"victoria-metrics": store.proc})
    for n in range(SHARDS):
        shard = Shard(tmp, n, SHARDS, store.url, targets_dir,
                      password_file=store.password_file)
        setup.procs[f"vmagent-{n}"] = shard.proc
    return setup


def _sharded(tmp: Path, targets_dir: Path) -> Setup:
    return _with_vmalert(_shards(tmp, targets_dir,
                                 f"{SHARDS} vmagent shards + VictoriaMetrics"), tmp)


def _ingest_only(tmp: Path, targets_dir: Path) -> Setup:
    """The sharded path without vmalert: what ingest alone costs the store, so that the
    rules' share of its CPU is the difference (for sizing, docs/scaling.md)."""
    setup = _shards(tmp, targets_dir, f"{SHARDS} vmagent shards + VictoriaMetrics, no rules")
    setup.rules = dict
    return setup


SETUPS = {"prometheus": _prometheus, "victoria": _victoria, "sharded": _sharded,
          "ingest": _ingest_only}


def _cpu_seconds(pid: int) -> float:
    """utime + stime of a process, in seconds."""
    fields = Path(f"/proc/{pid}/stat").read_text().rsplit(")", 1)[1].split()
    return (int(fields[11]) + int(fields[12])) / os.sysconf("SC_CLK_TCK")


def _children(pid: int) -> list[int]:
    """Processes whose parent is `pid` (the fleet server's workers)."""
    out = []
    for d in Path("/proc").iterdir():
        if d.name.isdigit():
            try:
                if int((d / "stat").read_text().rsplit(")", 1)[1].split()[1]) == pid:
                    out.append(int(d.name))
            except (OSError, ValueError, IndexError):
                continue
    return out


def _machine_busy() -> tuple[float, float]:
    """All CPUs' busy and total jiffies (/proc/stat): the machine is shared."""
    cpu = [int(x) for x in Path("/proc/stat").read_text().splitlines()[0].split()[1:]]
    idle = cpu[3] + cpu[4]
    return sum(cpu) - idle, sum(cpu)


def _available_gib() -> float:
    for line in Path("/proc/meminfo").read_text().splitlines():
        if line.startswith("MemAvailable:"):
            return int(line.split()[1]) / 2**20
    return float("nan")


def _rss_mib(pid: int) -> float:
    status = Path(f"/proc/{pid}/status").read_text()
    return float(status.split("VmRSS:")[1].split()[0]) / 1024


def _render(store: Store, store_pid: int,
            background: float) -> tuple[float, float, float, int, float]:
    """Renders of the cluster page against `store`: median and worst of COLD_RENDERS
    with no cached data, a second view; queries per refresh; the store's CPU seconds
    per view with no cached data, above its steady `background` (cores: ingest and
    rules go on meanwhile), a figure that the shared machine's other users move less
    than the times.

    No cached data means the first view in a dashboard process already running (the
    server imports its modules once): one untimed render first, then every data cache
    cleared before each timed one. The first timed render's queries are printed."""
    import streamlit as st

    from clusterpulse.dashboard import data
    from clusterpulse.dashboard.promclient import PrometheusClient

    os.environ["CLUSTERPULSE_PROMETHEUS_URL"] = store.url
    if store.password_file:  # VictoriaMetrics asks for its password (docs/scaling.md)
        os.environ["CLUSTERPULSE_PROMETHEUS_PASSWORD_FILE"] = str(store.password_file)
    else:
        os.environ.pop("CLUSTERPULSE_PROMETHEUS_PASSWORD_FILE", None)
    os.environ["CLUSTERPULSE_ALERTMANAGER_URL"] = f"http://127.0.0.1:{free_port()}"
    app = str(REPO / "dashboard" / "app.py")
    AppTest.from_file(app, default_timeout=300).run()
    times = []
    plain = PrometheusClient.query

    def timed(self, promql: str, at: float | None = None) -> list:
        t0 = time.perf_counter()
        try:
            return plain(self, promql, at)
        finally:
            print(f"  {store.name}: {time.perf_counter() - t0:5.2f} s  {promql[:90]}",
                  file=sys.stderr, flush=True)

    cpu0, wall0 = _cpu_seconds(store_pid), time.monotonic()
    for n in range(COLD_RENDERS + 1):  # the last one is the second view (cached data)
        if n == COLD_RENDERS:
            per_view = (_cpu_seconds(store_pid) - cpu0
                        - background * (time.monotonic() - wall0)) / COLD_RENDERS
        if n < COLD_RENDERS:
            st.cache_data.clear()
        at = AppTest.from_file(app, default_timeout=300)
        PrometheusClient.query = timed if n == 0 else plain  # type: ignore[method-assign]
        t0 = time.perf_counter()
        try:
            at.run()
        finally:
            PrometheusClient.query = plain  # type: ignore[method-assign]
        times.append(time.perf_counter() - t0)
        assert not at.exception, at.exception
        metrics = kpis(at)
        want = f"{NODES * GPUS} / {NODES * GPUS}"
        assert metrics.get("Healthy GPUs") == want, (store.name, metrics,
                                                     [e.value for e in at.error])
    queries = data.cluster(store.url, os.environ["CLUSTERPULSE_ALERTMANAGER_URL"],
                           "utilization").value["queries"]
    cold = sorted(times[:COLD_RENDERS])
    return cold[len(cold) // 2], cold[-1], times[-1], queries, per_view


def _everything_in(store: Store) -> bool:
    gpus = store.scalar("count(clusterpulse_gpu_up)")
    ranks = store.scalar("count(clusterpulse_trainer_step)")
    free = _available_gib()
    print(f"  {store.name}: {gpus:.0f} of {NODES * GPUS} GPUs, {ranks:.0f} ranks; "
          f"{free:.1f} GiB available", file=sys.stderr, flush=True)
    assert free > MIN_FREE_GIB, (f"stopped: {free:.1f} GiB of memory left on this machine "
                                 f"with {NODES * GPUS} GPUs in {store.name}")
    return gpus == NODES * GPUS and ranks == NODES * GPUS


def _ingest(setup: Setup) -> float:
    """Samples the store has taken in so far (scrapes and recording rules)."""
    m = _metrics(setup.store.url)
    if setup.name == "Prometheus":
        return _total(m, "prometheus_tsdb_head_samples_appended_total")
    return _total(m, "vm_rows_inserted_total")


def _measure(setup: Setup, fleet_pids: list[int], scraped_per_s: float) -> list[Row]:
    """The steady state over WINDOW_S: rule groups sampled every evaluation interval,
    ingest, each process's CPU (cores) and the machine's, then the page."""
    name, store = setup.name, setup.store
    pids = {role: p.p.pid for role, p in setup.procs.items()}
    cpu0 = {role: _cpu_seconds(pid) for role, pid in pids.items()}
    fleet0 = sum(_cpu_seconds(p) for p in fleet_pids)
    busy0, total0 = _machine_busy()
    ingest0, t0 = _ingest(setup), time.monotonic()
    evaluator = store.url if name == "Prometheus" else setup.vmalert and setup.vmalert.url
    own0 = _metrics(evaluator) if evaluator else {}
    worst: dict[str, tuple[float, float]] = {}
    means: dict[str, list[float]] = {}
    while time.monotonic() - t0 < WINDOW_S:
        time.sleep(RULE_S)
        for group, (took, every, mean) in setup.rules().items():
            worst[group] = (max(took, worst.get(group, (0.0, 0.0))[0]), every)
            means.setdefault(group, []).append(mean or took)
    elapsed = time.monotonic() - t0
    ingest = (_ingest(setup) - ingest0) / elapsed
    cores = {role: (_cpu_seconds(pid) - cpu0[role]) / elapsed for role, pid in pids.items()}
    fleet_cores = (sum(_cpu_seconds(p) for p in fleet_pids) - fleet0) / elapsed
    busy1, total1 = _machine_busy()
    machine = (busy1 - busy0) / (total1 - total0) * os.cpu_count()
    load = Path("/proc/loadavg").read_text().split()[0]
    rss = {role: _rss_mib(pid) for role, pid in pids.items()}
    if name == "Prometheus":
        own = _metrics(store.url)
        missed = (_total(own, "prometheus_rule_group_iterations_missed_total")
                  - _total(own0, "prometheus_rule_group_iterations_missed_total"))
        failed = (_total(own, "prometheus_rule_evaluation_failures_total")
                  - _total(own0, "prometheus_rule_evaluation_failures_total"))
        series = _total(own, "prometheus_tsdb_head_series")
        firing = len(store.query('ALERTS{alertstate="firing"}'))
    else:
        own = _metrics(evaluator) if evaluator else {}
        missed = (_total(own, "vmalert_iteration_missed_total")
                  - _total(own0, "vmalert_iteration_missed_total"))
        failed = (_total(own, "vmalert_execution_errors_total")
                  - _total(own0, "vmalert_execution_errors_total"))
        dropped = _total(own, "vmalert_remotewrite_dropped_rows_total")
        failed += dropped
        series = _total(_metrics(store.url), "vm_cache_entries",
                        'type="storage/hour_metric_ids"')
        firing = len(setup.vmalert.alerts()) if setup.vmalert else 0
    print(f"  {name}: machine busy {machine:.2f} cores, load {load}; ours "
          + ", ".join(f"{r} {c:.2f}" for r, c in cores.items())
          + f", fleet {fleet_cores:.2f}", file=sys.stderr, flush=True)
    store_role = "prometheus" if name == "Prometheus" else "victoria-metrics"
    nan = float("nan")
    try:
        cold, cold_worst, warm, queries, per_view = _render(store, pids[store_role],
                                                            cores[store_role])
    except Exception as err:  # the page says what went wrong (a timeout): keep the rest
        print(f"  {name}: the cluster page failed: {type(err).__name__}: {err}",
              file=sys.stderr, flush=True)
        cold = cold_worst = warm = queries = per_view = nan
    g = f"{NODES * GPUS:,} GPUs, {name}"
    rows = [
        Row(f"{g}: series in the store", series, "series"),
        Row(f"{g}: ingest (scrapes + recorded), samples/s", ingest, "samples/s",
            baseline=scraped_per_s, baseline_name="series kept / 5 s + progress / 1 s"),
        *[Row(f"{g}: rule group {group}, slowest eval in {WINDOW_S} s", took, "s",
              budget=f"< {every:g} s", baseline=sorted(means[group])[len(means[group]) // 2],
              baseline_name="median eval")
          for group, (took, every) in sorted(worst.items())],
        Row(f"{g}: rule group evaluations missed in {WINDOW_S} s", missed, "evaluations",
            budget="0"),
        Row(f"{g}: rule evaluation errors in {WINDOW_S} s", failed, "errors", budget="0"),
        Row(f"{g}: alerts firing (a healthy fleet)", firing, "alerts", budget="0"),
        *[Row(f"{g}: {role} CPU", c, "cores") for role, c in cores.items()],
        Row(f"{g}: fleet server CPU (not the monitoring's)", fleet_cores, "cores"),
        Row(f"{g}: whole machine busy (all users), load {load}", machine, "cores",
            budget=f"of {os.cpu_count()}"),
        *[Row(f"{g}: {role} resident memory", m, "MiB") for role, m in rss.items()],
        Row(f"{g}: cluster page, no cached data (median of {COLD_RENDERS})", cold, "s",
            budget="< 2 s"),
        Row(f"{g}: cluster page, no cached data (worst of {COLD_RENDERS})", cold_worst, "s"),
        Row(f"{g}: cluster page, second view", warm, "s"),
        Row(f"{g}: PromQL queries per refresh", queries, "queries"),
        Row(f"{g}: {store_role} CPU per view, no cached data (above its steady rate)",
            per_view, "s"),
    ]
    return rows


def run() -> list[Row]:
    unknown = set(STORES) - set(SETUPS)
    assert not unknown, f"CLUSTERPULSE_FLEET_STORES: unknown {unknown}; known {list(SETUPS)}"
    fleet_port = free_port()
    fleet = subprocess.Popen([sys.executable, "-m", "tests.bench.fleet_static", str(NODES),
                              str(GPUS), str(fleet_port), str(RUN_NODES)], cwd=REPO,
                             stdin=subprocess.PIPE, stdout=subprocess.PIPE, text=True)
    rows: list[Row] = []
    try:
        assert int(fleet.stdout.readline()) == NODES
        fleet_pids = [fleet.pid, *_children(fleet.pid)]
        with tempfile.TemporaryDirectory() as tmp_name:
            tmp = Path(tmp_name)
            write_targets(tmp / "targets", _targets(fleet_port))
            for kind in STORES:
                work = tmp / kind
                work.mkdir()
                print(f"  {kind}: starting ({NODES * GPUS:,} GPUs, {_available_gib():.1f} "
                      "GiB available)", file=sys.stderr, flush=True)
                setup = SETUPS[kind](work, tmp / "targets")
                try:
                    t0 = time.monotonic()
                    wait_until(lambda s=setup: _everything_in(s.store), 600,
                               f"every GPU and rank in {setup.name}", interval=5)
                    arrived = time.monotonic() - t0
                    print(f"  {setup.name}: everything in after {arrived:.0f} s",
                          file=sys.stderr, flush=True)
                    time.sleep(SETTLE_S)
                    scraped_per_s = setup.store.scalar(
                        'sum(scrape_samples_post_metric_relabeling{job="clusterpulse"})'
                        ) / SCRAPE_S + setup.store.scalar(
                        'sum(scrape_samples_scraped{job="rank-progress"})')
                    rows.append(Row(f"{NODES * GPUS:,} GPUs, {setup.name}: from start to "
                                    "every GPU and rank queryable", arrived, "s"))
                    rows += _measure(setup, fleet_pids, scraped_per_s)
                finally:
                    setup.stop()
    finally:
        fleet.stdin.close()
        fleet.wait(timeout=60)
    return rows
