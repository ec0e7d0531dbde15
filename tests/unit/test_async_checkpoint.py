"""Async checkpoints through torch's stager on whatever torch is installed: several saves
in a row, then a resume (issue #26: on torch 2.11 every async save after the first
failed with `KeyError: <class 'type'>`). tests/gpu/device_check.sh runs this file on
the GPU machine's torch too; the CUDA case needs a GPU and says so when there is none.
"""

from __future__ import annotations

import logging
from collections.abc import Iterator
from pathlib import Path

import pytest
import torch
import torch.distributed.checkpoint as dcp

from clusterpulse.trainer import checkpoint, torch_support
from clusterpulse.trainer.checkpoint import CheckpointError, CheckpointManager, candidates
from clusterpulse.trainer.data import SyntheticTokens
from clusterpulse.trainer.model import PRESETS, build_model
from clusterpulse.trainer.state import TrainState

DEVICES = ["cpu", pytest.param("cuda", marks=pytest.mark.skipif(
    not torch.cuda.is_available(), reason="no CUDA device: the CPU case ran"))]


@pytest.fixture(autouse=True)
def _fresh_probe() -> Iterator[None]:
    """The stager probe is cached per process; each test probes the torch it runs."""
    checkpoint.stager_survives_reuse.cache_clear()
    yield
    checkpoint.stager_survives_reuse.cache_clear()


def _train_state(device: str, seed: int) -> TrainState:
    """The trainer's own checkpoint state (model, AdamW, LambdaLR, step, RNG)."""
    model = build_model("tiny", seed).to(device)
    opt = torch.optim.AdamW(model.parameters(), lr=1e-3, weight_decay=0.0)
    sched = torch.optim.lr_scheduler.LambdaLR(opt, lambda s: min(1.0, (s + 1) / 10))
    return TrainState(model, opt, sched)


def _step(state: TrainState, step: int, device: str) -> None:
    mc = PRESETS["tiny"]
    x, y = SyntheticTokens(7, mc.vocab, mc.seq_len, 4).shard(step - 1, 0, 1)
    logits = state.model(x.to(device))
    loss = torch.nn.functional.cross_entropy(logits.reshape(-1, mc.vocab),
                                             y.to(device).reshape(-1))
    loss.backward()
    state.optimizer.step()
    state.scheduler.step()
    state.optimizer.zero_grad(set_to_none=True)
    state.step = step


def _saves_in_a_row_then_resume(root: Path, device: str, saves: int = 3) -> None:
    state = _train_state(device, seed=1)
    mgr = CheckpointManager(root, rank=0, keep=saves, async_save=True)
    for step in range(1, saves + 1):
        _step(state, step, device)
        mgr.save(step, {"app": state})
    mgr.wait()
    assert (mgr.failures, mgr.committed_step) == (0, saves)
    assert [f.step for f in candidates(root)] == list(range(saves, 0, -1))
    resumed = _train_state(device, seed=2)  # other weights: the load must replace them
    dcp.load({"app": resumed}, checkpoint_id=str(candidates(root)[0].path))
    assert resumed.step == saves
    for (name, a), b in zip(state.model.state_dict().items(),
                            resumed.model.state_dict().values(), strict=True):
        assert torch.equal(a, b), name
    assert resumed.optimizer.state_dict()["state"].keys() == \
        state.optimizer.state_dict()["state"].keys()
    assert resumed.scheduler.state_dict()["last_epoch"] == saves
    # training goes on from the resumed state exactly as from the original
    _step(state, saves + 1, device)
    _step(resumed, saves + 1, device)
    for a, b in zip(state.model.parameters(), resumed.model.parameters(), strict=True):
        assert torch.equal(a, b)


@pytest.mark.parametrize("device", DEVICES)
def test_async_saves_in_a_row_with_the_stager_then_resume(tmp_path, device):
    _saves_in_a_row_then_resume(tmp_path, device)


@pytest.fixture
def torch_2_11_stager(monkeypatch) -> None:
    """torch 2.11's DefaultStager, on this torch: it closes its StateDictStager at the
    end of every stage (pytorch#170431; reverted by pytorch#183424 in later releases).
    torch 2.11 itself is not installable here, and this one behaviour is what broke."""
    api = torch_support.stager_api()
    if api is None:
        pytest.skip(f"torch {torch.__version__} has no DefaultStager (2.9+) to close itself")
    DefaultStager = api[0]
    stage = DefaultStager._stage

    def stage_then_close(self, state_dict, **kwargs):
        staged = stage(self, state_dict, **kwargs)
        self._state_dict_stager.close()
        return staged

    monkeypatch.setattr(DefaultStager, "_stage", stage_then_close)


def test_async_saves_survive_a_stager_that_closes_itself(tmp_path, torch_2_11_stager, caplog):
    """Each save gets a fresh stager there, and says so once at start."""
    with caplog.at_level(logging.INFO, logger="clusterpulse.trainer.checkpoint"):
        _saves_in_a_row_then_resume(tmp_path, "cpu", saves=4)
    assert sum("fresh stager per async checkpoint" in r.getMessage()
               for r in caplog.records) == 1


def test_async_saves_where_torch_has_no_stager(tmp_path, monkeypatch, caplog):
    """torch < 2.9 has no DefaultStager (its import failed and no trainer started):
    dcp.async_save stages each save itself, three in a row then a resume, with no word
    of a stager. CI runs this file on the oldest supported torch too
    (scripts/test-oldest-torch.sh), where the absence is torch's own."""
    monkeypatch.setattr(checkpoint, "stager_api", lambda: None)
    with caplog.at_level(logging.INFO, logger="clusterpulse.trainer.checkpoint"):
        _saves_in_a_row_then_resume(tmp_path, "cpu", saves=3)
    assert not any("stager" in r.getMessage() for r in caplog.records)


def test_a_failed_save_is_logged_once_whole_and_counted(tmp_path, caplog):
    """The log said only `checkpoint at step 100 failed: <class 'type'>`: now the type,
    the message and the traceback, once per failure; sync and async alike."""
    def broken_storage(step: int) -> None:
        if step == 2:
            raise OSError(28, "No space left on device")

    mgr = CheckpointManager(tmp_path, rank=0, async_save=True, before_publish=broken_storage)
    state = _train_state("cpu", seed=1)
    with caplog.at_level(logging.ERROR, logger="clusterpulse.trainer.checkpoint"):
        mgr.save(1, {"app": state})
        mgr.save(2, {"app": state})  # fails in the writer thread
        mgr.wait()
        with pytest.raises(CheckpointError):
            mgr.save(3, {"app": state}, fail=True)  # fails in the loop
    assert mgr.failures == 2 and mgr.committed_step == 1
    errors = [r for r in caplog.records if r.levelno == logging.ERROR]
    assert [r.getMessage() for r in errors] == [
        "async checkpoint at step 2 failed: OSError: [Errno 28] No space left on device",
        "checkpoint at step 3 failed: CheckpointError: injected checkpoint write failure"]
    assert all(r.exc_info and r.exc_info[2] is not None for r in errors)  # the traceback
    assert "broken_storage" in caplog.text  # ... down to the frame that raised
