"""A DataLoader that resumes mid-epoch without reading the batches it skips.

The usual resume, `itertools.islice(loader, done, None)`, loads every skipped batch
and throws it away: on a large input pipeline that is minutes, counted as the first
step's data wait, and Lightning, finding a loader it cannot position, restarts the
epoch's data instead. Here the skip happens on the batch sampler's indices, before
any sample is fetched: the first batch after a resume costs what any batch costs.

The position is a count of batches, the same on every rank of a job (each rank's
DistributedSampler shard has as many), so the state rank 0 saves fits every rank.
`state_dict`/`load_state_dict` are the interface Lightning saves and restores with
its checkpoints (it then no longer warns that the loader is not resumable).
"""

from __future__ import annotations

import itertools
from collections.abc import Iterable, Iterator
from typing import Any

from torch.utils.data import DataLoader


class _Skipped:
    """The loader's batch sampler less its first `skip` batches (indices only)."""

    def __init__(self, batches: Iterable[Any], skip: int) -> None:
        self.batches, self.skip = batches, skip

    def __iter__(self) -> Iterator[Any]:
        return itertools.islice(iter(self.batches), self.skip, None)

    def __len__(self) -> int:
        # The epoch's length, skipped batches included: Lightning counts a resumed
        # epoch's batches from the restored position up to this.
        return len(self.batches)  # type: ignore[arg-type]


class ResumableDataLoader(DataLoader):
    """A DataLoader (same arguments) with a position: `skip_next(n)` starts its next
    iteration at batch n, unread; `state_dict()` is how many batches the current
    iteration has handed out (restored with `load_state_dict`). `len()` stays the
    whole epoch's, as the step arithmetic of a resumed epoch expects."""

    def __init__(self, *args: Any, **kwargs: Any) -> None:
        super().__init__(*args, **kwargs)
        self._skip = 0
        self._yielded = 0

    def skip_next(self, batches: int) -> None:
        """Start the next iteration `batches` batches in (the rest of a resumed epoch)."""
        if batches < 0:
            raise ValueError(f"cannot skip a negative number of batches ({batches})")
        self._skip = batches

    @property
    def _index_sampler(self) -> Any:
        # DataLoader draws its indices from here (torch's own hook for this), whether
        # the batches come from the main process or from workers.
        base = super()._index_sampler
        return _Skipped(base, self._skip) if self._skip else base

    def __iter__(self) -> Iterator[Any]:
        it = super().__iter__()  # takes the skipped index sampler
        self._yielded, self._skip = self._skip, 0
        for batch in it:
            self._yielded += 1
            yield batch

    def state_dict(self) -> dict[str, int]:
        return {"batches": self._yielded}

    def load_state_dict(self, state: dict[str, int]) -> None:
        self.skip_next(int(state.get("batches", 0)))
