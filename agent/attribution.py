"""Who is using each GPU: one info series per process on a GPU, one per pod holding it.

A GPU burning in an uninstrumented notebook or a stray job must be as visible as a
rank that reports telemetry. The driver lists every process with a context on a GPU
(the backend's `processes`); the kernel says who runs it: the real uid from
/proc/PID/status and, under Slurm, the job from the process's cgroup (slurmstepd puts
every task in .../job_<id>/step_<n>/...). On Kubernetes the kubelet says which pod the
device plugin gave the GPU to (agent.podresources). Nothing comes from a payload.

Identity goes on these *_info series only, never on the GPU's metric series, so that a
job's start or end does not churn every series of the GPU; dashboards join on
(node, gpu):  clusterpulse_gpu_utilization_ratio
                * on (node, gpu) group_left (pod, namespace) clusterpulse_gpu_owner_info
"""

from __future__ import annotations

import pwd
import re
import time
from collections.abc import Callable, Iterator
from functools import lru_cache
from pathlib import Path

from prometheus_client.core import CounterMetricFamily, GaugeMetricFamily

from clusterpulse.agent.identity import real_uid
from clusterpulse.agent.podresources import PodResources
from clusterpulse.agent.sample import GpuSample

PREFIX = "clusterpulse_"
GPU_LABELS = ["node", "gpu", "uuid"]
# Slurm's cgroup layouts: v1 "/slurm/uid_1000/job_123/step_0/task_0" (a per-node
# "slurm_<node>" with several slurmd on a host), v2
# "/system.slice/slurmstepd.scope/job_123/step_batch/user/task_0".
_SLURM_JOB = re.compile(r"/job_(\d+)(?:/|$)")


def slurm_job(cgroup_text: str) -> str:
    """The Slurm job id in a /proc/PID/cgroup's lines, or "" outside any job."""
    for line in cgroup_text.splitlines():
        path = line.split(":", 2)[-1]
        m = _SLURM_JOB.search(path)
        if m:
            return m.group(1)
    return ""


@lru_cache(maxsize=256)
def user_name(uid: int) -> str:
    """The account name of a uid, "" where this host (or container) has none for it."""
    try:
        return pwd.getpwuid(uid).pw_name
    except KeyError:
        return ""


def read_cgroup(pid: int, proc: Path) -> str:
    try:
        return (proc / str(pid) / "cgroup").read_text(errors="replace")
    except OSError:  # gone, or another pid namespace
        return ""


class GpuAttribution:
    """Collector of clusterpulse_gpu_process_info and clusterpulse_gpu_owner_info.

    `gpus` returns the last collection's samples: the series follow what the driver
    said then. /proc is read at scrape time (a few small files per process; the
    server caches a scrape per collection cycle)."""

    def __init__(self, gpus: Callable[[], list[GpuSample]], proc: Path = Path("/proc"),
                 pods: PodResources | None = None) -> None:
        self.gpus = gpus
        self.proc = proc
        self.pods = pods

    def families(self, node: str) -> Iterator:
        samples = self.gpus()
        yield self._processes(node, samples)
        if self.pods is not None:
            yield from self._owners(node, samples)

    def _processes(self, node: str, samples: list[GpuSample]) -> GaugeMetricFamily:
        fam = GaugeMetricFamily(
            PREFIX + "gpu_process_info",
            "A process with a context on the GPU, instrumented or not; value is always 1. "
            "uid from the kernel, slurm_job from the process's cgroup (empty outside Slurm, "
            "uid empty when the agent cannot see the process).",
            labels=[*GPU_LABELS, "pid", "uid", "user", "slurm_job"])
        for s in samples:
            for pid in s.processes:
                uid = real_uid(pid, str(self.proc))
                fam.add_metric(
                    [node, str(s.index), s.uuid, str(pid),
                     "" if uid is None else str(uid), "" if uid is None else user_name(uid),
                     slurm_job(read_cgroup(pid, self.proc))], 1.0)
        return fam

    def _owners(self, node: str, samples: list[GpuSample]) -> Iterator:
        assert self.pods is not None
        owners = self.pods.owners()
        fam = GaugeMetricFamily(
            PREFIX + "gpu_owner_info",
            "The pod and container the kubelet assigned the GPU to (PodResources API); "
            "value is always 1. device_id as the device plugin named it (a MIG device "
            "names its own).", labels=[*GPU_LABELS, "pod", "namespace", "container",
                                       "device_id"])
        for s in samples:
            for key in (s.uuid, str(s.index)):  # UUIDs, or the plugin's index strategy
                for o in owners.get(key, ()):
                    fam.add_metric([node, str(s.index), s.uuid, o.pod, o.namespace,
                                    o.container, o.device_id], 1.0)
        yield fam
        age = GaugeMetricFamily(
            PREFIX + "agent_pod_resources_age_seconds",
            "Seconds since the kubelet last answered the PodResources List (the owner "
            "series show that answer); -1 before the first answer.", labels=["node"])
        last = self.pods.last_success
        age.add_metric([node], round(time.time() - last, 3) if last else -1.0)
        yield age
        err = CounterMetricFamily(
            PREFIX + "agent_pod_resources_errors",
            "Failed PodResources List calls by gRPC status (unavailable: no kubelet "
            "socket; deadline_exceeded: the kubelet did not answer in time).",
            labels=["node", "kind"])
        for kind, n in sorted(dict(self.pods.errors).items()):  # a copy: it may grow now
            err.add_metric([node, kind], n)
        yield err
