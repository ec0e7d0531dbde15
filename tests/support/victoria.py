"""Real VictoriaMetrics processes on loopback, as deploy/victoriametrics runs them past one
machine: the store (victoria-metrics), scrape shards (vmagent, the shipped
deploy/victoriametrics/vmagent.yml) and the rules (vmalert, the shipped rule files).

Each process is started with the flags its shipped /etc/default file gives its systemd
unit (deploy/victoriametrics/), with the addresses and paths of the test or benchmark
in place of the shipped ones: what the tests run is what is shipped.
"""

from __future__ import annotations

import os
import re
import shlex
import shutil
import subprocess
import time
from pathlib import Path

from tests.support.ports import free_port
from tests.support.procs import REPO, RULE_FILES, Proc, _http, wait_until

DEPLOY = REPO / "deploy" / "victoriametrics"
VMAGENT_CONFIG = DEPLOY / "vmagent.yml"
STORE_SCRAPE_CONFIG = DEPLOY / "store-scrape.yml"
# The store's user (-httpAuth.username in victoria-metrics.default), and the secrets the
# installed copy of that file gets from docs/scaling.md (-envflag.enable): the test's own.
STORE_USER = "clusterpulse"
STORE_PASSWORD = "test-store-password"
STORE_DELETE_KEY = "test-delete-key"
# The keys for what the password alone must not do (docs/security.md): the secrets file
# docs/scaling.md makes has these names, each a flag of victoria-metrics read from the
# environment.
STORE_KEYS = {"deleteAuthKey": STORE_DELETE_KEY, "snapshotAuthKey": "test-snapshot-key",
              "forceMergeAuthKey": "test-force-merge-key", "pprofAuthKey": "test-pprof-key",
              "flagsAuthKey": "test-flags-key"}
# vmalert reads `keep_firing_for` from 1.92 on (VictoriaMetrics issue #4529); Debian 12
# ships 1.79, which refuses the rule files with it ("unknown fields in rule").
KEEP_FIRING_FOR_SINCE = (1, 92)


def binary(name: str) -> str:
    path = shutil.which(name)
    assert path, (f"{name} is not installed (scripts/setup.sh installs Debian's "
                  "victoria-metrics, which has victoria-metrics, vmagent and vmalert)")
    return path


def shipped_flags(default_file: str, **override: str | None) -> list[str]:
    """The flags in a shipped /etc/default file's ARGS (deploy/victoriametrics/), each
    flag named in `override` given the test's value instead (None: left out). The
    addresses and paths change; every other flag is the shipped one."""
    text = (DEPLOY / default_file).read_text()
    args = shlex.split(re.search(r'^ARGS="(.*)"$', text, re.M).group(1))
    out = []
    for arg in args:
        name = arg.lstrip("-").split("=", 1)[0]
        if name not in override:
            out.append(arg)
    for name, value in override.items():
        if value is not None:
            out.append(f"-{name}={value}")
    return out


def default_value(default_file: str, name: str) -> str:
    """A variable set in a shipped /etc/default file (CLUSTERPULSE_SHARDS=2)."""
    text = (DEPLOY / default_file).read_text()
    return re.search(rf"^{name}=(.*)$", text, re.M).group(1).strip('"')


def version(name: str) -> tuple[int, int]:
    """vmagent/vmalert's version as (major, minor); Debian's builds print no version
    (an empty "build version"), then the package's."""
    out = subprocess.run([binary(name), "-version"], capture_output=True, text=True,
                         timeout=30).stdout
    m = re.search(r"v(\d+)\.(\d+)\.", out)
    if not m:
        pkg = subprocess.run(["dpkg-query", "-W", "-f=${Version}", "victoria-metrics"],
                             capture_output=True, text=True, timeout=30).stdout
        m = re.match(r"(?:\d+:)?(\d+)\.(\d+)", pkg)
    assert m, f"cannot tell {name}'s version"
    return int(m.group(1)), int(m.group(2))


def rule_files_for_vmalert(tmp: Path) -> list[Path]:
    """vmalert's rule files as an operator gets them: `clusterpulse-config write DIR
    --only victoriametrics` (victoriametrics/rules/, made from the shipped Prometheus
    rules: increase_prometheus(), no keep_firing_for). Written under `tmp`."""
    from clusterpulse import configcli

    written = configcli.write(tmp / "config", ["victoriametrics"], force=True)
    rules = sorted(p for p in written if p.parent.name == "rules")
    assert [p.name for p in rules] == sorted(p.name for p in RULE_FILES), rules
    return rules


class Store:
    """A Prometheus-compatible HTTP API (Prometheus, VictoriaMetrics): what the
    dashboard and the tests query."""

    def __init__(self, name: str, url: str, proc: Proc,
                 password_file: Path | None = None) -> None:
        """`password_file`: the store asks for basic auth as STORE_USER with it (what
        the shards, vmalert and the dashboard are given); None: no auth."""
        self.name, self.url, self.proc = name, url, proc
        self.password_file = password_file
        self.auth = (STORE_USER, password_file.read_text().strip()) if password_file else None

    def query(self, expr: str, timeout: float = 300) -> list[dict]:
        """An instant query; asked again (up to 3 times) when the store answers 503, as
        VictoriaMetrics does when a query waited past -search.maxQueueDuration (10 s)
        on a busy machine."""
        for attempt in range(3):
            r = _http().get(self.url + "/api/v1/query", params={"query": expr},
                            timeout=timeout, auth=self.auth)
            if r.status_code != 503 or attempt == 2:
                break
            time.sleep(2)
        r.raise_for_status()
        return r.json()["data"]["result"]

    def scalar(self, expr: str) -> float:
        res = self.query(expr)
        return float(res[0]["value"][1]) if res else float("nan")

    def stop(self) -> None:
        self.proc.stop()


def store_env(password: str = STORE_PASSWORD) -> dict[str, str]:
    """The environment the store's unit gets from its secrets file through the drop-in
    victoria-metrics-secrets.conf (docs/scaling.md): its password and keys."""
    return {**os.environ, "httpAuth_password": password, **STORE_KEYS}


def victoria_metrics(tmp: Path, scrape_config: Path | None = None) -> Store:
    """A single-node VictoriaMetrics with the shipped flags and secrets in the
    environment as installed; with `scrape_config` it scrapes that, as one machine
    without vmagent does, else the shipped store-scrape.yml with a free port for the
    remediation receiver (none runs here; another on this machine must not be read)."""
    port = free_port()
    if scrape_config is None:
        scrape_config = tmp / f"store-scrape-{port}.yml"
        scrape_config.write_text(STORE_SCRAPE_CONFIG.read_text().replace(
            "127.0.0.1:19495", f"127.0.0.1:{free_port()}"))
    flags = shipped_flags("victoria-metrics.default",
                          storageDataPath=str(tmp / f"vm-{port}"),
                          httpListenAddr=f"127.0.0.1:{port}",
                          **{"vmalert.proxyURL": None, "promscrape.config": str(scrape_config)})
    password_file = tmp / f"vm-{port}-password"
    password_file.write_text(STORE_PASSWORD + "\n")
    proc = Proc([binary("victoria-metrics"), *flags, "-loggerLevel=WARN"],
                tmp / f"vm-{port}.log", env=store_env())
    url = f"http://127.0.0.1:{port}"
    wait_until(lambda: _http().get(url + "/health", timeout=2).ok, 60, "victoria-metrics ready")
    return Store("VictoriaMetrics", url, proc, password_file)


class Shard:
    """One vmagent scrape shard with the shipped scrape config, `targets_dir` in place
    of /etc/clusterpulse/targets."""

    def __init__(self, tmp: Path, shard: int, shards: int, store_url: str,
                 targets_dir: Path, scrape_interval: str | None = None,
                 password_file: Path | None = None) -> None:
        """`password_file`: the store's password (Store.password_file), passed as the
        unit passes its credential."""
        self.shard, self.port = shard, free_port()
        self.url = f"http://127.0.0.1:{self.port}"
        config = VMAGENT_CONFIG.read_text().replace("/etc/clusterpulse/targets",
                                                    str(targets_dir))
        if scrape_interval:  # the benchmark's choice; the shipped file says 5s
            config = config.replace("scrape_interval: 5s", f"scrape_interval: {scrape_interval}")
        cfg = tmp / f"vmagent-{shard}.yml"
        cfg.write_text(config)
        flags = shipped_flags(
            "clusterpulse-vmagent.default", **{
                "promscrape.config": str(cfg),
                "remoteWrite.url": store_url + "/api/v1/write",
                "remoteWrite.tmpDataPath": str(tmp / f"vmagent-{shard}-queue"),
                "httpListenAddr": f"127.0.0.1:{self.port}"})
        if password_file is not None:  # clusterpulse-vmagent@.service's ExecStart
            flags.append(f"-remoteWrite.basicAuth.passwordFile={password_file}")
        # As the unit sets them: the shard count from the default file, the shard from
        # the instance name (clusterpulse-vmagent@SHARD).
        env = {**os.environ, "CLUSTERPULSE_SHARD": str(shard),
               "CLUSTERPULSE_SHARDS": str(shards)}
        self.proc = Proc([binary("vmagent"), *flags, "-loggerLevel=WARN"],
                         tmp / f"vmagent-{shard}.log", env=env)
        wait_until(lambda: _http().get(self.url + "/health", timeout=2).ok, 60,
                   f"vmagent shard {shard} ready")

    def targets(self) -> list[dict]:
        """The targets this shard scrapes (Prometheus' /api/v1/targets format)."""
        r = _http().get(self.url + "/api/v1/targets", timeout=30)
        r.raise_for_status()
        return r.json()["data"]["activeTargets"]

    def stop(self) -> None:
        self.proc.stop()


class VmAlert:
    """vmalert with the shipped rules and flags, reading and writing `store_url`,
    notifying `alertmanager_url`."""

    def __init__(self, tmp: Path, store_url: str, alertmanager_url: str,
                 extra: dict[str, str] | None = None,
                 password_file: Path | None = None) -> None:
        """`extra`: flags given other values than the shipped ones (a benchmark trying
        a change before it is shipped); `password_file`: the store's password, passed
        for its three URLs as the unit passes its credential."""
        self.port = free_port()
        self.url = f"http://127.0.0.1:{self.port}"
        rules = rule_files_for_vmalert(tmp)
        # The test's Alertmanager asks for no password (tests/support/procs.Alertmanager).
        flags = shipped_flags(
            "clusterpulse-vmalert.default", rule=None, **{
                "datasource.url": store_url, "remoteWrite.url": store_url,
                "remoteRead.url": store_url, "notifier.url": alertmanager_url,
                "notifier.basicAuth.username": None,
                "httpListenAddr": f"127.0.0.1:{self.port}", **(extra or {})})
        if password_file is not None:  # clusterpulse-vmalert.service's ExecStart
            flags += [f"-{url}.basicAuth.passwordFile={password_file}"
                      for url in ("datasource", "remoteWrite", "remoteRead")]
        self.proc = Proc([binary("vmalert"), *flags, *[f"-rule={p}" for p in rules],
                          "-loggerLevel=WARN"], tmp / f"vmalert-{self.port}.log")
        wait_until(lambda: _http().get(self.url + "/health", timeout=2).ok, 60,
                   "vmalert ready")

    def alerts(self) -> list[dict]:
        r = _http().get(self.url + "/api/v1/alerts", timeout=30)
        r.raise_for_status()
        return r.json()["data"]["alerts"] or []

    def groups(self) -> list[dict]:
        """The rule groups and their rules' state (each rule's lastEvaluation: when its
        last evaluation started). vmalert 1.79 answers this at /api/v1/rules."""
        r = _http().get(self.url + "/api/v1/rules", timeout=30)
        r.raise_for_status()
        return r.json()["data"]["groups"]

    def stop(self) -> None:
        self.proc.stop()


def write_targets(targets_dir: Path, addresses: list[str]) -> None:
    """The agents as file_sd lists them (what an inventory writes into
    /etc/clusterpulse/targets/)."""
    targets_dir.mkdir(parents=True, exist_ok=True)
    lines = ["- targets:"] + [f"    - '{a}'" for a in addresses]
    (targets_dir / "agents.yml").write_text("\n".join(lines) + "\n")
