"""The NVML backend against a fake at the pynvml API level."""

import contextlib
import json
import subprocess
import sys
from pathlib import Path

import pynvml
import pytest

from clusterpulse.agent.backends import BackendError, CollectionFailed
from clusterpulse.agent.backends.nvml import FIELDS, NvmlBackend, error_kind
from tests.fakes.fake_pynvml import FakeNvml
from tests.support.clock import ManualClock

REPO = Path(__file__).resolve().parents[2]


def test_reads_core_set_in_base_units():
    fake = FakeNvml(gpus=2)
    fake.gpus[1].reasons = (pynvml.nvmlClocksEventReasonHwThermalSlowdown
                            | pynvml.nvmlClocksEventReasonSwPowerCap)
    s = NvmlBackend(nvml=fake).collect()
    assert [g.index for g in s] == [0, 1] and all(g.up for g in s)
    g = s[0]
    assert g.uuid == "GPU-fake-0" and g.driver_version == "550.54.15"
    assert g.utilization_ratio == 0.5
    assert g.memory_used_bytes == 10 * 2**30 and g.memory_total_bytes == 80 * 2**30
    assert g.power_watts == 350.0 and g.power_limit_watts == 700.0
    assert g.sm_clock_hertz == 1980e6 and g.sm_clock_max_hertz == 1980e6
    assert g.energy_joules_total == 5000.0  # from mJ
    assert g.nvlink_tx_bytes_total == 1000 * 1024  # from KiB
    assert g.pcie_rx_bytes_total == 8192
    assert g.memory_temperature_celsius == 70
    assert g.ecc_corrected_total == 3 and g.remapped_rows_correctable_total == 1
    assert s[0].clock_events == frozenset()
    assert s[1].clock_events == {"hw_thermal_slowdown", "sw_power_cap"}


def test_fields_are_batched_in_one_call_per_gpu():
    fake = FakeNvml(gpus=4)
    backend = NvmlBackend(nvml=fake)
    fake.calls.clear()
    backend.collect()
    assert fake.calls["nvmlDeviceGetFieldValues"] == 4
    assert fake.calls["fields_requested"] == 4 * len(FIELDS)


def test_gpu_lost_mid_run_marks_only_that_gpu_down_and_reinitialises():
    fake, clock = FakeNvml(gpus=3), ManualClock()
    backend = NvmlBackend(nvml=fake, clock=clock)
    assert all(g.up for g in backend.collect())
    fake.gpus[1].lost = True
    s = backend.collect()
    assert [g.up for g in s] == [True, False, True]
    assert s[1].down_reason == "gpu_is_lost"
    assert backend.errors()["gpu_is_lost"] == 1
    # Until the re-init interval passes, no re-init storm; the other GPUs keep reporting.
    inits = fake.calls["nvmlInit"]
    s = backend.collect()
    assert fake.calls["nvmlInit"] == inits and s[0].up and s[2].up
    clock.t += NvmlBackend.REINIT_INTERVAL_S
    s = backend.collect()
    assert fake.calls["nvmlInit"] == inits + 1
    # After re-enumeration the lost GPU is gone from the driver: reported missing, by uuid.
    assert [(g.uuid, g.up) for g in s] == [
        ("GPU-fake-0", True), ("GPU-fake-1", False), ("GPU-fake-2", True)]
    assert s[1].down_reason == "missing"


def _labels(samples) -> dict[str, int]:
    """uuid -> exported gpu label, checking that no label is exported twice."""
    labels = [g.index for g in samples]
    assert len(labels) == len(set(labels)), [(g.uuid, g.index) for g in samples]
    return {g.uuid: g.index for g in samples}


def test_a_gpu_off_the_bus_keeps_its_label_and_is_reprobed_until_it_returns():
    """Review finding: after the re-init, the driver enumerates one GPU fewer; the next
    GPU took the lost one's index while the lost one kept it (two gpu="1", no gpu="3"),
    the unsupported-metric memory applied to the wrong device, XIDs landed on the wrong
    one, and a GPU back after a reset stayed `missing` until the agent restarted."""
    fake, clock = FakeNvml(gpus=4), ManualClock()
    fake.gpus[2].unsupported_fns.add("nvmlDeviceGetPowerUsage")
    backend = NvmlBackend(nvml=fake, clock=clock)
    first = _labels(backend.collect())
    assert first == {f"GPU-fake-{i}": i for i in range(4)}
    fake.gpus[1].lost = True  # off the bus: the next enumeration has three GPUs
    for _ in range(int(NvmlBackend.REINIT_INTERVAL_S) + 1):
        s = backend.collect()
        assert _labels(s) == first
        clock.t += 1
    assert fake.calls["nvmlInit"] == 2  # re-initialised once
    assert [(g.uuid, g.up, g.down_reason) for g in s] == [
        ("GPU-fake-0", True, ""), ("GPU-fake-1", False, "missing"),
        ("GPU-fake-2", True, ""), ("GPU-fake-3", True, "")]
    assert s[2].power_watts is None and s[3].power_watts == 350.0  # follows the device
    assert set(backend.unsupported()) == {(2, "power_watts")}
    fake.events.append((3, 79))  # an XID on GPU-fake-3, now NVML's index 2
    assert _labels(s := backend.collect()) == first and s[3].xid_errors_total == {79: 1}
    # while it is missing it is re-probed, but not every collection
    inits = fake.calls["nvmlInit"]
    for _ in range(300):
        assert _labels(backend.collect()) == first
        clock.t += 1
    assert 2 <= fake.calls["nvmlInit"] - inits <= 300 / NvmlBackend.REINIT_INTERVAL_S
    fake.gpus[1].lost = False  # back after a reset
    for _ in range(int(NvmlBackend.REINIT_MAX_INTERVAL_S) + 2):  # one re-probe interval
        s = backend.collect()
        assert _labels(s) == first
        if s[1].up:
            break
        clock.t += 1
    assert all(g.up for g in s), [(g.uuid, g.down_reason) for g in s]
    assert s[2].power_watts is None and s[3].power_watts == 350.0


def test_a_reprobe_that_fails_is_retried_soon_and_keeps_the_queued_xids():
    """Re-probing a missing GPU re-initialises NVML for every GPU: one whose nvmlInit
    failed reported the healthy GPUs down (uninitialized; GpuDown pages at once) for the
    next whole minute, and the XIDs queued since the last cycle went with the freed
    event set. Now the collection fails as a whole (the agent keeps the last readings,
    whose age grows) and is retried within seconds."""
    fake, clock = FakeNvml(gpus=3), ManualClock()
    backend = NvmlBackend(nvml=fake, clock=clock)
    fake.gpus[1].lost = True
    while backend.collect()[1].down_reason != "missing":
        clock.t += 1
    # an XID queued just before the next re-probe is counted, not lost
    clock.t += NvmlBackend.REINIT_MAX_INTERVAL_S
    fake.events.append((2, 48))
    fake.init_error = pynvml.NVMLError_DriverNotLoaded
    for _ in range(3):  # the re-probe fails: nothing read would be true
        with pytest.raises(CollectionFailed):
            backend.collect()
        clock.t += 1
    fake.init_error = None
    for _ in range(int(NvmlBackend.REINIT_RETRY_S) + 1):
        clock.t += 1
        with contextlib.suppress(CollectionFailed):
            s = backend.collect()
    assert [g.up for g in s] == [True, False, True]  # within seconds, not a minute
    assert s[2].xid_errors_total == {48: 1}
    # NVML gone for good: the retries back off to once a minute again
    fake.init_error = pynvml.NVMLError_DriverNotLoaded
    inits = fake.calls["nvmlInit"]
    for _ in range(600):
        clock.t += 1
        with contextlib.suppress(CollectionFailed):
            backend.collect()
    assert fake.calls["nvmlInit"] - inits <= 600 / NvmlBackend.REINIT_MAX_INTERVAL_S + 4


def test_a_gpu_new_to_the_agent_never_takes_a_known_gpus_label():
    """A GPU already off the bus when the agent started is unknown to it; if it is
    enumerated at a re-init, NVML's index for it belongs to another GPU's series."""
    fake, clock = FakeNvml(gpus=4), ManualClock()
    fake.gpus[1].lost = True
    backend = NvmlBackend(nvml=fake, clock=clock)
    first = _labels(backend.collect())
    assert first == {"GPU-fake-0": 0, "GPU-fake-2": 1, "GPU-fake-3": 2}
    fake.gpus[1].lost, fake.gpus[3].lost = False, True  # back, and another one lost
    backend.collect()
    clock.t += NvmlBackend.REINIT_INTERVAL_S
    s = backend.collect()
    labels = _labels(s)
    assert {u: labels[u] for u in first} == first
    assert labels["GPU-fake-1"] == 3 and s[-1].up  # the lowest free label


def test_unsupported_function_and_field_are_recorded_once_and_not_retried():
    fake = FakeNvml(gpus=1)
    fake.gpus[0].unsupported_fns.add("nvmlDeviceGetPowerUsage")
    fake.gpus[0].unsupported_fields.add(pynvml.NVML_FI_DEV_NVLINK_THROUGHPUT_DATA_TX)
    backend = NvmlBackend(nvml=fake)
    for _ in range(5):
        s = backend.collect()[0]
    assert s.up and s.power_watts is None and s.nvlink_tx_bytes_total is None
    assert s.nvlink_rx_bytes_total == 2000 * 1024
    assert fake.calls["nvmlDeviceGetPowerUsage"] == 1  # asked once, never again
    assert fake.calls["fields_requested"] == len(FIELDS) + 4 * (len(FIELDS) - 1)
    unsupported = backend.unsupported()
    assert unsupported[(0, "power_watts")] == "Not Supported"
    assert (0, "nvlink_tx_bytes_total") in unsupported
    assert backend.errors()["not_supported"] == 2


@pytest.mark.parametrize("code,kind", [
    (pynvml.NVML_ERROR_UNKNOWN, "unknown"),
    (pynvml.NVML_ERROR_TIMEOUT, "timeout"),
    (pynvml.NVML_ERROR_GPU_IS_LOST, "gpu_is_lost"),
])
def test_the_gpu_is_down_when_no_reading_of_the_liveness_probe_answers(code, kind):
    """One UNKNOWN or TIMEOUT of utilization alone made the GPU down for a cycle and
    GpuDown (critical, no `for:`) paged (a review): the GPU is down when none of
    utilization and memory answers, by the last error's kind, or when one says it is
    gone."""
    fake = FakeNvml(gpus=2)
    backend = NvmlBackend(nvml=fake)

    def broken(h):
        raise pynvml.NVMLError(code)

    util, mem = fake.nvmlDeviceGetUtilizationRates, fake.nvmlDeviceGetMemoryInfo
    fake.nvmlDeviceGetUtilizationRates = lambda h: broken(h) if h == 0 else util(h)
    s = backend.collect()
    assert s[1].up and s[1].utilization_ratio == 0.5
    assert backend.errors()[kind] == 1
    if kind == "gpu_is_lost":
        assert not s[0].up and s[0].down_reason == kind
        return
    assert s[0].up and s[0].utilization_ratio is None and s[0].failing == ("utilization",)
    assert s[0].memory_used_bytes == 10 * 2**30  # it answered: alive
    # a second cycle in a row: a hung GPU times out every cycle while the driver may
    # still serve its memory figures (a second review)
    s = backend.collect()
    assert not s[0].up and s[0].down_reason == kind and s[1].up
    fake.nvmlDeviceGetUtilizationRates = util  # answers again: up
    assert backend.collect()[0].up
    fake.nvmlDeviceGetUtilizationRates = lambda h: broken(h) if h == 0 else util(h)
    fake.nvmlDeviceGetMemoryInfo = lambda h: broken(h) if h == 0 else mem(h)
    s = backend.collect()  # both fail in one cycle: down at once
    assert not s[0].up and s[0].down_reason == kind and s[1].up


@pytest.mark.parametrize("code,kind,up", [
    (pynvml.NVML_ERROR_UNKNOWN, "unknown", True),
    (pynvml.NVML_ERROR_TIMEOUT, "timeout", True),
    (pynvml.NVML_ERROR_GPU_IS_LOST, "gpu_is_lost", False),
])
def test_an_optional_metric_failing_loses_that_metric_unless_the_gpu_is_gone(code, kind, up):
    """An error of one optional reading marked the GPU down, and GpuDown pages at once;
    only the errors that say the GPU or NVML is gone (`GONE`) still do."""
    fake = FakeNvml(gpus=2)
    backend = NvmlBackend(nvml=fake)

    def broken(h):
        raise pynvml.NVMLError(code)

    fake.nvmlDeviceGetTemperature = lambda h, s: broken(h) if h == 0 else 55
    s = backend.collect()
    assert s[0].up is up and s[0].down_reason == ("" if up else kind)
    if up:
        assert s[0].temperature_celsius is None and s[0].power_watts == 350.0
        assert s[0].failing == ("temperature_celsius",)  # GpuReadingsFailing's evidence
    assert s[1].up and s[1].temperature_celsius == 55 and s[1].failing == ()
    assert backend.errors()[kind] == 1
    assert backend.unsupported() == {}


def test_readings_that_fail_are_named_each_cycle_and_exported():
    """A GPU that answers its liveness probe and fails its other readings was up with
    those metrics missing and nothing saying so; every reading that fails a cycle is
    now named, and `clusterpulse_gpu_reading_failing{metric}` is exported while it
    fails (GpuReadingsFailing), gone the cycle it answers again."""
    from prometheus_client import CollectorRegistry, generate_latest

    from clusterpulse.agent.audit import AuditLog
    from clusterpulse.agent.core import Agent
    from clusterpulse.agent.exporter import AgentCollector
    from clusterpulse.agent.ranks import RankRegistry

    fake = FakeNvml(gpus=2)
    failing: set[str] = set()

    def breaks(name):
        real = getattr(fake, name)

        def call(h, *args):
            if h == 0 and name in failing:
                raise pynvml.NVMLError(pynvml.NVML_ERROR_UNKNOWN)
            return real(h, *args)
        return call

    for name in ("nvmlDeviceGetPowerUsage", "nvmlDeviceGetFieldValues",
                 "nvmlDeviceGetNvLinkState"):
        setattr(fake, name, breaks(name))
    agent = Agent(NvmlBackend(nvml=fake), "n1", RankRegistry(), AuditLog(None))

    def exported() -> set[tuple[str, str]]:
        agent.collect_once()
        reg = CollectorRegistry(auto_describe=False)
        reg.register(AgentCollector(agent))
        return {(ln.split('gpu="')[1].split('"')[0], ln.split('metric="')[1].split('"')[0])
                for ln in generate_latest(reg).decode().splitlines()
                if ln.startswith("clusterpulse_gpu_reading_failing{")}

    assert exported() == set()  # its NVLinks counted at the first cycle
    failing.update({"nvmlDeviceGetPowerUsage", "nvmlDeviceGetFieldValues",
                    "nvmlDeviceGetNvLinkState"})
    assert exported() == {("0", "power_watts"), ("0", "field_values"), ("0", "nvlink_up")}
    s = agent.snapshot.gpus
    # the cycles with a failure, against the agent's cycles (GpuReadingsFailing)
    assert (s[0].failed_reading_cycles_total, s[1].failed_reading_cycles_total) == (1, 0)
    assert s[0].up and s[0].temperature_celsius == 60 and s[0].power_watts is None
    failing.clear()  # it answers again: nothing is failing
    assert exported() == set()


def test_nvml_init_failure_is_a_clear_error():
    with pytest.raises(BackendError, match="--backend sim"):
        NvmlBackend(nvml=FakeNvml(init_error=pynvml.NVMLError))


def test_xid_events_are_counted_without_blocking():
    fake = FakeNvml(gpus=2)
    backend = NvmlBackend(nvml=fake)
    fake.events.extend([(1, 79), (1, 79), (0, 48)])
    s = backend.collect()
    assert s[1].xid_errors_total == {79: 2} and s[0].xid_errors_total == {48: 1}
    s = backend.collect()  # no new events: counts stay, wait returns at once
    assert s[1].xid_errors_total == {79: 2}


def test_xids_while_a_lost_gpu_awaits_the_reinit_are_counted_not_freed_with_the_set():
    """A review: after GPU_IS_LOST the drain stopped until NVML's re-initialisation (30 s
    on), which freed the event set undrained: the lost GPU's XID 79 and a healthy GPU's
    XID 48 in that window were never counted. One GPU is gone, not NVML."""
    fake, clock = FakeNvml(gpus=2), ManualClock()
    backend = NvmlBackend(nvml=fake, clock=clock)
    backend.collect()
    fake.gpus[1].lost = True
    assert not backend.collect()[1].up
    fake.events.extend([(1, 79), (0, 48)])  # the driver's 79, then a DBE on GPU 0
    for _ in range(40):  # past the re-initialisation
        clock.t += 1
        s = backend.collect()
    assert fake.calls["nvmlInit"] >= 2 and fake.discarded == 0
    assert s[0].xid_errors_total == {48: 1} and s[1].xid_errors_total == {79: 1}


def test_a_passing_error_registering_xid_events_is_retried_not_unsupported_for_good():
    """A review: any error of nvmlDeviceRegisterEvents (one UNKNOWN) or of
    nvmlEventSetCreate marked XIDs unsupported, for that GPU or every GPU, until the
    agent restarted. NOT_SUPPORTED still does."""
    fake = FakeNvml(gpus=3)
    fake.gpus[1].register_errors = [pynvml.NVML_ERROR_UNKNOWN] * 2
    fake.gpus[2].register_errors = [pynvml.NVML_ERROR_NOT_SUPPORTED]
    backend = NvmlBackend(nvml=fake)
    s = backend.collect()  # GPU 1 fails again: its XIDs are not counted, and it says so
    assert s[1].failing == ("xid_errors",) and s[0].failing == s[2].failing == ()
    s = backend.collect()  # registered now
    assert s[1].failing == ()
    fake.events.extend([(1, 48), (0, 48)])
    s = backend.collect()
    assert s[1].xid_errors_total == {48: 1} and s[0].xid_errors_total == {48: 1}
    assert (1, "xid_errors") not in backend.unsupported()
    assert (2, "xid_errors") in backend.unsupported()
    assert fake.calls["nvmlDeviceRegisterEvents"] == 5  # 3 at start, GPU 1 twice more

    fake = FakeNvml(gpus=2)
    fake.event_set_error = pynvml.NVML_ERROR_UNKNOWN
    backend = NvmlBackend(nvml=fake)
    assert backend.unsupported() == {}
    fake.event_set_error = None
    backend.collect()  # the set made now, every GPU registered
    fake.events.append((1, 79))
    assert backend.collect()[1].xid_errors_total == {79: 1}


@pytest.mark.parametrize("mask, reasons", [
    (0x200, {"board_limit"}), (0x400, {"reliability"}),
    (0x800 | 0x40, {"other", "hw_thermal_slowdown"}), (0, set())])
def test_every_clock_event_bit_is_a_reason_an_unknown_one_other(mask, reasons):
    """A review: bits above 0x100 (BoardLimit and Reliability, which pynvml names,
    and a newer driver's) were dropped, the GPU read as not throttled."""
    fake = FakeNvml(gpus=1)
    fake.gpus[0].reasons = mask
    assert NvmlBackend(nvml=fake).collect()[0].clock_events == frozenset(reasons)


def test_xid_counts_survive_an_agent_restart(tmp_path):
    """An XID 79 after the agent restarted must raise the counter Prometheus saw before
    the restart; without persisted state it would read 1 again and go unnoticed."""
    state = tmp_path / "state" / "xid-counts.json"
    fake = FakeNvml(gpus=2)
    first = NvmlBackend(nvml=fake, xid_state=state)
    fake.events.append((1, 79))
    assert first.collect()[1].xid_errors_total == {79: 1}
    first.close()
    second = NvmlBackend(nvml=FakeNvml(gpus=2), xid_state=state)  # the restarted agent
    assert second.collect()[1].xid_errors_total == {79: 1}  # the old count, read back
    second._nvml.events.append((1, 79))
    s = second.collect()
    assert s[1].xid_errors_total == {79: 2} and s[0].xid_errors_total == {}
    assert second.collect()[1].xid_errors_total == {79: 2}  # counted once


def test_unreadable_xid_state_counts_from_zero_without_failing(tmp_path):
    state = tmp_path / "xid-counts.json"
    state.write_text("{not json")
    fake = FakeNvml(gpus=1)
    backend = NvmlBackend(nvml=fake, xid_state=state)
    fake.events.append((0, 48))
    assert backend.collect()[0].xid_errors_total == {48: 1}


@pytest.mark.parametrize(("text", "kept"), [
    ('{"GPU-x": {"\u00b2": 3, "79": 2}}', {"GPU-x": {79: 2}}),  # a digit int() refuses
    ('{"GPU-x": {"79": true, "48": 2.5, "13": 1}}', {"GPU-x": {13: 1}}),
    ("[" * 100_000, {}),
])
def test_damaged_xid_state_keeps_what_it_can_without_failing(tmp_path, text, kept):
    """Found by a review: a key '²' passed str.isdigit() and int() raised ValueError in
    the agent's start with --state-dir (not a BackendError: the agent died)."""
    from clusterpulse.agent.xidstate import XidLedger

    state = tmp_path / "xid-counts.json"
    state.write_text(text)
    assert XidLedger(state)._totals == kept
    fake = FakeNvml(gpus=1)
    backend = NvmlBackend(nvml=fake, xid_state=state)
    fake.events.append((0, 48))
    assert backend.collect()[0].xid_errors_total == {48: 1}


def test_error_kind_names():
    assert error_kind(pynvml.NVMLError(pynvml.NVML_ERROR_GPU_IS_LOST)) == "gpu_is_lost"
    assert error_kind(pynvml.NVMLError(pynvml.NVML_ERROR_NOT_SUPPORTED)) == "not_supported"


def test_link_health_nvlink_state_and_errors_and_pcie_width_against_max():
    fake = FakeNvml(gpus=2)
    fake.gpus[0].nvlink_up = [True, False, True]
    fake.gpus[0].nvlink_errors = {(2, pynvml.NVML_NVLINK_ERROR_DL_CRC_FLIT): 7,
                                  (2, pynvml.NVML_NVLINK_ERROR_DL_REPLAY): 3}
    fake.gpus[0].pcie_width = 8  # trained down from x16
    fake.gpus[1].nvlink_up = []  # a PCIe-only board
    backend = NvmlBackend(nvml=fake)
    s = backend.collect()
    links = s[0].nvlinks
    assert [links[i].up for i in sorted(links)] == [True, False, True]
    assert links[2].errors == {"crc": 7, "replay": 3, "recovery": 0}
    assert (s[0].pcie_link_width, s[0].pcie_link_width_max) == (8, 16)
    assert (s[0].pcie_link_generation, s[0].pcie_link_generation_max) == (5, 5)
    assert s[1].nvlinks == {} and (1, "nvlink") in backend.unsupported()
    fake.calls.clear()
    backend.collect()  # the PCIe-only board is not asked about NVLink again
    assert fake.calls["nvmlDeviceGetNvLinkState"] == 3


def test_a_gpu_lost_before_an_agent_restart_stays_down_under_its_own_label(tmp_path):
    """Review (issue #30): GPU 2 fell off the bus, then the agent restarted with its
    --state-dir kept. The restarted agent listed 3 GPUs, all up, with GPU-fake-3
    relabelled gpu="2": the health check said OK and the node went back into service.
    Now the GPUs are remembered by UUID: the lost one is still exported, down, as
    gpu="2", and the others keep their labels."""
    state = tmp_path / "state"
    fake = FakeNvml(gpus=4)
    before = NvmlBackend(nvml=fake, xid_state=state / "xid-counts.json",
                         gpu_state=state / "gpus.json")
    fake.events.append((2, 79))
    first = _labels(before.collect())
    fake.gpus[2].lost = True
    assert [(g.index, g.up) for g in before.collect()][2] == (2, False)
    before.close()
    after = NvmlBackend(nvml=fake, xid_state=state / "xid-counts.json",
                        gpu_state=state / "gpus.json")  # the agent restarted
    for _ in range(3):
        s = after.collect()
        assert _labels(s) == first
        assert [(g.uuid, g.up, g.down_reason) for g in s] == [
            ("GPU-fake-0", True, ""), ("GPU-fake-1", True, ""),
            ("GPU-fake-2", False, "missing"), ("GPU-fake-3", True, "")]
    assert s[2].xid_errors_total == {79: 1} and s[2].pci_bus_id == "00000000:03:00.0"
    assert s[3].power_watts == 350.0  # the survivor's static facts are read again
    fake.gpus[2].lost = False  # back (a reset): up again under its label
    clock = ManualClock()
    back = NvmlBackend(nvml=fake, clock=clock, gpu_state=state / "gpus.json")
    assert _labels(s := back.collect()) == first and all(g.up for g in s)


def test_a_replaced_card_takes_its_slots_label_and_an_operator_can_forget_a_gpu(tmp_path):
    """After a dead card is swapped (a new UUID in the same PCI slot) the new card is
    gpu="2", not gpu="4" beside a GPU 2 down for ever; a card removed for good stays
    down until the operator deletes its entry from gpus.json (docs/agent.md)."""
    roster = tmp_path / "gpus.json"
    fake = FakeNvml(gpus=4)
    NvmlBackend(nvml=fake, gpu_state=roster).close()
    fake.gpus[2].uuid = "GPU-replacement"
    s = NvmlBackend(nvml=fake, gpu_state=roster).collect()
    assert _labels(s) == {"GPU-fake-0": 0, "GPU-fake-1": 1, "GPU-replacement": 2,
                          "GPU-fake-3": 3} and all(g.up for g in s)
    assert "GPU-fake-2" not in json.loads(roster.read_text())
    fake.gpus[1].lost = True  # pulled for good, the node runs with three
    assert not NvmlBackend(nvml=fake, gpu_state=roster).collect()[1].up
    known = json.loads(roster.read_text())
    del known["GPU-fake-1"]  # the operator, agent stopped
    roster.write_text(json.dumps(known))
    s = NvmlBackend(nvml=fake, gpu_state=roster).collect()
    assert _labels(s) == {"GPU-fake-0": 0, "GPU-replacement": 2, "GPU-fake-3": 3}
    assert all(g.up for g in s)


def test_an_unreadable_gpu_roster_starts_from_nvml_without_failing(tmp_path):
    roster = tmp_path / "gpus.json"
    for bad in ("{not json", "[1, 2]", '{"GPU-x": {"gpu": "two"}, "GPU-y": {"gpu": 0}, '
                '"GPU-z": {"gpu": 0}}'):
        roster.write_text(bad)
        s = NvmlBackend(nvml=FakeNvml(gpus=2), gpu_state=roster).collect()
        assert [(g.uuid, g.up) for g in s if g.up] == [("GPU-fake-0", True), ("GPU-fake-1", True)]


def _agent_backend(monkeypatch, fake: FakeNvml, *flags: str) -> NvmlBackend:
    """The backend the real agent CLI builds from `flags`, over the fake NVML."""
    from clusterpulse.agent import cli
    from clusterpulse.agent.ranks import RankRegistry

    monkeypatch.setitem(sys.modules, "pynvml", fake)
    args = cli.build_parser().parse_args(["--backend", "nvml", *flags])
    backend = cli.make_backend(args, RankRegistry())
    assert isinstance(backend, NvmlBackend)
    return backend


def test_an_agent_scoped_to_a_jobs_gpus_reports_no_other_gpu_down(tmp_path, monkeypatch):
    """Review #30b: Slurm with ConstrainDevices, the job-step agent (train.sbatch) sees
    only its job's GPUs. With the --state-dir a previous node-level agent filled, it
    exported the node's other GPUs down (missing): GpuDown, the Slurm policy drained
    the node. Only --remember-gpus (the node-level deploy files) keeps the roster; the
    XID counts in --state-dir still survive the job-step agent's restarts."""
    state = str(tmp_path / "state")
    _agent_backend(monkeypatch, FakeNvml(gpus=8), "--state-dir", state,
                   "--remember-gpus").close()  # the node agent, with all 8, before
    job = FakeNvml(gpus=8)
    for g in job.gpus[4:]:
        g.lost = True  # not in this job's device cgroup: NVML does not list them
    step = _agent_backend(monkeypatch, job, "--state-dir", state)
    job.events.append((2, 79))
    s = step.collect()
    assert [(g.uuid, g.up) for g in s] == [(f"GPU-fake-{i}", True) for i in range(4)]
    step.close()
    again = _agent_backend(monkeypatch, job, "--state-dir", state)  # restarted
    assert again.collect()[2].xid_errors_total == {79: 1}
    assert sorted(json.loads((tmp_path / "state" / "gpus.json").read_text())) == [
        f"GPU-fake-{i}" for i in range(8)]  # the node agent's roster is left alone


def test_the_node_agents_flag_remembers_a_gpu_lost_before_a_restart(tmp_path, monkeypatch):
    """The node-level setting (--state-dir with --remember-gpus, as the DaemonSet, chart,
    image and systemd unit pass it) still keeps a GPU lost before a restart down."""
    flags = ("--state-dir", str(tmp_path / "state"), "--remember-gpus")
    fake = FakeNvml(gpus=4)
    _agent_backend(monkeypatch, fake, *flags).close()
    fake.gpus[2].lost = True
    s = _agent_backend(monkeypatch, fake, *flags).collect()
    assert [(g.uuid, g.up, g.down_reason) for g in s] == [
        ("GPU-fake-0", True, ""), ("GPU-fake-1", True, ""),
        ("GPU-fake-2", False, "missing"), ("GPU-fake-3", True, "")]


def test_remember_gpus_without_a_state_dir_is_a_one_line_error(monkeypatch):
    from clusterpulse.agent import cli

    with pytest.raises(cli.UsageError, match="--remember-gpus needs --state-dir"):
        _agent_backend(monkeypatch, FakeNvml(gpus=1), "--remember-gpus")


def test_the_slurm_job_step_agent_refuses_to_remember_gpus(tmp_path):
    """train.sbatch's agent is a job step: with ConstrainDevices it sees the job's GPUs
    only, so --remember-gpus in AGENT_ARGS is refused before anything starts."""
    env = {"PATH": "/usr/bin:/bin", "SLURM_JOB_ID": "7", "SLURM_JOB_NAME": "t",
           "CKPT": str(tmp_path), "AGENT_ARGS": "--backend auto --remember-gpus"}
    r = subprocess.run(["bash", str(REPO / "deploy" / "slurm" / "train.sbatch")], env=env,
                       capture_output=True, text=True, timeout=30)
    assert r.returncode == 2 and "--remember-gpus is for the node-level agent" in r.stderr


def test_auto_says_why_nvml_could_not_start(monkeypatch):
    """Review of #30: with --backend auto any NVML start failure, a driver/library
    mismatch included, read "no NVIDIA driver found" and the real reason was dropped:
    a node with a broken driver looked like one without GPUs."""
    from clusterpulse.agent import cli
    from clusterpulse.agent.ranks import RankRegistry

    mismatch = pynvml.NVMLError_LibRmVersionMismatch
    monkeypatch.setitem(sys.modules, "pynvml", FakeNvml(init_error=mismatch))
    args = cli.build_parser().parse_args(["--backend", "auto"])
    with pytest.raises(cli.UsageError) as err:
        cli.make_backend(args, RankRegistry())
    assert "lib_rm_version_mismatch" in str(err.value), err.value
    assert "--backend sim" in str(err.value), err.value


def _answering(fake: FakeNvml, name: str, code: int | None, gpu: int = 0,
               link: int | None = None) -> None:
    """Make `name` answer NVML error `code` on `gpu` (and only `link`, for link calls);
    None: answer as before."""
    real = getattr(type(fake), name).__get__(fake)

    def call(h, *args):
        if code is not None and h == gpu and (link is None or args[0] == link):
            raise pynvml.NVMLError(code)
        return real(h, *args)

    setattr(fake, name, call)


def test_what_a_gpu_cannot_report_is_unsupported_not_failing():
    """A review of GpuReadingsFailing: answers that say a reading is not there (the field
    call NOT_SUPPORTED, one field NO_PERMISSION, an NVLink that stopped being readable)
    were named failing every cycle, and the warning fired for good."""
    fake = FakeNvml(gpus=2)
    backend = NvmlBackend(nvml=fake)
    _answering(fake, "nvmlDeviceGetFieldValues", pynvml.NVML_ERROR_NOT_SUPPORTED, gpu=0)
    _answering(fake, "nvmlDeviceGetNvLinkState", pynvml.NVML_ERROR_NOT_SUPPORTED, gpu=1,
               link=2)
    real_fields = type(fake).nvmlDeviceGetFieldValues.__get__(fake)

    def fields(h, ids):  # GPU 1: the ECC counter is not this process's to read
        out = real_fields(h, ids)
        if h == 1:
            out[0].nvmlReturn = pynvml.NVML_ERROR_NO_PERMISSION
        return out

    original = fake.nvmlDeviceGetFieldValues
    fake.nvmlDeviceGetFieldValues = lambda h, ids: original(h, ids) if h == 0 else fields(h, ids)
    for _ in range(2):
        s = backend.collect()
    assert [x.failing for x in s] == [(), ()], s
    assert [x.failed_reading_cycles_total for x in s] == [0.0, 0.0]
    assert (0, "ecc_corrected_total") in backend.unsupported()
    first = next(iter(FIELDS))
    assert (1, first) in backend.unsupported()
    assert s[1].nvlinks.keys() == {0, 1, 3}


def test_a_field_that_says_nvml_is_gone_takes_the_gpu_down():
    fake = FakeNvml(gpus=2)
    backend = NvmlBackend(nvml=fake)
    real_fields = type(fake).nvmlDeviceGetFieldValues.__get__(fake)

    def fields(h, ids):
        out = real_fields(h, ids)
        if h == 0:
            out[1].nvmlReturn = pynvml.NVML_ERROR_UNINITIALIZED
        return out

    fake.nvmlDeviceGetFieldValues = fields
    s = backend.collect()
    assert not s[0].up and s[0].down_reason == "uninitialized" and s[1].up


def test_static_facts_and_nvlinks_that_fail_are_named_and_read_again():
    """A review of GpuReadingsFailing: the static facts read again each cycle while they
    fail (the PCI slot) were cleared before the cycle's own readings, so never named;
    and an UNKNOWN from link 0 at start marked NVLink unsupported for good, its alerts
    blind with nothing saying so."""
    fake = FakeNvml(gpus=2)
    _answering(fake, "nvmlDeviceGetNvLinkState", pynvml.NVML_ERROR_UNKNOWN, link=0)
    backend = NvmlBackend(nvml=fake)
    _answering(fake, "nvmlDeviceGetPciInfo", pynvml.NVML_ERROR_UNKNOWN)
    for cycle in (1, 2):
        s = backend.collect()
        assert s[0].up and set(s[0].failing) >= {"pci_info", "nvlink_up"}, s[0].failing
        assert s[0].failed_reading_cycles_total == cycle and s[1].failing == ()
    assert (0, "nvlink") not in backend.unsupported()
    _answering(fake, "nvmlDeviceGetNvLinkState", None)  # both answer again
    _answering(fake, "nvmlDeviceGetPciInfo", None)
    s = backend.collect()
    assert s[0].failing == () and s[0].failed_reading_cycles_total == 2
    assert sorted(s[0].nvlinks) == [0, 1, 2, 3] and s[0].pci_bus_id


def test_what_a_gpu_cannot_report_is_exported_with_its_uuid():
    """Every GPU series carries node, gpu and uuid (DESIGN.md); this one had no uuid, and
    after a lost GPU an index names another card than nvidia-smi's (a review)."""
    from prometheus_client import CollectorRegistry, generate_latest

    from clusterpulse.agent.audit import AuditLog
    from clusterpulse.agent.core import Agent
    from clusterpulse.agent.exporter import AgentCollector
    from clusterpulse.agent.ranks import RankRegistry

    fake = FakeNvml(gpus=2)
    fake.gpus[1].unsupported_fns.add("nvmlDeviceGetPowerUsage")
    agent = Agent(NvmlBackend(nvml=fake), "n1", RankRegistry(), AuditLog(None))
    agent.collect_once()
    registry = CollectorRegistry(auto_describe=False)
    registry.register(AgentCollector(agent))
    lines = [line for line in generate_latest(registry).decode().splitlines()
             if line.startswith("clusterpulse_gpu_metric_unsupported{")]
    assert lines == ['clusterpulse_gpu_metric_unsupported{gpu="1",metric="power_watts",'
                     'node="n1",reason="Not Supported",uuid="GPU-fake-1"} 1.0'], lines
