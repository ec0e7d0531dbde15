"""Runs under torchrun for bench_trainer: instrumentation overhead and checkpoint
blocking, each side by side with its baseline in the same processes.

Overhead: blocks of steps alternate between a truly bare loop (its own DDP model: no
comm hook, no Pulse, no telemetry) and the same loop on an identical DDP model with
Pulse (timing, bucket comm hook, telemetry to a live agent port, heartbeat thread,
step-boundary agreement every 5 steps), so that machine noise hits both alike;
medians per mode are compared.
"""

from __future__ import annotations

import json
import statistics
import sys
import time
from pathlib import Path

import torch
import torch.distributed as dist
import torch.nn.functional as F

from clusterpulse.trainer.checkpoint import CheckpointManager
from clusterpulse.trainer.data import SyntheticTokens
from clusterpulse.trainer.instrument import Pulse
from clusterpulse.trainer.model import PRESETS, build_model
from clusterpulse.trainer.parallel import init_distributed, wrap
from clusterpulse.trainer.state import TrainState
from clusterpulse.trainer.telemetry import parse_agent_addr


def main() -> None:
    agent, out_dir, preset = sys.argv[1], Path(sys.argv[2]), sys.argv[3]
    info = init_distributed(300)
    bare_model = wrap(build_model(preset, 1), "ddp", info)  # no hook, ever
    bare_opt = torch.optim.AdamW(bare_model.parameters(), lr=1e-3)
    model = wrap(build_model(preset, 1), "ddp", info)
    opt = torch.optim.AdamW(model.parameters(), lr=1e-3)
    sched = torch.optim.lr_scheduler.LambdaLR(opt, lambda s: 1.0)
    mc = PRESETS[preset]
    data = SyntheticTokens(1, mc.vocab, mc.seq_len, 8)
    pulse = Pulse(run="bench", agent=parse_agent_addr(agent))
    pulse.attach_ddp(model)

    def bare(step: int) -> torch.Tensor:
        x, y = data.shard(step, info.rank, info.world)
        logits = bare_model(x)
        loss = F.cross_entropy(logits.reshape(-1, logits.shape[-1]), y.reshape(-1))
        loss.backward()
        bare_opt.step()
        bare_opt.zero_grad(set_to_none=True)
        return loss

    def work(step: int) -> torch.Tensor:
        x, y = data.shard(step, info.rank, info.world)
        logits = model(x)
        loss = F.cross_entropy(logits.reshape(-1, logits.shape[-1]), y.reshape(-1))
        loss.backward()
        opt.step()
        opt.zero_grad(set_to_none=True)
        return loss

    times: dict[str, list[float]] = {"bare": [], "instrumented": []}
    step = 0
    for _block in range(6):
        for mode in ("bare", "instrumented"):
            for _ in range(40):
                step += 1
                t0 = time.perf_counter()
                if mode == "bare":
                    bare(step)
                else:
                    with pulse.step(step) as s, s.section("forward_backward"):
                        s.loss = work(step)
                    pulse.boundary(step)
                times[mode].append(time.perf_counter() - t0)
    result = {m: statistics.median(v[10:]) for m, v in times.items()}
    exchanges = max(pulse.consensus.exchanges, 1)
    result["consensus_ms_per_exchange"] = pulse.consensus.seconds / exchanges * 1e3

    state = TrainState(model, opt, sched)
    blocking: dict[str, list[float]] = {}
    for mode in ("sync", "async"):
        group = dist.new_group(backend="gloo") if mode == "async" else None
        mgr = CheckpointManager(out_dir / mode, info.rank, keep=1, async_save=mode == "async",
                                group=group)
        blocking[mode] = []
        for i in range(5):
            work(step + i)
            blocking[mode].append(mgr.save(100 + i, {"app": state}))
            mgr.wait()  # measure each save alone: the next step's training is not the point
            dist.barrier()
    result["ckpt_sync_s"] = statistics.median(blocking["sync"][1:])
    result["ckpt_async_s"] = statistics.median(blocking["async"][1:])
    result["state_bytes"] = sum(p.numel() * 4 for p in model.parameters()) * 3
    if info.rank == 0:
        print("RESULT " + json.dumps(result), flush=True)
    dist.barrier()
    pulse.close()
    dist.destroy_process_group()


if __name__ == "__main__":
    main()
