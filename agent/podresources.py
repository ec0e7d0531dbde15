"""Which pod holds each GPU, from the kubelet's PodResources API (gRPC, Unix socket).

The kubelet is the only party that knows which container the device plugin gave a
GPU to; dcgm-exporter reads the same API. The agent asks it on its own thread, with a
timeout, and the scrape reads the last answer: a kubelet that is absent, restarting
or slow costs a counted error and an ageing answer, never a blocked or failed
collection.

Device ids, as the NVIDIA device plugin hands them out: the GPU's UUID
("GPU-..."), a MIG device ("MIG-GPU-<uuid>/<gi>/<ci>" with old drivers, "MIG-<uuid>"
with new ones: only the first names its parent GPU), a time-slicing replica
("<uuid>::<n>": several containers share the GPU, each is an owner), or the GPU's index
with the plugin's `index` device-id strategy.
"""

from __future__ import annotations

import logging
import threading
import time
from collections import Counter
from dataclasses import dataclass

log = logging.getLogger(__name__)

DEFAULT_SOCKET = "unix:///var/lib/kubelet/pod-resources/kubelet.sock"
GPU_RESOURCE_PREFIX = "nvidia.com/"  # nvidia.com/gpu and the MIG profiles nvidia.com/mig-*
MAX_MESSAGE_BYTES = 16 << 20  # the kubelet's own limit on this API's answers


class PodResourcesUnavailable(Exception):
    """grpcio or protobuf is not installed: the `kubernetes` extra is needed."""


@dataclass(frozen=True)
class Owner:
    """A container the kubelet assigned a device to."""

    pod: str
    namespace: str
    container: str
    device_id: str  # as the device plugin named it (UUID, MIG id or index)


def parse_target(text: str) -> str:
    """`unix:///path` or `unix:/path` -> a gRPC target; anything else is refused, since
    the kubelet serves this API on a local socket only."""
    if text.startswith("unix://"):
        path = text.removeprefix("unix://")
    elif text.startswith("unix:"):
        path = text.removeprefix("unix:")
    else:
        raise ValueError(f"must be unix:///PATH (the kubelet's socket, e.g. {DEFAULT_SOCKET}), "
                         f"got {text!r}")
    if not path.startswith("/"):
        raise ValueError(f"socket path must be absolute, got {text!r}")
    return "unix://" + path


def gpu_of(device_id: str) -> str:
    """The GPU a device id names: its UUID, the parent UUID of an old-style MIG id, the
    GPU of a time-slicing replica ("<uuid>::<n>"), or the id unchanged (a new-style MIG
    UUID or an index, matched as such)."""
    device_id = device_id.split("::", 1)[0]
    if device_id.startswith("MIG-GPU-"):
        return device_id.removeprefix("MIG-").split("/", 1)[0]
    return device_id


class PodResources:
    """The kubelet's device assignments, refreshed every `refresh_s` on a thread."""

    def __init__(self, target: str, timeout_s: float = 2.0, refresh_s: float = 10.0) -> None:
        try:
            import grpc

            from clusterpulse.agent.podresources_v1 import api_pb2, api_pb2_grpc
        except ImportError as err:
            raise PodResourcesUnavailable(
                f"--pod-resources needs grpcio and protobuf ({err.name} is missing): "
                "pip install 'clusterpulse[kubernetes]'") from None
        self.target = parse_target(target)
        self.timeout_s = timeout_s
        self.refresh_s = refresh_s
        self._grpc = grpc
        self._request = api_pb2.ListPodResourcesRequest()
        # gRPC waits up to 2 min between reconnects by default: a restarted kubelet
        # would stay unseen that long. Try again at each refresh instead.
        self._channel = grpc.insecure_channel(self.target, options=[
            ("grpc.max_receive_message_length", MAX_MESSAGE_BYTES),
            ("grpc.initial_reconnect_backoff_ms", 1000),
            ("grpc.max_reconnect_backoff_ms", int(refresh_s * 1000))])
        self._stub = api_pb2_grpc.PodResourcesListerStub(self._channel)
        self._owners: dict[str, list[Owner]] = {}
        self.last_success = 0.0  # Unix time of the last answer (0: none yet)
        self.errors: Counter[str] = Counter()
        self._stop = threading.Event()
        self._thread: threading.Thread | None = None

    def refresh(self) -> bool:
        """Ask the kubelet once; keep the last answer if it does not give one."""
        try:
            reply = self._stub.List(self._request, timeout=self.timeout_s)
        except self._grpc.RpcError as err:
            code = err.code() if callable(getattr(err, "code", None)) else None
            kind = code.name.lower() if code is not None else "rpc_error"
            if not self.errors[kind]:
                log.warning("kubelet PodResources at %s: %s (GPU pod labels keep the last "
                            "answer)", self.target, kind)
            self.errors[kind] += 1
            return False
        owners: dict[str, list[Owner]] = {}
        for pod in reply.pod_resources:
            for c in pod.containers:
                for dev in c.devices:
                    if not dev.resource_name.startswith(GPU_RESOURCE_PREFIX):
                        continue
                    for device_id in dev.device_ids:
                        owners.setdefault(gpu_of(device_id), []).append(
                            Owner(pod.name, pod.namespace, c.name, device_id))
        self._owners = owners  # one assignment: readers see the old or the new map
        self.last_success = time.time()
        return True

    def owners(self) -> dict[str, list[Owner]]:
        """GPU UUID (or index, or MIG UUID) -> the containers holding it."""
        return self._owners

    def start(self) -> None:
        self.refresh()
        self._thread = threading.Thread(target=self._loop, name="agent-pod-resources",
                                        daemon=True)
        self._thread.start()

    def _loop(self) -> None:
        while not self._stop.wait(self.refresh_s):
            try:
                self.refresh()
            except Exception:  # a decoding bug must not end the refreshes
                log.exception("PodResources refresh failed")
                self.errors["internal"] += 1

    def close(self) -> None:
        self._stop.set()
        if self._thread is not None:
            self._thread.join(timeout=5)
        self._channel.close()
