"""Two real gloo ranks (`torchrun ... ddp_bytes_job.py OUT`): the bytes Pulse reports
for DDP's gradient all-reduces where a step's backward reaches two attached models (a
GAN's generator under its discriminator) and where torch's fp16 compression hook
halves what goes over the wire. Rank 0 writes {case: comm_bytes} to OUT."""

from __future__ import annotations

import json
import sys
from pathlib import Path

import torch
import torch.distributed as dist
from torch import nn
from torch.distributed.algorithms.ddp_comm_hooks import default_hooks
from torch.nn.parallel import DistributedDataParallel as DDP

from clusterpulse.trainer.instrument import Pulse


def main(out: Path) -> None:
    dist.init_process_group("gloo")
    torch.manual_seed(0)
    got: dict[str, float] = {}
    pulse = Pulse(run="bytes", agent=None)
    gen, disc = DDP(nn.Linear(64, 64)), DDP(nn.Linear(64, 1))
    pulse.attach_ddp(gen)
    pulse.attach_ddp(disc)
    with pulse.step(1) as s, s.section("forward_backward"):
        disc(gen(torch.randn(4, 64))).sum().backward()  # both reduce
    got["generator_and_discriminator"] = pulse.last["comm_bytes"]
    with pulse.step(2) as s, s.section("forward_backward"):
        disc(gen(torch.randn(4, 64)).detach()).sum().backward()  # the discriminator's only
    got["discriminator"] = pulse.last["comm_bytes"]
    pulse.close()
    pulse = Pulse(run="bytes", agent=None)
    model = DDP(nn.Linear(64, 64))
    pulse.attach_ddp(model)
    model.register_comm_hook(None, default_hooks.fp16_compress_hook)  # after attaching
    with pulse.step(1) as s, s.section("forward_backward"):
        model(torch.randn(4, 64)).sum().backward()
    got["fp16_compressed"] = pulse.last["comm_bytes"]
    pulse.close()
    if dist.get_rank() == 0:
        out.write_text(json.dumps(got))
    dist.destroy_process_group()


if __name__ == "__main__":
    main(Path(sys.argv[1]))
