"""Agent benchmarks: collection cost, NVML batching, scrape latency, CPU share, memory.

Each figure is measured side by side with a baseline in the same run:
- scrape rendering against the usual prometheus_client design (Gauge objects updated
  with .labels().set() every cycle), serving the same series;
- NVML calls against one call per field (what an exporter without batching makes).
"""

from __future__ import annotations

import os
import resource
import socket
import statistics
import subprocess
import sys
import time
from concurrent.futures import ThreadPoolExecutor

import requests
from prometheus_client import CollectorRegistry, Gauge, generate_latest

from clusterpulse.agent import protocol
from clusterpulse.agent.audit import AuditLog
from clusterpulse.agent.backends.nvml import NvmlBackend
from clusterpulse.agent.backends.sim import SimBackend
from clusterpulse.agent.core import Agent
from clusterpulse.agent.exporter import GPU_SERIES, AgentCollector
from clusterpulse.agent.ranks import RankRegistry
from tests.bench.table import Row
from tests.conftest import socket_path
from tests.fakes.fake_pynvml import FakeNvml
from tests.support.ports import free_port
from tests.support.ranksock import NEIGHBOURS, SYSTEM_PYTHON, connect

GPUS = RANKS = 8


def _agent(backend=None) -> Agent:
    ranks = RankRegistry()
    backend = backend or SimBackend(gpus=GPUS, activity=ranks.activity)
    agent = Agent(backend, "bench", ranks, AuditLog(None))
    for r in range(RANKS):
        agent.handle_datagram(protocol.encode({
            "type": "step", "run": "bench", "rank": r, "local_rank": r, "gpu": r, "pid": 1,
            "step": 10, "step_seconds": 0.1, "compute_seconds": 0.08, "sync_wait_seconds": 0.02,
            "loss": 2.0, "samples_total": 100, "tokens_total": 1e5, "sync_bytes_total": 1e9,
        }), None)
    return agent


def _series(text: bytes) -> int:
    return sum(1 for line in text.decode().splitlines() if line and not line.startswith("#"))


def _cpu_per_call(fn, n: int) -> float:
    fn()
    t0 = time.process_time()
    for _ in range(n):
        fn()
    return (time.process_time() - t0) / n


def _gauge_baseline(agent: Agent) -> tuple[CollectorRegistry, callable]:
    """The common exporter design: Gauge objects, .labels().set() per series per cycle."""
    reg = CollectorRegistry()
    gauges = {name: Gauge("clusterpulse_" + name.removesuffix("_total"), h,
                          ["node", "gpu", "uuid"], registry=reg)
              for _, name, h, _ in GPU_SERIES}

    def update():
        for s in agent.snapshot.gpus:
            for attr, name, _, _ in GPU_SERIES:
                v = getattr(s, attr)
                if v is not None:
                    gauges[name].labels("bench", str(s.index), s.uuid).set(v)
    return reg, update


def bench_collection() -> list[Row]:
    rows = []
    agent = _agent()
    sim_cycle = _cpu_per_call(agent.collect_once, 2000)
    rows.append(Row("collection cycle, 8 sim GPUs + 8 ranks (CPU)", sim_cycle * 1e3, "ms",
                    budget="< 5 ms"))
    fake = FakeNvml(gpus=GPUS)
    nvml_agent = _agent(NvmlBackend(nvml=fake))
    nvml_cycle = _cpu_per_call(nvml_agent.collect_once, 2000)
    rows.append(Row("collection cycle, 8 fake-NVML GPUs + 8 ranks (CPU)", nvml_cycle * 1e3, "ms",
                    budget="< 5 ms"))
    fake.calls.clear()
    nvml_agent.backend.collect()
    calls = sum(v for k, v in fake.calls.items() if k != "fields_requested")
    unbatched = calls - fake.calls["nvmlDeviceGetFieldValues"] + fake.calls["fields_requested"]
    rows.append(Row("NVML calls per GPU per cycle", calls / GPUS, "calls",
                    baseline=unbatched / GPUS, baseline_name="one call per field"))
    registry = CollectorRegistry(auto_describe=False)
    registry.register(AgentCollector(agent))
    ours = _cpu_per_call(lambda: generate_latest(registry), 500)
    ours_series = _series(generate_latest(registry))
    base_reg, update = _gauge_baseline(agent)
    base = _cpu_per_call(lambda: (update(), generate_latest(base_reg)), 500)
    base_series = _series(generate_latest(base_reg))
    rows.append(Row(f"update+render per series ({ours_series} series, CPU)",
                    ours / ours_series * 1e6, "us", baseline=base / base_series * 1e6,
                    baseline_name=f"Gauge objects .labels().set() ({base_series} series)"))
    return rows


def _latencies(url: str, scrapers: int = 50, per: int = 20) -> list[float]:
    def one(_):
        out = []
        with requests.Session() as s:
            for _ in range(per):
                t0 = time.perf_counter()
                s.get(url, timeout=10).raise_for_status()
                out.append(time.perf_counter() - t0)
        return out
    with ThreadPoolExecutor(scrapers) as ex:
        return [x for xs in ex.map(one, range(scrapers)) for x in xs]


def _serve(kind: str) -> tuple[subprocess.Popen, str]:
    port = free_port()
    p = subprocess.Popen([sys.executable, "-m", "tests.bench.scrape_server", kind, str(port)],
                         stdin=subprocess.PIPE, stdout=subprocess.PIPE, text=True)
    assert p.stdout.readline().strip() == "ready"
    return p, f"http://127.0.0.1:{port}/metrics"


def bench_scrape_latency() -> list[Row]:
    result = {}
    for kind in ("ours", "baseline"):
        p, url = _serve(kind)
        try:
            _latencies(url, scrapers=5, per=5)  # warm up
            result[kind] = _latencies(url)
        finally:
            p.stdin.close()
            p.wait()
    p = lambda xs, q: statistics.quantiles(xs, n=100)[q - 1] * 1e3  # noqa: E731
    one = _latencies  # a single scraper: the latency Prometheus itself sees
    solo = {}
    for kind in ("ours", "baseline"):
        proc, url = _serve(kind)
        try:
            solo[kind] = statistics.median(one(url, scrapers=1, per=200)) * 1e3
        finally:
            proc.stdin.close()
            proc.wait()
    base = "prometheus_client WSGI server, same GPU data"
    return [
        Row("/metrics latency, 1 scraper (median)", solo["ours"], "ms",
            baseline=solo["baseline"], baseline_name=base, budget="< 10 ms"),
        Row("/metrics p50 latency, 50 concurrent scrapers", p(result["ours"], 50), "ms",
            baseline=p(result["baseline"], 50), baseline_name=base),
        Row("/metrics p99 latency, 50 concurrent scrapers", p(result["ours"], 99), "ms",
            baseline=p(result["baseline"], 99), baseline_name=base),
    ]


def bench_slowloris(slow: int = 1000, probes: int = 50) -> list[Row]:
    """/metrics while `slow` connections hold the server (half silent, half stopped in
    their head), from the same address: the latency of a scrape and of a POST with a
    token, against the same probes on an idle server (issue #29)."""
    proc, url = _serve("ours")
    port = int(url.split(":")[2].split("/")[0])
    try:
        def probe() -> tuple[list[float], int]:
            times, failed = [], 0
            for _ in range(probes):
                t0 = time.perf_counter()
                try:
                    ok = requests.get(url, timeout=10).status_code == 200
                except requests.RequestException:
                    ok = False
                times.append(time.perf_counter() - t0)
                failed += not ok
            return times, failed

        idle, _ = probe()
        held = []
        for i in range(slow):
            s = socket.create_connection(("127.0.0.1", port), timeout=30)
            if i % 2:
                s.sendall(b"GET /metrics HTTP/1.1\r\nX-Slow: ")
            held.append(s)
        try:
            loaded, failed = probe()
        finally:
            for s in held:
                s.close()
    finally:
        proc.stdin.close()
        proc.wait()
    q = lambda xs, n: statistics.quantiles(xs, n=100)[n - 1] * 1e3  # noqa: E731
    return [
        Row(f"/metrics p50 latency, {slow} slow connections open", q(loaded, 50), "ms",
            baseline=q(idle, 50), baseline_name="no slow connection", budget="< 1000 ms"),
        Row(f"/metrics max latency, {slow} slow connections open", max(loaded) * 1e3, "ms",
            baseline=max(idle) * 1e3, baseline_name="no slow connection",
            budget="< 1000 ms"),
        Row(f"/metrics probes failed, {slow} slow connections open", failed, "of "
            f"{probes}", budget="0"),
    ]


def _proc_cpu_seconds(pid: int) -> float:
    with open(f"/proc/{pid}/stat") as f:
        fields = f.read().rsplit(")", 1)[1].split()
    return (int(fields[11]) + int(fields[12])) / os.sysconf("SC_CLK_TCK")


def bench_cpu_share(seconds: float = 15.0) -> list[Row]:
    port, path = free_port(), socket_path("bench")
    p = subprocess.Popen([sys.executable, "-m", "clusterpulse.agent", "--backend", "sim",
                          "--gpus", "8",
                          "--listen", f"127.0.0.1:{port}", "--telemetry", f"unix:{path}",
                          "--interval", "1"], stdout=subprocess.DEVNULL)
    try:
        deadline = time.time() + 20
        while time.time() < deadline:
            try:
                requests.get(f"http://127.0.0.1:{port}/healthz", timeout=1)
                break
            except requests.RequestException:
                time.sleep(0.1)
        sock = connect(path)
        cpu0, t0 = _proc_cpu_seconds(p.pid), time.time()
        step = 0
        while time.time() - t0 < seconds:  # 8 ranks at 10 steps/s, a scrape every second
            step += 1
            for r in range(RANKS):
                sock.send(protocol.encode({"type": "step", "run": "b", "rank": r, "gpu": r,
                                           "step": step, "step_seconds": 0.1}))
            if step % 10 == 0:
                requests.get(f"http://127.0.0.1:{port}/metrics", timeout=5)
            time.sleep(0.1)
        share = (_proc_cpu_seconds(p.pid) - cpu0) / (time.time() - t0)
    finally:
        p.terminate()
        p.wait()
    return [Row("agent CPU share: 1 s interval, 8 GPUs, 8 ranks at 10 Hz, 1 scrape/s",
                share * 100, "% core", budget="< 1 %")]


def _receive_cpu_per_datagram(unix: bool, batches: int = 500, per: int = 8) -> float:
    """CPU the receiver spends on one valid message: recv, decode, registry, reply (the
    sender's identity is taken once, when its connection is accepted, not per message)."""
    ranks = RankRegistry()
    agent = Agent(SimBackend(gpus=GPUS, activity=ranks.activity), "bench", ranks,
                  AuditLog(None), telemetry_addr=socket_path("rx") if unix else ("127.0.0.1", 0))
    assert agent.receiver is not None
    if unix:
        tx = connect(agent.telemetry_address.removeprefix("unix:"))
        tx.setblocking(False)  # the reply drain below must not wait for more
        agent.receiver.round(timeout=1)  # accept the connection
    else:
        tx = socket.socket(socket.AF_INET, socket.SOCK_DGRAM)
        tx.connect(("127.0.0.1", agent.telemetry_port))
    msg = protocol.encode({"type": "step", "run": "b", "rank": 0, "gpu": 0, "step": 1,
                           "step_seconds": 0.1, "compute_seconds": 0.08, "loss": 2.0})
    spent = 0.0
    try:
        for _ in range(batches):
            for _ in range(per):
                tx.send(msg)
            t0 = time.process_time()
            agent.receiver.round(timeout=1)  # one round reads a user's whole batch
            spent += time.process_time() - t0
            while True:  # drain the replies
                try:
                    tx.recv(8192, socket.MSG_DONTWAIT)
                except (BlockingIOError, TimeoutError):
                    break
    finally:
        tx.close()
        agent.stop()
    return spent / (batches * per)


def bench_telemetry_receive() -> list[Row]:
    unix = _receive_cpu_per_datagram(True)
    udp = _receive_cpu_per_datagram(False)
    return [Row("telemetry receive per message, Unix connection, kernel-verified (CPU)",
                unix * 1e6, "us", baseline=udp * 1e6,
                baseline_name="UDP, no sender identity")]


def _victim_under(hostile: bool, seconds: float = 10.0, rate_hz: float = 20.0) -> dict:
    """A healthy job's rank on a node that also holds (hostile=True) a hung 8-rank job
    that never reads its replies and another user flooding: the rank's loss, its worst
    heartbeat age (what RankHung reads), and the messages the agent got through."""
    from clusterpulse.trainer.telemetry import AgentLink

    ranks = RankRegistry()
    agent = Agent(SimBackend(gpus=GPUS, activity=ranks.activity), "bench", ranks,
                  AuditLog(None), telemetry_addr=socket_path("shared"))
    agent.start()
    path = agent.telemetry_address.removeprefix("unix:")
    other = None
    if hostile:  # another uid where we can switch to one (root), else the same user
        other = subprocess.Popen([SYSTEM_PYTHON, "-c", NEIGHBOURS, path, str(seconds + 2),
                                  "8", "4"],
                                 stdout=subprocess.PIPE, text=True,
                                 user=65534 if os.geteuid() == 0 else None)
        assert other.stdout is not None and other.stdout.readline().strip() == "ready"
    link = AgentLink(path, local_rank=0)
    worst_age, n = 0.0, int(seconds * rate_hz)
    handled0 = sum(agent.telemetry_counts.values())
    t0 = time.monotonic()
    try:
        for step in range(1, n + 1):
            link.send({"type": "step", "run": "victim", "rank": 0, "step": step})
            for r in ranks.of_run("victim"):
                worst_age = max(worst_age, ranks.age(r))
            time.sleep(max(0.0, t0 + step / rate_hz - time.monotonic()))
        time.sleep(0.5)
        got = sum(r.steps_total for r in ranks.of_run("victim"))
        rate = (sum(agent.telemetry_counts.values()) - handled0) / (time.monotonic() - t0)
    finally:
        link.close()
        if other is not None:
            other.kill()
            other.wait()
        agent.stop()
    return {"loss": 100.0 * (n - got) / n, "age": worst_age, "rate": rate}


def bench_shared_node() -> list[Row]:
    quiet, busy = _victim_under(False), _victim_under(True)
    who = "another uid" if os.geteuid() == 0 else "the same uid (not root)"
    return [
        Row(f"victim's lost messages: hung 8-rank job + flood from {who}", busy["loss"],
            "%", baseline=quiet["loss"], baseline_name="quiet node", budget="< 1 %"),
        Row("victim's worst heartbeat age at 20 steps/s, same node", busy["age"], "s",
            baseline=quiet["age"], baseline_name="quiet node", budget="< 3 s"),
        Row("messages/s the agent handled with the flood on", busy["rate"], "msg/s",
            baseline=quiet["rate"], baseline_name="quiet node (the victim alone)"),
    ]


def bench_memory(cycles: int = 10_000) -> list[Row]:
    agent = _agent()
    registry = CollectorRegistry(auto_describe=False)
    registry.register(AgentCollector(agent))

    def rss_mib() -> float:
        with open("/proc/self/statm") as f:
            return int(f.read().split()[1]) * resource.getpagesize() / 2**20

    for _ in range(1000):
        agent.collect_once()
        generate_latest(registry)
    early = rss_mib()
    for i in range(cycles - 1000):
        agent.collect_once()
        if i % 10 == 0:
            generate_latest(registry)
    late = rss_mib()
    return [Row(f"RSS growth from cycle 1,000 to {cycles:,}", late - early, "MiB",
                budget="flat (~0)")]


def run() -> list[Row]:
    return (bench_collection() + bench_telemetry_receive() + bench_shared_node()
            + bench_scrape_latency() + bench_slowloris() + bench_cpu_share() + bench_memory())
