"""The rank -> agent telemetry contract: one JSON object per message.

Messages, each sent whole or not at all, because the design requires that a rank never
blocks, slows or fails because its agent is absent, slow or restarting: a non-blocking
send returns at once whatever the receiver does, and a lost message costs one sample,
not a step.

The channel (docs/agent.md#telemetry-address, the one place that states it) is a Unix
SOCK_SEQPACKET socket by default: each rank holds a connection of its own, message
boundaries kept, and the kernel names the process that connected (pid, uid, gid),
which the agent pins as it accepts (agent.channel), so identity never comes from the
payload (see docs/security.md). Plain UDP (`HOST:PORT`) is still accepted for setups
that cannot share a socket file; it is unauthenticated, and the agent never signals a
process it learnt about over UDP.

The agent answers each message to its sender with its own state (pending commands,
simulated GPU slowdown), on the rank's connection (over UDP, to its address), so the
same channel carries commands back without a server in the rank.

This module is the single definition of that format: the trainer encodes with it,
the agent validates with it. `decode` returns a *new* dict holding only the known
fields, each of the right type and within its bound, so nothing unknown is ever kept.
"""

from __future__ import annotations

import json
import math
import re
from typing import Any

from clusterpulse.agent.validate import host_port

VERSION = 1
MAX_DATAGRAM_BYTES = 8192
DEFAULT_TELEMETRY_PORT = 9401
DEFAULT_SOCKET_PATH = "/run/clusterpulse/telemetry.sock"
DEFAULT_TELEMETRY = f"unix:{DEFAULT_SOCKET_PATH}"

MESSAGE_TYPES = {"step", "heartbeat", "event"}
EVENTS = {"start", "checkpoint_committed", "checkpoint_failed", "restart_requested", "exit",
          "leave_refused"}
ACTIONS = {"checkpoint-restart", "restart"}
# The longest a graceful command may keep a node out of its job (`leave_s`, the
# remediation's evict-node): an hour; an operator who wants a node out for longer
# drains it in the scheduler.
MAX_LEAVE_S = 3600
# Why a rank cannot take its node out of the job (event `leave_refused`, field
# `reason`): it says so when the command arrives, and nothing restarts; or, for
# `others_leaving`, when the ranks agree on the restart, and the node restarts with
# the job instead of sitting out.
LEAVE_REFUSALS = {
    "single_node": "a single-node job cannot go on without its node",
    "rendezvous_host": "the node hosts the rendezvous store: the others cannot meet without it",
    "min_nodes": "the job is at its minimum node count (--nnodes MIN:MAX)",
    "others_leaving": "other nodes leave the job at the same restart, and it cannot lose this "
                      "one as well (--nnodes MIN:MAX)",
    "no_launcher": "its ranks do not run under clusterpulse-train, which sits a node out",
    "udp": "its ranks report over UDP, which is never trusted to take a node out",
}
# How a rank's `exit` event says it ended (trainer.instrument.Pulse.close).
OUTCOMES = {"finished", "failed", "checkpoint-restart", "preempted"}
RUN_ID = re.compile(r"[A-Za-z0-9_.:-]{1,128}")  # use fullmatch: "$" admits a final "\n"
_COMMAND_ID = re.compile(r"^[A-Za-z0-9_.:-]{1,160}$")
# NVML's form ("GPU-<uuid>", "MIG-<uuid>"); what CUDA_VISIBLE_DEVICES may hold.
_GPU_UUID = re.compile(r"^(GPU|MIG)-[0-9A-Za-z-]{1,80}$")
MAX_ACKS = 16
MAX_GPU_UUIDS = 16
# Integers beyond this are nonsense for any field we know; refusing them before any
# arithmetic is what keeps a 400-digit number from overflowing float() downstream.
_MAX_INT_DIGITS = 20

# Optional numeric fields a message may carry, all in base units.
NUMBER_FIELDS = frozenset({
    "step_seconds", "compute_seconds", "sync_wait_seconds", "data_wait_seconds", "loss",
    "samples_total", "tokens_total", "straggler_score", "memory_bytes", "sync_bytes_total",
    "host_bytes_total", "checkpoint_step", "checkpoint_timestamp_seconds",
    "checkpoint_blocking_seconds", "checkpoint_in_progress", "phase_seconds", "goodput_ratio",
    "ts",
    # Checkpoint saves that failed in this process (CheckpointsFailing pages on repeats).
    "checkpoint_failures_total",
    # Collectives entered / completed since the process started (a sequence number, as
    # NCCL's flight recorder keeps): in a hang the rank that entered fewer is the root.
    "collectives_entered_total", "collectives_completed_total",
    # Straggler scoring (detection.scoring): against its own history, and the decision.
    "straggler_self_score", "straggler_flagged", "straggler_recurring",
    # The last step's gradient all-reduce: its window and the bytes each rank moved.
    "comm_seconds", "comm_bytes",
    # The resume record (rank 0, after a restart): the step it resumed from, the steps
    # it had made past that and does again, when it resumed (trainer/runstate.py).
    # One record per process; the incident timeline reads it (clusterpulse/incident.py).
    "resume_step", "resume_steps_recomputed", "resume_timestamp_seconds",
})
# What a rank blocked in a collective waits in ("" when it is not blocked).
COLLECTIVES = {"", "all_reduce", "all_gather", "reduce_scatter", "broadcast", "barrier",
               "all_to_all", "send_recv"}
# What a rank is doing right now, from its heartbeat thread: a section name
# ("data", "forward_backward", "optimizer", "checkpoint"), "sync" (waiting for peers
# in an instrumented collective), "between" (outside a step), "evaluate" (the loop's
# evaluation, announced with Pulse.evaluating()) or "start".
PHASES = {"start", "data", "forward_backward", "optimizer", "checkpoint", "sync", "between",
          "evaluate"}
# Phases with no step-time reference, held to the absolute hang timeout (the rules'
# clusterpulse:rank_hang_threshold_seconds): starting and loading, saving a checkpoint,
# evaluating (every 1,000 steps for a minute: longer than the steady threshold, and
# rank 0 alone evaluating while its peers wait was paged as a hang root).
OWN_TIMEOUT_PHASES = frozenset({"start", "checkpoint", "evaluate"})
# Phases added after the first release: an older agent drops a heartbeat naming one as
# malformed (and then the rank's heartbeats during a long evaluation, its liveness), so
# an agent lists them in its replies ("phases") and a rank sends one only to an agent
# that did; to another it reports "between", as before.
LATER_PHASES = ("evaluate",)
# Phases the agent sets itself, never accepted from a rank: its exit event said it
# finished (or was preempted) and its growing age is no hang; or it leaves for a
# checkpoint-restart, and the rules give it the restart gap until its successor reports.
EXITED, RESTARTING = "exited", "restarting"
# `pid` is accepted for compatibility with older ranks but never used: the agent takes
# the sender's pid from the kernel.
INT_FIELDS = frozenset({"rank", "local_rank", "world_size", "pid", "gpu", "step", "restarts"})
# The largest magnitude of a number field: past it a value is nonsense for any field
# we know (a diverged loss of 1e30 is no figure to plot), and the message is refused
# (a sender leaves such a figure out rather than lose the message).
MAX_NUMBER = 1e18
# The largest step: any whole number a loop counts (the samples seen, past 2**31 in a
# long run) up to the last one a float64 holds exactly, as Prometheus stores it.
MAX_STEP = 2**53
_MAX_INT = 2**31 - 1  # the other integer fields: ranks, pids, GPU indices, attempts


class MalformedMessage(ValueError):
    """Bytes received that are not a valid telemetry message; the text names why."""


# One encoder for every message: json.dumps with any option builds a new one per call,
# and a rank encodes a message every training step. No NaN or Infinity (allow_nan): the
# agent refuses a message that holds one, and a ValueError here lets the sender leave
# out just that field (a NaN in `Pulse.extra` silenced every step and heartbeat).
def _scalar(value: Any) -> Any:
    """A numpy scalar or a 0-d tensor as the number it holds (`.item()`); anything else
    JSON has no form for is a TypeError, as json's own."""
    item = getattr(value, "item", None)
    if callable(item) and getattr(value, "shape", None) == ():
        return item()
    raise TypeError(f"Object of type {type(value).__name__} is not JSON serializable")


_ENCODER = json.JSONEncoder(separators=(",", ":"), default=_scalar, allow_nan=False)


def check_run_id(run: str) -> str:
    """The run id as the agent accepts it, or ValueError naming the rule."""
    if not isinstance(run, str) or not RUN_ID.fullmatch(run):
        raise ValueError(f"run id {run!r} is not accepted by the agent: use 1-128 characters "
                         "from letters, digits and _ . : - (no spaces or slashes)")
    return run


def encode(msg: dict[str, Any]) -> bytes:
    """The message as sent. TypeError for a value JSON has no form for, ValueError for
    NaN or an infinity (which the agent would refuse, and the message with it)."""
    return _ENCODER.encode({"v": VERSION, **msg}).encode()


def _parse_int(text: str) -> int:
    if len(text.lstrip("-")) > _MAX_INT_DIGITS:
        raise MalformedMessage("number_too_large")
    return int(text)


def _parse_constant(text: str) -> float:
    raise MalformedMessage("non_finite_number")  # NaN, Infinity, -Infinity


def _loads(data: bytes) -> Any:
    try:
        return json.loads(data, parse_int=_parse_int, parse_constant=_parse_constant)
    except MalformedMessage:
        raise
    except RecursionError:  # "[[[[..." thousands deep
        raise MalformedMessage("too_deep") from None
    except (UnicodeDecodeError, ValueError, OverflowError, TypeError):
        raise MalformedMessage("not_json") from None


def _int(msg: dict[str, Any], key: str) -> int:
    v = msg[key]
    if (not isinstance(v, int) or isinstance(v, bool)
            or not -1 <= v <= (MAX_STEP if key == "step" else _MAX_INT)):
        raise MalformedMessage(f"bad_{key}")
    return v


def _number(msg: dict[str, Any], key: str) -> float:
    v = msg[key]
    if not isinstance(v, int | float) or isinstance(v, bool):
        raise MalformedMessage(f"bad_{key}")
    f = float(v)
    # a `_total` is exported as a counter: below zero it is none (invalid OpenMetrics)
    if not math.isfinite(f) or abs(f) > MAX_NUMBER or (f < 0 and key.endswith("_total")):
        raise MalformedMessage(f"bad_{key}")
    return f


def decode(data: bytes) -> dict[str, Any]:
    """Parse and validate one message into a clean dict of known fields only.

    Raises MalformedMessage, never anything else, whatever the bytes: the caller counts
    the reason and drops the message.
    """
    if len(data) > MAX_DATAGRAM_BYTES:
        raise MalformedMessage("too_large")
    msg = _loads(data)
    if not isinstance(msg, dict):
        raise MalformedMessage("not_object")
    if msg.get("v") != VERSION or isinstance(msg.get("v"), bool):
        raise MalformedMessage("bad_version")
    kind = msg.get("type")
    if not isinstance(kind, str) or kind not in MESSAGE_TYPES:
        raise MalformedMessage("bad_type")
    run = msg.get("run")
    if not isinstance(run, str) or not RUN_ID.fullmatch(run):
        raise MalformedMessage("bad_run")
    if "rank" not in msg:
        raise MalformedMessage("bad_rank")
    out: dict[str, Any] = {"v": VERSION, "type": kind, "run": run}
    for key in INT_FIELDS:
        if key in msg:
            out[key] = _int(msg, key)
    for key in NUMBER_FIELDS:
        if key in msg:
            out[key] = _number(msg, key)
    if "phase" in msg:
        if not isinstance(msg["phase"], str) or msg["phase"] not in PHASES:
            raise MalformedMessage("bad_phase")
        out["phase"] = msg["phase"]
    if "collective" in msg:
        if not isinstance(msg["collective"], str) or msg["collective"] not in COLLECTIVES:
            raise MalformedMessage("bad_collective")
        out["collective"] = msg["collective"]
    if kind == "event":
        if not isinstance(msg.get("event"), str) or msg["event"] not in EVENTS:
            raise MalformedMessage("bad_event")
        out["event"] = msg["event"]
        if "outcome" in msg:
            if not isinstance(msg["outcome"], str) or msg["outcome"] not in OUTCOMES:
                raise MalformedMessage("bad_outcome")
            out["outcome"] = msg["outcome"]
        if msg["event"] == "leave_refused":
            if not isinstance(msg.get("command"), str) or not _COMMAND_ID.match(msg["command"]):
                raise MalformedMessage("bad_command")
            if not isinstance(msg.get("reason"), str) or msg["reason"] not in LEAVE_REFUSALS:
                raise MalformedMessage("bad_reason")
            out["command"], out["reason"] = msg["command"], msg["reason"]
    acks = msg.get("acks", [])
    if (not isinstance(acks, list) or len(acks) > MAX_ACKS
            or not all(isinstance(a, str) and _COMMAND_ID.match(a) for a in acks)):
        raise MalformedMessage("bad_acks")
    if acks:
        out["acks"] = acks
    uuids = msg.get("gpu_uuids", [])
    if (not isinstance(uuids, list) or len(uuids) > MAX_GPU_UUIDS
            or not all(isinstance(u, str) and _GPU_UUID.match(u) for u in uuids)):
        raise MalformedMessage("bad_gpu_uuids")
    if uuids:
        out["gpu_uuids"] = uuids
    return out


def parse_address(text: str) -> str | tuple[str, int]:
    """"unix:/path" -> "/path" (Unix SOCK_SEQPACKET socket); "HOST:PORT" -> (host, port)
    (UDP).

    Raises ValueError naming the expected forms.
    """
    if text.startswith("unix:"):
        path = text[len("unix:"):]
        if not path.startswith("/"):
            raise ValueError(f"unix socket path must be absolute, got {text!r}")
        if len(path.encode()) > 107:
            raise ValueError(f"unix socket path longer than 107 bytes: {path!r}")
        return path
    address = host_port(text)
    if address is None:
        raise ValueError("telemetry address must be unix:/PATH (e.g. "
                         f"{DEFAULT_TELEMETRY}) or HOST:PORT (UDP), got {text!r}")
    return address
