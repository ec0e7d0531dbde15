"""A tiny Hugging Face Trainer job (a 1-layer GPT-2 built from a config in code, no
download) instrumented with clusterpulse.integrations.hf, for tests under
clusterpulse-train on gloo. The README shows the lines between `# --- README: hf ---`
and `# --- end README ---` verbatim (tests/unit/test_docs_agree.py checks it); the test
plumbing stays outside them.

The test steers it from outside through files in --control DIR, as lightning_job.py:
`slow_compute_RANK`, `slow_data_RANK`, and `fast` (until then each step takes
--step-seconds). Each rank prints the sample indices of every batch it trains, and at
the end how many samples it loaded (a resume must not load the batches it skips).
"""

import argparse
import os
import time
from pathlib import Path

import torch
from torch.utils.data import Dataset
from transformers import GPT2Config, GPT2LMHeadModel, Trainer, TrainingArguments

# --- README: hf ---
from clusterpulse.integrations.hf import ClusterPulseCallback
from clusterpulse.trainer.parallel import init_distributed

# --- end README ---


class Tokens(Dataset):
    def __init__(self, size: int, control: Path, rank: int) -> None:
        g = torch.Generator().manual_seed(0)
        self.ids = torch.randint(0, 64, (size, 8), generator=g)
        self.slow = control / f"slow_data_{rank}"
        self.reads = 0  # samples loaded by this process (num_workers=0: all of them)

    def __len__(self) -> int:
        return len(self.ids)

    def __getitem__(self, i: int) -> dict:
        self.reads += 1
        if self.slow.exists():
            time.sleep(0.03)
        return {"input_ids": self.ids[i], "labels": self.ids[i], "idx": torch.tensor(i)}


class Tiny(torch.nn.Module):
    """GPT-2 that reports which samples it trains on at which step, and can be made
    slow. Its count of steps trained is part of its state_dict (extra state, which DDP
    does not broadcast), so the Trainer's checkpoint carries it and a resume restores
    it: the step it prints is the one the Trainer resumed at.

    Its forward takes `**kwargs`, as every stock HF model's does, and hands them on:
    the Trainer then counts the batch's label tokens across ranks (`num_items_in_batch`,
    an all_gather in `get_batch_samples`, between one step's end and the next one's
    begin), where a rank waits for a peer slow to load its batch. Without `**kwargs`
    the job never ran that collective (issue #31). Each step prints the count it got."""

    def __init__(self, control: Path, rank: int, pace: float) -> None:
        super().__init__()
        torch.manual_seed(0)
        self.lm = GPT2LMHeadModel(GPT2Config(n_layer=1, n_head=2, n_embd=16, vocab_size=64,
                                             n_positions=8, tie_word_embeddings=False))
        self.slow, self.fast, self.pace, self.rank = (
            control / f"slow_compute_{rank}", control / "fast", pace, rank)
        self.steps = 0  # one forward per optimizer step (no gradient accumulation)

    def forward(self, input_ids, labels, idx, **kwargs):
        if self.slow.exists():
            time.sleep(0.2)
        if not self.fast.exists():
            time.sleep(self.pace)
        self.steps += 1
        print(f"trained rank={self.rank} step={self.steps} "
              f"idx={','.join(map(str, idx.tolist()))} "
              f"items={int(kwargs.get('num_items_in_batch', -1))}", flush=True)
        return {"loss": self.lm(input_ids=input_ids, labels=labels, **kwargs).loss}

    def get_extra_state(self) -> torch.Tensor:
        return torch.tensor(self.steps)

    def set_extra_state(self, state: torch.Tensor) -> None:  # train(resume_from_checkpoint)
        self.steps = int(state)
        if self.rank == 0:
            print(f"resuming from checkpoint-{self.steps}", flush=True)


def main() -> None:
    p = argparse.ArgumentParser()
    p.add_argument("--batches", type=int, default=40, help="batches per rank (one epoch)")
    p.add_argument("--batch-size", type=int, default=4)
    p.add_argument("--output-dir", required=True)
    p.add_argument("--control", required=True)
    p.add_argument("--run-id", default="hf")
    p.add_argument("--step-seconds", type=float, default=0.0)
    p.add_argument("--save-every", type=int, default=10, help="the Trainer's own, in steps")
    args = p.parse_args()
    rank, world = int(os.environ.get("RANK", 0)), int(os.environ.get("WORLD_SIZE", 1))
    control = Path(args.control)
    training_args = TrainingArguments(
        output_dir=args.output_dir, per_device_train_batch_size=args.batch_size,
        num_train_epochs=1, save_strategy="steps", save_steps=args.save_every,
        save_total_limit=2, logging_strategy="no", report_to="none",
        use_cpu=True, disable_tqdm=True, ddp_backend="gloo", dataloader_num_workers=0,
        remove_unused_columns=False, ddp_find_unused_parameters=False)
    dataset = Tokens(args.batches * args.batch_size * world, control, rank)
    model = Tiny(control, rank, args.step_seconds)

    # --- README: hf ---
    init_distributed()  # the restart-safe process group, before the Trainer: it uses it
    trainer = Trainer(model=model, args=training_args, train_dataset=dataset)
    pulse = ClusterPulseCallback.attach(trainer, run=args.run_id)  # needs the Trainer's DDP model
    trainer.train(resume_from_checkpoint=pulse.resume_from())
    # --- end README ---

    print(f"reads rank={rank} samples={dataset.reads}", flush=True)
    if rank == 0:
        print(f"done: {trainer.state.global_step} steps", flush=True)


if __name__ == "__main__":
    main()
