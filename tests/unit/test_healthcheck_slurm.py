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
