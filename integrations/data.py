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
permutation. An iteration that has run to its end leaves position 0: the next one
is a new epoch, whatever saves it.
"""

from __future__ import annotations

import itertools
import math
from collections.abc import Iterable, Iterator
from typing import Any

import torch
from torch.utils.data import BatchSampler, DataLoader, DistributedSampler, RandomSampler


class _Positioned:
    """The indices an iteration hands out, with the whole epoch's length: Lightning
    counts a resumed epoch's batches from the restored position up to `len()`."""

    def __init__(self, batches: Iterable[Any], epoch_len: int) -> None:
        self.batches, self.epoch_len = batches, epoch_len

    def __iter__(self) -> Iterator[Any]:
        return iter(self.batches)

    def __len__(self) -> int:
        return self.epoch_len


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
        self._skip_batches = 0
        self._skip_samples: int | None = None  # a position in samples wins over batches
        self._rng_to_restore: torch.Tensor | None = None
        self._start_samples = 0  # where the current iteration began, in samples
        self._consumed = 0  # samples of the epoch's order consumed, by all ranks
        self._yielded = 0  # batches of the current epoch handed out, skipped ones included
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
        self._skip_batches, self._skip_samples = batches, None

    def _generator(self) -> torch.Generator | None:
        """A shuffling sampler's generator: its state is the epoch's permutation."""
        return self.sampler.generator if isinstance(self.sampler, RandomSampler) else None

    def _samples_per_batch(self) -> int:
        """Samples of the epoch's order one batch index of every rank consumes."""
        ranks = self.sampler.num_replicas if isinstance(self.sampler, DistributedSampler) else 1
        return (self.batch_size or 1) * ranks

    @property
    def _index_sampler(self) -> Any:
        # DataLoader draws its indices from here (torch's own hook for this), whether
        # the batches come from the main process or from workers.
        base = super()._index_sampler
        if self._skip_samples is not None and isinstance(self.sampler, DistributedSampler) \
                and self.batch_size is not None:
            rest = shard_after(self.sampler, self._skip_samples)
            return _Positioned(BatchSampler(rest, self.batch_size, self.drop_last), len(base))
        if self._skip_batches:
            return _Positioned(itertools.islice(iter(base), self._skip_batches, None),
                               len(base))
        return base

    def __iter__(self) -> Iterator[Any]:
        generator = self._generator()
        if generator is not None:
            if self._rng_to_restore is not None:
                generator.set_state(self._rng_to_restore)  # the permutation it was cut from
                self._rng_to_restore = None
            self._rng_at_start = generator.get_state()
        per_batch = self._samples_per_batch()
        if self._skip_samples is not None:
            self._start_samples = self._skip_samples
            self._yielded = self._skip_samples // per_batch
        else:
            self._start_samples = self._skip_batches * per_batch
            self._yielded = self._skip_batches
        self._consumed = self._start_samples
        it = super().__iter__()  # takes the positioned index sampler
        self._skip_batches, self._skip_samples = 0, None
        for batch in it:
            self._yielded += 1
            self._consumed += per_batch
            yield batch
        self._yielded = self._consumed = 0  # ran to its end: the next iteration is new
        self._rng_at_start = None

    def state_dict(self) -> dict[str, Any]:
        """`batches`: this rank's batches of the epoch handed out (skipped included);
        `samples`: the epoch's order consumed by all ranks; `rng`: a shuffling
        sampler's generator where this epoch's permutation was drawn (between epochs:
        where the next one will be)."""
        state: dict[str, Any] = {"batches": self._yielded, "samples": self._consumed}
        generator = self._generator()
        if generator is not None:
            rng = self._rng_at_start if self._rng_at_start is not None else generator.get_state()
            state["rng"] = rng.clone()
        return state

    def load_state_dict(self, state: dict[str, Any]) -> None:
        """Position the next iteration at `state` (from `state_dict`, on this or
        another number of ranks). A state without samples (an older one) positions
        by batches."""
        self.skip_next(int(state.get("batches", 0)))
        if "samples" in state:
            self._skip_samples = int(state["samples"])
        if "rng" in state and self._generator() is not None:
            self._rng_to_restore = torch.as_tensor(state["rng"], dtype=torch.uint8).clone()
