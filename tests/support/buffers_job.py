"""A training loop whose model has buffers, under DDP's default settings, for the
attribution tests (run by a real torchrun: tests/integration/test_attribution.py).

minGPT registers its causal mask as a buffer and most real models hold BatchNorm
statistics: DDP then broadcasts the buffers from rank 0 at the start of every forward
(broadcast_buffers=True), a collective inside the rank's own forward. One rank is made
a straggler, in compute (a slower GPU: longer before backward and in the optimizer,
whose lateness its peers then wait for in the next forward's broadcast) or in data
loading (its input takes longer to arrive), and every rank writes its
figures per step as JSON lines to OUT_DIR/rank<r>.jsonl: `{"step": s, ...Pulse.last,
"straggler_score": ...}`.

Mode `fwd_collective`: the model runs a collective of its own inside forward, the
way SyncBatchNorm does (it all-gathers the batch statistics in forward and all-reduces
in backward; a tensor-parallel layer's all-reduce is the same). SyncBatchNorm itself
raises on CPU input, so `StatsNorm` all-reduces its batch statistics with
`dist.all_reduce`, after the layers before it (the rank's simulated device work, where
the straggler is slower): its peers wait for it there, inside their own forward.
Mode `syncbn` is the same with the real `nn.SyncBatchNorm` (CUDA and NCCL only: DDP
refuses it on CPU) and DDP's buffer broadcast off, so that the peers wait in
SyncBatchNorm's all-gather, not in the broadcast.

Mode `accumulate`: the loop of the review of #31 that attach_ddp got wrong. It
accumulates gradients over two micro-batches that both reduce (no `no_sync()`: two
gradient all-reduces a step, as SAM's two passes run too), and in the optimizer
section checks across ranks that the gradients are finite before stepping (an
all-reduce, as clipping's norm on a sharded model). The straggler is slower in the
first micro-batch and in the optimizer before the check: its peers wait for it in the
first all-reduce and in the check, and both waits are sync wait.

    torchrun --nproc-per-node 3 tests/support/buffers_job.py compute 2 30 OUT_DIR

`run_ranks` runs it so from a test and returns each rank's median figures.
"""

from __future__ import annotations

import json
import os
import statistics
import subprocess
import sys
import time
from collections.abc import Iterator
from pathlib import Path

import torch
import torch.distributed as dist
import torch.nn.functional as F
from torch import nn
from torch.nn.parallel import DistributedDataParallel as DDP

from clusterpulse.trainer.instrument import Pulse, StepContext
from clusterpulse.trainer.parallel import init_distributed
from tests.support.procs import REPO

WORK_S = 0.04  # every rank's simulated device work per step
DELAY_S = 0.04  # the straggler's extra time per step (compute or data)
SEQ, DIM = 16, 32


class CausalBlock(nn.Module):
    """minGPT's attention: the causal mask is a registered buffer, then BatchNorm."""

    def __init__(self) -> None:
        super().__init__()
        self.register_buffer("mask", torch.tril(torch.ones(SEQ, SEQ)).view(1, SEQ, SEQ))
        self.qkv = nn.Linear(DIM, 3 * DIM)
        self.norm = nn.BatchNorm1d(DIM)
        self.head = nn.Linear(DIM, 1)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        q, k, v = self.qkv(x).split(DIM, dim=2)
        att = (q @ k.transpose(1, 2)) / DIM ** 0.5
        att = att.masked_fill(self.mask[:, :SEQ, :SEQ] == 0, float("-inf")).softmax(-1)
        y = self.norm((att @ v).transpose(1, 2)).transpose(1, 2)
        return self.head(y).mean(dim=1)


class StatsNorm(nn.Module):
    """SyncBatchNorm's forward on CPU: per-feature mean and variance over every rank's
    batch (one blocking all-reduce of sum, sum of squares and count), running mean kept
    as a buffer."""

    def __init__(self) -> None:
        super().__init__()
        self.register_buffer("running_mean", torch.zeros(DIM))

    def forward(self, h: torch.Tensor) -> torch.Tensor:
        local = torch.cat([h.sum(0), h.square().sum(0), torch.tensor([float(len(h))])])
        stats = local.detach().clone()
        dist.all_reduce(stats)  # looked up at call time, as SyncBatchNorm does
        n = stats[-1]
        mean, sq = stats[:DIM] / n, stats[DIM:2 * DIM] / n
        with torch.no_grad():
            self.running_mean.lerp_(mean, 0.1)
        return (h - mean) / (sq - mean.square() + 1e-5).sqrt()


class NormNet(nn.Module):
    """A layer, a norm whose statistics span every rank (StatsNorm, or a real
    SyncBatchNorm on CUDA), a head. `work_s`: the simulated device time of the layers
    before the norm (on CUDA the device idles meanwhile: its events time it too)."""

    def __init__(self, norm: nn.Module, work_s: float) -> None:
        super().__init__()
        self.work_s = work_s
        self.inp = nn.Linear(DIM, DIM)
        self.norm = norm
        self.head = nn.Linear(DIM, 1)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        h = self.inp(x).flatten(0, 1)
        time.sleep(self.work_s)  # this rank's layers before the norm
        return self.head(self.norm(h)).view(x.shape[0], SEQ, 1).mean(dim=1)


def batches(rank: int, slow_data: bool) -> Iterator[tuple[torch.Tensor, torch.Tensor]]:
    g = torch.Generator().manual_seed(rank)
    while True:
        if slow_data:
            time.sleep(DELAY_S)  # a starved input pipeline
        yield torch.rand(8, SEQ, DIM, generator=g), torch.rand(8, 1, generator=g)


def one_pass(model: DDP, opt: torch.optim.Optimizer, s: StepContext, x: torch.Tensor,
             y: torch.Tensor, mode: str, slow: bool) -> torch.Tensor:
    """The README's step: one forward and backward, then the optimizer."""
    extra = DELAY_S / 2 if mode == "compute" and slow else 0.0
    with s.section("forward_backward"):
        loss = F.mse_loss(model(x), y)
        if not isinstance(model.module, NormNet):  # there: in its forward
            time.sleep(WORK_S + extra)
        loss.backward()
    with s.section("optimizer"):
        time.sleep(extra)
        opt.step()
        opt.zero_grad()
    return loss


def accumulate_and_check(model: DDP, opt: torch.optim.Optimizer, s: StepContext,
                         x: torch.Tensor, y: torch.Tensor, _mode: str,
                         slow: bool) -> torch.Tensor:
    """Mode accumulate: two micro-batches that both reduce, then a check across ranks
    that the gradients are finite, in the optimizer section."""
    late = DELAY_S / 2 if slow else 0.0
    with s.section("forward_backward"):
        for micro, extra in enumerate((late, 0.0)):
            loss = F.mse_loss(model(x[micro::2]), y[micro::2]) / 2
            time.sleep(WORK_S / 2 + extra)
            loss.backward()
    with s.section("optimizer"):
        time.sleep(late)
        finite = torch.stack([p.grad.isfinite().all() for p in model.parameters()])
        every = finite.all().float().reshape(1)
        dist.all_reduce(every, op=dist.ReduceOp.MIN)  # every rank steps, or none
        if every.item() == 1:
            opt.step()
        opt.zero_grad()
    return loss


def main(mode: str, slow_rank: int, steps: int, out_dir: Path) -> None:
    info = init_distributed(timeout_s=120)
    out = (out_dir / f"rank{info.rank}.jsonl").open("w", buffering=1)  # a crash loses no row
    torch.manual_seed(0)
    slow = info.rank == slow_rank
    work = WORK_S + (DELAY_S if slow else 0.0)  # own_collective: all before the norm
    if mode == "syncbn":  # buffers not broadcast: the wait is SyncBatchNorm's
        model = DDP(NormNet(nn.SyncBatchNorm(DIM), work).to(info.device),
                    device_ids=[info.device.index], broadcast_buffers=False)
    else:  # broadcast_buffers=True: DDP's default
        model = DDP(NormNet(StatsNorm(), work) if mode == "fwd_collective"
                    else CausalBlock())
    opt = torch.optim.SGD(model.parameters(), lr=1e-3)
    with Pulse(run="buffers", agent=None, catch_sigterm=False) as pulse:
        pulse.attach_ddp(model)
        data = batches(info.rank, mode == "data" and slow)
        for step, (x, y) in enumerate(pulse.data(data), start=1):
            with pulse.step(step) as s:
                train = accumulate_and_check if mode == "accumulate" else one_pass
                s.loss = train(model, opt, s, x.to(info.device), y.to(info.device),
                               mode, slow).detach()
            pulse.boundary(step)
            out.write(json.dumps({"step": step, **pulse.last,
                                  "straggler_score": pulse.extra.get("straggler_score")}) + "\n")
            if step == steps:
                break
    out.close()
    torch.distributed.destroy_process_group()


def run_ranks(tmp_path: Path, mode: str, ranks: int, slow: int,
              steps: int) -> dict[int, dict[str, float]]:
    """Run the job under torchrun: each rank's median figures over the steps after the
    first five, and its straggler score at the end."""
    out = tmp_path / mode
    out.mkdir()
    cmd = [sys.executable, "-m", "torch.distributed.run", "--standalone",
           f"--nproc-per-node={ranks}", "--monitor-interval=0.2", __file__, mode,
           str(slow), str(steps), str(out)]
    env = {**os.environ, "OMP_NUM_THREADS": "1", "PYTHONPATH": str(REPO)}
    p = subprocess.run(cmd, cwd=tmp_path, capture_output=True, text=True, timeout=240,
                       env=env)
    if p.returncode != 0:  # how far each rank got tells a crash in the loop from one at exit
        written = {r: len(f.read_text().splitlines()) if (f := out / f"rank{r}.jsonl").exists()
                   else "no file" for r in range(ranks)}
        raise AssertionError(f"torchrun exited {p.returncode}; steps written by rank: "
                             f"{written} of {steps}\n{(p.stdout + p.stderr)[-3000:]}")
    figures = {}
    for rank in range(ranks):
        rows = [json.loads(line) for line in (out / f"rank{rank}.jsonl").read_text().splitlines()]
        assert len(rows) == steps, rows
        steady = rows[5:]
        figures[rank] = {k: statistics.median(r[k] for r in steady) for k in (
            "step_seconds", "compute_seconds", "sync_wait_seconds", "data_wait_seconds")}
        figures[rank]["straggler_score"] = rows[-1]["straggler_score"]
        # what a rank moves in DDP's gradient all-reduces a step (none: 0)
        figures[rank]["comm_bytes"] = statistics.median(r.get("comm_bytes", 0.0)
                                                        for r in steady)
    return figures


if __name__ == "__main__":
    main(sys.argv[1], int(sys.argv[2]), int(sys.argv[3]), Path(sys.argv[4]))
