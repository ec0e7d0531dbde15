"""What `clusterpulse-healthcheck --drain` does to Slurm for each verdict: an unknown
(the agent did not answer) must leave the node alone, drained or not, and must not
even need Slurm's tools to say so."""

from __future__ import annotations

import pytest

from clusterpulse.agent import healthcheck
from clusterpulse.agent.healthcheck import PROBLEM, UNKNOWN, SlurmError, Verdict


def test_unknown_neither_drains_nor_resumes_nor_calls_scontrol(monkeypatch, tmp_path):
    monkeypatch.setenv("PATH", str(tmp_path))  # no scontrol: any Slurm call would fail
    verdict = Verdict(UNKNOWN, ["agent unreachable at http://127.0.0.1:9477/metrics"])
    assert healthcheck.apply_to_slurm("gpu-node-1", verdict) == ""


def test_a_problem_does_need_slurm(monkeypatch, tmp_path):
    monkeypatch.setenv("PATH", str(tmp_path))
    with pytest.raises(SlurmError, match="scontrol not found"):
        healthcheck.apply_to_slurm("gpu-node-1", Verdict(PROBLEM, ["GPU 1 down"]))


@pytest.mark.parametrize(("argv", "why"), [
    (["--timeout", "nan"], "--timeout must be > 0 and at most 3600 seconds, got nan"),
    (["--max-age", "nan"], "--max-age must be a number of seconds > 0, got nan"),
    (["--ecc-max", "nan"], "--ecc-max must be a count >= 0"),
    (["--agent", "http://[::1"], "--agent must be an http:// or https:// URL"),
    (["--agent", "http://127.0.0.1:port"], "--agent must be an http:// or https:// URL"),
    (["--agent", "http://"], "--agent must be an http:// or https:// URL"),
])
def test_a_setting_it_cannot_use_is_a_usage_error_not_a_traceback(argv, why, capsys):
    """Found by a review: --timeout nan passed `<= 0` and raised in settimeout, and
    'http://[::1' raised ValueError: Slurm saw exit 1 and a traceback, not a verdict
    or a usage error."""
    with pytest.raises(SystemExit) as exit_:
        healthcheck.main(argv)
    assert exit_.value.code == 2
    assert why in capsys.readouterr().err
