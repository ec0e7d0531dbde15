"""The wrappers over torch.distributed's collectives (trainer/collective_timing.py):
inside a step's forward_backward a blocking collective is timed as sync wait and
counted; everywhere else, and for async or ClusterPulse's own collectives, the call is
torch's own, with its return value and exceptions unchanged. A gloo world of one; the
waits themselves are tested with real ranks in tests/integration/test_attribution.py."""

from __future__ import annotations

import tempfile
from collections.abc import Iterator

import pytest
import torch
import torch.distributed as dist

from clusterpulse.agent import protocol
from clusterpulse.trainer import collective_timing
from clusterpulse.trainer.instrument import Pulse


@pytest.fixture(scope="module")
def world_of_one() -> Iterator[None]:
    with tempfile.TemporaryDirectory() as tmp:
        dist.init_process_group("gloo", init_method=f"file://{tmp}/store", rank=0,
                                world_size=1)
        try:
            yield
        finally:
            dist.destroy_process_group()


@pytest.fixture
def pulse(world_of_one: None) -> Iterator[Pulse]:
    p = Pulse(run="wrap", agent=None, world_size=1, catch_sigterm=False)
    yield p
    p.close()


def test_installed_once_by_a_pulse_in_a_distributed_run(pulse: Pulse) -> None:
    wrapper = dist.all_reduce
    assert collective_timing.originals["all_reduce"] is wrapper.__wrapped__
    assert wrapper.__name__ == "all_reduce" and wrapper.__doc__ == wrapper.__wrapped__.__doc__
    collective_timing.install()
    assert dist.all_reduce is wrapper  # idempotent: never a wrapper of a wrapper
    assert {"all_reduce", "all_gather", "broadcast", "barrier", "reduce_scatter_tensor",
            "all_to_all_single"} <= set(collective_timing.originals)


def test_heartbeats_name_a_collective_as_the_agent_accepts_it() -> None:
    # any other name and the agent drops the heartbeat that shows a rank hung in it
    assert set(collective_timing.COLLECTIVES.values()) <= protocol.COLLECTIVES


def test_in_forward_backward_a_blocking_collective_is_sync_wait(
        pulse: Pulse, monkeypatch: pytest.MonkeyPatch) -> None:
    entered: list[str] = []  # the names heartbeats give while a rank waits in them
    enter = pulse.collectives.enter
    monkeypatch.setattr(pulse.collectives, "enter", lambda op: entered.append(op) or enter(op))
    t = torch.ones(3)
    dist.all_reduce(t)  # before any step: torch's own, nothing counted
    with pulse.step(1) as s:
        with s.section("forward_backward"):
            assert dist.all_reduce(t) is None  # the blocking call's own return value
            gathered = [torch.zeros(3)]
            dist.all_gather(gathered, t)
            work = dist.all_reduce(t, async_op=True)  # not timed: completes at wait()
            work.wait()
            with collective_timing.untimed():  # ClusterPulse's own: timed by itself
                dist.all_reduce(t)
            assert len(pulse._fwd_waits) == 2
        dist.all_reduce(t)  # in the optimizer: not the forward's
        assert collective_timing.state.timer is None
    assert pulse.collectives.entered == pulse.collectives.completed == 2
    assert entered == ["all_reduce", "all_gather"]
    assert torch.equal(gathered[0], torch.ones(3))
    assert pulse.last["sync_wait_seconds"] > 0


def test_exceptions_are_torchs_own(pulse: Pulse) -> None:
    original = collective_timing.originals["all_reduce"]
    with pytest.raises(Exception) as theirs:
        original("not a tensor")
    with pulse.step(1) as s, s.section("forward_backward"), \
            pytest.raises(type(theirs.value)) as ours:
        dist.all_reduce("not a tensor")
    assert str(ours.value) == str(theirs.value)
    assert collective_timing.state.timer is None  # the section closed on the error
    assert pulse.collectives.entered == pulse.collectives.completed == 1


def test_a_compiled_module_with_a_collective_traces_through_the_wrapper(
        pulse: Pulse) -> None:
    class Reduced(torch.nn.Module):
        def forward(self, x: torch.Tensor) -> torch.Tensor:
            y = x * 2
            dist.all_reduce(y)
            return y + 1

    compiled = torch.compile(Reduced(), backend="eager", fullgraph=True)
    x = torch.arange(4.0)
    with pulse.step(1) as s, s.section("forward_backward"):
        out = compiled(x)
    assert torch.equal(out, x * 2 + 1)
    with torch._dynamo.config.patch(error_on_recompile=True):  # no guard on the state
        assert torch.equal(compiled(x), x * 2 + 1)  # outside a section: the same graph
