"""Trainer benchmarks: instrumentation overhead against a truly bare loop, checkpoint
blocking (async vs sync), recovery time (fault -> first resumed step) for crash and
graceful restarts, and checkpoint verification (per-rank vs rank 0)."""

from __future__ import annotations

import hashlib
import json
import multiprocessing
import os
import signal
import subprocess
import sys
import tempfile
import time
from pathlib import Path

from clusterpulse.trainer.checkpoint import MANIFEST, verify
from deploy.local.stack import rank_pids
from tests.bench.table import Row
from tests.conftest import start_agent
from tests.support.procs import REPO
from tests.support.torchrun import launcher_cmd, start_logged, stop_group


def _worker(preset: str, agent: str) -> dict:
    with tempfile.TemporaryDirectory() as tmp:
        cmd = [sys.executable, "-m", "torch.distributed.run", "--standalone",
               "--nproc-per-node=2", "tests/bench/trainer_worker.py", agent, tmp, preset]
        p = subprocess.run(cmd, cwd=REPO, capture_output=True, text=True, timeout=900,
                           env={**os.environ, "OMP_NUM_THREADS": "1", "PYTHONPATH": str(REPO)})
        line = next((x for x in p.stdout.splitlines() if x.startswith("RESULT ")), None)
        assert line, p.stdout[-2000:] + p.stderr[-3000:]
        return json.loads(line[7:])


def bench_overhead_and_checkpoints() -> list[Row]:
    with tempfile.TemporaryDirectory() as tmp:
        running, server = start_agent(Path(tmp))
        try:
            rows = []
            for preset in ("tiny", "small"):
                r = _worker(preset, running.telemetry)
                rows.append(Row(f"step time with instrumentation ({preset}, 2 ranks DDP)",
                                r["instrumented"] * 1e3, "ms", baseline=r["bare"] * 1e3,
                                baseline_name="bare loop (no hook, no Pulse)",
                                budget="ratio <= 1.01"))
            rows.append(Row("consensus exchange (2 floats/rank all_gather on gloo, every 5 steps)",
                            r["consensus_ms_per_exchange"], "ms"))
            mib = r["state_bytes"] / 2**20
            rows.append(Row(f"checkpoint blocking, async ({mib:.0f} MiB model+optim, small)",
                            r["ckpt_async_s"] * 1e3, "ms", baseline=r["ckpt_sync_s"] * 1e3,
                            baseline_name="synchronous save", budget="ratio <= 0.10"))
            return rows
        finally:
            server.shutdown()
            running.agent.stop()


def _launch(tmp: Path, name: str, extra: list[str], max_restarts: int,
            steps: int = 60, ranks: int = 2, cold_start: bool = False) -> dict:
    ckpt = tmp / name
    args = ["--preset", "tiny", "--steps", str(steps), "--ckpt-every", "10", "--agent", "none",
            "--sim-compute-seconds", "0.02", "--ckpt-dir", str(ckpt),
            "--summary-json", str(ckpt / "summary.json"), *extra]
    p = start_logged(launcher_cmd(ranks, max_restarts, args, cold_start=cold_start),
                     tmp / f"{name}.log", tmp)
    try:
        assert p.wait(timeout=900) == 0, (tmp / f"{name}.log").read_text()[-3000:]
    finally:
        stop_group(p)
    return json.loads((ckpt / "summary.json").read_text())


def bench_recovery() -> list[Row]:
    """Under clusterpulse-train (the supported launcher), 2 ranks on one machine."""
    rows = []
    with tempfile.TemporaryDirectory() as tmp:
        crash = ["--inject", "crash:rank=1:step=35:mode=sigkill"]
        s = _launch(Path(tmp), "crash", crash, 2)
        (restart,) = s["restarts"]
        rows.append(Row("crash (SIGKILL) -> first resumed step", restart["downtime_seconds"], "s"))
        rows.append(Row("crash: steps recomputed (checkpoint every 10)",
                        restart["steps_recomputed"], "steps", budget="<= 10"))
        # ranks forked warm (the default) against new interpreters, 4 ranks each
        downtime = {}
        for cold in (False, True):
            name = f"crash4-{'cold' if cold else 'warm'}"
            s = _launch(Path(tmp), name, crash, 2, ranks=4, cold_start=cold)
            downtime[cold] = s["restarts"][0]["downtime_seconds"]
        rows.append(Row("crash, 4 ranks -> first resumed step (warm ranks)", downtime[False],
                        "s", baseline=downtime[True], baseline_name="--cold-start"))
        # 20 graceful restarts under --max-restarts 0: none may spend the failure budget
        # (an injection fires in the attempt it names; one per agreement, every 5 steps)
        graceful = [f"graceful:step={3 + 5 * i}:attempt={i}" for i in range(20)]
        s = _launch(Path(tmp), "graceful",
                    [arg for g in graceful for arg in ("--inject", g)], 0, steps=103)
        restarts = s["restarts"]
        assert len(restarts) == len(graceful) and all(
            r["cause"] == "checkpoint-restart" for r in restarts), restarts
        downtime = sorted(r["downtime_seconds"] for r in restarts)
        rows.append(Row("graceful restarts in one run under --max-restarts 0", len(restarts),
                        "restarts", budget=">= 20"))
        rows.append(Row("graceful request -> first resumed step (relaunch), median of 20",
                        downtime[len(downtime) // 2], "s"))
        rows.append(Row("graceful request -> first resumed step (relaunch), worst of 20",
                        downtime[-1], "s"))
        rows.append(Row("graceful: steps recomputed (all 20)",
                        sum(r["steps_recomputed"] for r in restarts), "steps", budget="0"))
    return rows


def _script_crash_downtime(tmp: Path, name: str, preload: list[str]) -> float:
    """examples/ddp_tutorial.py on 4 ranks: SIGKILL one rank once the first snapshot
    exists; seconds until every rank of the restart has loaded the snapshot."""
    snapshot, log = tmp / f"{name}.pt", tmp / f"{name}.log"
    cmd = launcher_cmd(4, 1, ["400", "1", "--snapshot", str(snapshot)],
                       script=str(REPO / "examples" / "ddp_tutorial.py"), preload=preload)
    p = start_logged(cmd, log, tmp, {"CLUSTERPULSE_AGENT": "none"})
    try:
        deadline = time.time() + 600
        while not snapshot.exists() or len(rank_pids([p.pid])) < 4:
            assert time.time() < deadline and p.poll() is None, log.read_text()[-3000:]
            time.sleep(0.05)
        os.kill(rank_pids([p.pid])[0], signal.SIGKILL)
        crashed = time.time()
        while log.read_text().count("Resuming training from snapshot") < 4:
            assert time.time() < deadline and p.poll() is None, log.read_text()[-3000:]
            time.sleep(0.02)
        return time.time() - crashed
    finally:
        stop_group(p)


def bench_script_recovery() -> list[Row]:
    """The README's recipe (a foreign script): a crash restart with its ranks forked
    from a server that imported torch (`--preload torch`) against new interpreters."""
    with tempfile.TemporaryDirectory() as tmp:
        warm = _script_crash_downtime(Path(tmp), "warm", ["torch"])
        cold = _script_crash_downtime(Path(tmp), "cold", [])
    return [Row("ddp_tutorial.py, 4 ranks: crash -> snapshot loaded on every rank "
                "(--preload torch)", warm, "s", baseline=cold, baseline_name="no --preload "
                "(new interpreters)")]


def _verify_share(args: tuple[str, int, int]) -> str | None:
    path, rank, world = args
    return verify(Path(path), rank, world)


def _fake_published(path: Path, mib: int, files: int) -> None:
    """A published checkpoint's shape: `files` shard files (as 4 ranks x 2 writer threads
    would write) and a manifest of their checksums. Only verification is timed."""
    path.mkdir()
    sums = {}
    for i in range(files):
        name = f"__{i // 2}_{i % 2}.distcp"
        (path / name).write_bytes(os.urandom(mib * 2**20 // files))
        sums[name] = hashlib.sha256((path / name).read_bytes()).hexdigest()
    (path / MANIFEST).write_text(json.dumps({"step": 1, "files": sums}))


def bench_verify() -> list[Row]:
    """Checkpoint verification at resume: 4 ranks each hashing a quarter of the files
    (4 processes, as the ranks do) against rank 0 hashing every file. Files are in the
    page cache for both. On this 2-core machine at most 2 hash at once; on a cluster
    each rank has its own cores and its own storage bandwidth share."""
    rows = []
    for mib in (64, 512):
        with tempfile.TemporaryDirectory() as tmp:
            path = Path(tmp) / "step-00000001"
            _fake_published(path, mib, 8)
            t0 = time.perf_counter()
            assert verify(path) is None
            alone = time.perf_counter() - t0
            with multiprocessing.get_context("fork").Pool(4) as pool:
                pool.map(abs, range(4))  # workers started before timing
                t0 = time.perf_counter()
                assert pool.map(_verify_share, [(str(path), r, 4) for r in range(4)]) == [None] * 4
                shared = time.perf_counter() - t0
            rows.append(Row(f"verify {mib} MiB checkpoint (8 files), 4 ranks in parallel",
                            shared, "s", baseline=alone, baseline_name="rank 0 hashes all"))
    return rows


def _step_times(model, pulse, steps: int) -> list[float]:
    """Host seconds per step (forward, backward, with Pulse's step when given)."""
    import contextlib

    import torch

    x, out = torch.ones(1, 4), []
    for step in range(1, steps + 1):
        t0 = time.perf_counter()
        with pulse.step(step) if pulse else contextlib.nullcontext():
            model(x).sum().backward()
        out.append(time.perf_counter() - t0)
    return out


def bench_hook_host_cost() -> list[Row]:
    """attach_ddp's host time per step against the parameter count (issue #26: a hook
    per parameter cost one Python call per parameter per backward). One process, a
    world of one on gloo, models of many tiny parameters so that the hooks, not the
    arithmetic, are what grows; blocks alternate so that noise hits both alike."""
    import statistics

    import torch.distributed as dist
    from torch import nn

    from clusterpulse.trainer.instrument import Pulse

    rows = []
    with tempfile.TemporaryDirectory() as tmp:
        dist.init_process_group("gloo", init_method=f"file://{tmp}/store", rank=0,
                                world_size=1)
        try:
            for n_params in (10, 2000):
                def build(n: int = n_params) -> nn.Module:
                    return nn.parallel.DistributedDataParallel(
                        nn.Sequential(*(nn.Linear(4, 4) for _ in range(n // 2))))
                bare, hooked = build(), build()
                pulse = Pulse(run="bench", agent=None, world_size=1, catch_sigterm=False)
                pulse.attach_ddp(hooked)
                times: dict[str, list[float]] = {"bare": [], "hooked": []}
                for _ in range(5):
                    times["bare"] += _step_times(bare, None, 40)[5:]
                    times["hooked"] += _step_times(hooked, pulse, 40)[5:]
                pulse.close()
                rows.append(Row(f"host time per step, attach_ddp + Pulse ({n_params} params)",
                                statistics.median(times["hooked"]) * 1e3, "ms",
                                baseline=statistics.median(times["bare"]) * 1e3,
                                baseline_name="same DDP model, no Pulse",
                                budget="+0.2 ms at any size"))
        finally:
            dist.destroy_process_group()
    return rows


def bench_instrument_host_cost(layer_counts: tuple[int, ...] = (1, 64), blocks: int = 20,
                               steps: int = 50) -> list[Row]:
    """The instrumentation's host time per step (issue #26: <= 0.2 ms at any model
    size): the README recipe's loop (pulse.data, step, two sections, s.loss, boundary,
    attach_ddp, telemetry to a real agent process) against the same loop bare, on a
    tiny CPU model so that the model's own time is small and stable. Bare and
    instrumented alternate in blocks (ABBA); the median of the paired differences is
    the cost. Then where it goes (a run with every part timed, exclusive of nested
    parts) and the Python calls per step (sys.setprofile), at two model sizes: the
    calls must not grow with the model."""
    import statistics

    import torch

    from clusterpulse.detection.scoring import StragglerScorer
    from clusterpulse.trainer.consensus import Consensus
    from clusterpulse.trainer.instrument import Pulse
    from tests.bench.bench_gpu import agent_process, process_group
    from tests.bench.recipe_loop import Parts, Recipe, added_calls, draining_socket

    rows: list[Row] = []
    with tempfile.TemporaryDirectory() as tmpdir:
        tmp = Path(tmpdir)
        with agent_process(tmp) as agent, process_group(torch.device("cpu"), tmp):
            where = "real agent" if agent else "no agent: it did not start"
            for layers in layer_counts:
                bare, inst = Recipe(layers), Recipe(layers)
                pulse = Pulse(run="bench", agent=agent or None, world_size=1,
                              catch_sigterm=False)
                try:
                    pulse.attach_ddp(inst.model)
                    bare.run(20)
                    inst.run(20, pulse)
                    # wall and this thread's CPU time: on a shared machine the wall
                    # clock also counts waiting for a core (the agent process's too)
                    wall: dict[str, list[float]] = {"bare": [], "inst": []}
                    cpu: dict[str, list[float]] = {"bare": [], "inst": []}
                    for block in range(blocks):
                        for mode in ("bare", "inst") if block % 2 == 0 else ("inst", "bare"):
                            t0, c0 = time.perf_counter(), time.thread_time()
                            if mode == "bare":
                                bare.run(steps)
                            else:
                                inst.run(steps, pulse)
                            cpu[mode].append((time.thread_time() - c0) / steps * 1e3)
                            wall[mode].append((time.perf_counter() - t0) / steps * 1e3)
                    for clock, per_step in (("CPU", cpu), ("wall", wall)):
                        diffs = [i - b for b, i in zip(per_step["bare"], per_step["inst"],
                                                       strict=True)]
                        rows.append(Row(f"recipe loop, host {clock} time per step ({layers} "
                                        f"layers, {where})", statistics.median(per_step["inst"]),
                                        "ms", baseline=statistics.median(per_step["bare"]),
                                        baseline_name="same loop bare"))
                        rows.append(Row(f"  instrumentation, paired median of {clock} time "
                                        f"({layers} layers)", statistics.median(diffs), "ms",
                                        budget="<= 0.2 ms"))
                    parts = Parts()
                    pulse._resolve = parts.wrap("resolve", pulse._resolve)  # type: ignore[method-assign]
                    pulse.link.send = parts.wrap("send", pulse.link.send)  # type: ignore[method-assign]
                    saved = Consensus.exchange, StragglerScorer.observe
                    Consensus.exchange = parts.wrap("consensus exchange", Consensus.exchange)  # type: ignore[method-assign]
                    StragglerScorer.observe = parts.wrap("scorer", StragglerScorer.observe)  # type: ignore[method-assign]
                    try:
                        n = blocks * steps // 2
                        inst.run_parts(n, pulse, parts)
                    finally:
                        Consensus.exchange, StragglerScorer.observe = saved  # type: ignore[method-assign]
                        del pulse._resolve, pulse.link.send
                    for name, ns in parts.ns.items():
                        rows.append(Row(f"  part: {name} ({layers} layers, CPU, exclusive)",
                                        ns / n / 1e3, "us"))
                    with draining_socket(tmp / f"drain-{layers}.sock") as quiet:
                        added, own = added_calls(quiet, layers, 50)
                    rows.append(Row(f"Python calls per step added by the instrumentation "
                                    f"({layers} layers; socket that never replies)", added,
                                    "calls", baseline=own,
                                    baseline_name="the bare loop's own",
                                    budget="constant in model size"))
                finally:
                    pulse.close()
    rows += scorer_host_cost()
    return rows


def scorer_host_cost(worlds: tuple[int, ...] = (8, 64), steps: int = 2000) -> list[Row]:
    """The straggler scorer's CPU time per step on every rank of a world of more than
    one (a world of one runs none: no peers, so the recipe loop above, a world of one,
    does not pay it): one evaluation every 5 steps over the gathered times, as the
    exchange feeds it, after its warm-up and windows are full."""
    import numpy as np

    from clusterpulse.detection.scoring import StragglerScorer

    rows = []
    for world in worlds:
        rng = np.random.default_rng(world)
        blocks = [rng.gamma(400, 1 / 400, size=(5, world)) for _ in range(steps // 5)]
        scorer = StragglerScorer(world)
        for block in blocks[:100]:  # 500 steps: past the warm-up, every window full
            scorer.observe(block)
        c0 = time.thread_time()
        for block in blocks[100:]:
            scorer.observe(block)
        per_step = (time.thread_time() - c0) / (len(blocks) - 100) / 5
        rows.append(Row(f"  straggler scorer per step ({world} ranks; every rank runs it)",
                        per_step * 1e6, "us"))
    return rows


def run() -> list[Row]:
    return (bench_overhead_and_checkpoints() + bench_hook_host_cost()
            + bench_instrument_host_cost() + bench_recovery()
            + bench_script_recovery() + bench_verify())


if __name__ == "__main__":  # one part alone: python -m tests.bench.bench_trainer
    from tests.bench.table import render

    print(render(bench_instrument_host_cost()))
