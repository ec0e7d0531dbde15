"""Simulated GPUs: physics that respond to load and faults the way hardware does."""

import pytest

from clusterpulse.agent.backends.sim import Activity, SimBackend
from clusterpulse.agent.faults import Fault, FaultError, load_scenario, parse_fault
from tests.support.clock import ManualClock


def run(sim: SimBackend, clock: ManualClock, seconds: float, dt: float = 1.0):
    out = None
    for _ in range(int(seconds / dt)):
        clock.t += dt
        out = sim.collect()
    return out


def busy(_gpu: int) -> Activity:
    return Activity(utilization=0.95, memory_bytes=20 * 2**30, sync_bytes_per_s=1e9,
                    host_bytes_per_s=1e8)


def test_idle_gpu_is_cool_idle_and_low_power():
    clock = ManualClock(100.0)
    s = run(SimBackend(gpus=2, clock=clock), clock, 60)[0]
    assert s.utilization_ratio == 0 and "gpu_idle" in s.clock_events
    assert s.power_watts == pytest.approx(70) and s.temperature_celsius < 40
    assert s.sm_clock_hertz < s.sm_clock_max_hertz


def test_load_drives_power_temperature_memory_and_links_with_inertia():
    clock = ManualClock(100.0)
    sim = SimBackend(gpus=1, activity=busy, clock=clock)
    early = run(sim, clock, 3)[0]
    late = run(sim, clock, 120)[0]
    assert late.power_watts > 600 and late.utilization_ratio == 0.95
    assert early.temperature_celsius < late.temperature_celsius < 87  # healthy: no throttle
    assert late.sm_clock_hertz == late.sm_clock_max_hertz
    assert not late.clock_events & {"sw_thermal_slowdown", "hw_thermal_slowdown"}
    assert late.memory_used_bytes > 20 * 2**30
    assert late.nvlink_tx_bytes_total == pytest.approx(123e9, rel=0.01)
    assert late.energy_joules_total > early.energy_joules_total
    assert sim.slowdown(0) == 1.0


def test_overheat_throttles_clocks_and_slows_the_bound_rank():
    clock = ManualClock(100.0)
    sim = SimBackend(gpus=2, activity=busy, clock=clock)
    run(sim, clock, 60)
    sim.inject(Fault(kind="overheat", gpu=1))
    s = run(sim, clock, 120)
    hot, ok = s[1], s[0]
    assert hot.temperature_celsius > 84
    assert "sw_thermal_slowdown" in hot.clock_events
    assert hot.sm_clock_hertz < 0.9 * hot.sm_clock_max_hertz
    assert sim.slowdown(1) > 1.1 and sim.slowdown(0) == 1.0
    assert ok.sm_clock_hertz == ok.sm_clock_max_hertz
    sim.inject(Fault(kind="recover", gpu=1))
    s = run(sim, clock, 180)
    assert s[1].temperature_celsius < 80 and sim.slowdown(1) == 1.0


@pytest.mark.parametrize("kind,reason", [("power_brake", "hw_power_brake_slowdown"),
                                         ("slow_clocks", "hw_slowdown")])
def test_clock_faults_carry_their_reason(kind, reason):
    clock = ManualClock(100.0)
    sim = SimBackend(gpus=1, activity=busy, clock=clock)
    sim.inject(Fault(kind=kind, gpu=0, factor=0.5))
    s = run(sim, clock, 2)[0]
    assert reason in s.clock_events
    assert s.sm_clock_hertz == pytest.approx(0.5 * s.sm_clock_max_hertz)
    assert sim.slowdown(0) == pytest.approx(2.0)


def test_gpu_lost_xid_and_ecc():
    clock = ManualClock(100.0)
    sim = SimBackend(gpus=3, clock=clock)
    sim.inject(Fault(kind="gpu_lost", gpu=0))
    sim.inject(Fault(kind="xid", gpu=1, code=13))
    sim.inject(Fault(kind="ecc_uncorrectable", gpu=2))
    s = run(sim, clock, 1)
    assert not s[0].up and s[0].down_reason == "gpu_is_lost" and s[0].xid_errors_total == {79: 1}
    assert s[1].up and s[1].xid_errors_total == {13: 1}
    assert s[2].ecc_uncorrected_total == 1 and s[2].row_remap_pending == 1


def test_fault_with_duration_recovers_by_itself():
    clock = ManualClock(100.0)
    sim = SimBackend(gpus=1, clock=clock)
    sim.inject(Fault(kind="gpu_lost", gpu=0, duration_s=5))
    assert not run(sim, clock, 2)[0].up
    assert run(sim, clock, 5)[0].up


def test_scenario_plays_on_schedule(tmp_path):
    path = tmp_path / "s.toml"
    path.write_text('[[fault]]\nat_s = 10\ngpu = 1\nkind = "slow_clocks"\nfactor = 0.5\n')
    clock = ManualClock(100.0)
    sim = SimBackend(gpus=2, activity=busy, clock=clock, scenario=load_scenario(path, 2))
    assert "hw_slowdown" not in run(sim, clock, 5)[1].clock_events
    assert "hw_slowdown" in run(sim, clock, 10)[1].clock_events


@pytest.mark.parametrize("raw,msg", [
    ({"kind": "melt", "gpu": 0}, "unknown fault kind"),
    ({"kind": "overheat", "gpu": 9}, "'gpu' must be an integer in 0..1"),
    ({"kind": "overheat"}, "'gpu'"),
    ({"kind": "slow_clocks", "gpu": 0, "factor": 3}, "'factor'"),
    ({"kind": "xid", "gpu": 0, "code": "x"}, "'code'"),
    ({"kind": "xid", "gpu": 0, "colour": 1}, "unknown fault fields: colour"),
    ([], "must be an object"),
])
def test_bad_faults_are_named(raw, msg):
    with pytest.raises(FaultError, match=msg):
        parse_fault(raw, gpus=2)


def test_bad_scenario_files_are_named(tmp_path):
    bad = tmp_path / "bad.toml"
    bad.write_text("[[fault]\n")
    with pytest.raises(FaultError, match="not valid TOML"):
        load_scenario(bad, 2)
    bad.write_text('[[fault]]\ngpu = 0\nkind = "overheat"\n')
    with pytest.raises(FaultError, match="fault #1: 'at_s'"):
        load_scenario(bad, 2)
    with pytest.raises(FaultError, match="cannot read scenario"):
        load_scenario(tmp_path / "missing.toml", 2)


def test_links_carry_the_ranks_sync_volume_and_can_degrade():
    clock = ManualClock(100.0)
    sim = SimBackend(gpus=2, activity=busy, clock=clock)
    s = run(sim, clock, 10)
    assert s[0].pcie_rx_bytes_total == pytest.approx(10 * (1e8 + 1e9), rel=0.01)
    assert all(link.up for link in s[0].nvlinks.values()) and s[0].pcie_link_width == 16
    sim.inject(Fault(kind="nvlink_down", gpu=1))
    sim.inject(Fault(kind="nvlink_errors", gpu=0))
    sim.inject(Fault(kind="pcie_degraded", gpu=0))
    s = run(sim, clock, 10)
    assert not s[1].nvlinks[0].up and s[1].nvlinks[1].up and s[1].xid_errors_total[74] == 1
    assert s[0].nvlinks[0].errors["replay"] > 1000 and s[0].pcie_link_width == 8
    sim.inject(Fault(kind="recover", gpu=1))
    assert run(sim, clock, 1)[1].nvlinks[0].up
