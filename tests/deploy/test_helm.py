"""deploy/helm/clusterpulse: rendered by Helm's own engine (Helm v4's Go SDK, bundled in
the helm-python-sdk wheel: no helm binary, no network), every object validated strictly
like the kustomize base, and what the issue asked of it checked on the output: probes on
every container, the NetworkPolicies, image digests, the values reaching the pods."""

from __future__ import annotations

import platform
import re
import shutil
import subprocess
import sys
from pathlib import Path

import pytest
import yaml

from tests.deploy.test_kubernetes import (
    PROBES,
    WORKLOADS,
    _base_objects,
    _validate_all,
    probe_paths,
)

if platform.machine() != "x86_64":  # the only platform the wheel ships a library for
    pytest.skip(f"helm-python-sdk has no wheel for {platform.machine()}",
                allow_module_level=True)

import helm_python as helm  # after the platform check

REPO = Path(__file__).resolve().parents[2]
CHART = REPO / "deploy" / "helm" / "clusterpulse"
EXAMPLE = REPO / "deploy" / "helm" / "values-example.yaml"
NS = "clusterpulse"


def render(values: dict | None = None, release: str = "clusterpulse") -> list[dict]:
    with helm.Chart.load(CHART) as chart:
        manifests = chart.render(values, name=release, namespace=NS, is_install=True)
    return [d for name, text in sorted(manifests.items()) if name.endswith(".yaml")
            for d in yaml.safe_load_all(text) if d]


@pytest.fixture(scope="module")
def default() -> list[dict]:
    return render()


@pytest.fixture(scope="module")
def example() -> list[dict]:
    return render(yaml.safe_load(EXAMPLE.read_text()))


def by_kind(objects: list[dict], kind: str) -> list[dict]:
    return [o for o in objects if o["kind"] == kind]


CLUSTER_WIDE = {"CSIDriver", "ValidatingAdmissionPolicy", "ValidatingAdmissionPolicyBinding"}


def policy_map(objects: list[dict]) -> dict:
    (cm,) = [o for o in by_kind(objects, "ConfigMap") if "policy.toml" in o["data"]]
    return cm


def pod_specs(objects: list[dict]) -> list[dict]:
    """The pods of the agent, Alertmanager and dashboard workloads, in that order."""
    return [o["spec"]["template"]["spec"] for o in sorted(
        (o for o in objects if o["kind"] in WORKLOADS), key=lambda o: o["metadata"]["name"])]


def test_chart_lints_clean_and_renders_valid_objects(default, example):
    for values in (None, yaml.safe_load(EXAMPLE.read_text())):
        report = helm.lint(CHART, values, strict=True, namespace=NS)
        assert report["errors"] == [] and not [m for m in report["messages"]
                                               if m["severity"] >= 2], report
    for objects in (default, example):
        assert {o["kind"] for o in objects} == {
            "ServiceAccount", "DaemonSet", "PodMonitor", "PrometheusRule", "ConfigMap",
            "PersistentVolumeClaim", "Deployment", "Service", "PodDisruptionBudget",
            "NetworkPolicy", "StatefulSet", "CSIDriver", "ValidatingAdmissionPolicy",
            "ValidatingAdmissionPolicyBinding"}
        assert {o["metadata"]["namespace"] for o in objects if o["kind"] not in CLUSTER_WIDE} \
            == {NS}
        _validate_all(objects)


def test_every_container_has_liveness_and_readiness_on_a_port_it_serves(default):
    assert probe_paths(default) == {
        name: {"livenessProbe": path, "readinessProbe": path} for name, path in PROBES.items()}


def _ingress(objects: list[dict], name: str) -> list[dict]:
    pol = next(o for o in by_kind(objects, "NetworkPolicy") if o["metadata"]["name"] == name)
    assert pol["spec"]["policyTypes"] == ["Ingress"]
    return pol["spec"]["ingress"]


def test_the_remediation_receiver_is_scraped_for_the_audit_head_as_job_remediation(default):
    """Its /metrics carries the central audit log's head (AuditLogRewound); its job is
    not clusterpulse*, whose up series NodeAgentDown reads."""
    base = [d for d in yaml.safe_load_all(
        (REPO / "deploy/kubernetes/base/dashboard.yaml").read_text()) if d]
    for objs in (default, base):
        (pm,) = [o for o in objs if o.get("kind") == "PodMonitor"
                 and o["metadata"]["name"].endswith("remediation")]
        (ep,) = pm["spec"]["podMetricsEndpoints"]
        assert (ep["port"], ep["path"]) == ("webhook", "/metrics")
        assert {"targetLabel": "job", "replacement": "remediation"} in ep["relabelings"]
        assert pm["spec"]["selector"]["matchLabels"]["app.kubernetes.io/name"] == \
            "clusterpulse-dashboard"


def test_network_policies_admit_only_whom_the_issue_names(default):
    dash = {"app.kubernetes.io/name": "clusterpulse-dashboard",
            "app.kubernetes.io/instance": "clusterpulse"}
    monitoring = {"matchLabels": {"kubernetes.io/metadata.name": "monitoring"}}
    (agent_rule,) = _ingress(default, "clusterpulse-agent")
    assert agent_rule["ports"] == [{"port": 9477, "protocol": "TCP"}]
    assert agent_rule["from"] == [
        {"namespaceSelector": monitoring,
         "podSelector": {"matchLabels": {"app.kubernetes.io/name": "prometheus"}}},
        {"podSelector": {"matchLabels": dash}}]
    ui, hook = _ingress(default, "clusterpulse-dashboard")
    assert ui == {"ports": [{"port": 8501, "protocol": "TCP"}],
                  "from": [{"namespaceSelector": {}}]}
    am = {"app.kubernetes.io/name": "clusterpulse-alertmanager",
          "app.kubernetes.io/instance": "clusterpulse"}
    prometheus = {"namespaceSelector": monitoring,
                  "podSelector": {"matchLabels": {"app.kubernetes.io/name": "prometheus"}}}
    # The webhook from the chart's own Alertmanager only, and Prometheus for its
    # /metrics (the central audit log's head) ...
    assert hook == {"ports": [{"port": 19495, "protocol": "TCP"}],
                    "from": [{"podSelector": {"matchLabels": am}}, prometheus]}
    # ... whose API admits Prometheus and the dashboard (and asks them for the password).
    (am_rule,) = _ingress(default, "clusterpulse-alertmanager")
    assert am_rule == {"ports": [{"port": 9093, "protocol": "TCP"}], "from": [
        {"namespaceSelector": monitoring,
         "podSelector": {"matchLabels": {"app.kubernetes.io/name": "prometheus"}}},
        {"podSelector": {"matchLabels": dash}}]}
    # An Alertmanager elsewhere: the webhook from networkPolicy.alertmanager's pods.
    elsewhere = render({"alertmanager": {"url": "http://am.monitoring:9093",
                                         "server": {"enabled": False}}})
    _, hook = _ingress(elsewhere, "clusterpulse-dashboard")
    assert hook["from"] == [{"namespaceSelector": monitoring, "podSelector": {
        "matchLabels": {"app.kubernetes.io/name": "alertmanager"}}}, prometheus]
    assert "clusterpulse-alertmanager" not in {o["metadata"]["name"] for o in elsewhere}
    # Each policy selects the pods it is named for.
    pods = {o["metadata"]["name"]: o["spec"]["template"]["metadata"]["labels"]
            for o in default if o["kind"] in WORKLOADS}
    for pol in by_kind(default, "NetworkPolicy"):
        wanted = pol["spec"]["podSelector"]["matchLabels"]
        assert wanted.items() <= pods[pol["metadata"]["name"]].items()


def test_images_are_pinned_by_digest_when_one_is_set(default, example):
    def images(objects: list[dict]) -> set[str]:
        return {c["image"] for pod in pod_specs(objects)
                for c in pod["containers"] + pod.get("initContainers", [])}
    assert images(default) == {"clusterpulse-agent:0.1.0", "clusterpulse-dashboard:0.1.0",
                               "quay.io/prometheus/alertmanager:v0.28.1",
                               "registry.k8s.io/sig-storage/csi-node-driver-registrar:v2.13.0"}
    values = yaml.safe_load(EXAMPLE.read_text())
    assert images(example) == {
        f"registry.example.com/gpu-platform/{values['images'][c]['repository']}"
        f"@{values['images'][c]['digest']}"
        for c in ("agent", "dashboard", "alertmanager", "registrar")}
    tagged = render({"images": {"agent": {"repository": "clusterpulse-agent", "tag": "0.2.0"}}})
    assert "clusterpulse-agent:0.2.0" in images(tagged)


@pytest.mark.parametrize("values, where", [
    ({"images": {"agent": {"repository": "a", "digest": "sha256:abc"}}},
     "/images/agent/digest"),
    ({"agnet": {"port": 9477}}, "'agnet' not allowed"),
    ({"prometheus": {"url": "prometheus:9090"}}, "/prometheus/url"),
    ({"alertmanager": {"server": {"enable": True}}}, "'enable' not allowed"),
    ({"alertmanager": {"url": "am:9093"}}, "/alertmanager/url"),
])
def test_bad_values_are_refused_naming_the_key(values, where):
    with pytest.raises(helm.HelmValuesError, match=where):
        render(values)


@pytest.mark.parametrize("values, says", [
    ({"alertmanager": {"basicAuth": {"enabled": False}}}, "always asks for the password"),
    ({"alertmanager": {"server": {"enabled": False}}}, "say where Alertmanager is"),
    ({"remediation": {"enabled": False}}, "give it your routing"),
])
def test_an_alertmanager_without_password_or_receiver_is_refused(values, says):
    """The chart's Alertmanager without basic auth would be issue #29's open API again."""
    with pytest.raises(Exception, match=says):
        render(values)


def test_example_values_reach_the_objects(example):
    labelled = {o["kind"]: o["metadata"]["labels"].get("release") for o in example
                if o["kind"] in ("PodMonitor", "PrometheusRule")}
    assert labelled == {"PodMonitor": "kube-prometheus-stack",
                        "PrometheusRule": "kube-prometheus-stack"}
    agent, am, csi, dash = pod_specs(example)
    assert [v["secret"]["secretName"] for v in am["volumes"] if "secret" in v] == [
        "clusterpulse-alertmanager-password", "clusterpulse-webhook-token"]
    assert agent["runtimeClassName"] == "nvidia"
    # the CSI plugin runs where the agent does: its socket directory is on those nodes
    assert (csi["nodeSelector"], csi["tolerations"]) == (agent["nodeSelector"],
                                                         agent["tolerations"])
    assert "runtimeClassName" not in csi  # it reads no GPU
    assert agent["nodeSelector"]["node-role.example.com/training"] == "true"
    assert {"key": "dedicated", "operator": "Equal", "value": "training",
            "effect": "NoSchedule"} in agent["tolerations"]
    assert dash["nodeSelector"] == {"node-role.kubernetes.io/infra": "true"}
    dashboard, remediation = dash["containers"]
    args = dashboard["args"]
    assert args[args.index("--prometheus") + 1] == \
        "http://kube-prometheus-stack-prometheus.monitoring:9090"
    assert args[args.index("--alertmanager") + 1] == \
        "http://clusterpulse-alertmanager.clusterpulse:9093"
    assert args[args.index("--alertmanager-password-file") + 1].startswith(
        next(m["mountPath"] for m in dashboard["volumeMounts"] if m["name"] == "alertmanager"))
    assert {"name": "alertmanager", "secret": {
        "secretName": "clusterpulse-alertmanager-password", "defaultMode": 0o400}} \
        in dash["volumes"]
    assert "--dry-run" not in remediation["args"]


def test_objects_match_the_kustomize_base_where_both_say_the_same(default):
    """One product, two packagings: the chart's rules, policy and pod hardening are the
    base's (the rules and policy are generated from one source into both)."""
    base = _base_objects()
    assert by_kind(default, "PrometheusRule")[0]["spec"] == \
        by_kind(base, "PrometheusRule")[0]["spec"]
    assert by_kind(default, "PodMonitor")[0]["spec"]["podMetricsEndpoints"] == \
        by_kind(base, "PodMonitor")[0]["spec"]["podMetricsEndpoints"]
    for kind in sorted(CLUSTER_WIDE):  # the CSI driver and who may mount it
        assert [o["spec"] for o in by_kind(default, kind)] == \
            [o["spec"] for o in by_kind(base, kind)], kind
    policy = policy_map(default)["data"]["policy.toml"]
    source = (REPO / "deploy" / "local" / "policy.toml").read_text()
    assert policy.rstrip("\n").endswith(source.rstrip("\n"))
    def am_config(objects: list[dict]) -> dict[str, str]:
        cm = next(o for o in by_kind(objects, "ConfigMap")
                  if o["metadata"]["name"] == "clusterpulse-alertmanager")
        return {k: "".join(line for line in v.splitlines(keepends=True)
                           if not line.startswith("# GENERATED")) for k, v in cm["data"].items()}
    assert am_config(default) == am_config(base)
    for ours, theirs in zip(pod_specs(default), pod_specs(base), strict=True):
        for key in ("securityContext", "hostPID", "hostNetwork", "automountServiceAccountToken",
                    "nodeSelector", "tolerations", "priorityClassName"):
            assert ours.get(key) == theirs.get(key), key
        assert sorted(v["name"] for v in ours["volumes"]) == \
            sorted(v["name"] for v in theirs["volumes"])
        for c, b in zip(ours["containers"] + ours.get("initContainers", []),
                        theirs["containers"] + theirs.get("initContainers", []), strict=True):
            assert (c["securityContext"], c["resources"], c.get("args"), c.get("command")) == \
                (b["securityContext"], b["resources"], b.get("args"), b.get("command")), c["name"]
            assert {m["mountPath"] for m in c["volumeMounts"]} == \
                {m["mountPath"] for m in b["volumeMounts"]}, c["name"]


def test_optional_parts_can_be_left_out_and_what_remains_is_valid():
    """No prometheus-operator CRDs, no receiver, no policies: the rest still installs, and
    nothing left refers to what was left out (the policy ConfigMap, the webhook port)."""
    objects = render({"podMonitor": {"enabled": False}, "prometheusRule": {"enabled": False},
                      "remediation": {"enabled": False},
                      "alertmanager": {"url": "http://am.monitoring:9093",
                                       "server": {"enabled": False}},
                      "networkPolicy": {"enabled": False}, "csi": {"enabled": False},
                      "dashboard": {"podDisruptionBudget": {"enabled": False}}},
                     release="gpu")
    assert {o["kind"] for o in objects} == {
        "ServiceAccount", "DaemonSet", "PersistentVolumeClaim", "Deployment", "Service"}
    assert [o["metadata"]["name"] for o in by_kind(objects, "DaemonSet")] == \
        ["gpu-clusterpulse-agent"]
    _validate_all(objects)
    (dash,) = by_kind(objects, "Deployment")
    assert dash["metadata"]["name"] == "gpu-clusterpulse-dashboard"
    assert [c["name"] for c in dash["spec"]["template"]["spec"]["containers"]] == ["dashboard"]
    assert "19495" not in yaml.safe_dump(objects)


def test_a_policy_given_as_a_value_replaces_the_shipped_one():
    policy = 'dry_run = true\n\n[[rule]]\nalert = "RankHung"\naction = "restart"\n'
    cm = policy_map(render({"remediation": {"policy": policy}}))
    assert cm["data"]["policy.toml"].rstrip("\n") == policy.rstrip("\n")


def test_the_rendered_policy_is_one_the_receiver_loads(default, tmp_path):
    from clusterpulse.dashboard.remediation import Policy
    cm = policy_map(default)
    (tmp_path / "policy.toml").write_text(cm["data"]["policy.toml"])
    assert Policy.load(tmp_path / "policy.toml").rules


def test_every_flag_in_the_pods_is_one_the_program_knows(default):
    """A renamed flag puts a pod in a crash loop that no render or schema check sees: every
    --flag in the containers' args must be in the program's --help."""
    values = yaml.safe_load(EXAMPLE.read_text())
    flags: dict[str, set[str]] = {}
    named = {"agent": "clusterpulse-agent", "alertmanager": "prometheus-alertmanager",
             "csi": "clusterpulse-csi"}
    for objects in (default, render(values)):
        for pod in pod_specs(objects):
            for c in pod["containers"]:
                if c["name"] == "registrar":  # Kubernetes' sidecar: not installed here
                    continue
                args = c["args"]
                program = named.get(c["name"], args[0])
                flags.setdefault(program, set()).update(
                    a.split("=")[0] for a in args if a.startswith("--"))
    assert set(flags) == {"clusterpulse-agent", "clusterpulse-dashboard", "clusterpulse-csi",
                          "clusterpulse-remediate", "prometheus-alertmanager"}
    for program, used in flags.items():
        path = shutil.which(program) if program == "prometheus-alertmanager" else \
            str(Path(sys.executable).parent / program)
        assert path, f"{program} is not installed"
        out = subprocess.run([path, "--help"], capture_output=True, text=True, timeout=120)
        assert out.returncode == 0, out.stderr
        known = set(re.findall(r"--[\w.-]+", out.stdout + out.stderr))
        assert not sorted(f for f in used if f not in known), program


def test_the_agent_remembers_gpus_unless_told_it_sees_only_some(default):
    """The DaemonSet's agent sees every GPU of its node: --remember-gpus keeps a GPU lost
    before a restart down. agent.rememberGpus=false (an agent given only some GPUs)
    drops the flag, or it would report the node's other GPUs missing (docs/agent.md)."""
    def agent_args(objects: list[dict]) -> list[str]:
        (ds,) = [d for d in by_kind(objects, "DaemonSet")
                 if d["metadata"]["name"].endswith("-agent")]
        (c,) = ds["spec"]["template"]["spec"]["containers"]
        return c["args"]

    assert "--remember-gpus" in agent_args(default)
    assert "--state-dir" in (off := agent_args(render({"agent": {"rememberGpus": False}})))
    assert "--remember-gpus" not in off
