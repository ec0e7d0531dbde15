"""deploy/systemd: units that verify, rate <= 4.0 in `systemd-analyze security`, create
their user and directories, and pass flags the CLIs accept."""

from __future__ import annotations

import fnmatch
import re
import shlex
import shutil
import subprocess
import sys
from pathlib import Path

import pytest

REPO = Path(__file__).resolve().parents[2]
UNITS = REPO / "deploy" / "systemd"
SERVICES = sorted(UNITS.glob("*.service"))
INSTALLED_BIN = "/opt/clusterpulse/.venv/bin"
# The units of ClusterPulse's programs (the Prometheus host's egress filter is a script
# that runs once as root: tests/deploy/test_egress.py, test_systemd_boot.py)
DAEMONS = [u for u in SERVICES if f"ExecStart={INSTALLED_BIN}/" in u.read_text()]
ANALYZE = shutil.which("systemd-analyze")
needs_systemd = pytest.mark.skipif(
    ANALYZE is None, reason="systemd-analyze is missing (scripts/setup.sh installs systemd)")


def _exec_start(unit: Path) -> str:
    text = unit.read_text().replace("\\\n", " ")
    return re.search(r"^ExecStart=(.*)$", text, re.M).group(1)


@needs_systemd
def test_units_verify_cleanly(tmp_path: Path):
    """`systemd-analyze verify` only warns on unknown keys or bad values: any output fails."""
    venv_bin = str(Path(sys.executable).parent)
    for unit in SERVICES:
        # The units name the documented install path; point them at this checkout's venv
        # so that verify can check the executables exist.
        # (the egress script: this checkout's copy for the documented /usr/local/sbin)
        (tmp_path / unit.name).write_text(unit.read_text().replace(INSTALLED_BIN, venv_bin)
                                          .replace("/usr/local/sbin", str(UNITS)))
    out = subprocess.run([ANALYZE, "verify", "--man=no", "--generators=no",
                          *map(str, sorted(tmp_path.glob("*.service")))],
                         capture_output=True, text=True, timeout=120)
    assert out.returncode == 0 and out.stderr.strip() == "" and out.stdout.strip() == "", \
        out.stdout + out.stderr


@needs_systemd
@pytest.mark.parametrize("unit", SERVICES, ids=lambda p: p.name)
def test_security_exposure_at_most_4(unit: Path):
    out = subprocess.run([ANALYZE, "security", "--offline=yes", "--threshold=40", str(unit)],
                         capture_output=True, text=True, timeout=120)
    level = re.search(r"Overall exposure level for \S+: (\d+\.\d)", out.stdout)
    assert level, out.stdout + out.stderr
    assert float(level.group(1)) <= 4.0 and out.returncode == 0, out.stdout[-2000:]


@needs_systemd
@pytest.mark.parametrize("name", ["clusterpulse-dashboard.service",
                                  "clusterpulse-remediate.service"])
def test_units_that_serve_http_can_ask_the_kernel_who_connects(name: str):
    """Found in the fifth review of issue #29: PrivateUsers=yes made every other local
    user read as 65534, and with no AF_NETLINK the sock_diag lookup could not run: all
    local clients were one, for the per-user caps and the sign-in throttle."""
    text = (UNITS / name).read_text()
    settings = dict(line.split("=", 1) for line in text.splitlines()
                    if "=" in line and not line.startswith("#"))
    assert settings.get("PrivateUsers", "no") == "no"
    assert "AF_NETLINK" in settings["RestrictAddressFamilies"].split()


def test_sysusers_and_tmpfiles_create_user_and_config_dir(tmp_path: Path):
    (tmp_path / "usr/lib/sysusers.d").mkdir(parents=True)
    (tmp_path / "usr/lib/tmpfiles.d").mkdir(parents=True)
    (tmp_path / "etc").mkdir()
    shutil.copy(UNITS / "clusterpulse.sysusers.conf",
                tmp_path / "usr/lib/sysusers.d/clusterpulse.conf")
    shutil.copy(UNITS / "clusterpulse.tmpfiles.conf",
                tmp_path / "usr/lib/tmpfiles.d/clusterpulse.conf")
    subprocess.run(["systemd-sysusers", f"--root={tmp_path}"], check=True,
                   capture_output=True, timeout=60)
    group = next(line for line in (tmp_path / "etc/group").read_text().splitlines()
                 if line.startswith("clusterpulse:"))
    subprocess.run(["systemd-tmpfiles", f"--root={tmp_path}", "--create"], check=True,
                   capture_output=True, timeout=60)
    conf = (tmp_path / "etc/clusterpulse").stat()
    assert conf.st_gid == int(group.split(":")[2]) and conf.st_mode & 0o777 == 0o750


def test_units_take_the_token_as_a_credential_and_log_where_systemd_creates():
    for unit in DAEMONS:
        text = unit.read_text()
        # The token stays root:root 0600; systemd hands the service user its own copy.
        assert "LoadCredential=token:/etc/clusterpulse/token" in text, unit.name
        assert "--token-file %d/token" in _exec_start(unit), unit.name
        assert "LogsDirectory=clusterpulse" in text and "ReadWritePaths" not in text
        assert f"EnvironmentFile=-/etc/default/{unit.stem}" in text
        assert (UNITS / f"{unit.stem}.default").is_file()
    agent = (UNITS / "clusterpulse-agent.service").read_text()
    assert "AmbientCapabilities=CAP_KILL" in agent and "CapabilityBoundingSet=CAP_KILL" in agent
    # the node's agent sees every GPU: one lost before a restart stays down (docs/agent.md)
    assert "--state-dir /var/lib/clusterpulse --remember-gpus" in _exec_start(
        UNITS / "clusterpulse-agent.service")


@pytest.mark.parametrize("unit", DAEMONS, ids=lambda p: p.name)
def test_flags_in_unit_and_default_file_exist_in_the_cli(unit: Path):
    """A renamed flag would put the unit in a restart loop: every flag must be one the
    program's --help lists."""
    default = (UNITS / f"{unit.stem}.default").read_text()
    args = shlex.split(re.search(r'^ARGS="(.*)"$', default, re.M).group(1))
    cmd = _exec_start(unit).split()
    program = Path(cmd[0]).name
    flags = {a.split("=")[0] for a in [*cmd[1:], *args] if a.startswith("--")}
    exe = Path(sys.executable).parent / program
    out = subprocess.run([str(exe), "--help"], capture_output=True, text=True, timeout=120)
    assert out.returncode == 0, out.stderr
    missing = sorted(f for f in flags if f not in out.stdout)
    assert not missing, f"{program} does not know {missing}"


# /proc/devices of GPU nodes (character devices; the block section is irrelevant here).
# Open and closed kernel modules share the kernel interface layer that registers these
# names (nv.c: "nvidia" for minors 0..N, "nvidiactl" for 255; nvidia-uvm and
# nvidia-caps take dynamic majors). Older drivers named major 195 "nvidia-frontend".
_COMMON = "  1 mem\n  4 /dev/vc/0\n  4 tty\n  5 /dev/tty\n  5 /dev/ptmx\n 10 misc\n 13 input\n"
PROC_DEVICES = {
    # captured on an H200 node, driver 580.159.04, open kernel module
    "R580 open (H200)": _COMMON + "195 nvidia\n195 nvidiactl\n238 nvidia-uvm\n"
                        "239 nvidia-nvswitch\n240 nvidia-nvlink\n241 nvidia-caps\n"
                        "242 nvidia-caps-imex-channels\n",
    "R550 open": _COMMON + "195 nvidia\n195 nvidiactl\n226 drm\n508 nvidia-caps-imex-channels\n"
                 "509 nvidia-uvm\n511 nvidia-caps\n",
    "R535 closed": _COMMON + "195 nvidia\n195 nvidiactl\n226 drm\n236 nvidia-nvswitch\n"
                   "237 nvidia-nvlink\n510 nvidia-uvm\n511 nvidia-caps\n",
    "R470 closed": _COMMON + "195 nvidia-frontend\n226 drm\n238 nvidia-uvm\n239 nvidia-caps\n",
}


def _allowed_majors(unit_text: str, proc_devices: str) -> set[int]:
    """The character majors a unit's DeviceAllow=char-GROUP lines resolve to, as
    systemd resolves them at start (systemd.resource-control(5)): GROUP is matched
    against /proc/devices' names with shell globbing; unresolvable groups are dropped."""
    groups = re.findall(r"^DeviceAllow=char-(\S+)\s+\S*r\S*w", unit_text, re.M)
    majors = set()
    for line in proc_devices.splitlines():
        major, _, name = line.strip().partition(" ")
        if any(fnmatch.fnmatchcase(name, g) for g in groups):
            majors.add(int(major))
    return majors


@pytest.mark.parametrize("driver", sorted(PROC_DEVICES))
def test_agent_unit_allows_the_gpu_devices_of_every_driver(driver: str):
    proc = PROC_DEVICES[driver]
    unit = (UNITS / "clusterpulse-agent.service").read_text()
    assert re.search(r"^DevicePolicy=closed$", unit, re.M)
    majors = _allowed_majors(unit, proc)
    names = {ln.split()[1]: int(ln.split()[0]) for ln in proc.splitlines()}
    # /dev/nvidia0..N and /dev/nvidiactl (195), MIG's /dev/nvidia-caps/*, UVM
    needed = {195, names["nvidia-caps"], names["nvidia-uvm"]}
    assert needed <= majors, f"{driver}: majors {sorted(needed - majors)} would be denied"
    # and nothing beyond the driver's own groups (no NVSwitch, NVLink, DRM, IMEX)
    assert majors <= {n for name, n in names.items() if name in (
        "nvidia", "nvidiactl", "nvidia-frontend", "nvidia-caps", "nvidia-uvm")}
