"""The rank -> agent telemetry contract: one JSON object per UDP datagram on loopback.

UDP because the design requires that a rank never blocks, slows or fails because its
agent is absent, slow or restarting: `sendto` on a datagram socket returns at once
whatever the receiver does, and a lost datagram costs one sample, not a step.
The agent answers each datagram to its sender with its own state (pending commands,
simulated GPU slowdown), so the same socket carries commands back without a server
in the rank.

This module is the single definition of that format: the trainer encodes with it,
the agent validates with it.
"""

from __future__ import annotations

import json
import re
from typing import Any

VERSION = 1
MAX_DATAGRAM_BYTES = 8192
DEFAULT_TELEMETRY_PORT = 9401

MESSAGE_TYPES = {"step", "heartbeat", "event"}
EVENTS = {"start", "checkpoint_committed", "checkpoint_failed", "restart_requested", "exit"}
ACTIONS = {"checkpoint-restart", "restart"}
_RUN_ID = re.compile(r"^[A-Za-z0-9_.:-]{1,128}$")

# Optional numeric fields a message may carry, all in base units.
NUMBER_FIELDS = {
    "step_seconds", "compute_seconds", "sync_wait_seconds", "data_wait_seconds", "loss",
    "samples_total", "tokens_total", "straggler_score", "memory_bytes", "sync_bytes_total",
    "host_bytes_total", "checkpoint_step", "checkpoint_timestamp_seconds",
    "checkpoint_blocking_seconds", "checkpoint_in_progress", "phase_seconds", "goodput_ratio",
    "ts",
    # Collectives entered / completed since the process started (a sequence number, as
    # NCCL's flight recorder keeps): in a hang the rank that entered fewer is the root.
    "collectives_entered_total", "collectives_completed_total",
    # Straggler scoring (detection.scoring): against its own history, and the decision.
    "straggler_self_score", "straggler_flagged",
}
# What a rank blocked in a collective waits in ("" when it is not blocked).
COLLECTIVES = {"", "all_reduce", "all_gather", "reduce_scatter", "broadcast", "barrier",
               "all_to_all", "send_recv"}
# What a rank is doing right now, from its heartbeat thread: a section name
# ("data", "forward_backward", "optimizer", "checkpoint"), "sync" (waiting for peers
# in an instrumented collective), "between" (outside a step) or "start".
PHASES = {"start", "data", "forward_backward", "optimizer", "checkpoint", "sync", "between"}
INT_FIELDS = {"rank", "local_rank", "world_size", "pid", "gpu", "step", "restarts"}


class MalformedMessage(ValueError):
    """A datagram that is not a valid telemetry message; the text names why."""


def encode(msg: dict[str, Any]) -> bytes:
    return json.dumps({"v": VERSION, **msg}, separators=(",", ":")).encode()


def decode(data: bytes) -> dict[str, Any]:
    """Parse and validate one datagram. Raises MalformedMessage, never anything else."""
    if len(data) > MAX_DATAGRAM_BYTES:
        raise MalformedMessage("too_large")
    try:
        msg = json.loads(data)
    except (UnicodeDecodeError, ValueError):
        raise MalformedMessage("not_json") from None
    if not isinstance(msg, dict):
        raise MalformedMessage("not_object")
    if msg.get("v") != VERSION:
        raise MalformedMessage("bad_version")
    if msg.get("type") not in MESSAGE_TYPES:
        raise MalformedMessage("bad_type")
    run = msg.get("run")
    if not isinstance(run, str) or not _RUN_ID.match(run):
        raise MalformedMessage("bad_run")
    for key in INT_FIELDS:
        if key in msg:
            v = msg[key]
            if not isinstance(v, int) or isinstance(v, bool) or not -1 <= v < 2**31:
                raise MalformedMessage(f"bad_{key}")
    if "rank" not in msg:
        raise MalformedMessage("bad_rank")
    for key in NUMBER_FIELDS:
        if key in msg:
            v = msg[key]
            if not isinstance(v, int | float) or isinstance(v, bool) or v != v or abs(v) > 1e18:
                raise MalformedMessage(f"bad_{key}")
    if "phase" in msg and msg["phase"] not in PHASES:
        raise MalformedMessage("bad_phase")
    if "collective" in msg and msg["collective"] not in COLLECTIVES:
        raise MalformedMessage("bad_collective")
    if msg["type"] == "event" and msg.get("event") not in EVENTS:
        raise MalformedMessage("bad_event")
    acks = msg.get("acks", [])
    if not isinstance(acks, list) or len(acks) > 16 or not all(isinstance(a, str) for a in acks):
        raise MalformedMessage("bad_acks")
    return msg
