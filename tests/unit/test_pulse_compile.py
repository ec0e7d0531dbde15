"""Pulse with torch.compile (issue #26 item 3): an instrumented compiled model adds no
graph breaks, no graphs and no recompiles, and its step timings are right.

The README recipe (pulse.step, the forward_backward and optimizer sections, s.loss,
boundary, attach_ddp) runs on a small model under DDP in a world of one (a real gloo
group of size one), compiled both ways users compile DDP: `torch.compile(ddp_model)`
(the reference trainer's `--compile`, and PyTorch's DDP recipe) and
`DDP(torch.compile(model))`. Each model comes plain (three Linear layers) and with a
buffer, which DDP broadcasts before every forward: that is where attach_ddp's
pre-forward hook takes a clock mark. Dynamo's own counters
(`torch._dynamo.utils.counters`) are compared with the same loop bare, measured here
after `torch._dynamo.reset()` and `counters.clear()`.

`backend="eager"`: dynamo finds its graphs and graph breaks before any backend
compiles them, so the counts are the same under inductor, and no C++ compiler is
needed (each graph would cost seconds of a loaded CPU).

`torch.compile(ddp_model)`: DDP's forward breaks the graph itself (3 breaks bare on
torch 2.13: dynamo skips `DDP._inside_ddp_forward` on purpose and cannot trace DDP's
logger), and any forward hook on the DDP module, even a no-op lambda, adds one (dynamo
then counts the logger break twice). attach_ddp must hook DDP's forward, so under this
wrapping the instrumented loop is held to the bare loop with no-op hooks in the same
places, and its graphs to the bare loop's; under `DDP(torch.compile(model))` it is
held to the bare loop (0 breaks, 1 graph). Pulse's hooks run under
`torch.compiler.disable`: dynamo calls them without tracing them (one break at the
DDP pre-hook's call, before the forward's first op, in place of the doubled one).
Before that, with a buffer, dynamo traced them: 7 breaks (4 at `time.perf_counter`),
2 graphs, and a recompile on a guard on the clock mark's value
(`self._fwd_start == 11554.13...`).
"""

from __future__ import annotations

import statistics
import time
from collections.abc import Iterator
from typing import Any

import pytest
import torch
import torch._dynamo as dynamo
import torch.nn.functional as F
from torch import nn
from torch._dynamo.utils import counters
from torch.nn.parallel import DistributedDataParallel as DDP

from clusterpulse.trainer.instrument import Pulse
from tests.support.worlds import gloo_world_of_one, late_peer

STEPS = 6
WAIT_S = 0.02  # in DDP's all-reduce, for a late peer (late_peer): where a rank waits
WORK_S = 0.01  # in the optimizer section: the rank's own work


class Plain(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.layers = nn.ModuleList(nn.Linear(8, 8) for _ in range(3))

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        for layer in self.layers:
            x = torch.relu(layer(x))
        return x


class WithBuffer(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.a, self.b = nn.Linear(8, 8), nn.Linear(8, 8)
        self.register_buffer("scale", torch.ones(8))

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.b(torch.relu(self.a(x)) * self.scale)


MODELS = {"plain": Plain, "buffer": WithBuffer}


@pytest.fixture(scope="module")
def world_of_one() -> Iterator[None]:
    with gloo_world_of_one():
        try:
            _run("plain", "outer", "bare")  # the process's first compile sets dynamo up
            yield
        finally:
            dynamo.reset()


def _run(model: str, wrap: str, mode: str, fullgraph: bool = False
         ) -> tuple[int, int, list[dict[str, float]]]:
    """(graph breaks, graphs, each step's pulse.last) for STEPS steps of the loop.
    `mode`: "bare", "noop_hooks" (bare, with no-op hooks where attach_ddp puts its
    own), or "pulse" (the README recipe)."""
    dynamo.reset()
    counters.clear()
    torch.manual_seed(0)
    inner = MODELS[model]()
    if wrap == "outer":
        ddp = DDP(inner)
        forward: Any = torch.compile(ddp, backend="eager", fullgraph=fullgraph)
    else:
        ddp = forward = DDP(torch.compile(inner, backend="eager", fullgraph=fullgraph))
    opt = torch.optim.SGD(ddp.parameters(), lr=1e-3)
    x, y = torch.randn(4, 8), torch.randn(4, 8)
    rows: list[dict[str, float]] = []
    if mode != "pulse":
        if mode == "noop_hooks":
            ddp.register_forward_pre_hook(lambda _m, _a: None)
            ddp.module.register_forward_pre_hook(lambda _m, _a: None)
            ddp.register_forward_hook(lambda _m, _a, _o: None)
        for _ in range(STEPS):
            F.mse_loss(forward(x), y).backward()
            opt.step()
            opt.zero_grad()
    else:
        ddp.register_comm_hook(None, late_peer(WAIT_S))  # waited for in backward
        with Pulse(run="compile", agent=None, world_size=1, catch_sigterm=False) as pulse:
            pulse.attach_ddp(ddp)
            for step, (xb, yb) in enumerate(pulse.data([(x, y)] * STEPS), 1):
                with pulse.step(step) as s:
                    with s.section("forward_backward"):
                        loss = F.mse_loss(forward(xb), yb)
                        loss.backward()
                    with s.section("optimizer"):
                        opt.step()
                        opt.zero_grad()
                        time.sleep(WORK_S)
                    s.loss = loss
                pulse.boundary(step)
                rows.append(dict(pulse.last))
    breaks = sum(counters["graph_break"].values())
    return breaks, counters["stats"]["unique_graphs"], rows


def _reasons() -> str:
    return "\n".join(f"{n} x " + " ".join(why.split())[:240] for why, n in
                     counters["graph_break"].items())


@pytest.mark.parametrize("model", sorted(MODELS))
@pytest.mark.parametrize("wrap", ["outer", "inner"])
def test_an_instrumented_compiled_model_adds_no_graph_breaks(
        world_of_one: None, model: str, wrap: str) -> None:
    bare_breaks, bare_graphs, _ = _run(model, wrap, "bare")
    allowed = bare_breaks
    if wrap == "outer":  # any forward hook on DDP: its own break counted twice
        allowed = max(allowed, _run(model, wrap, "noop_hooks")[0])
    breaks, graphs, rows = _run(model, wrap, "pulse")
    assert breaks <= allowed, f"{breaks} graph breaks (bare {bare_breaks}):\n{_reasons()}"
    # a graph more is a split graph or a recompile (a guard on a value Pulse changes)
    assert graphs == bare_graphs, f"{graphs} graphs, bare {bare_graphs}:\n{_reasons()}"
    assert len(rows) == STEPS


@pytest.mark.parametrize("model", sorted(MODELS))
@pytest.mark.parametrize("wrap", ["outer", "inner"])
def test_an_instrumented_compiled_model_times_its_steps_right(
        world_of_one: None, model: str, wrap: str) -> None:
    """Every step is reported, its parts add up to it, the wait for a late peer in
    DDP's all-reduce is sync wait (the rank's own work done and the all-reduce's end
    were marked when they happened: without those marks it is compute) and the
    optimizer's work is compute. (A world of one moves no all-reduce bytes, so no
    comm_seconds is reported.)"""
    _, _, rows = _run(model, wrap, "pulse")
    assert len(rows) == STEPS
    for r in rows:
        parts = r["compute_seconds"] + r["sync_wait_seconds"] + r["data_wait_seconds"]
        assert abs(r["step_seconds"] - parts) < 1e-9, r
        assert r["sync_wait_seconds"] >= WAIT_S, r
        assert r["compute_seconds"] >= WORK_S, r
        assert r["step_seconds"] >= WAIT_S + WORK_S, r
        assert r["loss"] > 0, r
    steady = rows[2:]  # the first step compiles (its compute, rightly)
    slack = 0.25  # a loaded machine; a mark taken at trace time would be off by steps
    assert statistics.median(r["sync_wait_seconds"] for r in steady) < WAIT_S + slack, rows
    assert statistics.median(r["compute_seconds"] for r in steady) < WORK_S + slack, rows


@pytest.mark.parametrize("model", sorted(MODELS))
def test_fullgraph_compile_of_the_wrapped_module_survives_the_instrumentation(
        world_of_one: None, model: str) -> None:
    """`DDP(torch.compile(model, fullgraph=True))` under Pulse: the module compiles as
    one graph. (`torch.compile(ddp_model, fullgraph=True)` fails bare: DDP's forward
    breaks the graph itself.)"""
    breaks, graphs, rows = _run(model, "inner", "pulse", fullgraph=True)
    assert (breaks, graphs, len(rows)) == (0, 1, STEPS), _reasons()
