"""The Kubernetes Alertmanager asks for the password (issue #29): the kustomize base and
the Helm chart's Alertmanager pod, played on loopback as the manifests say. Each volume
becomes a directory holding what the cluster would mount there (the ConfigMap as
rendered, the two secrets with test values); the init container's own script, run with
the real clusterpulse-ctl, writes the web config; the real Alertmanager runs with the
container's own arguments. Without credentials, posting an alert is 401; with the
password from the secret, 200."""

from __future__ import annotations

import os
import re
import secrets
import shutil
import subprocess
import sys
from pathlib import Path

import pytest
import requests

from tests.deploy.test_kubernetes import _base_objects
from tests.support.ports import free_port
from tests.support.procs import Proc, wait_until

pytestmark = pytest.mark.integration

USER = "clusterpulse"
PASSWORD_SECRET, WEBHOOK_SECRET = "clusterpulse-alertmanager-password", "clusterpulse-webhook-token"


def _helm_objects() -> list[dict]:
    from tests.deploy import test_helm  # skips off x86_64 (the Helm SDK's wheel)
    return test_helm.render()


PACKAGINGS = {"kustomize": _base_objects, "helm": _helm_objects}


class Pod:
    """The Alertmanager StatefulSet's pod as directories: one per volume."""

    def __init__(self, objects: list[dict], root: Path, password: str, token: str) -> None:
        (sts,) = [o for o in objects if o["kind"] == "StatefulSet"]
        self.spec = sts["spec"]["template"]["spec"]
        maps = {o["metadata"]["name"]: o["data"] for o in objects if o["kind"] == "ConfigMap"}
        self.config = maps
        secret_data = {PASSWORD_SECRET: {"password": password + "\n"},
                       WEBHOOK_SECRET: {"token": token + "\n"}}
        self.dirs: dict[str, Path] = {}
        claims = [c["metadata"]["name"] for c in sts["spec"]["volumeClaimTemplates"]]
        for vol in self.spec["volumes"] + [{"name": c} for c in claims]:
            d = root / vol["name"]
            d.mkdir(mode=0o700)
            files = (maps[vol["configMap"]["name"]] if "configMap" in vol else
                     secret_data[vol["secret"]["secretName"]] if "secret" in vol else {})
            for key, text in files.items():
                (d / key).write_text(text)
            self.dirs[vol["name"]] = d

    def local(self, container: dict, text: str) -> str:
        """`text` with each of the container's mount paths replaced by its directory."""
        mounts = {m["mountPath"]: str(self.dirs[m["name"]]) for m in container["volumeMounts"]}
        pattern = "|".join(re.escape(p) for p in sorted(mounts, key=len, reverse=True))
        return re.sub(rf"(?<![\w/.-])({pattern})(?=/|\s|$|')", lambda m: mounts[m[1]], text)


@pytest.fixture(params=sorted(PACKAGINGS))
def alertmanager(request, tmp_path):
    am_bin = shutil.which("prometheus-alertmanager")
    assert am_bin, "prometheus-alertmanager is not installed (scripts/setup.sh)"
    password, token = secrets.token_hex(32), secrets.token_hex(32)
    pod = Pod(PACKAGINGS[request.param](), tmp_path, password, token)
    # The init container, as the manifest says, with the real clusterpulse-ctl.
    (init,) = pod.spec["initContainers"]
    sh, opt, script = init["command"]
    env = {**os.environ, "PATH": f"{Path(sys.executable).parent}:{os.environ['PATH']}",
           **{e["name"]: e["value"] for e in init.get("env", [])}}
    out = subprocess.run([sh, opt, pod.local(init, script)], env=env, capture_output=True,
                         text=True, timeout=60)
    assert out.returncode == 0, out.stderr
    (am,) = pod.spec["containers"]
    port = free_port()
    args = [pod.local(am, a) for a in am["args"]]
    args = [f"--web.listen-address=127.0.0.1:{port}" if a.startswith("--web.listen-address=")
            else a for a in args]
    proc = Proc([am_bin, *args], tmp_path / "alertmanager.log")
    url = f"http://127.0.0.1:{port}"
    try:
        wait_until(lambda: requests.get(url + "/-/ready", auth=(USER, password),
                                        timeout=1).ok, 15, "alertmanager ready")
        yield url, password, pod
    finally:
        proc.stop()
    assert proc.p.returncode is not None


def test_the_kubernetes_alertmanager_refuses_alerts_without_the_password(alertmanager):
    url, password, pod = alertmanager
    forged = [{"labels": {"alertname": "RankHung", "run": "victim", "rank": "0"}}]
    api = url + "/api/v2/alerts"
    assert requests.post(api, json=forged, timeout=5).status_code == 401
    assert requests.post(api, json=forged, timeout=5, auth=(USER, "wrong")).status_code == 401
    assert requests.post(api, json=forged, timeout=5, auth=("admin", password)).status_code == 401
    assert requests.post(url + "/api/v2/silences", timeout=5, json={
        "matchers": [{"name": "alertname", "value": "GpuDown", "isRegex": False}],
        "startsAt": "2030-01-01T00:00:00Z", "endsAt": "2030-01-02T00:00:00Z",
        "createdBy": "x", "comment": "x"}).status_code == 401
    assert requests.get(url + "/-/ready", timeout=5).status_code == 401
    # Prometheus and the dashboard, with the password from the secret, are let in.
    ok = [{"labels": {"alertname": "AuthCheck", "run": "demo"}}]
    assert requests.post(api, json=ok, timeout=5, auth=(USER, password)).status_code == 200
    names = {a["labels"]["alertname"] for a in requests.get(
        api, auth=(USER, password), timeout=5).json()}
    assert names == {"AuthCheck"}
    # The web config in the memory volume holds the hash, never the password; the
    # loaded routing sends to the dashboard's remediation receiver with the webhook token.
    web = (pod.dirs["web"] / "web.yml").read_text()
    assert password not in web and "REPLACE-WITH-A-BCRYPT-HASH" not in web
    assert (pod.dirs["web"] / "web.yml").stat().st_mode & 0o077 == 0
    status = requests.get(url + "/api/v2/status", auth=(USER, password), timeout=5).json()
    assert "http://clusterpulse-dashboard.clusterpulse:19495/alertmanager" in \
        status["config"]["original"]
