"""The drain-node action's policy: the shipped Slurm policy loads, and bad [drain]
settings or rule matchers are one clear error naming the key (never a traceback at the
first alert)."""

from __future__ import annotations

import pytest

from clusterpulse.dashboard.drain import DrainSettings
from clusterpulse.dashboard.remediation import Policy, PolicyError
from tests.support.procs import REPO


def test_shipped_slurm_policy_drains_on_gpu_down_and_requeues():
    policy = Policy.load(REPO / "deploy/slurm/policy.toml")
    assert {r.alert: r.action for r in policy.rules}["GpuDown"] == "drain-node"
    assert policy.drain == DrainSettings(requeue=True, max_drained=2)


RULE = "[[rule]]\nalert = 'TrainingStraggler'\naction = 'restart'\n"


@pytest.mark.parametrize(("body", "named"), [
    ("[drain]\nrequeue = 'yes'\n", "requeue must be true or false"),
    ("[drain]\nmax_drained = 0\n", "max_drained must be an integer >= 1"),
    ("[drain]\nmax_draned = 3\n", "unknown keys max_draned"),
    ("drain = 3\n", "[drain] must be a table"),
    ("[[rule]]\nalert = 'GpuDown'\naction = 'drain'\n", "drain-node"),
    # a rule's label matchers
    (RULE + "match = 'compute'\n",
     "rule #1: 'match' must be a table"),
    (RULE + "match = { 'bad-label' = 'x' }\n",
     "rule #1: match: 'bad-label' is not a label name"),
    (RULE + "match = { cause = 3 }\n",
     "rule #1: match.cause must be a string"),
    (RULE + "match = { cause = '(' }\n",
     "rule #1: match.cause: bad regular expression '('"),
])
def test_bad_policy_settings_are_named(tmp_path, body, named):
    path = tmp_path / "policy.toml"
    path.write_text(body)
    with pytest.raises(PolicyError, match=r"^policy ") as err:
        Policy.load(path)
    assert named in str(err.value)
