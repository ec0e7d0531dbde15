"""deploy/testbed/machine.py: the booted systemd is a machine of its own and leaves the
host as it found it (one bare boot for the module; the units' tests are in
test_systemd_boot.py)."""

from __future__ import annotations

import os
import socket
import subprocess
from pathlib import Path

import pytest

from deploy.testbed.machine import SystemdMachine, unavailable
from deploy.testbed.net import proc_start_time, process_alive

pytestmark = pytest.mark.integration
REPO = Path(__file__).resolve().parents[2]
HOSTNAME = "cp-bare-machine"


def mounted_by(path: Path) -> list[str]:
    """The host's mounts (this process's mount table) that involve `path`."""
    return [line for line in Path("/proc/self/mountinfo").read_text().splitlines()
            if str(path) in line]


def cgroup_exists(name: str) -> bool:
    """Whether the host's cgroup v2 tree holds `name` under this process's cgroup
    (read through a private mount: the host may have none mounted)."""
    own = next(line[3:] for line in Path("/proc/self/cgroup").read_text().splitlines()
               if line.startswith("0::"))
    out = subprocess.run(["unshare", "--mount", "--propagation", "private", "sh", "-euc",
                          'd=$(mktemp -d); mount -t cgroup2 cgroup2 "$d"; '
                          'test -d "$d$0/$1" && echo yes || echo no; umount "$d"; rmdir "$d"',
                          own.rstrip("/"), name],
                         capture_output=True, text=True, check=True, timeout=30)
    return out.stdout.strip() == "yes"


def machine_processes(pid1: int) -> list[tuple[int, int]]:
    """(pid, start time) of every process in the PID namespace of `pid1`."""
    ns = os.readlink(f"/proc/{pid1}/ns/pid")
    out = []
    for proc in Path("/proc").iterdir():
        try:
            if proc.name.isdigit() and os.readlink(proc / "ns/pid") == ns:
                out.append((int(proc.name), proc_start_time((proc / "stat").read_text())))
        except OSError:
            continue
    return out


@pytest.fixture(scope="module")
def booted(tmp_path_factory):
    reason = unavailable()
    if reason:
        pytest.skip(reason)
    hostname = socket.gethostname()
    m = SystemdMachine(tmp_path_factory.mktemp("bare-machine"), hostname=HOSTNAME)
    try:
        state = m.boot()
        yield m, state, hostname
    finally:
        m.close()


def test_systemd_is_pid_1_of_a_container_that_booted(booted):
    m, state, _ = booted
    assert state == "running", m.run(["systemctl", "--failed", "--no-legend"]).stdout
    assert m.run(["cat", "/proc/1/comm"]).stdout.strip() == "systemd"
    assert m.run(["systemd-detect-virt", "--container"]).stdout.strip() == "container-other"
    assert m.run(["hostname"]).stdout.strip() == HOSTNAME
    # its own cgroup tree: PID 1 in init.scope of the machine's cgroup namespace
    assert m.run(["cat", "/proc/1/cgroup"]).stdout.strip().endswith("0::/init.scope")


def test_the_host_is_out_of_reach(booted):
    m, _, hostname = booted
    assert socket.gethostname() == hostname  # UTS namespace
    assert mounted_by(m.workdir) == []  # every mount is in the machine's namespaces
    # its network is its own loopback
    devices = m.run(["cat", "/proc/net/dev"]).stdout.splitlines()[2:]
    assert [d.split(":")[0].strip() for d in devices] == ["lo"]
    # none of the host's tree but the read-only binds: not this checkout, not its root
    assert m.run(["test", "-e", str(REPO / "pyproject.toml")]).returncode == 1
    assert m.run(["test", "-e", str(m.root)]).returncode == 1
    options = {fields[4]: fields[5].split(",") for fields in
               (line.split() for line in m.run(["cat", "/proc/1/mountinfo"]).stdout
                .splitlines())}
    for path in ("/usr", "/proc/sys", "/sys"):  # the host's, or its kernel's settings
        assert "ro" in options[path], (path, options[path])
    # no loading kernel modules, no setting the clock (bits 16 and 25 of CapBnd)
    status = m.run(["cat", "/proc/1/status"]).stdout
    bounding = int(next(ln.split()[1] for ln in status.splitlines() if ln.startswith("CapBnd")),
                   16)
    assert bounding & (1 << 16) == 0 and bounding & (1 << 25) == 0


def test_close_ends_every_process_and_removes_the_cgroup(booted):
    """Last in the module: it ends the module's machine."""
    m, _, _ = booted
    assert m.run(["systemd-run", "--unit=cp-sleeper", "sleep", "600"]).returncode == 0
    assert cgroup_exists(m.name)
    processes = machine_processes(m.pid)
    assert len(processes) > 3  # systemd, journald, the sleeper, ...
    m.close()
    assert [p for p, start in processes if process_alive(p, start)] == []
    assert not cgroup_exists(m.name)
