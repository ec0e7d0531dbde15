"""deploy/victoriametrics, the path past one machine: every shipped flag is one the
installed binaries accept, the scrape config loads on every shard, vmalert loads the
shipped rules, the units verify and rate <= 4.0 in `systemd-analyze security`.
What the processes do together is tests/integration/test_sharded_scrape.py."""

from __future__ import annotations

import os
import re
import shutil
import subprocess
from pathlib import Path

import pytest
import yaml

from tests.support.procs import REPO, RULE_FILES
from tests.support.victoria import (
    DEPLOY,
    KEEP_FIRING_FOR_SINCE,
    STORE_KEYS,
    STORE_SCRAPE_CONFIG,
    STORE_USER,
    VMAGENT_CONFIG,
    binary,
    default_value,
    rule_files_for_vmalert,
    shipped_flags,
    version,
)

ANALYZE = shutil.which("systemd-analyze")
UNITS = sorted(DEPLOY.glob("*.service"))


def _run(args: list[str], env: dict[str, str] | None = None) -> subprocess.CompletedProcess:
    return subprocess.run(args, capture_output=True, text=True, timeout=60,
                          env={**os.environ, **(env or {})})


def test_every_shard_loads_the_scrape_config_with_the_shipped_flags(tmp_path: Path):
    shards = int(default_value("clusterpulse-vmagent.default", "CLUSTERPULSE_SHARDS"))
    assert shards >= 2
    for shard in range(shards):
        env = {"CLUSTERPULSE_SHARDS": str(shards), "CLUSTERPULSE_SHARD": str(shard)}
        flags = shipped_flags("clusterpulse-vmagent.default",
                              **{"promscrape.config": str(VMAGENT_CONFIG)})
        r = _run([binary("vmagent"), *flags, "-promscrape.config.dryRun"], env)
        assert r.returncode == 0, r.stdout + r.stderr


def test_scrape_config_shards_every_job_by_address():
    """Each job keeps only its shard's targets, hashed from the address alone (one agent
    per address: a node's series never split across shards)."""
    text = VMAGENT_CONFIG.read_text()
    jobs = re.findall(r"^  - job_name: (\S+)", text, re.M)
    assert jobs == ["clusterpulse", "rank-progress"]  # a node's progress on its shard too
    assert text.count("source_labels: [__address__]") == len(jobs)
    assert text.count("modulus: %{CLUSTERPULSE_SHARDS}") == len(jobs)
    assert text.count("regex: '%{CLUSTERPULSE_SHARD}'") == len(jobs)
    assert "scrape_interval: 5s" in text  # the recommended interval (docs/scaling.md)


def _targets(config: Path) -> list[str]:
    cfg = yaml.safe_load(config.read_text().replace("%{", "{"))
    return [t for job in cfg["scrape_configs"] for sc in job.get("static_configs", [])
            for t in sc["targets"]]


LOOPBACK = re.compile(r"(127\.|localhost[:/]|\[::1\])")


def test_no_shared_scrape_target_is_on_loopback_and_the_store_scrapes_its_own(
        tmp_path: Path):
    """Every shard loads vmagent.yml on its own host: a loopback target there is
    scraped by whichever shard it hashes to, from that shard's loopback (the remediation
    receiver's head was read only if the dashboard ran on shard 0's host). The receiver
    is the store's own target (store-scrape.yml, victoria-metrics.default's
    -promscrape.config), on the store's host as Alertmanager's webhook has it."""
    assert [t for t in _targets(VMAGENT_CONFIG) if LOOPBACK.match(t)] == []
    assert "static_configs" not in VMAGENT_CONFIG.read_text()  # no fixed host at all
    assert _targets(STORE_SCRAPE_CONFIG) == ["127.0.0.1:19495"]
    assert "-promscrape.config=/etc/victoria-metrics/scrape.yml" in \
        shipped_flags("victoria-metrics.default")
    flags = shipped_flags("victoria-metrics.default", storageDataPath=str(tmp_path / "vm"),
                          **{"promscrape.config": str(STORE_SCRAPE_CONFIG)})
    r = _run([binary("victoria-metrics"), *flags, "-promscrape.config.dryRun"])
    assert r.returncode == 0, r.stdout + r.stderr


def test_shards_reread_the_targets_as_often_as_their_config_says():
    """vmagent.yml promises a new node is scraped within N s; vmagent's own default is
    5 minutes. The binary takes the flag: the dry runs above pass the shipped flags."""
    said = re.search(r"re-reads the files every (\d+) s", VMAGENT_CONFIG.read_text())
    flags = [a for a in shipped_flags("clusterpulse-vmagent.default")
             if a.startswith("-promscrape.fileSDCheckInterval=")]
    assert said and flags == [f"-promscrape.fileSDCheckInterval={said.group(1)}s"], flags


def _flags(default_file: str) -> dict[str, str]:
    return dict(a.lstrip("-").split("=", 1) if "=" in a else (a.lstrip("-"), "")
                for a in shipped_flags(default_file))


def test_the_store_asks_for_credentials_and_the_shards_listen_on_loopback():
    """The store listens on the network: every request but /health and /metrics needs
    the user and its password, a delete also -deleteAuthKey, both secrets from the
    environment of the installed file (-envflag.enable), none in the shipped one. A
    shard takes writes on its port and forwards them with its credentials: loopback
    only. What the store refuses, live: tests/integration/test_sharded_scrape.py."""
    store = _flags("victoria-metrics.default")
    assert store["httpAuth.username"] == STORE_USER and "envflag.enable" in store
    assert "httpAuth.password" not in store and "deleteAuthKey" not in store
    shipped = (DEPLOY / "victoria-metrics.default").read_text()
    assert re.findall(r"^(?!#)\s*(httpAuth_password|deleteAuthKey)=", shipped, re.M) == []
    shard = _flags("clusterpulse-vmagent.default")
    assert LOOPBACK.match(shard["httpListenAddr"]), shard["httpListenAddr"]
    assert shard["remoteWrite.basicAuth.username"] == STORE_USER
    vmalert = _flags("clusterpulse-vmalert.default")
    for url in ("datasource", "remoteWrite", "remoteRead"):
        assert vmalert[f"{url}.basicAuth.username"] == STORE_USER
    # The units hand each of them the store's password file as a credential.
    credential = ("LoadCredential=victoria-metrics-password:"
                  "/etc/clusterpulse/victoria-metrics-password")
    for unit, urls in (("clusterpulse-vmagent@.service", ["remoteWrite"]),
                       ("clusterpulse-vmalert.service",
                        ["datasource", "remoteWrite", "remoteRead"])):
        text = (DEPLOY / unit).read_text()
        assert credential in text, unit
        for url in urls:
            assert f"-{url}.basicAuth.passwordFile=%d/victoria-metrics-password" in text, \
                (unit, url)


def test_the_store_gets_every_key_from_a_root_only_file_through_the_drop_in():
    """docs/scaling.md's store block makes the secrets file that the shipped drop-in
    loads: the password and a key for each thing the password alone must not do (1.79
    served /flags and /debug/pprof/* to anyone, and the password alone took snapshots,
    deleted them and force-merged). Every name is a flag of the installed
    victoria-metrics, the same the live test gives the store (STORE_KEYS), and none is
    in Debian's conffile /etc/default/victoria-metrics, which the block replaces."""
    section = (REPO / "docs/scaling.md").read_text().split(
        "### Installing it with systemd\n")[1].split("\n### ", 1)[0]
    (line,) = [x for x in re.findall(r"```bash\n(.*?)```", section, re.S)
               for x in x.splitlines() if "victoria-metrics-secrets)" in x]
    names = re.findall(r"(?:'|\\n)(\w+)=%s", line)
    assert names == ["httpAuth_password", *STORE_KEYS], names
    assert "umask 077" in line and "[ -s /etc/clusterpulse/victoria-metrics-secrets ]" in line
    dropin = (DEPLOY / "victoria-metrics-secrets.conf").read_text()
    assert re.findall(r"^EnvironmentFile=(.*)$", dropin, re.M) == [
        "/etc/clusterpulse/victoria-metrics-secrets"]
    assert ("victoria-metrics-secrets.conf /etc/systemd/system/victoria-metrics.service.d/"
            in section)
    r = _run([binary("victoria-metrics"), "-help"])
    help_text = r.stdout + r.stderr
    for name in names:
        assert re.search(rf"^  -{name.replace('_', '.')} ", help_text, re.M), name
    shipped = (DEPLOY / "victoria-metrics.default").read_text()
    assert re.findall(r"^(?!#)\s*\w+(?:password|AuthKey)=", shipped, re.M | re.I) == []
    assert "/etc/default/victoria-metrics" not in line


def test_vmalert_loads_the_rules_clusterpulse_config_writes_at_the_shipped_flags_path(
        tmp_path: Path):
    """The shipped flags read vmalert's copy of the rules (victoriametrics/rules/, made by
    `clusterpulse-config write` from the Prometheus rules), and the installed vmalert
    loads it as written. Before, they read prometheus/*.rules.yml, which vmalert 1.79
    refuses (keep_firing_for: fatal, no alert goes out) until a manual sed that the next
    `write --force` undid; and they counted with MetricsQL's increase()."""
    (rule_glob,) = [a.split("=", 1)[1] for a in shipped_flags("clusterpulse-vmalert.default")
                    if a.startswith("-rule=")]
    assert rule_glob == "/etc/clusterpulse/victoriametrics/rules/*.rules.yml"
    rules = rule_files_for_vmalert(tmp_path)  # clusterpulse-config write --only victoriametrics
    assert [p.parent for p in rules] == [tmp_path / "config/victoriametrics/rules"] * 2
    flags = shipped_flags("clusterpulse-vmalert.default",
                          rule=str(tmp_path / "config/victoriametrics/rules/*.rules.yml"))
    r = _run([binary("vmalert"), *flags, "-dryRun"])
    assert r.returncode == 0 and "fatal" not in r.stdout + r.stderr, r.stdout + r.stderr
    # The same rules as Prometheus', and only the two changes: every increase( is
    # increase_prometheus(, every keep_firing_for left out.
    for source, copy in zip(sorted(RULE_FILES), rules, strict=True):
        src, out = yaml.safe_load(source.read_text()), yaml.safe_load(copy.read_text())
        src_rules = [r for g in src["groups"] for r in g["rules"]]
        out_rules = [r for g in out["groups"] for r in g["rules"]]
        assert len(src_rules) == len(out_rules)
        for s, o in zip(src_rules, out_rules, strict=True):
            s.pop("keep_firing_for", None)
            s["expr"] = re.sub(r"(?<![\w:])increase\(", "increase_prometheus(", s["expr"])
            assert s == o
        assert "increase(" not in "".join(r["expr"] for r in out_rules)
    if version("vmalert") < KEEP_FIRING_FOR_SINCE:
        assert "keep_firing_for" in "".join(p.read_text() for p in RULE_FILES)


def test_victoria_metrics_accepts_the_shipped_flags(tmp_path: Path):
    # -version exits after the flags are parsed: an unknown flag or value fails first.
    flags = shipped_flags("victoria-metrics.default", storageDataPath=str(tmp_path / "vm"))
    r = _run([binary("victoria-metrics"), *flags, "-version"])
    assert r.returncode == 0, r.stdout + r.stderr


@pytest.mark.skipif(ANALYZE is None,
                    reason="systemd-analyze is missing (scripts/setup.sh installs systemd)")
def test_units_verify_and_rate_at_most_4(tmp_path: Path):
    assert [u.name for u in UNITS] == ["clusterpulse-vmagent@.service",
                                       "clusterpulse-vmalert.service"]
    for unit in UNITS:  # a template is verified as one of its instances
        (tmp_path / unit.name.replace("@.", "@0.")).write_text(unit.read_text())
    units = sorted(map(str, tmp_path.glob("*.service")))
    out = subprocess.run([ANALYZE, "verify", "--man=no", "--generators=no", *units],
                         capture_output=True, text=True, timeout=120)
    assert out.returncode == 0 and not (out.stdout + out.stderr).strip(), \
        out.stdout + out.stderr
    for unit in units:
        out = subprocess.run([ANALYZE, "security", "--offline=yes", "--threshold=40", unit],
                             capture_output=True, text=True, timeout=120)
        level = re.search(r"Overall exposure level for \S+: (\d+\.\d)", out.stdout)
        assert level and float(level.group(1)) <= 4.0 and out.returncode == 0, out.stdout
