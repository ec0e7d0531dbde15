"""A tiny Lightning job instrumented with clusterpulse.integrations.lightning, as a user
would write it (the README's snippet), for tests under clusterpulse-train on gloo.

The test steers it from outside through files in --control DIR: `slow_compute_RANK`
(that rank's training_step sleeps) and `slow_data_RANK` (that rank's samples load
slowly); every step takes --step-seconds until `fast` appears there. Each rank
prints the first sample index of every batch it trains, so a test can check that a
resumed run trains exactly the batches an uninterrupted one would, and at the end how
many samples it loaded (a resume must not load the batches it skips).
"""

import argparse
import os
import time
from pathlib import Path

import lightning.pytorch as pl
import torch
from torch.utils.data import Dataset

from clusterpulse.integrations.data import ResumableDataLoader
from clusterpulse.integrations.lightning import ClusterPulseCallback
from clusterpulse.trainer.parallel import init_distributed


class Samples(Dataset):
    def __init__(self, size: int, control: Path, rank: int) -> None:
        g = torch.Generator().manual_seed(0)
        self.x, self.y = torch.rand(size, 8, generator=g), torch.rand(size, 1, generator=g)
        self.slow = control / f"slow_data_{rank}"
        self.reads = 0  # samples loaded by this process (num_workers=0: all of them)

    def __len__(self) -> int:
        return len(self.x)

    def __getitem__(self, i: int):
        self.reads += 1
        if self.slow.exists():
            time.sleep(0.03)
        return self.x[i], self.y[i], i


class Tiny(pl.LightningModule):
    def __init__(self, control: Path, rank: int, pace: float) -> None:
        super().__init__()
        torch.manual_seed(0)
        self.net = torch.nn.Sequential(torch.nn.Linear(8, 16), torch.nn.ReLU(),
                                       torch.nn.Linear(16, 1))
        self.slow, self.rank = control / f"slow_compute_{rank}", rank
        self.fast, self.pace = control / "fast", pace

    def training_step(self, batch, batch_idx):
        x, y, idx = batch
        if self.slow.exists():
            time.sleep(0.2)
        if not self.fast.exists():
            time.sleep(self.pace)
        print(f"trained rank={self.rank} step={self.global_step + 1} idx={int(idx[0])}",
              flush=True)
        return torch.nn.functional.mse_loss(self.net(x), y)

    def configure_optimizers(self):
        return torch.optim.SGD(self.parameters(), lr=0.01)


def main() -> None:
    p = argparse.ArgumentParser()
    p.add_argument("--epochs", type=int, default=2)
    p.add_argument("--batches", type=int, default=40, help="batches per rank per epoch")
    p.add_argument("--batch-size", type=int, default=4)
    p.add_argument("--checkpoint", required=True)
    p.add_argument("--control", required=True)
    p.add_argument("--run-id", default="lightning")
    p.add_argument("--step-seconds", type=float, default=0.0)
    a = p.parse_args()
    info = init_distributed()
    control = Path(a.control)
    data = Samples(a.batches * a.batch_size * info.world, control, info.rank)
    pulse = ClusterPulseCallback(run=a.run_id, checkpoint=a.checkpoint)
    trainer = pl.Trainer(accelerator="cpu", strategy="ddp", max_epochs=a.epochs,
                         devices=int(os.environ.get("LOCAL_WORLD_SIZE", 1)),
                         num_nodes=info.world // int(os.environ.get("LOCAL_WORLD_SIZE", 1)),
                         callbacks=[pulse], logger=False, enable_checkpointing=False,
                         enable_progress_bar=False, enable_model_summary=False)
    resume = pulse.resume_from()
    if resume and info.rank == 0:
        step = torch.load(resume, map_location="cpu", weights_only=False)["global_step"]
        print(f"resuming from {resume} at step {step}", flush=True)
    model = Tiny(control, info.rank, a.step_seconds)
    trainer.fit(model, ResumableDataLoader(data, batch_size=a.batch_size), ckpt_path=resume)
    print(f"reads rank={info.rank} samples={data.reads}", flush=True)
    if info.rank == 0:
        print(f"done: {trainer.global_step} steps", flush=True)


if __name__ == "__main__":
    main()
