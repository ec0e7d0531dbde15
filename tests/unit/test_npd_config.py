"""The Kubernetes Node Problem Detector files are valid on paper: the custom-plugin
config has the structure NPD's custom plugin monitor reads, its rules call the health
check this project installs with arguments that check accepts, the health check's
exit codes are NPD's plugin protocol, and the DaemonSet loads that config."""

from __future__ import annotations

import json
import re
import tomllib
from pathlib import Path

import pytest
import yaml

from clusterpulse.agent import healthcheck
from tests.support.procs import REPO

NPD = REPO / "deploy/kubernetes/node-problem-detector"
DURATION = re.compile(r"^\d+(ms|s|m|h)$")  # Go time.ParseDuration, as NPD uses


@pytest.fixture(scope="module")
def config() -> dict:
    return json.loads((NPD / "clusterpulse-gpu-monitor.json").read_text())


def test_plugin_config_has_npd_custom_plugin_structure(config):
    assert config["plugin"] == "custom"
    pc = config["pluginConfig"]
    for key in ("invoke_interval", "timeout"):
        assert DURATION.match(pc[key]), f"{key}={pc[key]!r} is not a Go duration"
    assert isinstance(pc["max_output_length"], int) and pc["max_output_length"] > 0
    assert isinstance(pc["concurrency"], int) and pc["concurrency"] >= 1
    assert config["source"]
    conditions = {c["type"]: c for c in config["conditions"]}
    assert conditions and all(c["reason"] and c["message"] for c in conditions.values())
    assert {r["type"] for r in config["rules"]} <= {"temporary", "permanent"}
    for rule in config["rules"]:
        assert rule["reason"] and DURATION.match(rule["timeout"])
        if rule["type"] == "permanent":  # a condition NPD knows, so the node gets it
            assert rule["condition"] in conditions
    assert any(r["type"] == "permanent" for r in config["rules"])


def test_rules_run_the_installed_health_check_with_valid_arguments(config):
    scripts = tomllib.loads((REPO / "pyproject.toml").read_text())["project"]["scripts"]
    assert scripts["clusterpulse-healthcheck"] == "clusterpulse.agent.healthcheck:main"
    for rule in config["rules"]:
        assert rule["path"].rsplit("/", 1)[-1] == "clusterpulse-healthcheck"
        args = healthcheck.build_parser().parse_args(rule["args"])
        # The check must answer before NPD kills it (plugin timeout), or NPD reports
        # the condition as Unknown instead of the GPU's state.
        assert args.timeout < float(rule["timeout"].rstrip("s"))


def test_rule_path_is_where_the_agent_image_installs_the_check(config):
    # The NPD image is built FROM the agent image (npd-daemonset.yaml): its venv's bin.
    containerfile = (REPO / "deploy/images/agent.Containerfile").read_text()
    venv = re.search(r"python3 -m venv (\S+)", containerfile)
    assert venv, "agent.Containerfile no longer creates its venv with python3 -m venv"
    for rule in config["rules"]:
        assert rule["path"] == f"{venv.group(1)}/bin/clusterpulse-healthcheck"


def test_unknown_never_cordons(config):
    # NPD: a permanent rule's exit 2 makes the condition Unknown; a temporary rule turns
    # every exit >= 1 (unknown too) into an event named by the rule's reason.
    assert [r["type"] for r in config["rules"]] == ["permanent"]
    draino = yaml.safe_load((NPD / "draino.yaml").read_text())
    cmd = draino["spec"]["template"]["spec"]["containers"][0]["command"]
    conditions = [a for a in cmd[1:] if not a.startswith("-")]
    assert conditions and all(a.partition("=")[2] in ("", "True") for a in conditions), \
        "draino must act on True only (its default), never on Unknown"


def test_exit_codes_are_npd_plugin_protocol():
    # NPD custom plugin protocol (pkg/custompluginmonitor/types): OK=0, NonOK=1, Unknown=2.
    assert (healthcheck.OK, healthcheck.PROBLEM, healthcheck.UNKNOWN) == (0, 1, 2)


def test_daemonset_loads_that_config_on_the_host_network():
    ds = yaml.safe_load((NPD / "npd-daemonset.yaml").read_text())
    spec = ds["spec"]["template"]["spec"]
    assert ds["kind"] == "DaemonSet" and spec["hostNetwork"] is True  # agent on 127.0.0.1
    (container,) = spec["containers"]
    flag = next(a for a in container["command"] if a.startswith("--config.custom-plugin"))
    mount = next(m for m in container["volumeMounts"] if m["name"] == "config")
    assert flag.split("=", 1)[1] == f"{mount['mountPath']}/clusterpulse-gpu-monitor.json"
    # The check's judged XIDs (healthstate) on a host directory the container's user
    # owns: in the image's read-only root one routine XID kept the condition True.
    state = next(m for m in container["volumeMounts"] if m["name"] == "state")
    assert Path(healthcheck.DEFAULT_STATE).parent == Path(state["mountPath"])
    (volume,) = [v for v in spec["volumes"] if v["name"] == "state"]
    assert volume["hostPath"]["type"] == "DirectoryOrCreate"
    (init,) = spec["initContainers"]
    assert init["command"] == ["chown", "65534:65534", state["mountPath"]]
    assert container["securityContext"]["runAsUser"] == 65534
    draino = yaml.safe_load((NPD / "draino.yaml").read_text())
    cmd = draino["spec"]["template"]["spec"]["containers"][0]["command"]
    condition = json.loads((NPD / "clusterpulse-gpu-monitor.json").read_text())[
        "conditions"][0]["type"]
    assert condition in cmd  # draino cordons (taints) and drains on our condition
