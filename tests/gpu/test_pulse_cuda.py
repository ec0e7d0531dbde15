"""On a machine with an NVIDIA GPU: instrumented steps never synchronize the device.

torch's sync debug mode turns every host-device synchronization (`.item()`, a
blocking copy, `cudaStreamSynchronize`) into an error, so these checks fail if a
step, its loss read-out, the step-boundary agreement or a probe syncs the stream.
"""

import datetime

import pytest
import torch
import torch.distributed as dist

from clusterpulse.trainer.instrument import Pulse, _CudaClock

pytestmark = pytest.mark.gpu


@pytest.fixture
def nccl_world_of_one(tmp_path):
    torch.cuda.set_device(0)
    dist.init_process_group("nccl", init_method=f"file://{tmp_path / 'store'}", rank=0,
                            world_size=1, timeout=datetime.timedelta(seconds=60))
    yield
    dist.destroy_process_group()


def test_steps_losses_and_agreement_never_sync_the_device(nccl_world_of_one):
    model = torch.nn.Linear(512, 512).cuda()
    opt = torch.optim.SGD(model.parameters(), lr=1e-3)
    x = torch.randn(64, 512, device="cuda")
    torch.cuda.synchronize()
    pulse = Pulse(run="gpu", agent=None, world_size=1, consensus_every=2, catch_sigterm=False)
    assert isinstance(pulse._clock, _CudaClock)
    # consensus runs on a CPU side group, not on the NCCL default group
    assert dist.get_backend(pulse.consensus.group) == "gloo"
    torch.cuda.set_sync_debug_mode("error")
    try:
        for step in range(1, 21):
            with pulse.step(step) as s:
                with s.section("forward_backward"):
                    loss = model(x).square().mean()
                    loss.backward()
                with s.section("optimizer"):
                    opt.step()
                    opt.zero_grad()
                s.loss = loss
            pulse.boundary(step)
    finally:
        torch.cuda.set_sync_debug_mode("default")
    torch.cuda.synchronize()
    with pulse.step(21) as s:
        s.loss = torch.tensor(1.5, device="cuda")
    torch.cuda.synchronize()
    pulse._resolve()
    assert pulse.last["loss"] == 1.5  # read from the pinned copy once it completed
    assert pulse.last["compute_seconds"] >= 0 and pulse.consensus.exchanges == 10
    pulse.close()


def test_ddp_marks_with_buffers_never_sync_the_device(nccl_world_of_one):
    """attach_ddp on CUDA: the forward's buffer broadcast (a causal mask, BatchNorm
    statistics) and the backward's end are CUDA events, read a step or more later;
    nothing in a step synchronizes the device."""

    class Buffered(torch.nn.Module):
        def __init__(self) -> None:
            super().__init__()
            self.register_buffer("mask", torch.tril(torch.ones(64, 64)))
            self.lin = torch.nn.Linear(64, 64)
            self.norm = torch.nn.BatchNorm1d(64)

        def forward(self, x: torch.Tensor) -> torch.Tensor:
            return self.norm(self.lin(x @ self.mask))

    model = torch.nn.parallel.DistributedDataParallel(Buffered().cuda(), device_ids=[0])
    opt = torch.optim.SGD(model.parameters(), lr=1e-3)
    x = torch.randn(32, 64, device="cuda")
    torch.cuda.synchronize()
    pulse = Pulse(run="gpu", agent=None, world_size=1, consensus_every=2, catch_sigterm=False)
    assert isinstance(pulse._clock, _CudaClock)
    pulse.attach_ddp(model)
    torch.cuda.set_sync_debug_mode("error")
    try:
        for step in range(1, 11):
            with pulse.step(step) as s:
                with s.section("forward_backward"):
                    loss = model(x).square().mean()
                    loss.backward()
                with s.section("optimizer"):
                    opt.step()
                    opt.zero_grad()
                s.loss = loss
                assert len(pulse._ddp_passes) == 1 and len(pulse._fwd_waits) == 1
            pulse.boundary(step)
    finally:
        torch.cuda.set_sync_debug_mode("default")
    torch.cuda.synchronize()
    pulse._resolve()
    assert not pulse._pending and pulse.last["sync_wait_seconds"] >= 0
    assert pulse.last["compute_seconds"] > 0
    pulse.close()
