"""Every GPU figure in one run, printed as one table (tests/bench/table.py rows):

- instrumentation overhead: the reference trainer's step (bf16 autocast, fused AdamW,
  DDP with world size 1 on NCCL) bare against the same step under Pulse (section timing,
  DDP comm hook, telemetry to a real agent process, step-boundary agreement), for the
  tiny, small and 125m presets, eager and under torch.compile;
- async against sync checkpoint blocking at 125m and 1b (what the loop waits for);
- NVML collection time per GPU (the agent's NVML backend);
- tokens/s and MFU of the instrumented steps, and of the reference trainer itself
  (torchrun, one rank, 125m, bf16: its run summary).

Bare and instrumented run in alternating blocks (ABBA order) of CUDA-synchronized steps,
so that clock and thermal drift hit both alike; each pair of neighbouring blocks gives
one paired difference, and the table shows the medians. A figure that cannot be taken
(no GPU, no NVML, no time left in --budget-s) is a row saying why, never a silent gap.

  python -m tests.bench.bench_gpu                 # all of it, about 4-5 min on an H200
  python -m tests.bench.bench_gpu --presets 125m --no-compile --ckpt-presets 125m
  python -m tests.bench.bench_gpu --cpu --presets tiny --blocks 2 --steps 2 \\
      --ckpt-presets tiny                         # the CPU path, seconds (CI runs this)
"""

from __future__ import annotations

import argparse
import contextlib
import json
import math
import os
import shutil
import signal
import statistics
import subprocess
import sys
import tempfile
import time
from collections.abc import Callable, Iterator
from dataclasses import dataclass, field
from pathlib import Path

import torch
import torch.distributed as dist
import torch.nn.functional as F

from clusterpulse.trainer.checkpoint import CheckpointManager
from clusterpulse.trainer.data import SyntheticTokens
from clusterpulse.trainer.flops import mfu, peak_bf16
from clusterpulse.trainer.instrument import Pulse
from clusterpulse.trainer.model import PRESETS, build_model
from clusterpulse.trainer.state import TrainState
from clusterpulse.trainer.telemetry import parse_agent_addr
from tests.bench.table import Row, fmt, render
from tests.support.procs import REPO


@dataclass
class Options:
    device: torch.device
    presets: list[str] = field(default_factory=lambda: ["tiny", "small", "125m"])
    ckpt_presets: list[str] = field(default_factory=lambda: ["125m", "1b"])
    compile: bool = True
    blocks: int = 6
    steps: int = 10  # per block
    batch: int = 16  # sequences per step
    budget_s: float = 280.0
    ckpt_dir: Path | None = None


class Budget:
    """The run must fit its time: a part that would start too late says so instead."""

    def __init__(self, seconds: float) -> None:
        self.deadline = time.monotonic() + seconds

    def left(self) -> float:
        return self.deadline - time.monotonic()


def _sync(device: torch.device) -> None:
    if device.type == "cuda":
        torch.cuda.synchronize(device)


def _fused_adamw(params: Iterator[torch.nn.Parameter], device: torch.device
                 ) -> torch.optim.Optimizer:
    """Fused AdamW (one kernel for all parameters) where this torch has it for the device."""
    try:
        return torch.optim.AdamW(params, lr=1e-4, weight_decay=0.0, fused=True)
    except (RuntimeError, TypeError):  # an older torch without fused on this device
        return torch.optim.AdamW(params, lr=1e-4, weight_decay=0.0)


class Loop:
    """The reference trainer's step on one model: bf16 autocast forward and loss,
    backward, fused AdamW; DDP (world size 1) when there is a process group."""

    def __init__(self, preset: str, device: torch.device, ddp: bool, compile_: bool,
                 batch: int) -> None:
        self.mc = PRESETS[preset]
        self.device = device
        self.model = build_model(preset, 1).to(device)
        self.ddp = (torch.nn.parallel.DistributedDataParallel(
            self.model, device_ids=[device.index] if device.type == "cuda" else None)
            if ddp else None)
        module = self.ddp if self.ddp is not None else self.model
        self.forward = torch.compile(module) if compile_ else module
        self.opt = _fused_adamw(self.model.parameters(), device)
        self.data = SyntheticTokens(1, self.mc.vocab, self.mc.seq_len, batch)

    def batch(self, step: int) -> tuple[torch.Tensor, torch.Tensor]:
        x, y = self.data.shard(step, 0, 1)
        return x.to(self.device, non_blocking=True), y.to(self.device, non_blocking=True)

    def forward_backward(self, x: torch.Tensor, y: torch.Tensor) -> torch.Tensor:
        with torch.autocast(self.device.type, dtype=torch.bfloat16):
            logits = self.forward(x)
            loss = F.cross_entropy(logits.reshape(-1, logits.shape[-1]), y.reshape(-1))
        loss.backward()
        return loss

    def optimizer(self) -> None:
        self.opt.step()
        self.opt.zero_grad(set_to_none=True)

    def bare(self, step: int) -> None:
        x, y = self.batch(step)
        self.forward_backward(x, y)
        self.optimizer()

    def instrumented(self, pulse: Pulse, step: int) -> None:
        with pulse.step(step) as s:
            with s.section("data"):
                x, y = self.batch(step)
            with s.section("forward_backward"):
                loss = self.forward_backward(x, y)
            with s.section("optimizer"):
                self.optimizer()
            s.loss = loss.detach()
            s.samples, s.tokens = x.shape[0], x.numel()
        pulse.boundary(step)


@dataclass
class Overhead:
    bare_s: float  # median seconds per step
    instrumented_s: float
    paired_diff: list[float]  # instrumented - bare, per neighbouring pair of blocks
    tokens_per_step: int


def measure_overhead(preset: str, opts: Options, agent: str | None, ddp: bool,
                     compile_: bool) -> Overhead:
    device = opts.device
    bare, inst = (Loop(preset, device, ddp, compile_, opts.batch) for _ in range(2))
    pulse = Pulse(run="bench-gpu", agent=parse_agent_addr(agent) if agent else None,
                  world_size=1, consensus_every=5, catch_sigterm=False)
    try:
        if inst.ddp is not None:
            pulse.attach_ddp(inst.ddp)
        step = 0
        for _ in range(2):  # warm-up (compilation, autotuning, allocator) outside the blocks
            step += 1
            bare.bare(step)
            inst.instrumented(pulse, step)
        _sync(device)
        per_step: dict[str, list[float]] = {"bare": [], "instrumented": []}
        for block in range(opts.blocks):
            order = ("bare", "instrumented") if block % 2 == 0 else ("instrumented", "bare")
            for mode in order:
                _sync(device)
                t0 = time.perf_counter()
                for _ in range(opts.steps):
                    step += 1
                    if mode == "bare":
                        bare.bare(step)
                    else:
                        inst.instrumented(pulse, step)
                _sync(device)
                per_step[mode].append((time.perf_counter() - t0) / opts.steps)
        diffs = [i - b for b, i in zip(per_step["bare"], per_step["instrumented"], strict=True)]
        return Overhead(statistics.median(per_step["bare"]),
                        statistics.median(per_step["instrumented"]), diffs,
                        opts.batch * inst.mc.seq_len)
    finally:
        pulse.close()
        del bare, inst
        if device.type == "cuda":
            torch.cuda.empty_cache()


def measure_checkpoint_blocking(preset: str, opts: Options, root: Path
                                ) -> tuple[float, float, int]:
    """Seconds the loop blocks for a sync save (one) and an async one (the last of two:
    the first also allocates and pins its host buffers), and the state's bytes."""
    loop = Loop(preset, opts.device, ddp=False, compile_=False, batch=1)
    loop.bare(0)  # the optimizer's state exists from the first step on
    sched = torch.optim.lr_scheduler.LambdaLR(loop.opt, lambda s: 1.0)
    state = TrainState(loop.model, loop.opt, sched)
    nbytes = sum(t.numel() * t.element_size() for t in loop.model.state_dict().values())
    nbytes += sum(v.numel() * v.element_size() for s in loop.opt.state.values()
                  for v in s.values() if isinstance(v, torch.Tensor))
    blocked: dict[str, float] = {}
    try:
        for mode, saves in (("sync", 1), ("async", 2)):
            # as the trainer does: async saves on a gloo group of their own (DCP refuses an
            # NCCL-only group for them; trainer/main.py)
            group = (dist.new_group(backend="gloo")
                     if mode == "async" and dist.is_initialized() else None)
            mgr = CheckpointManager(root / f"{preset}-{mode}", rank=0, keep=1,
                                    async_save=mode == "async", group=group)
            for i in range(saves):
                _sync(opts.device)
                blocked[mode] = mgr.save(i + 1, {"app": state})
                mgr.wait()
            if mgr.failures:
                raise RuntimeError(f"{mgr.failures} {mode} checkpoint(s) failed (see the log)")
            shutil.rmtree(root / f"{preset}-{mode}", ignore_errors=True)
    finally:
        del loop, state
        if opts.device.type == "cuda":
            torch.cuda.empty_cache()
    return blocked["sync"], blocked["async"], nbytes


def measure_nvml(repeats: int = 20) -> tuple[float, int]:
    """Seconds per GPU of one collection cycle of the agent's NVML backend."""
    from clusterpulse.agent.backends.nvml import NvmlBackend

    backend = NvmlBackend()
    try:
        gpus = len(backend.collect())  # the first cycle also reads static fields
        if not gpus:
            raise RuntimeError("NVML reports no GPU")
        t0 = time.perf_counter()
        for _ in range(repeats):
            backend.collect()
        return (time.perf_counter() - t0) / repeats / gpus, gpus
    finally:
        backend.close()


@contextlib.contextmanager
def agent_process(tmp: Path) -> Iterator[str | None]:
    """A real node agent (simulated GPUs) in its own process, for the ranks' telemetry;
    None (and the table says so) if it does not come up."""
    from tests.support.ports import free_port

    sock = tmp / "t.sock"
    log = open(tmp / "agent.log", "w")  # noqa: SIM115 (closed below)
    proc = subprocess.Popen(
        [sys.executable, "-m", "clusterpulse.agent", "--backend", "sim", "--node", "bench",
         "--gpus", "1", "--listen", f"127.0.0.1:{free_port()}", "--telemetry", f"unix:{sock}",
         "--audit-log", str(tmp / "audit.jsonl")],
        cwd=REPO, stdout=log, stderr=subprocess.STDOUT, start_new_session=True,
        env={**os.environ, "PYTHONPATH": str(REPO)})
    try:
        deadline = time.monotonic() + 20
        while not sock.exists() and proc.poll() is None and time.monotonic() < deadline:
            time.sleep(0.1)
        yield f"unix:{sock}" if sock.exists() else None
    finally:
        with contextlib.suppress(ProcessLookupError):
            os.killpg(proc.pid, signal.SIGTERM)
        proc.wait(timeout=10)
        log.close()


@contextlib.contextmanager
def process_group(device: torch.device, tmp: Path) -> Iterator[str]:
    """World size 1 on NCCL (gloo on CPU), as torchrun gives one rank. Yields what the
    overhead rows say about DDP."""
    backend = "nccl" if device.type == "cuda" else "gloo"
    try:
        dist.init_process_group(backend, init_method=f"file://{tmp / 'pg-store'}", rank=0,
                                world_size=1)
    except (RuntimeError, ValueError) as err:
        yield f"no DDP: {backend} did not start ({type(err).__name__}: {err})"[:160]
        return
    try:
        yield f"DDP world 1 on {backend}"
    finally:
        dist.destroy_process_group()


def _skip(what: str, why: str) -> Row:
    return Row(f"{what}: skipped ({why})", math.nan, "")


def _guard(rows: list[Row], what: str, budget: Budget, need_s: float,
           fn: Callable[[], list[Row]]) -> None:
    """Run one part: its rows, or one row saying why it has none (never a traceback
    that hides the other parts' figures)."""
    if budget.left() < need_s:
        rows.append(_skip(what, f"time budget: {budget.left():.0f} s left, needs ~{need_s:.0f}"))
        return
    t0, before = time.monotonic(), len(rows)
    try:
        rows += fn()
    except Exception as err:  # one failed part must not hide the others
        rows.append(Row(f"{what}: FAILED ({type(err).__name__}: {err})"[:200], math.nan, ""))
    print(f"  {what}: {time.monotonic() - t0:.0f} s", file=sys.stderr, flush=True)
    for r in rows[before:]:  # as they come: a run stopped from outside keeps its figures
        print(f"    {r.what}: {fmt(r.ours)} {r.unit}"
              + (f" (baseline {fmt(r.baseline)})" if r.baseline else ""),
              file=sys.stderr, flush=True)


def collect(opts: Options) -> list[Row]:
    """Every figure, as table rows; CPU-only parts run anywhere (the CI smoke test)."""
    budget = Budget(opts.budget_s)
    rows: list[Row] = []
    cuda = opts.device.type == "cuda"
    name = torch.cuda.get_device_name(opts.device) if cuda else "CPU"
    rows.append(Row(f"device: {name}, torch {torch.__version__}, "
                    f"CUDA {torch.version.cuda or '-'}", math.nan, ""))
    if cuda:
        _guard(rows, "NVML collection", budget, 5, lambda: [
            Row(f"NVML collection per GPU ({gpus} GPU, agent's backend)", s * 1e3, "ms")
            for s, gpus in [measure_nvml()]])
    else:
        rows.append(_skip("NVML collection", "no GPU"))
    tmp = Path(tempfile.mkdtemp(prefix="cpgpu-"))
    ckpt_root = opts.ckpt_dir or tmp
    try:
        with agent_process(tmp) as agent, process_group(opts.device, tmp) as how:
            ddp = how.startswith("DDP")
            sent = "telemetry to an agent process" if agent else "no agent: telemetry dropped"
            rows.append(Row(f"overhead set-up: {how}; bf16 autocast; fused AdamW; {sent}; "
                            f"batch {opts.batch}", math.nan, ""))
            # eager first, then the checkpoints and the trainer itself, the compiles last:
            # what is skipped when time runs short is what takes longest to measure
            for preset in opts.presets:
                _guard(rows, f"overhead {preset}, eager", budget, 10,
                       lambda p=preset: _overhead_rows(p, f"{p}, eager", opts, agent, ddp,
                                                       False, cuda, name))
            for i, preset in enumerate(opts.ckpt_presets):
                _guard(rows, f"checkpoint blocking {preset}", budget, 20 if i == 0 else 90,
                       lambda p=preset: _ckpt_rows(p, opts, ckpt_root))
            if cuda:
                _guard(rows, "reference trainer CLI", budget, 30,
                       lambda: _trainer_cli_rows(opts, tmp))
            for preset in opts.presets if opts.compile else []:
                _guard(rows, f"overhead {preset}, torch.compile", budget, 45,
                       lambda p=preset: _overhead_rows(p, f"{p}, torch.compile", opts, agent,
                                                       ddp, True, cuda, name))
    finally:
        shutil.rmtree(tmp, ignore_errors=True)
    return rows


def _overhead_rows(preset: str, tag: str, opts: Options, agent: str | None, ddp: bool,
                   compile_: bool, cuda: bool, name: str) -> list[Row]:
    o = measure_overhead(preset, opts, agent, ddp, compile_)
    diffs = sorted(o.paired_diff)
    rel = statistics.median(d / o.bare_s for d in diffs) * 100
    rows = [Row(f"step time instrumented ({tag})", o.instrumented_s * 1e3, "ms",
                baseline=o.bare_s * 1e3, baseline_name="bare step", budget="ratio <= 1.01"),
            Row(f"paired difference instrumented - bare ({tag}), median of {len(diffs)}; "
                f"range {diffs[0] * 1e3:+.3f}..{diffs[-1] * 1e3:+.3f} ms",
                statistics.median(diffs) * 1e3, "ms", budget=f"{rel:+.2f} % of bare")]
    tokens_s = o.tokens_per_step / o.instrumented_s
    rows.append(Row(f"tokens/s, instrumented ({tag})", tokens_s, "tokens/s"))
    share = mfu(tokens_s, PRESETS[preset], 1, name) if cuda else None
    if share is not None:
        rows.append(Row(f"MFU, instrumented ({tag}; PaLM FLOPs count, bf16 peak "
                        f"{(peak_bf16(name) or 0) / 1e12:.0f} TFLOP/s)", share * 100, "%"))
    else:
        rows.append(_skip(f"MFU ({tag})", "no bf16 peak known for " + name))
    return rows


def _ckpt_rows(preset: str, opts: Options, root: Path) -> list[Row]:
    sync_s, async_s, nbytes = measure_checkpoint_blocking(preset, opts, root)
    return [Row(f"checkpoint blocking, async ({preset}, {nbytes / 2**30:.2f} GiB model+optim)",
                async_s * 1e3, "ms", baseline=sync_s * 1e3, baseline_name="synchronous save",
                budget="ratio <= 0.10")]


def _trainer_cli_rows(opts: Options, tmp: Path, preset: str = "125m") -> list[Row]:
    """The reference trainer itself (torchrun, one rank, bf16): its run summary's
    tokens/s and MFU, timed from the end of its first step."""
    ckpt = tmp / "trainer-cli"
    cmd = [sys.executable, "-m", "torch.distributed.run", "--standalone", "--nproc-per-node=1",
           "-m", "clusterpulse.trainer", "--preset", preset, "--dtype", "bf16", "--steps", "40",
           "--global-batch", str(opts.batch), "--agent", "none", "--ckpt-dir", str(ckpt),
           "--summary-json", str(ckpt / "summary.json")]
    p = subprocess.run(cmd, cwd=REPO, capture_output=True, text=True, timeout=240,
                       env={**os.environ, "PYTHONPATH": str(REPO)})
    if p.returncode != 0:
        raise RuntimeError(f"trainer exit {p.returncode}: {(p.stderr or p.stdout)[-300:]}")
    s = json.loads((ckpt / "summary.json").read_text())
    tag = f"reference trainer CLI, {preset}, bf16, eager, batch {opts.batch}, 1 rank"
    rows = [Row(f"tokens/s ({tag})", s["tokens_per_second"], "tokens/s")]
    if s["mfu"] is not None:
        rows.append(Row(f"MFU ({tag}; PaLM FLOPs count)", s["mfu"] * 100, "%"))
    else:
        rows.append(_skip(f"MFU ({tag})", "no bf16 peak known for this GPU"))
    return rows


def run() -> list[Row]:
    """For tests/bench/run.py (`--only bench_gpu`)."""
    if not torch.cuda.is_available():
        return [_skip("GPU benchmarks", "no CUDA device")]
    return collect(Options(device=torch.device("cuda", 0)))


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0],
                                epilog=__doc__.split("\n\n", 3)[-1],
                                formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--cpu", action="store_true", help="run the CPU path (no GPU figures)")
    p.add_argument("--presets", nargs="+", choices=sorted(PRESETS),
                   default=["tiny", "small", "125m"], help="overhead presets")
    p.add_argument("--ckpt-presets", nargs="*", choices=sorted(PRESETS), default=["125m", "1b"],
                   help="checkpoint-blocking presets (none: skip)")
    p.add_argument("--no-compile", action="store_true", help="skip the torch.compile rows")
    p.add_argument("--blocks", type=int, default=6, help="alternating blocks per mode")
    p.add_argument("--steps", type=int, default=10, help="steps per block")
    p.add_argument("--batch", type=int, default=16, help="sequences per step")
    p.add_argument("--budget-s", type=float, default=280.0,
                   help="parts that would start after this many seconds are skipped")
    p.add_argument("--ckpt-dir", type=Path, help="where checkpoints are written (default: "
                   "a temporary directory; 1b needs ~25 GB)")
    a = p.parse_args(argv)
    if a.blocks < 2 or a.steps < 1 or a.batch < 1:
        p.error("--blocks must be >= 2, --steps and --batch >= 1")
    if not a.cpu and not torch.cuda.is_available():
        print("bench_gpu: no CUDA device: every GPU figure is skipped (run with --cpu for "
              "the CPU path)", flush=True)
        print(render(run()))
        return 0
    device = torch.device("cpu") if a.cpu else torch.device("cuda", 0)
    if device.type == "cuda":
        torch.cuda.set_device(device)
    opts = Options(device=device, presets=a.presets, ckpt_presets=a.ckpt_presets,
                   compile=not a.no_compile, blocks=a.blocks, steps=a.steps, batch=a.batch,
                   budget_s=a.budget_s, ckpt_dir=a.ckpt_dir)
    print(render(collect(opts)), flush=True)
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
