"""What one collection cycle knows about one GPU.

Every field but identity and `up` is optional: a metric the device does not support
stays None and is simply not exported, so dashboards show a gap rather than a lie.
"""

from __future__ import annotations

from dataclasses import dataclass, field

# Clock-event (throttle) reasons, in NVML's bit order. The names are the label values
# of clusterpulse_gpu_clock_event_active and what the rules and dashboard match on.
CLOCK_EVENT_REASONS: dict[str, int] = {
    "gpu_idle": 0x1,
    "applications_clocks_setting": 0x2,
    "sw_power_cap": 0x4,
    "hw_slowdown": 0x8,
    "sync_boost": 0x10,
    "sw_thermal_slowdown": 0x20,
    "hw_thermal_slowdown": 0x40,
    "hw_power_brake_slowdown": 0x80,
    "display_clock_setting": 0x100,
    "board_limit": 0x200,
    "reliability": 0x400,
    # a bit this agent does not know (a newer driver's reason): throttled, for a reason
    # named nowhere here. Ignored, the GPU read as not throttled (a review).
    "other": 0,
}
_KNOWN_CLOCK_EVENTS = sum(CLOCK_EVENT_REASONS.values())


def decode_clock_events(mask: int) -> frozenset[str]:
    """Turn NVML's reason bitmask into reason names; bits not named here: "other"."""
    names = {name for name, bit in CLOCK_EVENT_REASONS.items() if mask & bit}
    if mask & ~_KNOWN_CLOCK_EVENTS:
        names.add("other")
    return frozenset(names)


@dataclass
class NvLinkSample:
    """One NVLink: whether it is up and its data-link error counters by kind
    (crc: CRC flit errors, replay: retransmissions, recovery: link recoveries)."""

    up: bool
    errors: dict[str, float] = field(default_factory=dict)


@dataclass
class GpuSample:
    index: int
    uuid: str
    up: bool
    name: str = ""
    pci_bus_id: str = ""
    driver_version: str = ""
    utilization_ratio: float | None = None
    memory_used_bytes: float | None = None
    memory_total_bytes: float | None = None
    temperature_celsius: float | None = None
    memory_temperature_celsius: float | None = None
    power_watts: float | None = None
    power_limit_watts: float | None = None
    energy_joules_total: float | None = None
    sm_clock_hertz: float | None = None
    sm_clock_max_hertz: float | None = None
    clock_events: frozenset[str] | None = None
    pcie_tx_bytes_total: float | None = None
    pcie_rx_bytes_total: float | None = None
    nvlink_tx_bytes_total: float | None = None
    nvlink_rx_bytes_total: float | None = None
    pcie_replays_total: float | None = None
    ecc_corrected_total: float | None = None
    ecc_uncorrected_total: float | None = None
    remapped_rows_correctable_total: float | None = None
    remapped_rows_uncorrectable_total: float | None = None
    row_remap_pending: float | None = None
    row_remap_failed: float | None = None
    xid_errors_total: dict[int, int] = field(default_factory=dict)
    # PCIe link now and at most: a GPU that trained down to x8 or gen 3 moves its data
    # (and, with GPUDirect, its inter-node collectives) at a fraction of the speed.
    pcie_link_generation: float | None = None
    pcie_link_generation_max: float | None = None
    pcie_link_width: float | None = None
    pcie_link_width_max: float | None = None
    nvlinks: dict[int, NvLinkSample] = field(default_factory=dict)
    # Why the GPU is down (an NVML error kind such as "gpu_is_lost"); "" when up.
    down_reason: str = ""
    # The readings of an up GPU that NVML answered with an error this cycle (not "not
    # supported", not the GPU's end): missing from this sample. A GPU that answers its
    # liveness probe and fails the rest cycle after cycle is up but unwatched there (no
    # temperature, no ECC counts): GpuReadingsFailing.
    failing: tuple[str, ...] = ()
    # The collection cycles so far with any such failed reading: against the agent's
    # cycles, how often it fails (counted per cycle, so readings that take turns count)
    failed_reading_cycles_total: float | None = None
    # Host pids of the processes holding a context on the GPU (compute and graphics),
    # instrumented or not: what attributes the GPU to a job, a user or a notebook.
    processes: tuple[int, ...] = ()
