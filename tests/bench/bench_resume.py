"""Resume without replaying data: the first step's data wait after a mid-epoch resume,
`ResumableDataLoader.skip_next` against the recipe's former `itertools.islice`, which
loaded every skipped batch. Measured by Pulse itself (the figure the agent exports as
data_wait_seconds), on a dataset whose samples cost 1 ms each to load (storage, decode),
DataLoader with one worker as in examples/ddp_tutorial.py."""

from __future__ import annotations

import itertools
import time
from collections.abc import Iterable

import torch
from torch.utils.data import Dataset

from clusterpulse.integrations.data import ResumableDataLoader
from clusterpulse.trainer.instrument import Pulse
from tests.bench.table import Row

BATCHES, BATCH, RESUME_AT, SAMPLE_S = 64, 32, 50, 0.001


class SlowSamples(Dataset):
    def __len__(self) -> int:
        return BATCHES * BATCH

    def __getitem__(self, i: int) -> torch.Tensor:
        time.sleep(SAMPLE_S)
        return torch.tensor([i])


def _first_step_data_wait(batches: Iterable[torch.Tensor]) -> float:
    with Pulse(run="bench-resume", agent="none", restarts=0, catch_sigterm=False) as pulse:
        for _ in pulse.data(batches):
            with pulse.step(RESUME_AT + 1):
                pass
            return pulse.last["data_wait_seconds"]
    raise RuntimeError("no batch")


def run() -> list[Row]:
    islice_wait = _first_step_data_wait(itertools.islice(
        ResumableDataLoader(SlowSamples(), batch_size=BATCH, num_workers=1), RESUME_AT, None))
    loader = ResumableDataLoader(SlowSamples(), batch_size=BATCH, num_workers=1)
    loader.skip_next(RESUME_AT)
    skip_wait = _first_step_data_wait(loader)
    what = (f"first step's data wait after resuming at batch {RESUME_AT}/{BATCHES} "
            f"({BATCH} samples/batch, 1 ms each)")
    return [Row(what, skip_wait, "s", islice_wait, "islice over the loader (reads skipped)")]


if __name__ == "__main__":
    from tests.bench.table import render

    print(render(run()))
