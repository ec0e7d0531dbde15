"""GPU backends: each one turns a device into `GpuSample`s behind one interface.

Like node_exporter's collectors, a backend knows one source (NVML, the simulator)
and nothing about HTTP, Prometheus or the trainer.
"""

from __future__ import annotations

from typing import Protocol

from clusterpulse.agent.sample import GpuSample


class Backend(Protocol):
    name: str

    def collect(self) -> list[GpuSample]:
        """Read every GPU once. Must not raise because one GPU fails."""
        ...

    def unsupported(self) -> dict[tuple[int, str], str]:
        """(gpu index, metric) -> the reason the device gave for not supporting it."""
        ...

    def errors(self) -> dict[str, int]:
        """Collection errors so far, by kind (NVML error kind, "not_supported", ...)."""
        ...

    def close(self) -> None: ...


class BackendError(Exception):
    """The backend cannot start at all (no driver, no devices)."""


class CollectionFailed(BackendError):
    """Nothing this collection could read would be true (NVML itself does not answer
    after a re-initialisation): the agent keeps the last readings, whose age grows
    (AgentCollectionStale inhibits the node's GPU alerts), rather than reporting every
    GPU down, which pages GpuDown at once and restarts their jobs."""
