"""A real systemd booted as PID 1 of namespaces of its own: what `systemd-nspawn -b`
does, made of util-linux tools (`unshare`, `nsenter`, `pivot_root`, `setpriv`), because
systemd-nspawn is in Debian's systemd-container package, which neither scripts/setup.sh
nor a minimal Debian has, and the host's own init need not be systemd.

    with SystemdMachine(workdir, hostname="cp-node") as m:     # root; see unavailable()
        m.boot()                                                # ~2 s
        m.run(["systemctl", "enable", "--now", "foo.service"])
        m.show("foo.service", "ActiveState", "MainPID")

How it is built, and why each piece is there:

- Namespaces: mount, PID, UTS, IPC, network and cgroup, all new. systemd is PID 1 of
  the PID namespace, so killing it ends every process of the machine at once, and the
  machine's network is its own loopback: a service's port inside is not the host's.
- Root: a directory on the host (`workdir/root`): a copy of the host's /etc with
  /etc/systemd/system and the SysV start links emptied (the host's enabled services
  are not this machine's; systemd-logind is masked: no logins, and no D-Bus on a
  minimal Debian), a fresh machine-id (an empty one would make this a first boot,
  which enables every preset), its hostname and an empty fstab; an empty /var; the host's /usr bound
  read-only (with the /bin, /lib... links or binds that go with it). After
  `pivot_root` the host's tree is unmounted from the machine's mount namespace: the
  machine sees nothing of the host but its read-only binds. (Started in a chroot
  whose / is a mount point, as the fresh-machine CI runs, the namespace keeps the
  host's tree above the machine's root, out of the machine's processes' reach, their
  root being the machine's; whoever enters the namespace from outside must take the
  root of a process in it too, `nsenter --root`, as `command()` does.)
- Mount propagation shared within the machine (systemd-nspawn does the same; systemd
  does not in a container): LoadCredential= and other per-service mounts are made in
  a helper's namespace and reach the service only through it.
- API filesystems as systemd-nspawn mounts them: a fresh /proc whose /proc/sys is
  read-only (the sysctls that are not per namespace are the host's; systemd's sysctl
  and binfmt units skip themselves on a read-only /proc/sys), sysfs read-only, a /dev
  of its own on tmpfs (the basic nodes, a new devpts, and any `DeviceNode`s asked
  for), tmpfs /run and /tmp.
- cgroup: a cgroup `clusterpulse-machine-XXXXXXXX` under this process's cgroup v2,
  created through a private mount of the cgroup2 hierarchy, so that a host with
  hybrid cgroups (v2 at /sys/fs/cgroup/unified) or none mounted at all (a chroot)
  works alike. The machine's cgroup namespace is rooted there and cgroup2 is mounted
  at its /sys/fs/cgroup: its systemd manages that subtree and nothing else.
- Capabilities: PID 1's bounding set lacks what systemd-nspawn drops and what would
  reach the host's kernel (loading modules, setting the clock, raw I/O, the kernel
  log); BPF and the rest stay, so DevicePolicy=, seccomp filters and the other
  sandboxing of units work as on a host.
- Teardown (`close`, also when boot fails): SIGKILL to PID 1 and a wait until the
  supervising shell has removed the cgroup. Every mount lives in the machine's or the
  supervisor's private mount namespace and goes with it. The supervisor gets SIGTERM
  when the process that started it dies (its parent-death signal) and then kills the
  machine the same way; a cgroup left by a supervisor that was SIGKILLed itself is
  removed by the next boot once it has been empty for a minute.

`stage_venv` puts a ClusterPulse virtual environment at the documented install path
(/opt/clusterpulse/.venv) into a machine's root before boot.
"""

from __future__ import annotations

import contextlib
import os
import secrets
import shlex
import shutil
import signal
import subprocess
import time
from collections.abc import Callable, Iterable, Sequence
from dataclasses import dataclass
from pathlib import Path
from typing import TypeVar

from deploy.testbed.net import proc_start_time, process_alive, root_propagation_problem

SYSTEMD = Path("/usr/lib/systemd/systemd")
TOOLS = ("unshare", "nsenter", "pivot_root", "setpriv", "mount", "umount", "mknod")
CGROUP_PREFIX = "clusterpulse-machine-"
LEFT_CGROUP = 98  # the supervisor's exit status when the machine's cgroup stayed
# Dropped from PID 1's bounding set (systemd-nspawn drops these too): they act on the
# host's kernel, not on a namespace.
DROPPED_CAPS = ("sys_module", "sys_time", "sys_rawio", "syslog", "wake_alarm",
                "block_suspend", "mac_admin", "mac_override", "audit_control", "audit_read")
# The environment of every command run in the machine: nothing of the caller's leaks in.
ENV = {"PATH": "/usr/local/sbin:/usr/local/bin:/usr/sbin:/usr/bin:/sbin:/bin",
       "LANG": "C.UTF-8", "SYSTEMD_PAGER": "", "SYSTEMD_COLORS": "0", "TERM": "dumb"}
# Where units with ProtectHome=yes see nothing.
HIDDEN_BY_PROTECT_HOME = ("/home", "/root", "/run/user")
T = TypeVar("T")


class MachineError(RuntimeError):
    """The machine could not be built, booted or driven; the message says why."""


class MachineUnavailable(MachineError):
    """This host lacks something a machine needs; the message names it (tests skip)."""


@dataclass(frozen=True)
class Bind:
    """`source` on the host appears at `target` in the machine (read-only unless not)."""

    source: Path
    target: str
    read_only: bool = True


@dataclass(frozen=True)
class DeviceNode:
    """A character device node created in the machine's /dev (e.g. a stand-in for a
    GPU's, with the driver's major number)."""

    path: str
    major: int
    minor: int
    mode: int = 0o666


def unavailable() -> str | None:
    """Why a machine cannot be booted here, or None."""
    if os.geteuid() != 0:
        return "booting a systemd machine needs root (namespaces, mounts, a cgroup)"
    if not os.access(SYSTEMD, os.X_OK):
        return f"{SYSTEMD} is missing: the `systemd` package (scripts/setup.sh installs it)"
    missing = [t for t in TOOLS if shutil.which(t) is None]
    if missing:
        return f"{', '.join(missing)} missing (the util-linux and mount packages)"
    if "cgroup2" not in Path("/proc/filesystems").read_text():
        return "the kernel has no cgroup2 filesystem, which systemd as PID 1 needs"
    why = root_propagation_problem()
    if why:  # its mounts must be private to it, which a plain chroot cannot promise
        return f"cannot keep a machine's mounts private: {why}"
    probe = subprocess.run(["unshare", "--mount", "--uts", "--ipc", "--net", "--pid",
                            "--cgroup", "--fork", "true"], capture_output=True, text=True)
    if probe.returncode != 0:
        return ("cannot create mount, PID, UTS, IPC, network and cgroup namespaces here "
                f"(unshare: {probe.stderr.strip() or probe.returncode}); a container "
                "needs CAP_SYS_ADMIN")
    return None


class SystemdMachine:
    """One booted systemd. Build with `boot()`, drive with `run()`, end with `close()`."""

    def __init__(self, workdir: Path, hostname: str = "cp-machine",
                 binds: Sequence[Bind] = (), devices: Sequence[DeviceNode] = ()) -> None:
        self.workdir = workdir
        self.root = workdir / "root"
        self.hostname = hostname
        self.binds = list(binds)
        self.devices = list(devices)
        self.name = CGROUP_PREFIX + secrets.token_hex(4)
        self.log = workdir / "machine.log"
        self.pid: int | None = None  # PID 1 of the machine, as the host numbers it
        self._pid_start: int | None = None
        self._supervisor: subprocess.Popen | None = None

    def __enter__(self) -> SystemdMachine:
        return self

    def __exit__(self, *exc: object) -> None:
        self.close()

    # -- building -------------------------------------------------------------------

    def prepare_root(self) -> None:
        """The machine's root tree (see the module's docstring). Idempotent until boot;
        `stage_venv` and other preparation may add to it before `boot()`."""
        root = self.root
        if (root / "etc").is_dir():
            return
        for d in ("usr", "proc", "sys", "dev", "run", "tmp", "opt", "srv", "mnt", "home",
                  ".oldroot", "var/lib", "var/log", "var/cache", "var/spool"):
            (root / d).mkdir(parents=True, exist_ok=True)
        (root / "root").mkdir(mode=0o700)
        (root / "var/tmp").mkdir(mode=0o1777)
        (root / "var/tmp").chmod(0o1777)
        (root / "var/run").symlink_to("/run")
        (root / "var/lock").symlink_to("/run/lock")
        for name in ("bin", "sbin", "lib", "lib32", "lib64", "libx32"):
            host = Path("/") / name
            if host.is_symlink():  # merged /usr: bin -> usr/bin
                (root / name).symlink_to(os.readlink(host))
            elif host.is_dir():
                self.binds.insert(0, Bind(host, f"/{name}"))
        self.binds.insert(0, Bind(Path("/usr"), "/usr"))
        # /usr/local/sbin: the machine's own, empty and writable, as on a fresh Debian
        # (where an administrator installs a script such as clusterpulse-egress)
        (root / "usr-local-sbin").mkdir()
        self.binds.insert(1, Bind(root / "usr-local-sbin", "/usr/local/sbin", read_only=False))
        # cp -a keeps owners and modes (/etc/shadow stays root:shadow 0640).
        subprocess.run(["cp", "-a", "/etc", str(root / "etc")], check=True,
                       capture_output=True, timeout=120)
        etc = root / "etc"
        units = etc / "systemd" / "system"
        shutil.rmtree(units, ignore_errors=True)
        units.mkdir(parents=True)
        for link in etc.glob("rc?.d/S*"):  # SysV scripts the host enabled
            link.unlink()
        # Logins: none here, and logind needs D-Bus, which a minimal Debian lacks (the
        # boot would end "degraded" for a unit nothing here uses).
        (units / "systemd-logind.service").symlink_to("/dev/null")
        (etc / "machine-id").write_text(secrets.token_hex(16) + "\n")
        (etc / "hostname").write_text(self.hostname + "\n")
        (etc / "fstab").write_text("# the machine's mounts are made before it boots\n")
        # ConditionNeedsUpdate= units (ldconfig, hwdb) compare these with /usr's mtime:
        # the copy is as current as the host, so they need not run at every boot.
        usr_ns = Path("/usr").stat().st_mtime_ns
        for stamp in (etc / ".updated", root / "var/.updated"):
            stamp.write_text(f"TIMESTAMP_NSEC={usr_ns}\n")
            os.utime(stamp, ns=(usr_ns, usr_ns))

    def _render(self) -> tuple[Path, Path, Path]:
        """The three shell scripts that build and start the machine (kept in workdir,
        so a failed step can be read and replayed by hand)."""
        q = shlex.quote
        root = str(self.root)
        scratch = self.root / ".oldroot"
        enter, boot = self.workdir / "enter.sh", self.workdir / "boot.sh"
        supervise = self.workdir / "supervise.sh"
        supervise.write_text(f"""\
# Supervises machine {self.name}: its cgroup, PID 1, then the removal of the cgroup.
# Runs in a mount namespace of its own (the cgroup2 mount below is private).
set -u
scratch={q(str(scratch))}
name={q(self.name)}
mount -t cgroup2 cgroup2 "$scratch" || exit 97
own=$(sed -n 's/^0:://p' /proc/self/cgroup)
parent="$scratch${{own%/}}"
for d in "$parent"/{CGROUP_PREFIX}*; do  # left by a supervisor that was SIGKILLed
  [ -d "$d" ] && [ -n "$(find "$d" -maxdepth 0 -mmin +1)" ] \\
    && grep -qx 'populated 0' "$d/cgroup.events" \\
    && find "$d" -depth -type d -exec rmdir {{}} + 2>/dev/null
done
cg="$parent/$name"
mkdir "$cg" || exit 97
unshare --mount --propagation private --uts --ipc --net --pid --fork --kill-child \\
  -- sh {q(str(enter))} "$cg" &
child=$!
trap 'kill -KILL "$child" 2>/dev/null' TERM INT HUP
rc=0
while :; do wait "$child"; rc=$?; kill -0 "$child" 2>/dev/null || break; done
i=0
while [ -d "$cg" ] && [ $i -lt 100 ]; do
  find "$cg" -depth -type d -exec rmdir {{}} + 2>/dev/null
  [ -d "$cg" ] && sleep 0.1
  i=$((i + 1))
done
umount "$scratch"
echo "machine: PID 1 ended ($rc)"
if [ -d "$cg" ]; then echo "machine: could not remove cgroup $cg" >&2; exit {LEFT_CGROUP}; fi
""")
        enter.write_text(f"""\
# PID 1 of the new PID namespace: into the machine's cgroup, then a cgroup namespace
# rooted there.
set -eu
echo 0 > "$1/cgroup.procs"
exec unshare --cgroup -- sh {q(str(boot))}
""")
        lines = ["# The machine's mounts, its root, then systemd.", "set -eu",
                 f"root={q(root)}", 'mount --bind "$root" "$root"']
        for b in self.binds:
            dst = f'"$root"{q(b.target)}'
            lines.append(f"mount --bind {q(str(b.source))} {dst}")
            if b.read_only:
                lines.append(f"mount -o remount,bind,ro {dst}")
        lines += [
            'mount -t proc -o nosuid,nodev,noexec proc "$root/proc"',
            'mount --bind "$root/proc/sys" "$root/proc/sys"',
            'mount -o remount,bind,ro "$root/proc/sys"',
            'if [ -e "$root/proc/sysrq-trigger" ]; then',
            '  mount --bind "$root/proc/sysrq-trigger" "$root/proc/sysrq-trigger"',
            '  mount -o remount,bind,ro "$root/proc/sysrq-trigger"',
            "fi",
            'mount -t sysfs -o ro,nosuid,nodev,noexec sysfs "$root/sys"',
            'mount -t cgroup2 -o nosuid,nodev,noexec cgroup2 "$root/sys/fs/cgroup"',
            'mount -t tmpfs -o mode=755,nosuid tmpfs "$root/dev"',
        ]
        nodes = [DeviceNode("/dev/null", 1, 3), DeviceNode("/dev/zero", 1, 5),
                 DeviceNode("/dev/full", 1, 7), DeviceNode("/dev/random", 1, 8),
                 DeviceNode("/dev/urandom", 1, 9), DeviceNode("/dev/tty", 5, 0),
                 *self.devices]
        for n in nodes:
            path = f'"$root"{q(n.path)}'
            lines += [f"mkdir -p $(dirname {path})",
                      f"mknod -m {n.mode:o} {path} c {n.major} {n.minor}"]
        lines += [
            'mkdir -m 755 "$root/dev/pts"; mkdir -m 1777 "$root/dev/shm"',
            'mount -t devpts -o newinstance,ptmxmode=0666,mode=620,gid=5,nosuid,noexec '
            'devpts "$root/dev/pts"',
            'ln -s pts/ptmx "$root/dev/ptmx"',
            'mount -t tmpfs -o mode=1777,nosuid,nodev tmpfs "$root/dev/shm"',
            'ln -s /proc/self/fd "$root/dev/fd"',
            'ln -s /proc/self/fd/0 "$root/dev/stdin"',
            'ln -s /proc/self/fd/1 "$root/dev/stdout"',
            'ln -s /proc/self/fd/2 "$root/dev/stderr"',
            'mount -t tmpfs -o mode=755,nosuid,nodev tmpfs "$root/run"',
            'mount -t tmpfs -o mode=1777,nosuid,nodev tmpfs "$root/tmp"',
            'cd "$root"', "pivot_root . .oldroot", "cd /", "umount -l /.oldroot",
            # Shared (inside this mount namespace, which shares nothing with the host):
            # systemd does not do it in a container and needs it, as systemd-nspawn
            # does, for mounts it makes in a helper's namespace to reach the services
            # (LoadCredential=: without it a service finds its credentials directory
            # empty, and a non-root one cannot even open it).
            "mount --make-rshared /",
            "exec env -i container=clusterpulse-machine setpriv --bounding-set "
            + ",".join(f"-{c}" for c in DROPPED_CAPS)
            + f" -- {SYSTEMD} --unit=multi-user.target",
        ]
        boot.write_text("\n".join(lines) + "\n")
        return supervise, enter, boot

    def boot(self, timeout: float = 120) -> str:
        """Build the root, start systemd and wait until it has finished booting;
        returns `systemctl is-system-running` ("running", or "degraded" when a unit of
        the boot failed). Raises MachineError with the cause, the machine closed."""
        if self._supervisor is not None or (self.workdir / "supervise.sh").exists():
            raise MachineError("a machine boots once; make a new one")
        self.workdir.mkdir(parents=True, exist_ok=True)
        self.prepare_root()
        for b in self.binds:
            target = self.root / b.target.lstrip("/")
            if b.source.is_dir():
                target.mkdir(parents=True, exist_ok=True)
            else:
                target.parent.mkdir(parents=True, exist_ok=True)
                target.touch()
        supervise, _, _ = self._render()
        with open(self.log, "ab") as log:
            self._supervisor = subprocess.Popen(
                # TERM when our thread dies; the supervisor then kills the machine
                ["setpriv", "--pdeathsig", "TERM", "--",
                 "unshare", "--mount", "--propagation", "private", "--",
                 "sh", str(supervise)],
                stdin=subprocess.DEVNULL, stdout=log, stderr=subprocess.STDOUT,
                start_new_session=True)
        try:
            deadline = time.monotonic() + timeout
            self.pid = self._wait(lambda: self._find_init(), deadline, "systemd to start")
            state = self._wait(self._booted, deadline, "the boot to finish")
        except BaseException:
            self.close()
            raise
        return state

    def _find_init(self) -> int | None:
        """The machine's PID 1 once it runs systemd (after pivot_root: never enter it
        earlier, when its root is still the host's)."""
        assert self._supervisor is not None
        if self._supervisor.poll() is not None:
            raise MachineError(f"the machine exited ({self._supervisor.returncode}) "
                               f"before systemd ran:\n{self.log_tail()}")
        for unshare in _children(self._supervisor.pid):
            for pid in _children(unshare):
                with contextlib.suppress(OSError):
                    if Path(f"/proc/{pid}/comm").read_text().strip() == "systemd":
                        self._pid_start = proc_start_time(
                            Path(f"/proc/{pid}/stat").read_text())
                        return pid
        return None

    def _booted(self) -> str | None:
        out = self.run(["systemctl", "is-system-running", "--wait"], timeout=60)
        state = out.stdout.strip()
        if state in ("running", "degraded"):
            return state
        if state == "maintenance":  # the emergency or rescue shell: it will not boot
            raise MachineError(f"systemd did not boot ({state}):\n{self.journal()[-4000:]}")
        return None  # not listening yet ("offline" and a connection error)

    def _wait(self, check: Callable[[], T | None], deadline: float, what: str) -> T:
        while True:
            result = check()
            if result:
                return result
            if time.monotonic() > deadline:
                raise MachineError(f"timed out waiting for {what}\n{self.log_tail()}")
            time.sleep(0.1)

    # -- driving --------------------------------------------------------------------

    def command(self, args: Sequence[str]) -> list[str]:
        """`args` wrapped to run inside the machine: all its namespaces, its root, and
        a clean environment (`ENV`)."""
        if self.pid is None:
            raise MachineError("the machine is not running")
        return ["nsenter", f"--target={self.pid}", "--mount", "--uts", "--ipc", "--net",
                "--pid", "--cgroup", "--root", "--wd", "--",
                "env", "-i", *(f"{k}={v}" for k, v in ENV.items()), *args]

    def run(self, args: Sequence[str], input: str | None = None, timeout: float = 60,
            check: bool = False) -> subprocess.CompletedProcess[str]:
        """Run a command inside the machine as root, to completion."""
        out = subprocess.run(self.command(args), input=input, capture_output=True,
                             text=True, timeout=timeout)
        if check and out.returncode != 0:
            raise MachineError(f"{shlex.join(args)} exited {out.returncode} in the "
                               f"machine:\n{out.stdout}{out.stderr}")
        return out

    def sh(self, script: str, timeout: float = 60) -> str:
        """A shell script in the machine (`sh -eu`); its output, or MachineError."""
        return self.run(["sh", "-euc", script], timeout=timeout, check=True).stdout

    def write(self, path: str, text: str, mode: int = 0o644) -> None:
        """Create a root-owned file in the machine with `mode` from its creation."""
        self.run(["sh", "-euc", f'umask 077; cat > "$1"; chmod {mode:o} "$1"', "sh", path],
                 input=text, check=True)

    def show(self, unit: str, *props: str) -> dict[str, str]:
        """`systemctl show -p ...` of a unit, as a dict."""
        out = self.run(["systemctl", "show", unit, *(f"--property={p}" for p in props)],
                       check=True).stdout
        return dict(line.split("=", 1) for line in out.splitlines() if "=" in line)

    def journal(self, unit: str | None = None) -> str:
        """The journal of this boot (of one unit with `unit`), as journalctl prints it."""
        where = ["--unit", unit] if unit else []
        return self.run(["journalctl", "--boot", "--no-pager", "--output", "short",
                         *where]).stdout

    def wait_for(self, check: Callable[[], T | None], timeout: float, what: str,
                 unit: str | None = None) -> T:
        """Poll `check` until it returns something truthy; MachineError naming `what`
        (with the end of `unit`'s journal, when given)."""
        try:
            return self._wait(check, time.monotonic() + timeout, what)
        except MachineError as err:
            if unit is None:
                raise
            raise MachineError(f"{err}\n{unit}'s journal:\n{self.journal(unit)[-4000:]}"
                               ) from None

    def log_tail(self, chars: int = 4000) -> str:
        try:
            return self.log.read_text(errors="replace")[-chars:]
        except OSError:
            return ""

    # -- teardown -------------------------------------------------------------------

    def close(self) -> None:
        """Kill PID 1 (so every process of the machine) and wait until the supervisor
        has removed the cgroup; MachineError if it could not. Idempotent."""
        if self.pid is not None and process_alive(self.pid, self._pid_start):
            with contextlib.suppress(ProcessLookupError):
                os.kill(self.pid, signal.SIGKILL)
        self.pid = None
        sup, self._supervisor = self._supervisor, None
        if sup is None:
            return
        try:
            sup.wait(timeout=30)
        except subprocess.TimeoutExpired:  # PID 1 was never found: stop it there
            sup.terminate()
            sup.wait(timeout=30)
        if sup.returncode == LEFT_CGROUP:
            raise MachineError(f"the machine's cgroup {self.name} was left behind:\n"
                               f"{self.log_tail()}")


def _children(pid: int) -> list[int]:
    """Processes whose parent is `pid` (from /proc/*/stat, which every kernel has)."""
    out = []
    for entry in Path("/proc").iterdir():
        if not entry.name.isdigit():
            continue
        try:
            stat = (entry / "stat").read_text()
        except OSError:
            continue
        if int(stat.rsplit(")", 1)[1].split()[1]) == pid:
            out.append(int(entry.name))
    return out


def stage_venv(machine: SystemdMachine, venv: Path, project: Path,
               prefix: str = "/opt/clusterpulse") -> str:
    """Lay out PREFIX/.venv in the machine's root as `python3 -m venv PREFIX/.venv` and
    `pip install PROJECT` would (docs/deploy.md), from an existing venv and checkout,
    with no network. The venv's site-packages are bound read-only at PREFIX/deps and
    PREFIX/.venv/lib/pythonX.Y/site-packages links each of its entries there (so every
    package sits under a "site-packages" path as pip puts it, which Streamlit, for one,
    reads to tell an installation from a development checkout), except the editable
    install's finder, whose place a link to the project takes (the project read-only
    at PREFIX/src). The console scripts get PREFIX/.venv/bin/python as their shebang.
    Nothing refers to where the checkout or its venv live, which matters because
    units with ProtectHome=yes cannot see /home or /root. Returns the interpreter.

    The interpreter is the venv's own unless it lives under /home, /root or /run/user
    (pyenv's do): then /usr/bin/pythonX.Y of the same version, whose ABI the venv's
    compiled packages share. Call before boot()."""
    libs = sorted(venv.glob("lib/python3.*/site-packages"))
    if not libs:
        raise MachineUnavailable(f"{venv} has no lib/python3.*/site-packages")
    site = libs[-1]
    xy = site.parent.name  # "python3.11"
    interpreter = (venv / "bin" / xy).resolve()
    if not interpreter.is_relative_to("/usr") and any(
            interpreter.is_relative_to(h) for h in HIDDEN_BY_PROTECT_HOME):
        interpreter = Path("/usr/bin") / xy
        if not interpreter.exists():
            raise MachineUnavailable(
                f"the venv's interpreter {(venv / 'bin' / xy).resolve()} lives where "
                f"ProtectHome=yes hides it from the units, and there is no /usr/bin/{xy} "
                "(Debian's python3) to run the venv with instead")
    elif not interpreter.is_relative_to("/usr"):
        machine.binds.append(Bind(interpreter.parent.parent, str(interpreter.parent.parent)))
    machine.prepare_root()
    top = machine.root / prefix.lstrip("/")
    env = top / ".venv"
    (env / "bin").mkdir(parents=True)
    packages = env / "lib" / xy / "site-packages"
    packages.mkdir(parents=True)
    (top / "src").mkdir()
    (top / "deps").mkdir()
    (env / "pyvenv.cfg").write_text(f"home = {interpreter.parent}\n"
                                    "include-system-site-packages = false\n")
    (env / "bin" / "python").symlink_to(interpreter)
    for alias in ("python3", xy):
        (env / "bin" / alias).symlink_to("python")
    for script in _console_scripts(venv):
        text = script.read_text()
        target = env / "bin" / script.name
        target.write_text(f"#!{prefix}/.venv/bin/python\n" + text.split("\n", 1)[1])
        target.chmod(0o755)
    for entry in sorted(site.iterdir()):
        # the editable install's finder maps to the checkout; an installed copy is not
        # the checkout under test
        if not entry.name.startswith("__editable__") and entry.name != "clusterpulse":
            (packages / entry.name).symlink_to(f"{prefix}/deps/{entry.name}")
    (packages / "clusterpulse").symlink_to(f"{prefix}/src/clusterpulse")
    machine.binds += [Bind(top, prefix), Bind(project, f"{prefix}/src"),
                      Bind(site, f"{prefix}/deps")]
    return str(interpreter)


def _console_scripts(venv: Path) -> Iterable[Path]:
    for script in sorted((venv / "bin").glob("clusterpulse-*")):
        with contextlib.suppress(OSError, UnicodeDecodeError):
            if script.read_text().startswith("#!"):
                yield script
