"""A DataLoader that resumes mid-epoch without reading the batches it skips, on any
number of ranks, with the order an uninterrupted run would have had.

The usual resume, `itertools.islice(loader, done, None)`, loads every skipped batch
and throws it away: on a large input pipeline that is minutes, counted as the first
step's data wait, and Lightning, finding a loader it cannot position, restarts the
epoch's data instead. Here the skip happens on the sampler's indices, before any
sample is fetched: the first batch after a resume costs what any batch costs.

The position is kept in samples of the epoch's whole order, not in batches of one
rank: with a `DistributedSampler`, a step of W ranks with batch size B consumes the
next W*B indices of the epoch's permutation (rank r takes every W-th one from r), and
that permutation depends on the seed and the epoch, not on W. So a job restarted on
fewer or more ranks (a node lost, a node added) goes on with the next unread sample,
none trained twice and none left out; counted in batches, a different W made the
skip count wrong or negative. On the same W the order is exactly the uninterrupted
run's, padding included.

A shuffling loader without a DistributedSampler (`shuffle=True`: a `RandomSampler`)
draws a new permutation from torch's global RNG each epoch, different after a
restart; the loader gives that sampler a generator of its own and keeps the
generator's state from the epoch's start in the position, so a resumed epoch skips
into the same permutation it was cut from.

`state_dict`/`load_state_dict` are the interface Lightning saves and restores with
its checkpoints (it then no longer warns that the loader is not resumable); the
state rank 0 saves fits every rank, as every rank is at the same place of the same
permutation. A position applies to the epoch it was taken in: with a
DistributedSampler the loader knows it (`set_epoch`), and a restored position is
applied only to an iteration of that epoch (the README's recipe iterates the same
epoch again and goes on where it stopped; Lightning, restored from a save at an
epoch's last batch, goes on with the next epoch, which starts at its beginning: a
skip carried into it trained nothing of that epoch). Without one, a position that
had handed out its whole epoch starts the next iteration at the beginning. An
iteration that has run to its end leaves position 0.

The index sampler DataLoader draws from is a view that reads the position when an
iteration starts: with `persistent_workers=True` torch keeps the first iteration's
index sampler for every later one, and a positioned one fixed at the resume repeated
the resumed epoch's rest (or nothing) in every epoch after it.
"""

from __future__ import annotations

import itertools
import math
import warnings
from collections.abc import Iterable, Iterator
from typing import Any

import torch
from torch.utils.data import (
    BatchSampler,
    DataLoader,
    DistributedSampler,
    IterableDataset,
    RandomSampler,
)


class _PositionView:
    """The index sampler a ResumableDataLoader hands DataLoader: each iteration's
    indices as the loader planned them when it started (`ResumableDataLoader._plan`),
    else the base sampler's; `len()` the whole epoch's, as Lightning counts a resumed
    epoch's batches from the restored position up to it."""

    def __init__(self, loader: ResumableDataLoader) -> None:
        self.loader = loader

    def __iter__(self) -> Iterator[Any]:
        plan = self.loader._plan
        return iter(plan) if plan is not None else iter(self.loader._base_index_sampler())

    def __len__(self) -> int:
        return len(self.loader._base_index_sampler())


def epoch_order(sampler: DistributedSampler) -> list[int]:
    """The epoch's whole permutation, as every rank's shard is cut from it: torch's
    own sampler with one replica (same dataset, shuffle, seed and epoch)."""
    whole = DistributedSampler(sampler.dataset, num_replicas=1, rank=0,
                               shuffle=sampler.shuffle, seed=sampler.seed)
    whole.set_epoch(sampler.epoch)
    return list(whole)


def shard_after(sampler: DistributedSampler, consumed: int) -> list[int]:
    """This rank's indices for the rest of the epoch once `consumed` samples of its
    permutation have been trained on (by any number of ranks): the rest padded from
    the epoch's start to a multiple of the ranks (or cut, with drop_last), as
    DistributedSampler pads, then every num_replicas-th from this rank."""
    order = epoch_order(sampler)
    rest = order[consumed:]
    ranks = sampler.num_replicas
    if sampler.drop_last:
        rest = rest[:len(rest) // ranks * ranks]
    elif rest and len(rest) % ranks:
        pad = ranks - len(rest) % ranks
        rest += (order * math.ceil(pad / len(order)))[:pad]
    return rest[sampler.rank::ranks]


class ResumableDataLoader(DataLoader):
    """A DataLoader (same arguments) with a position: `skip_next(n)` starts its next
    iteration at batch n, unread; `state_dict()` is where the current iteration is
    (restored with `load_state_dict`, on any number of ranks with a DistributedSampler).
    `len()` stays the whole epoch's, as the step arithmetic of a resumed epoch expects."""

    def __init__(self, *args: Any, **kwargs: Any) -> None:
        super().__init__(*args, **kwargs)
        self._view = _PositionView(self)
        self._plan: Iterable[Any] | None = None  # the starting iteration's indices
        self._pending: dict[str, Any] | None = None  # a position for the next iteration
        self._epoch: int | None = None  # the current iteration's (a DistributedSampler's)
        self._consumed = 0  # samples of the epoch's order consumed, by all ranks
        self._yielded = 0  # batches of the current epoch handed out, skipped ones included
        self._left = 0  # batches the current iteration has still to hand out
        self._rng_at_start: torch.Tensor | None = None
        if isinstance(self.sampler, RandomSampler) and self.sampler.generator is None:
            # its own generator, seeded as RandomSampler seeds one (from torch's RNG):
            # a state to save and restore
            seed = int(torch.empty((), dtype=torch.int64).random_().item())
            self.sampler.generator = torch.Generator().manual_seed(seed)

    def skip_next(self, batches: int) -> None:
        """Start the next iteration `batches` batches in (the rest of a resumed epoch)."""
        if batches < 0:
            raise ValueError(f"cannot skip a negative number of batches ({batches})")
        self._pending = {"batches": batches, "explicit": True}

    def _generator(self) -> torch.Generator | None:
        """A shuffling sampler's generator: its state is the epoch's permutation."""
        return self.sampler.generator if isinstance(self.sampler, RandomSampler) else None

    def _sampler_epoch(self) -> int | None:
        return self.sampler.epoch if isinstance(self.sampler, DistributedSampler) else None

    def _samples_per_batch(self) -> int:
        """Samples of the epoch's order one batch index of every rank consumes."""
        ranks = self.sampler.num_replicas if isinstance(self.sampler, DistributedSampler) else 1
        return (self.batch_size or 1) * ranks

    def _base_index_sampler(self) -> Any:
        return DataLoader._index_sampler.fget(self)  # type: ignore[attr-defined]

    @property
    def _index_sampler(self) -> Any:
        # DataLoader draws its indices from here (torch's own hook for this), whether
        # the batches come from the main process or from workers.
        return self._view

    def _applies(self, pending: dict[str, Any]) -> bool:
        """Whether a restored position is for the iteration starting now: one of the
        epoch it was taken in (known with a DistributedSampler), or, the epoch unknown,
        one with batches left (a whole epoch handed out: the next is a new one)."""
        if pending.get("explicit"):
            return True
        epoch = self._sampler_epoch()
        if pending.get("epoch") is not None and epoch is not None:
            return pending["epoch"] == epoch
        return not pending.get("complete", False)

    def _start(self) -> None:
        """Plan the iteration starting now from the pending position, if it applies."""
        pending, self._pending = self._pending, None
        applies = pending is not None and self._applies(pending)
        generator = self._generator()
        if generator is not None:
            if pending is not None and pending.get("rng") is not None:
                generator.set_state(pending["rng"])  # the permutation it was cut from
                if not applies:  # that epoch is over: draw what it drew (indices only)
                    for _ in self.sampler:
                        pass
            self._rng_at_start = generator.get_state()
        self._epoch = self._sampler_epoch()
        base = self._base_index_sampler()
        per_batch = self._samples_per_batch()
        self._plan, start_batches, start_samples = None, 0, 0
        if pending is not None and applies:
            if pending.get("samples") is not None and self.batch_size is not None \
                    and isinstance(self.sampler, DistributedSampler):
                start_samples = int(pending["samples"])
                rest = shard_after(self.sampler, start_samples)
                self._plan = BatchSampler(rest, self.batch_size, self.drop_last)
                start_batches = start_samples // per_batch
            elif pending.get("batches"):
                start_batches = int(pending["batches"])
                start_samples = start_batches * per_batch
                self._plan = itertools.islice(iter(base), start_batches, None)
        self._yielded, self._consumed = start_batches, start_samples
        self._left = len(self._plan) if isinstance(self._plan, BatchSampler) \
            else len(base) - start_batches

    def __iter__(self) -> Iterator[Any]:
        if isinstance(self.dataset, IterableDataset):  # no indices to skip: a plain
            yield from super().__iter__()  # DataLoader's iteration (it crashed, a review)
            return
        self._start()
        try:
            it = super().__iter__()  # draws the planned indices through the view
        finally:
            self._plan = None
        per_batch = self._samples_per_batch()
        for batch in it:
            self._yielded += 1
            self._consumed += per_batch
            self._left -= 1
            yield batch
        # ran to its end: the next iteration is new (a shuffling sampler has drawn it)
        self._yielded = self._consumed = self._left = 0
        self._rng_at_start = None
        self._epoch = None

    def state_dict(self) -> dict[str, Any]:
        """`batches`: this rank's batches of the epoch handed out (skipped included);
        `samples`: the epoch's order consumed by all ranks; `complete`: the epoch's last
        batch handed out; `epoch`: a DistributedSampler's epoch; `rng`: a shuffling
        sampler's generator where this epoch's permutation was drawn (between epochs:
        where the next one will be; a restored complete epoch draws its permutation
        again, indices only, to be there)."""
        if isinstance(self.dataset, IterableDataset):  # no indices: the dataset's own
            own = getattr(self.dataset, "state_dict", None)  # state, if it keeps one
            return {"dataset": own()} if callable(own) else {}
        complete = self._yielded > 0 and self._left <= 0
        state: dict[str, Any] = {"batches": self._yielded, "samples": self._consumed,
                                 "complete": complete}
        if self._epoch is not None:
            state["epoch"] = self._epoch
        generator = self._generator()
        if generator is not None:  # at the epoch's start; between epochs, as it is now
            rng = self._rng_at_start if self._rng_at_start is not None else generator.get_state()
            state["rng"] = rng.clone()
        return state

    def load_state_dict(self, state: dict[str, Any]) -> None:
        """Position the next iteration at `state` (from `state_dict`, on this or
        another number of ranks), if it is of the epoch the state was taken in. A
        state without samples (an older one) positions by batches."""
        if isinstance(self.dataset, IterableDataset):
            load = getattr(self.dataset, "load_state_dict", None)
            if "dataset" in state and callable(load):
                load(state["dataset"])
            else:  # resumed, and it cannot say where: its epoch starts again (replayed)
                warnings.warn("ResumableDataLoader: an iterable dataset without "
                              "state_dict/load_state_dict is not positioned: the resumed "
                              "epoch reads it from its beginning again", stacklevel=2)
            return
        pending = {k: state[k] for k in ("batches", "samples", "epoch", "complete")
                   if k in state}
        if "rng" in state and self._generator() is not None:
            pending["rng"] = torch.as_tensor(state["rng"], dtype=torch.uint8).clone()
        self._pending = pending
