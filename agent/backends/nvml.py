"""NVML backend: reads real GPUs through nvidia-ml-py (pynvml).

Three rules keep it trustworthy on sick hardware:
- one GPU's failure marks that GPU down (`up` = 0, counted by NVML error kind) and
  never stops the others from reporting;
- a metric the device does not support is recorded once with NVML's reason and not
  asked for again (no error storm every cycle);
- everything NVML can batch is read with one `nvmlDeviceGetFieldValues` call.

A GPU is known by its UUID, not by NVML's index: after a re-initialisation the
driver may enumerate one GPU fewer (one fell off the bus) and shift the others'
indices, so each GPU keeps the `gpu` label it had when the agent first saw it, its
unsupported metrics, and its XID counts; the lost one is exported as `missing` and
re-probed until it returns. With a roster (`gpu_state`: the CLI's --remember-gpus, for
an agent that sees the whole node) the GPUs seen are remembered
(agent/gpuroster.py), so this holds across agent restarts too: a GPU lost before the
restart is still exported, down, under its own label. A GPU with a new UUID in the PCI
slot of a missing one is its replacement: it takes over the label.

The `nvml` module is a constructor argument so that the same code runs against the
real driver and against a fake at the pynvml API level on machines without a GPU.
"""

from __future__ import annotations

import collections
import contextlib
import ctypes
import importlib
import itertools
import logging
import re
import time
from dataclasses import dataclass, field
from pathlib import Path
from types import ModuleType
from typing import Any

from clusterpulse.agent.backends import BackendError, CollectionFailed
from clusterpulse.agent.gpuroster import GpuRoster, KnownGpu
from clusterpulse.agent.sample import GpuSample, NvLinkSample, decode_clock_events
from clusterpulse.agent.xidstate import XidLedger

log = logging.getLogger(__name__)

UINT_MAX = 0xFFFFFFFF  # scopeId meaning "all NVLink links"
NVML_SUCCESS = 0
NVML_ERROR_INVALID_ARGUMENT = 2
NVML_ERROR_NOT_SUPPORTED = 3

# Error kinds that say the GPU or NVML itself is gone, whichever call met them: the GPU
# is down and NVML is initialised again. Any other error of one optional metric (a
# driver's NVML_ERROR_UNKNOWN once, a process list that grew between pynvml's two
# calls) loses that metric for one cycle, not the GPU: GpuDown paged on them.
GONE = frozenset({"gpu_is_lost", "uninitialized", "reset_required", "driver_not_loaded",
                  "lib_rm_version_mismatch"})
# What NVML answers for a GPU it counts that this process may not use (outside its
# device cgroup: a Slurm job step's agent with ConstrainDevices): not this agent's GPU
NOT_OURS = frozenset({"no_permission"})

# GpuSample attribute -> (field id name in pynvml, scope id, scale to base units).
FIELDS: dict[str, tuple[str, int, float]] = {
    "memory_temperature_celsius": ("NVML_FI_DEV_MEMORY_TEMP", 0, 1.0),
    "energy_joules_total": ("NVML_FI_DEV_TOTAL_ENERGY_CONSUMPTION", 0, 1e-3),  # mJ
    "ecc_corrected_total": ("NVML_FI_DEV_ECC_SBE_VOL_TOTAL", 0, 1.0),
    "ecc_uncorrected_total": ("NVML_FI_DEV_ECC_DBE_VOL_TOTAL", 0, 1.0),
    "remapped_rows_correctable_total": ("NVML_FI_DEV_REMAPPED_COR", 0, 1.0),
    "remapped_rows_uncorrectable_total": ("NVML_FI_DEV_REMAPPED_UNC", 0, 1.0),
    "row_remap_pending": ("NVML_FI_DEV_REMAPPED_PENDING", 0, 1.0),
    "row_remap_failed": ("NVML_FI_DEV_REMAPPED_FAILURE", 0, 1.0),
    "nvlink_tx_bytes_total": ("NVML_FI_DEV_NVLINK_THROUGHPUT_DATA_TX", UINT_MAX, 1024.0),  # KiB
    "nvlink_rx_bytes_total": ("NVML_FI_DEV_NVLINK_THROUGHPUT_DATA_RX", UINT_MAX, 1024.0),
    "pcie_tx_bytes_total": ("NVML_FI_DEV_PCIE_COUNT_TX_BYTES", 0, 1.0),
    "pcie_rx_bytes_total": ("NVML_FI_DEV_PCIE_COUNT_RX_BYTES", 0, 1.0),
    "pcie_replays_total": ("NVML_FI_DEV_PCIE_REPLAY_COUNTER", 0, 1.0),
}


def error_kind(err: Exception) -> str:
    """NVMLError_GpuIsLost -> "gpu_is_lost": a stable label value for error counters."""
    name = type(err).__name__.removeprefix("NVMLError_")
    if name in ("NVMLError", ""):
        return f"nvml_error_{getattr(err, 'value', 'unknown')}"
    return re.sub(r"(?<!^)(?=[A-Z])", "_", name).lower()


def _field_number(fv: Any) -> float:
    """Read a c_nvmlFieldValue_t union by its declared type."""
    attr = {0: "dVal", 1: "uiVal", 2: "ulVal", 3: "ullVal", 4: "sllVal", 5: "siVal"}.get(
        int(fv.valueType), "ullVal"
    )
    return float(getattr(fv.value, attr))


@dataclass
class _Device:
    index: int  # the exported `gpu` label: NVML's index when the agent first saw the GPU
    handle: Any
    uuid: str
    name: str = ""
    pci_bus_id: str = ""
    sm_clock_max_hertz: float | None = None
    memory_total_bytes: float | None = None
    missing: bool = False
    # Why it is missing: "missing" (NVML no longer lists it), or the error kind of the
    # static read that failed (it answered its UUID, then was lost)
    reason: str = "missing"
    lost: bool = False  # a reading said it was gone (GONE) since the last enumeration
    probed: bool = True  # False: known from the roster only, static facts not read yet
    xid_counts: dict[int, int] = field(default_factory=dict)
    nvlinks: int = 0  # links found at start (0: no NVLink, or not supported)
    pcie_gen_max: float | None = None
    pcie_width_max: float | None = None
    # The readings that failed this cycle with an error that is not the GPU's end
    # (GpuSample.failing), and the cycles that had any (GpuReadingsFailing's evidence)
    failing: list[str] = field(default_factory=list)
    failed_cycles: int = 0
    probe_failed: bool = False  # the liveness probe failed last cycle (not GONE)


# NVLink data-link error counters: label value -> pynvml constant name
NVLINK_ERRORS = {"replay": "NVML_NVLINK_ERROR_DL_REPLAY",
                 "recovery": "NVML_NVLINK_ERROR_DL_RECOVERY",
                 "crc": "NVML_NVLINK_ERROR_DL_CRC_FLIT"}


class NvmlBackend:
    name = "nvml"
    # Re-initialisations (after a lost GPU, and to re-probe a missing one) wait this
    # long, then twice as long each time up to the maximum: a GPU back after a reset
    # reappears within a minute, and one gone for good costs an nvmlInit a minute.
    REINIT_INTERVAL_S = 30.0
    REINIT_MAX_INTERVAL_S = 60.0
    REINIT_RETRY_S = 5.0  # after a re-initialisation that failed

    def __init__(self, nvml: ModuleType | None = None, clock=time.monotonic,
                 xid_state: Path | None = None, gpu_state: Path | None = None) -> None:
        self._nvml = nvml if nvml is not None else importlib.import_module("pynvml")
        # XID totals persisted across agent restarts (None: this process's counts only).
        self._xids = XidLedger(xid_state) if xid_state is not None else None
        # The GPUs ever seen on this node (None: only those NVML lists at start).
        self._roster = GpuRoster(gpu_state) if gpu_state is not None else None
        self._clock = clock
        self._unsupported: dict[tuple[str, str], str] = {}  # (uuid, metric) -> reason
        self._errors: collections.Counter[str] = collections.Counter()
        self._devices: dict[str, _Device] = {}  # by uuid: survives re-enumeration
        # NVML indices whose handle or UUID did not answer at the last enumeration, with
        # the error kind: exported down under that index, and re-probed (a GPU that
        # answers `nvidia-smi` with "Unable to determine the device handle")
        self._unlisted: dict[int, str] = {}
        # Entry points this driver lacks (an older driver than the pynvml: no
        # ..._v3 symbol, no ClocksEventReasons): not tried again
        self._absent: set[str] = set()
        self._transient = 0  # passing errors of optional readings, ever
        self._order: list[str] = []
        self._event_set: Any = None
        # GPUs whose XID registration met a passing error, tried again each cycle
        # (None: every GPU is still to be registered)
        self._xid_unregistered: set[str] | None = None
        self._need_reinit = False  # NVML itself failed: no events until re-initialised
        self._reinit_failing = False  # the last re-initialisation failed
        self._last_reinit = clock()
        self._reinit_interval = self.REINIT_INTERVAL_S
        self._driver_version = ""
        self.calls = collections.Counter()  # NVML calls by function, for benchmarks
        for known in self._roster.load() if self._roster is not None else ():
            self._devices[known.uuid] = _Device(
                index=known.index, handle=None, uuid=known.uuid, name=known.name,
                pci_bus_id=known.pci_bus_id, missing=True, probed=False)
            self._order.append(known.uuid)
        try:
            self._init()
        except self._nvml.NVMLError as err:
            raise BackendError(
                f"NVML could not start ({error_kind(err)}: {err}). Is the NVIDIA driver "
                "installed and a GPU visible? Without a GPU run `clusterpulse-agent "
                "--backend sim` for simulated GPUs."
            ) from err

    # -- NVML plumbing -----------------------------------------------------------
    def _call(self, fn: str, *args: Any) -> Any:
        self.calls[fn] += 1
        return getattr(self._nvml, fn)(*args)

    def _init(self) -> None:
        n = self._nvml
        self._call("nvmlInit")
        version = self._call("nvmlSystemGetDriverVersion")
        self._driver_version = version.decode() if isinstance(version, bytes) else str(version)
        count = self._call("nvmlDeviceGetCount")
        seen: set[str] = set()
        changed = False
        unlisted, self._unlisted = self._unlisted, {}
        for index in range(count):
            try:
                handle = self._call("nvmlDeviceGetHandleByIndex", index)
                uuid = _text(self._call("nvmlDeviceGetUUID", handle))
            except n.NVMLError as err:
                kind = error_kind(err)
                self._errors[kind] += 1
                if kind in NOT_OURS:  # outside this agent's device cgroup: another job's
                    continue
                self._unlisted[index] = kind
                log.warning("gpu %d cannot be enumerated: %s", index, err)
                continue
            seen.add(uuid)
            dev = self._devices.get(uuid)
            if dev is None:
                dev = _Device(index=-1, handle=handle, uuid=uuid)
                probed = self._probe_static(dev)
                label = self._replaced_label(dev, seen)
                dev.index = self._free_label(index) if label is None else label
                self._devices[uuid] = dev
                self._order.append(uuid)
                changed = True
                if not probed:
                    continue
            elif not dev.probed:  # remembered (or lost at its first probe), here again
                dev.handle = handle
                if not self._probe_static(dev):
                    continue
                # now with its PCI slot: a replacement lost at its first probe, before
                # the slot was read, takes the replaced GPU's label now
                label = self._replaced_label(dev, seen)
                if label is not None:
                    dev.index = label
                changed = True  # the roster gets its name and slot
            if dev.missing or dev.lost:
                # back after a loss or a reset: what it did not support may have changed
                # (MIG turned off, which takes a reset, makes utilization supported)
                for key in [k for k in self._unsupported if k[0] == uuid]:
                    del self._unsupported[key]
            dev.handle, dev.missing, dev.lost, dev.reason = handle, False, False, "missing"
        for uuid, dev in self._devices.items():
            if uuid not in seen:
                dev.missing, dev.reason = True, "missing"
        # One NVML listed without answering, and lists no more (off the bus): no UUID
        # to be remembered by, so its label stays down, "missing", and NVML re-probed,
        # until a GPU takes that label (it was dropped, and never monitored again)
        labels = {d.index for d in self._devices.values()}
        for index in unlisted.keys() - self._unlisted.keys() - labels:
            self._unlisted[index] = "missing"
        if changed:
            self._save_roster()
        self._register_xid_events()

    def _replaced_label(self, dev: _Device, seen: set[str]) -> int | None:
        """A GPU new to the agent in the PCI slot of a known GPU that NVML no longer
        lists is that GPU's replacement (a card swapped during maintenance): it takes
        the old one's label, and the old one is forgotten. None if it is no such GPU."""
        if not dev.pci_bus_id:
            return None
        for uuid, old in list(self._devices.items()):
            if uuid not in seen and old.pci_bus_id.lower() == dev.pci_bus_id.lower():
                log.warning("gpu %d: %s replaced by %s in PCI slot %s", old.index, uuid,
                            dev.uuid, dev.pci_bus_id)
                del self._devices[uuid]
                self._order.remove(uuid)
                for key in [k for k in self._unsupported if k[0] == uuid]:
                    del self._unsupported[key]
                return old.index
        return None

    def _free_label(self, index: int) -> int:
        """The label for a GPU new to the agent: NVML's index, unless a known GPU (up
        or missing) exports it already, then the lowest free one: two series with one
        `gpu` label would merge in Prometheus."""
        taken = {d.index for d in self._devices.values()}
        if index not in taken:
            return index
        return next(i for i in itertools.count() if i not in taken)

    def _probe_static(self, dev: _Device) -> bool:
        """Read a GPU's static facts; False (the GPU stays missing, down with the error's
        kind, and is probed again) if it is lost while they are read. One GPU that
        answered its UUID and then was lost stopped the agent from starting, or every
        later collection of every GPU once it came back so."""
        transient = self._transient
        try:
            self._read_static(dev)
        except self._nvml.NVMLError as err:
            kind = error_kind(err)
            self._errors[kind] += 1
            log.warning("gpu %s lost while its static facts were read: %s", dev.uuid, err)
            dev.missing, dev.probed, dev.reason = True, False, kind
            return False
        # A passing error left a fact unread (its PCI slot, its maximum clock): read
        # again at the next collection, not kept empty for the agent's life
        dev.probed = self._transient == transient
        return True

    def _read_static(self, dev: _Device) -> None:
        dev.name = _text(self._optional(dev, "name", "nvmlDeviceGetName", dev.handle) or "")
        pci = self._optional(dev, "pci_info", "nvmlDeviceGetPciInfo", dev.handle)
        dev.pci_bus_id = _text(pci.busId) if pci is not None else ""
        max_mhz = self._optional(
            dev, "sm_clock_max_hertz", "nvmlDeviceGetMaxClockInfo", dev.handle,
            self._nvml.NVML_CLOCK_SM,
        )
        dev.sm_clock_max_hertz = max_mhz * 1e6 if max_mhz is not None else None
        gen = self._optional(dev, "pcie_link_generation_max",
                             "nvmlDeviceGetMaxPcieLinkGeneration", dev.handle)
        width = self._optional(dev, "pcie_link_width_max", "nvmlDeviceGetMaxPcieLinkWidth",
                               dev.handle)
        dev.pcie_gen_max = None if gen is None else float(gen)
        dev.pcie_width_max = None if width is None else float(width)
        dev.nvlinks = self._count_nvlinks(dev)

    def _count_nvlinks(self, dev: _Device) -> int:
        """Links answer in order; the first that does not ends the list."""
        n = self._nvml
        count = 0
        for link in range(int(getattr(n, "NVML_NVLINK_MAX_LINKS", 18))):
            try:
                self._call("nvmlDeviceGetNvLinkState", dev.handle, link)
            except (n.NVMLError_NotSupported, n.NVMLError_NoPermission,
                    n.NVMLError_InvalidArgument, n.NVMLError_FunctionNotFound) as err:
                if count == 0:
                    self._mark_unsupported(dev, "nvlink", err)
                break
            except n.NVMLError as err:
                # UNKNOWN, a timeout: not the end of the list. One on link 0 at start
                # marked NVLink unsupported for good (its alerts blind, nothing saying
                # so); now it is named, and the static facts are read again next cycle.
                self._passing(err, dev, "nvlink_up")
                break
            count += 1
        return count

    def _register_xid_events(self) -> None:
        """An event set for every GPU's XIDs. Only NOT_SUPPORTED or NO_PERMISSION
        mark a GPU's XIDs unsupported; any other error (UNKNOWN once) is tried again
        at the next cycle (`_xid_unregistered`): marked unsupported on any error, one
        passing failure blinded the GPU's XIDs (or, at the set's creation, every
        GPU's) until the agent restarted (a review)."""
        n = self._nvml
        if self._event_set is None:
            try:
                self._event_set = self._call("nvmlEventSetCreate")
            except (n.NVMLError_NotSupported, n.NVMLError_NoPermission) as err:
                for dev in self._devices.values():
                    self._mark_unsupported(dev, "xid_errors", err)
                self._xid_unregistered = set()
                return
            except n.NVMLError as err:
                self._errors[f"xid_events_{error_kind(err)}"] += 1
                if self._xid_unregistered is None:  # once, not each cycle it fails
                    log.warning("no XID event set (%s): no GPU's XIDs are counted; "
                                "trying again each cycle", err)
                self._xid_unregistered = {d.uuid for d in self._devices.values()
                                          if not d.missing}
                return
        retry = set()
        for dev in self._devices.values():
            if dev.missing or self._lacks(dev, "xid_errors"):
                continue
            if self._xid_unregistered is not None and dev.uuid not in self._xid_unregistered:
                continue  # registered already
            try:
                self._call(
                    "nvmlDeviceRegisterEvents", dev.handle, n.nvmlEventTypeXidCriticalError,
                    self._event_set,
                )
            except (n.NVMLError_NotSupported, n.NVMLError_NoPermission) as err:
                self._mark_unsupported(dev, "xid_errors", err)
            except n.NVMLError as err:
                self._errors[f"xid_events_{error_kind(err)}"] += 1
                retry.add(dev.uuid)
                if dev.uuid not in (self._xid_unregistered or ()):
                    log.warning("gpu %d (%s): its XID events are not registered (%s); "
                                "trying again each cycle", dev.index, dev.uuid, err)
        self._xid_unregistered = retry

    def _drain_xid_events(self) -> None:
        """Collect pending XID events without waiting (timeout 0): never blocks a cycle."""
        if self._event_set is None:
            return
        n = self._nvml
        by_uuid = {d.uuid: d for d in self._devices.values() if not d.missing}
        for _ in range(1000):  # bound the work per cycle whatever the driver does
            try:
                event = self._call("nvmlEventSetWait_v2", self._event_set, 0)
            except n.NVMLError_Timeout:
                return
            except n.NVMLError as err:
                self._errors[f"xid_events_{error_kind(err)}"] += 1
                return
            try:  # by UUID: NVML's index of a GPU changes when one before it is lost
                dev = by_uuid.get(_text(self._call("nvmlDeviceGetUUID", event.device)))
            except n.NVMLError:
                # a GPU that fell off the bus (XID 79) no longer answers its UUID: its
                # handle, from this enumeration, still names it
                dev = next((d for d in by_uuid.values()
                            if _same_handle(d.handle, event.device)), None)
            if dev is not None:
                xid = int(event.eventData)
                dev.xid_counts[xid] = dev.xid_counts.get(xid, 0) + 1

    def _xid_totals(self, dev: _Device) -> dict[int, int]:
        if self._xids is None:
            return dict(dev.xid_counts)
        return self._xids.merge(dev.uuid, dev.xid_counts)

    def _mark_unsupported(self, dev: _Device, metric: str, err: Exception | str) -> None:
        key = (dev.uuid, metric)
        if key not in self._unsupported:
            self._unsupported[key] = str(err)
            self._errors["not_supported"] += 1
            log.info("gpu %d (%s) does not support %s: %s", dev.index, dev.uuid, metric, err)

    def _passing(self, err: Exception, dev: _Device, metric: str) -> None:
        """An error of an optional reading: raised again where it says the GPU or NVML
        is gone (`GONE`: the GPU is down), else counted by its kind, noted as the
        device's failing `metric` this cycle, and let pass."""
        if error_kind(err) in GONE:
            raise err
        self._errors[error_kind(err)] += 1
        self._transient += 1
        dev.failing.append(metric)

    def _save_roster(self) -> None:
        if self._roster is not None:
            self._roster.save([KnownGpu(d.uuid, d.index, d.pci_bus_id, d.name)
                               for d in self._devices.values()])

    def _lacks(self, dev: _Device, metric: str) -> bool:
        return (dev.uuid, metric) in self._unsupported

    def _optional(self, dev: _Device, metric: str, fn: str | tuple[str, ...], *args: Any,
                  strict: bool = False) -> Any:
        """Call NVML for one metric; None (recorded once) if the device lacks it. `fn`
        may name older entry points after the first, tried where the driver lacks the
        newer one. An error that is not the GPU's or NVML's end (`GONE`) is counted
        and gives None for this cycle, unless `strict` (the liveness probe)."""
        if (dev.uuid, metric) in self._unsupported:
            return None
        n = self._nvml
        names = [f for f in ((fn,) if isinstance(fn, str) else fn)
                 if f not in self._absent and hasattr(n, f)]
        err: Exception = n.NVMLError(n.NVML_ERROR_FUNCTION_NOT_FOUND)
        for name in names:
            try:
                return self._call(name, *args)
            except (n.NVMLError_FunctionNotFound, _mismatch_error(n)) as lacking:
                # pynvml's unversioned process calls raise NVMLLibraryMismatchError, not
                # an NVMLError, where an older driver lacks their _v3 symbol
                self._absent.add(name)
                err = lacking
            except (n.NVMLError_NotSupported, n.NVMLError_NoPermission) as unsupported:
                err = unsupported
                break
            except n.NVMLError as other:
                if strict:
                    raise
                self._passing(other, dev, metric)
                return None
        self._mark_unsupported(dev, metric, err)
        return None

    # -- the collection cycle ----------------------------------------------------
    def collect(self) -> list[GpuSample]:
        n = self._nvml
        if ((self._need_reinit or self._any_missing())
                and self._clock() - self._last_reinit >= self._reinit_interval):
            self._reinit()
        if self._reinit_failing:  # shut down, not started again: every handle is void
            raise CollectionFailed("NVML does not start again after a re-initialisation; "
                                   "the last GPU readings stand (retrying)")
        # Also while a lost GPU waits for the re-initialisation: one GPU is gone, not
        # NVML, and the others' XIDs (and the lost one's 79) are in the event set now
        # (a review: an XID 48 of a healthy GPU in that window was never counted)
        if self._xid_unregistered and not self._need_reinit:
            self._register_xid_events()
        try:
            self._drain_xid_events()
        except n.NVMLError as err:  # pragma: no cover - defensive: driver misbehaving
            self._errors[error_kind(err)] += 1
        samples = []
        for uuid in self._order:
            dev = self._devices[uuid]
            dev.failing = []  # the static probe's, too: it is read again while they fail
            if self._xid_unregistered and uuid in self._xid_unregistered:
                # its XIDs are not counted until it is registered: said every cycle
                # (GpuReadingsFailing), not only in a node-wide error count
                dev.failing.append("xid_errors")
            if dev.missing:
                samples.append(self._down(dev, dev.reason))
                continue
            try:
                if not dev.probed:  # a static fact a passing error left unread
                    self._probe_static(dev)
                    if dev.probed:
                        self._save_roster()
                    if dev.missing:
                        samples.append(self._down(dev, dev.reason))
                        continue
                samples.append(self._read(dev))
            except n.NVMLError as err:
                kind = error_kind(err)
                self._errors[kind] += 1
                if kind in GONE:
                    if not dev.lost:  # the counter alone never said which GPU
                        log.warning("gpu %d (%s, %s) is gone (%s): re-initialising NVML "
                                    "within %.0f s", dev.index, dev.uuid, dev.pci_bus_id,
                                    kind, max(0.0, self._reinit_interval
                                              - (self._clock() - self._last_reinit)))
                    self._need_reinit = dev.lost = True
                samples.append(self._down(dev, kind))
        labels = {d.index for d in self._devices.values()}
        for index, kind in sorted(self._unlisted.items()):
            if index not in labels:  # else a known GPU exports that label already
                samples.append(GpuSample(index=index, uuid="", up=False,
                                         driver_version=self._driver_version,
                                         down_reason=kind))
        if not self._need_reinit and not self._any_missing():
            self._reinit_interval = self.REINIT_INTERVAL_S  # all back: the next loss waits 30 s
        return samples

    def _any_missing(self) -> bool:
        """A known GPU the last enumeration did not find: only a re-init can see it back
        (NVML enumerates once, at init), or an index NVML listed without answering."""
        return bool(self._unlisted) or any(d.missing for d in self._devices.values())

    def _reinit(self) -> None:
        n = self._nvml
        self._last_reinit = self._clock()
        self._reinit_interval = min(2 * self._reinit_interval, self.REINIT_MAX_INTERVAL_S)
        log.warning("re-initialising NVML: a GPU was lost or is missing")
        try:
            if self._event_set is not None:  # _init makes a new one: do not leak the old
                # what the set holds goes with it: XIDs queued since the last cycle
                with contextlib.suppress(n.NVMLError):
                    self._drain_xid_events()
                with contextlib.suppress(n.NVMLError):
                    self._call("nvmlEventSetFree", self._event_set)
                self._event_set = None
            self._xid_unregistered = None  # every GPU, into the new set
            with contextlib.suppress(n.NVMLError):
                self._call("nvmlShutdown")
            self._init()
            self._need_reinit = self._reinit_failing = False
        except n.NVMLError as err:
            self._errors[f"reinit_{error_kind(err)}"] += 1
            # NVML is down now for every GPU, not only the missing one: the first
            # failure is tried again soon, not a minute later; then backing off again
            self._need_reinit = True
            if not self._reinit_failing:
                self._reinit_failing = True
                self._reinit_interval = self.REINIT_RETRY_S

    def _down(self, dev: _Device, reason: str) -> GpuSample:
        return GpuSample(
            index=dev.index, uuid=dev.uuid, up=False, name=dev.name, pci_bus_id=dev.pci_bus_id,
            driver_version=self._driver_version, down_reason=reason,
            xid_errors_total=self._xid_totals(dev),
        )

    def _read(self, dev: _Device) -> GpuSample:
        n, h = self._nvml, dev.handle
        # The liveness probe: utilization, or where the GPU does not support it (a
        # MIG-enabled one answers NOT_SUPPORTED, and was exported down for good) memory,
        # then temperature. The GPU is down when a reading says it is gone (GONE), when
        # the probe fails two cycles in a row (a hung GPU times out every cycle while
        # the driver may still serve its memory figures), or when the reading after it
        # fails too. One UNKNOWN or TIMEOUT alone made it down for a cycle, and GpuDown
        # (critical, no `for:`) paged (a review); on a MIG GPU, one from memory still did.
        util, mem, temp = self._probe(dev, (
            ("utilization", "nvmlDeviceGetUtilizationRates", (h,)),
            ("memory", "nvmlDeviceGetMemoryInfo", (h,)),
            ("temperature_celsius", "nvmlDeviceGetTemperature", (h, n.NVML_TEMPERATURE_GPU))))
        s = GpuSample(
            index=dev.index, uuid=dev.uuid, up=True, name=dev.name, pci_bus_id=dev.pci_bus_id,
            driver_version=self._driver_version,
            utilization_ratio=None if util is None else util.gpu / 100.0,
            sm_clock_max_hertz=dev.sm_clock_max_hertz, xid_errors_total=self._xid_totals(dev),
        )
        if mem is not None:
            s.memory_used_bytes, s.memory_total_bytes = float(mem.used), float(mem.total)
        s.temperature_celsius = None if temp is None else float(temp)
        mw = self._optional(dev, "power_watts", "nvmlDeviceGetPowerUsage", h)
        s.power_watts = None if mw is None else mw / 1000.0
        mw = self._optional(dev, "power_limit_watts", "nvmlDeviceGetEnforcedPowerLimit", h)
        s.power_limit_watts = None if mw is None else mw / 1000.0
        mhz = self._optional(dev, "sm_clock_hertz", "nvmlDeviceGetClockInfo", h, n.NVML_CLOCK_SM)
        s.sm_clock_hertz = None if mhz is None else mhz * 1e6
        # the older name where the driver lacks the newer one (pynvml >= 12.535 has both)
        mask = self._optional(dev, "clock_events", ("nvmlDeviceGetCurrentClocksEventReasons",
                                                    "nvmlDeviceGetCurrentClocksThrottleReasons"), h)
        s.clock_events = None if mask is None else decode_clock_events(int(mask))
        self._read_fields(dev, s)
        self._read_links(dev, s)
        s.processes = self._read_processes(dev)
        s.failing = tuple(dict.fromkeys(dev.failing))
        dev.failed_cycles += bool(s.failing)
        s.failed_reading_cycles_total = float(dev.failed_cycles)
        return s

    def _probe(self, dev: _Device, readings: tuple[tuple[str, str, tuple], ...]) -> list[Any]:
        """The liveness probe's readings, (metric, NVML function, arguments) in order:
        the first the GPU supports is the probe, and each after it is strict until one
        answers. NVMLError (the GPU is down) when a reading says the GPU is gone, or a
        strict one fails after a failure (earlier this cycle, or the probe's last
        cycle); a first failure is a passing error, as for any optional reading."""
        values: list[Any] = []
        failed = False  # a reading of the probe failed this cycle
        for metric, fn, args in readings:
            strict = all(v is None for v in values)
            try:
                values.append(self._optional(dev, metric, fn, *args, strict=strict))
            except self._nvml.NVMLError as err:
                if error_kind(err) in GONE or dev.probe_failed:
                    raise
                dev.probe_failed = failed = True
                self._passing(err, dev, metric)
                values.append(None)
        if not failed:
            dev.probe_failed = False
        return values

    def _read_processes(self, dev: _Device) -> tuple[int, ...]:
        """Every process with a context on the GPU, from the driver: the ranks that
        report telemetry and the ones that never will (a notebook, a stray job)."""
        pids: set[int] = set()
        for metric, fn in (("processes", "nvmlDeviceGetComputeRunningProcesses"),
                           ("graphics_processes", "nvmlDeviceGetGraphicsRunningProcesses")):
            # ..._v2: the drivers before R510 have no _v3, which the unversioned calls use
            for p in self._optional(dev, metric, (fn, f"{fn}_v2"), dev.handle) or ():
                pids.add(int(p.pid))
        return tuple(sorted(pids))

    def _read_links(self, dev: _Device, s: GpuSample) -> None:
        n, h = self._nvml, dev.handle
        gen = self._optional(dev, "pcie_link_generation", "nvmlDeviceGetCurrPcieLinkGeneration", h)
        width = self._optional(dev, "pcie_link_width", "nvmlDeviceGetCurrPcieLinkWidth", h)
        s.pcie_link_generation = None if gen is None else float(gen)
        s.pcie_link_width = None if width is None else float(width)
        s.pcie_link_generation_max, s.pcie_link_width_max = dev.pcie_gen_max, dev.pcie_width_max
        for link in range(dev.nvlinks):
            try:
                state = self._call("nvmlDeviceGetNvLinkState", h, link)
            except (n.NVMLError_NotSupported, n.NVMLError_NoPermission):
                continue  # not readable now: no failure, and no state to export
            except n.NVMLError as err:
                self._passing(err, dev, "nvlink_up")
                continue
            sample = NvLinkSample(up=int(state) == int(getattr(n, "NVML_FEATURE_ENABLED", 1)))
            for kind, const in NVLINK_ERRORS.items():  # each kind supported or not alone
                v = self._optional(dev, f"nvlink_{kind}_errors",
                                   "nvmlDeviceGetNvLinkErrorCounter", h, link, getattr(n, const))
                if v is not None:
                    sample.errors[kind] = float(v)
            s.nvlinks[link] = sample

    def _read_fields(self, dev: _Device, s: GpuSample) -> None:
        wanted = [
            (attr, spec) for attr, spec in FIELDS.items()
            if (dev.uuid, attr) not in self._unsupported and hasattr(self._nvml, spec[0])
        ]
        for attr, (fid_name, _, _) in FIELDS.items():
            if not hasattr(self._nvml, fid_name):
                self._mark_unsupported(dev, attr, "field unknown to this nvidia-ml-py")
        if not wanted:
            return
        ids = [(getattr(self._nvml, fid), scope) for _, (fid, scope, _) in wanted]
        n = self._nvml
        try:
            values = self._call("nvmlDeviceGetFieldValues", dev.handle, ids)
        except (n.NVMLError_NotSupported, n.NVMLError_NoPermission,
                n.NVMLError_FunctionNotFound) as err:
            for attr, _ in wanted:  # the call itself is not there: none of them is
                self._mark_unsupported(dev, attr, err)
            return
        except n.NVMLError as err:
            self._passing(err, dev, "field_values")
            return
        for (attr, (_, _, scale)), fv in zip(wanted, values, strict=True):
            ret = int(fv.nvmlReturn)
            if ret == NVML_SUCCESS:
                setattr(s, attr, _field_number(fv) * scale)
                continue
            err = n.NVMLError(ret)
            if error_kind(err) in GONE:  # GPU_IS_LOST, UNINITIALIZED...: the GPU is down
                raise err
            if ret in (NVML_ERROR_NOT_SUPPORTED, NVML_ERROR_INVALID_ARGUMENT) \
                    or error_kind(err) in NOT_OURS:
                # INVALID_ARGUMENT: a field id this driver does not know; asked for
                # again, it was counted as an error every cycle
                self._mark_unsupported(dev, attr, "Not Supported" if ret == NVML_ERROR_NOT_SUPPORTED
                                       else "Invalid Argument (a field unknown to this driver)"
                                       if ret == NVML_ERROR_INVALID_ARGUMENT else str(err))
            else:
                self._errors[f"field_{ret}"] += 1
                dev.failing.append(attr)

    def unsupported(self) -> dict[tuple[int, str], str]:
        """By the GPU's exported label, as the Backend protocol says; kept by UUID."""
        return {(self._devices[uuid].index, metric): reason
                for (uuid, metric), reason in list(self._unsupported.items())}

    def errors(self) -> dict[str, int]:
        return dict(self._errors)

    def close(self) -> None:
        try:
            if self._event_set is not None:
                self._call("nvmlEventSetFree", self._event_set)
            self._call("nvmlShutdown")
        except self._nvml.NVMLError:
            pass


def _mismatch_error(nvml: Any) -> type[Exception] | tuple[()]:
    """pynvml's NVMLLibraryMismatchError (a plain Exception), or nothing to catch in a
    pynvml without it."""
    return getattr(nvml, "NVMLLibraryMismatchError", ())


def _same_handle(a: Any, b: Any) -> bool:
    """Two device handles: pynvml's are ctypes pointers, equal by the address they hold."""
    try:
        return ctypes.cast(a, ctypes.c_void_p).value == ctypes.cast(b, ctypes.c_void_p).value
    except (TypeError, ctypes.ArgumentError):
        return a is b or a == b


def _text(value: Any) -> str:
    return value.decode() if isinstance(value, bytes) else str(value)
