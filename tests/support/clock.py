"""A clock the test moves by hand (`clock.t += 30`): what the backends take as `clock`."""

from __future__ import annotations


class ManualClock:
    def __init__(self, start: float = 0.0) -> None:
        self.t = start

    def __call__(self) -> float:
        return self.t
