"""Which pod holds each GPU (issue #25 item 4), from the kubelet's PodResources API.

The stand-in is a real gRPC server of the kubelet's own proto (v1.PodResourcesLister)
on a Unix socket, as the kubelet serves it; the agent is the real CLI process. A
kubelet that is absent or slow costs a counted error, never a blocked scrape."""

from __future__ import annotations

import threading
import time
import uuid as uuidlib
from concurrent import futures

import grpc
import pytest
import requests
from prometheus_client.parser import text_string_to_metric_families

from clusterpulse.agent.podresources import PodResources, gpu_of
from clusterpulse.agent.podresources_v1 import api_pb2, api_pb2_grpc
from tests.conftest import socket_path
from tests.support.procs import start_agent_cli, wait_until

pytestmark = pytest.mark.integration
NODE = "k8s-a"


def sim_uuid(node: str, gpu: int) -> str:
    """The UUID the simulator gives a GPU (deterministic per node and index)."""
    return "GPU-" + str(uuidlib.uuid5(uuidlib.NAMESPACE_DNS, f"{node}/{gpu}"))


def pods() -> api_pb2.ListPodResourcesResponse:
    dev = api_pb2.ContainerDevices
    return api_pb2.ListPodResourcesResponse(pod_resources=[
        api_pb2.PodResources(name="train-0", namespace="ml", containers=[
            api_pb2.ContainerResources(name="trainer", devices=[
                dev(resource_name="nvidia.com/gpu", device_ids=[sim_uuid(NODE, 1)]),
                dev(resource_name="example.com/fpga", device_ids=[sim_uuid(NODE, 0)])]),
            api_pb2.ContainerResources(name="sidecar")]),
        api_pb2.PodResources(name="notebook", namespace="research", containers=[
            api_pb2.ContainerResources(name="jupyter", devices=[
                dev(resource_name="nvidia.com/mig-1g.10gb",
                    device_ids=[f"MIG-{sim_uuid(NODE, 0)}/7/0"])])]),
        api_pb2.PodResources(name="infer-1", namespace="serving", containers=[
            api_pb2.ContainerResources(name="server", devices=[  # time-slicing replica
                dev(resource_name="nvidia.com/gpu", device_ids=[f"{sim_uuid(NODE, 1)}::3"])])]),
        api_pb2.PodResources(name="web", namespace="default"),
    ])


class Kubelet(api_pb2_grpc.PodResourcesListerServicer):
    def __init__(self) -> None:
        self.answer = threading.Event()  # cleared: List hangs, as a kubelet under load
        self.answer.set()
        self.calls = 0

    def List(self, request, context):  # the proto's method name
        self.calls += 1
        self.answer.wait(10)
        return pods()


@pytest.fixture
def kubelet():
    sock = socket_path("kubelet")
    servicer = Kubelet()
    server = grpc.server(futures.ThreadPoolExecutor(max_workers=4))
    api_pb2_grpc.add_PodResourcesListerServicer_to_server(servicer, server)
    server.add_insecure_port(f"unix://{sock}")
    server.start()
    yield sock, servicer
    servicer.answer.set()
    server.stop(0)


def owners(text: str) -> set[tuple[str, ...]]:
    fams = {f.name: f for f in text_string_to_metric_families(text)}
    return {(s.labels["gpu"], s.labels["uuid"], s.labels["pod"], s.labels["namespace"],
             s.labels["container"], s.labels["device_id"])
            for s in fams["clusterpulse_gpu_owner_info"].samples}


def test_agent_exports_the_pod_namespace_and_container_holding_each_gpu(kubelet, tmp_path):
    sock, _ = kubelet
    agent, port, _ = start_agent_cli(tmp_path, NODE, gpus=2,
                                     extra=["--pod-resources", f"unix://{sock}"])
    try:
        text = requests.get(f"http://127.0.0.1:{port}/metrics", timeout=5).text
    finally:
        agent.stop()
    g0, g1 = sim_uuid(NODE, 0), sim_uuid(NODE, 1)
    assert owners(text) == {
        ("1", g1, "train-0", "ml", "trainer", g1),
        ("1", g1, "infer-1", "serving", "server", f"{g1}::3"),  # sharing the GPU
        ("0", g0, "notebook", "research", "jupyter", f"MIG-{g0}/7/0"),  # MIG: its parent
    }  # the fpga is not a GPU
    (age,) = [s.value for f in text_string_to_metric_families(text) for s in f.samples
              if s.name == "clusterpulse_agent_pod_resources_age_seconds"]
    assert 0 <= age < 60  # answered at start


def test_agent_without_a_kubelet_starts_and_counts_the_error(tmp_path):
    absent = socket_path("no-kubelet")
    agent, port, _ = start_agent_cli(tmp_path, NODE, gpus=2,
                                     extra=["--pod-resources", f"unix://{absent}"])
    try:
        text = requests.get(f"http://127.0.0.1:{port}/metrics", timeout=5).text
    finally:
        agent.stop()
    assert owners(text) == set()
    assert 'clusterpulse_agent_pod_resources_errors_total{kind="unavailable",node="k8s-a"}' \
        in text
    assert 'clusterpulse_agent_pod_resources_age_seconds{node="k8s-a"} -1.0' in text
    assert "Traceback" not in agent.output()


def test_slow_kubelet_keeps_the_last_answer_and_counts_a_timeout(kubelet):
    sock, servicer = kubelet
    client = PodResources(f"unix://{sock}", timeout_s=0.5)
    try:
        assert client.refresh()
        before = client.owners()
        servicer.answer.clear()
        t0 = time.monotonic()
        assert not client.refresh()
        assert time.monotonic() - t0 < 5  # bounded by the timeout, not by the kubelet
        assert client.errors["deadline_exceeded"] == 1
        assert client.owners() == before and sim_uuid(NODE, 1) in before
        servicer.answer.set()
        wait_until(client.refresh, 10, "the kubelet's next answer")
    finally:
        client.close()


def test_device_ids_name_their_gpu():
    assert gpu_of("GPU-abc") == "GPU-abc"
    assert gpu_of("MIG-GPU-abc/1/0") == "GPU-abc"  # R470 and older: names the parent
    assert gpu_of("MIG-4f2e") == "MIG-4f2e"  # R470+: its own UUID
    assert gpu_of("3") == "3"  # the device plugin's index strategy
    assert gpu_of("GPU-abc::2") == "GPU-abc"  # a time-slicing replica of the GPU
