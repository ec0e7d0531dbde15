"""Pulse in loops its recipe did not show: step numbers restored from a checkpoint, a
loss that is not a float, a step that raises and a loop that recovers, micro-batches
fetched inside the step. Each broke the loop, its heartbeats or its figures."""

from __future__ import annotations

import json
import logging
import os
import signal
import socket
import threading
import time
from collections.abc import Iterator
from typing import Any

import numpy as np
import pytest
import torch

from clusterpulse.agent import protocol
from clusterpulse.trainer import collective_timing
from clusterpulse.trainer.instrument import IN_STEP_PHASES, Pulse
from tests.conftest import socket_path


class Agent:
    """A SOCK_SEQPACKET listener in the agent's place: keeps what one Pulse sends."""

    def __init__(self) -> None:
        path = socket_path("pulse-loops")
        self.address = f"unix:{path}"
        self.server = socket.socket(socket.AF_UNIX, socket.SOCK_SEQPACKET)
        self.server.bind(path)
        self.server.listen(1)
        self.messages: list[dict[str, Any]] = []
        self.refused: list[str] = []  # why the agent's decode refused a message
        threading.Thread(target=self._read, daemon=True).start()

    def _read(self) -> None:
        conn, _ = self.server.accept()
        with conn:
            while data := conn.recv(65536):
                try:
                    protocol.decode(data)
                except protocol.MalformedMessage as why:
                    self.refused.append(str(why))
                self.messages.append(json.loads(data))

    def steps(self, want: int, timeout: float = 10.0) -> list[dict[str, Any]]:
        deadline = time.monotonic() + timeout
        while time.monotonic() < deadline:
            got = [m for m in self.messages if m.get("type") == "step"]
            if len(got) >= want:
                return got
            time.sleep(0.02)
        raise AssertionError(f"{want} step messages expected, got {self.messages}")


@pytest.fixture
def agent() -> Iterator[Agent]:
    a = Agent()
    yield a
    a.server.close()


def test_numpy_and_tensor_step_numbers_and_a_numpy_loss_reach_the_agent(agent):
    """A resumed loop's step from np.load or an optimizer's state ('step' is a 0-d
    tensor), and a loss computed in numpy: each message failed to encode, out of the
    `with`, and the heartbeat thread died on the stored step for good."""
    p = Pulse(run="loops", agent=agent.address, consensus_every=1)
    try:
        for step, loss in ((np.int64(1), 0.5), (torch.tensor(2), 0.25), (3, np.float32(0.125))):
            with p.step(step) as s:
                s.loss = loss
            p.boundary(int(step))
        got = agent.steps(3)
        assert [(m["step"], m["loss"]) for m in got] == [(1, 0.5), (2, 0.25), (3, 0.125)]
        before = sum(m.get("type") == "heartbeat" for m in agent.messages)
        deadline = time.monotonic() + 10
        while sum(m.get("type") == "heartbeat" for m in agent.messages) < before + 2:
            assert time.monotonic() < deadline, "the heartbeats stopped"
            time.sleep(0.1)
    finally:
        p.close()


def test_extra_fields_numpy_or_not_json_never_stop_the_loop_or_its_messages(agent, caplog):
    """`Pulse.extra` goes into every message: a numpy value there made every send
    raise, out of the step and in the heartbeat thread, which died; a value JSON has
    no form for is left out of the messages, which still go (a review: dropping the
    whole message silenced the rank while it stayed)."""
    p = Pulse(run="loops", agent=agent.address, consensus_every=1)
    try:
        with caplog.at_level(logging.WARNING, logger="clusterpulse.trainer.telemetry"):
            p.extra["lr"] = np.float32(0.5)
            with p.step(1):
                pass
            p.extra["lr"], p.extra["optimizer"] = 0.25, object()
            with p.step(2):
                pass
            time.sleep(1.5)  # a heartbeat's turn
        got = agent.steps(2)
        assert [(m["step"], m["lr"], "optimizer" in m) for m in got] == [
            (1, 0.5, False), (2, 0.25, False)]
        beats = [m for m in agent.messages if m.get("type") == "heartbeat"]
        assert beats and beats[-1]["lr"] == 0.25
        assert p._beat.is_alive() and p.link.failed == 0
        warned = [r.getMessage() for r in caplog.records if "not JSON" in r.getMessage()]
        assert len(warned) == 1 and warned[0].startswith("field(s) optimizer of a")
    finally:
        p.close()


def test_nan_or_infinity_in_extra_leaves_out_that_field_not_the_message(agent):
    """A loop's gradient norm in `Pulse.extra`, NaN or inf for a while (AMP, a
    divergence): the rank sent NaN, which the agent refuses, and so every step and
    heartbeat of the rank while it stayed (a review: 15 steps, none counted)."""
    p = Pulse(run="loops", agent=agent.address, consensus_every=1)
    try:
        for step, norm in ((1, 0.5), (2, float("nan")), (3, float("inf")), (4, np.float32("nan"))):
            p.extra["grad_norm"] = norm
            with p.step(step):
                pass
        time.sleep(1.3)  # a heartbeat's turn, with the NaN
        got = agent.steps(4)
        assert [m["step"] for m in got] == [1, 2, 3, 4]
        assert [m.get("grad_norm") for m in got] == [0.5, None, None, None]
        assert any(m["type"] == "heartbeat" for m in agent.messages)
        assert agent.refused == [], agent.refused
    finally:
        p.close()


def test_a_loss_the_agent_would_refuse_is_left_out_not_the_steps_message(agent):
    """A diverged or fp16-overflowed loss (inf, past the protocol's 1e18): the step's
    whole message was refused by the agent; NaN alone was left out."""
    p = Pulse(run="loops", agent=agent.address, consensus_every=1)
    try:
        losses = (2.5, float("inf"), 1e19, -1e30, float("nan"), torch.tensor(float("inf")), 4.0)
        for step, loss in enumerate(losses, 1):
            with p.step(step) as s:
                s.loss = loss
        got = agent.steps(len(losses))
        assert [(m["step"], m.get("loss")) for m in got] == [
            (1, 2.5), (2, None), (3, None), (4, None), (5, None), (6, None), (7, 4.0)]
        assert agent.refused == [], agent.refused
    finally:
        p.close()


def test_step_numbers_up_to_2_to_the_53_reach_the_agent_and_beyond_are_refused(agent):
    """A loop that numbers its steps by the samples seen passes 2**31: the agent
    refused every message from then on (its step bound), and the rank went silent.
    Up to 2**53 (exact as Prometheus' float64) they are taken; beyond, refused at once."""
    p = Pulse(run="loops", agent=agent.address, consensus_every=1)
    try:
        for step in (2**31 - 1, 2**31, 2**40, 2**53):
            with p.step(step):
                pass
        assert [m["step"] for m in agent.steps(4)] == [2**31 - 1, 2**31, 2**40, 2**53]
        assert agent.refused == [], agent.refused
        for bad in (2**53 + 1, -1):
            with pytest.raises(ValueError, match=r"pulse.step\(n\): n must be from 0 to 2\*\*53"):
                p.step(bad)
    finally:
        p.close()
    step = {"type": "step", "run": "r", "rank": 0}
    with pytest.raises(protocol.MalformedMessage, match="bad_step"):
        protocol.decode(protocol.encode({**step, "step": 2**53 + 1}))
    with pytest.raises(protocol.MalformedMessage, match="bad_gpu"):  # the others: as before
        protocol.decode(protocol.encode({**step, "gpu": 2**31}))


def test_a_step_number_that_is_not_whole_is_named():
    p = Pulse(run="loops", agent=None)
    try:
        for bad in (2.5, True, "3"):
            with pytest.raises(TypeError, match=r"pulse.step\(n\): n must be a whole step "
                                                r"number, not (float 2.5|bool True|str '3')"):
                p.step(bad)
    finally:
        p.close()


def test_the_step_an_optimizer_saved_is_a_step_number():
    """torch's Adam keeps `step` as a float tensor: tensor(1.)."""
    w = torch.nn.Parameter(torch.ones(2))
    opt = torch.optim.AdamW([w])
    w.grad = torch.ones(2)
    opt.step()
    saved = opt.state_dict()["state"][0]["step"]
    p = Pulse(run="loops", agent=None)
    try:
        with p.step(saved):
            pass
        assert p._step == 1 and type(p._step) is int
    finally:
        p.close()


def test_a_loss_of_more_than_one_number_is_warned_about_once_and_the_step_kept(caplog):
    p = Pulse(run="loops", agent=None)
    try:
        with caplog.at_level(logging.WARNING, logger="clusterpulse.trainer.instrument"):
            for step in (1, 2):
                with p.step(step) as s:
                    s.loss = torch.ones(4)
        assert "step_seconds" in p.last and "loss" not in p.last
        warned = [r.getMessage() for r in caplog.records if "s.loss" in r.getMessage()]
        assert warned == ["s.loss must be one number (a float, or a tensor of one element); "
                          "got a tensor of shape (4,): the loss is not reported"]
    finally:
        p.close()


def test_a_step_that_raises_leaves_the_step_phase():
    """A loop that catches a bad batch and recovers (reloads a checkpoint) outside any
    step was still 'forward_backward' to the agent: held to a step's hang threshold."""
    p = Pulse(run="loops", agent=None)
    try:
        with pytest.raises(RuntimeError), p.step(1):
            raise RuntimeError("bad batch")
        assert p.phase == "between"
        with p.step(2):
            pass
        assert p.last["step_seconds"] >= 0
    finally:
        p.close()


def _batches_50ms_apart() -> Iterator[int]:
    """A loader whose every batch takes 50 ms to arrive, for ever."""
    while True:
        time.sleep(0.05)
        yield 0


def test_micro_batches_fetched_inside_the_step_are_its_data_wait_once():
    """The nanoGPT pattern: the next micro-batch is fetched from `pulse.data` inside the
    step. The fetches were the step's compute and, again, the next step's data wait,
    and the first one's arrival stopped the timing of the step's collectives."""
    p = Pulse(run="loops", agent=None)
    try:
        it = p.data(_batches_50ms_apart())
        for step in (1, 2):
            with p.step(step) as s, s.section("forward_backward"):
                for _ in range(4):
                    next(it)
                    assert p.phase in IN_STEP_PHASES  # not "between"
                    assert collective_timing.state.timer is p  # still timing collectives
                time.sleep(0.01)
            first = dict(p.last)
            # 4 fetches of 0.05 s: data; the compute (0.01 s) is well under it
            assert first["data_wait_seconds"] >= 0.2
            assert first["compute_seconds"] < first["data_wait_seconds"]
            assert first["step_seconds"] == pytest.approx(
                first["compute_seconds"] + first["data_wait_seconds"], abs=1e-6)
        assert p.phase == "between"
    finally:
        p.close()


def test_an_evaluation_inside_a_step_keeps_its_phase_and_its_loader_is_no_step_data():
    def loader() -> Iterator[int]:
        for i in range(3):
            time.sleep(0.05)
            yield i

    p = Pulse(run="loops", agent=None)
    try:
        with p.step(1), p.evaluating():
            phases = [p.phase for _ in p.data(loader())]
        assert phases == ["evaluate"] * 3
        assert p.last["data_wait_seconds"] == 0.0
    finally:
        p.close()


def test_a_fetch_that_raises_inside_a_step_ends_its_wait():
    def broken() -> Iterator[int]:
        yield 0
        raise OSError("the shard's file is gone")

    p = Pulse(run="loops", agent=None)
    try:
        with p.step(1):
            it = p.data(broken())
            next(it)
            with pytest.raises(OSError):
                next(it)
            assert p.phase == "step"  # not "data" for the rest of the step
            time.sleep(0.05)
        assert p.last["compute_seconds"] >= 0.05
    finally:
        p.close()


def test_a_step_a_failed_framework_run_left_open_is_discarded_unreported():
    """A Hugging Face Trainer that raised inside a step, then train() again: the retry's
    first wait for input went to the dead step, reported when the next one began."""
    from clusterpulse.integrations.steps import OpenStep

    p = Pulse(run="loops", agent=None)
    steps = OpenStep()
    try:
        steps.begin(p, 1, 0)  # ... the Trainer raises inside it
        steps.discard()  # on_train_begin of the retry
        assert p.phase == "between" and "step_seconds" not in p.last
        p.awaiting_input()
        time.sleep(0.1)
        p.input_arrived()
        steps.begin(p, 1, 0)
        steps.end()
        assert p.last["data_wait_seconds"] >= 0.1
    finally:
        p.close()


def test_a_fetch_inside_the_steps_data_section_is_its_data_wait_once():
    """`s.section("data")` around `next()` of a `pulse.data()` iterator (gradient
    accumulation fetching its micro-batches in the step): the section timed the wait,
    and so did `data()`; the step's data wait was twice the fetches, its compute 0 (a
    review: 200 ms of data for 100 ms of fetches). The section times it alone."""
    p = Pulse(run="loops", agent=None)
    try:
        it = p.data(_batches_50ms_apart())
        for step in (1, 2):
            with p.step(step) as s:
                for _ in range(2):
                    with s.section("data"):
                        next(it)
                        assert p.phase == "data"  # the section's, to its end
                    with s.section("forward_backward"):
                        time.sleep(0.02)
            last = dict(p.last)
            assert last["data_wait_seconds"] >= 0.1 and last["compute_seconds"] >= 0.04
            assert last["step_seconds"] == pytest.approx(
                last["compute_seconds"] + last["data_wait_seconds"], abs=1e-6)
        short = p.data([7])  # the loader's end, met inside the section: the step goes on
        with p.step(3) as s:
            with s.section("data"):
                assert next(short) == 7
            with pytest.raises(StopIteration), s.section("data"):
                next(short)
            assert p.phase == "step" and collective_timing.state.timer is p
        assert p.phase == "between"
    finally:
        p.close()


def test_a_loop_that_never_asks_about_restarts_gets_sigterm_back(monkeypatch):
    """Pulse catches SIGTERM for the restart protocol, acted on at a `boundary`: a loop
    that only times its steps never calls one, and a preemption's SIGTERM was
    swallowed for good (a review: the loop trained on to its end). A SIGTERM no ask
    has come for in UNASKED_SIGTERM_S is passed on to the previous handler at the next
    step's start. Not sooner (a second review): a loop that asks only every few steps,
    or skips its first step's ask, was killed without its save when SIGTERM was handed
    back as its second step began; and a handler the loop installs after Pulse is
    never touched."""
    from clusterpulse.trainer import instrument

    heard: list[int] = []
    before = signal.signal(signal.SIGTERM, lambda signum, _frame: heard.append(signum))
    try:
        p = Pulse(run="loops", agent=None)
        try:
            with p.step(1):
                os.kill(os.getpid(), signal.SIGTERM)
            for step in (2, 3):  # steps within the wait: still held for a boundary
                with p.step(step):
                    pass
            assert p.sigterm.received and heard == [] and p.sigterm.is_current()
            monkeypatch.setattr(instrument, "UNASKED_SIGTERM_S", 0.0)  # the wait is over
            with p.step(4):
                pass
            assert heard == [signal.SIGTERM]  # no ask came: passed on
            assert not p.sigterm.is_current()
            # and forgotten by Pulse: a later ask does not agree a preemption as well
            assert not p.sigterm.received and not p.restart_requested(5)
        finally:
            p.close()
            monkeypatch.undo()  # the wait as shipped, from here on
        ends = Pulse(run="loops", agent=None)  # the loop ends within the wait
        try:
            with ends.step(1):
                os.kill(os.getpid(), signal.SIGTERM)
        finally:
            ends.close()
        assert heard == [signal.SIGTERM] * 2  # passed on at the end, not lost
        asks = Pulse(run="loops", agent=None)  # consensus every 5 steps
        try:
            os.kill(os.getpid(), signal.SIGTERM)
            time.sleep(0.05)
            for step in (1, 2, 3):  # asks from step 3 only (a resumed fit's first steps)
                with asks.step(step):
                    pass
                if step == 3:
                    assert not asks.restart_requested(step)  # not due: the protocol's
            assert asks.sigterm.received and asks.sigterm.is_current()
            assert heard == [signal.SIGTERM] * 2  # this one stays the protocol's
        finally:
            asks.close()
        theirs: list[int] = []
        own = Pulse(run="loops", agent=None)
        try:  # the loop's own graceful handler, installed after Pulse
            signal.signal(signal.SIGTERM, lambda signum, _frame: theirs.append(signum))
            with own.step(1):
                os.kill(os.getpid(), signal.SIGTERM)
            with own.step(2):
                pass
            assert theirs == [signal.SIGTERM] and heard == [signal.SIGTERM] * 2
            assert signal.getsignal(signal.SIGTERM) is not before  # still theirs
        finally:
            own.close()
    finally:
        signal.signal(signal.SIGTERM, before)


def test_rank_and_world_size_are_the_process_groups_whatever_the_environment_says(
        monkeypatch):
    """The mp.spawn script of PyTorch's DDP tutorial makes its group with
    init_process_group(rank=r, world_size=n) and sets no RANK or WORLD_SIZE: read from
    the environment, every rank was rank 0 of a world of one to Pulse and to
    init_distributed (its telemetry overwrote its peer's, no straggler was scored).
    Here the environment says rank 1 of 2 and the group, a world of one: the group's
    answer is taken."""
    from clusterpulse.trainer.parallel import init_distributed
    from tests.support.worlds import gloo_world_of_one

    monkeypatch.setenv("RANK", "1")
    monkeypatch.setenv("WORLD_SIZE", "2")
    with gloo_world_of_one():
        info = init_distributed()
        p = Pulse(run="loops", agent=None)
        try:
            assert (info.rank, info.world) == (0, 1)
            assert (p.rank, p.world_size) == (0, 1)
            assert (p.identity["rank"], p.identity["world_size"]) == (0, 1)
        finally:
            p.close()
