"""Alertmanager as the project ships it asks for basic auth (issue #29): a local user
posted an alert to its open API and the remediation policy killed the victim's ranks
2 s later. A real Alertmanager with the local stack's web config (the shipped
deploy/alertmanager/web.yml with a fresh bcrypt hash), and a real Prometheus with the
local stack's configuration template, which must still deliver its alerts."""

from __future__ import annotations

import json
import shutil
import stat

import pytest
import requests

from deploy.local.stack import AM_USER, HERE, REPO, alertmanager_auth
from tests.support.ports import free_port
from tests.support.procs import Proc, wait_until

pytestmark = pytest.mark.integration


@pytest.fixture
def stack(tmp_path):
    am_bin, prom_bin = shutil.which("prometheus-alertmanager"), shutil.which("prometheus")
    assert am_bin and prom_bin, "prometheus and prometheus-alertmanager are not installed"
    web, password_file = alertmanager_auth(tmp_path)
    am_port, prom_port = free_port(), free_port()
    am_config = tmp_path / "alertmanager.yml"
    am_config.write_text((REPO / "deploy" / "alertmanager" / "alertmanager.yml").read_text())
    am = Proc([am_bin, f"--config.file={am_config}", f"--storage.path={tmp_path / 'am'}",
               f"--web.listen-address=127.0.0.1:{am_port}", f"--web.config.file={web}",
               "--cluster.listen-address="], tmp_path / "alertmanager.log")
    rules = tmp_path / "always.rules.yml"
    rules.write_text("groups:\n- name: t\n  rules:\n  - alert: AlwaysFiring\n"
                     "    expr: vector(1)\n    labels: {run: demo}\n")
    (tmp_path / "prometheus.yml").write_text((HERE / "prometheus.yml.tmpl").read_text().format(
        scrape_interval="1s", rule_files=f"  - {rules}", alertmanager=f"127.0.0.1:{am_port}",
        am_user=AM_USER, am_password_file=password_file, agents="[]",
        remediation="127.0.0.1:9"))
    prom = Proc([prom_bin, f"--config.file={tmp_path / 'prometheus.yml'}",
                 f"--storage.tsdb.path={tmp_path / 'prom'}",
                 f"--web.listen-address=127.0.0.1:{prom_port}",
                 # its first send may come before it has found Alertmanager (dropped):
                 # resend in seconds, not the default minute
                 "--rules.alert.resend-delay=2s"], tmp_path / "prometheus.log")
    url = f"http://127.0.0.1:{am_port}"
    auth = (AM_USER, password_file.read_text().strip())
    try:
        wait_until(lambda: requests.get(url + "/-/ready", auth=auth, timeout=1).ok, 30,
                   "alertmanager ready")
        yield url, auth, password_file, web
    finally:
        prom.stop()
        am.stop()


def test_alertmanager_refuses_alerts_without_credentials(stack):
    url, auth, password_file, web = stack
    forged = [{"labels": {"alertname": "RankHung", "run": "victim", "rank": "0"}}]
    assert requests.post(url + "/api/v2/alerts", json=forged, timeout=5).status_code == 401
    assert requests.post(url + "/api/v2/alerts", json=forged, timeout=5,
                         auth=(AM_USER, "wrong")).status_code == 401
    assert requests.get(url + "/api/v2/alerts", timeout=5).status_code == 401
    # the secrets: the password file is private, the web config holds only a hash
    assert stat.S_IMODE(password_file.stat().st_mode) == 0o600
    assert password_file.read_text().strip() not in web.read_text()
    # Prometheus authenticates with the stack's template and delivers its alert
    def delivered() -> bool:
        r = requests.get(url + "/api/v2/alerts", auth=auth, timeout=5)
        return r.ok and any(a["labels"].get("alertname") == "AlwaysFiring" for a in r.json())
    wait_until(delivered, 60, "Prometheus's alert in Alertmanager")
    names = {a["labels"]["alertname"] for a in requests.get(
        url + "/api/v2/alerts", auth=auth, timeout=5).json()}
    assert "RankHung" not in names, json.dumps(sorted(names))


def test_the_dashboard_reads_alerts_with_its_password_file(stack, monkeypatch):
    from clusterpulse.dashboard import config
    from clusterpulse.dashboard.amclient import AlertmanagerClient, AlertmanagerUnavailable

    url, _, password_file, _ = stack
    with pytest.raises(AlertmanagerUnavailable):
        AlertmanagerClient(url).alerts()
    monkeypatch.setenv("CLUSTERPULSE_ALERTMANAGER_PASSWORD_FILE", str(password_file))
    credentials = config.from_env().alertmanager_auth()
    assert credentials == (AM_USER, password_file.read_text().strip())
    wait_until(lambda: AlertmanagerClient(url, auth=credentials).alerts(), 60,
               "alerts read with the password file")


def test_the_shipped_debian_defaults_turn_the_gossip_port_off(tmp_path):
    """Found in the second review: the systemd instructions set only --web.config.file,
    Debian's default cluster port stayed open (0.0.0.0:9094, no authentication), and a
    user's own Alertmanager joined as a peer and planted a silence of every alert. The
    shipped /etc/default/prometheus-alertmanager, run as Debian's unit runs it."""
    import shlex

    am_bin = shutil.which("prometheus-alertmanager")
    assert am_bin, "prometheus-alertmanager is not installed"
    defaults = (REPO / "deploy/alertmanager/prometheus-alertmanager.default").read_text()
    (line,) = [x for x in defaults.splitlines() if x.startswith("ARGS=")]
    # the unit passes $ARGS unquoted: the shell's word splitting of the quoted value
    args = shlex.split(shlex.split(line.split("=", 1)[1])[0])
    web, password_file = alertmanager_auth(tmp_path)
    args = [a.replace("/etc/prometheus/alertmanager-web.yml", str(web)) for a in args]
    assert f"--web.config.file={web}" in args and "--cluster.listen-address=" in args
    port = free_port()
    config = tmp_path / "alertmanager.yml"
    config.write_text((REPO / "deploy" / "alertmanager" / "alertmanager.yml").read_text())
    am = Proc([am_bin, *args, f"--config.file={config}", f"--storage.path={tmp_path / 'am'}",
               f"--web.listen-address=127.0.0.1:{port}"], tmp_path / "am.log")
    try:
        url = f"http://127.0.0.1:{port}/api/v2/status"
        auth = (AM_USER, password_file.read_text().strip())
        status = wait_until(lambda: requests.get(url, auth=auth, timeout=2).ok and
                            requests.get(url, auth=auth, timeout=2).json(), 30,
                            "Alertmanager answering with the password")
        assert status["cluster"]["status"] == "disabled", status["cluster"]
        assert requests.get(url, timeout=5).status_code == 401
    finally:
        am.stop()
