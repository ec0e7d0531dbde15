"""torchrun as clusterpulse-train runs it: torch's launcher, with two changes that make a
restart quicker, and torch's rendezvous fixed for hot spares when the job has them.

    python -m clusterpulse.trainer.torchrun <torchrun args>   # cold ranks
    python -m clusterpulse.trainer.warmstart <torchrun args>  # warm ranks (same changes)

What a restart spent here before its ranks started again, on the 4-node testbed after a
rank's crash (torchrun at INFO, 2026-12-03): 0.4 s until torchrun saw its worker fail,
2.9 s formatting that failure's log line, 2.4 s in the rendezvous.

1. A warm-started worker's failure (trainer/warmstart/: torchrun's multiprocessing
   start) is logged with its traceback, through torch's log formatter, which imports
   `torch._dynamo` (and sympy) the first time it formats a traceback: ~1 s of CPU in
   every torchrun, at the moment every torchrun of the job logs its failure, and ~3 s
   on four nodes sharing two cores (torchrun logs a cold worker's failure without
   one). Here the traceback is rendered
   as `logging` does it before torch's formatter sees the record, which then has
   nothing left to import for. The line reads the same.
2. The c10d rendezvous polls its state every second while a node waits (for the old
   round to empty, for the new one to fill), and a poll within a second of the last
   read serves that read again, so each of a restart's waits costs up to a second on
   every node, and a node sees the round complete up to a second after it is. Here
   the poll is `RDZV_POLL_ENV` seconds (the launcher sets it from the job's size,
   `rendezvous_poll_s`), never more often than keeps the store's load at what torch's
   one-second poll puts on it at 256 nodes. The cache also serves torchrun's monitor
   loop, which asks for waiting nodes every `--monitor-interval` all through the run:
   each node reads the state up to 1/interval times a second (5 instead of 1), from
   the rendezvous' own store (not the one the ranks use).

3. Each rendezvous round gives the ranks a fresh store (the launcher sets
   TORCH_DISABLE_SHARE_RDZV_TCP_STORE, pytorch#135712), on a port torch finds free by
   binding port 0 and closing it, which rank 0 binds again later. Port 0 draws from
   the kernel's ephemeral range, which every other process's outgoing connection and
   bind(0) draw from too: on a clean machine with other tests beside it, one took the
   port in between and the launch failed with EADDRINUSE. Here the port is a free one
   below that range and below Kubernetes' NodePorts (30000-32767), outside torch's own
   defaults (29400, 29500) and the local demo's ports (`port_below_ephemeral`), which
   only a bind to that very number can take. The trade: the store holds a port of the
   range where services listen on fixed ports, for the round (hours); a service started
   on that very port meanwhile cannot bind it. `STORE_PORTS_ENV` ("LOW-HIGH") sets the
   range where a node has such services.

All change torch's private parts (checked for torch 2.6 to 2.13): `_delay` of the
dynamic rendezvous, whose polling call passes one second, and its state holder's cache
duration (one second); the formatter on torch's log handlers; the `get_free_port` the
rendezvous' store info is built with. Where those are not there, torch runs as it is,
and the log says so once (torch_support.fallback).
"""

from __future__ import annotations

import copy
import logging
import math
import os
import random
import socket
from pathlib import Path

from clusterpulse.agent.validate import is_digits
from clusterpulse.trainer import spares
from clusterpulse.trainer.torch_support import fallback

log = logging.getLogger(__name__)
RDZV_POLL_ENV = "CLUSTERPULSE_RDZV_POLL_S"  # the rendezvous' poll, set by the launcher
HOLD_FD_ENV = "CLUSTERPULSE_HOLD_FD"  # a torchrun started ahead of its turn waits on it
GO = b"go\n"
TORCH_POLL_S = 1.0  # what torch's rendezvous passes to _delay when it polls
NODES_AT_TORCH_POLL = 256  # the job size from which the poll is torch's own
MIN_POLL_S = 0.05
PORT_RANGE = Path("/proc/sys/net/ipv4/ip_local_port_range")
STORE_PORTS_ENV = "CLUSTERPULSE_STORE_PORTS"  # "LOW-HIGH": where a round's store may listen
LOWEST_PORT = 10000  # below: well-known and registered services
HIGHEST_PORT = 29999  # from 30000: Kubernetes NodePorts (kube-proxy redirects them)
# torch's default rendezvous and store ports; the local demo's (--base-port and the
# next 97) and its screenshots'
NOT_STORE_PORTS = ((29400, 29400), (29500, 29500), (19400, 19497), (24400, 24497))


def rendezvous_poll_s(nodes: int) -> float:
    """The rendezvous' poll for a job of `nodes` nodes: 0.2 s up to 51 nodes, then as
    long as keeps the state reads per second at what torch's 1 s gives at 256 nodes
    (each poll reads the whole state, which grows with the job), torch's 1 s from 256."""
    return min(TORCH_POLL_S, max(0.2, nodes / NODES_AT_TORCH_POLL))


def prepare() -> None:
    """Apply this module's changes in the torchrun process, before torchrun runs."""
    render_tracebacks_plainly()
    store_ports_below_ephemeral()
    interval = poll_interval(os.environ.get(RDZV_POLL_ENV, ""))
    if interval is not None:
        poll_rendezvous_every(interval)
    if os.environ.get(spares.HOT_SPARES_ENV):
        spares.install()


def poll_interval(text: str) -> float | None:
    """RDZV_POLL_ENV's seconds, or None for torch's own poll (unset, not a number, 1 s).
    At least MIN_POLL_S: torch skips a wait under 10 ms, and the poll would spin."""
    try:
        seconds = float(text)
    except ValueError:
        return None
    if not math.isfinite(seconds) or seconds <= 0 or seconds == TORCH_POLL_S:
        return None
    return max(seconds, MIN_POLL_S)


class _PlainTraceback(logging.Formatter):
    """Renders a record's traceback as `logging` does, then leaves the record to the
    formatter it wraps (torch's), which appends the text it finds (see 1. above)."""

    def __init__(self, inner: logging.Formatter) -> None:
        super().__init__()
        self.inner = inner

    def format(self, record: logging.LogRecord) -> str:
        if record.exc_info:
            record = copy.copy(record)  # other handlers may still want exc_info
            record.exc_text = record.exc_text or self.formatException(record.exc_info)
            record.exc_info = None
        return self.inner.format(record)


def render_tracebacks_plainly() -> None:
    """Wrap the formatter of every handler torch's logging set up (idempotent)."""
    try:
        from torch._logging._internal import TorchLogsFormatter, handlers
    except ImportError:  # another torch: its formatter as it is
        fallback("torch._logging's TorchLogsFormatter", "torchrun's log lines as they are")
        return
    for handler in list(handlers):  # the handlers torch's logging set up
        if isinstance(handler.formatter, TorchLogsFormatter):
            handler.setFormatter(_PlainTraceback(handler.formatter))


def poll_rendezvous_every(interval: float) -> None:
    """Make the c10d rendezvous poll every `interval` seconds instead of every second
    (2. above; idempotent, the last call wins): both its wait between polls and how
    long a state it read stands for the store's (a poll within that time reads its own
    copy, so shortening the wait alone changes nothing). Its other delays (the first
    round's random skew) are left as they are."""
    from torch.distributed.elastic.rendezvous import dynamic_rendezvous as dr

    delay = getattr(dr, "_delay", None)
    holder = getattr(dr, "_BackendRendezvousStateHolder", None)
    if delay is None or holder is None:  # another torch
        fallback("c10d rendezvous _delay and _BackendRendezvousStateHolder",
                 "the rendezvous polls every second, as torch's own")
        return
    torch_delay = getattr(delay, "_clusterpulse_torch", delay)
    torch_init = getattr(holder.__init__, "_clusterpulse_torch", holder.__init__)

    def poll(seconds: float | tuple[float, float]) -> None:  # torch passes it by name
        torch_delay(interval if seconds == TORCH_POLL_S else seconds)

    def init(self, backend, settings, cache_duration=TORCH_POLL_S):  # type: ignore[no-untyped-def]
        torch_init(self, backend, settings,
                   interval if cache_duration == TORCH_POLL_S else cache_duration)

    poll._clusterpulse_torch = torch_delay  # type: ignore[attr-defined]
    init._clusterpulse_torch = torch_init  # type: ignore[attr-defined]
    dr._delay = poll
    holder.__init__ = init  # type: ignore[method-assign]


def store_port_range() -> tuple[int, int] | None:
    """The ports a round's store may take (inclusive): `STORE_PORTS_ENV`, else from
    LOWEST_PORT to below the kernel's ephemeral range and HIGHEST_PORT; None where
    there is none (an ephemeral range from below LOWEST_PORT, no /proc)."""
    given = os.environ.get(STORE_PORTS_ENV, "")
    if given:
        low, _, high = given.partition("-")
        if is_digits(low) and is_digits(high) and 1024 <= int(low) <= int(high) <= 65535:
            return int(low), int(high)
        log.warning(
            "%s=%r is not LOW-HIGH (1024-65535): the default range", STORE_PORTS_ENV, given)
    try:
        ephemeral = int(PORT_RANGE.read_text().split()[0])
    except (OSError, ValueError, IndexError):
        return None
    high = min(ephemeral - 1, HIGHEST_PORT)
    return (LOWEST_PORT, high) if high >= LOWEST_PORT else None


def port_below_ephemeral(tries: int = 64, kind: int = socket.SOCK_STREAM,
                         span: tuple[int, int] | None = None) -> int:
    """A port free now in `span` (default `store_port_range()`) outside NOT_STORE_PORTS
    (3. above), or, where there is none, one the kernel gives (torch's own choice, said
    in the log). The local demo's services and the tests' servers take theirs here too,
    for the same reason: an ephemeral port can go to an outgoing connection before they
    bind it."""
    span = span or store_port_range()
    if span is not None:
        for port in random.sample(range(span[0], span[1] + 1), min(tries, span[1] + 1 - span[0])):
            if any(a <= port <= b for a, b in NOT_STORE_PORTS):
                continue
            with socket.socket(socket.AF_INET, kind) as s:
                try:
                    s.bind(("", port))
                except OSError:
                    continue
                return port
    log.info(
        "no free port for the ranks' store in %s: the kernel's choice, from its ephemeral "
        "range (set %s=LOW-HIGH)", span or "a range below the ephemeral ports",
        STORE_PORTS_ENV)
    with socket.socket(socket.AF_INET, kind) as s:
        s.bind(("", 0))
        return s.getsockname()[1]


def store_ports_below_ephemeral() -> None:
    """The fresh store of each rendezvous round on `port_below_ephemeral` (idempotent)."""
    try:
        from torch.distributed.elastic.rendezvous import api
    except ImportError:
        api = None
    if not callable(getattr(api, "get_free_port", None)):
        fallback("rendezvous api.get_free_port", "the ranks' store port is torch's own choice")
        return
    api.get_free_port = port_below_ephemeral  # type: ignore[union-attr]


def take_hold() -> int | None:
    """The pipe a torchrun started ahead of its turn waits on (trainer/launch.py,
    Prewarmed), taken out of the environment before anything is started from this
    process (a forkserver, ranks: a nested clusterpulse-train would read a stranger's
    descriptor)."""
    fd = os.environ.pop(HOLD_FD_ENV, "")
    return int(fd) if is_digits(fd) else None


def held_until_its_turn(hold: int | None) -> bool:
    """With its imports done, wait on the launcher's pipe: True to run now (also for a
    torchrun not held), False when the launcher closed the pipe without the word (it
    ended, or started none after all): exit quietly."""
    if hold is None:
        return True
    with os.fdopen(hold, "rb") as pipe:  # closed after: no child inherits it
        return pipe.readline() == GO


def main() -> None:
    hold = take_hold()
    prepare()
    from torch.distributed.run import main as torchrun

    if held_until_its_turn(hold):
        torchrun()


if __name__ == "__main__":
    main()
