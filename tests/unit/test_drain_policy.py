"""The remediation policy file: every shipped policy loads, and bad [drain] settings,
rule matchers, misspelt keys or out-of-range numbers are one clear error naming the key
(never a traceback at the first alert, nor a typo silently replaced by a default)."""

from __future__ import annotations

import subprocess
import sys

import pytest
import yaml

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
    # Found in review: each of these loaded, the misspelt key ignored and its default
    # used. `dry-run = true` left dry_run false, and the policy acted.
    ("dry-run = true\n" + RULE,
     ": unknown keys dry-run (did you mean dry_run?); known: drain, dry_run, evict, "
     "max_actions_per_run, rule, window_s"),
    (RULE + "sustain_s = 120\n",
     "rule #1: unknown keys sustain_s (did you mean sustained_s?); known: action, alert, "
     "match, sustained_s"),
    (RULE + "matches = { cause = 'compute' }\n",
     "rule #1: unknown keys matches (did you mean match?)"),
    ("[drain]\nmax_draned = 3\n",
     "[drain] has unknown keys max_draned (did you mean max_drained?); known: "
     "max_drained, requeue"),
    ("[evict]\ngrace = 5\n", "[evict] has unknown keys grace; known: leave_s"),
    # numbers: a zero or negative window switched the rate limit off; "15m" was a
    # ValueError traceback
    ("window_s = 0\n" + RULE, "window_s must be a number of seconds > 0, not 0"),
    ("window_s = -60\n" + RULE, "window_s must be a number of seconds > 0, not -60"),
    ("window_s = '15m'\n" + RULE, "window_s must be a number of seconds > 0, not '15m'"),
    ("window_s = inf\n" + RULE, "window_s must be a number of seconds > 0, not inf"),
    ("max_actions_per_run = 0\n", "max_actions_per_run must be an integer >= 1, not 0"),
    ("max_actions_per_run = 1.5\n", "max_actions_per_run must be an integer >= 1"),
    ("max_actions_per_run = true\n", "max_actions_per_run must be an integer >= 1"),
    ("dry_run = 'false'\n", "dry_run must be true or false, not 'false'"),
    (RULE + "sustained_s = -1\n", "rule #1: sustained_s must be a number of seconds >= 0"),
    (RULE + "sustained_s = '2m'\n", "rule #1: sustained_s must be a number of seconds >= 0"),
    # the rules' shape
    ("rule = 3\n", "'rule' must be an array of tables ([[rule]])"),
    ("[rule]\nalert = 'A'\naction = 'restart'\n",
     "'rule' must be an array of tables ([[rule]])"),
    ("[[rule]]\nalert = ''\naction = 'restart'\n", "rule #1: 'alert' (a name) is required"),
])
def test_bad_policy_settings_are_named(tmp_path, body, named):
    path = tmp_path / "policy.toml"
    path.write_text(body)
    with pytest.raises(PolicyError, match=r"^policy ") as err:
        Policy.load(path)
    assert named in str(err.value)


def _kubernetes_policy() -> str:
    cm = yaml.safe_load((REPO / "deploy/kubernetes/base/policy-configmap.yaml").read_text())
    return cm["data"]["policy.toml"]


def test_every_shipped_policy_loads(tmp_path):
    """Stricter loading must not refuse a policy we ship (the Kubernetes one is
    generated from deploy/local/policy.toml)."""
    k8s = tmp_path / "k8s-policy.toml"
    k8s.write_text(_kubernetes_policy())
    for path in (REPO / "deploy/local/policy.toml", REPO / "deploy/slurm/policy.toml", k8s):
        assert Policy.load(path).rules, path


@pytest.mark.parametrize("body", ["window_s = '15m'\n" + RULE, "dry-run = true\n" + RULE,
                                  "[drain]\nmax_drained = 0\n"])
def test_the_receiver_names_a_bad_policy_and_exits_2(tmp_path, body):
    """Found in review: `window_s = "15m"` ended clusterpulse-remediate with a
    ValueError traceback and exit 1; it must say `error: policy FILE: problem` and
    exit 2 (a policy it accepted would have it listening: the timeout fails that)."""
    policy, hook = tmp_path / "policy.toml", tmp_path / "hook-token"
    policy.write_text(body)
    hook.write_text("alertmanager-hook-token-0123456789\n")
    hook.chmod(0o600)
    p = subprocess.run([sys.executable, "-m", "clusterpulse.dashboard.remediation",
                        "--policy", str(policy), "--webhook-token-file", str(hook),
                        "--listen", "127.0.0.1:0", "--audit-log", str(tmp_path / "audit")],
                       capture_output=True, text=True, timeout=30, cwd=REPO)
    assert p.returncode == 2, p.stderr
    assert p.stderr.startswith(f"clusterpulse-remediate: error: policy {policy}: "), p.stderr
    assert p.stderr.count("\n") == 1 and "Traceback" not in p.stderr, p.stderr
