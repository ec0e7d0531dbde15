"""Trainer parts that need no process group: fault specs, checkpoint publishing and
fallback, straggler scoring, telemetry sending with no agent."""

from __future__ import annotations

import json
import socket

import pytest
import torch
import torch.distributed.checkpoint as dcp

from trainer.checkpoint import CheckpointManager, find_latest_valid, verify
from trainer.consensus import Consensus
from trainer.faults import Faults, InjectError, parse_injection
from trainer.instrument import Pulse
from trainer.telemetry import AgentLink, parse_agent_addr


def test_injection_specs():
    i = parse_injection("crash:rank=1:step=35:mode=sigkill")
    assert (i.kind, i.rank, i.step, i.mode, i.attempt) == ("crash", 1, 35, "sigkill", 0)
    faults = Faults([i, parse_injection("slow:rank=1:step=10:factor=2")], rank=1, attempt=0)
    assert faults.crash_at(35) == "sigkill" and faults.crash_at(34) is None
    assert faults.slow_factor(9) == 1.0 and faults.slow_factor(50) == 2.0
    assert Faults([i], rank=1, attempt=1).crash_at(35) is None  # not again after restart
    assert Faults([i], rank=0, attempt=0).crash_at(35) is None


@pytest.mark.parametrize("spec,msg", [
    ("boom:step=1", "unknown kind 'boom'"),
    ("crash:rank", "is not key=value"),
    ("crash:step=x", "invalid literal"),
    ("crash:step=3:mode=gentle", "mode must be one of"),
    ("slow:step=3:factor=0.5", "factor >= 1"),
    ("hang:step=3:colour=red", "unknown keys colour"),
])
def test_bad_injection_specs_are_named(spec, msg):
    with pytest.raises(InjectError, match=msg):
        parse_injection(spec)


def _state(value: float) -> dict:
    return {"w": torch.full((64,), value), "step": torch.tensor(int(value))}


def test_checkpoints_publish_atomically_prune_and_fall_back(tmp_path):
    mgr = CheckpointManager(tmp_path, rank=0, keep=2)
    for step in (10, 20, 30):
        mgr.save(step, _state(step))
    assert sorted(p.name for p in tmp_path.iterdir()) == ["step-00000020", "step-00000030"]
    manifest = json.loads((tmp_path / "step-00000030" / "manifest.json").read_text())
    assert manifest["step"] == 30 and manifest["files"]
    assert find_latest_valid(tmp_path).step == 30
    # An interrupted write leaves only a temporary directory: never loaded, then cleaned.
    (tmp_path / ".tmp-step-00000040").mkdir()
    assert find_latest_valid(tmp_path).step == 30
    mgr.clean_temporaries()
    assert not (tmp_path / ".tmp-step-00000040").exists()
    # Corrupt the newest: resume falls back to the one before, and loads it.
    data = next((tmp_path / "step-00000030").glob("*.distcp"))
    data.write_bytes(data.read_bytes()[:-8] + b"garbage!")
    assert "fails its checksum" in verify(tmp_path / "step-00000030")
    found = find_latest_valid(tmp_path)
    assert found.step == 20
    loaded = _state(0)
    dcp.load(loaded, checkpoint_id=str(found.path))
    assert torch.equal(loaded["w"], torch.full((64,), 20.0))
    (tmp_path / "step-00000020" / "manifest.json").unlink()
    assert verify(tmp_path / "step-00000020") == "no manifest (incomplete write)"
    assert find_latest_valid(tmp_path) is None


def test_async_checkpoint_publishes_in_the_background(tmp_path):
    mgr = CheckpointManager(tmp_path, rank=0, async_save=True)
    blocked = mgr.save(5, _state(5))
    mgr.wait()
    assert mgr.committed_step == 5 and blocked >= 0
    assert find_latest_valid(tmp_path).step == 5


def test_failed_write_keeps_the_previous_checkpoint(tmp_path):
    from trainer.checkpoint import CheckpointError

    mgr = CheckpointManager(tmp_path, rank=0)
    mgr.save(10, _state(10))
    with pytest.raises(CheckpointError):
        mgr.save(20, _state(20), fail=True)
    assert mgr.committed_step == 10 and mgr.failures == 1
    assert find_latest_valid(tmp_path).step == 10
    assert not list(tmp_path.glob(".tmp-*"))


def test_straggler_score_is_relative_and_skips_warmup():
    c = Consensus(every=3, warmup_windows=1)
    for x in (0.1, 0.1, 0.1):
        c.record(x)
    assert c.exchange(False, world=1) == (False, False, None)  # warm-up window
    for _ in range(3):  # scores once the scorer's 10-step window is full
        for x in (0.2, 0.2, 0.9):
            c.record(x)
        restart, ckpt, scores = c.exchange(True, world=1, want_checkpoint=True)
    assert restart and ckpt and scores == [1.0]  # one rank is its own typical peer


def test_pulse_sends_step_telemetry_and_never_blocks_without_agent():
    rx = socket.socket(socket.AF_INET, socket.SOCK_DGRAM)
    rx.bind(("127.0.0.1", 0))
    rx.settimeout(2)
    pulse = Pulse(run="unit", agent=rx.getsockname(), rank=0, local_rank=0, world_size=1)
    assert json.loads(rx.recv(8192))["event"] == "start"
    with pulse.step(1) as s:
        with s.section("data"):
            pass
        s.loss = torch.tensor(2.5)
        s.samples, s.tokens = 4, 128
    msg = json.loads(rx.recv(8192))
    if msg["type"] == "heartbeat":  # the first section beats: nothing was sent for > 1 s
        assert msg["step"] == 1
        msg = json.loads(rx.recv(8192))
    assert msg["type"] == "step" and msg["step"] == 1 and msg["loss"] == 2.5
    assert msg["tokens_total"] == 128 and msg["step_seconds"] >= msg["compute_seconds"] >= 0
    # No agent listening: sends are dropped silently, steps go on.
    silent = Pulse(run="unit", agent=("127.0.0.1", 9), rank=0, world_size=1)
    for step in range(1, 50):
        with silent.step(step):
            pass
    assert silent.link.sent + silent.link.failed >= 50


def test_agent_address_parsing():
    assert parse_agent_addr("none") is None and parse_agent_addr("") is None
    assert parse_agent_addr("127.0.0.1:9401") == ("127.0.0.1", 9401)
    with pytest.raises(ValueError, match="HOST:PORT"):
        parse_agent_addr("localhost")
    AgentLink(None).send({"type": "heartbeat"})  # telemetry off: a no-op


def test_launcher_builds_the_torchrun_command():
    from trainer.launch import build_command

    cmd = build_command(["--nproc", "2", "--max-restarts", "1", "--", "--steps", "5"])
    assert cmd[1:] == ["-m", "torch.distributed.run", "--nproc-per-node=2", "--max-restarts=1",
                       "--standalone", "-m", "trainer", "--steps", "5"]
    cmd = build_command(["--nproc", "8", "--nnodes", "2", "--rdzv-endpoint", "head:29400"])
    assert "--rdzv-backend=c10d" in cmd and "--rdzv-endpoint=head:29400" in cmd
