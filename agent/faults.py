"""Hardware faults for simulated GPUs: what can be injected, validated in one place.

Faults arrive from two doors, the control API (JSON) and scenario files (TOML with
timestamps); both go through `parse_fault`, so both reject bad input the same way.
"""

from __future__ import annotations

from dataclasses import dataclass
from pathlib import Path
from typing import Any

from clusterpulse.agent.validate import bounded_number, read_toml

FAULT_KINDS = {
    "overheat": "cooling failure: temperature climbs past slowdown, clocks thermal-throttle",
    "power_brake": "external power brake asserted: clocks halved (hw_power_brake_slowdown)",
    "slow_clocks": "clocks held at `factor` of max (hw_slowdown), e.g. a bad VRM",
    "gpu_lost": "GPU fell off the bus: NVML reports GPU_IS_LOST",
    "xid": "one XID error of `code` (e.g. 79: fallen off the bus, 48: DBE, 13: graphics)",
    "ecc_uncorrectable": "one uncorrectable ECC error; a row remap becomes pending",
    "nvlink_down": "NVLink 0 of the GPU goes down (XID 74): the node's collectives lose a path",
    "nvlink_errors": "NVLink 0 counts replay/CRC errors in proportion to its traffic",
    "pcie_degraded": "the PCIe link trains down to x8 (of x16)",
    "recover": "clear every persistent fault on the GPU (counters keep their values)",
}


MAX_DURATION_S = 7 * 86400.0


class FaultError(ValueError):
    """A fault description is invalid; the message names the problem."""


@dataclass(frozen=True)
class Fault:
    kind: str
    gpu: int
    factor: float = 0.6  # slow_clocks only
    code: int = 79  # xid only
    duration_s: float | None = None  # if set, a `recover` follows after this long


@dataclass(frozen=True)
class ScheduledFault:
    at_s: float
    fault: Fault


def parse_fault(raw: Any, gpus: int) -> Fault:
    if not isinstance(raw, dict):
        raise FaultError("a fault must be an object with at least 'kind' and 'gpu'")
    kind = raw.get("kind")
    if not isinstance(kind, str) or kind not in FAULT_KINDS:
        raise FaultError(f"unknown fault kind {kind!r}; known: {', '.join(sorted(FAULT_KINDS))}")
    gpu = raw.get("gpu")
    if not isinstance(gpu, int) or isinstance(gpu, bool) or not 0 <= gpu < gpus:
        raise FaultError(f"'gpu' must be an integer in 0..{gpus - 1}, got {gpu!r}")
    factor = raw.get("factor", 0.6)
    if bounded_number(factor, 0.05, 1.0) is None:
        raise FaultError(f"'factor' must be a number in 0.05..1.0, got {factor!r}")
    code = raw.get("code", 79)
    if not isinstance(code, int) or isinstance(code, bool) or not 0 < code < 1000:
        raise FaultError(f"'code' must be an XID number in 1..999, got {code!r}")
    duration = raw.get("duration_s")
    if duration is not None and (bounded_number(duration, 0.0, MAX_DURATION_S) is None
                                 or duration <= 0):
        raise FaultError(f"'duration_s' must be a number of seconds in (0, {MAX_DURATION_S:.0f}]"
                         f", got {duration!r}")
    unknown = set(raw) - {"kind", "gpu", "factor", "code", "duration_s", "at_s"}
    if unknown:
        raise FaultError(f"unknown fault fields: {', '.join(sorted(unknown))}")
    return Fault(kind=kind, gpu=gpu, factor=float(factor), code=code,
                 duration_s=None if duration is None else float(duration))


def load_scenario(path: Path, gpus: int) -> list[ScheduledFault]:
    """Read a TOML scenario: a list of [[fault]] tables, each with `at_s` seconds."""
    data = read_toml(path, "scenario", FaultError)
    entries = data.get("fault", [])
    if not isinstance(entries, list):
        raise FaultError(f"scenario {path}: 'fault' must be an array of tables ([[fault]])")
    out = []
    for i, raw in enumerate(entries):
        at = raw.get("at_s") if isinstance(raw, dict) else None
        if bounded_number(at, 0.0, float("inf")) is None:
            raise FaultError(f"scenario {path}, fault #{i + 1}: 'at_s' must be >= 0 seconds")
        try:
            out.append(ScheduledFault(float(at), parse_fault(raw, gpus)))
        except FaultError as err:
            raise FaultError(f"scenario {path}, fault #{i + 1}: {err}") from None
    return sorted(out, key=lambda f: f.at_s)
