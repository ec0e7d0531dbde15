"""A fake libnvidia-ml under the real pynvml, for machines without a GPU.

`fake_pynvml.FakeNvml` stands in for the pynvml module: quick to steer, but pynvml's
own code never runs there, and that code decides what the backend meets on a real
driver: which symbol an unversioned call looks up (`..._v3` on an older driver is
missing, and pynvml then raises `NVMLLibraryMismatchError`, which is not an
NVMLError), which return code becomes which exception class, and how structs come
back. Here only the C functions are Python: `install()` gives pynvml this library,
pynvml's real wrappers call it through their own ctypes signatures, and a symbol the
`FakeLib` lacks is a symbol the driver lacks (pynvml raises FunctionNotFound exactly
as on an old driver). It models return codes and values, not a GPU.
"""

from __future__ import annotations

import contextlib
import ctypes
from collections.abc import Callable, Iterator
from dataclasses import dataclass, field
from typing import Any

import pynvml

OK = 0
_BASE = 0x1000  # a handle is this plus the GPU's index


def _set(out: Any, value: Any) -> None:
    """Write through a `byref(c_uint)` argument."""
    out._obj.value = value


def _index(handle: Any) -> int:
    return ctypes.cast(handle, ctypes.c_void_p).value - _BASE


@dataclass
class LibGpu:
    uuid: str
    busid: bytes
    lost: bool = False
    fail: dict[str, int] = field(default_factory=dict)  # symbol -> return code, each call
    # symbol -> the codes of its next calls, in turn (0: answers as usual)
    fail_once: dict[str, list[int]] = field(default_factory=dict)
    field_ret: dict[int, int] = field(default_factory=dict)  # field id -> its nvmlReturn
    compute: list[int] = field(default_factory=list)  # pids with a compute context
    graphics: list[int] = field(default_factory=list)  # ... with a graphics context
    nvlinks: int = 4


class FakeLib:
    """The C library: attribute `nvmlX` is the symbol `nvmlX` (methods `c_nvmlX`);
    names in `missing` are symbols this driver lacks."""

    def __init__(self, gpus: int = 2, missing: set[str] | frozenset[str] = frozenset()) -> None:
        self.gpus = [LibGpu(f"GPU-lib-{i}", f"00000000:{i + 7:02X}:00.0".encode())
                     for i in range(gpus)]
        self.missing = set(missing)
        self.handle_ret: dict[int, int] = {}  # index -> return code of its handle call
        self.events: list[tuple[int, int]] = []  # (gpu index, xid)
        self.calls: dict[str, int] = {}

    def __getattr__(self, name: str) -> Callable[..., int]:
        impl = getattr(type(self), "c_" + name, None)
        if name in self.missing or name.startswith("__") or impl is None:
            raise AttributeError(name)  # pynvml: NVMLError_FunctionNotFound

        def call(*args: Any) -> int:
            self.calls[name] = self.calls.get(name, 0) + 1
            return impl(self, *args)
        return call

    def _dev(self, name: str, handle: Any) -> tuple[LibGpu, int]:
        g = self.gpus[_index(handle)]
        if g.lost:
            return g, pynvml.NVML_ERROR_GPU_IS_LOST
        if g.fail_once.get(name):
            return g, g.fail_once[name].pop(0)
        return g, g.fail.get(name, OK)

    # -- system ---------------------------------------------------------------------------
    def c_nvmlInitWithFlags(self, _flags: int) -> int:
        return OK

    def c_nvmlShutdown(self) -> int:
        return OK

    def c_nvmlErrorString(self, ret: int) -> bytes:
        return b"error %d" % ret

    def c_nvmlSystemGetDriverVersion(self, buf: Any, _size: int) -> int:
        buf.value = b"470.82.01"
        return OK

    def c_nvmlDeviceGetCount_v2(self, count: Any) -> int:
        _set(count, len(self.gpus))
        return OK

    def c_nvmlDeviceGetHandleByIndex_v2(self, index: Any, dev: Any) -> int:
        i = index.value
        if i in self.handle_ret:
            return self.handle_ret[i]
        ctypes.c_void_p.from_buffer(dev._obj).value = _BASE + i
        return OK

    # -- one GPU ---------------------------------------------------------------------------
    def c_nvmlDeviceGetUUID(self, h: Any, buf: Any, _size: int) -> int:
        g, ret = self._dev("nvmlDeviceGetUUID", h)
        if not ret:
            buf.value = g.uuid.encode()
        return ret

    def c_nvmlDeviceGetName(self, h: Any, buf: Any, _size: int) -> int:
        _, ret = self._dev("nvmlDeviceGetName", h)
        if not ret:
            buf.value = b"NVIDIA A100-SXM4-80GB"
        return ret

    def c_nvmlDeviceGetPciInfo_v3(self, h: Any, info: Any) -> int:
        g, ret = self._dev("nvmlDeviceGetPciInfo_v3", h)
        if not ret:
            info._obj.busId = g.busid
        return ret

    @staticmethod
    def _uint(name: str, value: int) -> Callable[..., int]:
        def read(self: FakeLib, h: Any, *rest: Any) -> int:
            _, ret = self._dev(name, h)
            if not ret:
                _set(rest[-1], value)
            return ret
        return read

    c_nvmlDeviceGetMaxClockInfo = _uint("nvmlDeviceGetMaxClockInfo", 1410)
    c_nvmlDeviceGetClockInfo = _uint("nvmlDeviceGetClockInfo", 1400)
    c_nvmlDeviceGetMaxPcieLinkGeneration = _uint("nvmlDeviceGetMaxPcieLinkGeneration", 4)
    c_nvmlDeviceGetMaxPcieLinkWidth = _uint("nvmlDeviceGetMaxPcieLinkWidth", 16)
    c_nvmlDeviceGetCurrPcieLinkGeneration = _uint("nvmlDeviceGetCurrPcieLinkGeneration", 4)
    c_nvmlDeviceGetCurrPcieLinkWidth = _uint("nvmlDeviceGetCurrPcieLinkWidth", 16)
    c_nvmlDeviceGetTemperature = _uint("nvmlDeviceGetTemperature", 55)
    c_nvmlDeviceGetPowerUsage = _uint("nvmlDeviceGetPowerUsage", 250_000)
    c_nvmlDeviceGetEnforcedPowerLimit = _uint("nvmlDeviceGetEnforcedPowerLimit", 400_000)
    # 0x40: hw_slowdown's bit for the thermal event
    c_nvmlDeviceGetCurrentClocksEventReasons = _uint(
        "nvmlDeviceGetCurrentClocksEventReasons", 0x40)
    c_nvmlDeviceGetCurrentClocksThrottleReasons = _uint(
        "nvmlDeviceGetCurrentClocksThrottleReasons", 0x40)
    c_nvmlDeviceGetNvLinkErrorCounter = _uint("nvmlDeviceGetNvLinkErrorCounter", 2)

    def c_nvmlDeviceGetNvLinkState(self, h: Any, link: int, out: Any) -> int:
        g, ret = self._dev("nvmlDeviceGetNvLinkState", h)
        if ret:
            return ret
        if link >= g.nvlinks:
            return pynvml.NVML_ERROR_INVALID_ARGUMENT
        _set(out, pynvml.NVML_FEATURE_ENABLED)
        return OK

    def c_nvmlDeviceGetUtilizationRates(self, h: Any, util: Any) -> int:
        _, ret = self._dev("nvmlDeviceGetUtilizationRates", h)
        if not ret:
            util._obj.gpu = 77
        return ret

    def c_nvmlDeviceGetMemoryInfo(self, h: Any, mem: Any) -> int:
        _, ret = self._dev("nvmlDeviceGetMemoryInfo", h)
        if not ret:
            mem._obj.total, mem._obj.used, mem._obj.free = 80 * 2**30, 2**30, 79 * 2**30
        return ret

    def c_nvmlDeviceGetFieldValues(self, h: Any, _n: int, values: Any) -> int:
        g, ret = self._dev("nvmlDeviceGetFieldValues", h)
        if ret:
            return ret
        for fv in values._obj:
            fv.nvmlReturn = g.field_ret.get(fv.fieldId, OK)
            fv.valueType = pynvml.NVML_VALUE_TYPE_UNSIGNED_LONG_LONG
            fv.value.ullVal = 7
        return OK

    @staticmethod
    def _processes(name: str, kind: str) -> Callable[..., int]:
        """pynvml asks twice: the count (no array), then the array."""
        def read(self: FakeLib, h: Any, count: Any, out: Any) -> int:
            g, ret = self._dev(name, h)
            if ret:
                return ret
            pids = getattr(g, kind)
            if out is None:
                if not pids:
                    return OK
                _set(count, len(pids))
                return pynvml.NVML_ERROR_INSUFFICIENT_SIZE
            for i, pid in enumerate(pids):
                out[i].pid, out[i].usedGpuMemory = pid, 2**30
            _set(count, len(pids))
            return OK
        return read

    c_nvmlDeviceGetComputeRunningProcesses_v3 = _processes(
        "nvmlDeviceGetComputeRunningProcesses_v3", "compute")
    c_nvmlDeviceGetComputeRunningProcesses_v2 = _processes(
        "nvmlDeviceGetComputeRunningProcesses_v2", "compute")
    c_nvmlDeviceGetGraphicsRunningProcesses_v3 = _processes(
        "nvmlDeviceGetGraphicsRunningProcesses_v3", "graphics")
    c_nvmlDeviceGetGraphicsRunningProcesses_v2 = _processes(
        "nvmlDeviceGetGraphicsRunningProcesses_v2", "graphics")

    # -- XID events ------------------------------------------------------------------------
    def c_nvmlEventSetCreate(self, out: Any) -> int:
        ctypes.c_void_p.from_buffer(out._obj).value = 0x9999
        return OK

    def c_nvmlDeviceRegisterEvents(self, h: Any, _types: int, _set_: Any) -> int:
        return self._dev("nvmlDeviceRegisterEvents", h)[1]

    def c_nvmlEventSetWait_v2(self, _set_: Any, data: Any, _timeout: int) -> int:
        if not self.events:
            return pynvml.NVML_ERROR_TIMEOUT
        i, xid = self.events.pop(0)
        ctypes.c_void_p.from_buffer(data._obj, 0).value = _BASE + i
        data._obj.eventType = pynvml.nvmlEventTypeXidCriticalError
        data._obj.eventData = xid
        return OK

    def c_nvmlEventSetFree(self, _set_: Any) -> int:
        return OK


@contextlib.contextmanager
def installed(lib: FakeLib) -> Iterator[Any]:
    """pynvml, calling `lib` as its libnvidia-ml, until the block ends."""
    saved = pynvml.nvmlLib
    pynvml.nvmlLib = lib
    pynvml._nvmlGetFunctionPointer_cache.clear()
    try:
        yield pynvml
    finally:
        pynvml.nvmlLib = saved
        pynvml._nvmlGetFunctionPointer_cache.clear()
