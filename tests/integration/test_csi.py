"""A training pod at Pod Security "baseline" reaches the agent (issue #25 item 5).

No hostPath, no hostNetwork, no hostPID: the pod's volume is an ephemeral inline CSI
volume of ClusterPulse's node plugin (agent/csi.py), which bind-mounts the agent's
socket directory, read-only, at the target path the kubelet gives it. Here the plugin
is the real CLI process, serving the CSI spec's own proto on a Unix socket; the test
calls it as the kubelet does (the one stand-in: no kubelet runs here). The "pod" is a
process in its own network and PID namespaces, as another uid, that sees the socket
only through the published volume: the agent names it by the kernel's word (its host
pid and uid) and a hard restart reaches it.

Mounts need root; the plugin runs in a mount namespace of its own, so nothing it
mounts outlives the test.
"""

from __future__ import annotations

import os
import shutil
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
    os.geteuid() != 0 or not shutil.which("unshare"),
    reason="mounting in a mount namespace of its own needs root and unshare")
NOBODY = 65534


@pytest.fixture
def plugin():
    """The plugin CLI in a private mount namespace, its gRPC stubs, and its pid."""
    base = Path(tempfile.mkdtemp(prefix="cp-csi-", dir="/tmp"))
    os.chmod(base, 0o755)  # the pod's uid must traverse to its volume
    endpoint = f"unix://{base}/plugin/csi.sock"
    log = open(base / "plugin.log", "w")  # noqa: SIM115 (closed below)
    yield base, endpoint, log
    log.close()
    shutil.rmtree(base, ignore_errors=True)


def start_plugin(base: Path, endpoint: str, log, socket_dir: str,
                 *extra: str) -> subprocess.Popen:
    p = subprocess.Popen(
        ["unshare", "--mount", "--propagation", "private", sys.executable, "-m",
         "clusterpulse.agent.csi", "--endpoint", endpoint, "--node-id", "k8s-a",
         "--socket-dir", socket_dir, *extra], cwd=REPO, stdout=log, stderr=subprocess.STDOUT)
    wait_until(lambda: p.poll() is not None or (base / "plugin" / "csi.sock").exists(), 30,
               "the plugin's socket")
    assert p.poll() is None, (base / "plugin.log").read_text()
    return p


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


def in_plugin_ns(pid: int, *cmd: str) -> subprocess.CompletedProcess:
    return subprocess.run(["nsenter", "--target", str(pid), "--mount", "--", *cmd],
                          capture_output=True, text=True, timeout=30)


@needs_root
def test_a_pod_without_host_path_sends_telemetry_is_verified_and_restarted(plugin, sim_agent):
    base, endpoint, log = plugin
    socket_dir = os.path.dirname(sim_agent.socket_path)
    health = free_port()
    proc = start_plugin(base, endpoint, log, socket_dir, "--health-listen", f"127.0.0.1:{health}")
    try:
        assert requests.get(f"http://127.0.0.1:{health}/healthz", timeout=5).status_code == 200
        channel = grpc.insecure_channel(endpoint)
        identity, node = rpc.IdentityStub(channel), rpc.NodeStub(channel)
        info = identity.GetPluginInfo(pb.GetPluginInfoRequest(), timeout=10)
        assert info.name == csi.DRIVER and info.vendor_version
        assert identity.Probe(pb.ProbeRequest(), timeout=10).ready.value
        assert node.NodeGetInfo(pb.NodeGetInfoRequest(), timeout=10).node_id == "k8s-a"
        # The kubelet's pod directory; it creates the parents, the plugin the mount point.
        target = base / "pods" / "6f1c0e" / "volumes" / "kubernetes.io~csi" / "cp" / "mount"
        target.parent.mkdir(parents=True)
        for d in (base / "pods", *list(target.parents)[:4]):
            os.chmod(d, 0o755)
        node.NodePublishVolume(publish_request(str(target)), timeout=10)
        node.NodePublishVolume(publish_request(str(target)), timeout=10)  # a retry: no-op
        assert not os.path.ismount(target)  # nothing leaked into this mount namespace
        mounts = in_plugin_ns(proc.pid, "findmnt", "--noheadings", "--output", "OPTIONS",
                              str(target))
        assert mounts.returncode == 0, mounts.stderr
        assert len(mounts.stdout.splitlines()) == 1, mounts.stdout  # the retry stacked none
        assert {"ro", "nosuid", "nodev", "noexec"} <= set(mounts.stdout.strip().split(",")), \
            mounts.stdout
        # Read-only even for root: a pod cannot replace the socket and impersonate the agent.
        touch = in_plugin_ns(proc.pid, "touch", f"{target}/agent.sock")
        assert touch.returncode != 0 and "Read-only" in touch.stderr, touch

        # The pod: its own network and PID namespaces, uid 65534, the volume its only way
        # to the agent; not its PID namespace's init (the trainer runs under torchrun or
        # a shell there, as in a container).
        sock = f"{target}/{os.path.basename(sim_agent.socket_path)}"
        pod = ["nsenter", "--target", str(proc.pid), "--mount", "--",
               "unshare", "--net", "--pid", "--fork", "--kill-child", "--",
               "sh", "-c", 'exec 3<&0; "$@" <&3 & wait $!', "pod",
               "setpriv", f"--reuid={NOBODY}", f"--regid={NOBODY}", "--clear-groups"]
        with RankProcess(sock, [{"type": "step", "run": "pod-run", "rank": 0,
                                 "local_rank": 0, "gpu": 1, "step": 3}], wrap=pod) as rank:
            (seen,) = wait_until(lambda: [r for r in sim_agent.get("/v1/ranks").json()["ranks"]
                                          if r["run"] == "pod-run"], 20, "the pod's rank")
            assert seen["uid"] == NOBODY, seen  # the kernel's word, verified
            status = Path(f"/proc/{seen['pid']}/status").read_text()
            nspid = next(x for x in status.splitlines() if x.startswith("NSpid:")).split()[1:]
            assert nspid == [str(seen["pid"]), "2"], status  # the host's pid of the pod's pid 2
            assert os.readlink(f"/proc/{seen['pid']}/ns/net") != os.readlink("/proc/self/ns/net")
            r = sim_agent.post("/v1/runs/pod-run/actions",
                               {"action": "restart", "reason": "test: the pod's rank hung"})
            assert r.status_code == 202, r.text
            wait_until(lambda: rank.p.poll() is not None, 30, "the pod's rank ended")
            assert not Path(f"/proc/{seen['pid']}").exists()

        node.NodeUnpublishVolume(pb.NodeUnpublishVolumeRequest(
            volume_id="csi-6f1c0e", target_path=str(target)), timeout=10)
        assert not target.exists()
        assert in_plugin_ns(proc.pid, "findmnt", str(target)).returncode != 0
        node.NodeUnpublishVolume(pb.NodeUnpublishVolumeRequest(  # again: already done
            volume_id="csi-6f1c0e", target_path=str(target)), timeout=10)
    finally:
        proc.terminate()
        assert proc.wait(timeout=20) == 0, (base / "plugin.log").read_text()


@needs_root
@pytest.mark.parametrize(("over", "says"), [
    ({"volume_context": {csi.POD: "train-0"}}, "ephemeral inline volumes only"),
    ({"readonly": False}, "readOnly: true"),
    ({"volume_capability": pb.VolumeCapability(block=pb.VolumeCapability.BlockVolume())},
     "no block volumes"),
    ({"target_path": "relative/mount"}, "must be absolute"),
])
def test_volumes_it_does_not_serve_are_refused_by_name_and_nothing_is_mounted(plugin, over,
                                                                              says):
    base, endpoint, log = plugin
    run = base / "run"
    run.mkdir(mode=0o755)
    proc = start_plugin(base, endpoint, log, str(run))
    try:
        node = rpc.NodeStub(grpc.insecure_channel(endpoint))
        target = base / "pods" / "x" / "mount"
        with pytest.raises(grpc.RpcError) as err:
            node.NodePublishVolume(publish_request(str(target), **over), timeout=10)
        assert err.value.code() == grpc.StatusCode.INVALID_ARGUMENT
        assert says in err.value.details(), err.value.details()
        assert not target.exists()
    finally:
        proc.terminate()
        proc.wait(timeout=20)
    assert "publish refused" in (base / "plugin.log").read_text()


def test_the_command_says_what_it_needs():
    out = subprocess.run([sys.executable, "-m", "clusterpulse.agent.csi", "--help"],
                         cwd=REPO, capture_output=True, text=True, timeout=60)
    assert out.returncode == 0 and "examples:" in out.stdout and csi.DRIVER in out.stdout
    bad = subprocess.run([sys.executable, "-m", "clusterpulse.agent.csi", "--node-id", "n",
                          "--endpoint", "tcp://0.0.0.0:1"], cwd=REPO, capture_output=True,
                         text=True, timeout=60, env={**os.environ, "NODE_NAME": ""})
    assert bad.returncode == 2 and "--endpoint must be unix:///PATH" in bad.stderr, bad
    assert "Traceback" not in bad.stderr


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
