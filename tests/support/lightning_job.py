"""A tiny Lightning job instrumented with clusterpulse.integrations.lightning, as a user
would write it, for tests under clusterpulse-train on gloo. The README shows the lines
between `# --- README: lightning ---` and `# --- end README ---` verbatim
(tests/unit/test_docs_agree.py checks it); the test plumbing stays outside them.

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

# --- README: lightning ---
from lightning.pytorch.callbacks import ModelCheckpoint

from clusterpulse.integrations.data import ResumableDataLoader
from clusterpulse.integrations.lightning import ClusterPulseCallback
from clusterpulse.trainer.parallel import init_distributed

# --- end README ---

class Samples(torch.utils.data.Dataset):
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

    def on_load_checkpoint(self, checkpoint: dict) -> None:  # fit(ckpt_path=...) resumes
        if self.rank == 0:
            print(f"resuming from {self.trainer.ckpt_path} at step {checkpoint['global_step']}",
                  flush=True)

    def configure_optimizers(self):
        return torch.optim.SGD(self.parameters(), lr=0.01)


def main() -> None:
    p = argparse.ArgumentParser()
    p.add_argument("--epochs", type=int, default=2)
    p.add_argument("--batches", type=int, default=40, help="batches per rank per epoch")
    p.add_argument("--batch-size", type=int, default=4)
    p.add_argument("--checkpoints", required=True, help="the checkpoint folder")
    p.add_argument("--save-every", type=int, default=10, help="Lightning's own, in steps")
    p.add_argument("--control", required=True)
    p.add_argument("--run-id", default="lightning")
    p.add_argument("--step-seconds", type=float, default=0.0)
    args = p.parse_args()
    rank, world = int(os.environ.get("RANK", 0)), int(os.environ.get("WORLD_SIZE", 1))
    control = Path(args.control)
    dataset = Samples(args.batches * args.batch_size * world, control, rank)
    model = Tiny(control, rank, args.step_seconds)
    # Quiet CI, outside the README's lines: Lightning takes Trainer defaults from
    # PL_TRAINER_* variables (no logs or progress bar here).
    os.environ.update(PL_TRAINER_LOGGER="False", PL_TRAINER_ENABLE_PROGRESS_BAR="False",
                      PL_TRAINER_ENABLE_MODEL_SUMMARY="False")

    # --- README: lightning ---
    info = init_distributed()  # the restart-safe process group, before Lightning: it uses it
    # accelerator="auto": the GPUs where there are, else CPU. devices * num_nodes must be
    # the ranks torchrun started (devices="auto" would count this node's GPUs, or 1 CPU).
    per_node = int(os.environ.get("LOCAL_WORLD_SIZE", 1))
    pulse = ClusterPulseCallback(run=args.run_id, checkpoint=f"{args.checkpoints}/graceful.ckpt")
    periodic = ModelCheckpoint(dirpath=args.checkpoints, save_top_k=0, save_last=True,
                               every_n_train_steps=args.save_every)  # for crashes
    trainer = pl.Trainer(accelerator="auto", strategy="ddp", devices=per_node,
                         num_nodes=info.world // per_node, max_epochs=args.epochs,
                         callbacks=[pulse, periodic])
    # the newest of the graceful save and Lightning's own last.ckpt (None at first)
    trainer.fit(model, ResumableDataLoader(dataset, batch_size=args.batch_size),
                ckpt_path=pulse.resume_from(trainer))
    # --- end README ---

    print(f"reads rank={rank} samples={dataset.reads}", flush=True)
    if rank == 0:
        print(f"done: {trainer.global_step} steps", flush=True)


if __name__ == "__main__":
    main()
