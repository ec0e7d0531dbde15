"""Who uses each GPU (issue #25 item 4): every process on a GPU, instrumented or not,
with its user from the kernel and its Slurm job from its cgroup.

The driver's process list comes from the fake pynvml (no GPU here); the processes,
/proc and the uid are real, except where a Slurm cgroup path is needed outside Slurm
(the real testbed checks that: tests/cluster/test_slurm.py)."""

from __future__ import annotations

import os
import pwd
import re
import subprocess
import sys

import pytest
from prometheus_client import CollectorRegistry, generate_latest
from prometheus_client.parser import text_string_to_metric_families

from clusterpulse.agent.attribution import GpuAttribution, slurm_job
from clusterpulse.agent.audit import AuditLog
from clusterpulse.agent.backends.nvml import NvmlBackend
from clusterpulse.agent.backends.sim import SimBackend
from clusterpulse.agent.cli import main, rank_processes
from clusterpulse.agent.core import Agent
from clusterpulse.agent.exporter import AgentCollector
from clusterpulse.agent.identity import Sender, start_time
from clusterpulse.agent.ranks import RankRegistry
from tests.fakes.fake_pynvml import FakeNvml
from tests.support.procs import REPO
from tests.support.promtool import exprs_pass

# /proc/PID/cgroup of a task in a job step, as slurmstepd leaves it.
CGROUP_V1 = """\
12:pids:/slurm/uid_1000/job_4242/step_0/task_0
11:freezer:/slurm/uid_1000/job_4242/step_0/task_0
4:memory:/slurm/uid_1000/job_4242/step_0/task_0
1:name=systemd:/system.slice/slurmd.service
0::/system.slice/slurmd.service
"""
CGROUP_V1_NODE = "6:freezer:/slurm_node3/uid_0/job_17/step_batch/task_0\n"  # multi-slurmd
CGROUP_V2 = "0::/system.slice/slurmstepd.scope/job_987654/step_3/user/task_0\n"
CGROUP_V2_EXTERN = "0::/system.slice/slurmstepd.scope/job_55/step_extern/user/task_special\n"
CGROUP_NOTEBOOK = "0::/user.slice/user-1000.slice/session-4.scope\n"
CGROUP_POD = ("0::/kubepods.slice/kubepods-pod0f1e.slice/"
              "cri-containerd-job_12ab.scope\n")  # a container id is not a job


@pytest.mark.parametrize(("text", "job"), [
    (CGROUP_V1, "4242"), (CGROUP_V1_NODE, "17"), (CGROUP_V2, "987654"),
    (CGROUP_V2_EXTERN, "55"), (CGROUP_NOTEBOOK, ""), (CGROUP_POD, ""), ("", ""),
])
def test_slurm_job_from_real_cgroup_path_formats(text, job):
    assert slurm_job(text) == job


def _families(agent: Agent) -> dict:
    reg = CollectorRegistry(auto_describe=False)
    reg.register(AgentCollector(agent))
    return {f.name: f for f in text_string_to_metric_families(generate_latest(reg).decode())}


@pytest.fixture
def notebook():
    """An uninstrumented process: it never sends telemetry."""
    p = subprocess.Popen([sys.executable, "-c", "import time; time.sleep(60)"])
    yield p
    p.kill()
    p.wait()


def test_nvml_lists_compute_and_graphics_processes():
    fake = FakeNvml(gpus=2)
    fake.gpus[0].compute_pids = [300, 100]
    fake.gpus[0].graphics_pids = [100, 200]
    s = NvmlBackend(nvml=fake).collect()
    assert s[0].processes == (100, 200, 300) and s[1].processes == ()


def test_unsupported_process_listing_is_asked_once():
    fake = FakeNvml(gpus=1)
    fake.gpus[0].unsupported_fns = {"nvmlDeviceGetGraphicsRunningProcesses"}
    fake.gpus[0].compute_pids = [7]
    backend = NvmlBackend(nvml=fake)
    backend.collect()
    s = backend.collect()
    assert s[0].processes == (7,)
    assert fake.calls["nvmlDeviceGetGraphicsRunningProcesses"] == 1
    assert (0, "graphics_processes") in backend.unsupported()


def test_every_process_on_a_gpu_is_exported_with_its_kernel_uid(notebook):
    fake = FakeNvml(gpus=2)
    fake.gpus[1].compute_pids = [notebook.pid]
    agent = Agent(NvmlBackend(nvml=fake), "n1", RankRegistry(), AuditLog(None))
    agent.links.append(GpuAttribution(lambda: agent.snapshot.gpus))
    agent.collect_once()
    (s,) = _families(agent)["clusterpulse_gpu_process_info"].samples
    uid = os.getuid()
    assert s.name == "clusterpulse_gpu_process_info" and s.value == 1.0
    assert s.labels == {"node": "n1", "gpu": "1", "uuid": "GPU-fake-1", "pid": str(notebook.pid),
                        "uid": str(uid), "user": pwd.getpwuid(uid).pw_name, "slurm_job": ""}
    # Identity stays on the info series: the GPU's own series keep node/gpu/uuid.
    util = _families(agent)["clusterpulse_gpu_utilization_ratio"].samples
    assert all(set(x.labels) == {"node", "gpu", "uuid"} for x in util)


def test_slurm_job_and_user_come_from_the_process_files(tmp_path):
    proc = tmp_path / "proc"
    (proc / "4321").mkdir(parents=True)
    (proc / "4321" / "cgroup").write_text(CGROUP_V2)
    (proc / "4321" / "status").write_text("Name:\tpython\nUid:\t0\t0\t0\t0\nGid:\t0\t0\t0\t0\n")
    fake = FakeNvml(gpus=1)
    fake.gpus[0].compute_pids = [4321, 999_999_999]  # the second: gone, or not visible
    agent = Agent(NvmlBackend(nvml=fake), "n1", RankRegistry(), AuditLog(None))
    agent.links.append(GpuAttribution(lambda: agent.snapshot.gpus, proc=proc))
    agent.collect_once()
    by_pid = {s.labels["pid"]: s.labels for s in
              _families(agent)["clusterpulse_gpu_process_info"].samples}
    assert by_pid["4321"]["slurm_job"] == "987654"
    assert by_pid["4321"]["uid"] == "0" and by_pid["4321"]["user"] == "root"
    assert by_pid["999999999"]["uid"] == "" and by_pid["999999999"]["slurm_job"] == ""


def test_simulated_gpu_lists_the_live_rank_processes_bound_to_it(notebook):
    """The sim backend's processes are the ranks the kernel named, while they live."""
    ranks = RankRegistry()
    sender = Sender(pid=notebook.pid, uid=os.getuid(), start_time=start_time(notebook.pid),
                    verified=True)
    ranks.update({"v": 1, "type": "step", "run": "r1", "rank": 0, "local_rank": 0, "gpu": 1,
                  "step": 1}, None, sender)
    backend = SimBackend(gpus=2, node="s", processes=lambda g: rank_processes(ranks, g))
    s = backend.collect()
    assert s[0].processes == () and s[1].processes == (notebook.pid,)
    notebook.kill()
    notebook.wait()
    assert backend.collect()[1].processes == ()


def test_pod_resources_flag_refuses_a_non_unix_target(capsys):
    assert main(["--backend", "sim", "--pod-resources", "localhost:10250"]) == 2
    err = capsys.readouterr().err.strip()
    assert err.startswith("clusterpulse-agent: error: --pod-resources: must be unix:///PATH")
    assert "\n" not in err



def doc_queries() -> dict[str, str]:
    """docs/agent.md's PromQL joins, by their comment line."""
    text = (REPO / "docs" / "agent.md").read_text()
    block = re.search(r"### Who uses each GPU.*?```promql\n(.*?)```", text, re.S)
    assert block, "docs/agent.md lost its PromQL examples"
    return {c.partition("\n")[0].lstrip("# "): c.partition("\n")[2]
            for c in block.group(1).strip().split("\n\n")}


def test_documented_joins_give_what_they_say_on_the_agents_series(tmp_path):
    """The PromQL in docs/agent.md, evaluated by promtool on series this agent
    exported: a rank in a Slurm job on GPU 1, a notebook on GPU 0 held by a pod."""
    proc = tmp_path / "proc"
    for pid, cgroup in ((4321, CGROUP_V2), (4322, CGROUP_NOTEBOOK)):
        (proc / str(pid)).mkdir(parents=True)
        (proc / str(pid) / "cgroup").write_text(cgroup)
        (proc / str(pid) / "status").write_text("Uid:\t0\t0\t0\t0\n")
    fake = FakeNvml(gpus=2)
    fake.gpus[0].compute_pids, fake.gpus[1].compute_pids = [4322], [4321]
    ranks = RankRegistry(alive=lambda s: True)
    ranks.update({"v": 1, "type": "step", "run": "r1", "rank": 0, "local_rank": 1, "gpu": 1,
                  "step": 1}, None, Sender(pid=4321, uid=0, start_time=1, verified=True))
    agent = Agent(NvmlBackend(nvml=fake), "n1", ranks, AuditLog(None))
    agent.links.append(GpuAttribution(lambda: agent.snapshot.gpus, proc=proc))
    agent.collect_once()
    wanted = ("clusterpulse_gpu_utilization_ratio", "clusterpulse_gpu_process_info",
              "clusterpulse_trainer_rank_info")
    series = [{"series": s.name + "{" + ",".join(f'{k}="{v}"' for k, v in s.labels.items())
               + "}", "values": f"{s.value}x3"}
              for f in _families(agent).values() for s in f.samples if s.name in wanted]
    series.append({"series": 'clusterpulse_gpu_owner_info{node="n1",gpu="0",uuid="GPU-fake-0",'
                             'pod="nb",namespace="research",container="jupyter",'
                             'device_id="GPU-fake-0"}', "values": "1x3"})
    q = doc_queries()
    expect = {
        "GPU utilization by pod": [{"labels": '{node="n1",gpu="0",uuid="GPU-fake-0",pod="nb",'
                                              'namespace="research"}', "value": 0.5}],
        "GPUs in use by each Slurm job and user": [
            {"labels": '{slurm_job="987654",user="root"}', "value": 1}],
        "GPUs busy with a process that is no rank of a training run (a notebook, a stray job)":
            [{"labels": '{node="n1",gpu="0",pid="4322",user="root"}', "value": 1}],
    }
    assert set(q) == set(expect), set(q)
    exprs_pass(tmp_path, "15s", series, [{"expr": q[k], "eval_time": "30s", "exp_samples": v}
                                         for k, v in expect.items()])


def test_proc_flag_refuses_a_directory_that_is_no_procfs(tmp_path, capsys):
    assert main(["--backend", "sim", "--proc", str(tmp_path)]) == 2
    err = capsys.readouterr().err.strip()
    assert err == f"clusterpulse-agent: error: --proc {tmp_path} is not a procfs (no " \
                  f"{tmp_path}/self)"
