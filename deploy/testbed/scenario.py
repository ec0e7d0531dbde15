"""A fault scenario played in order: each fault waits until the previous one was
detected, acted on and recovered from, so every fault announced actually plays.

Scenario file (TOML), used by the demo (deploy/local/scenario.toml):

    [[fault]]
    kind = "gpu_overheat"   # see deploy/testbed/faults.py
    node = 0                # node index
    gpu = 1                 # GPU faults: the GPU (its local rank's GPU to hit a rank)
    seconds = 120           # transient faults: how long they last
    after_s = 60            # pause before it (after the previous fault recovered)
"""

from __future__ import annotations

import threading
import time
from collections.abc import Callable
from pathlib import Path

from clusterpulse.agent.validate import read_toml
from clusterpulse.dashboard.promclient import PrometheusError
from clusterpulse.incident import Incident
from deploy.testbed.faults import EXPECT, TESTBED_ONLY, Fault, Observer, Outcome, Target, play, undo

# How long the printout waits, after a restart, for the trainer's resume record.
RESUME_WAIT_S = 30.0
# How often the driver asks Prometheus again while it waits for the job's first step,
# for a fault's alerts to resolve, or for a resume record: at the 1 s of its other
# reads, so that each line follows what it reports within a second (one small query).
POLL_S = 1.0


class ScenarioError(ValueError):
    """The scenario file is invalid; the message names the problem."""


def load(path: Path, nodes: int, gpus: int, testbed: bool) -> list[tuple[float, Fault]]:
    data = read_toml(path, "scenario", ScenarioError)
    out = []
    for i, raw in enumerate(data.get("fault", [])):
        where = f"scenario {path}, fault #{i + 1}"
        if not isinstance(raw, dict):
            raise ScenarioError(f"{where}: must be a [[fault]] table")
        unknown = set(raw) - {"kind", "node", "gpu", "seconds", "after_s"}
        if unknown:
            raise ScenarioError(f"{where}: unknown fields {', '.join(sorted(unknown))}")
        kind = raw.get("kind")
        if kind not in EXPECT:
            raise ScenarioError(f"{where}: unknown kind {kind!r}; known: {', '.join(EXPECT)}")
        if kind in TESTBED_ONLY and not testbed:
            raise ScenarioError(f"{where}: {kind} needs the multi-node testbed (--testbed)")
        node, gpu = raw.get("node", 0), raw.get("gpu", 0)
        if not isinstance(node, int) or not 0 <= node < nodes:
            raise ScenarioError(f"{where}: 'node' must be in 0..{nodes - 1}, got {node!r}")
        if not isinstance(gpu, int) or not 0 <= gpu < gpus:
            raise ScenarioError(f"{where}: 'gpu' must be in 0..{gpus - 1}, got {gpu!r}")
        seconds, after = raw.get("seconds", 60), raw.get("after_s", 30)
        for name, v in (("seconds", seconds), ("after_s", after)):
            if not isinstance(v, int | float) or v < 0:
                raise ScenarioError(f"{where}: {name!r} must be a number >= 0, got {v!r}")
        out.append((float(after), Fault(kind, node, gpu, float(seconds))))
    return out


class Driver(threading.Thread):
    """Plays the faults in order in the background, printing each fault as it starts
    and then its detection, action and recovery (or what is missing at the deadline)."""

    def __init__(self, faults: list[tuple[float, Fault]], target: Target, observer: Observer,
                 names: list[str], say: Callable[[str], None], deadline_s: float = 600,
                 action_gap_s: float = 0.0) -> None:
        super().__init__(daemon=True, name="fault-driver")
        self.faults, self.target, self.obs = faults, target, observer
        self.names, self.say, self.deadline_s = names, say, deadline_s
        self.action_gap_s = action_gap_s  # the policy's rate-limit window
        self.stop_event = threading.Event()
        self.outcomes: list[Outcome] = []

    def run(self) -> None:
        total = len(self.faults)
        try:
            self._wait_for_progress()
            for i, (after, fault) in enumerate(self.faults, 1):
                if self.stop_event.wait(after):
                    return
                if self.obs.action_for(fault):  # at most one action per window
                    gap = self.obs.last_action() + self.action_gap_s + 2 - time.time()
                    if gap > 0 and self.stop_event.wait(gap):
                        return
                play(fault, self.target)
                self.say(f"fault {i}/{total}: {fault.describe(self.names)}")
                o = Outcome(fault)
                self.outcomes.append(o)
                self._follow(o)
                self._settle(o)
                self._incident(o)
        except Exception as err:  # a driver failure must not take the demo down
            self.say(f"fault driver stopped: {type(err).__name__}: {err}")

    def _settle(self, o: Outcome) -> None:
        """Wait until the fault's alerts have resolved, so that the next fault's
        detection is its own (a cooling GPU keeps its rank straggling for a while)."""
        names = EXPECT[o.fault.kind]
        end = time.time() + self.deadline_s
        while names and time.time() < end and not self.stop_event.is_set():
            try:
                if not self.obs.firing(names, self.names[o.fault.node]):
                    return
            except OSError:
                pass
            self.stop_event.wait(POLL_S)

    def _incident(self, o: Outcome) -> None:
        """The fault's incident, once its alerts are over: the line the dashboard's
        timeline shows for it (clusterpulse/incident.py). After a restart, once the
        trainer's resume record has been scraped too (up to RESUME_WAIT_S): on a loaded
        machine the line was printed without it, and the page showed it later."""
        inc = self._read_incident(o)
        until = time.time() + RESUME_WAIT_S
        while inc is not None and inc.action in ("restart", "checkpoint-restart") \
                and inc.resume is None and time.time() < until and not self.stop_event.wait(POLL_S):
            inc = self._read_incident(o)
        if inc is not None:
            self.say(f"  incident: {inc.line()}")

    def _read_incident(self, o: Outcome) -> Incident | None:
        try:
            return self.obs.incident(o)
        except (OSError, PrometheusError) as err:
            self.say(f"  incident: cannot read it ({err})")
            return None

    def _wait_for_progress(self) -> None:
        while not self.stop_event.is_set():
            try:
                if (self.obs.step() or 0) > 0:
                    return
            except OSError:
                pass
            self.stop_event.wait(POLL_S)

    def _follow(self, o: Outcome) -> None:
        name = self.names[o.fault.node]
        alerts, action = EXPECT[o.fault.kind], self.obs.action_for(o.fault)
        undone = False
        said: set[str] = set()
        end = time.time() + self.deadline_s
        while not self.stop_event.wait(POLL_S) and time.time() < end:
            try:
                self.obs.update(o, name)
            except OSError:
                continue
            if not undone and o.fault.kind in ("partition", "slow_link", "agent_kill",
                                                "node_death") \
                    and time.time() - o.fault.at >= o.fault.seconds:
                undo(o.fault, self.target)
                undone = True
            if o.detected_at and "d" not in said:
                said.add("d")
                self.say(f"  detected: {o.alert} after {o.detect_s:.0f} s")
            if o.acted_at and "a" not in said:
                said.add("a")
                self.say(f"  action:   {o.action} (remediation) after "
                         f"{o.acted_at - o.fault.at:.0f} s")
            if o.recovered_at and "r" not in said:
                said.add("r")
                inc = self._read_incident(o)
                # the trainer's own resume record when it restarted (the timeline's
                # numbers); else what the observer saw in the step series
                redo = (f"resumed from step {inc.resume.step}, {inc.resume.recomputed}"
                        if inc is not None and inc.resume is not None else f"{o.recomputed}")
                self.say(f"  recovered: step {self.obs.step()} after {o.recover_s:.0f} s "
                         f"({redo} steps recomputed)")
            done = (not alerts or o.detected_at) and (not action or o.acted_at) \
                and o.recovered_at
            if done and (undone or o.fault.kind not in ("partition", "slow_link",
                                                        "agent_kill", "node_death")):
                return
        if not self.stop_event.is_set():
            missing = [w for w, ok in (("detection", not alerts or o.detected_at),
                                       ("action", not action or o.acted_at),
                                       ("recovery", o.recovered_at)) if not ok]
            self.say(f"  NOT SEEN within {self.deadline_s:.0f} s: {', '.join(missing)}")
