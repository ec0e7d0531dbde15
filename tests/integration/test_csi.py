"""A training pod at Pod Security "baseline" reaches the agent (issue #25 item 5).

No hostPath, no hostNetwork, no hostPID: the pod's volume is an ephemeral inline CSI
volume of ClusterPulse's node plugin (agent/csi.py), which bind-mounts the agent's
socket directory at the target path the kubelet gives it. Here the plugin is the real
CLI process, serving the CSI spec's own proto on a Unix socket; the test calls it as
the kubelet does (the one stand-in: no kubelet runs here).

The mounts are laid out as on a node: a "node" mount namespace whose pod directory is
a shared mount (the kubelet's view); the plugin in a mount namespace of its own that
shares it (Bidirectional propagation, as the DaemonSet's), the agent's directory
mounted read-only in it (its DaemonSet's volume); and a "pod" that bind-mounts the
published target at /run/clusterpulse in a mount namespace of its own, as a container
runtime does, in its own network and PID namespaces, as another uid. The agent names
that pod's rank by the kernel's word (its host pid and uid) and a hard restart reaches
it. Nothing outlives the test: the node namespace goes with its last process. Mounts
need root.
"""

from __future__ import annotations

import os
import shutil
import socket
import subprocess
import sys
import tempfile
from pathlib import Path

import grpc
import pytest
import requests

from clusterpulse.agent import csi
from clusterpulse.agent.csi_v1 import csi_pb2 as pb
from clusterpulse.agent.csi_v1 import csi_pb2_grpc as rpc
from tests.support.procs import REPO, free_port, wait_until
from tests.support.ranksock import RankProcess

pytestmark = pytest.mark.integration
needs_root = pytest.mark.skipif(
    os.geteuid() != 0 or not shutil.which("unshare") or not shutil.which("nsenter"),
    reason="mount namespaces need root, unshare and nsenter")
NOBODY = 65534


@pytest.fixture
def node():
    """A scratch directory (traversable by the pod's uid) and a "node" mount namespace
    (its pid) in which the kubelet's pod directory, base/pods, is a shared mount."""
    base = Path(tempfile.mkdtemp(prefix="cp-csi-", dir="/tmp"))
    os.chmod(base, 0o755)
    (base / "pods").mkdir(mode=0o755)
    holder = subprocess.Popen(["unshare", "--mount", "--propagation", "private", "sleep",
                               "600"])
    wait_until(lambda: os.readlink(f"/proc/{holder.pid}/ns/mnt")
               != os.readlink("/proc/self/ns/mnt"), 10, "the node's mount namespace")
    shared = in_ns(holder.pid, "sh", "-c", 'mount --bind "$0" "$0" && mount --make-shared "$0"',
                   str(base / "pods"))
    assert shared.returncode == 0, shared.stderr
    log = open(base / "plugin.log", "w")  # noqa: SIM115 (closed below)
    yield base, holder.pid, log
    holder.kill()
    holder.wait()
    log.close()
    shutil.rmtree(base, ignore_errors=True)


def in_ns(pid: int, *cmd: str) -> subprocess.CompletedProcess:
    """`cmd` in the mount namespace of process `pid` (and its root and working
    directory: entering a mount namespace resets both to the namespace's, which is not
    a chrooted test run's root)."""
    return subprocess.run(["nsenter", "--target", str(pid), "--mount", "--root", "--wd", "--",
                           *cmd], capture_output=True, text=True, timeout=30)


def start_plugin(base: Path, node_pid: int, log, socket_dir: str, *extra: str,
                 as_deployed: bool = True) -> tuple[subprocess.Popen, str]:
    """The plugin in a mount namespace of its own, child of the node's: its mounts
    under the shared pod directory reach the node's (Bidirectional propagation).
    `as_deployed`: the agent's directory mounted read-only in its namespace, as its
    DaemonSet's hostPath volume (readOnly: true) is; else `socket_dir` as it is."""
    endpoint = f"unix://{base}/plugin/csi.sock"
    view = base / "plugin-view"  # /run/clusterpulse in the plugin's container
    view.mkdir(exist_ok=True)
    container = ['mount --bind "$1" "$2" && mount -o remount,bind,ro "$2" || exit 1; '
                 'shift 2; exec "$@"', "csi", socket_dir, str(view)] if as_deployed else \
        ['exec "$@"', "csi"]
    p = subprocess.Popen(
        ["nsenter", "--target", str(node_pid), "--mount", "--root", "--wd", "--",
         "unshare", "--mount", "--propagation", "unchanged", "sh", "-c", *container,
         sys.executable, "-m", "clusterpulse.agent.csi", "--endpoint", endpoint,
         "--node-id", "k8s-a", "--socket-dir", str(view) if as_deployed else socket_dir,
         *extra], cwd=REPO, stdout=log, stderr=subprocess.STDOUT)
    wait_until(lambda: p.poll() is not None or (base / "plugin" / "csi.sock").exists(), 30,
               "the plugin's socket")
    assert p.poll() is None, (base / "plugin.log").read_text()
    return p, endpoint


def stop_plugin(proc: subprocess.Popen, base: Path) -> int:
    """SIGTERM, as the kubelet stops a pod; its exit status."""
    proc.terminate()
    try:
        return proc.wait(timeout=20)
    except subprocess.TimeoutExpired:
        proc.kill()
        proc.wait()
        raise AssertionError("the plugin did not stop on SIGTERM within 20 s; its log:\n"
                             + (base / "plugin.log").read_text()) from None


def publish_request(target: str, **over) -> pb.NodePublishVolumeRequest:
    """What the kubelet sends for a pod's inline `csi:` volume with `readOnly: true`."""
    fields = dict(
        volume_id="csi-6f1c0e", target_path=target, readonly=True,
        volume_capability=pb.VolumeCapability(
            mount=pb.VolumeCapability.MountVolume(),
            access_mode=pb.VolumeCapability.AccessMode(
                mode=pb.VolumeCapability.AccessMode.SINGLE_NODE_WRITER)),
        volume_context={csi.EPHEMERAL: "true", csi.POD: "train-0", csi.NAMESPACE: "ml",
                        "csi.storage.k8s.io/pod.uid": "6f1c0e",
                        "csi.storage.k8s.io/serviceAccount.name": "default"})
    fields.update(over)
    return pb.NodePublishVolumeRequest(**fields)


def mount_options(pid: int, path: Path) -> set[str] | None:
    """The options of the mount at `path` as process `pid`'s namespace sees it."""
    r = in_ns(pid, "findmnt", "--noheadings", "--output", "OPTIONS", "--mountpoint", str(path))
    if r.returncode != 0:
        return None
    (line,) = r.stdout.splitlines()  # one mount there: a retried publish stacks none
    return set(line.strip().split(","))


@needs_root
def test_a_pod_without_host_path_sends_telemetry_is_verified_and_restarted(node, sim_agent):
    base, node_pid, log = node
    socket_dir = os.path.dirname(sim_agent.socket_path)
    health = free_port()
    proc, endpoint = start_plugin(base, node_pid, log, socket_dir,
                                  "--health-listen", f"127.0.0.1:{health}")
    try:
        assert requests.get(f"http://127.0.0.1:{health}/healthz", timeout=5).status_code == 200
        channel = grpc.insecure_channel(endpoint)
        identity, plugin = rpc.IdentityStub(channel), rpc.NodeStub(channel)
        info = identity.GetPluginInfo(pb.GetPluginInfoRequest(), timeout=10)
        assert info.name == csi.DRIVER and info.vendor_version
        assert identity.Probe(pb.ProbeRequest(), timeout=10).ready.value
        assert plugin.NodeGetInfo(pb.NodeGetInfoRequest(), timeout=10).node_id == "k8s-a"
        # The kubelet's pod directory; it creates the parents, the plugin the mount point.
        target = base / "pods" / "6f1c0e" / "volumes" / "kubernetes.io~csi" / "cp" / "mount"
        target.parent.mkdir(parents=True)
        for d in list(target.parents)[:4]:
            os.chmod(d, 0o755)
        plugin.NodePublishVolume(publish_request(str(target)), timeout=10)
        plugin.NodePublishVolume(publish_request(str(target)), timeout=10)  # a retry: no-op
        assert not os.path.ismount(target)  # nothing leaked into this mount namespace
        # The kubelet (the node's namespace) sees it, read-only there too: nothing, not
        # the kubelet making a pod's missing subPath, makes a file in the agent's
        # directory (the agent would refuse to start beside a directory at its path).
        seen = mount_options(node_pid, target)
        assert seen is not None and "ro" in seen, seen
        made = in_ns(node_pid, "mkdir", f"{target}/telemetry.sock")
        assert made.returncode != 0 and "Read-only" in made.stderr, made

        # The pod: the volume bound where the rank looks, as a runtime does (no read-only
        # flag of its own here: what is read-only comes from the plugin), its own network
        # and PID namespaces (not its init: the trainer runs under torchrun), uid 65534.
        inside = base / "pod-root" / "run" / "clusterpulse"
        inside.mkdir(parents=True)
        for d in (inside, *list(inside.parents)[:2]):
            os.chmod(d, 0o755)
        runtime = ('mount --bind "$1" "$2" || exit 1; shift 2; exec 3<&0; "$@" <&3 & '
                   'wait $!')
        pod = ["nsenter", "--target", str(node_pid), "--mount", "--root", "--wd", "--",
               "unshare", "--mount", "--net", "--pid", "--fork", "--kill-child", "--",
               "sh", "-c", runtime, "pod", str(target), str(inside),
               "setpriv", f"--reuid={NOBODY}", f"--regid={NOBODY}", "--clear-groups"]
        sock = f"{inside}/{os.path.basename(sim_agent.socket_path)}"
        with RankProcess(sock, [{"type": "step", "run": "pod-run", "rank": 0,
                                 "local_rank": 0, "gpu": 1, "step": 3}], wrap=pod) as rank:
            (seen_rank,) = wait_until(
                lambda: [r for r in sim_agent.get("/v1/ranks").json()["ranks"]
                         if r["run"] == "pod-run"], 20, "the pod's rank")
            pid = seen_rank["pid"]
            assert seen_rank["uid"] == NOBODY, seen_rank  # the kernel's word, verified
            status = Path(f"/proc/{pid}/status").read_text()
            nspid = next(x for x in status.splitlines() if x.startswith("NSpid:")).split()[1:]
            # the host's pid of a process of the pod's PID namespace (not its init)
            assert len(nspid) == 2 and nspid[0] == str(pid) and nspid[1] != "1", status
            assert os.readlink(f"/proc/{pid}/ns/net") != os.readlink("/proc/self/ns/net")
            # Read-only in the pod, even for root: no pod can replace the agent's socket.
            assert "ro" in (mount_options(pid, inside) or set())
            touch = in_ns(pid, "touch", f"{inside}/agent.sock")
            assert touch.returncode != 0 and "Read-only" in touch.stderr, touch
            r = sim_agent.post("/v1/runs/pod-run/actions",
                               {"action": "restart", "reason": "test: the pod's rank hung"})
            assert r.status_code == 202, r.text
            wait_until(lambda: rank.p.poll() is not None, 30, "the pod's rank ended")
            assert not Path(f"/proc/{pid}").exists()

        plugin.NodeUnpublishVolume(pb.NodeUnpublishVolumeRequest(
            volume_id="csi-6f1c0e", target_path=str(target)), timeout=10)
        assert mount_options(node_pid, target) is None  # gone from the kubelet's view too
        assert not target.exists()
        plugin.NodeUnpublishVolume(pb.NodeUnpublishVolumeRequest(  # again: already done
            volume_id="csi-6f1c0e", target_path=str(target)), timeout=10)
    finally:
        assert stop_plugin(proc, base) == 0, (base / "plugin.log").read_text()


@needs_root
@pytest.mark.parametrize(("over", "says"), [
    ({"volume_context": {csi.POD: "train-0"}}, "ephemeral inline volumes only"),
    ({"readonly": False}, "readOnly: true"),
    ({"volume_capability": pb.VolumeCapability(block=pb.VolumeCapability.BlockVolume())},
     "no block volumes"),
    ({"target_path": "relative/mount"}, "must be absolute"),
])
def test_volumes_it_does_not_serve_are_refused_by_name_and_nothing_is_mounted(node, over,
                                                                              says):
    base, node_pid, log = node
    run = base / "run"
    run.mkdir(mode=0o755)
    proc, endpoint = start_plugin(base, node_pid, log, str(run))
    try:
        plugin = rpc.NodeStub(grpc.insecure_channel(endpoint))
        target = base / "pods" / "x" / "mount"
        with pytest.raises(grpc.RpcError) as err:
            plugin.NodePublishVolume(publish_request(str(target), **over), timeout=10)
        assert err.value.code() == grpc.StatusCode.INVALID_ARGUMENT
        assert says in err.value.details(), err.value.details()
        assert not target.exists()
    finally:
        stop_plugin(proc, base)
    assert "publish refused" in (base / "plugin.log").read_text()


@needs_root
def test_a_publish_that_fails_leaves_nothing_behind(node):
    """The agent's directory gone (an agent never started on the node): the bind fails,
    the kubelet is told why, and the mount point the plugin made is removed again."""
    base, node_pid, log = node
    proc, endpoint = start_plugin(base, node_pid, log, str(base / "no-agent-here"),
                                  as_deployed=False)
    try:
        plugin = rpc.NodeStub(grpc.insecure_channel(endpoint))
        assert not rpc.IdentityStub(grpc.insecure_channel(endpoint)).Probe(
            pb.ProbeRequest(), timeout=10).ready.value
        target = base / "pods" / "y" / "mount"
        with pytest.raises(grpc.RpcError) as err:
            plugin.NodePublishVolume(publish_request(str(target)), timeout=10)
        assert err.value.code() == grpc.StatusCode.INTERNAL
        assert "No such file or directory" in err.value.details(), err.value.details()
        assert not target.exists() and target.parent.exists()
    finally:
        stop_plugin(proc, base)


def test_the_command_says_what_it_needs():
    out = subprocess.run([sys.executable, "-m", "clusterpulse.agent.csi", "--help"],
                         cwd=REPO, capture_output=True, text=True, timeout=60)
    assert out.returncode == 0 and "examples:" in out.stdout and csi.DRIVER in out.stdout
    bad = subprocess.run([sys.executable, "-m", "clusterpulse.agent.csi", "--node-id", "n",
                          "--endpoint", "tcp://0.0.0.0:1"], cwd=REPO, capture_output=True,
                         text=True, timeout=60, env={**os.environ, "NODE_NAME": ""})
    assert bad.returncode == 2 and "--endpoint must be unix:///PATH" in bad.stderr, bad
    assert "Traceback" not in bad.stderr
    # the probes' address held by another process, or not HOST:PORT: the address and
    # why, in one line (a held port gave Errno 98 without the address)
    with socket.socket() as held:
        held.bind(("127.0.0.1", 0))
        held.listen()
        taken = f"127.0.0.1:{held.getsockname()[1]}"
        for listen, why in ((taken, f"cannot listen on {taken}: Address already in use"),
                            ("127.0.0.1:http", "--health-listen must be HOST:PORT")):
            r = subprocess.run([sys.executable, "-m", "clusterpulse.agent.csi", "--node-id",
                                "n", "--socket-dir", "/nonexistent/agent-dir",
                                "--health-listen", listen], cwd=REPO, capture_output=True,
                               text=True, timeout=60)
            assert r.returncode == 2 and why in r.stderr, r
            assert r.stderr.count("\n") == 1, r.stderr
    # the agent's directory mounted read-write: binds from it would be writable by pods
    rw = subprocess.run([sys.executable, "-m", "clusterpulse.agent.csi", "--node-id", "n",
                         "--endpoint", "unix:///tmp/cp-csi-never/csi.sock", "--socket-dir",
                         "/tmp"], cwd=REPO, capture_output=True, text=True, timeout=60)
    assert rw.returncode == 2 and "mounted read-write here" in rw.stderr, rw
    assert not os.path.exists("/tmp/cp-csi-never")  # refused before anything was made
    # a socket path too long for AF_UNIX: grpc cannot bind it (it raised, a traceback)
    long = subprocess.run([sys.executable, "-m", "clusterpulse.agent.csi", "--node-id", "n",
                           "--socket-dir", "/nonexistent/agent-dir",
                           "--endpoint", f"unix:///tmp/{'x' * 120}/csi.sock"], cwd=REPO,
                          capture_output=True, text=True, timeout=60)
    assert long.returncode == 2 and "cannot listen on" in long.stderr, long
    assert "Traceback" not in long.stderr
    shutil.rmtree(f"/tmp/{'x' * 120}", ignore_errors=True)


def test_a_file_or_a_live_plugin_at_the_endpoint_is_left_alone(tmp_path):
    """The plugin cleared its endpoint with a bare unlink: a mistyped --endpoint
    deleted whatever file was there, and a second plugin took a live one's socket."""
    kept = tmp_path / "notes.txt"
    kept.write_text("keep me")
    with socket.socket(socket.AF_UNIX, socket.SOCK_STREAM) as live, \
            socket.socket(socket.AF_UNIX, socket.SOCK_STREAM) as frozen, \
            socket.socket(socket.AF_UNIX, socket.SOCK_STREAM) as waiting:
        live.bind(str(tmp_path / "live.sock"))
        live.listen()
        # a plugin that stopped accepting: its backlog full, a connect gets EAGAIN
        frozen.bind(str(tmp_path / "frozen.sock"))
        frozen.listen(0)
        waiting.connect(str(tmp_path / "frozen.sock"))
        for path, why in ((kept, "exists and is not a socket"),
                          (tmp_path / "live.sock", "another plugin is listening on"),
                          (tmp_path / "frozen.sock", "another plugin is listening on")):
            r = subprocess.run([sys.executable, "-m", "clusterpulse.agent.csi", "--node-id",
                                "n", "--socket-dir", "/nonexistent/agent-dir",
                                "--endpoint", f"unix://{path}"], cwd=REPO,
                               capture_output=True, text=True, timeout=60)
            assert r.returncode == 2 and why in r.stderr and str(path) in r.stderr, r
            assert "Traceback" not in r.stderr
        assert (tmp_path / "live.sock").is_socket() and (tmp_path / "frozen.sock").is_socket()
    assert kept.read_text() == "keep me"


def test_without_the_kubernetes_extra_it_says_which_to_install():
    blocked = ("import importlib.abc, sys\n"
               "class NotInstalled(importlib.abc.MetaPathFinder):\n"
               "    def find_spec(self, name, path=None, target=None):\n"
               "        if name.partition('.')[0] in ('grpc', 'google'):\n"
               "            raise ModuleNotFoundError(name, name=name)\n"
               "sys.meta_path.insert(0, NotInstalled())\n"
               "from clusterpulse.agent.csi import main\n"
               "raise SystemExit(main(['--node-id', 'n']))\n")
    r = subprocess.run([sys.executable, "-c", blocked], cwd=REPO, capture_output=True,
                       text=True, timeout=60)
    assert r.returncode == 2 and r.stderr.splitlines() == [
        "clusterpulse-csi needs the kubernetes extra (grpc is missing): "
        "pip install 'clusterpulse[kubernetes]'"], r.stderr
