"""One rank of a job on the shared node of `bench_node`, as its own process (its own pid,
run as the job's uid): it sends what the instrumentation sends (trainer/instrument.py's
step and heartbeat messages, through the real AgentLink) without torch, so that 20
ranks fit on a 2-core machine beside the agent they load.

    python -m tests.bench.node_rank SOCKET RUN RANK WORLD STEPS_PER_S [--hang-after S]

A healthy rank steps at STEPS_PER_S, sends a heartbeat every second from a thread of
its own and reads the agent's replies every 5 steps (Pulse's consensus interval). A
rank with --hang-after stops in the middle of a step after that many seconds, as a
hung job does: its main thread never returns (rank 0, the root, before entering the
step's all-reduce; the others inside it, waiting), its heartbeat thread goes on, and
nobody reads the replies again. On SIGTERM (or stdin closing) a healthy rank sends its
exit event and prints what it sent as one JSON line.
"""

from __future__ import annotations

import argparse
import json
import os
import signal
import sys
import threading
import time

from clusterpulse.trainer.telemetry import AgentLink

HEARTBEAT_EVERY_S = 1.0  # as Pulse
CONSENSUS_EVERY = 5  # steps between reads of the agent's replies, as Pulse's default


def main() -> int:
    p = argparse.ArgumentParser(description=__doc__)
    p.add_argument("socket")
    p.add_argument("run")
    p.add_argument("rank", type=int)
    p.add_argument("world", type=int)
    p.add_argument("steps_per_s", type=float)
    p.add_argument("--hang-after", type=float, default=None)
    p.add_argument("--restarts", type=int, default=0)
    a = p.parse_args()
    stop = threading.Event()
    signal.signal(signal.SIGTERM, lambda *_: stop.set())
    link = AgentLink(a.socket, local_rank=a.rank)
    ident = {"run": a.run, "rank": a.rank, "local_rank": a.rank, "world_size": a.world,
             "pid": os.getpid(), "gpu": a.rank, "restarts": a.restarts}
    state = {"step": 0, "entered": 0, "phase": "start", "collective": ""}
    lock = threading.Lock()

    def beat() -> None:
        while not stop.wait(HEARTBEAT_EVERY_S):
            with lock:
                msg = {"type": "heartbeat", **ident, "step": state["step"],
                       "phase": state["phase"], "phase_seconds": 0.0,
                       "collectives_entered_total": state["entered"],
                       "collectives_completed_total": state["step"],
                       "collective": state["collective"]}
            link.send(msg)

    link.send({"type": "event", "event": "start", **ident})
    threading.Thread(target=beat, daemon=True).start()
    period = 1.0 / a.steps_per_s
    t0 = time.monotonic()
    sent = 0
    while not stop.is_set():
        step = state["step"] + 1
        with lock:
            state["phase"] = "forward_backward"
        if a.hang_after is not None and time.monotonic() - t0 > a.hang_after:
            with lock:  # the root never reaches the all-reduce; its peers wait in it
                if a.rank != 0:
                    state["entered"] += 1
                    state["collective"] = "all_reduce"
            stop.wait()  # hung: nothing returns, nothing reads the replies
            break
        time.sleep(max(0.0, t0 + step * period - time.monotonic()))
        with lock:
            state["entered"] += 1
            state["step"] = step
            state["phase"] = "between"
        link.send({"type": "step", **ident, "step": step, "step_seconds": period,
                   "compute_seconds": period * 0.8, "sync_wait_seconds": period * 0.2,
                   "loss": 2.0, "samples_total": step * 8, "tokens_total": step * 8192,
                   "collectives_entered_total": state["entered"],
                   "collectives_completed_total": step})
        sent += 1
        if step % CONSENSUS_EVERY == 0:
            link.poll()
    if a.hang_after is None:
        link.send({"type": "event", "event": "exit", "outcome": "finished", **ident},
                  wait_s=1.0)
    print(json.dumps({"run": a.run, "rank": a.rank, "steps_sent": sent,
                      "send_failed": link.failed}), flush=True)
    link.close()
    return 0


if __name__ == "__main__":
    sys.exit(main())
