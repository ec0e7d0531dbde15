"""deploy/kubernetes: strict schema validation, admin expectations, generated files in sync."""

from __future__ import annotations

import importlib.util
import shutil
import subprocess
import sys
from pathlib import Path

import pytest
import yaml
from kubernetes_validate import utils as kv

from tests.support import podsecurity

REPO = Path(__file__).resolve().parents[2]
K8S = REPO / "deploy" / "kubernetes"
VERSIONS = ("1.30.0", "1.33.0")  # 1.30: ValidatingAdmissionPolicy v1 (base/csi.yaml)

# prometheus-operator's monitoring.coreos.com/v1 fields (pkg/apis/monitoring/v1), the
# subset a strict check needs: anything else in these objects is a typo or misplaced.
PODMONITOR_SPEC = {"jobLabel", "podTargetLabels", "podMetricsEndpoints", "selector",
                   "namespaceSelector", "sampleLimit", "targetLimit", "labelLimit",
                   "labelNameLengthLimit", "labelValueLengthLimit", "attachMetadata",
                   "scrapeProtocols", "scrapeClass", "keepDroppedTargets", "bodySizeLimit",
                   "selectorMechanism", "fallbackScrapeProtocol", "scrapeClassicHistograms",
                   "nativeHistogramBucketLimit", "nativeHistogramMinBucketFactor",
                   "convertClassicHistogramsToNHCB"}
POD_ENDPOINT = {"port", "portNumber", "targetPort", "path", "scheme", "params", "interval",
                "scrapeTimeout", "honorLabels", "honorTimestamps", "trackTimestampsStaleness",
                "metricRelabelings", "relabelings", "proxyUrl", "filterRunning",
                "enableHttp2", "followRedirects", "basicAuth", "bearerTokenSecret",
                "authorization", "oauth2", "tlsConfig"}
RULE_GROUP = {"name", "interval", "rules", "limit", "partial_response_strategy",
              "query_offset", "labels"}
RULE = {"record", "alert", "expr", "for", "keep_firing_for", "labels", "annotations"}


def _docs(text: str) -> list[dict]:
    return [d for d in yaml.safe_load_all(text) if d]


def _base_objects() -> list[dict]:
    kust = yaml.safe_load((K8S / "base" / "kustomization.yaml").read_text())
    return [d for f in kust["resources"] for d in _docs((K8S / "base" / f).read_text())]


@pytest.fixture(scope="module")
def rendered_overlay() -> list[dict]:
    kubectl = shutil.which("kubectl")
    if kubectl is None:
        pytest.skip("kubectl (for `kubectl kustomize`) is not installed; the base files "
                    "are validated by the other tests")
    out = subprocess.run([kubectl, "kustomize", str(K8S / "overlays" / "example")],
                         capture_output=True, text=True, check=True, timeout=120)
    return _docs(out.stdout)


def _check_operator_object(obj: dict) -> None:
    kind = obj["kind"]
    if kind == "PodMonitor":
        assert set(obj["spec"]) <= PODMONITOR_SPEC, set(obj["spec"]) - PODMONITOR_SPEC
        for ep in obj["spec"]["podMetricsEndpoints"]:
            assert set(ep) <= POD_ENDPOINT, set(ep) - POD_ENDPOINT
    elif kind == "PrometheusRule":
        assert set(obj["spec"]) == {"groups"}
        for group in obj["spec"]["groups"]:
            assert set(group) <= RULE_GROUP, set(group) - RULE_GROUP
            assert group.get("interval"), f"group {group['name']} has no interval"
            for rule in group["rules"]:
                assert set(rule) <= RULE, set(rule) - RULE
    else:
        raise AssertionError(f"unexpected custom resource {kind}")


def _validate_all(objects: list[dict]) -> None:
    for obj in objects:
        if obj["apiVersion"].startswith("monitoring.coreos.com/"):
            _check_operator_object(obj)
            continue
        for version in VERSIONS:
            try:
                kv.validate(obj, version, strict=True)
            except kv.ValidationError as err:
                raise AssertionError(f"{obj['kind']}/{obj['metadata']['name']} is invalid "
                                     f"for Kubernetes {version}: {err.message} at "
                                     f"{'.'.join(map(str, err.path))}") from None


def test_base_validates_strictly_on_1_30_and_1_33():
    objects = _base_objects()
    assert {o["kind"] for o in objects} >= {
        "Namespace", "ServiceAccount", "DaemonSet", "PodMonitor", "PrometheusRule",
        "PersistentVolumeClaim", "ConfigMap", "Deployment", "Service", "StatefulSet",
        "NetworkPolicy"}
    _validate_all(objects)


def test_strict_validation_catches_a_misplaced_field():
    """The check itself must bite: jobLabel inside an endpoint, or a typo in a pod spec."""
    pm = next(o for o in _base_objects() if o["kind"] == "PodMonitor")
    pm["spec"]["podMetricsEndpoints"][0]["jobLabel"] = "clusterpulse"
    with pytest.raises(AssertionError):
        _check_operator_object(pm)
    ds = next(o for o in _base_objects() if o["kind"] == "DaemonSet")
    ds["spec"]["template"]["spec"]["hostPid"] = True
    with pytest.raises(AssertionError, match="hostPid"):
        _validate_all([ds])


def test_overlay_renders_and_validates(rendered_overlay):
    _validate_all(rendered_overlay)
    labelled = {o["kind"]: o["metadata"]["labels"].get("release") for o in rendered_overlay
                if o["kind"] in ("PodMonitor", "PrometheusRule")}
    assert labelled == {"PodMonitor": "kube-prometheus-stack",
                        "PrometheusRule": "kube-prometheus-stack"}
    ds = next(o for o in rendered_overlay if o["kind"] == "DaemonSet")
    assert ds["spec"]["template"]["spec"]["runtimeClassName"] == "nvidia"


def test_pods_are_locked_down_and_bounded():
    objects = _base_objects()
    ns = next(o for o in objects if o["kind"] == "Namespace")
    assert ns["metadata"]["labels"]["pod-security.kubernetes.io/enforce"] == "privileged"
    for sa in (o for o in objects if o["kind"] == "ServiceAccount"):
        assert sa["automountServiceAccountToken"] is False
    workloads = [o for o in objects if o["kind"] in WORKLOADS]
    assert {w["kind"] for w in workloads} == set(WORKLOADS)
    for w in workloads:
        pod = w["spec"]["template"]["spec"]
        assert pod["automountServiceAccountToken"] is False
        assert pod["securityContext"]["seccompProfile"]["type"] == "RuntimeDefault"
        assert pod["securityContext"].get("runAsUser", 0) != 0 or w["kind"] == "DaemonSet"
        for c in pod["containers"] + pod.get("initContainers", []):
            sc = c["securityContext"]
            propagation = {m.get("mountPropagation") for m in c.get("volumeMounts", [])}
            if (w["metadata"]["name"], c["name"]) == ("clusterpulse-csi", "csi"):
                # The one privileged container: it mounts into the kubelet's pod
                # directories, seen by the kubelet through Bidirectional propagation, as
                # root (the image's user is 65534, which keeps no capability).
                assert sc["privileged"] is True and sc["readOnlyRootFilesystem"]
                assert sc["runAsUser"] == 0 and "Bidirectional" in propagation
                continue
            assert sc["capabilities"]["drop"] == ["ALL"], c["name"]
            assert not sc.get("privileged") and "Bidirectional" not in propagation
            assert sc["allowPrivilegeEscalation"] is False and sc["readOnlyRootFilesystem"]
            assert {"cpu", "memory"} <= set(c["resources"]["requests"]), c["name"]
            assert {"cpu", "memory"} <= set(c["resources"]["limits"]), c["name"]
    agent = next(w for w in workloads if w["metadata"]["name"] == "clusterpulse-agent")[
        "spec"]["template"]["spec"]
    assert agent["priorityClassName"] == "system-node-critical"
    assert agent["containers"][0]["securityContext"]["capabilities"]["add"] == ["KILL"]
    assert any(t["key"] == "nvidia.com/gpu" for t in agent["tolerations"])
    assert "9400" not in yaml.safe_dump(agent), "9400 is dcgm-exporter's port"
    dash = next(w for w in workloads if w["kind"] == "Deployment")
    assert dash["spec"]["strategy"]["type"] == "Recreate"
    assert dash["spec"]["template"]["spec"]["securityContext"]["runAsNonRoot"] is True
    # Every volume the dashboard mounts from the cluster is defined here or is a secret
    # the admin creates (named in the file's header).
    defined = {(o["kind"], o["metadata"]["name"]) for o in objects}
    for vol in dash["spec"]["template"]["spec"]["volumes"]:
        if "configMap" in vol:
            assert ("ConfigMap", vol["configMap"]["name"]) in defined
        if "persistentVolumeClaim" in vol:
            assert ("PersistentVolumeClaim", vol["persistentVolumeClaim"]["claimName"]) in defined


# Every container's health endpoint: the agent's /healthz (503 once a thread died),
# Streamlit's own, the remediation receiver's /healthz; Alertmanager's port (every path
# of its, /-/ready too, asks for the password).
PROBES = {"agent": "/healthz", "dashboard": "/_stcore/health", "remediation": "/healthz",
          "alertmanager": "tcp", "csi": "/healthz", "registrar": "/healthz"}
WORKLOADS = ("DaemonSet", "Deployment", "StatefulSet")


def probe_paths(objects: list[dict]) -> dict[str, dict[str, str]]:
    """container -> {probe kind: path, or "tcp"}, checking that each probe targets a
    port the container declares (a probe on a wrong port restarts a healthy pod forever)."""
    out: dict[str, dict[str, str]] = {}
    for w in (o for o in objects if o["kind"] in WORKLOADS):
        for c in w["spec"]["template"]["spec"]["containers"]:
            ports = {p["name"] for p in c.get("ports", [])}
            out[c["name"]] = {}
            for kind in ("livenessProbe", "readinessProbe"):
                if kind in c:
                    how = "httpGet" if "httpGet" in c[kind] else "tcpSocket"
                    assert c[kind][how]["port"] in ports, (c["name"], kind)
                    out[c["name"]][kind] = c[kind][how].get("path", "tcp")
    return out


def test_every_container_has_liveness_and_readiness_probes():
    """The dashboard had no liveness probe and the remediation receiver no probe at all:
    a wedged process kept its pod "Running" and Alertmanager's webhooks went nowhere."""
    assert probe_paths(_base_objects()) == {
        name: {"livenessProbe": path, "readinessProbe": path} for name, path in PROBES.items()}


def test_generated_files_are_in_sync_with_their_sources():
    """Fails after someone edits deploy/prometheus rules, policy.toml or the Grafana
    dashboards without regenerating: the message names the command."""
    out = subprocess.run([sys.executable, str(REPO / "scripts" / "gen_deploy.py"), "--check"],
                         capture_output=True, text=True, timeout=120)
    assert out.returncode == 0, out.stdout + out.stderr
    # The Helm chart's copies are among the files checked (a chart cannot read files
    # outside itself, so it carries its own, generated from the same sources).
    spec = importlib.util.spec_from_file_location("gen_deploy", REPO / "scripts" / "gen_deploy.py")
    assert spec and spec.loader
    gen = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(gen)
    chart = REPO / "deploy" / "helm" / "clusterpulse" / "files"
    assert {chart / "prometheusrule-spec.yaml", chart / "policy.toml", chart / "alertmanager.yml",
            chart / "alertmanager-web.yml"} <= set(gen.targets())


def test_prometheus_rule_carries_every_source_rule_with_an_interval():
    """Each group keeps the interval its source sets (the heavy per-GPU groups: 15-30 s);
    the others get the scrape interval, whatever kube-prometheus-stack's global 30 s."""
    rule = next(o for o in _base_objects() if o["kind"] == "PrometheusRule")
    got = {g["name"]: g["interval"] for g in rule["spec"]["groups"]}
    for src in ("clusterpulse.rules.yml", "alerts.rules.yml"):
        for g in yaml.safe_load((REPO / "deploy" / "prometheus" / src).read_text())["groups"]:
            assert got[g["name"]] == g.get("interval", "5s"), g["name"]
    assert got["clusterpulse-training"] == got["clusterpulse-availability"] == "5s"
    assert got["clusterpulse-progress"] == got["clusterpulse-hangs"] == "1s"  # the hangs


def test_agent_asks_the_kubelet_which_pod_holds_each_gpu_through_a_read_only_mount():
    ds = next(o for o in _base_objects() if o["kind"] == "DaemonSet")
    pod = ds["spec"]["template"]["spec"]
    (agent,) = pod["containers"]
    sock = agent["args"][agent["args"].index("--pod-resources") + 1].removeprefix("unix://")
    (mount,) = [m for m in agent["volumeMounts"] if sock.startswith(m["mountPath"] + "/")]
    assert mount["readOnly"] is True
    (vol,) = [v for v in pod["volumes"] if v["name"] == mount["name"]]
    assert vol["hostPath"]["path"] == mount["mountPath"]
    assert pod["hostPID"] is True  # /proc/PID of every process on a GPU: its user and job
    # the node's agent sees every GPU: one lost before a restart stays down (docs/agent.md)
    assert "--state-dir" in agent["args"] and "--remember-gpus" in agent["args"]


def test_alertmanager_is_the_projects_with_basic_auth_and_the_dashboard_reads_it():
    """Issue #29: the base pointed the dashboard at kube-prometheus-stack's Alertmanager,
    whose API nothing shipped protected. Its own Alertmanager takes the shipped web.yml
    (filled in from the password secret the dashboard reads), routes to the remediation
    receiver with the webhook token, and only Prometheus and the dashboard reach it."""
    objects = _base_objects()
    (sts,) = [o for o in objects if o["kind"] == "StatefulSet"]
    pod = sts["spec"]["template"]["spec"]
    (am,) = pod["containers"]
    assert "--web.config.file=/etc/alertmanager/web/web.yml" in am["args"]
    assert "--cluster.listen-address=" in am["args"]
    secrets = {v["secret"]["secretName"] for v in pod["volumes"] if "secret" in v}
    assert secrets == {"clusterpulse-alertmanager-password", "clusterpulse-webhook-token"}
    dash = next(o for o in objects if o["kind"] == "Deployment")
    args = dash["spec"]["template"]["spec"]["containers"][0]["args"]
    assert args[args.index("--alertmanager") + 1] == "http://clusterpulse-alertmanager.clusterpulse:9093"
    assert "--alertmanager-password-file" in args
    cm = next(o for o in objects if o["kind"] == "ConfigMap"
              and o["metadata"]["name"] == "clusterpulse-alertmanager")
    assert cm["data"]["web.yml"] == (REPO / "deploy" / "alertmanager" / "web.yml").read_text()
    routing = yaml.safe_load(cm["data"]["alertmanager.yml"])
    (hook,) = next(r for r in routing["receivers"] if r["name"] == "remediation")["webhook_configs"]
    assert hook["url"] == "http://clusterpulse-dashboard.clusterpulse:19495/alertmanager"
    assert any(m["mountPath"] + "/token" == hook["http_config"]["authorization"]["credentials_file"]
               for m in am["volumeMounts"])
    (pol,) = [o for o in objects if o["kind"] == "NetworkPolicy"]
    labels = sts["spec"]["template"]["metadata"]["labels"]
    assert pol["spec"]["podSelector"]["matchLabels"].items() <= labels.items()
    (rule,) = pol["spec"]["ingress"]
    assert rule["ports"] == [{"port": 9093, "protocol": "TCP"}]
    assert [list(f) for f in rule["from"]] == [["namespaceSelector", "podSelector"],
                                                ["podSelector"]]


EXAMPLE_JOB = K8S / "examples" / "training-job.yaml"


def _training_pod() -> tuple[dict, dict]:
    docs = _docs(EXAMPLE_JOB.read_text())
    ns = next(d for d in docs if d["kind"] == "Namespace")
    job = next(d for d in docs if d["kind"] == "Job")
    return ns, job["spec"]["template"]["spec"]


def test_a_training_pod_needs_no_privilege_to_reach_the_agent():
    """Issue #25 item 5: training pods needed the hostPath /run/clusterpulse, which Pod
    Security "baseline" refuses, so every training namespace had to be `privileged`.
    The example job reaches the agent through the CSI driver's inline volume instead,
    and meets baseline (its namespace enforces it) and restricted."""
    _validate_all(_docs(EXAMPLE_JOB.read_text()))
    ns, pod = _training_pod()
    assert ns["metadata"]["labels"]["pod-security.kubernetes.io/enforce"] == "baseline"
    assert podsecurity.baseline(pod) == [] and podsecurity.restricted(pod) == []
    # ... and the agent is where the rank looks: the CSI volume, mounted read-only, holds
    # the socket file the agent's --telemetry names.
    objects = _base_objects()
    (driver,) = [o for o in objects if o["kind"] == "CSIDriver"]
    (trainer,) = pod["containers"]
    (volume,) = [v for v in pod["volumes"] if "csi" in v]
    assert volume["csi"] == {"driver": driver["metadata"]["name"], "readOnly": True}
    (mount,) = [m for m in trainer["volumeMounts"] if m["name"] == volume["name"]]
    assert mount["readOnly"] is True
    env = {e["name"]: e["value"] for e in trainer["env"]}
    agent = next(o for o in objects if o["metadata"]["name"] == "clusterpulse-agent"
                 and o["kind"] == "DaemonSet")["spec"]["template"]["spec"]["containers"][0]
    telemetry = agent["args"][agent["args"].index("--telemetry") + 1]
    assert env["CLUSTERPULSE_AGENT"] == f"unix:{mount['mountPath']}/" \
        f"{telemetry.rsplit('/', 1)[1]}"
    # The way the README used to give (the hostPath, read-only) is what baseline refuses.
    old = {**pod, "volumes": [{"name": volume["name"], "hostPath": {
        "path": "/run/clusterpulse", "type": "Directory"}} if v is volume else v
        for v in pod["volumes"]]}
    assert podsecurity.baseline(old) == ["hostPath volumes: volume 'clusterpulse'"]


def test_the_csi_plugin_publishes_the_agents_socket_directory():
    """The driver serves inline volumes only, and its plugin publishes the host
    directory the agent's socket is in, where the kubelet's registrar says it listens."""
    objects = _base_objects()
    (driver,) = [o for o in objects if o["kind"] == "CSIDriver"]
    assert driver["spec"]["volumeLifecycleModes"] == ["Ephemeral"]
    assert driver["spec"]["attachRequired"] is False
    # without it the kubelet does not say a volume is ephemeral, and the plugin, which
    # serves inline volumes only, would refuse every publish
    assert driver["spec"]["podInfoOnMount"] is True
    sets = {o["metadata"]["name"]: o["spec"]["template"]["spec"] for o in objects
            if o["kind"] == "DaemonSet"}
    agent, plugin = sets["clusterpulse-agent"], sets["clusterpulse-csi"]

    def host_path(pod: dict, container: dict, flag_value: str) -> str:
        """The host path behind a path in the container (through its volume mounts)."""
        vols = {v["name"]: v for v in pod["volumes"]}
        for m in container["volumeMounts"]:
            if flag_value == m["mountPath"] or flag_value.startswith(m["mountPath"] + "/"):
                return vols[m["name"]]["hostPath"]["path"] + flag_value[len(m["mountPath"]):]
        raise AssertionError(f"{flag_value} is in no volume of {container['name']}")

    def flag(container: dict, name: str) -> str:
        args = container["args"]
        for i, a in enumerate(args):
            if a == name:
                return args[i + 1]
            if a.startswith(name + "="):
                return a.split("=", 1)[1]
        raise AssertionError(f"{container['name']} has no {name}")

    csi, registrar = plugin["containers"]
    socket = flag(agent["containers"][0], "--telemetry").removeprefix("unix:")
    assert host_path(plugin, csi, flag(csi, "--socket-dir")) == \
        host_path(agent, agent["containers"][0], socket.rsplit("/", 1)[0])
    endpoint = flag(csi, "--endpoint").removeprefix("unix://")
    assert host_path(plugin, csi, endpoint) == flag(registrar, "--kubelet-registration-path")
    assert flag(registrar, "--csi-address") == endpoint
    assert driver["metadata"]["name"] in flag(registrar, "--kubelet-registration-path")
    pods = next(m for m in csi["volumeMounts"] if m.get("mountPropagation") == "Bidirectional")
    # the kubelet's target paths are host paths: the plugin sees them at the same place
    assert host_path(plugin, csi, pods["mountPath"]) == pods["mountPath"] == \
        "/var/lib/kubelet/pods"
    # binds taken from a read-only mount are read-only for the kubelet and the pods too
    (source,) = [m for m in csi["volumeMounts"] if m["mountPath"] == flag(csi, "--socket-dir")]
    assert source["readOnly"] is True


def _selects(selector: dict, labels: dict[str, str]) -> bool:
    """A label selector's meaning (matchLabels and the four matchExpressions operators)."""
    ok = all(labels.get(k) == v for k, v in selector.get("matchLabels", {}).items())
    for e in selector.get("matchExpressions", []):
        key, op, values = e["key"], e["operator"], e.get("values", [])
        ok &= {"In": key in labels and labels[key] in values,
               "NotIn": key not in labels or labels[key] not in values,
               "Exists": key in labels, "DoesNotExist": key not in labels}[op]
    return ok


def test_only_namespaces_an_admin_labelled_may_mount_the_agents_socket():
    """Review: with the CSI volume, a pod of any namespace, at any Pod Security level, could
    reach the agent, and one with a run owner's uid would count as that run's. The
    admission policy (evaluated here with a CEL implementation; no API server runs here)
    refuses the volume outside namespaces labelled clusterpulse.io/telemetry=true."""
    import celpy

    objects = _base_objects()
    (policy,) = [o for o in objects if o["kind"] == "ValidatingAdmissionPolicy"]
    (binding,) = [o for o in objects if o["kind"] == "ValidatingAdmissionPolicyBinding"]
    assert binding["spec"]["policyName"] == policy["metadata"]["name"]
    assert binding["spec"]["validationActions"] == ["Deny"]
    assert policy["spec"]["failurePolicy"] == "Fail"
    rules = policy["spec"]["matchConstraints"]["resourceRules"]
    assert any(r["resources"] == ["pods"] and "CREATE" in r["operations"] for r in rules)
    env = celpy.Environment()
    checks = [env.program(env.compile(v["expression"])) for v in policy["spec"]["validations"]]

    def admitted(pod_spec: dict, ns_labels: dict[str, str]) -> bool:
        if not _selects(binding["spec"]["matchResources"]["namespaceSelector"], ns_labels):
            return True  # the binding does not apply there
        obj = celpy.json_to_cel({"spec": pod_spec})
        return all(bool(p.evaluate({"object": obj})) for p in checks)

    ns, pod = _training_pod()
    labels = ns["metadata"]["labels"]
    assert admitted(pod, labels)
    unlabelled = {k: v for k, v in labels.items() if k != "clusterpulse.io/telemetry"}
    assert not admitted(pod, unlabelled)
    assert not admitted(pod, {**labels, "clusterpulse.io/telemetry": "false"})
    other_csi = {**pod, "volumes": [{"name": "x", "csi": {"driver": "secrets-store.csi.k8s.io"}}]}
    for fine in (other_csi, {**pod, "volumes": [{"name": "x", "emptyDir": {}}]},
                 {k: v for k, v in pod.items() if k != "volumes"}):
        assert admitted(fine, unlabelled)


@pytest.mark.parametrize(("change", "control"), [
    ({"hostNetwork": True}, "host namespaces"),
    ({"containers": [{"name": "t", "securityContext": {"privileged": True}}]}, "privileged"),
    ({"containers": [{"name": "t", "securityContext": {"capabilities": {"add": ["SYS_ADMIN"]}}}]},
     "capabilities"),
    ({"containers": [{"name": "t", "ports": [{"containerPort": 80, "hostPort": 80}]}]},
     "hostPorts"),
    ({"containers": [{"name": "t", "readinessProbe": {"httpGet": {"host": "10.0.0.1",
                                                                  "port": 80}}}]},
     "host probes"),
    ({"securityContext": {"seccompProfile": {"type": "Unconfined"}}}, "seccompProfile"),
    ({"securityContext": {"sysctls": [{"name": "kernel.msgmax", "value": "1"}]}}, "sysctls"),
])
def test_the_pod_security_check_names_each_baseline_control(change, control):
    """The checker the example is held to is not vacuous: each baseline control it
    reads refuses a pod that breaks it."""
    (problem,) = podsecurity.baseline({"containers": [{"name": "t"}], **change})
    assert problem.startswith(control), problem
    assert podsecurity.baseline({"containers": [{"name": "t"}]}, {
        "container.apparmor.security.beta.kubernetes.io/t": "unconfined"})


def test_the_gpu_owner_keeps_the_training_pods_labels_under_prometheus_operator(tmp_path):
    """prometheus-operator gives every target the agent pod's pod, namespace and
    container labels (honor_labels off); the agent's own on clusterpulse_gpu_owner_info
    came out as exported_*, and docs/agent.md's query named the agent's pod as every
    GPU's user. A real Prometheus with those target labels and the PodMonitor's
    metricRelabelings (as the operator writes them: the same fields, snake_case)."""
    from tests.support.httpstub import answering
    from tests.support.procs import Prometheus, wait_until

    docs = yaml.safe_load_all((K8S / "base" / "agent.yaml").read_text())
    (monitor,) = [d for d in docs if d and d.get("kind") == "PodMonitor"]
    (endpoint,) = [e for e in monitor["spec"]["podMetricsEndpoints"] if e["path"] == "/metrics"]
    snake = {"sourceLabels": "source_labels", "targetLabel": "target_label"}
    relabel = [{snake.get(k, k): v for k, v in rule.items()}
               for rule in endpoint["metricRelabelings"]]
    page = ('# TYPE clusterpulse_gpu_owner_info gauge\n'
            'clusterpulse_gpu_owner_info{node="n1",gpu="0",uuid="GPU-0",pod="train-0",'
            'namespace="ml",container="trainer",device_id="GPU-0"} 1\n'
            '# TYPE clusterpulse_gpu_up gauge\n'
            'clusterpulse_gpu_up{node="n1",gpu="0",uuid="GPU-0"} 1\n')
    agent_pod = {"pod": "clusterpulse-agent-x7", "namespace": "clusterpulse",
                 "container": "agent"}
    with answering(page, "text/plain; version=0.0.4") as url:
        target = url.removeprefix("http://")
        prom = Prometheus(tmp_path, [target], labels={target: agent_pod},
                          metric_relabel=relabel)
        try:
            (owner,) = wait_until(lambda: prom.query("clusterpulse_gpu_owner_info"), 30,
                                  "the owner series scraped")
            (up,) = prom.query("clusterpulse_gpu_up")
        finally:
            prom.stop()
    assert {k: owner["metric"][k] for k in ("pod", "namespace", "container")} == \
        {"pod": "train-0", "namespace": "ml", "container": "trainer"}
    assert not [k for k in owner["metric"] if k.startswith("exported_")], owner["metric"]
    assert {k: up["metric"][k] for k in agent_pod} == agent_pod  # the others keep the agent's
