"""The telemetry socket in a training pod without a hostPath: a CSI node plugin.

A training pod reached the agent's socket through a hostPath volume, which Pod Security
"baseline" forbids, so every training namespace had to be `privileged` (issue #25).
Kubernetes' own answer for a node-local socket is a CSI driver serving an *ephemeral
inline volume* (the way SPIFFE's CSI driver hands pods the SPIRE Workload API): the pod
names the driver in its volumes, a kind of volume baseline and restricted both admit,
and the kubelet asks this plugin, on the node, to publish the volume at the pod's
target path. The plugin bind-mounts the agent's socket directory there. Read-only, so
that no pod can replace the socket and impersonate the agent, nor make a file in the
directory (the kubelet makes a missing `subPath` inside a volume, read-only or not):
the directory is mounted read-only into the plugin's container, and a bind taken from a
read-only mount is read-only, in the kubelet's copy of it too (the flags of a remount
after the bind would not reach that copy). The plugin also serves only volumes the pod
marks `readOnly: true`, which the kubelet mounts read-only into the containers and,
for CSI volumes, never relabels for SELinux.

Identity is unchanged by it: the rank connects to the same Unix socket, so the kernel
still names the connecting process (pid in the agent's, the host's, PID namespace, its
uid) and the agent pins it with a pidfd and signals it as on any node (see
agent.channel and docs/security.md). No token to steal or replay, and no API server
call per rank. The cost: this plugin runs privileged (it mounts into the kubelet's pod
directories, with Bidirectional mount propagation), in the agent's namespace, which is
privileged already; the training pods are not.

Only the CSI calls a node plugin of ephemeral volumes needs are served (Identity and
Node: publish and unpublish); the rest answer UNIMPLEMENTED, as the spec allows.
"""

from __future__ import annotations

import argparse
import contextlib
import ctypes
import ctypes.util
import errno
import logging
import os
import signal
import sys
import threading
from concurrent import futures
from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer
from pathlib import Path

from clusterpulse import __version__
from clusterpulse.agent.channel import remove_stale_socket
from clusterpulse.agent.httpsafe import listen_address
from clusterpulse.agent.logsetup import setup_logging
from clusterpulse.agent.protocol import DEFAULT_SOCKET_PATH

log = logging.getLogger(__name__)

DRIVER = "telemetry.clusterpulse.io"  # the CSIDriver object's name; pods name it
DEFAULT_ENDPOINT = f"unix:///var/lib/kubelet/plugins/{DRIVER}/csi.sock"
EPHEMERAL = "csi.storage.k8s.io/ephemeral"  # set by the kubelet for inline volumes
POD = "csi.storage.k8s.io/pod.name"
NAMESPACE = "csi.storage.k8s.io/pod.namespace"
MS_BIND = 4096  # mount(2) (linux/mount.h)

EXAMPLES = """\
examples:
  # in the agent's DaemonSet, beside the kubelet's node-driver-registrar
  clusterpulse-csi --node-id "$NODE_NAME" --socket-dir /run/clusterpulse \\
      --endpoint unix:///csi/csi.sock --health-listen 0.0.0.0:9808

  # a training pod then mounts the agent's socket without a hostPath:
  #   volumes: [{name: clusterpulse, csi: {driver: telemetry.clusterpulse.io,
  #                                        readOnly: true}}]
  #   env: CLUSTERPULSE_AGENT=unix:/run/clusterpulse/telemetry.sock
"""


class MountError(OSError):
    """mount(2) or umount2(2) failed; the text names the call and the path."""


def _libc() -> ctypes.CDLL:
    return ctypes.CDLL(ctypes.util.find_library("c") or "libc.so.6", use_errno=True)


def bind(source: str, target: str) -> None:
    if _libc().mount(source.encode(), target.encode(), None, MS_BIND, None) != 0:
        err = ctypes.get_errno()
        raise MountError(err, f"mount --bind {source} {target}: {os.strerror(err)}")


def unmount(target: str) -> None:
    if _libc().umount2(target.encode(), 0) != 0:
        err = ctypes.get_errno()
        raise MountError(err, f"umount {target}: {os.strerror(err)}")


def _unescape(field: str) -> str:
    """/proc/self/mountinfo escapes space, tab, newline and backslash as octal."""
    return field.encode().decode("unicode_escape").encode("latin-1").decode(
        "utf-8", "replace")


def is_mount_point(path: str) -> bool:
    """Whether `path` is a mount point in this mount namespace (os.path.ismount misses
    a bind mount of a directory of the same filesystem)."""
    target = os.path.realpath(path)
    with open("/proc/self/mountinfo", encoding="utf-8", errors="replace") as f:
        return any(_unescape(line.split()[4]) == target for line in f if line.strip())


class Publisher:
    """Publishes the socket directory at pod volumes' target paths and takes it back."""

    def __init__(self, socket_dir: str) -> None:
        self.socket_dir = os.path.realpath(socket_dir)
        self._lock = threading.Lock()  # the kubelet may call for two pods at once

    def publish(self, target: str) -> None:
        with self._lock:
            made = not os.path.isdir(target)
            Path(target).mkdir(mode=0o755, parents=True, exist_ok=True)
            if is_mount_point(target):
                return  # published already: the kubelet retries after a timeout
            try:
                bind(self.socket_dir, target)
            except OSError:
                if made:  # a failed publish leaves nothing behind (the CSI spec)
                    with contextlib.suppress(OSError):
                        os.rmdir(target)
                raise

    def unpublish(self, target: str) -> None:
        with self._lock:
            while is_mount_point(target):  # a mount stacked by a retried publish too
                unmount(target)
            with contextlib.suppress(FileNotFoundError):
                os.rmdir(target)


def _servicers(publisher: Publisher, node_id: str, version: str):
    """The Identity and Node servicers (classes built here: grpc is imported late, so
    that a missing `kubernetes` extra is one line, not a traceback)."""
    import grpc

    from clusterpulse.agent.csi_v1 import csi_pb2 as pb
    from clusterpulse.agent.csi_v1 import csi_pb2_grpc as rpc

    class Identity(rpc.IdentityServicer):
        def GetPluginInfo(self, request, context):
            return pb.GetPluginInfoResponse(name=DRIVER, vendor_version=version)

        def GetPluginCapabilities(self, request, context):
            return pb.GetPluginCapabilitiesResponse()  # a node plugin: no controller

        def Probe(self, request, context):
            # Ready while the agent's directory is there to publish: the agent's socket
            # need not be (a pod published before the agent starts sees it appear).
            return pb.ProbeResponse(ready={"value": os.path.isdir(publisher.socket_dir)})

    class Node(rpc.NodeServicer):
        def NodeGetInfo(self, request, context):
            return pb.NodeGetInfoResponse(node_id=node_id)

        def NodeGetCapabilities(self, request, context):
            return pb.NodeGetCapabilitiesResponse()  # no staging, no stats

        def NodePublishVolume(self, request, context):
            problem = _refuse(request)
            if problem:
                log.warning("publish refused: %s", problem)
                context.abort(grpc.StatusCode.INVALID_ARGUMENT, problem)
            ctx = request.volume_context
            try:
                publisher.publish(request.target_path)
            except OSError as err:
                log.warning("publish %s for pod %s/%s failed: %s", request.volume_id,
                            ctx.get(NAMESPACE, "?"), ctx.get(POD, "?"), err)
                context.abort(grpc.StatusCode.INTERNAL, str(err))
            log.info("published %s at %s for pod %s/%s", publisher.socket_dir,
                     request.target_path, ctx.get(NAMESPACE, "?"), ctx.get(POD, "?"))
            return pb.NodePublishVolumeResponse()

        def NodeUnpublishVolume(self, request, context):
            if not request.volume_id or not request.target_path:
                context.abort(grpc.StatusCode.INVALID_ARGUMENT,
                              "volume_id and target_path are required")
            try:
                publisher.unpublish(request.target_path)
            except OSError as err:
                log.warning("unpublish %s failed: %s", request.target_path, err)
                context.abort(grpc.StatusCode.INTERNAL, str(err))
            return pb.NodeUnpublishVolumeResponse()

    return Identity(), Node(), rpc


def _refuse(request) -> str:
    """Why a NodePublishVolume request is not one this driver serves ("" if it is)."""
    if not request.volume_id or not request.target_path:
        return "volume_id and target_path are required"
    if not os.path.isabs(request.target_path):
        return f"target_path must be absolute, got {request.target_path!r}"
    if not request.HasField("volume_capability") or \
            not request.volume_capability.HasField("mount"):
        return "a mount volume capability is required (this driver has no block volumes)"
    if request.volume_context.get(EPHEMERAL) != "true":
        return (f"{DRIVER} serves ephemeral inline volumes only (a pod's `csi:` volume); "
                "it has no PersistentVolumes")
    if not request.readonly:
        return f"the volume must be read-only: set `readOnly: true` on the pod's {DRIVER} volume"
    return ""


def parse_endpoint(text: str) -> str:
    """`unix:///path` or `unix:/path` -> the socket's path; anything else is refused (the
    kubelet reaches node plugins over a local socket only)."""
    if text.startswith("unix://"):
        path = text.removeprefix("unix://")
    elif text.startswith("unix:"):
        path = text.removeprefix("unix:")
    else:
        raise ValueError(f"--endpoint must be unix:///PATH, got {text!r}")
    if not path.startswith("/"):
        raise ValueError(f"--endpoint's path must be absolute, got {text!r}")
    return path


def serve(endpoint: str, socket_dir: str, node_id: str, version: str):
    """The started gRPC server (stop it with .stop(grace))."""
    import grpc

    path = parse_endpoint(endpoint)
    with contextlib.suppress(FileNotFoundError):  # missing: Probe says so, publishes fail
        if not os.statvfs(socket_dir).f_flag & os.ST_RDONLY:
            raise ValueError(f"--socket-dir {socket_dir} is mounted read-write here; mount it "
                             "read-only (readOnly: true): binds taken from it would let pods "
                             "make files in the agent's directory")
    Path(path).parent.mkdir(parents=True, exist_ok=True)
    # a stale socket of a plugin that died goes (the kubelet redials); a live plugin's
    # socket or a file that is not a socket stays, and this one does not start
    remove_stale_socket(path, "another plugin")
    identity, node, rpc = _servicers(Publisher(socket_dir), node_id, version)
    server = grpc.server(futures.ThreadPoolExecutor(max_workers=4))
    rpc.add_IdentityServicer_to_server(identity, server)
    rpc.add_NodeServicer_to_server(node, server)
    try:
        bound = server.add_insecure_port(f"unix://{path}")
    except RuntimeError:  # grpc's word for a socket it could not bind
        bound = 0
    if not bound:
        raise OSError(errno.EADDRNOTAVAIL, f"cannot listen on {endpoint} (the directory "
                      "must be writable by this user, the path at most 107 bytes)")
    server.start()
    return server


def serve_health(listen: str, publisher_dir: str, endpoint: str) -> ThreadingHTTPServer:
    """/healthz for the kubelet's probes: 200 while the plugin's gRPC socket and the
    agent's directory are there, 503 otherwise (a deleted socket leaves the kubelet
    unable to reach the plugin: restarting it makes the socket again). Whether the
    agent is up is the agent's own probe's business: a publish does not need it."""
    host, port = listen_address(listen, "--health-listen")
    grpc_socket = parse_endpoint(endpoint)

    class Health(BaseHTTPRequestHandler):
        def do_GET(self) -> None:
            if self.path != "/healthz":
                self.send_error(404)
                return
            ok = os.path.exists(grpc_socket) and os.path.isdir(publisher_dir)
            body = b"ok\n" if ok else b"the plugin's socket or the agent's directory is gone\n"
            self.send_response(200 if ok else 503)
            self.send_header("Content-Type", "text/plain")
            self.send_header("Content-Length", str(len(body)))
            self.end_headers()
            self.wfile.write(body)

        def log_message(self, *args: object) -> None:  # probes every few seconds: quiet
            pass

    server = ThreadingHTTPServer((host, port), Health)
    threading.Thread(target=server.serve_forever, name="csi-health", daemon=True).start()
    return server


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(
        prog="clusterpulse-csi", description=__doc__, epilog=EXAMPLES,
        formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--endpoint", default=DEFAULT_ENDPOINT,
                   help=f"where the kubelet calls this plugin (default: {DEFAULT_ENDPOINT})")
    p.add_argument("--socket-dir", default=os.path.dirname(DEFAULT_SOCKET_PATH),
                   help="the agent's telemetry socket directory, published into pods "
                        "(default: %(default)s)")
    p.add_argument("--node-id", default=os.environ.get("NODE_NAME", ""),
                   help="this node's name (default: $NODE_NAME)")
    p.add_argument("--health-listen", default="",
                   help="HOST:PORT of /healthz for the kubelet's probes (default: none)")
    p.add_argument("--log-level", default="info", choices=["debug", "info", "warning"])
    args = p.parse_args(argv)
    setup_logging(args.log_level)
    if not args.node_id:
        p.error("--node-id (or $NODE_NAME, from the downward API's spec.nodeName) is required")
    try:
        import grpc  # noqa: F401

        from clusterpulse.agent.csi_v1 import csi_pb2  # noqa: F401 (needs protobuf)
    except ImportError as err:
        print(f"clusterpulse-csi needs the kubernetes extra ({err.name} is missing): "
              "pip install 'clusterpulse[kubernetes]'", file=sys.stderr)
        return 2
    stop = threading.Event()  # set before serving: a SIGTERM at start is not lost
    for sig in (signal.SIGTERM, signal.SIGINT):
        signal.signal(sig, lambda *_: stop.set())
    if args.health_listen:  # first: its 503 until the plugin's socket is there is right
        try:
            serve_health(args.health_listen, args.socket_dir, args.endpoint)
        except ValueError as err:  # names the flag
            print(f"clusterpulse-csi: {err}", file=sys.stderr)
            return 2
        except OSError as err:
            print(f"clusterpulse-csi: cannot listen on {args.health_listen}: "
                  f"{err.strerror or err}", file=sys.stderr)
            return 2
    try:
        server = serve(args.endpoint, args.socket_dir, args.node_id, __version__)
    except (OSError, ValueError) as err:
        print(f"clusterpulse-csi: {err}", file=sys.stderr)
        return 2
    log.info("serving %s for node %s on %s (publishing %s)", DRIVER, args.node_id,
             args.endpoint, args.socket_dir)
    while not stop.wait(1):
        pass
    server.stop(2).wait(10)
    return 0


if __name__ == "__main__":
    sys.exit(main())
