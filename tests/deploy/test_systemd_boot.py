"""deploy/systemd under a real systemd: one machine booted for the module
(deploy/testbed/machine.py: systemd 252 as PID 1 of its own namespaces, what
`systemd-nspawn -b` does), the units installed by running docs/deploy.md's systemd
commands as written, the token as the documented credential, and the venv at the
documented /opt/clusterpulse/.venv (this checkout and its venv's packages, read-only).

The machine has no NVIDIA driver: the shipped flags (`--backend nvml`) must fail with a
line in the journal that says so and what to do, and the agent then runs with the
documented stand-in, `--backend sim` in /etc/default/clusterpulse-agent. /dev/nvidia0
and /dev/nvidiactl exist in the machine as stand-in nodes with the driver's major
number (195), so the unit's DevicePolicy= is checked against them."""

from __future__ import annotations

import base64
import json
import re
import subprocess
import sys
import urllib.parse
from dataclasses import dataclass
from pathlib import Path

import pytest
from prometheus_client.parser import text_string_to_metric_families

from deploy.testbed.machine import (
    DeviceNode,
    MachineError,
    MachineUnavailable,
    SystemdMachine,
    stage_venv,
    unavailable,
)

pytestmark = pytest.mark.integration
REPO = Path(__file__).resolve().parents[2]
VENV = Path(sys.prefix)
HOSTNAME = "cp-systemd-node"
BIN = "/opt/clusterpulse/.venv/bin"
CONFIG_DIR = "/root/clusterpulse"  # where `clusterpulse-config write` puts the files
AGENT = "clusterpulse-agent.service"
DASHBOARD = "clusterpulse-dashboard.service"
REMEDIATE = "clusterpulse-remediate.service"
OPERATOR_PASSWORD = "correct-horse-battery-staple"
GPU_STAND_INS = [DeviceNode("/dev/nvidia0", 195, 0), DeviceNode("/dev/nvidiactl", 195, 255)]
# GET or POST (with a body) from inside the machine; prints the status, then the body.
HTTP = """
import sys, urllib.error, urllib.request
url, token, body = sys.argv[1:4]
req = urllib.request.Request(url, data=body.encode() or None)
if token:
    req.add_header("Authorization", token if token.startswith("Basic ") else "Bearer " + token)
try:
    with urllib.request.urlopen(req, timeout=10) as r:
        print(r.status); print(r.read().decode())
except urllib.error.HTTPError as e:
    print(e.code); print(e.read().decode())
"""


def docs_commands(heading: str, doc: str = "deploy.md") -> list[str]:
    """The ```bash blocks of a section of docs/deploy.md (or another page), to run as
    written."""
    section = (REPO / "docs" / doc).read_text().split(f"\n{heading}\n", 1)[1]
    return re.findall(r"```bash\n(.*?)```", section.split("\n## ", 1)[0], re.S)


def nvidia_driver_loaded() -> bool:
    """Whether this kernel has the NVIDIA driver (it registers major 195)."""
    return any(line.split()[-1:] in (["nvidia"], ["nvidia-frontend"])
               for line in Path("/proc/devices").read_text().splitlines())


@pytest.fixture(scope="module")
def machine(tmp_path_factory):
    reason = unavailable()
    if reason:
        pytest.skip(reason)
    m = SystemdMachine(tmp_path_factory.mktemp("systemd-machine"), hostname=HOSTNAME,
                       devices=GPU_STAND_INS)
    try:
        stage_venv(m, VENV, REPO)
    except MachineUnavailable as err:
        pytest.skip(str(err))
    try:
        m.boot()
        yield m
    finally:
        m.close()


@dataclass
class Installed:
    failure_journal: str | None  # the agent's journal under the shipped flags (no driver)
    uid: int
    gid: int
    token: str


def http(machine: SystemdMachine, url: str, token: str = "", body: str = "") -> tuple[int, str]:
    out = machine.run([f"{BIN}/python", "-c", HTTP, url, token, body], check=True).stdout
    status, _, text = out.partition("\n")
    return int(status), text


def agent_healthy(machine: SystemdMachine) -> bool:
    try:
        return http(machine, "http://127.0.0.1:9477/healthz")[0] == 200
    except Exception:
        return False


@pytest.fixture(scope="module")
def installed(machine: SystemdMachine) -> Installed:
    """The agent installed as docs/deploy.md says, then started with the stand-in."""
    machine.run([f"{BIN}/clusterpulse-config", "write", "--only", "systemd", CONFIG_DIR],
                check=True)
    machine.sh(f"cd {CONFIG_DIR}/systemd\n" + docs_commands("## systemd")[0])
    failure = None
    if not nvidia_driver_loaded():
        def failed() -> str | None:
            text = machine.journal(AGENT)
            return text if ("status=2/INVALIDARGUMENT" in text
                            and "clusterpulse-agent: error:" in text) else None
        failure = machine.wait_for(failed, 60, "the agent's failure under the shipped flags",
                                   AGENT)
    # The documented stand-in for a machine without GPUs: simulated GPUs.
    machine.sh("sed -i 's/--backend nvml/--backend sim/' /etc/default/clusterpulse-agent\n"
               f"systemctl reset-failed {AGENT} || true\nsystemctl restart {AGENT}")
    machine.wait_for(lambda: agent_healthy(machine), 60, "the agent's /healthz", AGENT)
    user = machine.run(["getent", "passwd", "clusterpulse"], check=True).stdout.split(":")
    token = machine.run(["cat", "/etc/clusterpulse/token"], check=True).stdout.strip()
    return Installed(failure, int(user[2]), int(user[3]), token)


def proc_status(machine: SystemdMachine, unit: str) -> dict[str, str]:
    """/proc/PID/status of a unit's main process, as the machine sees it."""
    pid = machine.show(unit, "MainPID")["MainPID"]
    text = machine.run(["cat", f"/proc/{pid}/status"], check=True).stdout
    return {k: v.strip() for k, v in (line.split(":", 1) for line in text.splitlines())}


def as_service(machine: SystemdMachine, unit: str, installed: Installed,
               args: list[str]) -> subprocess.CompletedProcess[str]:
    """Run `args` as the unit's user, in its cgroup and its mount namespace (what it
    sees of the file system, /proc and /dev; its seccomp filter and capabilities are
    not carried over, so what fails here fails for the service too)."""
    props = machine.show(unit, "MainPID", "ControlGroup")
    return machine.run(["sh", "-euc", 'echo $$ > "/sys/fs/cgroup$0/cgroup.procs"; exec "$@"',
                        props["ControlGroup"], "nsenter", f"--target={props['MainPID']}",
                        "--mount", "--root", f"--setuid={installed.uid}",
                        f"--setgid={installed.gid}", "--", *args], check=True)


def test_shipped_flags_without_a_gpu_driver_fail_with_a_clear_journal_line(
        installed: Installed):
    if installed.failure_journal is None:
        pytest.skip("this kernel has the NVIDIA driver: the shipped --backend nvml can start")
    journal = installed.failure_journal
    # the agent says what is wrong and what to run instead; systemd says how it ended
    assert re.search(r"clusterpulse-agent: error: NVML could not start \(.*\)\. Is the "
                     r"NVIDIA driver installed.*--backend sim", journal), journal
    assert f"{AGENT}: Main process exited, code=exited, status=2/INVALIDARGUMENT" \
        in journal, journal


def test_agent_unit_is_enabled_active_and_runs_as_its_user(machine: SystemdMachine,
                                                           installed: Installed):
    assert machine.run(["systemctl", "is-enabled", AGENT]).stdout.strip() == "enabled"
    assert machine.run(["systemctl", "is-active", AGENT]).stdout.strip() == "active"
    props = machine.show(AGENT, "User", "Group", "SubState")
    assert (props["User"], props["Group"], props["SubState"]) == (
        "clusterpulse", "clusterpulse", "running"), props
    status = proc_status(machine, AGENT)
    # real, effective, saved and filesystem ids are all the sysusers.d user's
    assert status["Uid"].split() == [str(installed.uid)] * 4, status["Uid"]
    assert status["Gid"].split() == [str(installed.gid)] * 4, status["Gid"]
    # CAP_KILL (bit 5) and nothing else, ambient so that the user holds it; no way up
    kill_only = f"{1 << 5:016x}"
    for caps in ("CapEff", "CapPrm", "CapBnd", "CapAmb"):
        assert status[caps] == kill_only, (caps, status[caps])
    assert status["NoNewPrivs"] == "1"
    assert status["Seccomp"] == "2"  # SystemCallFilter= is a filter in force


def test_metrics_answer_on_the_configured_address_in_the_machines_network(
        machine: SystemdMachine, installed: Installed):
    flags = machine.run(["cat", "/etc/default/clusterpulse-agent"], check=True).stdout
    assert "--listen 0.0.0.0:9477" in flags
    code, text = http(machine, "http://127.0.0.1:9477/metrics")
    assert code == 200
    up = [s for f in text_string_to_metric_families(text) if f.name == "clusterpulse_gpu_up"
          for s in f.samples]
    # the default node label is the machine's hostname: this is the unit's agent
    assert {s.labels["node"] for s in up} == {HOSTNAME}
    assert sorted(int(s.labels["gpu"]) for s in up if s.value == 1) == list(range(8))


def test_token_is_root_only_and_reaches_the_agent_as_a_credential(machine: SystemdMachine,
                                                                   installed: Installed):
    modes = machine.run(["stat", "-c", "%n %U:%G %a", "/etc/clusterpulse",
                         "/etc/clusterpulse/token"], check=True).stdout.splitlines()
    assert modes == ["/etc/clusterpulse root:clusterpulse 750",
                     "/etc/clusterpulse/token root:root 600"]
    url = "http://127.0.0.1:9477/v1/faults"
    assert http(machine, url)[0] == 401
    assert http(machine, url, "wrong-" + installed.token)[0] == 401
    code, body = http(machine, url, installed.token, json.dumps({"kind": "overheat", "gpu": 3}))
    assert code == 200, body
    # the action is audited where LogsDirectory= put the log, owned by the service user
    audit = machine.run(["stat", "-c", "%U %a", "/var/log/clusterpulse/agent-audit.jsonl"],
                        check=True).stdout.split()
    assert audit == ["clusterpulse", "600"]  # UMask=0077
    record = json.loads(machine.run(["tail", "-n1", "/var/log/clusterpulse/agent-audit.jsonl"],
                                    check=True).stdout)
    assert record["action"] == "fault:overheat" and record["gpu"] == 3, record


# Run inside the agent's cgroup and mount namespace, as its user: what it may write.
PROBE = """
import errno, json, os, sys
out = {}
def attempt(name, fn):
    try:
        fn(); out[name] = "ok"
    except OSError as e:
        out[name] = errno.errorcode[e.errno]
def create(path):
    fd = os.open(path, os.O_WRONLY | os.O_CREAT, 0o600); os.close(fd)
for d in sys.argv[1:]:
    attempt(d, lambda d=d: create(os.path.join(d, "cp-probe")))
attempt("list /home", lambda: os.listdir("/home"))
attempt("open /dev/null", lambda: os.close(os.open("/dev/null", os.O_RDWR)))
attempt("open /dev/nvidiactl", lambda: os.close(os.open("/dev/nvidiactl", os.O_RDWR)))
print(json.dumps(out))
"""


def test_sandbox_confines_the_agent_to_its_directories_and_devices(machine: SystemdMachine,
                                                                   installed: Installed):
    # Directories any user could write to, were it not for ProtectSystem=strict.
    machine.sh("for d in /etc/cp-open /var/cp-open /srv/cp-open /home/someone; do\n"
               "  mkdir -p $d; chmod 1777 $d\ndone")
    writable = ["/var/lib/clusterpulse", "/var/log/clusterpulse", "/run/clusterpulse", "/tmp"]
    closed = ["/etc/cp-open", "/var/cp-open", "/srv/cp-open"]
    out = as_service(machine, AGENT, installed,
                     [f"{BIN}/python", "-c", PROBE, *writable, *closed])
    result = json.loads(out.stdout)
    assert {d: result[d] for d in writable} == dict.fromkeys(writable, "ok"), result
    assert {d: result[d] for d in closed} == dict.fromkeys(closed, "EROFS"), result
    assert result["list /home"] == "EACCES"  # ProtectHome=yes
    assert result["open /dev/null"] == "ok"
    # DevicePolicy=closed: char-nvidia* resolve against /proc/devices, where no driver
    # registered them here, so the agent's cgroup may not open major 195; root in the
    # machine, outside that cgroup, reaches the node (and no driver behind it).
    outside = machine.run([f"{BIN}/python", "-c", PROBE], check=True)
    if nvidia_driver_loaded():
        assert result["open /dev/nvidiactl"] != "EPERM", result
    else:
        assert result["open /dev/nvidiactl"] == "EPERM", result
        assert json.loads(outside.stdout)["open /dev/nvidiactl"] == "ENXIO"
    # PrivateTmp=yes: the agent's /tmp is not the machine's
    assert machine.run(["test", "-e", "/tmp/cp-probe"]).returncode == 1
    assert machine.run(["test", "-e", "/var/lib/clusterpulse/cp-probe"]).returncode == 0


@pytest.fixture(scope="module")
def monitoring_host(machine: SystemdMachine, installed: Installed) -> None:
    """The dashboard and remediation units installed as docs/deploy.md says, on the
    same machine (its user, /etc/clusterpulse and token are the agent's)."""
    am_password = docs_commands("## Alertmanager's API")[0].splitlines()[0]
    assert "/etc/clusterpulse/alertmanager-password" in am_password
    machine.sh(am_password)
    machine.run(["sh", "-euc", f"export PATH={BIN}:$PATH\ncd {CONFIG_DIR}/systemd\n"
                 + docs_commands("## systemd")[1]],
                input=f"{OPERATOR_PASSWORD}\n{OPERATOR_PASSWORD}\n", check=True)

    def serving() -> bool:
        try:
            return (http(machine, "http://127.0.0.1:8501/_stcore/health")[0] == 200
                    and http(machine, "http://127.0.0.1:19495/healthz")[0] == 200)
        except Exception:
            return False
    try:
        machine.wait_for(serving, 90, "the dashboard's and the receiver's health endpoints",
                         DASHBOARD)
    except MachineError as err:
        raise MachineError(f"{err}\n{machine.journal(REMEDIATE)[-3000:]}") from None


@pytest.mark.parametrize("unit", [DASHBOARD, REMEDIATE])
def test_monitoring_units_are_active_as_their_user_without_capabilities(
        machine: SystemdMachine, installed: Installed, monitoring_host: None, unit: str):
    assert machine.run(["systemctl", "is-enabled", unit]).stdout.strip() == "enabled"
    assert machine.run(["systemctl", "is-active", unit]).stdout.strip() == "active"
    status = proc_status(machine, unit)
    assert status["Uid"].split() == [str(installed.uid)] * 4
    for caps in ("CapEff", "CapPrm", "CapBnd", "CapAmb"):
        assert int(status[caps], 16) == 0, (caps, status[caps])
    assert (status["NoNewPrivs"], status["Seccomp"]) == ("1", "2")


OPERATORS = """
import json, sys
from pathlib import Path
from clusterpulse.dashboard.auth import load_operators, verify_password
ops = load_operators(Path(sys.argv[1]), None).hashes
procs = [int(p) for p in __import__("os").listdir("/proc") if p.isdigit()]
print(json.dumps({"operators": sorted(ops), "admin_ok": verify_password(sys.argv[2],
                  ops.get("admin", "")), "pid1_visible": 1 in procs}))
"""


def test_dashboard_reads_its_operators_credential_and_sees_only_its_users_processes(
        machine: SystemdMachine, installed: Installed, monitoring_host: None):
    out = as_service(machine, DASHBOARD, installed, [
        f"{BIN}/python", "-c", OPERATORS,
        f"/run/credentials/{DASHBOARD}/operators.toml", OPERATOR_PASSWORD])
    # the documented operators file parses, and the hash is of the password typed
    assert json.loads(out.stdout) == {"operators": ["admin"], "admin_ok": True,
                                      "pid1_visible": False}  # ProtectProc=invisible


def test_receiver_takes_the_webhook_token_as_a_credential(
        machine: SystemdMachine, installed: Installed, monitoring_host: None):
    token = machine.run(["cat", "/etc/clusterpulse/webhook-token"], check=True).stdout.strip()
    url = "http://127.0.0.1:19495/alertmanager"
    notification = json.dumps({"alerts": [{"status": "resolved",
                                           "labels": {"alertname": "GpuDown"}}]})
    assert http(machine, url, "", notification)[0] == 401
    assert http(machine, url, installed.token, notification)[0] == 401  # the agents' token
    code, body = http(machine, url, token, notification)
    assert code == 200, body


def test_the_egress_filter_lets_only_the_monitoring_services_reach_the_agents_port(
        machine: SystemdMachine, installed: Installed):
    """docs/deploy.md's "The Prometheus host" block as written: the unit is active;
    in the machine's network `nobody` and a process of the `prometheus` user without
    the group (another service of that user: the blackbox exporter) get no connection
    to the agents' port, one holding the group does; stopping the unit lets everyone
    through again."""
    machine.sh(f"cd {CONFIG_DIR}/systemd\n" + docs_commands("### The Prometheus host")[0])
    assert machine.show("clusterpulse-egress.service", "ActiveState")["ActiveState"] == "active"

    def status_as(user: str, groups: str | None = None) -> str:
        probe = ("import urllib.request\ntry:\n print(urllib.request.urlopen("
                 "'http://127.0.0.1:9477/healthz', timeout=3).status)\n"
                 "except OSError:\n print('no connection')")
        group = "nogroup" if user == "nobody" else user
        extra = [f"--groups={groups}"] if groups else ["--clear-groups"]
        return machine.run(["setpriv", f"--reuid={user}", f"--regid={group}", *extra,
                            f"{BIN}/python", "-c", probe], check=True).stdout.strip()

    try:
        assert [status_as("nobody"), status_as("prometheus"),
                status_as("prometheus", "clusterpulse-scrape")] == \
            ["no connection", "no connection", "200"], \
            machine.journal("clusterpulse-egress.service")
        machine.run(["systemctl", "stop", "clusterpulse-egress.service"], check=True)
        assert status_as("nobody") == "200"
    finally:
        machine.run(["systemctl", "stop", "clusterpulse-egress"])


GPUS_IN_STORE = f'count(clusterpulse_gpu_up{{node="{HOSTNAME}"}})'
VM_UNITS = ["victoria-metrics.service", "clusterpulse-vmagent@0.service",
            "clusterpulse-vmalert.service"]


def test_the_victoriametrics_path_comes_up_scrapes_the_agent_and_evaluates_the_rules(
        machine: SystemdMachine, installed: Installed, monitoring_host: None):
    """docs/scaling.md's systemd block as written, on this machine as the store, shard 0
    and the rules host at once, scraping the machine's own agent. What Debian's package
    made on a real host is made here first (the machine's /usr and /etc are the host's,
    its /var is empty): /var/lib/victoria-metrics, owned by the package's user. The name
    `victoria-metrics` resolves through /etc/hosts; one shard, so the shard count is 1."""
    machine.sh("install -d -o _victoria-metrics -g _victoria-metrics /var/lib/victoria-metrics\n"
               "echo '127.0.0.1 victoria-metrics' >> /etc/hosts\n"
               "install -d /etc/clusterpulse/targets\n"
               "echo \"- targets: ['127.0.0.1:9477']\" > /etc/clusterpulse/targets/agents.yml")
    # Every host's block, then the store's, shard 0's (SHARD=0 as written) and the rules
    # host's, in the docs' order: vmalert reads the rules clusterpulse-config writes for
    # it (no sed), the store its secrets through the drop-in.
    blocks = docs_commands("### Installing it with systemd", doc="scaling.md")
    assert len(blocks) == 4, blocks
    install = "\n".join(blocks)
    machine.run(["sh", "-euc", f"export PATH={BIN}:$PATH\n" + install], check=True)
    machine.sh("sed -i 's/^CLUSTERPULSE_SHARDS=.*/CLUSTERPULSE_SHARDS=1/' "
               "/etc/default/clusterpulse-vmagent\nsystemctl restart clusterpulse-vmagent@0")

    # The store asks for its user and password (made by the block, as shards and vmalert
    # are given them).
    password = machine.run(["cat", "/etc/clusterpulse/victoria-metrics-password"],
                           check=True).stdout.strip()
    store_auth = "Basic " + base64.b64encode(f"clusterpulse:{password}".encode()).decode()

    def query(expr: str) -> list[dict]:
        try:  # refused until the store listens
            code, body = http(machine, "http://127.0.0.1:8428/api/v1/query?query="
                              + urllib.parse.quote(expr), store_auth)
        except MachineError:
            return []
        return json.loads(body)["data"]["result"] if code == 200 else []

    def journals() -> str:
        return "\n".join(machine.journal(u)[-1500:] for u in VM_UNITS)

    try:
        # the shard scraped the agent into the store: its `up` and the node's 8 GPUs
        machine.wait_for(lambda: query(GPUS_IN_STORE),
                         60, "the agent's GPUs in VictoriaMetrics", VM_UNITS[1])
        # vmalert evaluated the rules and wrote the results back into the store
        machine.wait_for(lambda: query("clusterpulse:config_hang_timeout_seconds"), 60,
                         "a series recorded by vmalert in VictoriaMetrics", VM_UNITS[2])
    except MachineError as err:
        raise MachineError(f"{err}\n{journals()}") from None
    for unit in VM_UNITS:
        assert machine.run(["systemctl", "is-active", unit]).stdout.strip() == "active", \
            journals()
    up = query('up{job="clusterpulse"}')
    assert [(r["metric"]["instance"], r["value"][1]) for r in up] == [("127.0.0.1:9477", "1")]
    # Without the password the store takes no query and no import.
    assert http(machine, "http://127.0.0.1:8428/api/v1/query?query=up")[0] == 401
    assert http(machine, "http://127.0.0.1:8428/api/v1/import/prometheus", "",
                "clusterpulse_gpu_up 0\n")[0] == 401
    assert query(GPUS_IN_STORE)[0]["value"][1] == "8"
    # The keys came through the drop-in, not Debian's conffile: the password alone does
    # not get /flags (1.79 served it to anyone without -flagsAuthKey).
    assert http(machine, "http://127.0.0.1:8428/flags", store_auth)[0] == 401
    conffile = machine.run(["cat", "/etc/default/victoria-metrics"], check=True).stdout
    assert password not in conffile
    assert re.findall(r"^(?!#)\s*\w+(?:password|AuthKey)=", conffile, re.M | re.I) == []
    rules = json.loads(http(machine, "http://127.0.0.1:8880/api/v1/rules")[1])
    errors = {r["name"]: r["lastError"] for g in rules["data"]["groups"] for r in g["rules"]
              if r["lastError"]}
    assert errors == {}, errors
