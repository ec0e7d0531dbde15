"""The README recipe's loop on a tiny CPU model, bare and under Pulse, and the tools
that measure what the instrumentation adds per step on the host.

Shared by `bench_trainer.bench_instrument_host_cost` (timings, not asserted) and
`tests/unit/test_instrument_calls.py` (Python calls per step, asserted: deterministic).
The model is a stack of tiny Linear layers under DDP (a world of one on gloo) so that
its own host time is small and stable, and `layers` changes its size without changing
what the instrumentation does.
"""

from __future__ import annotations

import contextlib
import gc
import selectors
import socket
import sys
import threading
import time
from collections import defaultdict
from collections.abc import Callable, Iterator
from pathlib import Path
from typing import Any

import torch
import torch.nn.functional as F
from torch import nn

from clusterpulse.trainer.instrument import Pulse


class Recipe:
    """One model, optimizer and batch; `run` takes `steps` steps of the recipe's loop
    (pulse.data, pulse.step, sections, s.loss, pulse.boundary), or the same work bare
    when `pulse` is None."""

    def __init__(self, layers: int, width: int = 8, batch: int = 4) -> None:
        torch.manual_seed(0)
        self.model = nn.parallel.DistributedDataParallel(
            nn.Sequential(*(nn.Linear(width, width) for _ in range(layers))))
        self.opt = torch.optim.SGD(self.model.parameters(), lr=1e-3)
        self.x, self.y = torch.randn(batch, width), torch.randn(batch, width)
        self.step = 0

    def run(self, steps: int, pulse: Pulse | None = None) -> None:
        batches = [(self.x, self.y)] * steps
        if pulse is None:
            for x, y in batches:
                self.step += 1
                loss = F.mse_loss(self.model(x), y)
                loss.backward()
                self.opt.step()
                self.opt.zero_grad()
            return
        for x, y in pulse.data(batches):
            self.step += 1
            with pulse.step(self.step) as s:
                with s.section("forward_backward"):
                    loss = F.mse_loss(self.model(x), y)
                    loss.backward()
                with s.section("optimizer"):
                    self.opt.step()
                    self.opt.zero_grad()
                s.loss = loss
            pulse.boundary(self.step)

    def run_parts(self, steps: int, pulse: Pulse, parts: Parts) -> None:
        """`run` under Pulse with the step, the sections and the boundary timed (their
        own code, not the model's); the wrappers' own calls make it slower than `run`,
        which the totals are taken from."""
        for x, y in pulse.data([(self.x, self.y)] * steps):
            self.step += 1
            with parts.cm("step", pulse.step(self.step)) as s:
                with parts.cm("sections", s.section("forward_backward")):
                    loss = F.mse_loss(self.model(x), y)
                    loss.backward()
                with parts.cm("sections", s.section("optimizer")):
                    self.opt.step()
                    self.opt.zero_grad()
                s.loss = loss
            parts.call("boundary", pulse.boundary, self.step)


class Parts:
    """Host nanoseconds per named part, exclusive of nested parts (the step's exit
    contains the resolve, which contains the send): each part is charged only its own
    time. Only the calling thread is timed (the heartbeat thread sends too). Thread
    CPU time, not wall time: on a shared machine a wall clock also counts the time the
    thread waited for a core, which the instrumentation does not cost."""

    def __init__(self) -> None:
        self.ns: dict[str, int] = defaultdict(int)
        self._children: list[int] = []
        self._thread = threading.get_ident()

    def call(self, name: str, fn: Callable[..., Any], *args: Any, **kw: Any) -> Any:
        if threading.get_ident() != self._thread:
            return fn(*args, **kw)
        self._children.append(0)
        t0 = time.thread_time_ns()
        try:
            return fn(*args, **kw)
        finally:
            dt = time.thread_time_ns() - t0
            self.ns[name] += dt - self._children.pop()
            if self._children:
                self._children[-1] += dt

    @contextlib.contextmanager
    def cm(self, name: str, inner: contextlib.AbstractContextManager[Any]) -> Iterator[Any]:
        """Time a context manager's enter and exit as `name`, not its body."""
        value = self.call(name, inner.__enter__)
        try:
            yield value
        except BaseException:
            if not self.call(name, inner.__exit__, *sys.exc_info()):
                raise
        else:
            self.call(name, inner.__exit__, None, None, None)

    def wrap(self, name: str, fn: Callable[..., Any]) -> Callable[..., Any]:
        def timed(*args: Any, **kw: Any) -> Any:
            return self.call(name, fn, *args, **kw)
        return timed


def python_calls(fn: Callable[[], None]) -> int:
    """Python and C function calls made by `fn` in this thread (sys.setprofile)."""
    count = 0

    def profile(_frame: Any, event: str, _arg: Any) -> None:
        nonlocal count
        if event in ("call", "c_call"):
            count += 1

    # Collection runs finalizers of whatever earlier code left behind (another test's
    # rendezvous handler, say) in this thread, at moments nothing here decides.
    gc.collect()
    gc.disable()
    sys.setprofile(profile)
    try:
        fn()
    finally:
        sys.setprofile(None)
        gc.enable()
    return count


def added_calls(agent: str, layers: int, steps: int = 20) -> tuple[float, float]:
    """(calls per step the instrumentation adds, the bare loop's own calls per step)
    for a `layers`-deep model; `agent` should not reply (draining_socket), so that the
    count is deterministic, and `steps` span whole consensus intervals."""
    bare, inst = Recipe(layers), Recipe(layers)
    pulse = Pulse(run="calls", agent=agent, world_size=1, catch_sigterm=False)
    try:
        pulse.attach_ddp(inst.model)
        bare.run(steps)
        inst.run(steps, pulse)  # warm: the scorer exists, every lazy import is done
        calls_bare = python_calls(lambda: bare.run(steps))
        calls_inst = python_calls(lambda: inst.run(steps, pulse))
        assert pulse.link.sent > 2 * steps, "the step messages took the send path"
    finally:
        pulse.close()
    return (calls_inst - calls_bare) / steps, calls_bare / steps


@contextlib.contextmanager
def draining_socket(path: Path) -> Iterator[str]:
    """A SOCK_SEQPACKET listener at `path` that reads and drops every message on every
    connection and never replies, so that the link's sends take their real path
    (encode, send on a connection) without an agent process, never find the queue
    full, and the loop reads no replies. Yields the address for Pulse."""
    server = socket.socket(socket.AF_UNIX, socket.SOCK_SEQPACKET)
    server.bind(str(path))
    server.listen(8)
    server.setblocking(False)
    stop = threading.Event()

    def drain() -> None:  # every connection (one per Pulse), until stopped
        with selectors.DefaultSelector() as sel:
            sel.register(server, selectors.EVENT_READ)
            while not stop.is_set():
                for key, _ in sel.select(timeout=0.2):
                    sock = key.fileobj
                    assert isinstance(sock, socket.socket)
                    if sock is server:
                        with contextlib.suppress(BlockingIOError):
                            conn, _ = server.accept()
                            conn.setblocking(False)
                            sel.register(conn, selectors.EVENT_READ)
                        continue
                    try:
                        data = sock.recv(65536)
                    except BlockingIOError:
                        continue
                    except OSError:
                        data = b""
                    if not data:
                        sel.unregister(sock)
                        sock.close()
            for key in list(sel.get_map().values()):
                if key.fileobj is not server:
                    key.fileobj.close()  # type: ignore[union-attr]

    thread = threading.Thread(target=drain, name="drain", daemon=True)
    thread.start()
    try:
        yield f"unix:{path}"
    finally:
        stop.set()
        thread.join(timeout=5)
        server.close()
