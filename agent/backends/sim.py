"""Simulated GPUs with a small physical model, for machines without NVIDIA hardware.

The model is coarse but causal, so that faults show up the way they do on real
hardware: ranks drive utilization; utilization drives power; power drives
temperature through thermal inertia; heat above the slowdown temperature lowers
clocks with the right clock-event reason; and lower clocks slow the ranks bound to
the GPU (the agent hands `slowdown(gpu)` back to them), so a hot GPU becomes a
straggler in the training metrics.
"""

from __future__ import annotations

import collections
import math
import threading
import time
import uuid as uuidlib
from collections.abc import Callable
from dataclasses import dataclass, field

from clusterpulse.agent.faults import Fault, ScheduledFault
from clusterpulse.agent.sample import GpuSample, NvLinkSample

GIB = 1024**3


@dataclass(frozen=True)
class GpuModel:
    name: str
    memory_bytes: float
    tdp_watts: float
    idle_watts: float
    max_sm_mhz: float
    idle_sm_mhz: float
    slowdown_celsius: float
    thermal_resistance: float  # °C per watt above ambient, with healthy cooling


MODELS = {
    "H100": GpuModel("NVIDIA H100 80GB HBM3", 80 * GIB, 700, 70, 1980, 345, 87, 0.06),
    "H200": GpuModel("NVIDIA H200", 141 * GIB, 700, 75, 1980, 345, 87, 0.06),
    "A100": GpuModel("NVIDIA A100-SXM4-80GB", 80 * GIB, 400, 55, 1410, 210, 85, 0.11),
}
AMBIENT_CELSIUS = 30.0
THERMAL_TAU_S = 15.0
BASE_MEMORY_BYTES = 0.5 * GIB  # driver/context overhead with no process


@dataclass
class Activity:
    """What the ranks bound to one GPU are doing, from their telemetry."""

    utilization: float = 0.0  # 0..1
    memory_bytes: float = 0.0
    sync_bytes_per_s: float = 0.0  # gradient all-reduce traffic -> NVLink
    host_bytes_per_s: float = 0.0  # input batches -> PCIe


@dataclass
class _GpuState:
    index: int
    uuid: str
    temperature: float = AMBIENT_CELSIUS + 5
    energy_joules: float = 0.0
    clock_factor: float = 1.0
    nvlink_tx: float = 0.0
    nvlink_rx: float = 0.0
    pcie_tx: float = 0.0
    pcie_rx: float = 0.0
    ecc_corrected: int = 0
    ecc_uncorrected: int = 0
    remapped_unc: int = 0
    remap_pending: int = 0
    xid: dict[int, int] = field(default_factory=dict)
    nvlink_replays: float = 0.0
    # persistent faults
    nvlink_down: bool = False
    nvlink_errors: bool = False
    pcie_degraded: bool = False
    overheat: bool = False
    power_brake: bool = False
    slow_clocks: float | None = None
    lost: bool = False


NO_ACTIVITY: Callable[[int], Activity] = lambda _gpu: Activity()  # noqa: E731
NO_PROCESSES: Callable[[int], tuple[int, ...]] = lambda _gpu: ()  # noqa: E731


class SimBackend:
    name = "sim"

    def __init__(
        self,
        gpus: int = 8,
        model: str = "H100",
        node: str = "sim",
        activity: Callable[[int], Activity] = NO_ACTIVITY,
        scenario: list[ScheduledFault] | None = None,
        clock: Callable[[], float] = time.monotonic,
        processes: Callable[[int], tuple[int, ...]] = NO_PROCESSES,
    ) -> None:
        """`processes(gpu)`: the pids a real driver would list on the GPU; the agent
        passes the live rank processes bound to it (no process is simulated)."""
        if model not in MODELS:
            raise ValueError(f"unknown GPU model {model!r}; known: {', '.join(MODELS)}")
        if not 1 <= gpus <= 64:
            raise ValueError(f"simulated GPUs must be 1..64, got {gpus}")
        self.model = MODELS[model]
        self.activity = activity
        self.processes = processes
        self._clock = clock
        self._start = self._last = clock()
        self._lock = threading.Lock()
        self._gpus = [
            _GpuState(i, "GPU-" + str(uuidlib.uuid5(uuidlib.NAMESPACE_DNS, f"{node}/{i}")))
            for i in range(gpus)
        ]
        self._pending = sorted(scenario or [], key=lambda f: f.at_s)
        self._recoveries: list[tuple[float, int]] = []  # (at monotonic, gpu)
        self._errors: collections.Counter[str] = collections.Counter()
        self.injected: list[tuple[float, Fault]] = []  # what happened, for the audit/UI

    @property
    def gpu_count(self) -> int:
        return len(self._gpus)

    # -- faults ---------------------------------------------------------------------
    def inject(self, fault: Fault) -> None:
        with self._lock:
            self._apply(fault)

    def _apply(self, fault: Fault) -> None:
        g = self._gpus[fault.gpu]
        now = self._clock()
        self.injected.append((now - self._start, fault))
        match fault.kind:
            case "overheat":
                g.overheat = True
            case "power_brake":
                g.power_brake = True
            case "slow_clocks":
                g.slow_clocks = fault.factor
            case "gpu_lost":
                g.lost = True
                g.xid[79] = g.xid.get(79, 0) + 1  # what the driver logs when a GPU falls off
            case "xid":
                g.xid[fault.code] = g.xid.get(fault.code, 0) + 1
            case "ecc_uncorrectable":
                g.ecc_uncorrected += 1
                g.remapped_unc += 1
                g.remap_pending = 1
                g.xid[48] = g.xid.get(48, 0) + 1  # double-bit ECC error XID
            case "nvlink_down":
                g.nvlink_down = True
                g.xid[74] = g.xid.get(74, 0) + 1  # NVLink error XID
            case "nvlink_errors":
                g.nvlink_errors = True
            case "pcie_degraded":
                g.pcie_degraded = True
            case "recover":
                g.overheat = g.power_brake = g.lost = False
                g.nvlink_down = g.nvlink_errors = g.pcie_degraded = False
                g.slow_clocks = None
                g.remap_pending = 0
        if fault.duration_s is not None and fault.kind != "recover":
            self._recoveries.append((now + fault.duration_s, fault.gpu))

    def _play_due_faults(self, now: float) -> None:
        elapsed = now - self._start
        while self._pending and self._pending[0].at_s <= elapsed:
            self._apply(self._pending.pop(0).fault)
        due = [gpu for at, gpu in self._recoveries if at <= now]
        self._recoveries = [(at, gpu) for at, gpu in self._recoveries if at > now]
        for gpu in due:
            self._apply(Fault(kind="recover", gpu=gpu))

    # -- physics --------------------------------------------------------------------
    def slowdown(self, gpu: int) -> float:
        """How much longer a rank's compute takes on this GPU than on a healthy one."""
        with self._lock:
            if not 0 <= gpu < len(self._gpus):
                return 1.0
            return 1.0 / max(self._gpus[gpu].clock_factor, 0.05)

    def collect(self) -> list[GpuSample]:
        with self._lock:
            now = self._clock()
            dt = max(0.0, now - self._last)
            self._last = now
            self._play_due_faults(now)
            return [self._step(g, dt) for g in self._gpus]

    def _step(self, g: _GpuState, dt: float) -> GpuSample:
        m = self.model
        if g.lost:
            return GpuSample(index=g.index, uuid=g.uuid, up=False, name=m.name,
                             down_reason="gpu_is_lost", xid_errors_total=dict(g.xid))
        try:
            act = self.activity(g.index)
        except Exception:  # the activity source is telemetry: never let it stop the GPUs
            self._errors["activity"] += 1
            act = Activity()
        util = min(max(act.utilization, 0.0), 1.0)
        reasons: set[str] = set()
        limit = m.tdp_watts
        # Clock factor from the faults and the current temperature (previous step's heat).
        factor = 1.0
        if g.slow_clocks is not None:
            factor = min(factor, g.slow_clocks)
            reasons.add("hw_slowdown")
        if g.power_brake:
            factor = min(factor, 0.5)
            limit = m.tdp_watts * 0.5
            reasons.add("hw_power_brake_slowdown")
        if g.temperature >= m.slowdown_celsius - 3:
            thermal = max(0.35, 1.0 - 0.07 * (g.temperature - (m.slowdown_celsius - 3)))
            factor = min(factor, thermal)
            reasons.add("sw_thermal_slowdown")
            if g.temperature >= m.slowdown_celsius:
                reasons.add("hw_thermal_slowdown")
        demand = m.idle_watts + (m.tdp_watts - m.idle_watts) * util * factor
        if demand > limit:
            reasons.add("sw_power_cap")
        power = min(demand, limit)
        if util < 0.05:
            reasons.add("gpu_idle")
            clock = m.idle_sm_mhz
        else:
            clock = m.max_sm_mhz * factor
        g.clock_factor = factor
        # Thermal inertia: first-order approach to the steady-state temperature.
        resistance = m.thermal_resistance * (2.6 if g.overheat else 1.0)
        target = AMBIENT_CELSIUS + resistance * power
        g.temperature += (target - g.temperature) * (1 - math.exp(-dt / THERMAL_TAU_S))
        g.energy_joules += power * dt
        g.nvlink_tx += act.sync_bytes_per_s * dt
        g.nvlink_rx += act.sync_bytes_per_s * dt
        # PCIe carries the input batches and, through the NIC (GPUDirect RDMA), the
        # share of the all-reduce that leaves the node: the ranks' real sync volume.
        g.pcie_rx += (act.host_bytes_per_s + act.sync_bytes_per_s) * dt
        g.pcie_tx += (act.host_bytes_per_s * 0.02 + act.sync_bytes_per_s) * dt
        if g.nvlink_errors:  # about one replay per MiB over a bad link
            g.nvlink_replays += act.sync_bytes_per_s * dt / 2**20
        try:
            pids = tuple(self.processes(g.index))
        except Exception:  # like the activity: telemetry must never stop the GPUs
            self._errors["processes"] += 1
            pids = ()
        return GpuSample(
            index=g.index, uuid=g.uuid, up=True, name=m.name,
            pci_bus_id=f"00000000:{0x18 + g.index * 0x10:02X}:00.0", driver_version="sim",
            utilization_ratio=util,
            memory_used_bytes=min(BASE_MEMORY_BYTES + act.memory_bytes, m.memory_bytes),
            memory_total_bytes=m.memory_bytes,
            temperature_celsius=round(g.temperature, 2),
            memory_temperature_celsius=round(g.temperature + 4, 2),
            power_watts=round(power, 2), power_limit_watts=limit,
            energy_joules_total=g.energy_joules,
            sm_clock_hertz=clock * 1e6, sm_clock_max_hertz=m.max_sm_mhz * 1e6,
            clock_events=frozenset(reasons),
            pcie_tx_bytes_total=g.pcie_tx, pcie_rx_bytes_total=g.pcie_rx,
            nvlink_tx_bytes_total=g.nvlink_tx, nvlink_rx_bytes_total=g.nvlink_rx,
            pcie_replays_total=0, ecc_corrected_total=g.ecc_corrected,
            ecc_uncorrected_total=g.ecc_uncorrected, remapped_rows_correctable_total=0,
            remapped_rows_uncorrectable_total=g.remapped_unc,
            row_remap_pending=g.remap_pending, row_remap_failed=0,
            failed_reading_cycles_total=0.0,  # a simulated GPU answers every reading
            xid_errors_total=dict(g.xid),
            pcie_link_generation=5, pcie_link_generation_max=5,
            pcie_link_width=8 if g.pcie_degraded else 16, pcie_link_width_max=16,
            nvlinks={link: NvLinkSample(
                up=not (link == 0 and g.nvlink_down),
                errors={"crc": 0.0, "recovery": 0.0,
                        "replay": round(g.nvlink_replays) if link == 0 else 0.0})
                for link in range(4)},
            processes=pids,
        )

    def unsupported(self) -> dict[tuple[int, str], str]:
        return {}

    def errors(self) -> dict[str, int]:
        return dict(self._errors)

    def close(self) -> None:
        pass
