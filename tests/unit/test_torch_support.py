"""The supported torch range, stated once and held (issue #26 item 6): pyproject's
lower bound, the oldest torch CI runs the trainer and instrumentation tests on
(scripts/test-oldest-torch.sh) and the version the trainer refuses below are one; below
it the trainer, the launcher and Pulse stop with one line naming both versions."""

from __future__ import annotations

import re
import tomllib

import pytest

from clusterpulse.trainer import launch, main, parallel, torch_support
from clusterpulse.trainer.instrument import Pulse
from clusterpulse.trainer.torch_support import OLDEST, UnsupportedTorch, release
from tests.support.procs import REPO


def test_pyproject_the_oldest_torch_ci_and_the_check_agree():
    extras = tomllib.loads((REPO / "pyproject.toml").read_text())["project"][
        "optional-dependencies"]
    (spec,) = [d for d in extras["trainer"] if d.startswith("torch")]
    assert spec == "torch>={}.{}".format(*OLDEST)
    script = (REPO / "scripts" / "test-oldest-torch.sh").read_text()
    (pinned,) = re.findall(r'^TORCH_OLDEST=\$\{TORCH_OLDEST:-([0-9.]+)\}', script, re.M)
    assert release(pinned) == OLDEST
    readme = (REPO / "README.md").read_text()
    assert "torch {}.{}".format(*OLDEST) in readme  # the range, where users read it


@pytest.mark.parametrize("version, ok", [
    ("2.13.0+cpu", True), ("2.6.0", True), ("2.6.0+cu124", True),
    ("2.6.0a0+ecf3bae40a.nv25.01", True),  # an NGC image's 2.6: a pre-release by PEP 440
    ("2.5.1", False), ("2.4.0+cu121", False), ("1.13.1", False), ("3.0.0", True)])
def test_versions_below_the_oldest_are_refused_naming_both(version, ok):
    if ok:
        torch_support.require_supported(version)
        return
    with pytest.raises(UnsupportedTorch) as err:
        torch_support.require_supported(version)
    assert f"this is torch {version}" in str(err.value)
    assert "torch >= {}.{}".format(*OLDEST) in str(err.value)


@pytest.fixture
def old_torch(monkeypatch: pytest.MonkeyPatch) -> None:
    """What an older torch reports (the check reads the installed version only)."""
    monkeypatch.setattr(torch_support, "installed", lambda: "2.4.1+cu121")


def test_the_launcher_refuses_an_old_torch_in_one_line(old_torch, capsys):
    assert launch.main(["--nproc", "2", "--", "--steps", "1"]) == 2
    err = capsys.readouterr().err
    assert err.startswith("clusterpulse-train: error: ClusterPulse's trainer needs torch >= ")
    assert err.count("\n") == 1 and "2.4.1+cu121" in err


def test_the_trainer_refuses_an_old_torch_in_one_line(old_torch, capsys):
    assert main.main(["--steps", "1"]) == 2
    err = capsys.readouterr().err
    assert err.startswith("trainer: error: ClusterPulse's trainer needs torch >= ")
    assert err.count("\n") == 1


def test_pulse_refuses_an_old_torch_by_name(old_torch):
    with pytest.raises(UnsupportedTorch, match=r"this is torch 2\.4\.1"):
        Pulse(run="old", agent="none")


def test_fsdp_on_cpu_without_torchs_support_is_refused_before_any_rank_starts(
        monkeypatch, capsys):
    """torch 2.6 runs FSDP2 on GPUs only: its CPU all-gather records an event on a CPU
    stream that has none (AttributeError in every rank's first forward, then torchrun's
    restarts). On the oldest-torch CI run the absence is torch's own."""
    monkeypatch.setattr(parallel, "fsdp_on_cpu", lambda: False)
    monkeypatch.setattr(parallel.torch.cuda, "is_available", lambda: False)
    assert main.main(["--steps", "1", "--parallel", "fsdp"]) == 2
    err = capsys.readouterr().err
    assert err.startswith("trainer: error: FSDP on CPU needs torch >= 2.7")
    assert err.count("\n") == 1


def test_the_failure_budget_is_torchruns_not_a_scripts_argument_of_the_same_name(tmp_path):
    """Review: the relaunch's budget replaced every `--max-restarts=` of the command
    line, a `--script`'s own arguments included."""
    script = tmp_path / "s.py"
    script.write_text("")
    a, rest = launch.parse(["--nproc", "1", "--max-restarts", "2", "--script", str(script),
                            "--", "--max-restarts=7"])
    cmd = launch.command(a, rest)
    assert launch.max_restarts(cmd) == 2
    out = launch.budgeted(cmd, 0)
    assert out.count("--max-restarts=0") == 1 and out[-1] == "--max-restarts=7"
    assert len(out) == len(cmd) and launch.max_restarts(out) == 0
