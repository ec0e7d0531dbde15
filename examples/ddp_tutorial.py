"""The PyTorch DDP tutorial (pytorch/examples distributed/ddp-tutorial-series/
multigpu_torchrun.py), on CPU/gloo or CUDA/NCCL, instrumented with ClusterPulse.

The README's recipe is this file; CI runs it as is through a graceful restart, a
crash and a slow-data rank (tests/integration/test_ddp_tutorial.py).

    clusterpulse-train --nproc 4 --script examples/ddp_tutorial.py --preload torch -- 50 5
    torchrun --standalone --nproc-per-node 4 examples/ddp_tutorial.py 50 5
    torchrun --standalone --nproc-per-node 1 examples/ddp_tutorial.py 20 5   # one GPU
"""

import argparse
import hashlib
import os

import torch
import torch.nn.functional as F
from torch.nn.parallel import DistributedDataParallel as DDP
from torch.utils.data import Dataset
from torch.utils.data.distributed import DistributedSampler

from clusterpulse.integrations.data import ResumableDataLoader
from clusterpulse.trainer.instrument import Pulse
from clusterpulse.trainer.parallel import init_distributed


class MyTrainDataset(Dataset):
    def __init__(self, size):
        g = torch.Generator().manual_seed(0)
        self.data = [(torch.rand(20, generator=g), torch.rand(1, generator=g))
                     for _ in range(size)]

    def __len__(self):
        return len(self.data)

    def __getitem__(self, index):
        return self.data[index]


class Trainer:
    def __init__(self, model, train_data, optimizer, save_every, snapshot_path, pulse, info):
        self.info = info
        self.device = self.info.device
        self.model = model.to(self.device)
        self.train_data = train_data
        self.optimizer = optimizer
        self.save_every = save_every
        self.epochs_run = 0
        self.global_step = 0  # steps completed
        self.snapshot_path = snapshot_path
        self.pulse = pulse
        if os.path.exists(snapshot_path):
            self._load_snapshot(snapshot_path)
        self.model = DDP(self.model, device_ids=[self.device] if self.device.type == "cuda"
                         else None)
        pulse.attach_ddp(self.model)  # per-rank compute vs sync wait (DDP's collectives)

    def _load_snapshot(self, snapshot_path):
        snapshot = torch.load(snapshot_path, map_location=self.device)
        self.model.load_state_dict(snapshot["MODEL_STATE"])
        self.optimizer.load_state_dict(snapshot["OPTIMIZER_STATE"])
        self.epochs_run = snapshot["EPOCHS_RUN"]
        self.global_step = snapshot["GLOBAL_STEP"]
        self.train_data.load_state_dict(snapshot["DATA_STATE"])  # on any number of ranks
        print(f"Resuming training from snapshot at Epoch {self.epochs_run} "
              f"step {self.global_step}")

    def _run_batch(self, source, targets):
        with self.pulse.step(self.global_step + 1) as s:
            with s.section("forward_backward"):
                self.optimizer.zero_grad()
                output = self.model(source)
                loss = F.mse_loss(output, targets)
                loss.backward()
            with s.section("optimizer"):
                self.optimizer.step()
            s.loss, s.samples = loss.detach(), len(source)
        self.global_step += 1

    def _run_epoch(self, epoch):
        self.train_data.sampler.set_epoch(epoch)
        # after a mid-epoch restart the loader starts where the snapshot left it, unread
        for source, targets in self.pulse.data(self.train_data):  # input stalls are measured
            self._run_batch(source.to(self.device), targets.to(self.device))
            # The whole graceful protocol: agree, save, ack, barrier, exit for a restart.
            self.pulse.boundary(self.global_step, save=lambda step: self._save_snapshot(epoch))

    def _save_snapshot(self, epoch):
        if self.info.rank != 0:
            return
        snapshot = {"MODEL_STATE": self.model.module.state_dict(),
                    "OPTIMIZER_STATE": self.optimizer.state_dict(),
                    "EPOCHS_RUN": epoch, "GLOBAL_STEP": self.global_step,
                    "DATA_STATE": self.train_data.state_dict()}  # the position in the epoch
        torch.save(snapshot, self.snapshot_path + ".tmp")
        os.replace(self.snapshot_path + ".tmp", self.snapshot_path)  # never a torn snapshot
        self.pulse.checkpoint_committed(self.global_step)

    def train(self, max_epochs):
        for epoch in range(self.epochs_run, max_epochs):
            self._run_epoch(epoch)
            if (epoch + 1) % self.save_every == 0:
                self._save_snapshot(epoch + 1)


def load_train_objs():
    train_set = MyTrainDataset(2048)
    torch.manual_seed(0)
    model = torch.nn.Sequential(torch.nn.Linear(20, 256), torch.nn.ReLU(), torch.nn.Linear(256, 1))
    optimizer = torch.optim.SGD(model.parameters(), lr=1e-3, momentum=0.9)
    return train_set, model, optimizer


def prepare_dataloader(dataset, batch_size):
    return ResumableDataLoader(dataset, batch_size=batch_size, shuffle=False, num_workers=1,
                               sampler=DistributedSampler(dataset))


def main(save_every, total_epochs, batch_size, snapshot_path, run):
    info = init_distributed()  # restart-safe process group; agreed attempt number
    with Pulse(run=run, restarts=info.attempt) as pulse:
        dataset, model, optimizer = load_train_objs()
        train_data = prepare_dataloader(dataset, batch_size)
        trainer = Trainer(model, train_data, optimizer, save_every, snapshot_path, pulse, info)
        trainer.train(total_epochs)
        digest = hashlib.sha256(b"".join(p.detach().cpu().numpy().tobytes()
                                         for p in trainer.model.parameters())).hexdigest()
        if info.rank == 0:
            print(f"done: {trainer.global_step} steps, parameters {digest}", flush=True)
    torch.distributed.destroy_process_group()


if __name__ == "__main__":
    parser = argparse.ArgumentParser(description="simple distributed training job")
    parser.add_argument("total_epochs", type=int, help="Total epochs to train the model")
    parser.add_argument("save_every", type=int, help="How often to save a snapshot")
    parser.add_argument("--batch_size", default=32, type=int,
                        help="Input batch size on each device (default: 32)")
    parser.add_argument("--snapshot", default="snapshot.pt", help="snapshot path")
    parser.add_argument("--run-id", default="ddp-tutorial", help="run id shown by ClusterPulse")
    args = parser.parse_args()
    main(args.save_every, args.total_epochs, args.batch_size, args.snapshot, args.run_id)
