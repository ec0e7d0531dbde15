"""Why a flagged rank is slow: the first cause that explains it, in the order an
operator would check. The same chain as the Prometheus rule
clusterpulse:rank_straggler_cause, for offline replay.

Throttle reasons count only when they really cost clocks: `sw_power_cap` is how a GPU
at full power normally runs, so it is never a cause alone; a clock far below its
maximum is, whatever the reason given, unless the GPU is idle: an idle GPU lowers its
clocks on purpose (NVML's reason `gpu_idle`), and a rank starved of input or waiting on
a slow link idles its GPU. Its clocks did not slow it; what kept it idle did (issue
#27: such ranks were named slow_clocks before their real cause).
"""

from __future__ import annotations

import math
from collections.abc import Mapping

SLOW_CLOCK_RATIO = 0.75
IDLE_UTILIZATION = 0.1  # a GPU running kernels less than this share of the time is idle
DATA_SHARE = 0.5  # of the rank's extra own time, beyond its peers', spent waiting for data
COMM_BANDWIDTH_RATIO = 0.5  # achieved collective bandwidth under this share of peers'


def _num(row: Mapping[str, float], key: str) -> float:
    v = row.get(key, math.nan)
    try:
        return float(v)
    except (TypeError, ValueError):
        return math.nan


def idle(rank: Mapping[str, float]) -> bool:
    """The GPU idled (NVML's reason gpu_idle in at least half the window, or kernels
    running less than IDLE_UTILIZATION of the time): low clocks are then its own doing."""
    return _num(rank, "gpu_idle") >= 0.5 or _num(rank, "utilization") < IDLE_UTILIZATION


def attribute(rank: Mapping[str, float], peers: Mapping[str, float]) -> str:
    """`rank`: the flagged rank's readings (window medians); `peers`: the peer
    medians of the same readings. Keys (all optional but own time): thermal,
    power_brake, hw_slowdown, gpu_idle (0/1), clock_ratio, utilization, xid_recent,
    ecc_uncorrected_recent, data_seconds, comm_seconds, comm_bytes."""
    if _num(rank, "thermal") >= 1:
        return "thermal_throttling"
    if _num(rank, "power_brake") >= 1:
        return "power_brake"
    if _num(rank, "hw_slowdown") >= 1 or (_num(rank, "clock_ratio") < SLOW_CLOCK_RATIO
                                          and not idle(rank)):
        return "slow_clocks"
    if _num(rank, "xid_recent") > 0 or _num(rank, "ecc_uncorrected_recent") > 0:
        return "gpu_errors"
    extra = _num(rank, "own_seconds") - _num(peers, "own_seconds")
    data_extra = _num(rank, "data_seconds") - _num(peers, "data_seconds")
    if extra > 0 and data_extra > DATA_SHARE * extra:
        return "data_loading"
    bw, peer_bw = (_num(rank, "comm_bytes") / _num(rank, "comm_seconds"),
                   _num(peers, "comm_bytes") / _num(peers, "comm_seconds"))
    if bw > 0 and peer_bw > 0 and bw < COMM_BANDWIDTH_RATIO * peer_bw:
        return "communication"
    comm_extra = _num(rank, "comm_seconds") - _num(peers, "comm_seconds")
    if extra > 0 and comm_extra > DATA_SHARE * extra:
        return "communication"
    return "compute"
