"""The NVML backend through the real pynvml's wrappers, on drivers and GPUs that answer
otherwise than the newest (tests/fakes/fake_libnvml.py: only the C library is faked).
Each case was a GPU or a whole node lost on such a driver or GPU."""

from __future__ import annotations

import pynvml
import pytest

from clusterpulse.agent.backends.nvml import NvmlBackend
from tests.fakes.fake_libnvml import FakeLib, installed
from tests.support.clock import ManualClock


def test_a_driver_without_the_v3_process_calls_still_reports_every_gpu_and_its_processes():
    """R470-class drivers lack ..._v3; pynvml's unversioned call then raises
    NVMLLibraryMismatchError, not an NVMLError: every collection failed, no GPU exported."""
    lib = FakeLib(2, missing={"nvmlDeviceGetComputeRunningProcesses_v3",
                              "nvmlDeviceGetGraphicsRunningProcesses_v3"})
    lib.gpus[1].compute = [4242]
    with installed(lib) as nvml:
        backend = NvmlBackend(nvml=nvml)
        for _ in range(2):
            samples = backend.collect()
            assert [(s.up, s.processes) for s in samples] == [(True, ()), (True, (4242,))]
    # per cycle: GPU 0 once, GPU 1 twice (pynvml asks for the count, then the list)
    assert lib.calls["nvmlDeviceGetComputeRunningProcesses_v2"] == 6
    assert backend.unsupported() == {}


def test_a_driver_without_clocks_event_reasons_reads_the_throttle_reasons():
    lib = FakeLib(1, missing={"nvmlDeviceGetCurrentClocksEventReasons"})
    with installed(lib) as nvml:
        backend = NvmlBackend(nvml=nvml)
        assert backend.collect()[0].clock_events == {"hw_thermal_slowdown"}
        assert backend.collect()[0].clock_events == {"hw_thermal_slowdown"}
    assert lib.calls["nvmlDeviceGetCurrentClocksThrottleReasons"] == 2
    assert backend.unsupported() == {}


def test_a_mig_enabled_gpu_without_utilization_is_up_and_its_liveness_still_counts():
    """NVML answers utilization NOT_SUPPORTED on a MIG-enabled GPU: it was exported down
    ("not_supported") every cycle. The probe moves to memory, which still says lost."""
    lib = FakeLib(2)
    lib.gpus[1].fail["nvmlDeviceGetUtilizationRates"] = pynvml.NVML_ERROR_NOT_SUPPORTED
    with installed(lib) as nvml:
        backend = NvmlBackend(nvml=nvml)
        for _ in range(2):
            mig = backend.collect()[1]
            assert mig.up and mig.utilization_ratio is None
            assert mig.memory_used_bytes == 2**30
        assert backend.unsupported() == {(1, "utilization"): "Not Supported"}
        # memory is its probe now, with utilization's tolerance: one passing error is
        # a failing reading (it was down at once, and GpuDown paged), twice is down
        lib.gpus[1].fail["nvmlDeviceGetMemoryInfo"] = pynvml.NVML_ERROR_UNKNOWN
        mig = backend.collect()[1]
        assert mig.up and mig.memory_used_bytes is None and mig.failing == ("memory",)
        mig = backend.collect()[1]
        assert not mig.up and mig.down_reason == "unknown"
        del lib.gpus[1].fail["nvmlDeviceGetMemoryInfo"]
        assert backend.collect()[1].up
        lib.gpus[1].fail["nvmlDeviceGetMemoryInfo"] = pynvml.NVML_ERROR_GPU_IS_LOST
        mig = backend.collect()[1]  # gone is down at once
        assert not mig.up and mig.down_reason == "gpu_is_lost"


@pytest.mark.parametrize("code", [pynvml.NVML_ERROR_GPU_IS_LOST, pynvml.NVML_ERROR_UNKNOWN])
def test_a_gpu_failing_while_its_static_facts_are_read_does_not_stop_the_agent(code):
    """It answered its handle and UUID, then a static read failed: NvmlBackend() raised
    ("NVML could not start"), and no GPU of the node was monitored."""
    lib, clock = FakeLib(2), ManualClock()
    lib.gpus[1].fail["nvmlDeviceGetMaxClockInfo"] = code
    with installed(lib) as nvml:
        backend = NvmlBackend(nvml=nvml, clock=clock)
        first = backend.collect()
        assert first[0].up
        if code == pynvml.NVML_ERROR_GPU_IS_LOST:  # down, under its label, and re-probed
            assert (first[1].index, first[1].up, first[1].down_reason) == (1, False, "gpu_is_lost")
            del lib.gpus[1].fail["nvmlDeviceGetMaxClockInfo"]
            clock.t += 31
            back = backend.collect()[1]
            assert back.up and back.sm_clock_max_hertz == 1410e6
        else:  # a one-off error: the GPU is up without that fact
            assert first[1].up and first[1].sm_clock_max_hertz is None


def test_a_gpu_lost_at_its_first_probe_after_a_restart_leaves_the_others_collected():
    """A GPU back after a loss, with a new UUID (in the lost one's PCI slot: its
    replacement), lost again while it was probed: every later collection raised
    CollectionFailed and the healthy GPUs' readings froze."""
    lib, clock = FakeLib(3), ManualClock()
    with installed(lib) as nvml:
        backend = NvmlBackend(nvml=nvml, clock=clock)
        backend.collect()
        lib.gpus[1].lost = True
        assert not backend.collect()[1].up
        lib.gpus[1].lost = False
        lib.gpus[1].uuid = "GPU-lib-1-replacement"
        lib.gpus[1].fail["nvmlDeviceGetMaxClockInfo"] = pynvml.NVML_ERROR_GPU_IS_LOST
        for _ in range(3):
            clock.t += 61
            by_label = {s.index: s for s in backend.collect()}
            assert by_label[0].up and by_label[2].up
            assert not by_label[1].up and by_label[1].down_reason == "gpu_is_lost"


def test_an_xid_of_a_gpu_that_fell_off_the_bus_is_counted():
    """XID 79: the GPU no longer answers its UUID, so the event was dropped."""
    lib = FakeLib(2)
    with installed(lib) as nvml:
        backend = NvmlBackend(nvml=nvml)
        backend.collect()
        lib.events = [(0, 13), (1, 79)]
        lib.gpus[1].lost = True
        healthy, lost = backend.collect()
    assert healthy.xid_errors_total == {13: 1}
    assert not lost.up and lost.xid_errors_total == {79: 1}


def test_a_gpu_listed_but_not_enumerable_at_start_is_exported_down_and_reprobed():
    """NVML counted it but its handle failed: without --remember-gpus it had no series
    at all, and was never looked at again."""
    lib, clock = FakeLib(2), ManualClock()
    lib.handle_ret[1] = pynvml.NVML_ERROR_GPU_IS_LOST
    with installed(lib) as nvml:
        backend = NvmlBackend(nvml=nvml, clock=clock)
        first = backend.collect()
        assert [(s.index, s.up, s.down_reason) for s in first] == [
            (0, True, ""), (1, False, "gpu_is_lost")]
        del lib.handle_ret[1]
        clock.t += 31
        back = backend.collect()
    assert [(s.index, s.uuid, s.up) for s in back] == [(0, "GPU-lib-0", True),
                                                       (1, "GPU-lib-1", True)]


def test_a_gpu_listed_but_not_enumerable_that_leaves_the_list_stays_down_and_reprobed():
    """Without a UUID it is known by its label only: when the driver stopped listing
    it (fallen off the bus) its series ended, no re-probe was due, and it was never
    monitored again, not even once it was back after a reset."""
    lib, clock = FakeLib(2), ManualClock()
    lib.handle_ret[1] = pynvml.NVML_ERROR_GPU_IS_LOST
    with installed(lib) as nvml:
        backend = NvmlBackend(nvml=nvml, clock=clock)
        assert [(s.index, s.up) for s in backend.collect()] == [(0, True), (1, False)]
        gpu = lib.gpus.pop()  # NVML no longer lists it
        for _ in range(2):
            clock.t += 61
            gone = backend.collect()
            assert [(s.index, s.up, s.down_reason) for s in gone] == [
                (0, True, ""), (1, False, "missing")]
        lib.gpus.append(gpu)  # back after a reset, and answering
        del lib.handle_ret[1]
        clock.t += 61
        back = backend.collect()
    assert [(s.index, s.uuid, s.up) for s in back] == [(0, "GPU-lib-0", True),
                                                       (1, "GPU-lib-1", True)]


def test_a_one_off_error_of_an_optional_metric_loses_that_metric_not_the_gpu():
    """NVML_ERROR_UNKNOWN once from the power reading, or a process list that grew
    between pynvml's two calls, marked the whole GPU down (GpuDown) for the cycle."""
    lib = FakeLib(2)
    with installed(lib) as nvml:
        backend = NvmlBackend(nvml=nvml)
        backend.collect()
        lib.gpus[1].fail_once["nvmlDeviceGetPowerUsage"] = [pynvml.NVML_ERROR_UNKNOWN]
        # pynvml's second call (the list) finds more processes than its first counted
        lib.gpus[0].compute = [100]
        lib.gpus[0].fail_once["nvmlDeviceGetComputeRunningProcesses_v3"] = [
            0, pynvml.NVML_ERROR_INSUFFICIENT_SIZE]
        a, b = backend.collect()
        assert a.up and b.up and b.power_watts is None and a.power_watts == 250.0
        assert a.processes == ()
        assert backend.errors() == {"unknown": 1, "insufficient_size": 1}
        a, b = backend.collect()  # and both are asked for again
        assert b.power_watts == 250.0 and a.processes == (100,)
    assert backend.unsupported() == {}


def test_a_field_unknown_to_the_driver_is_recorded_once_and_not_counted_every_cycle():
    lib = FakeLib(1)
    lib.gpus[0].field_ret[pynvml.NVML_FI_DEV_PCIE_COUNT_TX_BYTES] = \
        pynvml.NVML_ERROR_INVALID_ARGUMENT
    with installed(lib) as nvml:
        backend = NvmlBackend(nvml=nvml)
        for _ in range(3):
            backend.collect()
    assert list(backend.unsupported()) == [(0, "pcie_tx_bytes_total")]
    assert backend.errors() == {"not_supported": 1}


def test_one_nvlink_error_counter_unsupported_leaves_the_others():
    lib = FakeLib(1)
    real = FakeLib.c_nvmlDeviceGetNvLinkErrorCounter

    def no_recovery(self, h, link, counter, out):
        if counter == pynvml.NVML_NVLINK_ERROR_DL_RECOVERY:
            return pynvml.NVML_ERROR_NOT_SUPPORTED
        return real(self, h, link, counter, out)

    lib.c_nvmlDeviceGetNvLinkErrorCounter = no_recovery  # looked up on the type
    FakeLib.c_nvmlDeviceGetNvLinkErrorCounter = no_recovery
    try:
        with installed(lib) as nvml:
            backend = NvmlBackend(nvml=nvml)
            links = backend.collect()[0].nvlinks
    finally:
        FakeLib.c_nvmlDeviceGetNvLinkErrorCounter = real
    assert {k: v.errors for k, v in links.items()} == {
        i: {"replay": 2.0, "crc": 2.0} for i in range(4)}
    assert list(backend.unsupported()) == [(0, "nvlink_recovery_errors")]


def test_gpus_outside_the_agents_device_cgroup_are_not_its_own():
    """A Slurm job step's agent under ConstrainDevices: NVML counts every GPU and answers
    NO_PERMISSION for the others' handles. They are another job's, not down (a review:
    exported down, they paged GpuDown, and NVML was re-initialised every minute)."""
    lib, clock = FakeLib(4), ManualClock()
    for i in (2, 3):
        lib.handle_ret[i] = pynvml.NVML_ERROR_NO_PERMISSION
    with installed(lib) as nvml:
        backend = NvmlBackend(nvml=nvml, clock=clock)
        for _ in range(5):
            clock.t += 60
            samples = backend.collect()
    assert [(s.index, s.up) for s in samples] == [(0, True), (1, True)]
    assert lib.calls["nvmlInitWithFlags"] == 1


@pytest.mark.parametrize("symbol", ["nvmlDeviceGetFieldValues", "nvmlDeviceGetNvLinkState"])
def test_a_one_off_error_of_the_batched_fields_or_a_link_state_keeps_the_gpu_up(symbol):
    lib = FakeLib(1)
    with installed(lib) as nvml:
        backend = NvmlBackend(nvml=nvml)
        lib.gpus[0].fail_once[symbol] = [pynvml.NVML_ERROR_UNKNOWN]
        once = backend.collect()[0]
        again = backend.collect()[0]
    assert once.up and again.up and backend.errors() == {"unknown": 1}
    assert again.ecc_corrected_total == 7 and len(again.nvlinks) == 4


def test_static_facts_a_passing_error_left_unread_are_read_again_and_remembered(tmp_path):
    """Its PCI slot unread for good: gpus.json kept "" and a card swapped into that slot
    later was not known as its replacement."""
    lib = FakeLib(2)
    lib.gpus[1].fail_once["nvmlDeviceGetPciInfo_v3"] = [pynvml.NVML_ERROR_UNKNOWN] * 2
    with installed(lib) as nvml:  # at the start, and again at the first collection
        backend = NvmlBackend(nvml=nvml, gpu_state=tmp_path / "gpus.json")
        first = backend.collect()[1]
        assert first.up and first.pci_bus_id == ""
        again = backend.collect()[1]
    assert again.up and again.pci_bus_id == "00000000:08:00.0"
    assert '"00000000:08:00.0"' in (tmp_path / "gpus.json").read_text()


def test_a_replacement_lost_before_its_slot_was_read_takes_the_old_label_once_probed():
    lib, clock = FakeLib(3), ManualClock()
    with installed(lib) as nvml:
        backend = NvmlBackend(nvml=nvml, clock=clock)
        backend.collect()
        lib.gpus[1].lost = True
        backend.collect()
        lib.gpus[1].lost = False
        lib.gpus[1].uuid = "GPU-lib-1-replacement"
        lib.gpus[1].fail_once["nvmlDeviceGetName"] = [pynvml.NVML_ERROR_GPU_IS_LOST]
        for _ in range(3):
            clock.t += 61
            samples = backend.collect()
    assert sorted((s.index, s.uuid, s.up) for s in samples) == [
        (0, "GPU-lib-0", True), (1, "GPU-lib-1-replacement", True), (2, "GPU-lib-2", True)]


def test_what_a_gpu_did_not_support_is_asked_again_after_it_was_lost_and_back():
    """MIG turned off takes a reset: utilization, unsupported under MIG, was never read
    again, nor a reading refused for permission."""
    lib, clock = FakeLib(1), ManualClock()
    lib.gpus[0].fail["nvmlDeviceGetUtilizationRates"] = pynvml.NVML_ERROR_NOT_SUPPORTED
    with installed(lib) as nvml:
        backend = NvmlBackend(nvml=nvml, clock=clock)
        assert backend.collect()[0].utilization_ratio is None
        lib.gpus[0].lost = True
        assert not backend.collect()[0].up
        lib.gpus[0].lost = False
        del lib.gpus[0].fail["nvmlDeviceGetUtilizationRates"]
        clock.t += 31
        back = backend.collect()[0]
    assert back.up and back.utilization_ratio == 0.77 and backend.unsupported() == {}


def test_a_gpu_lost_at_its_probe_then_gone_from_the_list_is_missing():
    lib, clock = FakeLib(2), ManualClock()
    lib.gpus[1].fail["nvmlDeviceGetMaxClockInfo"] = pynvml.NVML_ERROR_GPU_IS_LOST
    with installed(lib) as nvml:
        backend = NvmlBackend(nvml=nvml, clock=clock)
        assert backend.collect()[1].down_reason == "gpu_is_lost"
        lib.gpus.pop()  # NVML no longer lists it
        clock.t += 31
        gone = backend.collect()[1]
    assert not gone.up and gone.down_reason == "missing"
