"""A Pulse step opened and closed from separate framework events.

`Pulse.step` and `StepContext.section` are context managers, written for a loop that
holds the step in one `with` block; a framework calls back at the step's start, at
the optimizer and at its end instead. This holds them open in between, the same way
for every integration.

A step is one optimizer step: with gradient accumulation, all its micro-batches, their
samples added up (`add`). A framework that fetches each micro-batch on its own
(Lightning) holds the step in its `data` section between them: that wait is input,
the step's data wait, not its compute."""

from __future__ import annotations

import contextlib
from typing import Any

from clusterpulse.trainer.instrument import Pulse, StepContext


class _Discarded(Exception):
    """What a discarded step exits with: a step that raised is not reported."""


class OpenStep:
    """At most one step open at a time, with at most one section open in it."""

    def __init__(self) -> None:
        self._step = contextlib.ExitStack()
        self._section = contextlib.ExitStack()
        self.ctx: StepContext | None = None

    def begin(self, pulse: Pulse, step: int, samples: int) -> None:
        """The step's (first) batch is here: the step starts, in forward_backward,
        with `samples` trained so far."""
        self.end()
        self.ctx = self._step.enter_context(pulse.step(step))
        self.ctx.samples = samples
        self.section("forward_backward")

    def add(self, samples: int) -> None:
        """Samples the open step trains beyond those it began with (gradient
        accumulation's later micro-batches); outside a step, nothing."""
        if self.ctx is not None:
            self.ctx.samples += samples

    def section(self, name: str) -> None:
        """The open section (if any) ends and `name` begins; outside a step, nothing."""
        if self.ctx is None:
            return
        self._section.close()
        self._section.enter_context(self.ctx.section(name))

    def discard(self) -> None:
        """A step a failed run left open (the framework raised inside it, and a retried
        `train()` begins) is dropped unreported: its time is no step's, and the next
        wait for input is not its own."""
        if self.ctx is None:
            return
        err = _Discarded()
        self._section.__exit__(_Discarded, err, None)
        self._step.__exit__(_Discarded, err, None)
        self.ctx = None

    def end(self, loss: Any = None) -> None:
        """The step ends (reported to the agent); outside a step, nothing."""
        if self.ctx is None:
            return
        if loss is not None:
            self.ctx.loss = loss.detach() if hasattr(loss, "detach") else loss
        self._section.close()
        self._step.close()
        self.ctx = None
