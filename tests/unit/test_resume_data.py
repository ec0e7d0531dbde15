"""Resuming mid-epoch without reading the skipped batches again (issue: the recipe's
islice resume loaded every skipped batch, minutes on a large input pipeline, counted as
the first step's data wait). Counted at the dataset: `__getitem__` calls."""

from __future__ import annotations

import importlib.util
import multiprocessing

import pytest
import torch
import torch.distributed as dist
from torch.utils.data import Dataset

from clusterpulse.integrations.data import ResumableDataLoader
from clusterpulse.trainer.instrument import Pulse
from clusterpulse.trainer.parallel import init_distributed
from tests.support.procs import REPO


class Counted(Dataset):
    """Counts its reads across DataLoader worker processes (shared memory)."""

    def __init__(self, size: int) -> None:
        self.size = size
        self.reads = multiprocessing.Value("i", 0)

    def __len__(self) -> int:
        return self.size

    def __getitem__(self, i: int) -> torch.Tensor:
        with self.reads.get_lock():
            self.reads.value += 1
        return torch.tensor([i])


@pytest.mark.parametrize("workers", [0, 1])
def test_a_resumed_epoch_reads_only_the_batches_it_trains_on(workers):
    data = Counted(40)
    loader = ResumableDataLoader(data, batch_size=4, num_workers=workers)
    whole = [b.view(-1).tolist() for b in loader]
    data.reads.value = 0
    loader.skip_next(7)
    rest = [b.view(-1).tolist() for b in loader]
    assert rest == whole[7:]
    assert data.reads.value == 3 * 4  # the 3 batches left, not the 7 skipped
    assert len(loader) == 10  # the epoch's length, as a resumed epoch's arithmetic expects
    assert [b.view(-1).tolist() for b in loader] == whole  # the next epoch starts afresh


def test_the_position_is_a_state_dict_lightning_and_accelerate_save():
    loader = ResumableDataLoader(Counted(40), batch_size=4)
    it = iter(loader)
    for _ in range(3):
        next(it)
    state = loader.state_dict()
    assert state == {"batches": 3}
    again = ResumableDataLoader(Counted(40), batch_size=4)
    again.load_state_dict(state)
    assert [int(b[0]) for b in again] == list(range(12, 40, 4))
    assert again.state_dict() == {"batches": 10}


def test_skipping_a_negative_count_is_refused_by_name():
    with pytest.raises(ValueError, match="negative number of batches"):
        ResumableDataLoader(Counted(4)).skip_next(-1)


def _tutorial():
    spec = importlib.util.spec_from_file_location("ddp_tutorial",
                                                  REPO / "examples" / "ddp_tutorial.py")
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module


def test_the_recipe_resumed_mid_epoch_does_not_load_the_skipped_batches(tmp_path):
    """examples/ddp_tutorial.py as is, in a world of one, resumed from a snapshot at
    step 50 of a 64-step epoch: it loads the 14 batches it trains on, not all 64."""
    tut = _tutorial()
    info = init_distributed()
    try:
        dataset, model, optimizer = tut.load_train_objs()
        reads = multiprocessing.Value("i", 0)

        class Reading(tut.MyTrainDataset):
            def __getitem__(self, index):
                with reads.get_lock():
                    reads.value += 1
                return super().__getitem__(index)

        dataset.__class__ = Reading
        snapshot = tmp_path / "snapshot.pt"
        torch.save({"MODEL_STATE": model.state_dict(), "OPTIMIZER_STATE": optimizer.state_dict(),
                    "EPOCHS_RUN": 0, "GLOBAL_STEP": 50}, snapshot)
        with Pulse(run="resume", agent="none", restarts=info.attempt) as pulse:
            trainer = tut.Trainer(model, tut.prepare_dataloader(dataset, 32), optimizer, 5,
                                  str(snapshot), pulse, info)
            trainer.train(1)
        assert trainer.global_step == 64
        assert reads.value == (64 - 50) * 32
    finally:
        dist.destroy_process_group()
