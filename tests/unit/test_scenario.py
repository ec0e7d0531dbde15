"""Fault scenarios (the demo's --scenario): bad input is a clear error, never a traceback."""

from __future__ import annotations

import subprocess
import sys

import pytest

from deploy.testbed.scenario import ScenarioError, load
from tests.support.procs import REPO


@pytest.mark.parametrize(("body", "message"), [
    ('[[fault]]\nkind = "melt"\n', "unknown kind 'melt'"),
    ('[[fault]]\nkind = "partition"\nnode = 1\n', "needs the multi-node testbed"),
    ('[[fault]]\nkind = "rank_hang"\nnode = 7\n', "'node' must be in 0..1"),
    ('[[fault]]\nkind = "gpu_lost"\ngpu = 9\n', "'gpu' must be in 0..3"),
    ('[[fault]]\nkind = "gpu_lost"\nseconds = -1\n', "'seconds' must be a number >= 0"),
    ('[[fault]]\nkind = "gpu_lost"\nwhen = 3\n', "unknown fields when"),
    ("[[fault]\n", "not valid TOML"),
])
def test_bad_scenarios_name_the_problem(tmp_path, body, message):
    path = tmp_path / "s.toml"
    path.write_text(body)
    with pytest.raises(ScenarioError, match=message):
        load(path, nodes=2, gpus=4, testbed=False)


def test_the_demo_scenario_loads_in_order():
    faults = load(REPO / "deploy" / "local" / "scenario.toml", nodes=2, gpus=4, testbed=False)
    assert [f.kind for _, f in faults] == ["rank_hang", "gpu_lost", "gpu_overheat"]


def test_demo_rejects_a_bad_scenario_before_starting_anything(tmp_path):
    bad = tmp_path / "bad.toml"
    bad.write_text('[[fault]]\nkind = "melt"\n')
    p = subprocess.run([sys.executable, "deploy/local/cluster.py", "--state-dir",
                        str(tmp_path / "state"), "--scenario", str(bad)], cwd=REPO,
                       capture_output=True, text=True, timeout=120)
    assert p.returncode == 2
    assert "unknown kind 'melt'" in p.stderr and "Traceback" not in p.stderr
    assert not (tmp_path / "state").exists()


def test_demo_rejects_a_bad_policy_before_starting_anything(tmp_path):
    bad = tmp_path / "policy.toml"
    bad.write_text("[[rule]]\nalert = 'TrainingStraggler'\naction = 'restart'\n"
                   "match = { cause = '(' }\n")
    p = subprocess.run([sys.executable, "deploy/local/cluster.py", "--state-dir",
                        str(tmp_path / "state"), "--policy", str(bad)], cwd=REPO,
                       capture_output=True, text=True, timeout=120)
    assert p.returncode == 2, p.stderr
    assert "rule #1: match.cause: bad regular expression" in p.stderr, p.stderr
    assert "Traceback" not in p.stderr
    assert not (tmp_path / "state").exists()
