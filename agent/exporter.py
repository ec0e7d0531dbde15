"""Prometheus exposition of the agent's state: custom collectors over the snapshot.

A scrape only reads what the collection thread last published; it never calls NVML
and never waits on it. Names and labels follow the shared contract: GPU series carry
node/gpu/uuid, trainer series carry run/rank/node/local_rank, identity goes on the
*_info series only.
"""

from __future__ import annotations

import logging
import time
from collections.abc import Iterable, Iterator
from typing import TYPE_CHECKING, Any

from prometheus_client.core import CounterMetricFamily, GaugeMetricFamily, InfoMetricFamily
from prometheus_client.registry import Collector

from clusterpulse.agent import __version__
from clusterpulse.agent.audit import file_head, head_families
from clusterpulse.agent.identity import still_running
from clusterpulse.agent.logsetup import Throttle
from clusterpulse.agent.protocol import EXITED, RESTARTING
from clusterpulse.agent.ranks import STEP_INTERVALS_KEPT
from clusterpulse.agent.sample import CLOCK_EVENT_REASONS

if TYPE_CHECKING:
    from clusterpulse.agent.core import Agent

log = logging.getLogger(__name__)
# a collector's failures: one log line a minute per collector and error (logsetup)
COLLECTOR_FAILURES = Throttle()

GPU_LABELS = ["node", "gpu", "uuid"]
RANK_LABELS = ["run", "rank", "node", "local_rank"]

# (GpuSample attribute, metric name without prefix, help, is counter)
GPU_SERIES: list[tuple[str, str, str, bool]] = [
    ("utilization_ratio", "gpu_utilization_ratio", "Fraction of time a kernel was running.", False),
    ("memory_used_bytes", "gpu_memory_used_bytes", "Device memory in use.", False),
    ("memory_total_bytes", "gpu_memory_total_bytes", "Device memory installed.", False),
    ("temperature_celsius", "gpu_temperature_celsius", "GPU core temperature.", False),
    ("memory_temperature_celsius", "gpu_memory_temperature_celsius", "HBM temperature.", False),
    ("power_watts", "gpu_power_watts", "Power draw.", False),
    ("power_limit_watts", "gpu_power_limit_watts", "Enforced power limit.", False),
    ("energy_joules_total", "gpu_energy_joules", "Energy used since driver load.", True),
    ("sm_clock_hertz", "gpu_sm_clock_hertz", "Current SM clock.", False),
    ("sm_clock_max_hertz", "gpu_sm_clock_max_hertz", "Maximum SM clock.", False),
    ("pcie_tx_bytes_total", "gpu_pcie_tx_bytes", "Bytes sent over PCIe.", True),
    ("pcie_rx_bytes_total", "gpu_pcie_rx_bytes", "Bytes received over PCIe.", True),
    ("nvlink_tx_bytes_total", "gpu_nvlink_tx_bytes", "Bytes sent over all NVLinks.", True),
    ("nvlink_rx_bytes_total", "gpu_nvlink_rx_bytes", "Bytes received over all NVLinks.", True),
    ("pcie_replays_total", "gpu_pcie_replays", "PCIe replay events.", True),
    ("remapped_rows_correctable_total", "gpu_remapped_rows_correctable",
     "Rows remapped after correctable errors.", True),
    ("remapped_rows_uncorrectable_total", "gpu_remapped_rows_uncorrectable",
     "Rows remapped after uncorrectable errors.", True),
    ("row_remap_pending", "gpu_row_remap_pending", "1 if a row remap awaits a GPU reset.", False),
    ("row_remap_failed", "gpu_row_remap_failed", "1 if a row remap failed.", False),
    ("pcie_link_generation", "gpu_pcie_link_generation", "Current PCIe link generation.",
     False),
    ("pcie_link_generation_max", "gpu_pcie_link_generation_max",
     "Highest PCIe generation the GPU and its slot support.", False),
    ("pcie_link_width", "gpu_pcie_link_width_lanes", "Current PCIe link width.", False),
    ("pcie_link_width_max", "gpu_pcie_link_width_max_lanes", "Maximum PCIe link width.",
     False),
    ("failed_reading_cycles_total", "gpu_failed_reading_cycles",
     "Collection cycles in which NVML answered a reading of the up GPU with an error "
     "(GpuReadingsFailing: against agent_collections_total).", True),
]

# (RankState value key, metric name, help, is counter)
RANK_SERIES: list[tuple[str, str, str, bool]] = [
    ("step_seconds", "trainer_step_seconds", "Wall time of the last step.", False),
    ("compute_seconds", "trainer_compute_seconds",
     "The rank's own work in the last step, excluding waits for peers.", False),
    ("sync_wait_seconds", "trainer_sync_wait_seconds",
     "Time the last step waited for peers in gradient sync.", False),
    ("data_wait_seconds", "trainer_data_wait_seconds", "Time the last step waited for data.",
     False),
    ("comm_seconds", "trainer_comm_seconds",
     "All-reduce window of the last step's gradient sync: first gradient ready to synced.",
     False),
    ("comm_bytes", "trainer_comm_bytes",
     "Bytes each rank moved in the last step's gradient all-reduce (ring: 2(n-1)/n of them).",
     False),
    ("loss", "trainer_loss", "Training loss of the last step.", False),
    ("samples_total", "trainer_samples", "Samples processed.", True),
    ("tokens_total", "trainer_tokens", "Tokens processed.", True),
    ("straggler_score", "trainer_straggler_score",
     "Own time relative to the typical peer rank (1 = typical).", False),
    ("straggler_self_score", "trainer_straggler_self_score",
     "Peer score relative to the rank's own usual peer score (1 = as usual).", False),
    ("straggler_flagged", "trainer_straggler_flagged",
     "1 while the scorer flags the rank (slower than peers and than its own history).",
     False),
    ("straggler_recurring", "trainer_straggler_recurring",
     "While the scorer flags the rank for short slowness recurring over 400 steps, what "
     "it costs the job there (1.27: 27 % slower than at its peers' pace); else 0.", False),
    ("memory_bytes", "trainer_memory_bytes", "Memory the rank reports using.", False),
    ("checkpoint_step", "trainer_checkpoint_last_step", "Step of the last committed checkpoint.",
     False),
    ("checkpoint_timestamp_seconds", "trainer_checkpoint_last_timestamp_seconds",
     "Unix time the last committed checkpoint was committed.", False),
    ("checkpoint_blocking_seconds", "trainer_checkpoint_blocking_seconds",
     "Time the last checkpoint blocked the training loop.", False),
    ("checkpoint_in_progress", "trainer_checkpoint_in_progress",
     "1 while the rank is writing a checkpoint.", False),
    ("checkpoint_failures_total", "trainer_checkpoint_failures",
     "Checkpoint saves that failed in the rank's process (staging, write or publish).", True),
    ("phase_seconds", "trainer_phase_seconds", "Seconds the rank has been in its phase.", False),
    ("goodput_ratio", "trainer_goodput_ratio",
     "Productive step time over wall time since the run first started (rank 0).", False),
    ("resume_step", "trainer_resume_step",
     "Step this process resumed from after a restart (rank 0; absent before a restart).",
     False),
    ("resume_steps_recomputed", "trainer_resume_steps_recomputed",
     "Steps made before the restart past the resumed step, done again (rank 0).", False),
    ("resume_timestamp_seconds", "trainer_resume_timestamp_seconds",
     "Unix time this process resumed (rank 0).", False),
    ("collectives_completed_total", "trainer_collectives_completed",
     "Collectives the rank has completed.", True),
]

PREFIX = "clusterpulse_"
# Hang detection's evidence (progress_families): also served alone on /metrics/progress.
PROGRESS_FAMILIES = tuple(PREFIX + n for n in (
    "trainer_heartbeat_age_seconds", "trainer_process_alive", "trainer_phase",
    "trainer_blocked_collective", "trainer_collectives_entered_total",
    "agent_telemetry_receive_lag_seconds"))


# A rank that finished is nobody's straggler: its last score and flag, exported for the
# rank's grace, paged TrainingStraggler minutes after a clean finish (cause slow_clocks,
# as the finished job's GPU idled). The agent's API still shows them.
JUDGEMENT = frozenset({"straggler_score", "straggler_self_score", "straggler_flagged",
                       "straggler_recurring"})


class AgentCollector(Collector):
    def __init__(self, agent: Agent) -> None:
        self.agent = agent

    def collect(self) -> Iterator:
        yield from self._agent_series()
        yield from self._gpu_series()
        yield from self._rank_series()
        # Collectors of other subsystems (node_exporter style): NIC port health and
        # queues, who uses each GPU (agent.attribution), as the CLI configured them.
        success = GaugeMetricFamily(
            PREFIX + "agent_collector_success",
            "1 if the subsystem's collector gave its series in this scrape, 0 if it failed "
            "(its series are left out; the agent's log says why).",
            labels=["node", "collector"])
        for links in self.agent.links:
            families = self._isolated(links)
            success.add_metric([self.agent.node, type(links).__name__],
                               0.0 if families is None else 1.0)
            yield from families or []
        yield success

    def _isolated(self, collector: Any) -> list | None:
        """One subsystem's series, or None: an error in one (a NIC's odd sysfs file, an
        unexpected reply) loses only its own series (agent_collector_success 0), not the
        scrape of every GPU series of the node (node_exporter's rule). Logged at most
        once a minute per collector and error, with how many since."""
        try:
            return list(collector.families(self.agent.node))
        except Exception as err:  # any failure of one subsystem
            kind = type(collector).__name__
            if n := COLLECTOR_FAILURES.due(f"{kind}:{type(err).__name__}:{err}"[:300]):
                log.warning("%s failed (%d time(s) since the last such line), its series "
                            "are left out of the scrape: %s: %s", kind, n,
                            type(err).__name__, err, exc_info=True)
            return None

    def _agent_series(self) -> Iterable:
        a = self.agent
        info = InfoMetricFamily(PREFIX + "agent_build", "Agent version and backend.",
                                labels=["node"])
        info.add_metric([a.node], {"version": __version__, "backend": a.backend.name})
        yield info
        snap = a.snapshot
        g = GaugeMetricFamily(PREFIX + "agent_collection_duration_seconds",
                              "Duration of the last collection cycle.", labels=["node"])
        g.add_metric([a.node], snap.duration_s)
        yield g
        g = GaugeMetricFamily(PREFIX + "agent_last_collection_timestamp_seconds",
                              "Unix time of the last completed collection cycle.",
                              labels=["node"])
        g.add_metric([a.node], snap.timestamp)
        yield g
        g = GaugeMetricFamily(PREFIX + "agent_collection_age_seconds",
                              "Seconds since the last successful GPU collection (before the "
                              "first, since the agent started), computed at scrape time: "
                              "grows while a collection is stuck (hung NVML call).",
                              labels=["node"])
        g.add_metric([a.node], round(max(0.0, time.time() - (snap.last_success
                                                             or a.started)), 3))
        yield g
        c = CounterMetricFamily(PREFIX + "agent_collections", "Collection cycles run.",
                                labels=["node"])
        c.add_metric([a.node], snap.cycles)
        yield c
        c = CounterMetricFamily(PREFIX + "agent_collection_errors",
                                "Collection errors by kind (NVML error kind, not_supported...).",
                                labels=["node", "kind"])
        for kind, n in sorted(a.collection_errors().items()):
            c.add_metric([a.node, kind], n)
        yield c
        # the audit chain's head, outside the file: a record cut from the end, or a
        # rewritten tail, no longer matches what Prometheus stored (docs/security.md)
        head = (file_head(a.audit.path) if a.audit.path is not None else None) or a.audit.head
        yield from head_families(head, {"node": a.node})
        c = CounterMetricFamily(PREFIX + "agent_telemetry_messages",
                                "Telemetry messages by result (accepted or why dropped).",
                                labels=["node", "result"])
        for result, n in sorted(a.telemetry_counts.items()):
            c.add_metric([a.node, result], n)
        yield c
        if a.receiver is not None:
            g = GaugeMetricFamily(PREFIX + "agent_telemetry_connections",
                                  "Open rank connections by sending user (kernel uid, or "
                                  "unverified).", labels=["node", "sender"])
            for sender, n in sorted(a.receiver.connections().items()):
                g.add_metric([a.node, sender], n)
            yield g

    def _gpu_series(self) -> Iterable:
        a, node = self.agent, self.agent.node
        samples = a.snapshot.gpus
        up = GaugeMetricFamily(PREFIX + "gpu_up", "1 if the GPU answered this cycle.",
                               labels=GPU_LABELS)
        info = GaugeMetricFamily(PREFIX + "gpu_info", "GPU identity; value is always 1.",
                                 labels=[*GPU_LABELS, "model", "pci_bus_id", "driver_version"])
        down = GaugeMetricFamily(PREFIX + "gpu_down_reason",
                                 "1 for the reason a GPU is down (NVML error kind).",
                                 labels=[*GPU_LABELS, "reason"])
        failing = GaugeMetricFamily(PREFIX + "gpu_reading_failing",
                                    "1 for each reading of an up GPU that NVML answered with "
                                    "an error in the last cycle (the metric is missing).",
                                    labels=[*GPU_LABELS, "metric"])
        for s in samples:
            labels = [node, str(s.index), s.uuid]
            up.add_metric(labels, 1.0 if s.up else 0.0)
            info.add_metric([*labels, s.name, s.pci_bus_id, s.driver_version], 1.0)
            if not s.up:
                down.add_metric([*labels, s.down_reason or "unknown"], 1.0)
            for metric in s.failing if s.up else ():
                failing.add_metric([*labels, metric], 1.0)
        yield up
        yield info
        yield down
        yield failing
        for attr, name, help_text, counter in GPU_SERIES:
            cls = CounterMetricFamily if counter else GaugeMetricFamily
            fam = cls(PREFIX + name, help_text, labels=GPU_LABELS)
            for s in samples:
                value = getattr(s, attr)
                if s.up and value is not None:
                    fam.add_metric([node, str(s.index), s.uuid], value)
            yield fam
        ev = GaugeMetricFamily(PREFIX + "gpu_clock_event_active",
                               "1 while a clock-event (throttle) reason is active.",
                               labels=[*GPU_LABELS, "reason"])
        for s in samples:
            if s.up and s.clock_events is not None:
                for reason in CLOCK_EVENT_REASONS:
                    ev.add_metric([node, str(s.index), s.uuid, reason],
                                  1.0 if reason in s.clock_events else 0.0)
        yield ev
        ecc = CounterMetricFamily(PREFIX + "gpu_ecc_errors", "ECC errors since driver load.",
                                  labels=[*GPU_LABELS, "kind"])
        for s in samples:
            if not s.up:
                continue
            for kind, v in (("corrected", s.ecc_corrected_total),
                            ("uncorrected", s.ecc_uncorrected_total)):
                if v is not None:
                    ecc.add_metric([node, str(s.index), s.uuid, kind], v)
        yield ecc
        xid = CounterMetricFamily(PREFIX + "gpu_xid_errors", "XID errors seen, by XID code.",
                                  labels=[*GPU_LABELS, "xid"])
        for s in samples:
            for code, n in sorted(s.xid_errors_total.items()):
                xid.add_metric([node, str(s.index), s.uuid, str(code)], n)
        yield xid
        nv_up = GaugeMetricFamily(PREFIX + "gpu_nvlink_up", "1 if the NVLink is active.",
                                  labels=[*GPU_LABELS, "link"])
        nv_err = CounterMetricFamily(PREFIX + "gpu_nvlink_errors",
                                     "NVLink data-link errors by kind (crc, replay, recovery).",
                                     labels=[*GPU_LABELS, "link", "kind"])
        for s in samples:
            if not s.up:
                continue
            for link, ls in sorted(s.nvlinks.items()):
                lb = [node, str(s.index), s.uuid, str(link)]
                nv_up.add_metric(lb, 1.0 if ls.up else 0.0)
                for kind, v in sorted(ls.errors.items()):
                    nv_err.add_metric([*lb, kind], v)
        yield nv_up
        yield nv_err
        uns = GaugeMetricFamily(PREFIX + "gpu_metric_unsupported",
                                "1 for each metric the GPU does not support, with NVML's reason.",
                                labels=[*GPU_LABELS, "metric", "reason"])
        # with the GPU's uuid, as every GPU series (DESIGN.md): a label alone is an
        # index, which after a lost GPU names another card than nvidia-smi's (a review)
        uuid_of = {s.index: s.uuid for s in samples}
        for (gpu, metric), reason in sorted(a.backend.unsupported().items()):
            uns.add_metric([node, str(gpu), uuid_of.get(gpu, ""), metric, reason], 1.0)
        yield uns

    def _rank_series(self) -> Iterable:
        a, node = self.agent, self.agent.node
        ranks = a.ranks.snapshot()
        yield from progress_families(a, ranks)

        def labels(r) -> list[str]:
            return rank_labels(r, node)

        info = GaugeMetricFamily(PREFIX + "trainer_rank_info",
                                 "Rank identity and GPU binding; value is always 1.",
                                 labels=[*RANK_LABELS, "gpu", "pid", "world_size"])
        step = GaugeMetricFamily(PREFIX + "trainer_step", "Last step the rank reported.",
                                 labels=RANK_LABELS)
        steps = CounterMetricFamily(PREFIX + "trainer_steps", "Steps completed (this process).",
                                    labels=RANK_LABELS)
        restarts = CounterMetricFamily(PREFIX + "trainer_restarts",
                                       "Restarts of the rank's worker group (torchrun).",
                                       labels=RANK_LABELS)
        pace = GaugeMetricFamily(PREFIX + "trainer_step_interval_p99_seconds",
                                 "99th percentile of the times between the rank's last "
                                 f"completed steps (at most {STEP_INTERVALS_KEPT}), as the agent "
                                 "saw them: the step and what the loop does between steps "
                                 "(an evaluation). The steady hang threshold is based on it.",
                                 labels=RANK_LABELS)
        for r in ranks:
            lb = labels(r)
            info.add_metric([*lb, str(r.gpu), str(r.pid), str(r.world_size)], 1.0)
            if r.step >= 0:
                step.add_metric(lb, r.step)
            steps.add_metric(lb, r.steps_total)
            if r.restarts_known:  # a default 0 is no count (RankState.restarts_known)
                restarts.add_metric(lb, r.restarts)
            if (p99 := r.step_intervals.p99()) is not None:
                pace.add_metric(lb, round(p99, 3))
        yield from (info, step, steps, restarts, pace)
        for key, name, help_text, counter in RANK_SERIES:
            cls = CounterMetricFamily if counter else GaugeMetricFamily
            fam = cls(PREFIX + name, help_text, labels=RANK_LABELS)
            for r in ranks:
                if key in r.values and not (key in JUDGEMENT and r.phase == EXITED):
                    fam.add_metric(labels(r), r.values[key])
            yield fam


def rank_labels(r, node: str) -> list[str]:
    """A rank's RANK_LABELS values, for every rank family of both paths."""
    return [r.run, str(r.rank), node, str(r.local_rank)]


class ProgressCollector(Collector):
    """The ranks' progress alone (PROGRESS_FAMILIES), served on /metrics/progress."""

    def __init__(self, agent: Agent) -> None:
        self.agent = agent

    def collect(self) -> Iterator:
        yield from progress_families(self.agent, self.agent.ranks.snapshot())


def progress_families(agent: Agent, ranks: list) -> Iterator:
    """What hang detection reads, in one place for /metrics and /metrics/progress.

    Prometheus scrapes these every second on their own path and every other series at
    the scrape interval (5 s shipped): a hang is named within max(15 s, 3 x the p99
    step) only if its evidence is at most a second old (docs/detection.md, Hang
    latency), and scraping every GPU series that often would cost 5x the samples.
    """
    node = agent.node
    age = GaugeMetricFamily(PREFIX + "trainer_heartbeat_age_seconds",
                            "Seconds since the rank last completed a step.",
                            labels=RANK_LABELS)
    alive = GaugeMetricFamily(PREFIX + "trainer_process_alive",
                              "1 if the rank's process exists on this node.",
                              labels=RANK_LABELS)
    phase = GaugeMetricFamily(PREFIX + "trainer_phase",
                              "1 for what the rank is doing now (sync = waiting for peers).",
                              labels=[*RANK_LABELS, "phase"])
    blocked = GaugeMetricFamily(PREFIX + "trainer_blocked_collective",
                                "Sequence number of the collective the rank waits in, "
                                "by operation (absent when not blocked).",
                                labels=[*RANK_LABELS, "op"])
    entered = CounterMetricFamily(PREFIX + "trainer_collectives_entered",
                                  "Collectives the rank has entered (sequence number; the "
                                  "hang root entered fewer).", labels=RANK_LABELS)
    for r in ranks:
        lb = rank_labels(r, node)
        phase.add_metric([*lb, r.phase], 1.0)
        if r.collective and r.phase not in (EXITED, RESTARTING):
            blocked.add_metric([*lb, r.collective],
                               r.values.get("collectives_completed_total", 0.0) + 1)
        age.add_metric(lb, round(agent.ranks.age(r), 3))
        if r.sender.verified:  # a UDP sender's pid is unknown: no claim either way
            alive.add_metric(lb, 1.0 if still_running(r.sender) else 0.0)
        if "collectives_entered_total" in r.values:
            entered.add_metric(lb, r.values["collectives_entered_total"])
    yield from (age, alive, phase, blocked, entered)
    if agent.receiver is not None:
        # With the heartbeat ages, at their pace: JobStalled leaves out the ranks of a
        # node whose receiver lags (their ages grow whatever they do); read only every
        # 5 s, the lag came after every rank's age had passed a 5 s threshold (a review)
        lag = GaugeMetricFamily(
            PREFIX + "agent_telemetry_receive_lag_seconds",
            "Seconds since the telemetry receive loop last finished a round, computed "
            "at scrape time (<= 0.2 when healthy): while it grows every rank on the "
            "node goes silent, whatever the ranks do.", labels=["node"])
        lag.add_metric([node], round(agent.receiver.lag_seconds(), 3))
        yield lag
