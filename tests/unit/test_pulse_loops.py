"""Pulse in loops its recipe did not show: step numbers restored from a checkpoint, a
loss that is not a float, a step that raises and a loop that recovers, micro-batches
fetched inside the step. Each broke the loop, its heartbeats or its figures."""

from __future__ import annotations

import json
import logging
import socket
import threading
import time
from collections.abc import Iterator
from typing import Any

import numpy as np
import pytest
import torch

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
        threading.Thread(target=self._read, daemon=True).start()

    def _read(self) -> None:
        conn, _ = self.server.accept()
        with conn:
            while data := conn.recv(65536):
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


def test_micro_batches_fetched_inside_the_step_are_its_data_wait_once():
    """The nanoGPT pattern: the next micro-batch is fetched from `pulse.data` inside the
    step. The fetches were the step's compute and, again, the next step's data wait,
    and the first one's arrival stopped the timing of the step's collectives."""
    def loader() -> Iterator[int]:
        while True:
            time.sleep(0.05)
            yield 0

    p = Pulse(run="loops", agent=None)
    try:
        it = p.data(loader())
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
