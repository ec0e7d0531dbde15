"""The wrappers over torch.distributed's collectives (trainer/collective_timing.py):
inside a step's forward_backward or data section, or while the loop awaits input, a
blocking collective is timed as sync wait; on the loop's thread it is counted in any
phase (a checkpoint's, the user's own), the outermost call only; async and
ClusterPulse's own collectives are left to torch and to their own counts, with return
values and exceptions unchanged. A gloo world of one; the waits themselves are tested
with real ranks in tests/integration/test_attribution.py and test_hf.py."""

from __future__ import annotations

import time
from collections.abc import Callable, Iterator
from typing import Any

import pytest
import torch
import torch.distributed as dist

from clusterpulse.agent import protocol
from clusterpulse.trainer import collective_timing
from clusterpulse.trainer.instrument import Pulse
from tests.support.worlds import gloo_world_of_one


@pytest.fixture(scope="module")
def world_of_one() -> Iterator[None]:
    with gloo_world_of_one():
        yield


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
    dist.all_reduce(t)  # before any step: counted (any phase), not timed
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
        dist.all_reduce(t)  # after the section, in the step: sync wait too
        assert len(pulse._fwd_waits) == 3
    assert collective_timing.state.timer is None  # the step is over: counted only
    assert pulse.collectives.entered == pulse.collectives.completed == 4
    assert entered == ["all_reduce", "all_reduce", "all_gather", "all_reduce"]
    assert torch.equal(gathered[0], torch.ones(3))
    assert pulse.last["sync_wait_seconds"] > 0


WAIT_S = 0.05  # a late peer, waited for inside a collective


def late_peer(op: str) -> Callable[..., Any]:
    """`op` as the loop calls it (through collective_timing's wrapper), waiting
    WAIT_S for a late peer before the collective itself."""
    def waits(*args: Any, **kwargs: Any) -> Any:
        time.sleep(WAIT_S)
        return collective_timing.originals[op](*args, **kwargs)

    return collective_timing._wrap(op, waits)


def test_in_every_part_of_a_step_a_blocking_collectives_wait_is_sync_wait(
        pulse: Pulse) -> None:
    """Review of #31: in the optimizer section the wait was counted as compute, so a
    healthy rank waiting there for a slow peer paged as the straggler: clipping's norm
    all-reduce on a sharded model, a loop's NaN check or metric all-reduce after
    backward. So in the optimizer section and in a step outside any section, as in
    forward_backward. A checkpoint section's is the checkpoint's own figure: counted
    only (a data section's: below). The late peer: an all_reduce that takes WAIT_S."""
    all_reduce = late_peer("all_reduce")
    t = torch.ones(1)
    with pulse.step(1) as s:
        with s.section("forward_backward"):
            pass
        with s.section("optimizer"):
            all_reduce(t)  # a gradient norm, a NaN check across ranks
    assert pulse.last["sync_wait_seconds"] >= WAIT_S, pulse.last
    assert pulse.last["compute_seconds"] < WAIT_S, pulse.last
    with pulse.step(2):  # a loop without sections
        all_reduce(t)
    assert pulse.last["sync_wait_seconds"] >= WAIT_S, pulse.last
    assert pulse.last["compute_seconds"] < WAIT_S, pulse.last
    with pulse.step(3) as s, s.section("checkpoint"):
        all_reduce(t)  # DCP's planning: the checkpoint's time, not a sync wait
    assert pulse.last["sync_wait_seconds"] == 0, pulse.last
    assert pulse.collectives.entered == pulse.collectives.completed == 3


def test_between_a_steps_micro_batches_a_blocking_collective_is_sync_wait(
        pulse: Pulse) -> None:
    """Lightning holds an accumulating step in its data section between micro-batches
    and broadcasts its SIGTERM flag after every batch: a healthy rank waited there for
    its slow peer, and that wait was its data wait (a review: 0.10 s a step against
    0.002 s of fetching; the straggler's score halved). The late peer takes WAIT_S."""
    broadcast = late_peer("broadcast")
    t = torch.ones(1)
    with pulse.step(1) as s:
        with s.section("forward_backward"):
            pass
        with s.section("data"):
            broadcast(t, 0)  # the framework's, after the first micro-batch
            time.sleep(0.01)  # the next micro-batch's own fetch
        with s.section("forward_backward"):
            pass
    v = pulse.last
    assert v["sync_wait_seconds"] >= WAIT_S and v["data_wait_seconds"] < WAIT_S, v
    assert v["data_wait_seconds"] >= 0.01 and v["compute_seconds"] < WAIT_S, v
    assert pulse.collectives.entered == pulse.collectives.completed == 1
    with pulse.step(2) as s, s.section("data"):
        time.sleep(0.01)  # a step's own input: still data wait
    assert pulse.last["sync_wait_seconds"] == 0 and pulse.last["data_wait_seconds"] >= 0.01


def test_awaiting_input_a_blocking_collective_is_sync_wait_not_data_wait(
        pulse: Pulse) -> None:
    """The HF Trainer gathers the batch's token count across ranks between steps
    (a model whose forward takes **kwargs): a rank waits there for a peer still
    loading its batch. As data wait every rank looked input-bound (issue #31)."""
    import threading

    waits_for_peer = collective_timing._wrap("all_gather", lambda *a, **k: time.sleep(0.3))
    pulse.awaiting_input()
    time.sleep(0.02)  # its own batch
    waits_for_peer([torch.zeros(1)], torch.ones(1))
    # a background checkpoint writer's: not the loop's wait (the loop's join is: input)
    th = threading.Thread(target=waits_for_peer, args=([torch.zeros(1)], torch.ones(1)))
    th.start()
    th.join()
    assert pulse.phase == "data" and pulse.collectives.entered == 1
    pulse.input_arrived()
    assert collective_timing.state.timer is None
    dist.barrier()  # between steps, not awaiting input: counted, not timed
    with pulse.step(1):
        pass
    v = pulse.last
    assert v["data_wait_seconds"] >= 0.32 and 0.3 <= v["sync_wait_seconds"] < 0.6, v
    assert v["compute_seconds"] < 0.1 and v["step_seconds"] >= 0.62, v
    assert pulse.collectives.entered == pulse.collectives.completed == 2
    with pulse.step(2):
        pass
    assert pulse.last["sync_wait_seconds"] == pulse.last["data_wait_seconds"] == 0.0


def test_awaiting_input_ends_with_the_input_or_the_pulse(pulse: Pulse) -> None:
    """No collective is timed for a wait that is over: the epoch ran dry, or the
    Pulse closed while awaiting input (the HF Trainer's last step end)."""
    assert list(pulse.data([])) == []
    assert collective_timing.state.timer is None
    pulse.awaiting_input()
    assert collective_timing.state.timer is pulse
    pulse.close()
    assert collective_timing.state.timer is None


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


def test_outside_a_step_every_blocking_collective_on_the_loop_thread_is_counted(
        pulse: Pulse, monkeypatch: pytest.MonkeyPatch) -> None:
    """A checkpoint's collectives (DCP's gather_object, scatter_object_list,
    broadcast_object_list, all_gather_object, barrier) and the user's own dist.* calls
    are counted in any phase: a rank held up in a checkpoint save is then behind its
    peers, which wait inside DCP's collective. Not timed: that is forward_backward's
    and the input wait's."""
    entered: list[str] = []
    enter = pulse.collectives.enter
    monkeypatch.setattr(pulse.collectives, "enter", lambda op: entered.append(op) or enter(op))
    t = torch.ones(2)
    pulse._enter("checkpoint")
    dist.all_reduce(t)
    dist.barrier()
    out: list[object] = [None]
    dist.all_gather_object(out, {"plan": 1})
    dist.gather_object({"plan": 2}, out, dst=0)
    objs: list[object] = [{"meta": 3}]
    dist.broadcast_object_list(objs, src=0)
    got: list[object] = [None]
    dist.scatter_object_list(got, [{"plan": 4}], src=0)
    assert out == [{"plan": 2}] and got == [{"plan": 4}]
    work = dist.all_reduce(t, async_op=True)  # completes where it is waited on: uncounted
    work.wait()
    assert entered == ["all_reduce", "barrier", "all_gather", "all_gather", "broadcast",
                       "broadcast"]
    assert pulse.collectives.entered == pulse.collectives.completed == 6
    assert pulse._fwd_waits == [] and pulse._probes == []  # counted, not timed


def test_only_the_outermost_call_is_counted(pulse: Pulse) -> None:
    """A wrapped function that calls another (a helper of the user's, DCP's object
    collectives on a torch that calls them through torch.distributed) is one wait."""
    def gather_then_reduce(t: torch.Tensor) -> None:
        dist.all_reduce(t)  # looked up on torch.distributed: the wrapper again
        dist.barrier()

    outer = collective_timing._wrap("broadcast_object_list",
                                    lambda objs, src=0: gather_then_reduce(torch.ones(1)))
    outer([1], src=0)
    assert pulse.collectives.entered == pulse.collectives.completed == 1
    assert pulse.collectives.fields()["collective"] == ""


def test_clusterpulse_own_collectives_are_counted_once(pulse: Pulse) -> None:
    with collective_timing.untimed():  # a sync probe, FSDP's timed collectives
        dist.all_reduce(torch.ones(1))
        dist.all_gather_object([None], 1)
    assert pulse.collectives.entered == 0
    pulse.sync_probe()  # world of one: returns before any collective
    with pulse.collectives.track("all_gather"), collective_timing.untimed():
        dist.all_gather_object([None], 1)
    assert pulse.collectives.entered == pulse.collectives.completed == 1


def test_another_thread_than_the_loop_is_not_counted(pulse: Pulse) -> None:
    """A background checkpoint's writer thread runs DCP's collectives at times of its
    own: counting them would put the ranks out of step with each other."""
    import threading

    th = threading.Thread(target=lambda: dist.barrier())
    th.start()
    th.join()
    assert pulse.collectives.entered == 0
    dist.barrier()
    assert pulse.collectives.entered == 1


def test_a_blocked_collective_is_in_flight_with_its_family(pulse: Pulse) -> None:
    """While a rank waits in DCP's gather_object its heartbeat names all_gather."""
    seen: list[dict] = []
    original = collective_timing.originals["gather_object"]
    wrapper = collective_timing._wrap(
        "gather_object", lambda *a, **k: seen.append(pulse.collectives.fields()))
    wrapper({"x": 1}, [None], dst=0)
    assert seen == [{"collectives_entered_total": 1, "collectives_completed_total": 0,
                     "collective": "all_gather"}]
    assert collective_timing.originals["gather_object"] is original


def test_a_closed_pulse_counts_nothing(world_of_one: None) -> None:
    p = Pulse(run="closed", agent=None, world_size=1, catch_sigterm=False)
    p.close()
    dist.barrier()
    assert p.collectives.entered == 0
