"""Resuming mid-epoch without reading the skipped batches again (issue: the recipe's
islice resume loaded every skipped batch, minutes on a large input pipeline, counted as
the first step's data wait). Counted at the dataset: `__getitem__` calls."""

from __future__ import annotations

import importlib.util
import itertools
import multiprocessing

import pytest
import torch
import torch.distributed as dist
from torch.utils.data import Dataset, DistributedSampler

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
    assert state == {"batches": 3, "samples": 12, "complete": False}
    again = ResumableDataLoader(Counted(40), batch_size=4)
    again.load_state_dict(state)
    it = iter(again)
    assert [int(b[0]) for b in itertools.islice(it, 6)] == list(range(12, 36, 4))
    assert again.state_dict() == {"batches": 9, "samples": 36, "complete": False}
    next(it)
    assert again.state_dict() == {"batches": 10, "samples": 40, "complete": True}
    list(it)
    # run to its end, the loader is between epochs: a save now resumes a new epoch
    assert again.state_dict() == {"batches": 0, "samples": 0, "complete": False}
    assert [int(b[0]) for b in again][:2] == [0, 4]
    # a position saved before samples were kept (batches only) still positions
    old = ResumableDataLoader(Counted(40), batch_size=4)
    old.load_state_dict({"batches": 8})
    assert [int(b[0]) for b in old] == [32, 36]


def _shards(size: int, ranks: int, batch: int, epoch: int = 3) -> list[ResumableDataLoader]:
    """One loader per rank of a `ranks`-rank job, as torchrun would make them (the
    DistributedSampler's default seed, as the recipe's)."""
    loaders = []
    for rank in range(ranks):
        sampler = DistributedSampler(Counted(size), num_replicas=ranks, rank=rank)
        sampler.set_epoch(epoch)
        loaders.append(ResumableDataLoader(sampler.dataset, batch_size=batch, sampler=sampler))
    return loaders


def _train(loaders: list[ResumableDataLoader], steps: int | None) -> tuple[list[int], dict]:
    """`steps` synchronous steps of every rank (None: to the epoch's end): the samples
    trained on, and rank 0's position at the end (what the recipe saves)."""
    iters = [iter(loader) for loader in loaders]
    seen: list[int] = []
    for _ in itertools.count() if steps is None else range(steps):
        try:
            for it in iters:
                seen += next(it).view(-1).tolist()
        except StopIteration:
            break
    return seen, loaders[0].state_dict()


@pytest.mark.parametrize("before, after", [(3, 2), (2, 3), (4, 1)])
def test_a_job_resumed_on_another_number_of_ranks_trains_each_sample_once(before, after):
    """A node lost (3 -> 2 ranks) or added: the rest of the epoch is exactly the samples
    the first ranks had not trained on, each once. (Counted in batches the skip was
    wrong: 3 -> 2 replayed samples and skipped others; 2 -> 3 skipped too far.)"""
    size, batch = 48, 4
    first, state = _train(_shards(size, before, batch), steps=2)
    resumed = _shards(size, after, batch)
    for loader in resumed:
        loader.load_state_dict(state)
    rest, _ = _train(resumed, steps=None)
    assert len(first) == 2 * before * batch
    assert set(first + rest) == set(range(size))
    # twice only as DistributedSampler pads the rest to a multiple of the ranks
    assert len(first) + len(rest) - size == -(size - len(first)) % after


def test_on_the_same_ranks_a_resumed_epoch_is_the_uninterrupted_one_padding_included():
    size, ranks, batch = 50, 3, 4  # 50 samples on 3 ranks: DistributedSampler pads 1
    whole = [[b.view(-1).tolist() for b in loader] for loader in _shards(size, ranks, batch)]
    _, state = _train(_shards(size, ranks, batch), steps=2)
    for rank, loader in enumerate(_shards(size, ranks, batch)):
        loader.load_state_dict(state)
        assert [b.view(-1).tolist() for b in loader] == whole[rank][2:]


def test_a_shuffled_loader_resumes_into_the_permutation_it_was_cut_from():
    """shuffle=True draws each epoch's order from torch's RNG, which a restarted
    process has in another state: the position carries the order's generator."""
    torch.manual_seed(1)
    loader = ResumableDataLoader(Counted(40), batch_size=4, shuffle=True)
    whole = [[b.view(-1).tolist() for b in loader] for _ in range(2)]  # two epochs
    torch.manual_seed(1)
    cut = ResumableDataLoader(Counted(40), batch_size=4, shuffle=True)
    it = iter(cut)
    for _ in range(3):
        next(it)
    state = cut.state_dict()
    torch.manual_seed(2)  # the restarted process: another RNG state
    resumed = ResumableDataLoader(Counted(40), batch_size=4, shuffle=True)
    resumed.load_state_dict(state)
    assert [b.view(-1).tolist() for b in resumed] == whole[0][3:]
    assert [b.view(-1).tolist() for b in resumed] == whole[1]  # and the next epoch too
    # saved at the epoch's last batch: the next iteration is the next permutation
    for _ in range(7):
        next(it)
    state = cut.state_dict()
    torch.manual_seed(3)
    at_end = ResumableDataLoader(Counted(40), batch_size=4, shuffle=True)
    at_end.load_state_dict(state)
    assert [b.view(-1).tolist() for b in at_end] == whole[1]


def test_a_position_at_an_epochs_last_batch_resumes_with_the_next_epoch_whole():
    """Review of #31: a Lightning graceful restart at an epoch's last batch restored
    `samples = N`; Lightning went on with the next epoch, and the skip carried into it
    trained none of it (40 steps of 80, exit 0). With a DistributedSampler the position
    holds its epoch: a loop that iterates the same epoch again (the README's recipe)
    gets its empty rest, one that goes on (Lightning) gets the next epoch whole."""
    loaders = _shards(40, 2, 4, epoch=0)
    whole_next = [b.view(-1).tolist() for b in _shards(40, 2, 4, epoch=1)[0]]
    _, state = _train(loaders, steps=5)  # the epoch's last step on 2 ranks
    assert state["complete"] and state["epoch"] == 0
    same, following = _shards(40, 2, 4, epoch=0)[0], _shards(40, 2, 4, epoch=0)[0]
    same.load_state_dict(state)
    assert list(same) == []  # the recipe: epoch 0 again, nothing left of it
    following.load_state_dict(state)
    following.sampler.set_epoch(1)  # Lightning: the next epoch
    assert [b.view(-1).tolist() for b in following] == whole_next
    # without a DistributedSampler the epoch is unknown: a whole epoch handed out
    # starts the next iteration at the beginning
    plain = ResumableDataLoader(Counted(40), batch_size=4)
    it = iter(plain)
    for _ in range(10):
        next(it)
    again = ResumableDataLoader(Counted(40), batch_size=4)
    again.load_state_dict(plain.state_dict())
    assert len(list(again)) == 10


@pytest.mark.parametrize("sampler", ["plain", "distributed"])
def test_persistent_workers_keep_every_epoch_after_a_resume_whole(sampler):
    """Review of #31: with persistent_workers=True torch keeps the first iteration's
    index sampler for every later one; the positioned one of a resumed epoch made every
    later epoch empty (plain) or the resumed epoch's rest again (DistributedSampler)."""
    def loader() -> ResumableDataLoader:
        data = Counted(40)
        kwargs: dict = {"sampler": DistributedSampler(data, num_replicas=1, rank=0)} \
            if sampler == "distributed" else {}
        return ResumableDataLoader(data, batch_size=4, num_workers=1,
                                   persistent_workers=True, **kwargs)

    def epoch(dl: ResumableDataLoader, e: int) -> list[int]:
        if sampler == "distributed":
            dl.sampler.set_epoch(e)
        return [i for b in dl for i in b.view(-1).tolist()]

    reference = loader()
    expected = [epoch(reference, e) for e in range(3)]
    cut = loader()
    if sampler == "distributed":
        cut.sampler.set_epoch(0)
    it = iter(cut)
    for _ in range(3):
        next(it)
    resumed = loader()
    resumed.load_state_dict(cut.state_dict())
    assert epoch(resumed, 0) == expected[0][12:]
    assert epoch(resumed, 1) == expected[1]
    assert epoch(resumed, 2) == expected[2]


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
    """examples/ddp_tutorial.py as is, in a world of one, resumed from a snapshot that a
    3-rank run of it saved at its step 10 (of 22 in the epoch): it loads exactly the
    samples the 3 ranks had not trained on, each once (the 1088 left of 2048), none of
    the 960 skipped. Counted in steps the resume was wrong on another number of ranks
    (the old recipe's step arithmetic raised ValueError going from 3 ranks to 2)."""
    tut = _tutorial()
    info = init_distributed()
    try:
        dataset, model, optimizer = tut.load_train_objs()
        reads = multiprocessing.Array("i", len(dataset))

        class Reading(tut.MyTrainDataset):
            def __getitem__(self, index):
                reads[index] += 1
                return super().__getitem__(index)

        first, state = _train(_shards(len(dataset), 3, 32, epoch=0), steps=10)
        assert len(first) == 960
        dataset.__class__ = Reading
        snapshot = tmp_path / "snapshot.pt"
        torch.save({"MODEL_STATE": model.state_dict(), "OPTIMIZER_STATE": optimizer.state_dict(),
                    "EPOCHS_RUN": 0, "GLOBAL_STEP": 10, "DATA_STATE": state}, snapshot)
        with Pulse(run="resume", agent="none", restarts=info.attempt) as pulse:
            trainer = tut.Trainer(model, tut.prepare_dataloader(dataset, 32), optimizer, 5,
                                  str(snapshot), pulse, info)
            trainer.train(1)
        assert trainer.global_step == 10 + 34  # 1088 samples in batches of 32
        assert [i for i in range(len(dataset)) if reads[i] != 1] == sorted(first)
        assert all(reads[i] == 0 for i in first)
    finally:
        dist.destroy_process_group()


def test_an_iterable_dataset_iterates_as_with_a_plain_dataloader_unpositioned():
    """It raised TypeError (`_InfiniteConstantSampler` has no len()) at its first batch:
    nothing indexes an iterable dataset, so there is nothing to skip, and the state
    says nothing."""
    class Stream(torch.utils.data.IterableDataset):
        def __iter__(self):
            return iter(range(10))

    loader = ResumableDataLoader(Stream(), batch_size=4)
    assert [b.tolist() for b in loader] == [[0, 1, 2, 3], [4, 5, 6, 7], [8, 9]]
    assert loader.state_dict() == {}
    with pytest.warns(UserWarning, match="not positioned"):  # resumed: it replays (a
        loader.load_state_dict({})  # second review: silently, Lightning's warning gone)
    assert [b.tolist() for b in loader] == [[0, 1, 2, 3], [4, 5, 6, 7], [8, 9]]

    class Positioned(torch.utils.data.IterableDataset):  # one that keeps its place
        def __init__(self) -> None:
            self.at = 0

        def __iter__(self):
            while self.at < 10:
                self.at += 1
                yield self.at - 1

        def state_dict(self) -> dict:
            return {"at": self.at}

        def load_state_dict(self, state: dict) -> None:
            self.at = state["at"]

    first = ResumableDataLoader(Positioned(), batch_size=4)
    next(iter(first))
    state = first.state_dict()
    resumed = ResumableDataLoader(Positioned(), batch_size=4)
    resumed.load_state_dict(state)
    assert [b.tolist() for b in resumed] == [[4, 5, 6, 7], [8, 9]]
