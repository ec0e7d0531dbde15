"""What a checkpoint holds, as one DCP `Stateful`: model, optimizer, LR schedule,
data position and RNG state. `get_state_dict`/`set_state_dict` make the same code
right for DDP and FSDP2 and let DCP reshard when the world size changes."""

from __future__ import annotations

import hashlib
from typing import Any

import torch
from torch import nn
from torch.distributed.checkpoint.state_dict import (
    StateDictOptions,
    get_model_state_dict,
    get_state_dict,
    set_state_dict,
)
from torch.distributed.checkpoint.stateful import Stateful


class TrainState(Stateful):
    def __init__(self, model: nn.Module, optimizer: torch.optim.Optimizer,
                 scheduler: torch.optim.lr_scheduler.LRScheduler) -> None:
        self.model, self.optimizer, self.scheduler = model, optimizer, scheduler
        self.step = 0  # steps completed; also the data position (data is a function of step)

    def state_dict(self) -> dict[str, Any]:
        msd, osd = get_state_dict(self.model, self.optimizer)
        return {"model": msd, "optim": osd, "sched": self.scheduler.state_dict(),
                "step": self.step, "rng": torch.get_rng_state()}

    def load_state_dict(self, sd: dict[str, Any]) -> None:
        set_state_dict(self.model, self.optimizer, model_state_dict=sd["model"],
                       optim_state_dict=sd["optim"])
        self.scheduler.load_state_dict(sd["sched"])
        self.step = int(sd["step"])
        torch.set_rng_state(sd["rng"])


def parameter_digest(model: nn.Module) -> str:
    """SHA-256 over the full parameters (gathered for FSDP); call on every rank."""
    sd = get_model_state_dict(model, options=StateDictOptions(full_state_dict=True,
                                                              cpu_offload=True))
    h = hashlib.sha256()
    for name in sorted(sd):
        t = sd[name]
        h.update(name.encode())
        h.update(t.detach().to("cpu", torch.float32).contiguous().numpy().tobytes())
    return h.hexdigest()
