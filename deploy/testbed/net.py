"""The kernel side of the testbed: network namespaces, a bridge, veth pairs, tc.

Everything here shells out to iproute2 (`ip`, `tc`) and util-linux (`nsenter`,
`unshare`): the same tools an administrator would use, so a failing step can be
replayed by hand from the error message. Names are built from a short per-run prefix
so that two runs (or two engineers' tests) never touch each other's interfaces.
"""

from __future__ import annotations

import errno
import fcntl
import ipaddress
import json
import os
import re
import shutil
import subprocess
from collections.abc import Iterator
from contextlib import contextmanager, suppress
from pathlib import Path

STATE_DIR = Path("/run/clusterpulse-testbed")
NETNS_DIR = Path("/run/netns")
PREFIX_RE = re.compile(r"^tb[0-9a-f]{4}$")
# A /16 inside 10.0.0.0/8 that holds one /24 per run; traffic never leaves the bridge.
SUPERNET = ipaddress.ip_network("10.213.0.0/16")
IFNAMSIZ = 15
TOOLS = ("ip", "tc", "nsenter", "unshare")


class TestbedError(RuntimeError):
    """The testbed cannot be built or driven; the message says why and what to do."""

    __test__ = False  # not a pytest test class despite the name


def missing_privileges() -> str | None:
    """None when this process can build a testbed, else the reason it cannot."""
    missing = [t for t in TOOLS if shutil.which(t) is None]
    if missing:
        return (f"the testbed needs {', '.join(missing)} (Debian packages iproute2, "
                "util-linux); run scripts/setup.sh")
    if os.geteuid() != 0:
        return ("the testbed needs root (CAP_NET_ADMIN and CAP_SYS_ADMIN to create network "
                "and UTS namespaces); run it as root, e.g. in CI or with sudo")
    probe = subprocess.run(["unshare", "--net", "true"], capture_output=True, text=True)
    if probe.returncode != 0:
        return ("cannot create network namespaces here (unshare --net: "
                f"{probe.stderr.strip() or probe.returncode}); a container needs "
                "CAP_NET_ADMIN and CAP_SYS_ADMIN")
    why = root_propagation_problem()
    if why:  # `ip -n NODE ...` makes `/` a slave mount in a private mount namespace
        return f"cannot enter network namespaces with `ip -n` here: {why}"
    return None


def root_propagation_problem() -> str | None:
    """None if `/` can change its mount propagation in a new mount namespace, which
    `ip -n` and buildah's layer storage both do; else why not (`/` is not a mount point
    in a plain chroot)."""
    probe = subprocess.run(["unshare", "--mount", "--propagation", "unchanged",
                            "mount", "--make-rslave", "/"], capture_output=True, text=True)
    if probe.returncode == 0:
        return None
    why = (probe.stderr.strip().splitlines() or [str(probe.returncode)])[0]
    return (f"`mount --make-rslave /` failed ({why}); `/` must be a mount point (it is not "
            "in a plain chroot)")


def run(*args: str, check: bool = True, quiet: bool = False) -> subprocess.CompletedProcess:
    """Run one command; on failure raise TestbedError carrying the command and stderr."""
    p = subprocess.run(list(args), capture_output=True, text=True)
    if check and p.returncode != 0:
        raise TestbedError(f"`{' '.join(args)}` failed ({p.returncode}): "
                           f"{(p.stderr or p.stdout).strip()}")
    if p.returncode != 0 and not quiet:
        return p
    return p


def names(prefix: str, index: int) -> tuple[str, str]:
    """(namespace name, host-side veth name) of node `index` of run `prefix`."""
    host = f"{prefix}-v{index}"
    assert len(host) <= IFNAMSIZ, host
    return f"{prefix}-node{index}", host


def bridge_name(prefix: str) -> str:
    return f"{prefix}-br"


@contextmanager
def state_lock() -> Iterator[None]:
    """Serialises subnet allocation between concurrent runs on this machine."""
    STATE_DIR.mkdir(mode=0o755, exist_ok=True)
    with open(STATE_DIR / ".lock", "w") as fh:
        fcntl.flock(fh, fcntl.LOCK_EX)
        try:
            yield
        finally:
            fcntl.flock(fh, fcntl.LOCK_UN)


def used_subnets() -> set[ipaddress.IPv4Network]:
    """Every /24 of the supernet already on an interface or held by a registered run."""
    used: set[ipaddress.IPv4Network] = set()
    out = run("ip", "-4", "-o", "addr", "show").stdout
    for m in re.finditer(r"inet (\d+\.\d+\.\d+\.\d+)/(\d+)", out):
        net = ipaddress.ip_network(f"{m.group(1)}/{m.group(2)}", strict=False)
        if net.overlaps(SUPERNET):
            used.add(ipaddress.ip_network(f"{m.group(1)}/24", strict=False))
    for rec in registered_runs():
        with _ignore_bad():
            used.add(ipaddress.ip_network(rec["subnet"]))
    return used


def pick_subnet() -> ipaddress.IPv4Network:
    used = used_subnets()
    for net in SUPERNET.subnets(new_prefix=24):
        if net not in used and net.network_address.packed[2] != 0:
            return net
    raise TestbedError(f"no free /24 left in {SUPERNET}; run `python -m deploy.testbed cleanup`")


@contextmanager
def _ignore_bad() -> Iterator[None]:
    with suppress(KeyError, ValueError, TypeError):
        yield


def registered_runs() -> list[dict]:
    """The runs recorded in STATE_DIR (one JSON file per run, written before building)."""
    out = []
    if not STATE_DIR.is_dir():
        return out
    for path in sorted(STATE_DIR.glob("tb*.json")):
        try:
            out.append(json.loads(path.read_text()))
        except (OSError, ValueError):
            continue
    return out


def register(record: dict) -> None:
    path = STATE_DIR / f"{record['prefix']}.json"
    tmp = path.with_suffix(".tmp")
    tmp.write_text(json.dumps(record))
    tmp.rename(path)


def unregister(prefix: str) -> None:
    for suffix in (".json", ".tmp"):
        (STATE_DIR / f"{prefix}{suffix}").unlink(missing_ok=True)


def process_alive(pid: int, start_time: int | None) -> bool:
    """True when `pid` runs and (if given) started at `start_time` (not a reused pid).
    A zombie does not run: it is dead and waits for its parent to reap it."""
    try:
        stat = Path(f"/proc/{pid}/stat").read_text()
    except OSError:
        return False
    if stat.rsplit(")", 1)[1].split()[0] == "Z":
        return False
    if start_time is None:
        return True
    return proc_start_time(stat) == start_time


def proc_start_time(stat: str) -> int:
    """Field 22 of /proc/PID/stat (start time in clock ticks), robust to odd comm names."""
    return int(stat.rsplit(")", 1)[1].split()[19])


def own_start_time() -> int:
    return proc_start_time(Path(f"/proc/{os.getpid()}/stat").read_text())


def netns_pids(ns: str) -> list[int]:
    """Every process whose network namespace is `ns` (what `ip netns pids` prints)."""
    try:
        target = os.stat(NETNS_DIR / ns)
    except FileNotFoundError:
        return []
    pids = []
    for entry in os.scandir("/proc"):
        if not entry.name.isdigit():
            continue
        try:
            st = os.stat(f"/proc/{entry.name}/ns/net")
        except OSError:
            continue
        if (st.st_ino, st.st_dev) == (target.st_ino, target.st_dev):
            pids.append(int(entry.name))
    return pids


def kill_netns(ns: str, rounds: int = 50) -> None:
    """SIGKILL every process of the namespace, again until none is left (a process may
    fork between the listing and the kill). SIGSTOP first so the group dies together."""
    import signal
    import time

    for _ in range(rounds):
        pids = [p for p in netns_pids(ns) if p != os.getpid()]
        if not pids:
            return
        for sig in (signal.SIGSTOP, signal.SIGKILL):
            for pid in pids:
                try:
                    os.kill(pid, sig)
                except ProcessLookupError:
                    pass
                except OSError as err:
                    if err.errno != errno.ESRCH:
                        raise
        time.sleep(0.05)
    left = netns_pids(ns)
    if left:
        raise TestbedError(f"processes {left} of namespace {ns} survive SIGKILL")


def read_sysctl_conf(path: Path) -> dict[str, str]:
    """The `key = value` settings of a sysctl.d file (comments and blank lines skipped,
    a leading `-`, "ignore failure", dropped)."""
    out = {}
    for n, line in enumerate(path.read_text().splitlines(), 1):
        line = line.strip()
        if not line or line[0] in "#;":
            continue
        key, sep, value = line.partition("=")
        if not sep or not key.strip():
            raise TestbedError(f"{path}:{n}: expected KEY = VALUE, got {line!r}")
        out[key.strip().lstrip("-")] = value.strip()
    return out


def apply_sysctl(ns: str, settings: dict[str, str]) -> list[str]:
    """Set per-namespace sysctls inside network namespace `ns`, as the node's boot
    would from /etc/sysctl.d; the keys this kernel does not have (returned) are left
    out, as `sysctl --system` leaves them. Only `net.*` keys: others are the whole
    machine's, not a node's."""
    missing = []
    for key, value in settings.items():
        if not key.startswith("net."):
            raise TestbedError(f"sysctl {key}: not per network namespace; a testbed node "
                               "can only carry net.* settings")
        rel = key.replace(".", "/")
        if not (Path("/proc/sys") / rel).exists():
            missing.append(key)
            continue
        # /proc/sys/net is the namespace of the process that opens it
        run("nsenter", f"--net={NETNS_DIR / ns}", "--", "sh", "-c",
            'printf "%s\n" "$1" > "/proc/sys/$2"', "sh", value, rel)
    return missing


def link_exists(name: str, ns: str | None = None) -> bool:
    cmd = ["ip", *(["-n", ns] if ns else []), "link", "show", "dev", name]
    return subprocess.run(cmd, capture_output=True).returncode == 0


def list_netns() -> list[str]:
    out = run("ip", "netns", "list", check=False).stdout
    return [line.split()[0] for line in out.splitlines() if line.strip()]


def list_links() -> list[str]:
    out = run("ip", "-o", "link", "show").stdout
    return [m.group(1) for m in re.finditer(r"^\d+: ([^:@]+)[@:]", out, re.M)]


def uts_path(ns: str) -> Path:
    return STATE_DIR / f"{ns}.uts"


def make_uts(ns: str, hostname: str) -> Path:
    """A persistent UTS namespace (bind-mounted file) holding the node's hostname, so
    every process of the node, started at any time, sees the same hostname."""
    path = uts_path(ns)
    path.touch()
    p = subprocess.run(["unshare", f"--uts={path}", "hostname", hostname],
                       capture_output=True, text=True)
    if p.returncode != 0:
        # The state dir sits on a shared mount: make it a private mount of its own.
        path.unlink(missing_ok=True)
        if not os.path.ismount(STATE_DIR):
            run("mount", "--bind", str(STATE_DIR), str(STATE_DIR))
        run("mount", "--make-private", str(STATE_DIR))
        path.touch()
        run("unshare", f"--uts={path}", "hostname", hostname)
    return path


def remove_uts(ns: str) -> None:
    path = uts_path(ns)
    if path.exists():
        subprocess.run(["umount", str(path)], capture_output=True)
        path.unlink(missing_ok=True)


def remove_run(prefix: str, nodes: int | None = None) -> list[str]:
    """Remove everything of run `prefix`: processes, namespaces, veths, bridge, UTS
    files, registry entry. Idempotent; returns what it removed."""
    if not PREFIX_RE.match(prefix):
        raise TestbedError(f"{prefix!r} is not a testbed run prefix (tbXXXX)")
    removed = []
    for ns in list_netns():
        if ns.startswith(f"{prefix}-"):
            kill_netns(ns)
            run("ip", "netns", "delete", ns, check=False)
            removed.append(f"netns {ns}")
    for link in list_links():
        if link.startswith(f"{prefix}-"):
            run("ip", "link", "delete", link, check=False)
            removed.append(f"link {link}")
    if STATE_DIR.is_dir():
        for path in STATE_DIR.glob(f"{prefix}-*.uts"):
            remove_uts(path.name[:-4])
            removed.append(f"uts {path.name}")
    unregister(prefix)
    return removed


def dead_runs() -> list[str]:
    """Prefixes of runs whose owner is gone, plus unregistered leftovers by name."""
    alive = {r["prefix"] for r in registered_runs()
             if process_alive(int(r.get("owner_pid", 0)), r.get("owner_start"))}
    seen = {r["prefix"] for r in registered_runs()}
    for name in [*list_netns(), *list_links()]:
        head = name.split("-", 1)[0]
        if PREFIX_RE.match(head):
            seen.add(head)
    return sorted(seen - alive)
