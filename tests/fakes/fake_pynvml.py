"""A fake of the pynvml API for machines without a GPU.

It stands in for the module object: the functions the NVML backend calls are
methods here, while constants and the NVMLError class hierarchy are the real
pynvml's, so the backend's `except n.NVMLError_GpuIsLost` clauses are exercised
against the real exception types. Tests flip per-GPU switches (lose a GPU, make a
function or field unsupported, queue XID events, fail init) and count calls.
"""

from __future__ import annotations

import collections
from dataclasses import dataclass, field
from types import SimpleNamespace
from typing import Any

import pynvml


@dataclass
class FakeGpu:
    uuid: str
    name: str = "NVIDIA H100 80GB HBM3"
    util: int = 50
    mem_used: int = 10 * 2**30
    mem_total: int = 80 * 2**30
    temp: int = 60
    power_mw: int = 350_000
    limit_mw: int = 700_000
    sm_mhz: int = 1980
    max_sm_mhz: int = 1980
    reasons: int = 0
    lost: bool = False
    unsupported_fns: set[str] = field(default_factory=set)
    failing_fns: set[str] = field(default_factory=set)  # answer NVML_ERROR_UNKNOWN
    unsupported_fields: set[int] = field(default_factory=set)
    fields: dict[int, float] = field(default_factory=dict)
    pcie_gen: int = 5
    pcie_gen_max: int = 5
    pcie_width: int = 16
    pcie_width_max: int = 16
    nvlink_up: list[bool] = field(default_factory=lambda: [True] * 4)  # [] = no NVLink
    nvlink_errors: dict[tuple[int, int], int] = field(default_factory=dict)  # (link, kind)
    compute_pids: list[int] = field(default_factory=list)  # processes with a CUDA context
    graphics_pids: list[int] = field(default_factory=list)
    register_errors: list[int] = field(default_factory=list)  # nvmlDeviceRegisterEvents'


class FakeNvml:
    def __init__(self, gpus: int = 2, init_error: type[Exception] | None = None) -> None:
        self.gpus = [FakeGpu(uuid=f"GPU-fake-{i}") for i in range(gpus)]
        for i, g in enumerate(self.gpus):
            g.fields = {
                pynvml.NVML_FI_DEV_MEMORY_TEMP: 70 + i,
                pynvml.NVML_FI_DEV_TOTAL_ENERGY_CONSUMPTION: 5_000_000,  # mJ
                pynvml.NVML_FI_DEV_ECC_SBE_VOL_TOTAL: 3,
                pynvml.NVML_FI_DEV_ECC_DBE_VOL_TOTAL: 0,
                pynvml.NVML_FI_DEV_REMAPPED_COR: 1,
                pynvml.NVML_FI_DEV_REMAPPED_UNC: 0,
                pynvml.NVML_FI_DEV_REMAPPED_PENDING: 0,
                pynvml.NVML_FI_DEV_REMAPPED_FAILURE: 0,
                pynvml.NVML_FI_DEV_NVLINK_THROUGHPUT_DATA_TX: 1000,  # KiB
                pynvml.NVML_FI_DEV_NVLINK_THROUGHPUT_DATA_RX: 2000,
                pynvml.NVML_FI_DEV_PCIE_COUNT_TX_BYTES: 4096,
                pynvml.NVML_FI_DEV_PCIE_COUNT_RX_BYTES: 8192,
                pynvml.NVML_FI_DEV_PCIE_REPLAY_COUNTER: 0,
            }
        self.init_error = init_error
        self.initialised = False
        # (gpu, xid) queued in the event set: freeing the set discards them (`discarded`)
        self.events: collections.deque[tuple[int, int]] = collections.deque()
        self.discarded = 0
        self.event_set_error: int | None = None  # nvmlEventSetCreate answers this error
        self.calls: collections.Counter[str] = collections.Counter()
        self.driver_lost_until_reinit = False
        # Set to an unset threading.Event to make every per-GPU call hang until it is
        # set: what a GPU in trouble does to NVML calls (they block in the driver).
        self.stuck: Any = None

    def __getattr__(self, name: str) -> Any:  # constants and error classes: the real ones
        return getattr(pynvml, name)

    # -- helpers ----------------------------------------------------------------------
    def _gpu(self, handle: Any) -> FakeGpu:
        g = self.gpus[handle]
        if not self.initialised:
            raise pynvml.NVMLError(pynvml.NVML_ERROR_UNINITIALIZED)
        if g.lost:
            raise pynvml.NVMLError(pynvml.NVML_ERROR_GPU_IS_LOST)
        return g

    def _fn(self, name: str, handle: Any) -> FakeGpu:
        self.calls[name] += 1
        if self.stuck is not None:
            self.stuck.wait()
        g = self._gpu(handle)
        if name in g.unsupported_fns:
            raise pynvml.NVMLError(pynvml.NVML_ERROR_NOT_SUPPORTED)
        if name in g.failing_fns:
            raise pynvml.NVMLError(pynvml.NVML_ERROR_UNKNOWN)
        return g

    # -- the pynvml API subset the backend uses --------------------------------------------
    def nvmlInit(self) -> None:
        self.calls["nvmlInit"] += 1
        if self.init_error is not None:
            raise self.init_error(pynvml.NVML_ERROR_DRIVER_NOT_LOADED)
        self.initialised = True

    def nvmlShutdown(self) -> None:
        self.calls["nvmlShutdown"] += 1
        self.initialised = False

    def nvmlSystemGetDriverVersion(self) -> str:
        return "550.54.15"

    def nvmlDeviceGetCount(self) -> int:
        return sum(1 for g in self.gpus if not g.lost)

    def nvmlDeviceGetHandleByIndex(self, index: int) -> int:
        live = [i for i, g in enumerate(self.gpus) if not g.lost]
        return live[index]

    def nvmlDeviceGetUUID(self, h: int) -> str:
        return self._fn("nvmlDeviceGetUUID", h).uuid

    def nvmlDeviceGetName(self, h: int) -> str:
        return self._fn("nvmlDeviceGetName", h).name

    def nvmlDeviceGetPciInfo(self, h: int) -> Any:
        self._fn("nvmlDeviceGetPciInfo", h)
        return SimpleNamespace(busId=f"00000000:{h + 1:02X}:00.0".encode())

    def nvmlDeviceGetMaxClockInfo(self, h: int, _clock: int) -> int:
        return self._fn("nvmlDeviceGetMaxClockInfo", h).max_sm_mhz

    def nvmlDeviceGetUtilizationRates(self, h: int) -> Any:
        return SimpleNamespace(gpu=self._fn("nvmlDeviceGetUtilizationRates", h).util, memory=0)

    def nvmlDeviceGetMemoryInfo(self, h: int) -> Any:
        g = self._fn("nvmlDeviceGetMemoryInfo", h)
        return SimpleNamespace(used=g.mem_used, total=g.mem_total, free=g.mem_total - g.mem_used)

    def nvmlDeviceGetTemperature(self, h: int, _sensor: int) -> int:
        return self._fn("nvmlDeviceGetTemperature", h).temp

    def nvmlDeviceGetPowerUsage(self, h: int) -> int:
        return self._fn("nvmlDeviceGetPowerUsage", h).power_mw

    def nvmlDeviceGetEnforcedPowerLimit(self, h: int) -> int:
        return self._fn("nvmlDeviceGetEnforcedPowerLimit", h).limit_mw

    def nvmlDeviceGetClockInfo(self, h: int, _clock: int) -> int:
        return self._fn("nvmlDeviceGetClockInfo", h).sm_mhz

    def nvmlDeviceGetCurrentClocksEventReasons(self, h: int) -> int:
        return self._fn("nvmlDeviceGetCurrentClocksEventReasons", h).reasons

    def nvmlDeviceGetCurrPcieLinkGeneration(self, h: int) -> int:
        return self._fn("nvmlDeviceGetCurrPcieLinkGeneration", h).pcie_gen

    def nvmlDeviceGetMaxPcieLinkGeneration(self, h: int) -> int:
        return self._fn("nvmlDeviceGetMaxPcieLinkGeneration", h).pcie_gen_max

    def nvmlDeviceGetCurrPcieLinkWidth(self, h: int) -> int:
        return self._fn("nvmlDeviceGetCurrPcieLinkWidth", h).pcie_width

    def nvmlDeviceGetMaxPcieLinkWidth(self, h: int) -> int:
        return self._fn("nvmlDeviceGetMaxPcieLinkWidth", h).pcie_width_max

    def nvmlDeviceGetNvLinkState(self, h: int, link: int) -> int:
        g = self._fn("nvmlDeviceGetNvLinkState", h)
        if not g.nvlink_up:  # a PCIe-only board, as the driver answers
            raise pynvml.NVMLError(pynvml.NVML_ERROR_NOT_SUPPORTED)
        if link >= len(g.nvlink_up):
            raise pynvml.NVMLError(pynvml.NVML_ERROR_INVALID_ARGUMENT)
        return pynvml.NVML_FEATURE_ENABLED if g.nvlink_up[link] else pynvml.NVML_FEATURE_DISABLED

    def nvmlDeviceGetNvLinkErrorCounter(self, h: int, link: int, counter: int) -> int:
        g = self._fn("nvmlDeviceGetNvLinkErrorCounter", h)
        if link >= len(g.nvlink_up):
            raise pynvml.NVMLError(pynvml.NVML_ERROR_INVALID_ARGUMENT)
        return g.nvlink_errors.get((link, counter), 0)

    def nvmlDeviceGetFieldValues(self, h: int, ids: list) -> list:
        g = self._fn("nvmlDeviceGetFieldValues", h)
        self.calls["fields_requested"] += len(ids)
        out = []
        for fid in ids:
            fid = fid[0] if isinstance(fid, tuple) else fid
            if fid in g.unsupported_fields or fid not in g.fields:
                out.append(SimpleNamespace(nvmlReturn=pynvml.NVML_ERROR_NOT_SUPPORTED,
                                           valueType=3, value=SimpleNamespace(ullVal=0)))
            else:
                out.append(SimpleNamespace(nvmlReturn=pynvml.NVML_SUCCESS, valueType=3,
                                           value=SimpleNamespace(ullVal=int(g.fields[fid]))))
        return out

    def nvmlDeviceGetComputeRunningProcesses(self, h: int) -> list:
        g = self._fn("nvmlDeviceGetComputeRunningProcesses", h)
        return [_process(pid) for pid in g.compute_pids]

    def nvmlDeviceGetGraphicsRunningProcesses(self, h: int) -> list:
        g = self._fn("nvmlDeviceGetGraphicsRunningProcesses", h)
        return [_process(pid) for pid in g.graphics_pids]

    def nvmlEventSetCreate(self) -> str:
        self.calls["nvmlEventSetCreate"] += 1
        if self.event_set_error is not None:
            raise pynvml.NVMLError(self.event_set_error)
        return "event-set"

    def nvmlDeviceRegisterEvents(self, h: int, _types: int, _set: Any) -> None:
        g = self._fn("nvmlDeviceRegisterEvents", h)
        if g.register_errors:  # passing failures, one per call
            raise pynvml.NVMLError(g.register_errors.pop(0))

    def nvmlEventSetWait_v2(self, _set: Any, _timeout_ms: int) -> Any:
        self.calls["nvmlEventSetWait_v2"] += 1
        if not self.events:
            raise pynvml.NVMLError(pynvml.NVML_ERROR_TIMEOUT)
        gpu, xid = self.events.popleft()
        return SimpleNamespace(device=gpu, eventData=xid, eventType=8)

    def nvmlEventSetFree(self, _set: Any) -> None:
        # as NVML: what the set still holds goes with it (one set at a time here)
        self.discarded += len(self.events)
        self.events.clear()


def _process(pid: int) -> Any:
    """A c_nvmlProcessInfo_t as pynvml returns it (memory in bytes; the MIG instance ids
    are 0xFFFFFFFF on a GPU without MIG)."""
    return SimpleNamespace(pid=pid, usedGpuMemory=2**30, gpuInstanceId=0xFFFFFFFF,
                           computeInstanceId=0xFFFFFFFF)
